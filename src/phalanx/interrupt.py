"""A cooperative stop: a flag plus a reason (burn's interrupter), and the signal handlers
that set it. Training checks the flag at step boundaries and saves a checkpoint. A stop asked
for in code (``learner.stop()``) then returns with ``Training interrupted: <reason>``; a
signal is not success: after the checkpoint, Ctrl-C (SIGINT) raises ``KeyboardInterrupt``
itself, as Python's Ctrl-C does (exactly that class: uncaught, Python then ends the process by
SIGINT, which a shell reports as 130; it does not for a subclass), and SIGTERM (preemption)
raises :class:`FitTerminated` (a ``SystemExit`` with code 143 = 128 + SIGTERM, what a shell
and a batch system read as "ended by SIGTERM"). SIGUSR1, the warning a batch system sends
before a time limit or a preemption (Slurm's ``--signal=USR1@120``), raises
:class:`FitPreempted` (a ``SystemExit`` with code 75, ``EX_TEMPFAIL``: a batch script
requeues the job on it, and the requeued job resumes). All carry the ``FitResult`` as
``.result``. A second Ctrl-C stops at once."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

EXIT_SIGTERM = 128 + signal.SIGTERM  # 143: the exit status of a process ended by SIGTERM
EXIT_REQUEUE = 75  # EX_TEMPFAIL: stopped and saved before a time limit; requeue the job
# A batch system's warning that the job's time is nearly up or that it is being preempted
# (Slurm: #SBATCH --signal=USR1@120). Workers ignore it: the caller's process acts on it.
WARNING_SIGNAL = signal.SIGUSR1


class FitTerminated(SystemExit):
    """SIGTERM ended ``fit`` after its checkpoint was written: exits with code 143 unless
    caught; ``result`` is what it had. Resume with ``fit(..., resume=True)``."""

    def __init__(self, result: Any) -> None:
        super().__init__(EXIT_SIGTERM)
        self.result = result


class FitPreempted(SystemExit):
    """The batch system's warning (SIGUSR1) ended ``fit`` after its checkpoint was written:
    exits with code 75 unless caught, which a batch script reads as "requeue me" (see
    docs/multinode.md); ``result`` is what it had. A requeued Slurm job resumes by itself."""

    def __init__(self, result: Any) -> None:
        super().__init__(EXIT_REQUEUE)
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
        ``KeyboardInterrupt`` (with ``.result``), SIGTERM :class:`FitTerminated`, SIGUSR1
        :class:`FitPreempted`. A stop
        asked for in code, or a run that finished before it saw the signal, returns."""
        if not result.interrupted or self.signum is None:
            return
        if self.signum == signal.SIGINT:
            stopped = KeyboardInterrupt(result.interrupted)
            stopped.result = result  # type: ignore[attr-defined]
            raise stopped
        if self.signum == WARNING_SIGNAL:
            raise FitPreempted(result)
        raise FitTerminated(result)


@contextmanager
def handle_signals(interrupter: Interrupter) -> Iterator[None]:
    """While inside, SIGINT, SIGTERM and SIGUSR1 ask ``interrupter`` to stop; a second SIGINT raises
    KeyboardInterrupt at once. Does nothing outside the main thread (signals only reach it)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_signal(signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if signum == signal.SIGINT and interrupter.should_stop():
            raise KeyboardInterrupt
        why = (
            " (the batch system's warning: a time limit or preemption)"
            if signum == WARNING_SIGNAL
            else ""
        )
        interrupter.stop(f"received {name}{why}", signum)

    handled = (signal.SIGINT, signal.SIGTERM, WARNING_SIGNAL)
    previous = {s: signal.signal(s, on_signal) for s in handled}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
