"""Shard sets: the snapshots of a sharded run's members, and the state of another world
made from them (pure: no group, no file).

Under ``strategy="fsdp"`` every member writes its own snapshot (its shards of the model and
optimizer state, and the loop's state) into its slot's folder, after the same committed
steps as every other member. A *set* is the snapshots of one step by every rank of one
generation: together they hold the whole state. Each snapshot's header tag says which
(:func:`tag`: the generation, its world size and the writer's rank), so the newest complete
set is found from the headers alone (:func:`newest_set`).

FSDP2 shards a tensor's dim 0 as ``torch.chunk`` does: ``ceil(d0 / world)`` rows per rank,
the last ranks fewer or none (:func:`rows`). A member of a new world takes, for each tensor,
its rows from the overlapping rows of the old ranks' shards (:func:`reshard`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

RANK_BITS = 8  # at most 255 members in an fsdp generation (validate.py refuses more)
MAX_WORLD = (1 << RANK_BITS) - 1


def tag(generation: int, world: int, rank: int) -> int:
    """A member's snapshot tag: ``generation``, ``world`` and ``rank`` in one int64."""
    assert 0 < world <= MAX_WORLD and 0 <= rank < world and generation >= 0
    return (generation << (2 * RANK_BITS)) | (world << RANK_BITS) | rank


@dataclass(frozen=True)
class Written:
    """One whole snapshot a slot's folder holds: who wrote it and of which step."""

    generation: int
    world: int
    rank: int
    step: int
    epoch: int

    @classmethod
    def of(cls, tagged: int, step: int, epoch: int) -> Written | None:
        """From a header's tag (None for a tag no fsdp member wrote)."""
        if tagged < 0:
            return None
        mask = (1 << RANK_BITS) - 1
        world, rank = (tagged >> RANK_BITS) & mask, tagged & mask
        if world == 0 or rank >= world:
            return None
        return cls(tagged >> (2 * RANK_BITS), world, rank, step, epoch)


@dataclass(frozen=True)
class ShardSet:
    """Every rank of ``generation`` (``world`` of them) has a snapshot of ``step``."""

    generation: int
    world: int
    step: int
    epoch: int


def newest_set(written: Iterable[Written]) -> ShardSet | None:
    """The newest complete set (the furthest step; the latest generation of two at one
    step) among ``written``; None when none is complete."""
    ranks: dict[tuple[int, int, int, int], set[int]] = {}
    for w in written:
        ranks.setdefault((w.generation, w.world, w.step, w.epoch), set()).add(w.rank)
    complete = [key for key, have in ranks.items() if have == set(range(key[1]))]
    if not complete:
        return None
    generation, world, step, epoch = max(complete, key=lambda k: (k[2], k[0]))
    return ShardSet(generation, world, step, epoch)


def rows(d0: int, world: int, rank: int) -> tuple[int, int]:
    """The dim-0 rows ``[start, stop)`` that ``rank`` of ``world`` holds of a tensor with
    ``d0`` rows (possibly none: ``start == stop``)."""
    each = -(-d0 // world)
    start = min(d0, rank * each)
    return start, min(d0, start + each)


def reshard(pieces: Sequence[torch.Tensor], d0: int, world: int, rank: int) -> torch.Tensor:
    """Rows :func:`rows` ``(d0, world, rank)`` of a tensor whose shards by the ranks of an
    old world are ``pieces`` (in rank order: rank ``r`` of ``len(pieces)`` holds
    :func:`rows` ``(d0, len(pieces), r)``). A copy; raises ValueError when a piece does not
    hold the rows its rank should."""
    old = len(pieces)
    start, stop = rows(d0, world, rank)
    like = pieces[0]
    out = torch.empty((stop - start, *like.shape[1:]), dtype=like.dtype, device=like.device)
    for r, piece in enumerate(pieces):
        a, b = rows(d0, old, r)
        if piece.shape[0] != b - a or piece.shape[1:] != like.shape[1:]:
            raise ValueError(
                f"rank {r} of {old} holds {tuple(piece.shape)} of a tensor with {d0} rows "
                f"(it should hold rows {a}..{b})"
            )
        lo, hi = max(a, start), min(b, stop)
        if lo < hi:
            out[lo - start : hi - start] = piece[lo - a : hi - a]
    return out


def whole(states: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The whole state (every tensor as one device holds it) from the states of all ranks of
    one world, in rank order: each writes a ``shards`` record naming its sharded entries
    (``model`` keys, and per optimizer state index the keys of param-shaped values); those
    are joined along dim 0, the rest taken from rank 0 (the same on every rank)."""
    return _joined(states, lambda pieces: torch.cat(list(pieces)))


def part(states: Sequence[dict[str, Any]], world: int, rank: int) -> dict[str, Any]:
    """As :func:`whole`, but each sharded entry holds only the rows member ``rank`` of
    ``world`` takes (:func:`rows`), copied out of the pieces: read from mapped files, only
    those rows are read. Raises ValueError when a piece does not hold its rank's rows."""

    def cut(pieces: Sequence[torch.Tensor]) -> torch.Tensor:
        return reshard(pieces, sum(p.shape[0] for p in pieces), world, rank)

    out = _joined(states, cut)
    # (the whole tensors' row counts: a model of other sizes is told apart from a cut)
    record = states[0].get("shards") or {}
    model = {k: sum(s["model"][k].shape[0] for s in states) for k in record.get("model", [])}
    optimizer: dict[str, dict[str, int]] = {}
    for index, keys in record.get("optimizer", {}).items():
        values = [_state_at(s, index) for s in states]
        optimizer[str(index)] = {k: sum(v[k].shape[0] for v in values) for k in keys}
    out[ROWS] = {"model": model, "optimizer": optimizer}
    return out


ROWS = "whole_rows"  # part()'s record: each sharded entry's rows in the whole tensor


def _state_at(state: dict[str, Any], index: Any) -> dict[str, Any]:
    """The optimizer state of parameter ``index`` (keyed by int or by str) in ``state``."""
    found = state["optimizer"]["state"]
    return found[next(i for i in found if str(i) == str(index))]


def _joined(
    states: Sequence[dict[str, Any]], join: Callable[[Sequence[torch.Tensor]], torch.Tensor]
) -> dict[str, Any]:
    first = states[0]
    record = first.get("shards") or {}
    model = dict(first["model"])
    for key in record.get("model", []):
        model[key] = join([s["model"][key] for s in states])
    optimizer = first["optimizer"]
    opt_states = {i: dict(values) for i, values in optimizer["state"].items()}
    for index, keys in record.get("optimizer", {}).items():
        found = next((i for i in opt_states if str(i) == str(index)), None)
        if found is None:
            continue
        for key in keys:
            opt_states[found][key] = join([s["optimizer"]["state"][found][key] for s in states])
    out = {k: v for k, v in first.items() if k != "shards"}
    out["model"] = model
    out["optimizer"] = {**optimizer, "state": opt_states}
    return out
