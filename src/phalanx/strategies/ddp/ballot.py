"""The vote rides DDP's gradient all-reduce: no collective of its own.

The module DDP wraps is a :class:`Ballot`: the replica's step module plus one parameter,
the *box*, that no optimizer sees. Right before its synchronised backward a member adds
``dot(box, its ballot)`` to the loss; the box's gradient is then exactly the ballot, and DDP
reduces it with the model's gradients, in the bucket of the layers whose gradients come
first (its gradient is ready at the very start of the backward). After the backward every
member reads the same reduced box and counts the vote from it.

A packed vote (:func:`phalanx.loop.pack_vote`) is float64; a bucket is float32 and DDP
averages it. So the ballot is exact by construction, whatever the world size and the order
of the sum: each member owns one slot of the box (the others' slots are zero in its
ballot, so every slot's sum is one member's value plus zeros), and each float64 travels as
its 64 bits in four 16-bit pieces, integers a float32 holds exactly. After DDP's division by
the world size, multiplying back and rounding gives every piece exactly. The members'
votes are then summed in rank order, in float64, the same on every member.

The cost: three small autograd operations and a copy of ``4 * world * len(vote)`` floats
(a few hundred bytes on two workers) into the first bucket, instead of one more collective
each step.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from phalanx.replica import StepModule

PIECES = 4  # 16-bit pieces of one float64 (little-endian on every member)


class Ballot(nn.Module):
    """What DDP wraps in a generation of ``world`` members: ``step`` (the replica's step
    module, whose forward this is) and the box for votes of ``size`` values."""

    def __init__(self, step: StepModule, world: int, size: int, device: torch.device) -> None:
        super().__init__()
        self.step = step
        self.world, self.size = world, size
        self.box = nn.Parameter(torch.zeros(world * size * PIECES, device=device))

    def forward(self, batch: Any) -> tuple[torch.Tensor, Any, Any]:
        return self.step(batch)

    def cast(self, packed: torch.Tensor, rank: int) -> torch.Tensor:
        """The term to add to the loss before the synchronised backward: its gradient with
        respect to the box is member ``rank``'s ballot for ``packed`` (its vote). Clears the
        box's gradient of the step before (nothing else does: no optimizer holds it)."""
        self.box.grad = None
        ballot = torch.from_numpy(encode(packed.numpy(), rank, self.world))
        return torch.dot(self.box, ballot.to(self.box.device, non_blocking=True))

    def count(self) -> torch.Tensor:
        """After the synchronised backward: the sum of every member's packed vote."""
        grad = self.box.grad
        assert grad is not None, "count() before a backward that carried the ballots"
        return torch.from_numpy(decode(grad.cpu().numpy(), self.world, self.size))


def encode(packed: np.ndarray, rank: int, world: int) -> np.ndarray:
    """Member ``rank``'s ballot (float32, ``world * len(packed) * PIECES``): the bits of
    each float64 of ``packed`` as 16-bit pieces, in its own slot."""
    out = np.zeros((world, len(packed) * PIECES), dtype=np.float32)
    out[rank] = np.asarray(packed, dtype="<f8").view("<u2")
    return out.reshape(-1)


def decode(reduced: np.ndarray, world: int, size: int) -> np.ndarray:
    """The float64 sum over members of the votes in ``reduced``, the box's gradient as DDP
    left it (the ballots summed, divided by ``world``)."""
    pieces = np.rint(reduced * np.float32(world)).astype("<u2")  # (each within 2**-8)
    # (rows added in rank order: the same float64 sum on every member)
    return pieces.view("<f8").reshape(world, size).sum(axis=0)
