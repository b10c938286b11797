"""What workers tell the supervisor (each over its own pipe, through an :class:`Outbox`) and
the store keys the supervisor uses to talk back. Every message is a small picklable
dataclass, except the heartbeat, which is a :class:`Heartbeat` in shared memory (no pipe
write per phase)."""

from __future__ import annotations

import contextlib
import json
import operator
import os
import pickle
import signal
import time
from dataclasses import dataclass, field, fields
from datetime import timedelta
from typing import Any

from phalanx.events import Event, StepEnded
from phalanx.failures import PHASES, WorkerFailure
from phalanx.strategies.ddp.timing import DEFAULT

# The signal the agent sends a worker for its Python stacks (faulthandler). A real-time
# signal: a batch system's SIGUSR1/SIGUSR2 warnings (Slurm's --signal) may reach every process
# of the job, and a worker must not take one for a request (it ignores them).
STACK_SIGNAL: int = signal.SIGRTMIN + 3

EXIT_TOLD = 3  # a worker's exit code when it exited because the supervisor said so
EXIT_HEAD_LOST = 4  # a node's worker, after the head was lost: it saved what it committed
ORDER_SAVE = 1  # a node agent's order in a worker's heartbeat: the head is lost, save and exit
STOP_KEY = "control/stop"  # value: the reason; workers stop after the current step
ABORT_KEY = "control/abort"  # value: why; workers exit at once
GEN_LATEST = "gen/latest"  # counter: the newest generation announced
CONTROL_KEY = "control/version"  # counter: bumped after each write of the keys above, so a
# worker's watch thread reads one key per tick and the others only when it moved
GEN_PREFIX = "gen/"  # gen/<n>: an :class:`Announcement` as JSON
ARRIVED_PREFIX = "arrived/"  # arrived/g<n>/<rank>: a member reached generation n's barrier
# Every value the workers act on (gen/<n>, stop, abort, arrived/...) is signed with the run's
# token (:mod:`.control`); the two counters are hints of when to look again, never trusted.


@dataclass
class Generation:
    """Who trains together: ``members`` are worker slots (device indices) in rank order;
    ``failed``: global step -> attempts of it that already failed, so the members go on
    counting attempts there; ``known``: those attempts' failures (the evidence a repeat is
    judged by, see :func:`phalanx.policy.repeats`)."""

    number: int
    members: list[int]
    cause: str = ""
    failed: dict[int, int] = field(default_factory=dict)
    known: list[WorkerFailure] = field(default_factory=list)
    timeline: int = -1  # the latest restart's generation (see Announcement)
    rebuild: bool = False  # the same members as the generation before, in a new group

    def rank_of(self, slot: int) -> int:
        return self.members.index(slot)


# The fields of a failure that travel in an announcement (what a repeat is judged by).
_EVIDENCE = (
    "worker",
    "rank",
    "device",
    "kind",
    "message",
    "phase",
    "step",
    "attempt",
    "exception_type",
    "sample_indices",
    "action",
)


@dataclass(frozen=True)
class Announcement:
    """Generation ``number`` as the supervisor writes it to ``gen/<n>``: the members in rank
    order, why it was formed, ``rebuild`` (the same members form a new group because the
    old one broke), ``replacing`` (the slot whose replacement process was started, joining
    later), the failed attempts of unfinished steps with their failures, and ``timeline``:
    the generation of the latest restart (every member fell; -1: none), from which the
    committed steps after the restored state were computed again (a snapshot written before
    it may hold a step computed another way, within float tolerance)."""

    number: int
    members: tuple[int, ...]
    cause: str = ""
    rebuild: bool = False
    replacing: int | None = None
    failed: tuple[tuple[int, int], ...] = ()
    known: tuple[WorkerFailure, ...] = ()
    timeline: int = -1

    def to_json(self) -> str:
        return json.dumps(
            {
                "members": list(self.members),
                "cause": self.cause,
                "rebuild": self.rebuild,
                "replacing": self.replacing,
                "failed": {str(k): v for k, v in self.failed},
                "known": [{k: getattr(f, k) for k in _EVIDENCE} for f in self.known],
                "timeline": self.timeline,
            }
        )

    @classmethod
    def from_json(cls, number: int, text: str | bytes) -> Announcement:
        doc = json.loads(text)
        return cls(
            number=number,
            members=tuple(doc["members"]),
            cause=doc.get("cause", ""),
            rebuild=bool(doc.get("rebuild")),
            replacing=doc.get("replacing"),
            failed=tuple((int(k), int(v)) for k, v in doc.get("failed", {}).items()),
            known=tuple(WorkerFailure(**f) for f in doc.get("known", [])),
            timeline=int(doc.get("timeline", -1)),
        )

    def generation(self) -> Generation:
        return Generation(
            self.number,
            list(self.members),
            self.cause,
            dict(self.failed),
            list(self.known),
            self.timeline,
            self.rebuild,
        )


