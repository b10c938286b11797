"""The engine of one ddp rank: the local step through DDP, then one all-reduce (the vote)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset

from phalanx.data import LocalBatches
from phalanx.failures import from_exception
from phalanx.faults import FaultInjector
from phalanx.loop import Vote
from phalanx.plan import Plan
from phalanx.replica import Identity, Replica
from phalanx.spec import FitConfig, TrainSpec
from phalanx.strategies.base import evaluate_local, guarded_commit
from phalanx.trainable import Trainable

PhaseHook = Callable[[int, str], None]


class DdpEngine:
    """Rank ``rank`` of ``world``: computes its slice of each global batch under DDP.

    The vote is one all-reduce of ``[failed, stop, *metric sums]``: a failed step costs
    nothing extra and metrics need no collective of their own.
    """

    def __init__(
        self,
        spec: TrainSpec,
        config: FitConfig,
        plan: Plan,
        train: Dataset[Any],
        valid: Dataset[Any] | None,
        valid_size: int,
        rank: int,
        world: int,
        device: torch.device,
        on_phase: PhaseHook,
    ) -> None:
        self.config, self.plan, self.train, self.valid, self.valid_size = (
            config,
            plan,
            train,
            valid,
            valid_size,
        )
        self.rank, self.world, self.device = rank, world, device
        self.is_main = rank == 0
        self.trainable = Trainable(spec, device, config.seed)
        ids = [device.index] if device.type == "cuda" else None
        # Buffers are not broadcast in forward: a zero pass after a failed forward would
        # otherwise run that collective twice on one rank. They are synced at commit instead.
        self.ddp = DistributedDataParallel(
            self.trainable.module, device_ids=ids, forward_sync_buffers=False
        )
        self.identity = Identity(worker=rank, rank=rank, device=config.devices[rank])
        self.faults = FaultInjector(config.faults, rank)
        self.on_phase = on_phase
        self.replica = Replica(
            self.trainable.module,
            device,
            self.identity,
            spec.summed_metrics(),
            self.faults,
            forward=self.ddp,
            world=world,
            on_phase=on_phase,
        )
        self.micro = spec.grad_accumulation
        self.has_buffers = any(True for _ in self.trainable.model.buffers())
        self.batches: LocalBatches | None = None
        self.epoch = 0
        self.step = 0

    def begin_epoch(self, epoch: int, start_step: int) -> None:
        self.epoch = epoch
        self.batches = LocalBatches(
            self.train, self.plan, epoch, start_step, self.rank, self.world, self.config.num_workers
        )

    def attempt(self, epoch: int, step: int, global_step: int, stop: bool) -> Vote:
        assert self.batches is not None
        self.step = global_step
        res = self.replica.run(
            self.batches.loader(step),
            self.batches.indices(step),
            self.batches.global_size(step),
            global_step,
            epoch,
            self.micro,
        )
        self.on_phase(global_step, "sync")
        try:
            self.faults.check(global_step, "sync")
        except Exception as exc:  # before the vote: this rank just votes failed
            res.failure = res.failure or self._failure(exc, "sync")
        failed = res.failure is not None
        head = torch.tensor([float(failed), float(stop)], dtype=torch.float64)
        vote = torch.cat([head, res.sums]).to(self.device)
        dist.all_reduce(vote)
        vote = vote.cpu()
        return Vote(
            failed=int(vote[0].item()),
            stop=bool(vote[1].item() > 0),
            sums=vote[2:],
            failures=[res.failure] if res.failure else [],
        )

    def commit(self) -> None:
        self.on_phase(self.step, "optimizer")
        guarded_commit(self.trainable, self.faults, self.identity, self.step, self.epoch)
        if self.has_buffers:
            for buf in self.trainable.model.buffers():
                dist.broadcast(buf, src=0)

    def discard(self) -> None:
        self.trainable.discard()

    def evaluate(self) -> torch.Tensor:
        self.on_phase(self.step, "validation")
        sums = evaluate_local(
            self.replica,
            self.valid,
            self.valid_size,
            self.config.batch_size,
            self.rank,
            self.world,
            self.epoch,
        ).to(self.device)
        dist.all_reduce(sums)
        return sums.cpu()

    def lr(self) -> float:
        return self.trainable.lr()

    def state_dict(self) -> dict[str, Any]:
        return self.trainable.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.trainable.load_state_dict(state)

    def _failure(self, exc: BaseException, phase: str) -> Any:
        return from_exception(
            exc,
            worker=self.rank,
            rank=self.rank,
            device=self.identity.device,
            phase=phase,
            step=self.step,
            epoch=self.epoch,
            pid=os.getpid(),
        )
