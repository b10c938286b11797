"""Typed events: the one stream the training loop writes and sinks read.

The loop never prints; it calls ``emit(event)``. In the ddp strategy, rank 0's events are
relayed to the supervisor, so sinks always run in the caller's process. Every event is a
small picklable dataclass; :func:`to_record` turns one into a JSON-friendly dict.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from phalanx.failures import WorkerFailure


@dataclass
class Event:
    time: float = field(default_factory=time.time, kw_only=True)


@dataclass
class RunOpened(Event):
    """The caller's process opened a run, before any worker starts (see
    :mod:`phalanx.runinfo`). ``run_id`` is new for a fresh run and kept by a resumed one;
    ``session`` counts the processes that trained it (1 for a fresh run)."""

    run_id: str
    run_dir: str
    session: int = 1
    resumed: bool = False


@dataclass
class RunStarted(Event):
    """Epochs and ``start_epoch`` are 0-based here (files keep the loop's indices); every
    line shown to people says ``epoch start_epoch + 1``."""

    run_dir: str
    strategy: str
    devices: list[str]
    epochs: int
    steps_per_epoch: int
    batch_size: int
    train_samples: int
    valid_samples: int
    start_epoch: int = 0
    start_step: int = 0  # step within start_epoch (non-zero after resume)


@dataclass
class EpochStarted(Event):
    epoch: int
    steps: int
    start_step: int = 0


@dataclass
class StepEnded(Event):
    """One committed optimizer step. ``metrics`` are running train means for the epoch."""

    epoch: int
    step: int  # step within the epoch, 0-based
    global_step: int  # committed steps since the run began, 1-based after this step
    steps_in_epoch: int
    loss: float
    lr: float
    samples: int  # samples in this global batch
    samples_per_s: float
    metrics: dict[str, float] = field(default_factory=dict)
    # "16-mixed": the gradients overflowed, so every member skipped the optimizer step (the
    # step still counts: its samples were used, the loss scale backed off)
    skipped: bool = False


@dataclass
class ValidationStarted(Event):
    epoch: int
    batches: int


@dataclass
class Validated(Event):
    """A validation in the middle of an epoch (``fit(val_every_steps=N)``), after committed
    step ``global_step``; ``metrics`` keys like ``valid/loss``. Epoch-end validation results
    come with :class:`EpochEnded`."""

    epoch: int
    step: int  # steps of the epoch done
    global_step: int
    metrics: dict[str, float]


@dataclass
class Balanced(Event):
    """After committed step ``global_step``, the members' shares of each global batch (rank
    order, summing to 1) from the next step on (``changed``), and ``paces``: each member's
    smoothed seconds per sample they were decided from. ``slow``: ranks named persistently
    slower than their peers (each once per generation; see :mod:`phalanx.balance`)."""

    global_step: int
    shares: list[float]
    paces: list[float]
    slow: list[int] = field(default_factory=list)
    changed: bool = True


@dataclass
class EpochEnded(Event):
    """Epoch results: keys like ``train/loss``, ``train/accuracy``, ``valid/loss``."""

    epoch: int
    metrics: dict[str, float]
    seconds: float


@dataclass
class CheckpointSaved(Event):
    path: str
    step: int
    epoch: int


@dataclass
class CheckpointDeleted(Event):
    path: str


@dataclass
class CheckpointSkipped(Event):
    """A checkpoint that could not be used for resume (truncated, bad checksum...)."""

    path: str
    reason: str


@dataclass
class Resumed(Event):
    path: str
    epoch: int
    step: int
    global_step: int


@dataclass
class Notice(Event):
    """A message for the user that is not a failure (e.g. early stopping triggered)."""

    text: str
    level: str = "info"


WORKER_STATES = ("starting", "preflight", "training", "joining", "fallen", "replaced", "finished")


@dataclass
class WorkerState(Event):
    """A worker's process changed state (one of :data:`WORKER_STATES`): ``starting`` (spawned,
    importing), ``preflight`` (its lone first step), ``training`` (a member of generation
    ``generation`` with rank ``rank``), ``joining`` (a replacement, or forming a new
    generation), ``fallen`` (died or hung), ``replaced`` (a fallen worker whose slot has a new
    process), ``finished``. ``worker`` is the slot (the device's index), stable for life."""

    worker: int
    device: str
    state: str
    rank: int | None = None
    generation: int | None = None
    pid: int | None = None
    detail: str = ""


@dataclass
class Beat:
    """One worker's latest heartbeat: ``phase`` of the step with 0-based global index
    ``step``, entered at ``since`` (wall clock); ``limit``: seconds without progress before it
    counts as hung (None while not watched: starting, joining)."""

    worker: int
    phase: str
    step: int
    since: float
    limit: float | None = None


@dataclass
class WorkersTick(Event):
    """Heartbeats of the live workers, a few times a second (ddp). Only live displays use
    it; the JSONL log leaves it out."""

    beats: list[Beat]


@dataclass
class GenerationStarted(Event):
    """Generation ``number`` announced: ``members`` (worker slots, in rank order) train
    together from here; ``cause`` says why (start, a fall, a rejoin, a rebuild)."""

    number: int
    members: list[int]
    devices: list[str]
    cause: str = ""


@dataclass
class WorkerFailed(Event):
    failure: WorkerFailure
    action: str  # retried, aborted, shrunk, respawned


@dataclass
class RunEnded(Event):
    history: list[dict[str, Any]]
    steps: int
    epochs: int
    interrupted: str | None  # as FitResult.interrupted: "Training interrupted: <reason>"
    seconds: float
    failed: bool = False


class Sink(Protocol):
    """Receives every event, in order, in the caller's process."""

    def handle(self, event: Event) -> None: ...

    def close(self) -> None: ...


Emit = Callable[[Event], None]


def to_record(event: Event) -> dict[str, Any]:
    """``{"event": "StepEnded", ...fields}``, JSON-friendly."""
    record: dict[str, Any] = {"event": type(event).__name__}
    record.update(dataclasses.asdict(event))
    return record


def _event_types() -> dict[str, type[Event]]:
    found: dict[str, type[Event]] = {}
    todo: list[type[Event]] = [Event]
    while todo:
        cls = todo.pop()
        found[cls.__name__] = cls
        todo += cls.__subclasses__()
    return found


def from_record(record: dict[str, Any]) -> Event | None:
    """The event a :func:`to_record` dict (or a line of ``events.jsonl``) holds; None for
    an unknown event name. Fields the class does not have (``run``) are left out; a
    ``WorkerFailed``'s failure and a tick's beats become their dataclasses again."""
    cls = _event_types().get(str(record.get("event")))
    if cls is None or cls is Event:
        return None
    names = {f.name for f in dataclasses.fields(cls)}
    fields = {k: v for k, v in record.items() if k in names}
    if cls is WorkerFailed:
        failure = dict(fields["failure"])
        known = {f.name for f in dataclasses.fields(WorkerFailure)}
        fields["failure"] = WorkerFailure(**{k: v for k, v in failure.items() if k in known})
    if cls is WorkersTick:
        fields["beats"] = [Beat(**b) for b in fields.get("beats", [])]
    return cls(**fields)


class Fanout:
    """Sends each event to every sink. A sink that raises is switched off and named once, in
    a warning :class:`Notice` to the remaining sinks (which sink, its exception), so a broken
    display never stops training. ``broken`` keeps each failed sink with its exception (also
    those whose ``close()`` raised, when there is nobody left to tell)."""

    def __init__(self, sinks: list[Sink]) -> None:
        self.sinks = list(sinks)
        self.broken: list[tuple[Sink, BaseException]] = []

    def __call__(self, event: Event) -> None:
        failed: list[tuple[Sink, Exception]] = []
        for sink in list(self.sinks):
            try:
                sink.handle(event)
            except Exception as exc:  # a sink must not kill training
                try:
                    self.sinks.remove(sink)
                except ValueError:  # another thread's event switched it off first
                    continue
                self.broken.append((sink, exc))
                failed.append((sink, exc))
        for sink, error in failed:  # after the event: every remaining sink has had it
            self(
                Notice(
                    f"sink {type(sink).__name__} raised {type(error).__name__}: {error} on a "
                    f"{type(event).__name__} event; it is switched off for the rest of the run",
                    level="warning",
                )
            )

    def close(self) -> None:
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as exc:
                self.broken.append((sink, exc))
