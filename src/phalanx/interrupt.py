"""A cooperative stop: a flag plus a reason (burn's interrupter), and the signal handlers
that set it. Training checks the flag at step boundaries, saves a checkpoint and returns
with ``Training interrupted: <reason>``. A second Ctrl-C stops at once."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType


class Interrupter:
    def __init__(self) -> None:
        self._event = threading.Event()
        self._reason: str | None = None

    def stop(self, reason: str = "stop requested") -> None:
        if not self._event.is_set():
            self._reason = reason
        self._event.set()

    def should_stop(self) -> bool:
        return self._event.is_set()

    @property
    def reason(self) -> str | None:
        return self._reason

    def reset(self) -> None:
        self._event.clear()
        self._reason = None


@contextmanager
def handle_signals(interrupter: Interrupter) -> Iterator[None]:
    """While inside, SIGINT and SIGTERM ask ``interrupter`` to stop; a second SIGINT raises
    KeyboardInterrupt at once. Does nothing outside the main thread (signals only reach it)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_signal(signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if signum == signal.SIGINT and interrupter.should_stop():
            raise KeyboardInterrupt
        interrupter.stop(f"received {name}")

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
