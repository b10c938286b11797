"""Starting a slot's worker on this machine: the same on the head and on every node's
agent (each builds the worker's arguments from its own ``fit`` call's parts: the same
script runs on every node)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from torch.utils.data import Dataset

from phalanx.plan import Plan
from phalanx.spec import FitConfig, TrainSpec
from phalanx.strategies.ddp.agent.agent import Agent
from phalanx.strategies.ddp.wire.messages import SpawnOrder
from phalanx.strategies.ddp.worker import worker as worker_mod

__all__ = ["SpawnOrder", "Spawner"]


class Spawner:
    """The user's parts and this machine's agent: starts workers as ordered."""

    def __init__(
        self,
        spec: TrainSpec,
        config: FitConfig,
        plan: Plan,
        data: tuple[Dataset[Any], Dataset[Any] | None, int],
        agent: Agent,
        local_slots: int,
        first_slot: int = 0,
    ) -> None:
        self.config, self.plan, self.data, self.agent = config, plan, data, agent
        self.here = tuple(range(first_slot, first_slot + local_slots))  # this machine's
        self.user = worker_mod.pack_user(spec)  # unpickled by each worker (see WorkerArgs)
        cpu = sum(1 for d in config.devices if d.startswith("cpu"))
        cpu_here = min(cpu, local_slots) if cpu else 0
        self.threads = max(1, (os.cpu_count() or 1) // max(1, cpu_here))

    def spawn(self, order: SpawnOrder) -> int | None:
        config = self.config
        restart = order.restart_after is not None
        if restart:  # (it passed preflight before)
            config = dataclasses.replace(config, preflight=False)
        agent = self.agent
        folder = agent.snapshot_folder() if config.snapshots is not None else None
        train, valid, valid_size = self.data
        assert agent.store_at is not None

        def make_args(conn: Any, stack_file: str, heartbeat: Any) -> worker_mod.WorkerArgs:
            assert agent.store_at is not None
            return worker_mod.WorkerArgs(
                slot=order.slot,
                store_port=agent.store_at[1],
                store_host=agent.store_at[0],
                store_prefix=agent.prefix,
                local_slots=self.here,
                token=agent.signer.token,
                user=self.user,
                config=config,
                plan=self.plan,
                train=train,
                valid=valid,
                valid_size=valid_size,
                conn=conn,
                parent_pid=os.getpid(),
                stack_file=stack_file,
                weights_path=os.path.join(agent.tmp, f"final-{order.slot}.pt"),
                threads=self.threads,
                timing=agent.timing,
                replacement=order.replacement,
                faults_after=order.faults_after,
                after_generation=-1 if order.restart_after is None else order.restart_after,
                restart=restart,
                snapshot_dir=folder,
                environ=dict(os.environ),
                heartbeat=heartbeat,
            )

        name = f"phalanx-worker-{order.slot}" + ("-replacement" if order.replacement else "")
        return agent.spawn(order.slot, name, worker_mod.main, make_args)
