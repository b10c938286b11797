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


_SCALARS = frozenset({int, float, str, bool, bytes, type(None)})


def split_tensors(state: Any) -> tuple[Any, list[torch.Tensor]]:
    """``state`` as (skeleton, tensors): the skeleton is ``state`` with each tensor replaced
    by a :class:`TensorSlot`, so it travels as data (:func:`.wire.encode`) without any
    tensor in it.

    The containers a loop's state is made of (dicts, module state dicts, lists, tuples) are
    walked here, a run of scalars copied at once (Python's RNG state is a tuple of 625
    ints); anything else goes through torch's pytree as a whole. Each snapshot splits the
    state on the loop's thread: through pytree alone that took 2.6 ms a snapshot for ~800
    leaves. The skeleton and the tensors' order are pytree's (``tests/test_handover.py``)."""
    tensors: list[torch.Tensor] = []

    def take(tensor: torch.Tensor) -> TensorSlot:
        tensors.append(tensor)
        return slot_of(len(tensors) - 1, tensor)

    def walk(node: Any) -> Any:
        kind = type(node)
        if kind in _SCALARS:
            return node
        if isinstance(node, torch.Tensor):
            return take(node)
        if kind is dict:
            return {key: walk(value) for key, value in node.items()}
        if kind is OrderedDict:
            walked: OrderedDict[Any, Any] = OrderedDict((k, walk(v)) for k, v in node.items())
            metadata = state_metadata(node)
            if metadata is not None:
                set_state_metadata(walked, metadata)
            return walked
        if kind is list or kind is tuple:
            if set(map(type, node)) <= _SCALARS:
                return kind(node)
            return kind(walk(value) for value in node)
        return tree_map_only(torch.Tensor, take, _keep_metadata(node))

    return walk(state), tensors


def slot_of(index: int, tensor: torch.Tensor) -> TensorSlot:
    """The slot of ``tensor``, the ``index``-th of a split: what :func:`split_tensors` puts in
    its place (and, for the tensors it returned, :func:`tensor_slots` finds again)."""
    return TensorSlot(index, tuple(tensor.shape), tensor.dtype, str(tensor.device))


def tensor_slots(skeleton: Any) -> list[TensorSlot]:
    """The tensors a skeleton stands for, in the order they travel."""
    found = [leaf for leaf in tree_leaves(skeleton) if isinstance(leaf, TensorSlot)]
    return sorted(found, key=lambda slot: slot.index)


def fill_tensors(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """The inverse of :func:`split_tensors`."""
    return tree_map_only(TensorSlot, lambda slot: tensors[slot.index], _keep_metadata(skeleton))