@dataclass
class Relay:
    """An event from rank 0, for the supervisor's sinks."""

    event: Event


# A step's event rings the supervisor's bell after this many unrung events, or
# ``Timing.ring_after`` (50 ms) after the last ring: at most ~20 wake-ups a second for step
# events, and never more than ~10 kB of them in the pipe (a worker never blocks on a full
# pipe the supervisor ignores).
RING_COUNT = 32
# What a ring says: a message to act on (``URGENT``), or step events only (``LATER``).
URGENT, LATER = b"!", b"."


class Outbox:
    """A worker's end of its channel to the supervisor: a pipe for the messages and a bell.

    Every message is written to the pipe before :meth:`send` returns (a worker killed a
    moment later has still said it), in order. The supervisor sleeps on the bell, not on the
    pipe, and reads every pipe whenever it wakes: a message it acts on (a failure, ready,
    done, any event but a step's) rings the bell at once; a committed step's
    :class:`StepEnded` rings it only every :data:`RING_COUNT` events or ``ring_after``
    (:attr:`.timing.Timing.ring_after`), so at 4 ms steps the supervisor does not wake 250
    times a second to compete for the cores with the workers it watches. Such an event is
    read at the supervisor's next wake-up: about ``ring_after`` after it while steps go on,
    within the supervisor's poll interval (0.1 s) when they stop; it carries the time it was
    stamped with in the worker.
    ``bell`` None: every message wakes the supervisor (it sleeps on the pipe itself)."""

    def __init__(
        self, pipe: Any, bell: Any = None, ring_after: timedelta = DEFAULT.ring_after
    ) -> None:
        self.pipe, self.bell = pipe, bell  # write ends (multiprocessing Connections)
        self.ring_after = ring_after.total_seconds()
        self._fresh()

    def __getstate__(self) -> dict[str, Any]:
        return {"pipe": self.pipe, "bell": self.bell, "ring_after": self.ring_after}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.pipe, self.bell = state["pipe"], state["bell"]
        self.ring_after = state["ring_after"]
        self._fresh()

    def _fresh(self) -> None:
        self.unrung = 0  # step events written since the last ring
        self.rung_at = 0.0  # monotonic time of the last ring
        if self.bell is not None:  # a ring never blocks (a full bell is ringing anyway)
            os.set_blocking(self.bell.fileno(), False)

    def send(self, message: object) -> None:
        event = message.event if isinstance(message, Relay) else None
        stepped = isinstance(event, StepEnded)
        if stepped:  # (its fields as a tuple: a tenth of a dataclass's pickle, see received)
            values = _step_values(event)
            self.pipe.send_bytes(pickle.dumps(values, pickle.HIGHEST_PROTOCOL))
        else:
            self.pipe.send(message)
        if self.bell is None:
            return
        now = time.monotonic()
        ring = URGENT
        if stepped:
            self.unrung, ring = self.unrung + 1, LATER
            if self.unrung < RING_COUNT and now - self.rung_at < self.ring_after:
                return
        self.unrung, self.rung_at = 0, now
        # (full of rings the supervisor has not read yet: it is ringing already)
        with contextlib.suppress(BlockingIOError):
            os.write(self.bell.fileno(), ring)

    def close(self) -> None:
        self.pipe.close()
        if self.bell is not None:
            self.bell.close()


# A committed step's event crosses the pipe as the tuple of its fields (in this order):
# every message but this one is a dataclass.
_STEP_FIELDS = tuple(f.name for f in fields(StepEnded))
_step_values = operator.attrgetter(*_STEP_FIELDS)


