"""Pieces every engine shares: evaluation of the validation split, guarded commits."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import Dataset

from phalanx.badsamples import Twist
from phalanx.data import Loading, LocalBatches, validation_batches
from phalanx.failures import FailedHere, failure_of
from phalanx.faults import FaultInjector
from phalanx.loop import Vote
from phalanx.replica import Identity, LocalResult, Replica, VoteLaunch
from phalanx.trainable import Trainable


def evaluate_local(
    replica: Replica,
    valid: Dataset[Any] | None,
    valid_size: int,
    batch_size: int,
    member: int,
    members: int,
    epoch: int,
    loading: Loading | None = None,
) -> torch.Tensor:
    """This member's metric sums over its part of the validation set."""
    sums = torch.zeros(replica.size, dtype=torch.float64)
    if valid is None:
        return sums
    parts = [b for b in validation_batches(valid_size, batch_size, member, members) if b]
    replica.module.eval()
    try:
        replica.faults.check(replica.step, "validation")
        loader = (loading or Loading()).batches(valid, parts)
        for idx, batch in zip(parts, loader, strict=True):
            sums += replica.evaluate(batch, len(idx))
    except Exception as exc:
        raise FailedHere(failure_of(exc, replica.identity, "validation", None, epoch)) from exc
    finally:
        replica.module.train()
    return sums


def run_attempt(
    replica: Replica,
    batches: LocalBatches,
    at: tuple[int, int, int],
    micro: int,
    twist: Twist,
    member: tuple[int, int],
    vote: VoteLaunch | None = None,
) -> LocalResult:
    """One member's attempt of step ``at = (step, global_step, epoch)``: its slice of the
    plan, or, for an attempt with a :class:`~phalanx.badsamples.Twist`, part ``(rank -
    rotation) % members`` of ``member = (rank, members)`` without the samples left out
    (read directly), bisecting a failed part when the twist says so."""
    step, global_step, epoch = at
    if twist.plain:
        return replica.run_step(batches, step, global_step, epoch, micro, vote)
    rank, members = member
    part = (rank - twist.rotation) % members
    samples, kept = batches.twisted(step, part, members, twist.leave_out)
    replica.bisect = batches.direct if part in twist.bisect else None
    try:
        load = functools.partial(batches.direct, samples) if samples else None
        return replica.run(load, samples, kept, global_step, epoch, micro, vote)
    finally:
        replica.bisect = None


def member_vote(
    result: LocalResult,
    stop: bool,
    regroup: bool = False,
    overflow: bool = False,
    repeated: bool = False,
) -> Vote:
    """One member's vote on its own result, before it is summed with the others'
    (``overflow``: its gradients are not finite, under "16-mixed")."""
    failure = result.failure
    return Vote(
        failed=int(failure is not None),
        stop=stop,
        regroup=regroup,
        splittable=int(result.splittable),
        contract=int(failure is not None and failure.breaks_step_contract),
        ledger=result.ledger,
        overflow=int(overflow),
        sums=result.sums,
        failures=[failure] if failure is not None else [],
        pace=result.pace,
        paces=[result.pace],
        bad=list(result.bad),
        failed_ranks=[0] if failure is not None else [],
        found=sorted(result.bad),
        repeated=int(repeated),
    )


def guarded_commit(
    trainable: Trainable,
    faults: FaultInjector,
    identity: Identity,
    step: int,
    epoch: int,
    skip: bool = False,
) -> None:
    """The optimizer phase (``skip``: the vote found overflowed gradients, see
    :meth:`Trainable.commit`). A failure here leaves this replica's weights unknown: fatal."""
    try:
        faults.check(step, "optimizer")
        trainable.commit(skip)
    except Exception as exc:
        raise FailedHere(failure_of(exc, identity, "optimizer", step, epoch)) from exc


Thunk = Callable[[], Any]
