"""The vote rides DDP's gradient all-reduce: no collective of its own.

The module DDP wraps is a :class:`Ballot`: the replica's step module plus one parameter,
the *box*, that no optimizer sees. A member's synchronised backward has two roots: the loss,
and the box with its ballot as the gradient it receives; the box's gradient is then exactly
the ballot, and DDP reduces it with the model's gradients, in the bucket of the layers whose
gradients come first (the box's is ready at the very start of the backward). After the
backward every member reads the same reduced box and counts the vote from it.

A packed vote (:func:`phalanx.loop.pack_vote`) is float64; a bucket is float32 and DDP
averages it. So the ballot is exact by construction, whatever the world size and the order
of the sum: each member owns one slot of the box (the others' slots are zero in its
ballot, so every slot's sum is one member's value plus zeros), and each float64 travels as
its 64 bits in four 16-bit pieces, integers a float32 holds exactly. After DDP's division by
the world size, multiplying back and rounding gives every piece exactly. The members'
votes are then summed in rank order, in float64, the same on every member.

The cost: writing the ballot, one more leaf in the backward, ``4 * world * len(vote)``
floats (a few hundred bytes on two workers) more in the first bucket and reading them back,
instead of one more collective each step.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from phalanx.errors import NonFiniteLossError
from phalanx.replica import Cast, StepModule, ZeroPass

PIECES = 4  # 16-bit pieces of one float64 (little-endian on every member)
# fsdp's box in a unit gathered or reduced in bfloat16 (an mp_policy): 8-bit pieces, the
# integers bfloat16 holds exactly (a slot's sum is one member's piece plus zeros)
BF16_BITS = 8


class BallotBox(Protocol):
    """How an engine casts a member's vote and counts everyone's (:class:`Ballot` under
    DDP, :class:`FsdpBallot` under FSDP2)."""

    def cast(self, packed: Sequence[float] | np.ndarray) -> Cast: ...

    def count(self) -> list[float]: ...

    def rows(self, upto: int) -> list[list[float]]: ...


class Ballot(nn.Module):
    """What DDP wraps for member ``rank`` of a generation of ``world``: ``step`` (the
    replica's step module, whose forward this is) and the box for votes of ``size`` values."""

    def __init__(
        self, step: StepModule, rank: int, world: int, size: int, device: torch.device
    ) -> None:
        super().__init__()
        self.step = step
        self.rank, self.world, self.size = rank, world, size
        self.box = nn.Parameter(torch.zeros(world * size * PIECES, device=device))
        # Never None: the ballot is added into it in place (a gradient torch could take over
        # as the box's own would be this member's ballot buffer, which DDP then overwrites).
        self.box.grad = torch.zeros_like(self.box)
        # Buffers made once (a step's few numpy calls then allocate nothing): this member's
        # ballot (its slot, and its packed vote whose pieces fill the slot), and the box's
        # reduced gradient as read.
        self._ballot = np.zeros((world, size * PIECES), dtype=np.float32)
        self._sent = torch.from_numpy(self._ballot).view(-1)  # (its memory)
        self._packed = np.zeros(size, dtype="<f8")
        self._slot, self._pieces = self._ballot[rank], pieces(self._packed)
        self._seen: tuple[torch.Tensor, np.ndarray] | None = None
        self._decode = Decoder(world, size)

    def forward(self, batch: Any) -> tuple[torch.Tensor, Any, Any]:
        return self.step(batch)

    def cast(self, packed: Sequence[float] | np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """This member's ballot for ``packed`` (its vote, ``size`` values), as a second root
        of the synchronised backward: the box, and the gradient it receives (the ballot).
        Clears the box's gradient of the step before (no optimizer holds it)."""
        grad = self.box.grad
        if grad is None:
            self.box.grad = torch.zeros_like(self.box)
        else:
            grad.zero_()
        self._packed[:] = packed
        self._slot[:] = self._pieces
        if self.box.device.type == "cpu":
            return self.box, self._sent
        return self.box, self._sent.to(self.box.device)

    def count(self) -> list[float]:
        """After the synchronised backward: the sum of every member's packed vote."""
        grad = self.box.grad
        assert grad is not None, "count() before a backward that carried the ballots"
        if grad.device.type != "cpu":
            reduced = grad.cpu().numpy()
        else:  # (DDP writes the reduced box into the same tensor every step: one view)
            if self._seen is None or self._seen[0] is not grad:
                self._seen = (grad, grad.detach().numpy())
            reduced = self._seen[1]
        return self._decode(reduced).tolist()

    def rows(self, upto: int) -> list[list[float]]:
        """After :meth:`count`: the first ``upto`` values of every member's own packed vote,
        in rank order (each slot holds one member's vote exactly: the same on every member)."""
        return self._decode.votes[:, :upto].tolist()


def pieces(packed: np.ndarray, bits: int = 16) -> np.ndarray:
    """The bits of each float64 of ``packed`` as ``bits``-bit unsigned integers (16 or 8),
    low first."""
    return np.asarray(packed, dtype="<f8").view(_UINT[bits])


_UINT = {16: "<u2", 8: "u1"}


def encode(packed: np.ndarray, rank: int, world: int) -> np.ndarray:
    """Member ``rank``'s ballot (float32, ``world * len(packed) * PIECES``): the
    :func:`pieces` of ``packed`` in its own slot (what :meth:`Ballot.cast` sends)."""
    out = np.zeros((world, len(packed) * PIECES), dtype=np.float32)
    out[rank] = pieces(packed)
    return out.reshape(-1)


class Decoder:
    """The float64 sum over members of the votes in a box's reduced gradient (as DDP left
    it: the ballots summed, divided by ``world``; ``scale``: what to multiply it back by,
    ``world`` unless given; ``bits``: of each piece), into buffers made once."""

    def __init__(self, world: int, size: int, scale: float | None = None, bits: int = 16) -> None:
        count = 64 // bits
        self.world = np.float32(world if scale is None else scale)
        self.scaled = np.zeros(world * size * count, dtype=np.float32)
        self.pieces = np.zeros(world * size * count, dtype=_UINT[bits])
        self.votes = self.pieces.view("<f8").reshape(world, size)  # (a view of the pieces)

    def __call__(self, reduced: np.ndarray) -> np.ndarray:
        np.multiply(reduced, self.world, out=self.scaled)
        np.rint(self.scaled, out=self.scaled)  # (each within 2**-8 of its integer)
        np.copyto(self.pieces, self.scaled, casting="unsafe")
        # (rows added in rank order: the same float64 sum on every member)
        return self.votes.sum(axis=0)


def decode(reduced: np.ndarray, world: int, size: int) -> np.ndarray:
    """The float64 sum over members of the votes in ``reduced`` (see :class:`Decoder`)."""
    return Decoder(world, size)(reduced)


class BoxHolder(nn.Module):
    """The box of an fsdp vote, ``[world, world * size * PIECES]``, in a module of its own:
    a child of the root (:class:`FsdpBallot`), sharded with it, or grouped with a unit of
    the model (``fully_shard([unit, holder])``) when the root holds nothing else."""

    def __init__(self, world: int, size: int, device: torch.device, bits: int = 16) -> None:
        super().__init__()
        count = 64 // bits  # (pieces of one float64)
        self.box = nn.Parameter(torch.zeros(world, world * size * count, device=device))

    def forward(self) -> torch.Tensor:
        return self.box  # (while its unit is gathered: the unsharded parameter)


class FsdpBallot(nn.Module):
    """The root of an fsdp member's sharded model (``fully_shard`` on it last): ``step`` (the
    replica's step module, whose forward this is, over the model's own units) and the box,
    ``[world, world * size * pieces]``, in :attr:`holder` (``bits``: of each piece, 16, or 8
    where an ``mp_policy`` gathers or reduces the carrier in bfloat16).

    FSDP2 gives a member only its shard of a reduced gradient: the box's dim-0 shard of a
    member is one row. So each member's ballot goes into every row (its own slot filled, the
    others zero), and a reduce-scatter, a plain SUM (no division: see
    :class:`~phalanx.strategies.ddp.worker.fsdp_engine.FsdpEngine`), leaves in every member's
    row the sum of all ballots: exact for the same reason as :class:`Ballot`'s. The vote thus
    rides a reduce-scatter of the backward, with no collective of its own:

    - **the root's** (``carrier`` None): the box is a root parameter, and its ballot a
      second root of the backward (:meth:`cast`). Where the root holds other parameters
      (a transformer's embeddings, its final norm), FSDP2 gathers and reduces it anyway.
    - **a unit's** (``carrier``: a unit the model's forward runs, sharded together with
      :attr:`holder` by ``fully_shard([carrier, holder])``): where the root would hold the
      box alone, its own all-gather and reduce-scatter would be the step's only extra
      collectives. The box is gathered and reduced with the carrier's parameters instead,
      and its ballot delivered by a hook on the carrier's output: that output's gradient
      comes before any gradient of the carrier's inputs, hence before FSDP2 reduces the
      carrier (:meth:`attach`). Where it did not come (a carrier the forward does not
      use), :meth:`count` sums the ballots in an all-reduce of their own.

    ``template()`` loads one training sample on the device: the zero pass under fsdp is a
    forward and backward of it with the loss times zero (a pass that skipped a unit would
    leave its peers' all-gathers unmatched), with buffers and random generators as before.
    """

    def __init__(
        self,
        step: StepModule,
        rank: int,
        world: int,
        size: int,
        device: torch.device,
        template: Callable[[], Any],
        carrier: nn.Module | None = None,
        bits: int = 16,
    ) -> None:
        super().__init__()
        self.step = step
        self.rank, self.world, self.size = rank, world, size
        self.holder = BoxHolder(world, size, device, bits)
        self.carried = carrier is not None
        self.template = template
        self._checked = False  # the template's loss was finite once
        self.last: torch.Tensor | None = None  # the box as this forward used it (root's)
        self._ballot = np.zeros((world, size * (64 // bits)), dtype=np.float32)
        self._sent = torch.from_numpy(self._ballot).view(1, -1)
        self._packed = np.zeros(size, dtype="<f8")
        self._slot, self._pieces = self._ballot[rank], pieces(self._packed, bits)
        self._decode = Decoder(world, size, scale=1.0, bits=bits)
        # (a carried box:) the unsharded box of this forward, the ballot waiting for the
        # carrier's backward, and whether that backward took it
        self._unsharded: torch.Tensor | None = None
        self._grid: torch.Tensor | None = None
        self._delivered = False
        # (a carried box:) the group's all-reduce, for a vote the carrier did not take
        self.all_reduce: Callable[[torch.Tensor], None] | None = None

    @property
    def box(self) -> nn.Parameter:
        return self.holder.box

    def attach(self, carrier: nn.Module) -> None:
        """Once ``fully_shard([carrier, holder])`` is done: the carrier's forward first
        runs the holder (so the group's all-gather of the box is the carrier's, and the
        box as unsharded then is kept), and a hook on its output's first gradient sets the
        ballot as the unsharded box's gradient, which FSDP2 then reduces with the
        carrier's (its pre-hooks are registered before, so they gather first)."""

        def before(module: nn.Module, args: Any) -> None:
            # (validation's forwards too: the group is resharded after the carrier then)
            self.holder()  # (its output may be cast to the policy's output_dtype: a copy)
            self._unsharded = self.holder.box  # (the group's unsharded parameter now)

        def after(module: nn.Module, args: Any, output: Any) -> None:
            if not torch.is_grad_enabled() or self._unsharded is None:
                return
            flat = [t for t in _tensors(output) if t.requires_grad]
            if flat:
                box = self._unsharded
                torch.autograd.graph.register_multi_grad_hook(
                    flat, lambda _grads: self._deliver(box), mode="any"
                )

        carrier.register_forward_pre_hook(before)
        carrier.register_forward_hook(after, prepend=True)

    def _deliver(self, box: torch.Tensor) -> None:
        """The carrier's output got its gradient: the ballot (when this backward carries
        one, and not yet given) becomes the unsharded box's gradient; a backward before the
        last micro-batch's gives it zeros, as every parameter of the carrier gets a
        gradient then (FSDP2 accumulates an mp_policy's in its reduce dtype, and reduces a
        group's gradients only when all share one dtype)."""
        if self._delivered:
            return
        grid = self._grid
        if grid is None:
            if box.grad is None:
                box.grad = torch.zeros_like(box)
            return
        box.grad = grid.to(box.dtype)  # (bfloat16 under an mp_policy: 8-bit pieces)
        self._delivered = True

    def forward(self, batch: Any) -> tuple[torch.Tensor, Any, Any]:
        if not self.carried:  # (not a view: the root's reduce-scatter carries its grad)
            self.last = self.box * 1.0
        if isinstance(batch, ZeroPass):
            return self._template_pass()
        return self.step(batch)

    def _template_pass(self) -> tuple[torch.Tensor, Any, Any]:
        model, device = self.step.model, self.box.device
        buffers = [b.detach().clone() for b in model.buffers()]
        cuda = [device.index or 0] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):
            loss, _, _ = self.step(self.template())
        with torch.no_grad():
            for buf, kept in zip(model.buffers(), buffers, strict=True):
                buf.copy_(kept)
        if not self._checked:  # (a NaN times zero is NaN: it would reach every shard)
            value = float(loss.detach().float().item())
            if not math.isfinite(value):
                raise NonFiniteLossError(
                    f"the loss of the zero pass's template (the run's first samples) is "
                    f"{value}: strategy='fsdp' computes it when a worker has fewer rows "
                    "than micro-batches; check those samples or the step function"
                )
            self._checked = True
        return loss * 0.0, None, None

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Micro-batches before the last: gradients kept unreduced (FSDP2's switch, which
        reaches every unit)."""
        self.set_requires_gradient_sync(False)  # type: ignore[operator]
        try:
            yield
        finally:
            self.set_requires_gradient_sync(True)  # type: ignore[operator]

    def cast(self, packed: Sequence[float] | np.ndarray) -> Cast:
        """This member's ballot for ``packed`` (every row of the box's gradient): carried
        by a unit, left for the carrier's hook (None: no second root); else, as a second
        root of the synchronised backward, the box as this step's forward used it and its
        gradient. (Its gradient is cleared after each count and each discarded attempt:
        FSDP2 adds into the sharded gradient, which is out of reach during forward.)"""
        self._packed[:] = packed
        self._slot[:] = self._pieces
        grid = self._sent.repeat(self.world, 1)
        grid = grid if self.box.device.type == "cpu" else grid.to(self.box.device)
        if self.carried:
            self._grid, self._delivered = grid, False
            return None
        assert self.last is not None, "cast() before a forward"
        return self.last, grid

    def count(self) -> list[float]:
        """After the synchronised backward: the sum of every member's packed vote (this
        member's row of the box's reduced gradient)."""
        if self.carried and not self._delivered:
            row = self._summed_alone()
        else:
            grad = self.box.grad
            assert grad is not None, "count() before a backward that carried the ballots"
            row = (grad.to_local() if hasattr(grad, "to_local") else grad)[0]
        counted = self._decode(row.detach().cpu().numpy()).tolist()
        self.clear()
        return counted

    def _summed_alone(self) -> torch.Tensor:
        """The carrier's output took no gradient in this backward (a unit the forward does
        not use: the same on every member, else FSDP2's own collectives would not match):
        the ballots summed in an all-reduce of their own, :attr:`all_reduce` (the
        generation's group's: a peer lost there is the group's end); a row of the sum."""
        grid = self._grid
        assert grid is not None, "count() before cast()"
        assert self.all_reduce is not None, "a carried box without the group's all-reduce"
        self.all_reduce(grid)
        return grid[0]

    def clear(self) -> None:
        """Drop the box's gradient (outside forward and backward: the sharded one), and a
        ballot not delivered."""
        self.box.grad = None
        self._grid, self._delivered = None, False

    def rows(self, upto: int) -> list[list[float]]:
        """After :meth:`count`: the first ``upto`` values of every member's own vote."""
        return self._decode.votes[:, :upto].tolist()


def _tensors(output: Any) -> list[torch.Tensor]:
    """The tensors in a module's output (nested in tuples, lists and dicts)."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):
        return [t for v in output.values() for t in _tensors(v)]
    if isinstance(output, tuple | list):
        return [t for v in output for t in _tensors(v)]
    return []
