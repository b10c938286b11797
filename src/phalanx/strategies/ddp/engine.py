"""The engine of one ddp rank in one generation: the local step through DDP, then one
all-reduce (the vote), and the state hand-over when a generation forms."""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset

from phalanx import ledger
from phalanx.data import LocalBatches
from phalanx.failures import WorkerFailure, from_exception
from phalanx.faults import FaultInjector
from phalanx.loop import TrainLoop, Vote
from phalanx.plan import Plan
from phalanx.replica import Identity, Replica
from phalanx.spec import FitConfig
from phalanx.strategies.base import evaluate_local, guarded_commit
from phalanx.trainable import Trainable

PhaseHook = Callable[[int, str], None]
# failed, stop, regroup, splittable, contract, ledger fingerprint, overflow
HEAD = 6 + ledger.WIDTH
OVERFLOW = HEAD - 1  # members whose gradients overflowed ("16-mixed"): all skip the step


@dataclass
class Member:
    """What a worker keeps across generations: its replica and what it trains."""

    slot: int  # the worker's index in the devices list; its identity for life
    trainable: Trainable
    replica: Replica
    faults: FaultInjector
    device: torch.device


class DdpEngine:
    """Rank ``rank`` of ``world`` in one generation: its slice of each global batch, under a
    DDP module built over this generation's process group.

    The vote is one all-reduce of
    ``[failed, stop, regroup, splittable, contract, *ledger, overflow, *sums]``:
    a failed step costs nothing extra and metrics need no collective of their own.
    """

    def __init__(
        self,
        member: Member,
        config: FitConfig,
        plan: Plan,
        data: tuple[Dataset[Any], Dataset[Any] | None, int],
        rank: int,
        world: int,
        on_phase: PhaseHook,
        regroup_requested: Callable[[], bool],
        init_sync: bool = True,
    ) -> None:
        self.m, self.config, self.plan = member, config, plan
        self.train, self.valid, self.valid_size = data
        self.rank, self.world = rank, world
        self.is_main = rank == 0
        self.device = member.device
        ids = [self.device.index] if self.device.type == "cuda" else None
        # Buffers are not synced in forward: a zero pass after a failed forward would
        # otherwise run that collective twice on one rank. They are synced at commit instead.
        # A later generation's members get their state from hand_over, not from rank 0 (which
        # may be the one behind): no sync at construction then.
        ddp = DistributedDataParallel(
            member.trainable.module,
            device_ids=ids,
            forward_sync_buffers=False,
            init_sync=init_sync,
        )
        self.ddp: DistributedDataParallel | None = ddp  # None once the group is left
        replica = member.replica
        replica.forward, replica.world, replica.identity.rank = ddp, world, rank
        self.on_phase = on_phase
        self.regroup_requested = regroup_requested
        self.micro = member.trainable.micro_batches
        self.has_buffers = any(True for _ in member.trainable.model.buffers())
        self.batches: LocalBatches | None = None
        self.epoch = 0
        self.step = 0

    @property
    def trainable(self) -> Trainable:
        return self.m.trainable

    @property
    def identity(self) -> Identity:
        return self.m.replica.identity

    def begin_epoch(self, epoch: int, start_step: int) -> None:
        self.epoch = epoch
        self.batches = LocalBatches(
            self.train, self.plan, epoch, start_step, self.rank, self.world, self.config.loading()
        )

    def attempt(self, epoch: int, step: int, global_step: int, stop: Callable[[], bool]) -> Vote:
        assert self.batches is not None
        self.step = global_step
        res = self.m.replica.run(
            self.batches.loader(step),
            self.batches.indices(step),
            self.batches.global_size(step),
            global_step,
            epoch,
            self.micro,
        )
        self.on_phase(global_step, "sync")
        try:
            self.m.faults.check(global_step, "sync")
        except Exception as exc:  # before the vote: this rank just votes failed
            res.ledger = ledger.EMPTY
            if res.failure is None:  # (else the step's own failure is already the unvoted one)
                failure = self._failure(exc, "sync")
                failure.sample_indices = list(self.batches.indices(step))
                res.failure, res.splittable = failure, False
                self.m.replica.unvoted, self.m.replica.unvoted_splittable = res.failure, False
        failed, splittable, *computed = res.vote_head()
        contract = float(res.failure is not None and res.failure.breaks_step_contract)
        regroup = float(self.regroup_requested())
        # After backward DDP has reduced the gradients: every member finds the same overflow.
        overflow = float(res.failure is None and self.trainable.overflowed())
        head = [failed, float(stop()), regroup, splittable, contract, *computed, overflow]
        vote = torch.cat([torch.tensor(head, dtype=torch.float64), res.sums]).to(self.device)
        dist.all_reduce(vote)
        self.m.replica.unvoted = None  # the vote carries it from here
        v = vote.cpu()
        if v[0].item() == 0:  # every member commits: a death from here fails no attempt
            self.on_phase(global_step, "optimizer")
        return Vote(
            failed=int(v[0].item()),
            stop=bool(v[1].item() > 0),
            regroup=bool(v[2].item() > 0),
            splittable=int(v[3].item()),
            contract=int(v[4].item()),
            ledger=cast(ledger.Fingerprint, tuple(v[5:OVERFLOW].tolist())),
            overflow=int(v[OVERFLOW].item()),
            sums=v[HEAD:],
            failures=[res.failure] if res.failure else [],
        )

    def commit(self, skip: bool = False) -> None:
        """Buffers first (a collective that can still fail with nothing changed), then the
        optimizer: once it has stepped, nothing here can fail because of a peer, so a step
        is never applied on one member and then computed again after a regroup. (The
        heartbeat for phase ``optimizer`` went when the vote came back all ok.)"""
        if self.has_buffers:
            for buf in self.trainable.model.buffers():
                dist.broadcast(buf, src=0)
        guarded_commit(
            self.trainable, self.m.faults, self.m.replica.identity, self.step, self.epoch, skip
        )

    def end_epoch(self) -> None:
        self.trainable.end_epoch()

    def discard(self) -> None:
        self.trainable.discard()

    def evaluate(self) -> torch.Tensor:
        self.on_phase(self.step, "validation")
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
        dist.all_reduce(sums)
        return sums.cpu()

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


