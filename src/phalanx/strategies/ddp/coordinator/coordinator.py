"""The ddp control plane's decisions: a pure state machine, no processes, store or clock.

:meth:`Coordinator.handle` takes one event and the time it happened at (:class:`Now`: a
monotonic clock for every timeout, the wall clock for the records) and returns the actions
to take, in order. Events: a message from a worker (:class:`Received`), a process exit
(:class:`Exited`), a :class:`Tick`, the stacks it asked for (:class:`StacksTaken`), a
started process's pid (:class:`Spawned`), a stop request (:class:`StopRequested`) and the
end of every process (:class:`AllExited`). Actions (:mod:`.actions`): announce a
generation, spawn, kill, dump stacks, record a failure, emit an event, stop, abort.

The rules themselves are pure functions in :mod:`phalanx.policy`; :mod:`.hangs` finds the
hung workers; the failure book (:class:`.book.FailureBook`) holds the run's failures and
the reports waiting for a decision; :class:`~.roster.Roster` keeps the record of slots and
generations that the rules read and the actions they decide.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import timedelta

from phalanx.events import Notice, StepEnded
from phalanx.failures import NO_SHARD_SET, WorkerFailure
from phalanx.policy import Recovery
from phalanx.strategies.ddp.coordinator.actions import (
    Action,
    DumpStacks,
    Emit,
    SetAbort,
    SetStop,
    Spawn,
)
from phalanx.strategies.ddp.coordinator.book import ACTIONS
from phalanx.strategies.ddp.coordinator.hangs import hung_among, stalled, tied_behind
from phalanx.strategies.ddp.coordinator.panel import IDLE_PHASES, PANEL_STATES
from phalanx.strategies.ddp.coordinator.roster import Now, Restart, Roster, Setup, Slot, SlotStatus
from phalanx.strategies.ddp.wire.protocol import (
    EXIT_TOLD,
    Aborted,
    Broke,
    Done,
    Failed,
    Joined,
    Progress,
    Ready,
    Relay,
    Snapshotted,
)


@dataclass(frozen=True)
class Received:
    slot: int
    message: object
    stale: bool = False  # from a process the slot's new one replaced: its last words
    pid: int | None = None  # the process that wrote it (None: unknown)


@dataclass(frozen=True)
class Exited:
    """The process of ``slot`` ended (after its pipe was read to the end); ``oom_kills``:
    the processes the kernel's out-of-memory killer killed on its machine while it ran
    (None: unknown)."""

    slot: int
    code: int
    oom_kills: int | None = None
    pid: int | None = None  # the process that ended (None: unknown)
    stacks: str | None = None  # a crash in native code: the stacks its faulthandler wrote


@dataclass(frozen=True)
class Spawned:
    slot: int
    pid: int | None


@dataclass(frozen=True)
class Tick:
    pass


@dataclass(frozen=True)
class StacksTaken:
    stacks: dict[int, str]


@dataclass(frozen=True)
class StopRequested:
    reason: str


@dataclass(frozen=True)
class AllExited:
    pass


@dataclass(frozen=True)
class NodeLost:
    """Node ``node`` (``host``) is gone with every worker it held: killed, frozen, cut off
    (``cause``: what the head saw). Its workers' own exits will never be seen."""

    node: int
    host: str
    cause: str


@dataclass(frozen=True)
class NodeJoined:
    """Node ``node``, lost before, registered again (the same machine back, or a spare in
    its place): its slots may be started again, as replacements."""

    node: int
    host: str
    spare: bool = False  # a spare node (PHALANX_NODE_RANK=spare) took its place


CoordinatorEvent = (
    Received
    | Exited
    | Spawned
    | Tick
    | StacksTaken
    | StopRequested
    | AllExited
    | NodeLost
    | NodeJoined
)


