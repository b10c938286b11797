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

from phalanx.events import Notice, WorkerFailed
from phalanx.failures import WorkerFailure
from phalanx.interrupt import Interrupter
from phalanx.plan import Plan
from phalanx.run import RunEnd, RunInputs, stopped
from phalanx.spec import FitConfig, TrainSpec
from phalanx.strategies.ddp import worker as worker_mod
from phalanx.strategies.ddp.actions import (
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
from phalanx.strategies.ddp.agent import Agent, SlotState
from phalanx.strategies.ddp.book import FailureBook
from phalanx.strategies.ddp.control import rejected_notice
from phalanx.strategies.ddp.coordinator import (
    AllExited,
    Coordinator,
    CoordinatorEvent,
    Exited,
    Now,
    Received,
    Setup,
    Spawned,
    StacksTaken,
    StopRequested,
    Tick,
    Timeouts,
)
from phalanx.strategies.ddp.protocol import Rejected

__all__ = ["SlotState", "Supervisor", "run_ddp"]

POLL = timedelta(seconds=0.1)
BROKE_SETTLE = 0.2  # seconds a Broke report waits for a peer's death to be seen first


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
    ) -> None:
        self.spec, self.config, self.plan = spec, config, plan
        self.user = worker_mod.pack_user(spec)  # unpickled by each worker (see WorkerArgs)
        self.data = data
        self.emit, self.interrupter = emit, interrupter
        self.agent = Agent()
        self.retired = self.agent.retired
        timeouts = Timeouts(config.hang_timeout, broke_settle=timedelta(seconds=BROKE_SETTLE))
        recovery, run_dir = config.recovery, bool(config.run_dir)
        self.coord = Coordinator(Setup(plan, list(config.devices), recovery, timeouts, run_dir))
        cpu_workers = sum(1 for d in config.devices if d.startswith("cpu"))
        self.threads = max(1, (os.cpu_count() or 1) // max(1, cpu_workers))
        self.rejected: set[tuple[str, str]] = set()  # (key, digest) already warned about

    @property
    def outcome(self) -> FailureBook:
        return self.coord.book

    def start(self) -> None:
        self._act(self.coord.start(now()))

    def watch(self) -> FailureBook:
        """Until every worker has ended (the coordinator kills them once the run is
        decided and its grace has passed)."""
        stop_told = False
        while True:
            self._see(POLL)
            if not stop_told and self.interrupter.should_stop():
                stop_told = True
                self._feed(StopRequested(self.interrupter.reason or "stop requested"))
            self._feed(Tick())
            if self.agent.all_exited():
                self._see(timedelta(0))  # the last words
                self._feed(AllExited())
                return self.coord.book

    def _see(self, timeout: timedelta) -> None:
        for seen in self.agent.poll(timeout):
            if seen.exited:
                assert seen.code is not None
                self._feed(Exited(seen.slot, seen.code))
            elif isinstance(seen.message, Rejected):
                self._rejected(seen.message)
            else:
                self._feed(Received(seen.slot, seen.message, seen.stale))

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
            self.agent.announce(action.announcement)
        elif isinstance(action, Spawn):
            self._spawn(action)
        elif isinstance(action, Kill):
            self.agent.kill(action.slot)
        elif isinstance(action, DumpStacks):
            stacks = {slot: self.agent.dump_stacks(slot) for slot in action.slots}
            self._feed(StacksTaken(stacks))
        elif isinstance(action, SetStop):
            self.agent.set_stop(action.reason)
        elif isinstance(action, SetAbort):
            self.agent.set_abort(action.reason)

    def _spawn(self, action: Spawn) -> None:
        """Start the worker of a slot as the coordinator asked."""
        config = self.config
        if action.restart_after is not None:  # (it passed preflight before)
            config = dataclasses.replace(config, resume=True, preflight=False)
        replacement = action.replaces is not None
        train, valid, valid_size = self.data

        def make_args(conn: Any, stack_file: str, heartbeat: Any) -> worker_mod.WorkerArgs:
            return worker_mod.WorkerArgs(
                slot=action.slot,
                store_port=self.agent.store.port,
                token=self.agent.signer.token,
                user=self.user,
                config=config,
                plan=self.plan,
                train=train,
                valid=valid,
                valid_size=valid_size,
                conn=conn,
                parent_pid=os.getpid(),
                stack_file=stack_file,
                weights_path=os.path.join(self.agent.tmp, "final.pt"),
                threads=self.threads,
                replacement=replacement,
                faults_after=action.faults_after,
                after_generation=-1 if action.restart_after is None else action.restart_after,
                heartbeat=heartbeat,
            )

        name = f"phalanx-worker-{action.slot}" + ("-replacement" if replacement else "")
        pid = self.agent.spawn(action.slot, name, worker_mod.main, make_args)
        self._feed(Spawned(action.slot, pid))

    # -- kept for the process tests ----------------------------------------------------------
    def _stack_file(self, slot: int) -> str:
        return self.agent.stack_file(slot)

    def _dump_stacks(self, slot: int, state: SlotState) -> str:
        self.agent.slots[slot] = state
        return self.agent.dump_stacks(slot)

    def close(self) -> None:
        self.agent.close()

    def final_model(self, path: str) -> torch.nn.Module:
        model = self.spec.build_model()
        model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        return model


def run_ddp(run: RunInputs, emit: Any, interrupter: Interrupter) -> RunEnd:
    """Train on one worker process per device; raises TrainingFailed when the run stopped
    (the caller finishes it: :func:`phalanx.run.finish`)."""
    started = time.time()
    config = run.config
    data = (run.train, run.valid, run.valid_size)
    sup = Supervisor(run.spec, config, run.plan, data, emit, interrupter)
    try:
        sup.start()
        outcome = sup.watch()
        fates = sup.coord.respawn_fates()
        for line in fates:  # the run's end says what became of every respawn
            emit(Notice(line))
        if outcome.fatal or outcome.aborted or outcome.done is None:
            failures = outcome.failures or [_lost(config)]
            poison = outcome.poison and not outcome.fatal
            raise stopped(failures, poison, config, tuple(outcome.notes), fates)
        done = outcome.done
        assert done.weights_path is not None
        model = sup.final_model(done.weights_path)
    finally:
        sup.close()
    interrupted = done.interrupted
    if interrupted and interrupter.reason:  # the reason as the supervisor was told it
        interrupted = f"Training interrupted: {interrupter.reason}"
    return RunEnd(
        model=model,
        history=done.history,
        steps=done.steps,
        epochs=done.epochs,
        interrupted=interrupted,
        ledger=done.ledger,
        failures=outcome.failures,
        seconds=time.time() - started,
        fates=fates,
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
