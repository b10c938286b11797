"""What the ddp coordinator knows and says: each slot's process, the generations announced,
the failure book, the worker panel, and the actions decided so far.

:class:`Roster` keeps that record and turns it into actions (spawn, kill, announce, emit);
:class:`~.coordinator.Coordinator` holds the rules that decide when. Each slot's status
moves in :meth:`Roster.move` only (the place to watch for a live view of the workers), and
each worker's last progress is :attr:`Slot.progress_at`, set only from its own messages.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

from phalanx.events import Event, GenerationStarted, Notice
from phalanx.failures import WorkerFailure
from phalanx.plan import Plan
from phalanx.policy import STEP_PHASES, Recovery
from phalanx.snapshot.copies import buddies
from phalanx.strategies.ddp.coordinator.actions import Action, Announce, Emit, Kill, Spawn
from phalanx.strategies.ddp.coordinator.book import FailureBook
from phalanx.strategies.ddp.coordinator.panel import Panel
from phalanx.strategies.ddp.timing import Timing
from phalanx.strategies.ddp.wire.protocol import Announcement, Joined, Progress


@dataclass(frozen=True)
class Now:
    mono: float  # seconds on a monotonic clock: every timeout
    wall: float  # seconds since the epoch: the time in failure records


class SlotStatus(Enum):
    STARTING = "starting"  # its process was started: preflight, model not built yet
    READY = "ready"  # waits for a generation: the first, a restart's, or to be let in
    MEMBER = "member"  # named in a generation (it may still be forming it)
    ENDED = "ended"  # its end is accounted for: finished, fallen, killed or dismissed


@dataclass
class Slot:
    """What the coordinator knows of the process that holds one slot (device) now."""

    status: SlotStatus = SlotStatus.STARTING
    step: int = 0
    phase: str = "start"
    progress_at: float = 0.0  # monotonic time of its own last progress
    generation: int = -1  # the newest generation it has joined
    attempt: int = 0  # of its step, from its last heartbeat
    pid: int | None = None
    replaces: WorkerFailure | None = None  # a replacement: the fall it answers
    joined_at: int | None = None  # a replacement: the step at which it joined
    joined_local: bool = False  # a replacement: it took the state from shared memory
    dropped: bool = False  # a replacement still starting when every member fell: killed
    order: Spawn | None = None  # how it was started (a preflight's retry starts the same)

    @property
    def ended(self) -> bool:
        return self.status is SlotStatus.ENDED

    def progress(self, message: Progress | Joined, now: float) -> None:
        """The worker's own progress: a phase entered, or a generation joined."""
        self.progress_at = now
        if isinstance(message, Joined):
            self.generation = message.generation
            if self.replaces is not None and self.joined_at is None:
                self.joined_at, self.joined_local = message.step, message.local
        else:
            self.step, self.phase, self.attempt = message.step, message.phase, message.attempt


@dataclass(frozen=True)
class Setup:
    """What the coordinator decides with: the run's plan, devices and policy."""

    plan: Plan
    devices: list[str]
    recovery: Recovery
    timing: Timing  # the run's durations (the coordinator reads hang, grace, startup, ...)
    run_dir: bool = False
    nodes: tuple[int, ...] = ()  # the node of each slot, across machines (empty: one node)
    # fsdp: each member holds only its shard of the state, so the survivors hold the state
    # only with a complete set of every member's shard snapshots (StateCopies.shard_set)
    sharded: bool = False

    def node_of(self, slot: int) -> int:
        return self.nodes[slot] if self.nodes else 0


Kept = tuple[int, int]  # a shard snapshot kept in a folder: (generation, step)


