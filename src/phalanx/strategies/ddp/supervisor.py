"""The ddp supervisor: the process that called ``fit()``, as glue between the coordinator
(every decision, :mod:`.coordinator`) and the agent (processes, pipes, the store, stack
dumps: :mod:`.agent`).

:meth:`Supervisor.watch` feeds what the agent sees (a message, a process exit), a tick and
a stop request to the coordinator, with the time on a monotonic clock, and carries out the
actions it returns: announce a generation, spawn, kill, dump stacks, record a failure, emit
an event, stop, abort. :func:`run_ddp` turns the outcome into the run's result or report.
"""

from __future__ import annotations

import dataclasses
import os
import time
from datetime import timedelta
from typing import Any

import torch
from torch.utils.data import Dataset

from phalanx.errors import NodeFencedError
from phalanx.events import Notice, WorkerFailed
from phalanx.failures import WorkerFailure
from phalanx.interrupt import Interrupter
from phalanx.launch import Launch
from phalanx.plan import Plan
from phalanx.ranks import acting_as
from phalanx.run import RunEnd, RunInputs, stopped
from phalanx.snapshot.config import snapshots_off
from phalanx.spec import FitConfig, TrainSpec
from phalanx.strategies.ddp.agent.agent import Agent, SlotState, start_fork_server
from phalanx.strategies.ddp.agent.routing import LocalAgent, Router
from phalanx.strategies.ddp.agent.spawner import Spawner
from phalanx.strategies.ddp.coordinator.actions import (
    Action,
    Announce,
    DumpStacks,
    Emit,
    Kill,
    Record,
    SetAbort,
    SetStop,
    Spawn,
)
from phalanx.strategies.ddp.coordinator.book import FailureBook
from phalanx.strategies.ddp.coordinator.coordinator import (
    AllExited,
    Coordinator,
    CoordinatorEvent,
    Exited,
    NodeCoordinator,
    NodeJoined,
    NodeLost,
    Received,
    Spawned,
    StacksTaken,
    StopRequested,
    Tick,
)
from phalanx.strategies.ddp.coordinator.roster import Now, Setup
from phalanx.strategies.ddp.nodes.headloss import head_lost, kept_line, save_on_head_loss
from phalanx.strategies.ddp.nodes.hub import Nodes, RemoteNode, rejected_link, start_head, tell_end
from phalanx.strategies.ddp.nodes.node import run_node, shared_path
from phalanx.strategies.ddp.timing import Timing
from phalanx.strategies.ddp.wire.control import rejected_notice
from phalanx.strategies.ddp.wire.messages import (
    BadMessage,
    End,
    FinalWeights,
    Message,
    Seen,
    SpawnOrder,
    Stacks,
    Started,
    StopAsked,
    decode,
)
from phalanx.strategies.ddp.wire.protocol import Done, Rejected, Saved

__all__ = ["SlotState", "Supervisor", "run_ddp"]


STOOD_DOWN_SHARDED = (
    "under fsdp a head that stands down keeps nothing: the side that may take over holds a "
    "copy of each of its members' shard snapshots and writes them into run_dir itself"
)


def now() -> Now:
    return Now(time.monotonic(), time.time())


