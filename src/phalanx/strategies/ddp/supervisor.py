"""The ddp supervisor: the process that called ``fit()``.

It hosts the TCPStore (127.0.0.1, a free port), spawns one worker per device, relays rank 0's
events to the sinks, and watches: a worker that exits without saying why crashed (the
process sentinel tells within one poll); a worker whose progress has stalled for
``hang_timeout`` while its peers wait is hung (its stacks are dumped, then it is killed).
Any fatal failure or a poison batch ends the run: workers are told to exit, stragglers are
killed, and one :class:`~phalanx.errors.TrainingFailed` names the root cause.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import Dataset

from phalanx import report
from phalanx.events import WorkerFailed
from phalanx.failures import WorkerFailure
from phalanx.interrupt import Interrupter
from phalanx.plan import Plan
from phalanx.spec import FitConfig, TrainSpec
from phalanx.strategies.ddp import worker as worker_mod
from phalanx.strategies.ddp.protocol import (
    ABORT_KEY,
    STOP_KEY,
    Aborted,
    Done,
    Failed,
    Progress,
    Relay,
)

POLL = 0.02
STARTUP_TIMEOUT = 120.0  # spawning and importing torch is not a hang
GRACE = 2.0  # seconds workers get to exit by themselves once the run is decided
STACK_WAIT = 0.5


@dataclass
class RankState:
    process: Any
    conn: Connection
    step: int = 0
    phase: str = "start"
    changed: float = field(default_factory=time.time)
    finished: bool = False  # sent Done or Aborted, or its failure is known


@dataclass
class Outcome:
    failures: list[WorkerFailure] = field(default_factory=list)
    fatal: bool = False
    poison: bool = False
    done: Done | None = None
    aborted: set[int] = field(default_factory=set)


class Supervisor:
    def __init__(
        self,
        spec: TrainSpec,
        config: FitConfig,
        plan: Plan,
        train: Dataset[Any],
        valid: Dataset[Any] | None,
        valid_size: int,
        emit: Any,
        interrupter: Interrupter,
    ) -> None:
        self.spec, self.config, self.plan = spec, config, plan
        self.train, self.valid, self.valid_size = train, valid, valid_size
        self.emit, self.interrupter = emit, interrupter
        self.world = len(config.devices)
        self.ctx = mp.get_context("spawn")
        self.tmp = tempfile.mkdtemp(prefix="phalanx-")
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.ranks: dict[int, RankState] = {}
        self.outcome = Outcome()
        self.stop_sent = False

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        threads = max(
            1,
            (os.cpu_count() or 1) // sum(1 for d in self.config.devices if d.startswith("cpu"))
            or 1,
        )
        for rank in range(self.world):
            reader, writer = self.ctx.Pipe(duplex=False)
            args = worker_mod.WorkerArgs(
                rank=rank,
                world=self.world,
                store_port=self.store.port,
                prefix="g0/",
                spec=self.spec,
                config=self.config,
                plan=self.plan,
                train=self.train,
                valid=self.valid,
                valid_size=self.valid_size,
                conn=writer,
                parent_pid=os.getpid(),
                stack_file=self._stack_file(rank),
                weights_path=os.path.join(self.tmp, "final.pt"),
                threads=threads,
            )
            proc = self.ctx.Process(
                target=worker_mod.main, args=(args,), name=f"phalanx-worker-{rank}", daemon=True
            )
            proc.start()
            writer.close()  # the worker holds the only write end: EOF means it is gone
            self.ranks[rank] = RankState(proc, reader)

    def watch(self) -> Outcome:
        """Until every worker is finished or the run is decided (then tear down)."""
        decided_at: float | None = None
        while True:
            self._drain()
            self._check_deaths()
            if decided_at is None:
                self._check_hang()
                self._forward_stop()
            if self._decided() and decided_at is None:
                decided_at = time.time()
                self.store.set(ABORT_KEY, "run decided")
            if all(not s.process.is_alive() for s in self.ranks.values()):
                for state in self.ranks.values():
                    if not state.conn.closed:
                        self._read(state.conn)
                return self.outcome
            if decided_at is not None and time.time() - decided_at > GRACE:
                self.kill_all()

    def kill_all(self) -> None:
        for state in self.ranks.values():
            if state.process.is_alive():
                state.finished = True  # killed by us: not a failure of its own
                state.process.kill()
        for state in self.ranks.values():
            state.process.join(timeout=5)

    def close(self) -> None:
        self.kill_all()
        for state in self.ranks.values():
            state.conn.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    # -- what workers say ----------------------------------------------------------------
    def _drain(self, timeout: float = POLL) -> None:
        """Handle every message that arrives within ``timeout`` (wakes on a message or a
        process exit)."""
        open_conns = [s.conn for s in self.ranks.values() if not s.conn.closed]
        sentinels = [s.process.sentinel for s in self.ranks.values()]
        ready = wait([*open_conns, *sentinels], timeout=timeout)
        for conn in open_conns:
            if conn in ready:
                self._read(conn)

    def _read(self, conn: Connection) -> None:
        try:
            while conn.poll():
                self._handle(conn.recv())
        except (EOFError, OSError):
            conn.close()

    def _handle(self, message: object) -> None:
        out = self.outcome
        if isinstance(message, Relay):
            self.emit(message.event)
        elif isinstance(message, Progress):
            state = self.ranks[message.rank]
            state.step, state.phase, state.changed = message.step, message.phase, time.time()
        elif isinstance(message, Failed):
            out.failures.append(message.failure)
            out.fatal = out.fatal or message.fatal
            if message.fatal:
                message.failure.action = "aborted"
                self.ranks[message.failure.rank].finished = True
            self.emit(WorkerFailed(message.failure, message.failure.action or ""))
        elif isinstance(message, Aborted):
            out.aborted.add(message.rank)
            out.poison = out.poison or message.poison
            self.ranks[message.rank].finished = True
        elif isinstance(message, Done):
            self.ranks[message.rank].finished = True
            if message.rank == 0:
                out.done = message

    def _decided(self) -> bool:
        return self.outcome.fatal or bool(self.outcome.aborted)

    # -- what the supervisor sees for itself ----------------------------------------------
    def _check_deaths(self) -> None:
        for rank, state in self.ranks.items():
            code = state.process.exitcode
            if code is None or state.finished:
                continue
            if code in (0, worker_mod.EXIT_TOLD):
                continue
            self._read(state.conn)  # its last words may still be in the pipe
            if state.finished:
                continue
            state.finished = True
            self._record(self._death(rank, state, code))

    def _death(self, rank: int, state: RankState, code: int) -> WorkerFailure:
        sig = -code if code < 0 else None
        if sig is not None:
            name = signal.Signals(sig).name
            message = f"worker process died from signal {name}"
            if sig == signal.SIGKILL:
                message += " (SIGKILL: possibly the kernel's out-of-memory killer; check dmesg)"
        else:
            message = f"worker process exited with code {code} without a report"
        return WorkerFailure(
            worker=rank,
            rank=rank,
            device=self.config.devices[rank],
            kind="crash",
            message=message,
            phase=state.phase,
            step=state.step,
            pid=state.process.pid,
            exit_code=code if sig is None else None,
            signal=sig,
            action="aborted",
        )

    def _check_hang(self) -> None:
        running = {r: s for r, s in self.ranks.items() if not s.finished}
        if not running:
            return
        now = time.time()
        if any(now - s.changed < self._limit(s) for s in running.values()):
            return
        # Everyone stalled: the hung ones are behind (the others wait in a collective).
        behind = min((s.step, _phase_rank(s.phase)) for s in running.values())
        tied = {r: s for r, s in running.items() if (s.step, _phase_rank(s.phase)) == behind}
        stacks = {r: self._dump_stacks(r, s) for r, s in tied.items()}
        hung = [r for r in tied if not _waits_in_collective(stacks[r])] or list(tied)
        for rank in hung:
            state = tied[rank]
            self._record(self._hang(rank, state, now - state.changed, stacks[rank]))
            state.process.kill()
            state.finished = True

    def _limit(self, state: RankState) -> float:
        limit = self.config.hang_timeout.total_seconds()
        return max(limit, STARTUP_TIMEOUT) if state.phase == "start" else limit

    def _hang(self, rank: int, state: RankState, stalled: float, stacks: str) -> WorkerFailure:
        return WorkerFailure(
            worker=rank,
            rank=rank,
            device=self.config.devices[rank],
            kind="hang",
            message=f"no progress for {stalled:.1f}s in phase {state.phase} of step "
            f"{state.step} (hang_timeout {self.config.hang_timeout.total_seconds():g}s)",
            phase=state.phase,
            step=state.step,
            pid=state.process.pid,
            stacks=stacks,
            action="aborted",
        )

    def _dump_stacks(self, rank: int, state: RankState) -> str:
        path = self._stack_file(rank)
        try:
            os.kill(state.process.pid, signal.SIGUSR1)
        except ProcessLookupError:
            return "(the process was gone before its stacks could be taken)"
        deadline = time.time() + STACK_WAIT
        text = ""
        while time.time() < deadline:
            time.sleep(0.05)
            with open(path) as fh:
                text = fh.read()
            if text and "File" in text:
                time.sleep(0.05)
                with open(path) as fh:
                    return fh.read()
        return text or "(no stacks: the worker did not answer SIGUSR1)"

    def _record(self, failure: WorkerFailure) -> None:
        self.outcome.failures.append(failure)
        self.outcome.fatal = True
        self.emit(WorkerFailed(failure, "aborted"))

    def _forward_stop(self) -> None:
        if self.interrupter.should_stop() and not self.stop_sent:
            self.store.set(STOP_KEY, self.interrupter.reason or "stop requested")
            self.stop_sent = True

    def _stack_file(self, rank: int) -> str:
        return os.path.join(self.tmp, f"stacks-{rank}.txt")

    # -- the result ------------------------------------------------------------------------
    def final_model(self, path: str) -> torch.nn.Module:
        model = self.spec.build_model()
        model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        return model


_PHASE_ORDER = (
    "start",
    "preflight",
    "data",
    "forward",
    "backward",
    "metrics",
    "sync",
    "optimizer",
    "validation",
    "checkpoint",
)


def _waits_in_collective(stacks: str) -> bool:
    """Whether some thread's innermost Python frame is inside torch's distributed or
    autograd code: a rank blocked there is waiting for a peer, not hung itself."""
    innermost = []
    lines = stacks.splitlines()
    for i, line in enumerate(lines):
        if "most recent call first" in line and i + 1 < len(lines):
            innermost.append(lines[i + 1])
    return any(
        m in frame
        for frame in innermost
        for m in ("torch/distributed", "torch/autograd", "torch/nn/parallel")
    )


def _phase_rank(phase: str) -> int:
    return _PHASE_ORDER.index(phase) if phase in _PHASE_ORDER else len(_PHASE_ORDER)


def run_ddp(
    spec: TrainSpec,
    config: FitConfig,
    plan: Plan,
    train: Dataset[Any],
    valid: Dataset[Any] | None,
    valid_size: int,
    emit: Any,
    interrupter: Interrupter,
) -> Any:
    from phalanx.learner import FitResult

    started = time.time()
    sup = Supervisor(spec, config, plan, train, valid, valid_size, emit, interrupter)
    try:
        sup.start()
        outcome = sup.watch()
        if outcome.fatal or outcome.aborted or outcome.done is None:
            failures = outcome.failures or [_lost(config)]
            error = report.build(failures, poison=outcome.poison and not outcome.fatal)
            report.write_json(config.run_dir, failures, error.root_cause, config.devices)
            raise error
        done = outcome.done
        assert done.weights_path is not None
        model = sup.final_model(done.weights_path)
    finally:
        sup.close()
    interrupted = done.interrupted
    if interrupted and interrupter.reason:  # the reason as the supervisor was told it
        interrupted = f"Training interrupted: {interrupter.reason}"
    return FitResult(
        model,
        done.history,
        done.steps,
        done.epochs,
        interrupted,
        outcome.failures,
        config.run_dir,
        time.time() - started,
    )


def _lost(config: FitConfig) -> WorkerFailure:
    return WorkerFailure(
        worker=0,
        rank=0,
        device=config.devices[0],
        kind="crash",
        message="rank 0 ended without a result",
        phase="sync",
    )