@dataclass
class StateCopies:
    """Where the run's committed state lives outside the members: the furthest step
    committed, each node's newest snapshot in shared memory, and a restart under way (every
    member fell: the step it fell at, to count the steps computed again).

    Under fsdp it follows what each member's folder keeps (``local``: the last two shard
    snapshots its slot wrote, on its node) and each copy folder (``copies``: per slot and
    node, the last two copies made whole there), as (generation, step), so that a set is
    counted only where one step of every member of a generation is kept."""

    committed: int = 0  # committed steps, from the main worker's step events
    snapshots: dict[int, int] = field(default_factory=dict)  # node -> step of its newest
    restart: Restart | None = None
    timeline: int = -1  # the generation of the latest restart (see Announcement)

    # fsdp: slot -> the shard snapshots its folder keeps (the last two written)
    local: dict[int, list[Kept]] = field(default_factory=dict)
    # fsdp across machines: (slot, node) -> the copies of its snapshots kept on that node
    copies: dict[tuple[int, int], list[Kept]] = field(default_factory=dict)
    starts: dict[int, int] = field(default_factory=dict)  # generation -> its first step
    shard_failed: bool = False  # a member's shard snapshots failed: no complete set after
    copied: int = 0  # copies made whole on another node (fsdp across machines)
    copy_seconds: float = 0.0  # their wall time, summed (beside the steps)
    taken: int = 0  # snapshots written, on every node
    seconds: float = 0.0  # their time, summed (the loop's share and the background copy)
    nbytes: int = 0  # the size of the last one
    gone: set[int] = field(default_factory=set)  # nodes lost (fsdp: their folders with them)
    no_set_in: int = -1  # fsdp: the last generation whose members found no complete set

    def snapshot(
        self, node: int, step: int, nbytes: int = 0, seconds: float = 0.0, writer: Any = None
    ) -> None:
        """A snapshot was written on ``node`` (fsdp: ``writer`` is ``(generation, slot)``:
        each member writes its own shards)."""
        self.snapshots[node] = max(step, self.snapshots.get(node, -1))
        if writer is not None:
            generation, slot = writer
            _keep(self.local.setdefault(slot, []), (generation, step))
        self.taken += 1
        self.seconds += seconds
        self.nbytes = nbytes or self.nbytes

    def joined(
        self,
        slot: int,
        generation: int,
        step: int,
        restored: Kept | None,
        writers: Sequence[int] = (),
        node_of: Callable[[int], int] = lambda _: 0,
    ) -> None:
        """``slot``'s member formed ``generation`` at committed ``step``; ``restored``: the
        set it started from, the only snapshot its folder then keeps (it forgot the rest).

        That set was whole: each of its ``writers`` (the members of its generation, in rank
        order) kept its snapshot of it, though the coordinator may not have heard of the
        newest ones (a member killed just after it wrote one, before its word left). Each
        one not heard of is counted now: in the writer's folder, or where its node is lost,
        in the copy on its buddy's node (the only one that takes its copies)."""
        self.starts.setdefault(generation, step)
        if restored is None:
            return
        if slot in self.local:
            self.local[slot] = [k for k in self.local[slot] if k == restored]
        buddy = buddies([str(node_of(w)) for w in writers])
        for rank, writer in enumerate(writers):
            if self._heard(writer, restored):
                continue
            if node_of(writer) not in self.gone:
                _unheard(self.local.setdefault(writer, []), restored)
            elif (held := buddy[rank]) is not None:
                _unheard(self.copies.setdefault((writer, node_of(writers[held])), []), restored)

    def _heard(self, slot: int, kept: Kept) -> bool:
        """Whether the coordinator knows ``slot``'s snapshot ``kept``, in a folder or a copy."""
        return kept in self.local.get(slot, []) or any(
            kept in held for (copied, _), held in self.copies.items() if copied == slot
        )

    def copy(self, generation: int, slot: int, node: int, step: int, seconds: float) -> None:
        """A copy of ``slot``'s snapshot of ``step`` in ``generation`` is whole on ``node``
        (the first of a generation there: the receiver forgot the copies past the step that
        generation started from)."""
        kept = self.copies.setdefault((slot, node), [])
        if kept and kept[-1][0] < generation:
            start = self.starts.get(generation, step)
            kept[:] = [k for k in kept if k[1] <= start]
        _keep(kept, (generation, step))
        self.copied += 1
        self.copy_seconds += seconds

    def copies_failed(self, generation: int, slot: int) -> None:
        """``slot``'s copies stopped in ``generation``: the one under way was written over
        the older copy on its node (each node keeps only its newest of the slot's)."""
        for (copied, _), kept in self.copies.items():
            if copied == slot:
                del kept[:-1]

    def summary(self, writers: int, each: str = "machine") -> str | None:
        """What the snapshots cost, for the run's end (None when none was taken):
        ``writers`` wrote them, one per ``each`` (a machine; under fsdp a worker)."""
        if not self.taken:
            return None
        every = self.committed * writers / self.taken
        line = (
            f"snapshots in shared memory: {self.taken} taken, about every {every:.0f} "
            f"step(s) on each {each}, {self.seconds / self.taken * 1e3:.1f} ms each, "
            f"{self.nbytes / 1e6:.1f} MB each (two buffers of that size per {each})"
        )
        if self.copied:
            line += (
                f"; {self.copied} copied to another node, "
                f"{self.copy_seconds / self.copied * 1e3:.1f} ms each beside the steps (two "
                "buffers there too)"
            )
        return line

    def lost(self, node: int, slots: list[int]) -> None:
        """A node is gone with its machine: its shared memory too (fsdp: the shard
        snapshots of its ``slots``, and the copies it kept of other nodes' members')."""
        self.snapshots.pop(node, None)
        self.gone.add(node)
        for slot in slots:
            self.local.pop(slot, None)
        for slot, held in list(self.copies):
            if held == node:
                del self.copies[(slot, held)]

    def missing(self) -> None:
        """fsdp: a new generation's members found no complete set where this record counted
        one: none of what it heard of is counted any more (the newer snapshots of the
        generations after a restart are heard of again)."""
        self.local.clear()
        self.copies.clear()

    @property
    def kept(self) -> bool:
        """Whether a snapshot lives on a node that is not lost."""
        return bool(self.snapshots)

    def shard_set(
        self,
        members: dict[int, list[int]],
        reach: Callable[[int], bool] = lambda _: True,
        node_of: Callable[[int], int] = lambda _: 0,
    ) -> bool:
        """fsdp: whether some generation (``members``: each one's) has a step of which
        every member's shard snapshot is still kept, in its folder or as a copy, where the
        next generation can read it: ``reach``, the nodes where one of its members runs
        (across nodes a set travels from the members that hold it); a slot's folder is on
        its node (``node_of``)."""
        if self.shard_failed:
            return False

        def steps(generation: int, slot: int) -> set[int]:
            found = {s for g, s in self.local.get(slot, []) if g == generation}
            if not reach(node_of(slot)):
                found = set()
            for (copied, node), kept in self.copies.items():
                if copied == slot and reach(node):
                    found |= {s for g, s in kept if g == generation}
            return found

        for generation, slots in members.items():
            common: set[int] | None = None
            for slot in slots:
                have = steps(generation, slot)
                common = have if common is None else common & have
            if common:
                return True
        return False


