"""A ddp worker process: one device, one rank.

Order of work: ignore SIGINT (the supervisor decides), register faulthandler on SIGUSR1
(the supervisor asks for stacks of a hung worker), watch the parent and the control keys,
preflight (one isolated forward/backward: no collective can hang on a shape bug), join the
process group, wrap the model in DDP, run the loop, report.

Exit codes: 0 done or stopped by the step policy (an :class:`Aborted` was sent), 1 failed
(a :class:`Failed` was sent, fatal).
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from phalanx.devices import torch_device
from phalanx.events import Event
from phalanx.failures import FailedHere, WorkerFailure, from_exception
from phalanx.faults import FaultInjector
from phalanx.loop import StepAborted
from phalanx.plan import Plan
from phalanx.replica import Identity, Replica
from phalanx.runner import build_loop, make_checkpointer, run_member
from phalanx.spec import FitConfig, TrainSpec
from phalanx.strategies.ddp.engine import DdpEngine
from phalanx.strategies.ddp.protocol import (
    ABORT_KEY,
    STOP_KEY,
    Aborted,
    Done,
    Failed,
    Progress,
    Relay,
)

WATCH_INTERVAL = 0.1
EXIT_TOLD = 3  # exited because the supervisor said the run is over (not a failure)


@dataclass
class WorkerArgs:
    rank: int
    world: int
    store_port: int
    prefix: str
    spec: TrainSpec
    config: FitConfig
    plan: Plan
    train: Dataset[Any]
    valid: Dataset[Any] | None
    valid_size: int
    conn: Any  # write end of this worker's pipe to the supervisor
    parent_pid: int
    stack_file: str
    weights_path: str
    threads: int


class Worker:
    def __init__(self, args: WorkerArgs) -> None:
        self.a = args
        self.label = args.config.devices[args.rank]
        self.device = torch_device(self.label)
        self.stop_reason: str | None = None
        self.step = 0
        self.phase = "preflight"
        self.lock = threading.Lock()  # the checkpointer thread sends events too

    # -- messages ----------------------------------------------------------------------
    def send(self, message: object) -> None:
        """Written to the pipe before returning: survives this process's sudden death."""
        with self.lock:
            self.a.conn.send(message)

    def on_phase(self, step: int, phase: str) -> None:
        self.step, self.phase = step, phase
        self.send(Progress(self.a.rank, step, phase, time.time()))

    def emit(self, event: Event) -> None:
        self.send(Relay(event))

    def failure(self, exc: BaseException, phase: str) -> WorkerFailure:
        return from_exception(
            exc,
            worker=self.a.rank,
            rank=self.a.rank,
            device=self.label,
            phase=phase,
            step=self.step,
            epoch=None,
            pid=os.getpid(),
        )

    # -- the watch thread: parent gone, abort or stop asked --------------------------------
    def watch(self, store: dist.TCPStore) -> None:
        while True:
            time.sleep(WATCH_INTERVAL)
            if os.getppid() != self.a.parent_pid:
                os._exit(1)  # the supervisor died: no orphans
            try:
                keys = [ABORT_KEY, STOP_KEY]
                present = [k for k in keys if store.check([k])]
            except Exception:
                os._exit(1)  # the store (the supervisor) is unreachable
            if ABORT_KEY in present:
                os._exit(EXIT_TOLD)
            if STOP_KEY in present and self.stop_reason is None:
                self.stop_reason = store.get(STOP_KEY).decode()

    # -- the run -------------------------------------------------------------------------
    def preflight(self) -> None:
        """One forward and backward on this rank's first slice, alone, gradients discarded."""
        cfg = self.a.config
        self.on_phase(0, "preflight")
        probe_device = self.device
        from phalanx.trainable import Trainable

        trainable = Trainable(self.a.spec, probe_device, cfg.seed)
        faults = FaultInjector(cfg.faults, self.a.rank)
        replica = Replica(
            trainable.module,
            probe_device,
            Identity(self.a.rank, self.a.rank, self.label),
            self.a.spec.summed_metrics(),
            faults,
        )
        first = self.a.plan.local_batch(0, 0, self.a.rank, self.a.world)
        from torch.utils.data import default_collate

        faults.check(0, "preflight")
        result = replica.run(
            lambda: default_collate([self.a.train[i] for i in first]),
            first,
            len(self.a.plan.global_batch(0, 0)),
            0,
            0,
        )
        if result.failure is not None:
            result.failure.phase = "preflight"
            raise FailedHere(result.failure)
        del trainable, replica

    def run(self) -> int:
        a, cfg = self.a, self.a.config
        store = dist.TCPStore(
            "127.0.0.1", a.store_port, is_master=False, timeout=timedelta(seconds=30)
        )
        threading.Thread(target=self.watch, args=(store,), daemon=True).start()
        if self.device.type == "cpu":
            torch.set_num_threads(a.threads)
        else:
            torch.cuda.set_device(self.device)
        try:
            if cfg.preflight:
                self.preflight()
            self.on_phase(0, "sync")
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            timeout = cfg.hang_timeout * 2 + timedelta(seconds=30)
            dist.init_process_group(
                backend,
                store=dist.PrefixStore(a.prefix, store),
                rank=a.rank,
                world_size=a.world,
                timeout=timeout,
            )
            engine = DdpEngine(
                a.spec,
                cfg,
                a.plan,
                a.train,
                a.valid,
                a.valid_size,
                a.rank,
                a.world,
                self.device,
                self.on_phase,
            )
            emit = self.emit if a.rank == 0 else _drop
            checkpointer = make_checkpointer(cfg, emit) if a.rank == 0 else None
            loop = build_loop(
                engine,
                a.spec,
                cfg,
                a.plan,
                emit,
                lambda: self.stop_reason,
                a.rank,
                a.valid is not None,
                checkpointer,
                on_failure=lambda f: self.send(Failed(f, fatal=False)),
            )
            run = run_member(loop, a.plan, cfg, emit, a.plan.samples, a.valid_size)
        except StepAborted as exc:
            self.send(Aborted(a.rank, exc.step, exc.poison))
            return 0
        except FailedHere as exc:
            self.send(Failed(exc.failure, fatal=True))
            return 1
        except Exception as exc:
            self.send(Failed(self.failure(exc, self.phase), fatal=True))
            return 1
        done = Done(a.rank)
        if a.rank == 0:
            torch.save(engine.trainable.model.state_dict(), a.weights_path)
            st = run.loop.state
            done = Done(
                0, a.weights_path, st.history, st.global_step, st.epoch, run.loop.interrupted
            )
        self.send(done)
        dist.destroy_process_group()
        return 0


def main(args: WorkerArgs) -> None:
    """Entry point of a spawned worker."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stacks = open(args.stack_file, "w")  # noqa: SIM115 - kept open for faulthandler
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    code = Worker(args).run()
    args.conn.close()
    sys.stdout.flush()
    os._exit(code)


def _drop(event: Event) -> None:
    return None