def received(message: object) -> object:
    """A message as read from a worker's pipe, as the worker sent it (see :class:`Outbox`)."""
    if isinstance(message, tuple):
        return Relay(StepEnded(**dict(zip(_STEP_FIELDS, message, strict=True))))
    return message


@dataclass
class Progress:
    """A worker entered ``phase`` of ``step`` (its heartbeat, and what a hang report names);
    ``attempt``: which attempt of the step (see :attr:`WorkerFailure.attempt`)."""

    slot: int
    step: int
    phase: str
    time: float
    attempt: int = 0


# Every phase a heartbeat can name, by its index in shared memory.
HEARTBEAT_PHASES = ("start", *PHASES, "regroup", "joining")
_PHASE_CODE = {name: code for code, name in enumerate(HEARTBEAT_PHASES)}


class Heartbeat:
    """A worker's heartbeat as 64-bit integers in memory it shares with the supervisor:
    a counter, and (step, attempt, phase) packed into one integer; a third the other way, an
    order from its node's agent (:data:`ORDER_SAVE`, read by the worker's watch thread: it
    needs neither the store nor the head). The worker writes the
    packed value, then bumps the counter (each is one aligned 8-byte store: never torn); the
    supervisor reads the counter, then the value, and sees a :class:`Progress` whenever the
    counter moved (the value it reads is the latest, at least as new as that count). Like
    a pipe write, a store is there when ``beat`` returns: a worker killed a moment later has
    still told its phase. Only the latest beat is seen; the supervisor reads it after the
    pipe's messages and before handling them, and after a process's exit."""

    def __init__(self, shared: Any) -> None:
        self.shared = shared  # a RawArray("q", 3) of a multiprocessing context
        self.count = 0

    @classmethod
    def create(cls, ctx: Any) -> Heartbeat:
        return cls(ctx.RawArray("q", 3))

    def __getstate__(self) -> dict[str, Any]:
        return {"shared": self.shared}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.shared, self.count = state["shared"], 0

    def beat(self, step: int, phase: str, attempt: int) -> None:
        """The worker: it entered ``phase`` of ``step`` (its ``attempt``-th attempt)."""
        self.shared[1] = (step << 16) | (min(attempt, 255) << 8) | _PHASE_CODE[phase]
        self.count += 1
        self.shared[0] = self.count

    def tell(self, order: int) -> None:
        """The agent: an order for the worker (see :meth:`told`)."""
        self.shared[2] = order

    def told(self) -> int:
        """The worker: the agent's order (0: none)."""
        return int(self.shared[2])

    def read(self, slot: int, now: float) -> Progress | None:
        """The supervisor: the latest beat, when there was one since the last read."""
        count = self.shared[0]
        if count == self.count:
            return None
        self.count = count
        packed = self.shared[1]
        return Progress(
            slot, packed >> 16, HEARTBEAT_PHASES[packed & 0xFF], now, (packed >> 8) & 0xFF
        )


@dataclass
class Failed:
    """A failure seen by a worker. ``fatal``: the worker is exiting (no vote can absorb it)."""

    failure: WorkerFailure
    fatal: bool


@dataclass
class Broke:
    """This worker's own failure in a step, when the step's collectives broke before a vote
    could carry it: either a peer fell in the same step, or this failure itself left the
    group unusable (an error in the middle of backward, after DDP began reducing). The
    supervisor decides: record it, rebuild the group with the same members, or stop the
    run (the step had failed before: a poison batch)."""

    failure: WorkerFailure
    generation: int
    splittable: bool = False  # out of memory, and the share is cut smaller: a split


@dataclass
class Aborted:
    """The step policy stopped the run at ``step`` (every rank sends one)."""

    slot: int
    step: int
    poison: bool


@dataclass
class Done:
    """A worker finished. The main one adds where the final weights are and the results."""

    slot: int
    weights_path: str | None = None
    history: list[dict[str, Any]] = field(default_factory=list)
    steps: int = 0
    epochs: int = 0
    interrupted: str | None = None
    ledger: list[list[float]] = field(default_factory=list)
    quarantine: list[list[int]] = field(default_factory=list)  # [index, global step] rows
    # fsdp's gather=False: the final sharded checkpoint that holds the weights (no weights_path)
    model_path: str | None = None


