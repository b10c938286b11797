"""The engine of one ddp rank in one generation: the local step through DDP, whose gradient
all-reduce also carries the step's vote (:mod:`phalanx.strategies.ddp.worker.ballot`); every
collective over the generation's own group."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset

from phalanx.badsamples import PLAIN, Twist
from phalanx.data import LocalBatches
from phalanx.devices import torch_device
from phalanx.failures import WorkerFailure, from_exception
from phalanx.faults import FaultInjector
from phalanx.loop import VOTE_HEAD, Vote, unpack_vote, vote_values
from phalanx.plan import Plan
from phalanx.ranks import acting_as
from phalanx.replica import Cast, Identity, LocalResult, Replica
from phalanx.spec import FitConfig, TrainSpec
from phalanx.strategies.base import evaluate_local, guarded_commit, member_vote, run_attempt
from phalanx.strategies.ddp.worker.ballot import Ballot, BallotBox
from phalanx.strategies.ddp.worker.group import GenerationGroup, GroupBroken
from phalanx.trainable import Trainable

PhaseHook = Callable[[int, str], None]


@dataclass
class Member:
    """What a worker keeps across generations: its replica and what it trains."""

    slot: int  # the worker's index in the devices list; its identity for life
    trainable: Trainable
    replica: Replica
    faults: FaultInjector
    device: torch.device
    # fsdp: this member's shards of the committed state, kept when it left a generation
    # (the next one's model is built again, on that generation's group, and takes them)
    kept: dict[str, Any] | None = None

    @classmethod
    def build(
        cls, spec: TrainSpec, config: FitConfig, slot: int, faults_after: int, on_phase: PhaseHook
    ) -> Member:
        """The replica of worker ``slot`` on its device (the model factory runs here). A
        replacement fires only the faults after ``faults_after``, its predecessor's fall."""
        label = config.devices[slot]
        device = torch_device(label)
        with acting_as(slot, len(config.devices)):  # (px.rank() in the model factory)
            trainable = Trainable(spec, device, config.seed)
        faults = FaultInjector([f for f in config.faults if f.step > faults_after], slot)
        identity = Identity(worker=slot, rank=slot, device=label)
        metrics = spec.summed_metrics()
        replica = Replica(
            trainable.module,
            device,
            identity,
            metrics,
            faults,
            on_phase=on_phase,
            members=len(config.devices),  # (px.world_size() in preflight: as planned)
        )
        return cls(slot, trainable, replica, faults, device)


@dataclass(frozen=True)
class EngineHooks:
    """What the engine tells its worker, and asks it."""

    on_phase: PhaseHook  # the heartbeat
    regroup_requested: Callable[[], bool]  # a newer generation waits