def _keep(kept: list[Kept], new: Kept) -> None:
    """A folder's two buffers: the newest two kept."""
    kept.append(new)
    del kept[:-2]


def _unheard(kept: list[Kept], found: Kept) -> None:
    """``found``, whole in a folder though its word never came: in its place among the
    newest two (a folder writes in (generation, step) order: a restore forgets the steps
    past the set, and the next generation writes on)."""
    kept.append(found)
    kept.sort()
    del kept[:-2]


@dataclass
class Restart:
    """Every member fell at ``committed`` steps; ``record`` is the index of the fall's
    record in the book; ``generation`` the restart's, once announced."""

    committed: int
    record: int
    generation: int | None = None


@dataclass
class Generations:
    """Every generation announced: members in rank order, and which ones rebuild."""

    members: dict[int, list[int]] = field(default_factory=dict)
    rebuilds: set[int] = field(default_factory=set)
    latest: int = -1
    announced_at: float = float("-inf")
    causes: dict[int, str] = field(default_factory=dict)
    formed: set[int] = field(default_factory=set)  # every member joined (its line was told)

    @property
    def current(self) -> list[int]:
        return self.members.get(self.latest, [])

    def left(self, generation: int) -> bool:
        """Whether a generation after ``generation`` makes its members leave its group (it
        drops a member, or rebuilds): then that one carries the retry. Generations that only
        add a replacement are joined at a step boundary, which a broken step never reaches."""
        for later in range(generation + 1, self.latest + 1):
            before, after = self.members[later - 1], self.members[later]
            if set(before) - set(after) or later in self.rebuilds:
                return True
        return False


