"""Every use of a private torch name, in one place, each with why it is needed.

torch's private names can change in any release without notice. Keeping them here makes
the list of what to check at a torch upgrade this file (``tests/test_torchprivate.py``
refuses a private torch name anywhere else in ``phalanx``). Each function says what it
stands in for and what breaks if torch changes it.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# torch.utils._pytree: flatten a state (model, optimizer, scheduler, loop) into its tensors
# and a skeleton and back (snapshots, hand-overs). The public `torch.utils.pytree` is not in
# every torch this supports; _pytree is what torch.compile and torch.export build on.
from torch.utils import _pytree as pytree

# A module imported into the ddp fork server, so that workers do not import it each: the
# first optimizer built imports torch._dynamo lazily (about a second). Only a name.
LAZY_IMPORTED = "torch._dynamo"


def set_nccl_timeout(options: Any, timeout: timedelta) -> None:
    """``ProcessGroupNCCL.Options._timeout``: NCCL's options take the collective timeout
    only through this attribute (``init_process_group(timeout=)`` sets it the same way)."""
    options._timeout = timeout


def bind_backend(pg: dist.ProcessGroup, device: torch.device, kind: Any, backend: Any) -> None:
    """A process group built from its backend without ``init_process_group`` (a generation
    owns its group; torch's default group is never made): ``_set_default_backend`` and
    ``_register_backend`` are what ``new_group`` calls inside. Without them, collectives on
    the group find no backend."""
    pg._set_default_backend(kind)
    pg._register_backend(torch.device(device.type), kind, backend)


def state_metadata(state: Any) -> Any:
    """``state_dict()._metadata``: the module versions ``load_state_dict`` reads (a
    BatchNorm of an old version loads differently). None where there is none."""
    return getattr(state, "_metadata", None)


def set_state_metadata(state: Any, metadata: Any) -> None:
    state._metadata = metadata


def register_node(
    kind: type,
    flatten: Callable[[Any], tuple[list[Any], Any]],
    unflatten: Callable[[Any, Any], Any],
    name: str,
) -> None:
    """A container type pytree flattens (torch.utils._pytree.register_pytree_node)."""
    pytree.register_pytree_node(kind, flatten, unflatten, serialized_type_name=name)


def tree_map(fn: Callable[[Any], Any], tree: Any, is_leaf: Callable[[Any], bool]) -> Any:
    return pytree.tree_map(fn, tree, is_leaf=is_leaf)


def tree_map_only(kind: type, fn: Callable[[Any], Any], tree: Any) -> Any:
    return pytree.tree_map_only(kind, fn, tree)


def tree_leaves(tree: Any) -> list[Any]:
    return list(pytree.tree_leaves(tree))