class Coordinator(Roster):
    """Events in, actions out (see the module's docstring); the record it decides with is
    its :class:`~.roster.Roster`."""

    def __init__(self, setup: Setup) -> None:
        super().__init__(setup)
        self.unready: set[int] = set()  # slots whose Ready the next first generation awaits
        self.waiting: list[int] = []  # replacements ready to be let in
        self.stop_sent = False
        self.decided_at: float | None = None
        self.killed_all = False
        self.quiet_until = float("-inf")  # no hang check before (a stalled one regroups)
        self.pending_hang: list[int] = []  # asked for their stacks
        self.inherited: int | None = None  # the lost head's failure, its replay not yet known
        self.starting: list[int] = []  # the slots the next first generation (or restart) has

    # -- the one entry point -------------------------------------------------------------
    def start(self, now: Now) -> list[Action]:
        """Start every worker; the first generation is announced once all are ready."""
        self.now = now
        devices = ", ".join(self.setup.devices)
        self.emit(
            Notice(
                f"starting {self.world} worker process(es) on {devices} "
                "(forked from a process that imported torch once: fast after the first run)"
            )
        )
        self.starting = list(range(self.world))
        for slot in self.starting:
            self.spawn(Spawn(slot))
            self.unready.add(slot)
        return self._flush()

    def inherit(self, failure: WorkerFailure, now: Now) -> list[Action]:
        """A failure decided before this coordinator started (the head lost, named by the
        node that took over from it): in the run's record and report like any other, its
        recovery time set when this run's first step is committed."""
        self.now = now
        self.book.record(failure, failure.action, self.out, recovers=True)
        if failure.step is not None:
            self.inherited = len(self.book.failures) - 1
        return self._flush()

    def handle(self, event: CoordinatorEvent, now: Now) -> list[Action]:
        self.now = now
        if isinstance(event, Received):
            if self.retired(event.slot, event.pid):
                event = replace(event, stale=True)
            if _counts(event):
                self._received(event.slot, event.message)
        elif isinstance(event, Exited):
            if not self.retired(event.slot, event.pid):  # (else it was accounted for)
                self._exited(event.slot, event.code, event.oom_kills, event.stacks)
        elif isinstance(event, Spawned):
            self.spawned(event.slot, event.pid)
        elif isinstance(event, StacksTaken):
            self._stacks_taken(event.stacks)
        elif isinstance(event, StopRequested):
            self._stop(event.reason)
        elif isinstance(event, AllExited):
            self.settle(everything=True)
        elif isinstance(event, Tick):
            self._tick()
        return self._decided()

    def _decided(self) -> list[Action]:
        """The actions so far; once the run is decided, first the abort every worker sees."""
        if self.decided and self.decided_at is None:
            self.decided_at = self.now.mono
            self.out.append(SetAbort("run decided"))
        return self._flush()

    # -- what workers say ----------------------------------------------------------------
    def _received(self, slot: int, message: object) -> None:
        if isinstance(message, Relay):
            if isinstance(message.event, StepEnded):
                self.book.recovered(message.event.time, message.event.global_step)
                self.state.committed = max(self.state.committed, message.event.global_step)
            self.out.append(Emit(message.event))  # (as the worker stamped it)
        elif isinstance(message, Snapshotted):
            self._snapshotted(slot, message)
        elif isinstance(message, Progress | Joined):
            if isinstance(message, Joined):
                self._restarted(message)
                kept = message.restored
                restored = (int(kept[0]), int(kept[1])) if kept and len(kept) == 2 else None
                writers = self.gens.members.get(restored[0], []) if restored else []
                self.state.joined(
                    slot, message.generation, message.step, restored, writers, self.setup.node_of
                )
            self.slots[slot].progress(message, self.now.mono)
            if isinstance(message, Joined):
                self.joined(message.generation)
            beat = isinstance(message, Progress)  # (a heartbeat; else Joined)
            phase = message.phase if isinstance(message, Progress) else "joined"
            self.show(slot, PANEL_STATES.get(phase, "training"), beat=beat)
        elif isinstance(message, Ready):
            self._ready(slot)
        elif isinstance(message, Failed):
            self._failed(slot, message)
        elif isinstance(message, Broke):
            self.book.hold(self.now.mono, message)
        elif isinstance(message, Aborted | Done):
            self._ended(slot, message)

    def _snapshotted(self, slot: int, message: Snapshotted) -> None:
        """A snapshot (fsdp: of a member's shards) is whole in shared memory, or a copy of one
        on another node (``held_by``), or they stopped (``failed``)."""
        node = self.setup.node_of(slot)
        writer = (message.generation, slot) if self.setup.sharded else None
        if message.held_by >= 0:  # (a copy on another node: phalanx.snapshot.copies)
            if message.failed:
                self.state.copies_failed(message.generation, slot)
            else:
                holder = self.setup.node_of(message.held_by)
                step = message.step
                self.state.copy(message.generation, slot, holder, step, message.seconds)
        elif message.failed:
            self.state.shard_failed = True
        else:
            self.state.snapshot(node, message.step, message.nbytes, message.seconds, writer)

    def _failed(self, slot: int, message: Failed) -> None:
        if message.fatal and message.failure.exception_type == NO_SHARD_SET:
            self._no_set(slot, message.failure)
        elif message.fatal:
            self.move(slot, SlotStatus.ENDED)
            self.fallen(message.failure)
        else:  # a vote carried it: the loop chose its action, counted over the run
            self.settle(before=self.slots[slot].generation)
            self.book.record_voted(message.failure, self.out)

    def _no_set(self, slot: int, failure: WorkerFailure) -> None:
        """fsdp: the members of the newest generation found no complete set of shard
        snapshots where this record counted one (two losses close together, a torn read:
        docs/fsdp.md). Not the member's own failure: the state it was to start from is not
        there. The first to say so is recorded, as a fall that leaves no holder: every slot
        starts again from the newest checkpoint (mode "respawn", a run_dir), or the run
        ends with the first loss as its root cause; the others say the same and are not."""
        self.move(slot, SlotStatus.ENDED)
        if self.state.no_set_in == self.gens.latest:
            return
        self.state.no_set_in = self.gens.latest
        self.state.missing()
        self.fallen(failure)

    def _ended(self, slot: int, message: Aborted | Done) -> None:
        """A worker's own end. An older generation's held report is that step's earlier
        attempt: it counts before the run is decided (a peer's Aborted can come first)."""
        self.settle(before=self.slots[slot].generation)
        self.move(slot, SlotStatus.ENDED)
        if isinstance(message, Done):
            self.show(slot, "finished")
        if isinstance(message, Aborted):
            self.book.aborted_by(slot, message.poison)
        elif message.weights_path is not None or message.model_path is not None:
            self.book.done = message
            self._dismiss_waiting()

    def _ready(self, slot: int) -> None:
        """A worker passed preflight: a replacement waits to be let in; the first
        generation (or a restart's) is announced once every starting slot is ready."""
        self.move(slot, SlotStatus.READY)
        if slot not in self.unready:
            self.waiting.append(slot)
            return
        self.unready.discard(slot)
        self.book.preflight_passed(slot, self.out)
        self._all_ready()

    def _all_ready(self) -> None:
        """Once every starting slot is ready: the first generation, or a restart's."""
        if not self.unready and not self.decided and self.starting:
            restart = self.state.restart
            cause = "restart from the newest snapshot or checkpoint" if restart else "start"
            if restart is not None:
                restart.generation = self.state.timeline = self.gens.latest + 1
            self.announce(sorted(self.starting), cause)

    # -- what the coordinator sees for itself ----------------------------------------------
    def _exited(
        self, slot: int, code: int, oom_kills: int | None = None, stacks: str | None = None
    ) -> None:
        """A worker that exited without having ended (sent Done, Aborted or a fatal
        Failed) has fallen, whatever its exit code: user code that calls ``sys.exit(0)``
        outside a step ends the process with code 0. Only two exits are expected of it: 0
        or EXIT_TOLD once the run is decided, and EXIT_TOLD from one the current
        generation leaves out."""
        state = self.slots[slot]
        if state.ended:
            return
        self.move(slot, SlotStatus.ENDED)
        expected = code in (0, EXIT_TOLD) and (
            self.decided or (code == EXIT_TOLD and slot not in self.gens.current)
        )
        if not expected:
            death = self.book.death(self._where(slot), code, self.now.wall, oom_kills)
            self.fallen(replace(death, stacks=stacks) if stacks else death)

    def _tick(self) -> None:
        self.settle()
        now, limit = self.now, self.setup.timing.limit
        beats = self.panel.tick(now.mono, now.wall, dict(self.slots), self.gens.current, limit)
        if beats is not None:
            self.emit(beats)
        if self.decided:
            grace = self.setup.timing.grace.total_seconds()
            late = self.decided_at is not None and self.now.mono - self.decided_at > grace
            if late and not self.killed_all:  # (those that ended but linger too)
                self.killed_all = True
                for slot in self.slots:
                    self.kill(slot)
            return
        self._check_hang()
        self._admit()

    def _check_hang(self) -> None:
        t, now = self.setup.timing, self.now.mono
        # (just after an announcement, members are leaving their old group: clocks still run)
        leaving = now - self.gens.announced_at < t.announce_grace.total_seconds()
        if self.pending_hang or now < self.quiet_until or leaving:
            return
        watched = watched_slots(self.slots, self.gens.current, self.unready, now, t.startup)
        if watched and stalled(watched, now, t.limit):
            # (fsdp: every pass gathers shards, so a worker whose heartbeat says it is in an
            # earlier phase may wait for one in a later phase: every stalled one is a suspect)
            self.pending_hang = list(watched) if self.setup.sharded else tied_behind(watched)
            self.out.append(DumpStacks(list(self.pending_hang)))

    def _stacks_taken(self, stacks: dict[int, str]) -> None:
        """Everyone stalled: the hung ones are those behind that do not wait in a
        collective (the others wait for them)."""
        tied, self.pending_hang = self.pending_hang, []
        hung = hung_among(tied, stacks)
        if not hung:  # one is regrouping: look again in a while
            self.quiet_until = self.now.mono + self.setup.timing.announce_grace.total_seconds()
        for slot in hung:
            if self.slots[slot].ended:
                continue
            stalled_for = self.now.mono - self.slots[slot].progress_at
            limit = self.setup.timing.hang.total_seconds()
            failure = self.book.hang(self._where(slot), stalled_for, stacks.get(slot, ""), limit)
            failure = replace(failure, last_progress=self.now.wall - stalled_for)
            self.kill(slot)
            self.fallen(failure)

    def _stop(self, reason: str) -> None:
        if not self.stop_sent and not self.decided:
            self.stop_sent = True
            self.out.append(SetStop(reason))

    # -- decisions -------------------------------------------------------------------------
    def fallen(self, failure: WorkerFailure) -> None:
        """A worker is out: judge the attempt it failed, then apply the recovery policy."""
        slot = failure.worker
        if slot in self.unready and failure.phase == "start":  # (setting up: a preflight's)
            failure = replace(failure, phase="preflight")
        self.show(slot, "fallen", f"{failure.kind} in {failure.phase}")
        self.settle(before=self.slots[slot].generation)
        if slot in self.waiting:
            self.waiting.remove(slot)
        survivors = [m for m in self.gens.current if m != slot and not self.slots[m].ended]
        holders = self.holders(survivors)
        action = self.book.fall(failure, holders, self.out, self.restart_kept(), self.can_restart())
        if action == "preflight":  # (as it was started: a restart's restores, skips faults)
            self.unready.add(slot)
            self.spawn(self.slots[slot].order or Spawn(slot))
        elif action in ("respawn", "shrink") and slot in self.gens.current:
            replacing = slot if action == "respawn" else None
            cause = f"worker {slot} {failure.kind}: {ACTIONS[action]}"
            self.announce(survivors, cause, replacing=replacing)
        if action == "respawn":
            after = -1 if failure.step is None else failure.step
            self.spawn(Spawn(slot, replaces=failure, faults_after=after))
        elif action == "restart":
            self._restart()

    def settle(self, everything: bool = False, before: int | None = None) -> None:
        """Decide on held :class:`Broke` reports once they are old enough (a peer that died
        in the same step is seen first), or at once when ``everything`` or older than
        generation ``before`` (a later generation's failure is decided next)."""
        settle = self.setup.timing.broke_settle.total_seconds()
        for message in self.book.settle(self.now.mono, settle, everything, before):
            rebuild = self.book.broke(message, self.out)
            if rebuild and not self.gens.left(message.generation):
                f = message.failure
                cause = f"worker {f.worker} {f.kind} in {f.phase}: rebuilt"
                self.announce(self.gens.current, cause, rebuild=True)

    def _restart(self) -> None:
        """Every member fell and respawns are left: start every slot again, each restoring
        the newest state it finds, its machine's snapshot in shared memory or the newest
        intact checkpoint in run_dir (replacements still starting are dropped: they would
        wait for state nobody holds); the generation's hand-over gives every member the
        furthest of them. The faults up to the last fall fired already; the steps after
        that state are computed again."""
        for slot, state in self.slots.items():
            if not state.ended:
                state.dropped = state.replaces is not None and state.joined_at is None
                self.kill(slot)
        self.waiting = []
        last = max((f.step for f in self.book.failures if f.step is not None), default=-1)
        self.starting = self.restartable()
        for slot in self.starting:
            self.spawn(Spawn(slot, faults_after=last, restart_after=self.gens.latest))
            self.unready.add(slot)
        self.state.restart = Restart(self.state.committed, len(self.book.failures) - 1)
        where = "the newest snapshot in shared memory or checkpoint"
        self.emit(
            Notice(f"every worker fell at step {self.state.committed + 1}: restarting from {where}")
        )

    def holders(self, members: list[int]) -> int:
        """How many of ``members`` hold the committed state: all but replacements let in
        that have not joined yet (they get it from a holder when their generation forms;
        once no holder is left, only a restart from a snapshot or checkpoint can go on).
        Under fsdp each holds a shard: together, with a set of the others' snapshots on
        their machines (a lost member's snapshot on a node where none of ``members`` runs
        is out of their reach: then a restart starts that node's slots too)."""
        if self.setup.sharded:
            nodes = {self.setup.node_of(m) for m in members}

            found = self.state.shard_set(self.gens.members, nodes.__contains__, self.setup.node_of)
            return len(members) if found else 0
        return sum(
            1
            for m in members
            if self.slots[m].replaces is None or self.slots[m].joined_at is not None
        )

    def restartable(self) -> list[int]:
        """The slots a restart starts again: every one (a lost node's cannot be, see
        :class:`NodeCoordinator`)."""
        return list(range(self.world))

    def restart_kept(self) -> bool:
        """Whether a restart of every slot would find a snapshot (fsdp: a complete set of
        shard snapshots)."""
        if self.setup.sharded:
            return self.state.shard_set(self.gens.members)
        return self.state.kept

    def can_restart(self) -> bool:
        """Whether a restart would have the workers it needs (``min_workers``)."""
        return len(self.restartable()) >= max(1, self.setup.recovery.min_workers)

    def _restarted(self, joined: Joined) -> None:
        """The first member of a restart's generation has the state it restarted from:
        the steps between it and the fall are computed again (recorded on the fall). Under
        fsdp a shrink or a respawn also starts from a set of snapshots: the same count. The
        lost head's failure (inherited): its last committed step less the step this run
        resumed from (0 from a node's emergency checkpoint; under fsdp, from the newest
        sharded checkpoint, the steps after it)."""
        if self.inherited is not None:
            head = self.book.failures[self.inherited]
            self.inherited = None
            assert head.step is not None
            head.replayed_steps = max(0, head.step - joined.step)
            if head.replayed_steps:
                self.emit(
                    Notice(
                        f"went on from committed step {joined.step} after the head's loss: "
                        f"{head.replayed_steps} committed step(s) to compute again"
                    )
                )
        if self.setup.sharded and joined.generation > 0 and joined.step <= self.state.committed:
            fall = next((f for f in reversed(self.book.failures) if f.action != "retried"), None)
            if fall is not None and fall.replayed_steps is None:
                fall.replayed_steps = self.state.committed - joined.step
        restart = self.state.restart
        if restart is None or restart.generation is None or joined.generation < restart.generation:
            return
        self.state.restart = None
        replayed = max(0, restart.committed - joined.step)
        self.book.failures[restart.record].replayed_steps = replayed
        self.emit(
            Notice(
                f"restarted from committed step {joined.step}: {replayed} committed step(s) "
                "to compute again"
            )
        )

    def _dismiss_waiting(self) -> None:
        """The run is over: workers that have not joined the last generation (replacements
        waiting to be let in, or let in while the others finished) are not needed."""
        for slot, state in self.slots.items():
            if state.generation < self.gens.latest and not state.ended:
                self.kill(slot)
        self.waiting = []

    def _admit(self) -> None:
        """Let ready replacements in, once the current generation has formed (so no member
        is half-way into an older one)."""
        if not self.waiting or self.book.done is not None:
            return
        current = self.gens.current
        if all(self.slots[m].generation == self.gens.latest for m in current):
            joining, self.waiting = self.waiting, []
            self.announce(current + joining, f"workers {joining} rejoin")

    def respawn_fates(self) -> list[str]:
        return respawn_fates(self.replacements, self.book.failures)