class Roster:
    """The coordinator's record of the run and the actions it has decided, not yet taken."""

    def __init__(self, setup: Setup) -> None:
        self.setup = setup
        self.world = len(setup.devices)
        self.slots: dict[int, Slot] = {}
        self.replacements: list[Slot] = []  # every respawn, for the run's end
        self.gens = Generations()
        self.book = FailureBook(setup.recovery, setup.run_dir, sharded=setup.sharded)
        self.now = Now(0.0, 0.0)
        self.out: list[Action] = []
        self.panel = Panel(list(setup.devices), setup.timing.panel_tick)
        self.state = StateCopies()
        # (slot, pid) of every process a spawn replaced in its slot: what it said or how it
        # ended, seen after the spawn, is not the new process's
        self.replaced: set[tuple[int, int]] = set()

    def _flush(self) -> list[Action]:
        actions, self.out = self.out, []
        return actions

    @property
    def decided(self) -> bool:
        return self.book.decided

    def spawned(self, slot: int, pid: int | None) -> None:
        """The process of ``slot`` started with ``pid`` (on the panel: replaced, then new)."""
        state = self.slots[slot]
        state.pid = pid
        if pid is not None:  # (a pid used again, say on a node that started afresh, is this one)
            self.replaced.discard((slot, pid))
        if slot in self.panel.shown:
            self.show(slot, "replaced", f"by pid {pid}")
        self.show(slot, "joining" if state.replaces is not None else "starting")

    def move(self, slot: int, status: SlotStatus) -> None:
        """The only place a slot's status changes."""
        self.slots[slot].status = status

    def spawn(self, action: Spawn) -> None:
        replacement = action.replaces is not None
        state = Slot(
            phase="joining" if replacement else "start",
            progress_at=self.now.mono,
            replaces=action.replaces,
            order=action,
        )
        if replacement:
            self.replacements.append(state)
        old = self.slots.get(action.slot)
        if old is not None and old.pid is not None:
            self.replaced.add((action.slot, old.pid))
        self.slots[action.slot] = state
        self.out.append(action)

    def show(self, slot: int, panel_state: str, detail: str = "", beat: bool = False) -> None:
        """The worker panel: ``slot`` is now in ``panel_state`` (sent once per change;
        ``beat``: see :meth:`Panel.show`)."""
        rank = self.rank(slot) if slot in self.gens.current else None
        event = self.panel.show(slot, panel_state, self.slots[slot], rank, detail, beat)
        if event is not None:
            self.emit(event)

    def retired(self, slot: int, pid: int | None) -> bool:
        """Whether ``pid`` is a process a spawn replaced in ``slot`` (an exit or a message
        of it seen in the same poll as the spawn, or in flight from a node)."""
        return pid is not None and (slot, pid) in self.replaced

    def kill(self, slot: int) -> None:
        """Killed on the coordinator's decision: its exit is no failure of its own."""
        self.move(slot, SlotStatus.ENDED)
        self.out.append(Kill(slot))

    def announce(
        self, members: list[int], cause: str, rebuild: bool = False, replacing: int | None = None
    ) -> None:
        """Generation n+1, with the failed attempts of unfinished steps and their failures
        (so its members judge a repeat). No member's hang clock is reset."""
        g = self.gens
        g.latest += 1
        g.members[g.latest] = list(members)
        g.causes[g.latest] = cause
        if rebuild:
            g.rebuilds.add(g.latest)
        g.announced_at = self.now.mono
        for slot in members:
            if not self.slots[slot].ended:
                self.move(slot, SlotStatus.MEMBER)
        failed, known = self.book.evidence()
        doc = Announcement(
            g.latest, tuple(members), cause, rebuild, replacing, failed, known, self.state.timeline
        )
        self.out.append(Announce(doc))
        devices = [self.setup.devices[m] for m in members]
        self.emit(GenerationStarted(g.latest, list(members), devices, cause))

    def joined(self, generation: int) -> None:
        """A member joined ``generation``; once every member has (and it is still the newest),
        the line that says it: when it happened, not when it was announced (a replacement
        may start and take the state for seconds in between)."""
        g = self.gens
        members = g.members.get(generation, [])
        if generation != g.latest or generation in g.formed or generation == 0:
            return
        if all(self.slots[m].generation == generation for m in members):
            g.formed.add(generation)
            took = self.now.mono - g.announced_at
            self.emit(
                Notice(
                    f"generation {generation}: workers {members} train together "
                    f"({g.causes.get(generation, '')}; formed {took:.1f} s after it was decided)"
                )
            )

    def emit(self, event: Event) -> None:
        """An event of the coordinator's own, stamped with the time it was decided at."""
        self.out.append(Emit(replace(event, time=self.now.wall)))

    def rank(self, slot: int) -> int:
        members = self.gens.current
        return members.index(slot) if slot in members else slot

    def _where(self, slot: int) -> WorkerFailure:
        members = self.gens.members.get(self.slots[slot].generation, [])
        return where(slot, self.slots[slot], members, self.rank(slot), self.setup, self.now)


def where(
    slot: int, state: Slot, members: list[int], rank: int, setup: Setup, now: Now
) -> WorkerFailure:
    """A failure record of ``slot`` where it is now (kind and message filled in later):
    its step, phase, attempt, and the samples the plan gave it there (``members``: of the
    generation it was in)."""
    plan = setup.plan
    in_step = state.phase in STEP_PHASES
    epoch = state.step // plan.steps if plan.steps else None
    share = None
    if in_step and slot in members and epoch is not None:
        step, index = state.step % plan.steps, members.index(slot)
        share = plan.local_batch(epoch, step, index, len(members))
    return WorkerFailure(
        worker=slot,
        rank=rank,
        device=setup.devices[slot],
        kind="crash",
        message="",
        phase=state.phase,
        step=state.step,
        epoch=epoch,
        pid=state.pid,
        sample_indices=share,
        attempt=state.attempt if in_step else None,
        time=now.wall,
    )
