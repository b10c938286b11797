"""``strategy="single"``: one replica in the caller's process."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from phalanx.badsamples import PLAIN, Twist
from phalanx.data import LocalBatches
from phalanx.devices import torch_device
from phalanx.faults import FaultInjector
from phalanx.loop import Vote
from phalanx.ranks import acting_as
from phalanx.replica import Identity, Replica
from phalanx.run import RunInputs
from phalanx.strategies.base import evaluate_local, guarded_commit, member_vote, run_attempt
from phalanx.trainable import Trainable


class SingleEngine:
    """The whole global batch on one device; the vote is this replica's own result."""

    is_main = True
    rank = 0
    can_leave = False
    saves_shards = False

    def __init__(self, run: RunInputs) -> None:
        config, spec = run.config, run.spec
        label = config.devices[0]
        device = torch_device(label)
        self.config, self.plan = config, run.plan
        self.train, self.valid, self.valid_size = run.train, run.valid, run.valid_size
        with acting_as(0, 1):  # (px.rank() in the model factory)
            self.trainable = Trainable(spec, device, config.seed)
        self.identity = Identity(worker=0, rank=0, device=label)
        self.faults = FaultInjector(config.faults, 0)
        self.replica = Replica(
            self.trainable.module, device, self.identity, spec.summed_metrics(), self.faults
        )
        self.micro = spec.grad_accumulation
        self.replica.nan_is_data = config.on_bad_sample == "skip"
        self.batches: LocalBatches | None = None
        self.epoch = 0
        self.step = 0

    def begin_epoch(self, epoch: int, start_step: int) -> None:
        self.epoch = epoch
        self.batches = LocalBatches(
            self.train, self.plan, epoch, start_step, 0, 1, self.config.loading()
        )

    def reshare(self, shares: list[float], epoch: int, start_step: int) -> None:
        """One member computes every step whole: nothing to re-cut."""

    def attempt(
        self,
        epoch: int,
        step: int,
        global_step: int,
        stop: Callable[[], bool],
        twist: Twist = PLAIN,
    ) -> Vote:
        assert self.batches is not None
        self.step = global_step
        at = (step, global_step, epoch)
        res = run_attempt(self.replica, self.batches, at, self.micro, twist, (0, 1))
        overflow = res.failure is None and self.trainable.overflowed()
        return member_vote(res, stop(), overflow=overflow)

    def commit(self, skip: bool = False) -> None:
        guarded_commit(self.trainable, self.faults, self.identity, self.step, self.epoch, skip)

    def end_epoch(self) -> None:
        self.trainable.end_epoch()

    def discard(self) -> None:
        self.trainable.discard()

    def evaluate(self) -> torch.Tensor:
        return evaluate_local(
            self.replica,
            self.valid,
            self.valid_size,
            self.config.batch_size,
            0,
            1,
            self.epoch,
            self.config.loading(),
        )

    def lr(self) -> float:
        return self.trainable.lr()

    def state_dict(self) -> dict[str, Any]:
        return self.trainable.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.trainable.load_state_dict(state)

    def final_model(self) -> torch.nn.Module:
        return self.trainable.model.to("cpu")