class NodeCoordinator(Coordinator):
    """The head's coordinator across machines: every rule of :class:`Coordinator` over
    the slots of all nodes, and a node's loss and return (:class:`NodeLost`,
    :class:`NodeJoined`). A lost node's slots are not started again until it registers."""

    def __init__(self, setup: Setup) -> None:
        super().__init__(setup)
        self.lost_nodes: dict[int, WorkerFailure] = {}  # node -> the failure that named it

    def handle(self, event: CoordinatorEvent, now: Now) -> list[Action]:
        if not isinstance(event, NodeLost | NodeJoined):
            return super().handle(event, now)
        self.now = now
        if isinstance(event, NodeLost):
            self._node_lost(event)
        else:
            self._node_joined(event)
        return self._decided()

    def _node_lost(self, event: NodeLost) -> None:
        """A node is gone with its workers: one failure names it (not an attempt of its
        step: the batch is not suspect), and the survivors go on as a new generation
        without it (shrink), while at least ``min_workers`` are left."""
        lost = [
            slot
            for slot, state in sorted(self.slots.items())
            if self.setup.node_of(slot) == event.node and not state.ended
        ]
        if event.node in self.lost_nodes or not lost:
            return
        failure = node_failure(self._where(lost[0]), event, lost)
        self.lost_nodes[event.node] = failure
        self.state.lost(event.node, [s for s in self.slots if self.setup.node_of(s) == event.node])
        self.settle(before=max(self.slots[s].generation for s in lost))
        for slot in lost:
            self.move(slot, SlotStatus.ENDED)
            self.show(slot, "fallen", f"node {event.node} lost")
            self.unready.discard(slot)
            if slot in self.waiting:
                self.waiting.remove(slot)
        survivors = [m for m in self.gens.current if not self.slots[m].ended]
        book = self.book
        if book.done is not None or self.decided:
            book.record(failure, "ignored" if book.done is not None else "aborted", self.out)
            return
        restart = self.state.restart
        if restart is not None and restart.generation is None:  # (a restart is starting)
            self.starting = [s for s in self.starting if s not in lost]
            if self.can_restart():
                book.record(failure, "shrunk", self.out, recovers=True)
                self._all_ready()
                return
        elif not self.holders(survivors) and self.gens.latest >= 0:  # (a restart, if kept)
            action = book.fall(failure, 0, self.out, self.restart_kept(), self.can_restart())
            if action == "restart":
                self._restart()
            return
        why = node_loss_stops(self.setup.recovery, len(survivors), self.gens.latest < 0)
        if why is None:
            book.record(failure, "shrunk", self.out, recovers=True)
            self.announce(survivors, f"node {event.node} lost: shrunk")
            return
        book.record(failure, "aborted", self.out)
        book.fatal = True
        book.notes.append(f"The run stopped when node {event.node} was lost: {why}.")

    def admits(self, node: int) -> bool:
        """Whether a lost node that registers again is let back in: while the run goes on
        and the recovery policy does not stop at a fall."""
        done = self.decided or self.book.done is not None
        return node in self.lost_nodes and not done and self.setup.recovery.mode != "abort"

    def _node_joined(self, event: NodeJoined) -> None:
        """A lost node is back: each of its slots starts a replacement, which is let in at
        a step boundary with the agreed state from a live peer (a respawn at node level)."""
        if not self.admits(event.node):
            return
        fell = self.lost_nodes.pop(event.node)
        self.state.gone.discard(event.node)  # (its folders are written again from now)
        slots = [s for s in sorted(self.slots) if self.setup.node_of(s) == event.node]
        after = -1 if fell.step is None else fell.step
        for slot in slots:
            self.spawn(Spawn(slot, replaces=replace(fell, worker=slot), faults_after=after))
        who = (
            f"a spare ({event.host}) takes node {event.node}'s place"
            if event.spare
            else f"node {event.node} ({event.host}) registered again"
        )
        self.emit(Notice(f"{who}: workers {slots} start and join at a step boundary"))

    def restartable(self) -> list[int]:
        """Every slot of the nodes that are not lost (a lost node's slots start again when
        it registers, as replacements let in at a step boundary)."""
        return [s for s in range(self.world) if self.setup.node_of(s) not in self.lost_nodes]