class Supervisor:
    """One run's coordinator and agent, and the user's parts a worker is started with."""

    def __init__(
        self,
        spec: TrainSpec,
        config: FitConfig,
        plan: Plan,
        data: tuple[Dataset[Any], Dataset[Any] | None, int],
        emit: Any,
        interrupter: Interrupter,
        nodes: Nodes | None = None,
        timing: Timing | None = None,
    ) -> None:
        self.spec, self.plan = spec, plan
        self.data = data
        self.emit, self.interrupter = emit, interrupter
        # The run's durations (across machines: the head's agent was made with them).
        self.timing = timing = timing if timing is not None else Timing.of(config)
        self.hub = nodes.hub if nodes is not None else None
        self.agent = nodes.agent if nodes is not None else Agent(timing=timing)
        self.retired = self.agent.retired
        local = len(config.devices)
        shown = list(config.devices)
        slot_nodes: tuple[int, ...] = ()
        if nodes is not None:  # every node's devices, in node order
            config = dataclasses.replace(config, devices=nodes.labels)
            shown, slot_nodes = nodes.shown, nodes.slot_nodes
        self.config = config
        self.spawner = Spawner(spec, config, plan, data, self.agent, local)
        # Every action on a slot, to the agent that holds it: this machine's, or a node's.
        remote = None if self.hub is None else self.hub.agent_of
        self.agents = Router(LocalAgent(self.agent, self.spawner), remote)
        self.user = self.spawner.user
        self.threads = self.spawner.threads
        recovery, run_dir = config.recovery, bool(config.run_dir)
        sharded = config.strategy == "fsdp"
        setup = Setup(plan, shown, recovery, timing, run_dir, slot_nodes, sharded)
        self.coord = Coordinator(setup) if nodes is None else NodeCoordinator(setup)
        self.rejected: set[tuple[str, str]] = set()  # (key, digest) already warned about
        self.stacks_due: tuple[float, dict[int, str | None]] | None = None  # remote dumps
        self.told = False  # whether the other nodes were told how the run ended
        self.fence = nodes.fence if nodes is not None else None
        self.inherited = nodes.inherited if nodes is not None else []

    @property
    def outcome(self) -> FailureBook:
        return self.coord.book

    def start(self) -> None:
        if self.config.snapshots is not None and self.agent.snapshot_folder() is None:
            self.emit(snapshots_off(self.agent.snapshot_error))
        self._act(self.coord.start(now()))
        for failure in self.inherited:  # (the lost head's, named by this successor)
            self._act(self.coord.inherit(failure, now()))

    def watch(self) -> FailureBook:
        """Until every worker has ended (the coordinator kills them once the run is
        decided and its grace has passed)."""
        stop_told = False
        while True:
            self._see(self.timing.poll)
            if not stop_told and self.interrupter.should_stop():
                stop_told = True
                self._feed(StopRequested(self.interrupter.reason or "stop requested"))
            self._feed(Tick())
            if self.agent.all_exited() and (self.hub is None or self.hub.all_exited()):
                self._see(timedelta())  # the last words
                self._feed(AllExited())
                return self.coord.book

    def _see(self, timeout: timedelta) -> None:
        seen = self.agent.poll(timeout)
        # Once a second (and at once for a head woken from a freeze), before it acts on
        # what its workers or the nodes said: a head another node replaced stops here.
        self._check_fence()
        for one in seen:
            self._seen(one)
        if self.hub is not None:
            self._hear()

    def _seen(self, seen: Seen) -> None:
        """What an agent saw, this machine's or a node's."""
        if seen.exited:
            assert seen.code is not None
            self._feed(Exited(seen.slot, seen.code, seen.oom_kills, seen.pid, seen.stacks))
        elif isinstance(seen.message, Rejected):
            self._rejected(seen.message)
        else:
            self._feed(Received(seen.slot, seen.message, seen.stale, seen.pid))

    def _hear(self) -> None:
        """What the other nodes' agents sent, and the nodes lost."""
        assert self.hub is not None
        frames, lost = self.hub.poll()
        for node, frame in frames:
            try:
                message = decode(frame)
            except BadMessage:
                continue  # (authenticated, but not a frame this version reads)
            self._heard(node, message)
        for node, cause in lost:
            if node is self.hub.outvoted:
                self._stand_down(node, cause)
        for node, cause in lost:
            self._feed(NodeLost(node.rank, node.host, cause))
        assert isinstance(self.coord, NodeCoordinator)
        for node, refused in self.hub.rejoined(self.coord.admits):
            if refused:
                self.emit(Notice(f"refused node {node.rank} ({node.host}): {refused}", "warning"))
            else:
                self._feed(NodeJoined(node.rank, node.host, spare=node.spare))
        notes, self.hub.notes = self.hub.notes, []
        for level, text in notes:
            self.emit(Notice(text, level))
        self._stacks_ready()

    def _heard(self, node: RemoteNode, message: Message) -> None:
        """A node's message (a node speaks for its own slots only)."""
        if isinstance(message, Seen) and message.slot in node.slots:
            if message.exited:
                node.alive.discard(message.slot)
            said = message.message
            if isinstance(said, Done) and said.weights_path:
                said = dataclasses.replace(said, weights_path=self._weights(message.slot))
                message = dataclasses.replace(message, message=said)
            self._seen(message)
        elif isinstance(message, FinalWeights) and message.slot in node.slots:
            with open(self._weights(message.slot), "wb") as fh:
                fh.write(message.weights)
        elif isinstance(message, Started) and message.slot in node.slots:
            self._started(message)
        elif isinstance(message, Stacks):
            self._stacks_in(message, node.slots)
        elif isinstance(message, StopAsked):
            self._feed(StopRequested(f"node {node.rank}: {message.reason}"))

    def _started(self, started: Started) -> None:
        self._feed(Spawned(started.slot, started.pid))

    def _stacks_in(self, stacks: Stacks, of: range) -> None:
        """Stacks a node sent for its slots (``of``), while a dump waits for them."""
        if self.stacks_due is None:
            return
        for slot, text in stacks.stacks.items():
            if slot in of:
                self.stacks_due[1][slot] = text

    def _weights(self, slot: int) -> str:
        return os.path.join(self.agent.tmp, f"final-{slot}-received.pt")

    def _stacks_ready(self, force: bool = False) -> None:
        """The stacks asked for, once every node answered (or did not in time)."""
        if self.stacks_due is None:
            return
        asked_at, stacks = self.stacks_due
        late = time.monotonic() - asked_at > self.timing.remote_stacks.total_seconds()
        if force or late or all(text is not None for text in stacks.values()):
            self.stacks_due = None
            answer = "(no answer from the worker's node in time)"
            self._feed(StacksTaken({s: answer if t is None else t for s, t in stacks.items()}))

    def _rejected(self, msg: Rejected) -> None:
        """One warning per rejected store value, however many workers read it."""
        if (msg.key, msg.digest) not in self.rejected:
            self.rejected.add((msg.key, msg.digest))
            self.emit(rejected_notice(msg))

    def _feed(self, event: CoordinatorEvent) -> None:
        self._act(self.coord.handle(event, now()))

    def _act(self, actions: list[Action]) -> None:
        for action in actions:
            self._do(action)

    def _do(self, action: Action) -> None:
        if isinstance(action, Emit):
            self.emit(action.event)
        elif isinstance(action, Record):
            self.emit(WorkerFailed(action.failure, action.failure.action or ""))
        elif isinstance(action, Announce):
            self._check_fence(now=True)  # (a head that was replaced announces nothing)
            self.agent.announce(action.announcement)
        elif isinstance(action, Spawn):
            self._spawn(action)
        elif isinstance(action, Kill):
            self.agents.kill(action.slot)
        elif isinstance(action, DumpStacks):
            self._dump_stacks_of(action.slots)
        elif isinstance(action, SetStop):
            self.agent.set_stop(action.reason)
        elif isinstance(action, SetAbort):
            self.agent.set_abort(action.reason)

    def _check_fence(self, now: bool = False) -> None:
        """A head that another node replaced (a newer term in run_dir's head.json: it was
        frozen or cut off, and the survivors went on with a successor) stops its workers
        and commits nothing more: raises NodeFencedError (PX145)."""
        if self.fence is None:
            return
        newer = self.fence.replaced(now)
        if newer is None:
            return
        self.agent.kill_all()
        raise NodeFencedError(
            f"this head (term {self.fence.term.term}) was replaced by {newer.describe()}: it was "
            "frozen or cut off long enough for the other nodes to go on without it, so its "
            "workers were stopped: the run goes on under the new head, and nothing this head's "
            "workers computed after it took over is kept (they write no checkpoint)"
        )

    def _stand_down(self, node: RemoteNode, cause: str) -> None:
        """The nodes the head lost may be the side of a partition that takes over (the
        hub's ``outvoted``: their leader is among them, and they are more than half of the
        run's succession): this head stops first, so that at most one side goes on. Its
        workers keep the last committed step as a node's do when the head is lost (under
        fsdp they keep nothing: the side that takes over holds a copy of each of their shard
        snapshots and writes those into run_dir itself, before it resumes). It then
        watches run_dir's head.json for a successor's term (the takeover's time): one there
        ends it with PX145 (exit 1: the run goes on there, nothing to start again here); none
        with HeadLost (PX147, exit 75: start the run again). The nodes still with it see its
        link close (they stop too, or follow a new head they can reach)."""
        assert self.hub is not None
        self._check_fence(now=True)  # (replaced already: PX145 says so)
        if self.config.strategy == "fsdp":
            # (its workers' shard snapshots would land in run_dir while the side that takes
            # over resumes from it, and could complete a newer set under its members' feet)
            self.agent.kill_all()
            saved = [Saved(0, 0, note=STOOD_DOWN_SHARDED)]
        else:
            saved = save_on_head_loss(self.agent)
        self.told = True  # (nothing is told: the nodes still here see the link close)
        wait = self.timing.takeover + self.timing.node
        end = time.monotonic() + wait.total_seconds()
        while time.monotonic() < end:
            self._check_fence(now=True)  # (a successor took over: NodeFencedError)
            time.sleep(self.timing.store_poll.total_seconds())
        lost = sorted(n.rank for n in self.hub.nodes.values() if n.lost)
        message = (
            f"head: node {node.rank} lost ({cause}), with node(s) {lost} lost in all: they may "
            "be the side of a partition that takes over (the leader they know is among them, "
            "and they are more than half of the run's nodes), so this head stopped its "
            f"workers, and no node took over within {wait.total_seconds():g}s"
        )
        raise head_lost(message + kept_line(saved), saved, self.emit)

    def _spawn(self, action: Spawn) -> None:
        """Start the worker of a slot as the coordinator asked, on its node (a node's
        answer comes later: :meth:`_heard`)."""
        order = SpawnOrder(
            action.slot, action.replaces is not None, action.faults_after, action.restart_after
        )
        started = self.agents.spawn(order)
        if started is not None:
            self._started(started)

    def _dump_stacks_of(self, slots: list[int]) -> None:
        """The stacks of ``slots``: fed at once when every agent answered at once, else
        once the nodes asked answered (or did not in time: :meth:`_stacks_ready`)."""
        known = self.agents.stacks(slots).stacks
        stacks: dict[int, str | None] = {slot: known.get(slot) for slot in slots}
        if all(text is not None for text in stacks.values()):
            self._feed(StacksTaken({s: t or "" for s, t in stacks.items()}))
            return
        self.stacks_due = (time.monotonic(), stacks)

    # -- kept for the process tests ----------------------------------------------------------
    def _stack_file(self, slot: int) -> str:
        return self.agent.stack_file(slot)

    def _dump_stacks(self, slot: int, state: SlotState) -> str:
        self.agent.slots[slot] = state
        return self.agent.dump_stacks(slot)

    def rejected_links(self) -> list[Notice]:
        """One warning for each connection the head refused (not this run's token)."""
        if self.hub is None:
            return []
        self.hub.poll()
        found, self.hub.rejected = self.hub.rejected, []
        return [rejected_link(address, why) for address, why in found]

    def tell_nodes(self, end: End) -> None:
        """Tell every other node how the run ended (once; nothing to tell on one node)."""
        if self.hub is not None and not self.told:
            self.told = True
            tell_end(self.hub, end)

    def close(self) -> None:
        self.agent.close()
        if self.hub is not None:
            self.hub.close()

    def final_model(self, path: str) -> torch.nn.Module:
        """The result's model, built (in this process) as the main member sees it."""
        with acting_as(0, len(self.config.devices)):
            empty = self.spec.build_empty(tied=False)  # (then the loaded tensors are its own)
            model = empty if empty is not None else self.spec.build_model()
        state = torch.load(path, map_location="cpu", weights_only=True)
        model.load_state_dict(state, assign=empty is not None)
        return model