def hand_over(loop: TrainLoop, rank: int, device: torch.device, timeout: timedelta) -> int:
    """When a generation forms: agree on the furthest position (committed steps, then
    finished epochs: a validation pass that completed on some members only leaves the
    others an epoch behind at the same step), and give the members that are behind it (a
    replacement; a member that had not committed the last step) the full state (model,
    optimizer, scheduler, loop state, metric sums, RNG) of the lowest rank that has it.
    Returns that rank. Collectives over the new group, every member in each.

    Members at the furthest position hold the same state already (every member applies
    the same reduced gradients), so a shrink moves no state at all. The state travels
    tensor by tensor (its structure, without the tensors, as one pickled object first), to
    the members that need it only: nobody holds a pickled copy of the whole state. All wait
    for the transfer to end (a barrier), so nobody enters a step's collectives while a peer
    is still receiving."""
    world = dist.get_world_size()
    where = torch.zeros(2 * world, dtype=torch.float64, device=device)
    where[2 * rank : 2 * rank + 2] = torch.tensor(
        [float(loop.state.global_step), float(loop.state.epoch)], dtype=torch.float64
    )
    dist.all_reduce(where)  # every member's (committed steps, finished epochs)
    position = [(where[2 * r].item(), where[2 * r + 1].item()) for r in range(world)]
    top = max(position)
    src = min(r for r in range(world) if position[r] == top)
    behind = [r for r in range(world) if position[r] < top]
    if not behind:
        return src
    ranks = sorted([src, *behind])
    group = None if len(ranks) == world else dist.new_group(ranks, timeout=timeout)
    if rank in ranks:
        _transfer(loop, rank, src, device, group)
    if group is not None:
        dist.destroy_process_group(group)
    dist.barrier()
    return src


def _transfer(
    loop: TrainLoop, rank: int, src: int, device: torch.device, group: dist.ProcessGroup | None
) -> None:
    """``src``'s snapshot to the other members of ``group``: the skeleton, then each tensor
    (on this member's device while it travels; a CPU tensor goes back to the CPU)."""
    skeleton, tensors = split_tensors(loop.snapshot()) if rank == src else (None, [])
    payload = [skeleton]
    dist.broadcast_object_list(payload, src=src, group=group, device=device)
    shape = payload[0]
    for slot in tensor_slots(shape):
        if rank == src:
            buf = tensors[slot.index].to(device).contiguous()
        else:
            buf = torch.empty(slot.shape, dtype=slot.dtype, device=device)
        dist.broadcast(buf, src=src, group=group)
        if rank != src:
            tensors.append(buf if slot.device.startswith("cuda") else buf.to(slot.device))
    if rank != src:
        loop.restore(fill_tensors(shape, tensors))


@dataclass(frozen=True)
class TensorSlot:
    """Where a tensor was in a state being handed over: its index, shape, type, device."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: str


def map_leaves(obj: Any, fn: Callable[[Any], Any]) -> Any:
    """``obj`` rebuilt with ``fn`` applied to each leaf: dicts, lists and plain tuples are
    walked (a module's state dict keeps its ``_metadata``), everything else is a leaf."""
    if isinstance(obj, dict):
        items = [(k, map_leaves(v, fn)) for k, v in obj.items()]
        out: Any = OrderedDict(items) if isinstance(obj, OrderedDict) else dict(items)
        if hasattr(obj, "_metadata"):
            out._metadata = obj._metadata
        return out
    if isinstance(obj, list):
        return [map_leaves(v, fn) for v in obj]
    if type(obj) is tuple:
        return tuple(map_leaves(v, fn) for v in obj)
    return fn(obj)


def split_tensors(state: Any) -> tuple[Any, list[torch.Tensor]]:
    """``state`` with each tensor replaced by a :class:`TensorSlot`, and the tensors."""
    tensors: list[torch.Tensor] = []

    def take(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        tensors.append(leaf)
        return TensorSlot(len(tensors) - 1, tuple(leaf.shape), leaf.dtype, str(leaf.device))

    return map_leaves(state, take), tensors


def tensor_slots(skeleton: Any) -> list[TensorSlot]:
    found: list[TensorSlot] = []
    map_leaves(skeleton, lambda leaf: found.append(leaf) if isinstance(leaf, TensorSlot) else None)
    return sorted(found, key=lambda s: s.index)


def fill_tensors(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """The inverse of :func:`split_tensors`."""
    return map_leaves(
        skeleton, lambda leaf: tensors[leaf.index] if isinstance(leaf, TensorSlot) else leaf
    )