@dataclass
class Saved:
    """The head was lost: what this worker kept of the run. ``path`` is the checkpoint that
    holds ``step`` (``wrote``: this worker wrote it; else a peer's on the shared run_dir
    already held that step or a newer one); None with ``note`` saying why there is none.
    ``kept_files``: under fsdp, the worker kept its machine's shard snapshots of earlier
    steps as files of sharded checkpoints (``note`` names the steps)."""

    slot: int
    step: int
    path: str | None = None
    wrote: bool = False
    note: str = ""
    kept_files: bool = False


@dataclass
class Ready:
    """A worker passed its preflight and built its model: it waits for the first generation
    (or, a replacement, to be let in)."""

    slot: int


@dataclass
class Joined:
    """A worker formed ``generation`` with its peers and holds the agreed state
    (``local``: it took that state from its machine's shared memory, not from a peer)."""

    slot: int
    generation: int
    step: int
    local: bool = False
    # fsdp: [generation, step] of the set of shard snapshots it started from (its folder
    # keeps only that one of its own then), or None
    restored: list[int] | None = None


@dataclass
class Snapshotted:
    """This worker wrote its machine's snapshot of committed step ``step`` into shared memory
    (``nbytes``; ``seconds`` it took): the state outlives the workers there."""

    slot: int
    step: int
    nbytes: int = 0
    seconds: float = 0.0
    generation: int = -1  # the writer's (fsdp: each member writes its own shards)
    failed: bool = False  # fsdp: this member's snapshots failed and stopped (no sets after)
    # fsdp across machines: a copy of the snapshot, whole on the machine of worker slot
    # ``held_by`` (failed: those copies stopped); -1: the writer's own snapshot
    held_by: int = -1


@dataclass
class Rejected:
    """A store value under ``key`` that is not a genuine control message of this run (why:
    ``reason``): the worker ignored it. ``digest`` names the value, so the supervisor warns
    once per rejected value however many workers read it."""

    slot: int
    key: str
    reason: str
    digest: str


# -- across machines: messages as data ---------------------------------------------------
# A worker's message crosses the node's link to the head as JSON (never pickled off the
# network): ``{"type": name, ...fields}``, with an event as its :func:`to_record` and a
# failure as its fields.
_WIRE_TYPES: dict[str, type] = {
    cls.__name__: cls
    for cls in (
        Relay,
        Progress,
        Failed,
        Broke,
        Aborted,
        Done,
        Ready,
        Joined,
        Rejected,
        Snapshotted,
    )
}


def to_wire(message: object) -> dict[str, Any]:
    """A worker's message as a JSON-friendly dict (see :func:`from_wire`)."""
    from phalanx.events import to_record

    name = type(message).__name__
    if name not in _WIRE_TYPES:
        raise TypeError(f"not a worker message: {name}")
    if isinstance(message, Relay):
        return {"type": name, "event": to_record(message.event)}
    doc: dict[str, Any] = {"type": name}
    for f in fields(message):  # type: ignore[arg-type]
        value = getattr(message, f.name)
        doc[f.name] = value.to_dict() if isinstance(value, WorkerFailure) else value
    return doc


def from_wire(doc: dict[str, Any]) -> object:
    """The message a :func:`to_wire` dict holds. Raises ValueError for anything else."""
    from phalanx.events import from_record

    cls = _WIRE_TYPES.get(str(doc.get("type")))
    if cls is None:
        raise ValueError(f"not a worker message: {doc.get('type')!r}")
    if cls is Relay:
        event = from_record(dict(doc.get("event") or {}))
        if event is None:
            raise ValueError("a relayed event of an unknown type")
        return Relay(event)
    known = {f.name for f in fields(WorkerFailure)}
    args: dict[str, Any] = {}
    for f in fields(cls):
        if f.name not in doc:
            continue
        value = doc[f.name]
        if f.name == "failure":
            value = WorkerFailure(**{k: v for k, v in dict(value).items() if k in known})
        args[f.name] = value
    try:
        return cls(**args)
    except TypeError as exc:
        raise ValueError(f"a malformed {cls.__name__}: {exc}") from None