def run_ddp(
    run: RunInputs, emit: Any, interrupter: Interrupter, launch: Launch | None = None
) -> RunEnd:
    """Train on one worker process per device; raises TrainingFailed when the run stopped
    (the caller finishes it: :func:`phalanx.run.finish`). Across machines (``launch`` with
    several nodes) this is the head's part; a node's is :func:`.nodes.node.run_node`."""
    if launch is not None and launch.remote:
        return run_node(run, launch, emit, interrupter)
    started = time.time()
    timing = Timing.of(run.config)  # (the run's every duration, from here on)
    start_fork_server()  # (before any node's clock runs: see start_fork_server)
    nodes = None
    if launch is not None and launch.nnodes > 1:
        nodes = start_head(run, launch, emit, timing)
        if nodes.fence is not None:  # (its workers write checkpoints only while it leads)
            config = dataclasses.replace(run.config, head_term=nodes.fence.term.term)
            run = dataclasses.replace(run, config=config)
    data = (run.train, run.valid, run.valid_size)
    sup = Supervisor(run.spec, run.config, run.plan, data, emit, interrupter, nodes, timing)
    try:
        sup.start()
        outcome = sup.watch()
        fates = sup.coord.respawn_fates()
        setup = sup.coord.setup
        writers = len(sup.coord.gens.current) if setup.sharded else max(setup.nodes, default=0) + 1
        cost = sup.coord.state.summary(writers, "worker" if setup.sharded else "machine")
        notes = [Notice(line) for line in fates] + ([Notice(cost)] if cost else [])
        for note in notes + sup.rejected_links():
            emit(note)  # (the run's end says what became of every respawn)
        end = _run_end(sup, outcome, fates, interrupter.reason)
    finally:
        if not sup.told:  # (a bug of ours: the nodes must not wait)
            sup.tell_nodes(_failed_end([_lost(run.config)], False, [], []))
        sup.close()
    return dataclasses.replace(end, seconds=time.time() - started)


