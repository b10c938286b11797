"""Which modules ``strategy="fsdp"`` shards as units (each one's parameters are gathered
whole only while it computes), before the root, which takes every parameter left over.

``fit(shard=None)`` (the default rule), with ``n`` the model's parameter count and a module
*sizeable* when it holds at least ``min(n / 32, 2**20)`` parameters:

- a module that is not sizeable stays in the unit of the module around it;
- a container (``nn.Sequential``, ``nn.ModuleList``, ``nn.ModuleDict``), or a sizeable module
  holding more than a quarter of ``n`` that has children of its own, is looked into: its
  children are judged by the same rule;
- any other sizeable module is a unit (a transformer block, an embedding, a large linear),
  unless it holds a parameter another module holds too (tied weights: an embedding and the
  output layer that shares it stay in the root).

``fit(shard=(Block,))`` makes every module of those classes a unit (the way transformer blocks
are sharded); ``fit(shard=fn)`` every module for which ``fn(module)`` is true. The root is
never among the units: it is sharded last, by the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

# What fit(shard=...) takes: None (the rule above), module classes, or a predicate.
ShardRule = Sequence[type[nn.Module]] | Callable[[nn.Module], bool] | None
CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def count(module: nn.Module) -> int:
    """Parameters of ``module`` and everything inside it (each tensor once)."""
    return sum(p.numel() for p in module.parameters())


def units(model: nn.Module, shard: ShardRule = None) -> list[nn.Module]:
    """The modules of ``model`` (never ``model`` itself) to shard as units, in the order
    ``model.modules()`` yields them; sharded innermost first by :func:`innermost_first`."""
    if shard is None:
        total = count(model)
        found: list[nn.Module] = []
        _default(model, min(total / 32, 2**20), total, found)
        shared = _shared(model)
        return [m for m in found if not any(id(p) in shared for p in m.parameters())]
    if isinstance(shard, type) or (isinstance(shard, Sequence) and not callable(shard)):
        classes = (shard,) if isinstance(shard, type) else tuple(shard)
        return [m for m in model.modules() if m is not model and isinstance(m, classes)]
    rule: Any = shard
    return [m for m in model.modules() if m is not model and rule(m)]


def _shared(model: nn.Module) -> set[int]:
    """The parameters that two modules hold (tied weights: an embedding and its output
    layer). A unit cannot share one with another unit: such modules stay in the root."""
    holders: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            holders[id(p)] = holders.get(id(p), 0) + 1
    return {pid for pid, n in holders.items() if n > 1}


def _default(module: nn.Module, least: float, total: int, found: list[nn.Module]) -> None:
    for child in module.children():
        size = count(child)
        if size < least or size == 0:
            continue
        has_children = any(True for _ in child.children())
        if isinstance(child, CONTAINERS) or (size > total / 4 and has_children):
            _default(child, least, total, found)
        else:
            found.append(child)


def innermost_first(found: list[nn.Module]) -> list[nn.Module]:
    """``found`` with every module after the modules inside it (FSDP2 shards inner units
    first); a module listed twice once."""
    seen: set[int] = set()
    ordered: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for inner in module.children():
            visit(inner)
        if id(module) in wanted and id(module) not in seen:
            seen.add(id(module))
            ordered.append(module)

    wanted = {id(m) for m in found}
    roots = [m for m in found if not any(m is not o and _inside(m, o) for o in found)]
    for root in roots:
        visit(root)
    return ordered


def _inside(module: nn.Module, outer: nn.Module) -> bool:
    return any(module is m for m in outer.modules() if m is not outer)
