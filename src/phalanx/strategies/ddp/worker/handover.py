"""The state hand-over when a generation forms.

Every member all-reduces its position (committed steps, then finished epochs); the lowest
rank at the furthest position is the source, and the members behind it get its snapshot
(model, optimizer, scheduler, loop state with metric sums and ledger, early stopping, RNG).
Members at the furthest position hold the same state already (every member applies the
same reduced gradients), so a shrink or a rebuild moves nothing.

The snapshot travels as a skeleton: the snapshot with each tensor replaced by a
:class:`~phalanx.skeleton.TensorSlot` (index, shape, dtype, device; torch's pytree maps the
leaves), as one JSON document (:mod:`phalanx.skeleton`: data that cannot run code, never a
pickle), then each tensor in its own broadcast; a barrier of all members ends it, so nobody
enters a step's collectives while a peer still receives. No process ever holds a serialized
copy of the whole state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from phalanx.loop import TrainLoop
from phalanx.skeleton import decode, encode, fill_tensors, split_tensors, tensor_slots
from phalanx.strategies.ddp.worker.group import GenerationGroup

__all__ = ["broadcast_state", "hand_over"]

# Builds the group of the source and the members behind it (sorted ranks): its rank is
# this member's index among them.
SubgroupFactory = Callable[[list[int]], GenerationGroup]


# A member behind tries its machine's snapshot of the agreed position: whether it now holds
# that state (see :func:`hand_over`).
LocalState = Callable[[tuple[float, float]], bool]


def hand_over(
    loop: TrainLoop,
    group: GenerationGroup,
    subgroup: SubgroupFactory,
    local: LocalState | None = None,
    everyone: bool = False,
) -> int:
    """Agree on the furthest position and give the members behind it the state of the
    lowest rank there; returns that rank. Every member calls it, over the new group.

    A member behind first looks for that very state in its machine's shared memory with
    ``local`` (a snapshot its generation's writer took at the regroup; without ``local``
    it finds nothing): one more small all-reduce says who found it, and only the others
    receive it from the source, so the members ahead are not kept waiting while it travels.
    ``everyone``: every member but the source receives it, whatever its position (a
    restart's members may hold the same step computed two ways: they must end equal)."""
    position = positions(loop, group)
    top = max(position)
    src = min(r for r in range(group.size) if position[r] == top)
    behind = [r for r in range(group.size) if position[r] < top or (everyone and r != src)]
    if behind and not everyone:
        behind = _still_behind(group, behind, _found(local, top, group.rank in behind))
    if not behind:
        return src
    ranks = sorted([src, *behind])
    if group.rank in ranks:
        moving = group if len(ranks) == group.size else subgroup(ranks)
        _transfer(loop, moving, ranks.index(src) if moving is not group else src)
        if moving is not group:
            moving.leave()
    group.barrier()
    return src


def _found(local: LocalState | None, top: tuple[float, float], behind: bool) -> bool:
    """Whether this member, behind, now holds the state at ``top`` from its machine; any
    error there is "no" (its peers wait in the all-reduce that follows)."""
    if not behind or local is None:
        return False
    try:
        return local(top)
    except Exception:
        return False


def _still_behind(group: GenerationGroup, behind: list[int], found: bool) -> list[int]:
    """The members behind that did not find the agreed state on their own machine."""
    flags = torch.zeros(group.size, dtype=torch.float64, device=group.device)
    flags[group.rank] = 1.0 if found else 0.0
    group.all_reduce(flags)
    return [r for r in behind if flags[r].item() == 0.0]


def positions(loop: TrainLoop, group: GenerationGroup) -> list[tuple[float, float]]:
    """Every member's (committed steps, finished epochs): a validation pass that completed
    on some members only leaves the others an epoch behind at the same step."""
    where = torch.zeros(2 * group.size, dtype=torch.float64, device=group.device)
    mine = [float(loop.state.global_step), float(loop.state.epoch)]
    where[2 * group.rank : 2 * group.rank + 2] = torch.tensor(mine, dtype=torch.float64)
    group.all_reduce(where)
    return [(where[2 * r].item(), where[2 * r + 1].item()) for r in range(group.size)]


def _transfer(loop: TrainLoop, group: GenerationGroup, src: int) -> None:
    """``src``'s snapshot to the other members of ``group``."""
    state = broadcast_state(group, loop.snapshot() if group.rank == src else None, src)
    if group.rank != src:
        assert state is not None
        loop.restore(state)


def broadcast_state(
    group: GenerationGroup, state: dict[str, Any] | None, src: int
) -> dict[str, Any] | None:
    """``src``'s ``state`` (a snapshot) on every member of ``group``: the skeleton, then
    each tensor (on this member's device while it travels; a CPU tensor goes back to the
    CPU). None on every member when ``src`` has none to send (``state`` None there)."""
    sending = group.rank == src
    skeleton, tensors = split_tensors(state) if sending and state is not None else (None, [])
    payload = group.broadcast_bytes(b"" if skeleton is None else encode(skeleton), src)
    if not payload:
        return None
    if not sending:
        skeleton = decode(payload)  # (a WireError for anything but a skeleton document)
    received: list[torch.Tensor] = []
    for i, slot in enumerate(tensor_slots(skeleton)):
        if sending:
            buf = tensors[i].to(group.device).contiguous()
        else:
            buf = torch.empty(slot.shape, dtype=slot.dtype, device=group.device)
        group.broadcast(buf, src)
        if not sending:
            received.append(buf if slot.device.startswith("cuda") else buf.to(slot.device))
    return state if sending else fill_tensors(skeleton, received)
