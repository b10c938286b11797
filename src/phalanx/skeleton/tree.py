"""A state as a skeleton and its tensors, through torch's pytree.

:func:`split_tensors` swaps each tensor of a state (a loop's snapshot: model, optimizer,
scheduler, loop state, RNG) for a :class:`~.wire.TensorSlot` (index, shape, dtype, device),
so the skeleton travels as data (:mod:`.wire`) and the tensors travel, or are copied, on their
own; :func:`fill_tensors` puts them back. A module state dict keeps its ``_metadata`` (the
versions ``load_state_dict`` reads) through a registered pytree node.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from phalanx.skeleton.wire import TensorSlot
from phalanx.torchprivate import (
    register_node,
    set_state_metadata,
    state_metadata,
    tree_leaves,
    tree_map,
    tree_map_only,
)


class _ModuleState(OrderedDict[str, Any]):
    """A module's state dict in flight: pytree rebuilds an OrderedDict without the
    ``_metadata`` (module versions) that ``load_state_dict`` reads; this node keeps it."""


def _flatten_module_state(node: _ModuleState) -> tuple[list[Any], Any]:
    return list(node.values()), (list(node.keys()), state_metadata(node))


def _unflatten_module_state(values: Any, context: Any) -> OrderedDict[str, Any]:
    keys, metadata = context
    state: OrderedDict[str, Any] = OrderedDict(zip(keys, values, strict=True))
    if metadata is not None:
        set_state_metadata(state, metadata)
    return state


register_node(_ModuleState, _flatten_module_state, _unflatten_module_state, "phalanx.ModuleState")


def _keep_metadata(state: Any) -> Any:
    """``state`` with each module state dict marked as a :class:`_ModuleState`."""

    def has_metadata(node: Any) -> bool:
        return isinstance(node, OrderedDict) and state_metadata(node) is not None

    def mark(node: Any) -> Any:
        if not has_metadata(node):
            return node
        marked = _ModuleState(node)
        set_state_metadata(marked, state_metadata(node))
        return marked

    return tree_map(mark, state, is_leaf=has_metadata)


def split_tensors(state: Any) -> tuple[Any, list[torch.Tensor]]:
    """``state`` as (skeleton, tensors): the skeleton is ``state`` with each tensor replaced
    by a :class:`TensorSlot`, so it travels as data (:func:`.wire.encode`) without any
    tensor in it."""
    tensors: list[torch.Tensor] = []

    def take(tensor: torch.Tensor) -> TensorSlot:
        tensors.append(tensor)
        return TensorSlot(len(tensors) - 1, tuple(tensor.shape), tensor.dtype, str(tensor.device))

    return tree_map_only(torch.Tensor, take, _keep_metadata(state)), tensors


def tensor_slots(skeleton: Any) -> list[TensorSlot]:
    """The tensors a skeleton stands for, in the order they travel."""
    found = [leaf for leaf in tree_leaves(skeleton) if isinstance(leaf, TensorSlot)]
    return sorted(found, key=lambda slot: slot.index)


def fill_tensors(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """The inverse of :func:`split_tensors`."""
    return tree_map_only(TensorSlot, lambda slot: tensors[slot.index], _keep_metadata(skeleton))
