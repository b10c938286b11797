"""The state hand-over when a generation forms.

Every member all-reduces its position (committed steps, then finished epochs); the lowest
rank at the furthest position is the source, and the members behind it get its snapshot
(model, optimizer, scheduler, loop state with metric sums and ledger, early stopping, RNG).
Members at the furthest position hold the same state already (every member applies the
same reduced gradients), so a shrink or a rebuild moves nothing.

The snapshot travels as a skeleton: the snapshot with each tensor replaced by a
:class:`TensorSlot` (index, shape, dtype, device; torch's pytree maps the leaves), as one
JSON document (:mod:`.wire`: data that cannot run code, never a pickle), then each tensor in
its own broadcast; a
barrier of all members ends it, so nobody enters a step's collectives while a peer still
receives. No process ever holds a serialized copy of the whole state.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from phalanx.loop import TrainLoop
from phalanx.strategies.ddp.group import GenerationGroup
from phalanx.strategies.ddp.wire import TensorSlot, decode, encode

__all__ = ["TensorSlot", "fill_tensors", "hand_over", "split_tensors", "tensor_slots"]

# Builds the group of the source and the members behind it (sorted ranks): its rank is
# this member's index among them.
SubgroupFactory = Callable[[list[int]], GenerationGroup]


class _ModuleState(OrderedDict[str, Any]):
    """A module's state dict in flight: pytree rebuilds an OrderedDict without the
    ``_metadata`` (module versions) that ``load_state_dict`` reads; this node keeps it."""


def _flatten_module_state(node: _ModuleState) -> tuple[list[Any], Any]:
    return list(node.values()), (list(node.keys()), getattr(node, "_metadata", None))


def _unflatten_module_state(values: Any, context: Any) -> OrderedDict[str, Any]:
    keys, metadata = context
    state: OrderedDict[str, Any] = OrderedDict(zip(keys, values, strict=True))
    if metadata is not None:
        state._metadata = metadata  # type: ignore[attr-defined]
    return state


pytree.register_pytree_node(
    _ModuleState,
    _flatten_module_state,
    _unflatten_module_state,
    serialized_type_name="phalanx.ModuleState",
)


def _keep_metadata(state: Any) -> Any:
    """``state`` with each module state dict marked as a :class:`_ModuleState`."""

    def has_metadata(node: Any) -> bool:
        return isinstance(node, OrderedDict) and hasattr(node, "_metadata")

    def mark(node: Any) -> Any:
        if not has_metadata(node):
            return node
        marked = _ModuleState(node)
        marked._metadata = node._metadata  # type: ignore[attr-defined]
        return marked

    return pytree.tree_map(mark, state, is_leaf=has_metadata)


def split_tensors(state: Any) -> tuple[Any, list[torch.Tensor]]:
    """``state`` as (skeleton, tensors): the skeleton is ``state`` with each tensor replaced
    by a :class:`TensorSlot`, so it travels as data (:func:`.wire.encode`) without any
    tensor in it."""
    tensors: list[torch.Tensor] = []

    def take(tensor: torch.Tensor) -> TensorSlot:
        tensors.append(tensor)
        return TensorSlot(len(tensors) - 1, tuple(tensor.shape), tensor.dtype, str(tensor.device))

    return pytree.tree_map_only(torch.Tensor, take, _keep_metadata(state)), tensors


def tensor_slots(skeleton: Any) -> list[TensorSlot]:
    """The tensors a skeleton stands for, in the order they travel."""
    found = [leaf for leaf in pytree.tree_leaves(skeleton) if isinstance(leaf, TensorSlot)]
    return sorted(found, key=lambda slot: slot.index)


def fill_tensors(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """The inverse of :func:`split_tensors`."""
    return pytree.tree_map_only(
        TensorSlot, lambda slot: tensors[slot.index], _keep_metadata(skeleton)
    )


def hand_over(loop: TrainLoop, group: GenerationGroup, subgroup: SubgroupFactory) -> int:
    """Agree on the furthest position and give the members behind it the state of the
    lowest rank there; returns that rank. Every member calls it, over the new group."""
    position = _positions(loop, group)
    top = max(position)
    src = min(r for r in range(group.size) if position[r] == top)
    behind = [r for r in range(group.size) if position[r] < top]
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


def _positions(loop: TrainLoop, group: GenerationGroup) -> list[tuple[float, float]]:
    """Every member's (committed steps, finished epochs): a validation pass that completed
    on some members only leaves the others an epoch behind at the same step."""
    where = torch.zeros(2 * group.size, dtype=torch.float64, device=group.device)
    mine = [float(loop.state.global_step), float(loop.state.epoch)]
    where[2 * group.rank : 2 * group.rank + 2] = torch.tensor(mine, dtype=torch.float64)
    group.all_reduce(where)
    return [(where[2 * r].item(), where[2 * r + 1].item()) for r in range(group.size)]


def _transfer(loop: TrainLoop, group: GenerationGroup, src: int) -> None:
    """``src``'s snapshot to the other members of ``group``: the skeleton, then each tensor
    (on this member's device while it travels; a CPU tensor goes back to the CPU)."""
    sending = group.rank == src
    skeleton, tensors = split_tensors(loop.snapshot()) if sending else (None, [])
    payload = group.broadcast_bytes(encode(skeleton) if sending else b"", src)
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
    if not sending:
        loop.restore(fill_tensors(skeleton, received))