class DdpEngine:
    """Rank ``group.rank`` of ``group.size`` in one generation: its slice of each global
    batch, under a DDP module built over this generation's group.

    The vote (:func:`phalanx.loop.vote_values`) is cast by :meth:`launch` right before the
    synchronised backward, as a gradient DDP reduces with the model's
    (:class:`~phalanx.strategies.ddp.worker.ballot.Ballot`), and counted after it: no
    collective of its own; a failed step costs nothing extra and metrics need none either.
    """

    can_leave = True  # (a member at fault leaves: respawned or shrunk)
    saves_shards = False  # (the main member saves the whole state)

    def __init__(
        self,
        *,
        member: Member,
        group: GenerationGroup,
        config: FitConfig,
        plan: Plan,
        data: tuple[Dataset[Any], Dataset[Any] | None, int],
        hooks: EngineHooks,
        init_sync: bool,
    ) -> None:
        self.m, self.group, self.config, self.plan = member, group, config, plan
        self.train, self.valid, self.valid_size = data
        self.rank, self.world = group.rank, group.size
        self.is_main = self.rank == 0
        self.device = member.device
        # A later generation's members get their state from the hand-over, not from rank 0
        # (which may be the one behind): no sync at construction then.
        self.ddp: DistributedDataParallel | None = None  # None once the group is left
        self.ballot: BallotBox
        forward = self._wrap(VOTE_HEAD + member.replica.size, init_sync)
        replica = member.replica
        replica.forward, replica.world, replica.identity.rank = forward, self.world, self.rank
        replica.members = self.world
        self.hooks = hooks
        self.micro = member.trainable.micro_batches
        self.has_buffers = any(True for _ in member.trainable.model.buffers())
        self.batches: LocalBatches | None = None
        self.shares: list[float] | None = None  # this generation's (None: even; balance)
        self.epoch = 0
        self.step = 0
        # The attempt in progress: its stop request, and this member's own vote once cast.
        self._stop: Callable[[], bool] = lambda: False
        self._pending: Vote | None = None
        # Set by the loop: whether a failure repeats an earlier attempt's (it rides in the
        # vote, so every member knows the evidence against the batch; phalanx.badsamples).
        self.judge: Callable[[WorkerFailure], bool] | None = None
        member.replica.nan_is_data = config.on_bad_sample == "skip"

    def _wrap(self, size: int, init_sync: bool) -> nn.Module:
        """What runs a step on this member: the replica's step module and the vote's box
        (for votes of ``size`` values), under DDP over this generation's group."""
        self.ballot = Ballot(self.m.trainable.module, self.rank, self.world, size, self.device)
        self.ddp = self.group.wrap(self.ballot, init_sync=init_sync)
        return self.ddp

    @property
    def trainable(self) -> Trainable:
        return self.m.trainable

    @property
    def identity(self) -> Identity:
        return self.m.replica.identity

    def begin_epoch(self, epoch: int, start_step: int) -> None:
        self.epoch = epoch
        self.batches = LocalBatches(
            self.train,
            self.plan,
            epoch,
            start_step,
            self.rank,
            self.world,
            self.config.loading(),
            self.shares,
        )

    def reshare(self, shares: list[float], epoch: int, start_step: int) -> None:
        """Every member's share of each global batch from ``start_step`` of ``epoch`` on
        (decided alike on every member: :mod:`phalanx.balance`)."""
        self.shares = shares
        self.begin_epoch(epoch, start_step)

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
        self._stop, self._pending = stop, None
        at, member = (step, global_step, epoch), (self.rank, self.world)
        res = run_attempt(self.m.replica, self.batches, at, self.micro, twist, member, self)
        mine, self._pending = self._pending, None
        if res.broken:  # no vote on a broken group: leave it (the failure is the peer's)
            raise GroupBroken(f"step {global_step + 1}: {res.failure and res.failure.message}")
        if res.after_vote:  # the vote said ok: leaving is what keeps the peers from committing
            raise GroupBroken(
                f"step {global_step + 1}: this member failed after its vote left "
                f"({res.failure and res.failure.message})"
            )
        assert mine is not None, "Replica.run returned without launching the vote"
        self.m.replica.unvoted = None  # the vote carries it from here
        vote = unpack_vote(self.ballot.count(), mine.failures)
        vote.read_rows(self.ballot.rows(VOTE_HEAD))  # (each member's own: paces, bad samples)
        # Only read when nobody failed: then every member checks (see _overflowed).
        if vote.failed == 0:
            if self._overflowed():
                vote.overflow = self.world
            self._before_commit()
            # every member commits: a death from here fails no attempt
            self.hooks.on_phase(global_step, "optimizer")
        return vote

    def _overflowed(self) -> bool:
        """Under "16-mixed", whether the step's gradients overflowed (unscaling them): after
        backward DDP has reduced them, every member holds the same ones (what keeps DDP's
        replicas equal), so each finds the same overflow, counted for every member."""
        return self.trainable.overflowed()

    def _before_commit(self) -> None:
        """What the members agree on before any commits, after a vote with no failure (a
        collective that fails here raises GroupBroken with nothing changed): nothing under
        ddp, whose gradients are whole on every member."""

    # -- the vote (VoteLaunch: called by Replica.run right before the synchronised backward)
    def check(self) -> None:
        """Phase ``sync``: an injected fault here fails this attempt before the vote left."""
        self.m.faults.check(self.step, "sync")

    def launch(self, result: LocalResult) -> Cast:
        """This member's vote on ``result``, as the second root of the backward that carries
        it through the backward's all-reduce; counted after the backward (:meth:`attempt`).
        The stop and regroup requests are read here (flags: nothing here waits or fails on
        a peer, so the vote needs no failure path of its own)."""
        failure = result.failure
        repeated = failure is not None and self.judge is not None and self.judge(failure)
        regroup = self.hooks.regroup_requested()
        self._pending = member_vote(result, self._stop(), regroup, repeated=repeated)
        return self.ballot.cast(vote_values(self._pending))

    def commit(self, skip: bool = False) -> None:
        """Buffers first (a collective that can still fail with nothing changed), then the
        optimizer: once it has stepped, nothing here can fail because of a peer, so a step
        is never applied on one member and then computed again after a regroup. (The
        heartbeat for phase ``optimizer`` went when the vote came back all ok.)"""
        if self.has_buffers:
            for buf in self.trainable.model.buffers():
                self.group.broadcast(buf, src=0)
        guarded_commit(
            self.trainable, self.m.faults, self.m.replica.identity, self.step, self.epoch, skip
        )

    def end_epoch(self) -> None:
        self.trainable.end_epoch()

    def discard(self) -> None:
        self.trainable.discard()

    def evaluate(self) -> torch.Tensor:
        self.hooks.on_phase(self.step, "validation")
        sums = evaluate_local(
            self.m.replica,
            self.valid,
            self.valid_size,
            self.config.batch_size,
            self.rank,
            self.world,
            self.epoch,
            self.config.loading(),
        ).to(self.device)
        self._after_validation()
        self.group.all_reduce(sums)
        return sums.cpu()

    def _after_validation(self) -> None:
        """What every member does after its validation batches, before the sums' all-reduce:
        nothing under ddp (validation has no collective of its own)."""

    def lr(self) -> float:
        return self.trainable.lr()

    def state_dict(self) -> dict[str, Any]:
        return self.trainable.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.trainable.load_state_dict(state)

    def _failure(self, exc: BaseException, phase: str) -> WorkerFailure:
        who = self.m.replica.identity
        return from_exception(
            exc,
            worker=who.worker,
            rank=who.rank,
            device=who.device,
            phase=phase,
            step=self.step,
            epoch=self.epoch,
            pid=os.getpid(),
        )