def _counts(event: Received) -> bool:
    """A replaced process's last words: its events and failure reports still count, its
    progress and its end do not (they would be read as its replacement's)."""
    message = event.message
    if not event.stale or isinstance(message, Relay | Broke):
        return True
    return isinstance(message, Failed) and not message.fatal


def watched_slots(
    slots: dict[int, Slot], current: list[int], unready: set[int], now: float, startup: timedelta
) -> dict[int, Slot]:
    """The slots whose silence counts: members outside their bounded idle phases, slots in a
    preflight, and every slot still starting once one is past the startup timeout."""
    watched = {
        slot: slots[slot]
        for slot in current
        if not slots[slot].ended and slots[slot].phase not in IDLE_PHASES
    }
    for slot in unready:
        if slots[slot].phase == "preflight" and not slots[slot].ended:
            watched[slot] = slots[slot]
    starting = {k: s for k, s in slots.items() if s.phase == "start" and not s.ended}
    if any(now - s.progress_at > startup.total_seconds() for s in starting.values()):
        watched.update(starting)
    return watched


def respawn_fates(replacements: list[Slot], failures: list[WorkerFailure]) -> list[str]:
    """What became of every replacement: joined at step N, or not (still starting)."""
    lines = []
    fallen = {f.pid for f in failures if f.pid is not None}
    for state in replacements:
        fell = state.replaces
        assert fell is not None
        at = "?" if fell.step is None else fell.step + 1  # steps 1-based, as people read them
        what = f"worker {fell.worker}'s replacement (after its {fell.kind} at step {at})"
        if state.joined_at is not None:
            source = " (its state from this machine's snapshot)" if state.joined_local else ""
            lines.append(f"{what} joined before step {state.joined_at + 1}{source}")
        elif state.dropped:
            lines.append(f"{what} was still starting when every worker fell: dropped")
        elif state.pid in fallen:
            lines.append(f"{what} fell before it joined")
        else:
            lines.append(f"{what} had not joined when the run ended (still starting)")
    return lines


def node_failure(first: WorkerFailure, event: NodeLost, lost: list[int]) -> WorkerFailure:
    """The one failure that names a lost node, where its first worker was (no attempt: a
    node's loss does not count against its step)."""
    step = "?" if first.step is None else first.step + 1
    message = (
        f"node {event.node} ({event.host}) lost with its workers {lost} at step {step}, "
        f"phase {first.phase}: {event.cause}"
    )
    return replace(first, message=message, host=event.host, attempt=None)


def node_loss_stops(policy: Recovery, survivors: int, before_training: bool) -> str | None:
    """Why the run stops when a node is lost, or None when the survivors go on (shrink)."""
    if before_training:
        return "before training began"
    if survivors < max(1, policy.min_workers):
        return "too few workers left"
    if policy.mode == "abort":
        return 'the recovery policy is mode="abort"'
    return None