def _run_end(sup: Supervisor, outcome: FailureBook, fates: list[str], reason: str | None) -> RunEnd:
    """The run's end from the coordinator's book (the nodes told the same), or raise
    TrainingFailed with its report."""
    config = sup.config
    if outcome.fatal or outcome.aborted or outcome.done is None:
        failures = outcome.failures or [_lost(config)]
        poison = outcome.poison and not outcome.fatal
        sup.tell_nodes(_failed_end(failures, poison, outcome.notes, fates))
        raise stopped(failures, poison, config, tuple(outcome.notes), fates)
    done = outcome.done
    assert done.weights_path is not None or done.model_path is not None
    interrupted = done.interrupted
    if interrupted and reason:  # the reason as the supervisor was told it
        interrupted = f"Training interrupted: {reason}"
    end = RunEnd(
        # (fsdp's gather=False: nothing gathered, the final sharded checkpoint has the weights)
        model=None if done.weights_path is None else sup.final_model(done.weights_path),
        history=done.history,
        steps=done.steps,
        epochs=done.epochs,
        interrupted=interrupted,
        ledger=done.ledger,
        failures=outcome.failures,
        seconds=0.0,
        fates=fates,
        quarantine={int(i): int(g) for i, g in done.quarantine},
        model_path=shared_path(config.run_dir, done.model_path),
    )
    if sup.hub is not None:
        # (gather=False: the main member's path, where this head sees it in run_dir)
        model_path = shared_path(config.run_dir, done.model_path)
        if config.run_dir and interrupted is None and end.model is not None:
            # Written before the nodes hear of the end, so that a node sharing run_dir (a
            # shared file system) finds the file when its fit returns (Learner writes the
            # same file again, atomically: the same bytes).
            from phalanx.learner import save_final_model

            model_path = os.path.abspath(save_final_model(config.run_dir, end.model))
        weights = b""  # (none gathered: the nodes read model_path)
        if done.weights_path is not None:
            with open(done.weights_path, "rb") as fh:
                weights = fh.read()
        sup.tell_nodes(_ok_end(end, model_path, weights))
    return end


def _ok_end(end: RunEnd, model_path: str | None, weights: bytes) -> End:
    return End(
        ok=True,
        failures=tuple(end.failures),
        fates=tuple(end.fates),
        history=tuple(end.history),
        steps=end.steps,
        epochs=end.epochs,
        interrupted=end.interrupted,
        ledger=tuple(tuple(row) for row in end.ledger),
        quarantine=tuple(sorted(end.quarantine.items())),
        model_path=model_path,
        weights=weights,
    )


def _failed_end(
    failures: list[WorkerFailure], poison: bool, notes: list[str], fates: list[str]
) -> End:
    return End(
        ok=False, failures=tuple(failures), fates=tuple(fates), poison=poison, notes=tuple(notes)
    )


def _lost(config: FitConfig) -> WorkerFailure:
    return WorkerFailure(
        worker=0,
        rank=0,
        device=config.devices[0],
        kind="crash",
        message="the run ended without a result from its main worker",
        phase="sync",
    )
