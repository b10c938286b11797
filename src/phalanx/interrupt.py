"""A cooperative stop: a flag plus a reason (burn's interrupter), and the signal handlers
that set it. Training checks the flag at step boundaries and saves a checkpoint. A stop asked
for in code (``learner.stop()``) then returns with ``Training interrupted: <reason>``; a
signal is not success: after the checkpoint, Ctrl-C (SIGINT) raises ``KeyboardInterrupt``
itself, as Python's Ctrl-C does (exactly that class: uncaught, Python then ends the process by
SIGINT, which a shell reports as 130; it does not for a subclass), and SIGTERM (preemption)
raises :class:`FitTerminated` (a ``SystemExit`` with code 143 = 128 + SIGTERM, what a shell
and a batch system read as "ended by SIGTERM", so the job can be requeued). Both carry the
``FitResult`` as ``.result``. A second Ctrl-C stops at once."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

EXIT_SIGTERM = 128 + signal.SIGTERM  # 143: the exit status of a process ended by SIGTERM


class FitTerminated(SystemExit):
    """SIGTERM ended ``fit`` after its checkpoint was written: exits with code 143 unless
    caught; ``result`` is what it had. Resume with ``fit(..., resume=True)``."""

    def __init__(self, result: Any) -> None:
        super().__init__(EXIT_SIGTERM)
        self.result = result


class Interrupter:
    def __init__(self) -> None:
        self._event = threading.Event()
        self._reason: str | None = None
        self.signum: int | None = None  # the signal that asked first, if one did

    def stop(self, reason: str = "stop requested", signum: int | None = None) -> None:
        if not self._event.is_set():
            self._reason, self.signum = reason, signum
        self._event.set()

    def should_stop(self) -> bool:
        return self._event.is_set()

    @property
    def reason(self) -> str | None:
        return self._reason

    def reset(self) -> None:
        self._event.clear()
        self._reason = None
        self.signum = None

    def raise_if_signalled(self, result: Any) -> None:
        """After a run a signal stopped (checkpoint written, sinks closed): SIGINT raises
        ``KeyboardInterrupt`` (with ``.result``), SIGTERM :class:`FitTerminated`. A stop
        asked for in code, or a run that finished before it saw the signal, returns."""
        if not result.interrupted or self.signum is None:
            return
        if self.signum == signal.SIGINT:
            stopped = KeyboardInterrupt(result.interrupted)
            stopped.result = result  # type: ignore[attr-defined]
            raise stopped
        raise FitTerminated(result)


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
        interrupter.stop(f"received {name}", signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
