"""Pieces every engine shares: evaluation of the validation split, guarded commits."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import Dataset

from phalanx.data import Loading, validation_batches
from phalanx.failures import FailedHere, failure_of
from phalanx.faults import FaultInjector
from phalanx.replica import Identity, Replica
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
        loader = (loading or Loading()).loader(valid, parts)
        for idx, batch in zip(parts, loader, strict=True):
            sums += replica.evaluate(batch, len(idx))
    except Exception as exc:
        raise FailedHere(failure_of(exc, replica.identity, "validation", None, epoch)) from exc
    finally:
        replica.module.train()
    return sums


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
