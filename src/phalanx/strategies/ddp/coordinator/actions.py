"""What the coordinator asks the mechanism to do (:mod:`.coordinator` returns these)."""

from __future__ import annotations

from dataclasses import dataclass

from phalanx.events import Event
from phalanx.failures import WorkerFailure
from phalanx.strategies.ddp.wire.protocol import Announcement


@dataclass(frozen=True)
class Announce:
    """Write the generation to the store (then move the counters)."""

    announcement: Announcement


@dataclass(frozen=True)
class Spawn:
    """Start a worker process on ``slot``: a replacement when it ``replaces`` a fallen one
    (it joins a running generation), a restart from the checkpoint when ``restart_after``
    is set (it resumes from run_dir and takes part only in generations after that one).
    It fires only the faults meant for steps after ``faults_after``."""

    slot: int
    replaces: WorkerFailure | None = None
    faults_after: int = -1
    restart_after: int | None = None


@dataclass(frozen=True)
class Kill:
    slot: int


@dataclass(frozen=True)
class DumpStacks:
    """Take the Python stacks of these slots' processes (answered by StacksTaken)."""

    slots: list[int]


@dataclass(frozen=True)
class Record:
    """A failure and the action taken for it, decided: for the report and the sinks."""

    failure: WorkerFailure


@dataclass(frozen=True)
class Emit:
    event: Event


@dataclass(frozen=True)
class SetStop:
    """Workers stop after the current step (and checkpoint)."""

    reason: str


@dataclass(frozen=True)
class SetAbort:
    """Workers exit at once: the run is decided."""

    reason: str


Action = Announce | Spawn | Kill | DumpStacks | Record | Emit | SetStop | SetAbort
