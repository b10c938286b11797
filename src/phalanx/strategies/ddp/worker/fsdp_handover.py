"""The state of a new fsdp generation whose members are not the last one's (a shrink, a
replacement let in): no member holds the whole state, and a lost one's shards went with it.
Every member therefore takes it from the newest complete set of shard snapshots in its
machine's shared memory (:mod:`phalanx.snapshot.shards`): each old rank's snapshot of one
committed step, written in its slot's folder. Each member cuts its own rows out of them for
the new world, takes the loop's state of that step (ledger, metric sums, RNG), and the
steps since are computed again (the run's steps are a pure function of their number, so the
weights end as a run without the failure).

Every member reads the same files (the old generation's writers are dead or fenced), so
they choose the same set; an all-reduce checks that they did.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

from phalanx.loop import TrainLoop
from phalanx.snapshot import SnapshotStore
from phalanx.snapshot.shards import ShardSet, Written, newest_set, reshard, tag
from phalanx.snapshot.store import Header
from phalanx.strategies.ddp.worker.fsdp_engine import FsdpEngine
from phalanx.strategies.ddp.worker.fsdp_group import FsdpGroup


class NoShardSet(RuntimeError):
    """No complete set of shard snapshots: the state of the run is lost with a member."""


def slot_folder(folder: str, slot: int) -> str:
    """Where the member on worker slot ``slot`` writes its shard snapshots."""
    return str(Path(folder) / f"slot-{slot}")


def restore_from_set(
    loop: TrainLoop, group: FsdpGroup, folder: str, slot: int, past: int | None = None
) -> ShardSet | None:
    """Every member of the new generation: find, agree on and restore the newest complete
    set under ``folder``; returns it. Raises :class:`NoShardSet` when there is none, unless
    ``past`` is given (a restart that resumed from a checkpoint at that step): then the set
    is restored only when it is further, and None returned otherwise.

    Each member then forgets the other snapshots in its own slot's folder (``slot``): its
    next snapshot goes into a buffer that holds none of the set, so the set it started from
    stays whole until a newer one is."""
    stores = [SnapshotStore(str(p)) for p in sorted(Path(folder).glob("slot-*"))]
    found: list[tuple[Written, SnapshotStore]] = []
    for store in stores:
        for header in store.headers().values():
            written = Written.of(header.tag, header.step, header.epoch) if header.whole else None
            if written is not None:
                found.append((written, store))
    chosen = newest_set(w for w, _ in found)
    _agree(group, chosen)
    if past is not None and (chosen is None or chosen.step <= past):
        return None
    if chosen is None:
        raise NoShardSet(
            "no complete set of shard snapshots: a member was lost before every member "
            "of its generation had written one, so its shards are lost with it"
        )
    states: list[dict[str, Any]] = []
    for rank in range(chosen.world):
        wanted = tag(chosen.generation, chosen.world, rank)
        holder = next(s for w, s in found if _of(w, chosen, rank))
        snap = holder.read(functools.partial(_is, wanted, chosen.step))
        if snap is None:
            raise NoShardSet(f"the snapshot of rank {rank} at step {chosen.step} was rewritten")
        states.append(snap.state)
    engine = loop.engine
    assert isinstance(engine, FsdpEngine)
    loop.restore(assemble(states, engine, group.size, group.rank))
    for store in stores:
        store.close()
    SnapshotStore(slot_folder(folder, slot)).forget(
        lambda h: not ((w := Written.of(h.tag, h.step, h.epoch)) and _of(w, chosen, w.rank))
    )
    return chosen


def _of(written: Written, chosen: ShardSet, rank: int) -> bool:
    key = (written.generation, written.world, written.rank, written.step)
    return key == (chosen.generation, chosen.world, rank, chosen.step)


def _is(wanted: int, step: int, header: Header) -> bool:
    return header.tag == wanted and header.step == step


def _agree(group: FsdpGroup, chosen: ShardSet | None) -> None:
    """Every member chose the same set (or none)."""
    key = [-1.0, -1.0] if chosen is None else [float(chosen.generation), float(chosen.step)]
    every = torch.zeros(group.size, 2, dtype=torch.float64, device=group.device)
    every[group.rank] = torch.tensor(key, dtype=torch.float64)
    group.all_reduce(every)  # (each row one member's: a sum of it and zeros)
    if any(row != key for row in every.tolist()):
        raise NoShardSet(
            "the members of the new generation found different shard sets "
            f"(this one: {chosen}); they cannot start from one state"
        )


def assemble(
    states: list[dict[str, Any]], engine: FsdpEngine, world: int, rank: int
) -> dict[str, Any]:
    """The loop snapshot of member ``rank`` of ``world`` from an old world's snapshots
    (``states``, in old rank order): its rows of every parameter and optimizer state, the
    rest (buffers, scheduler, loop, RNG: the same on every old rank) from old rank 0's."""
    first = states[0]
    record = first.get("shards") or {}
    live = engine.sharded.model.state_dict()
    model = dict(first["model"])
    for key in record.get("model", []):
        pieces = [s["model"][key] for s in states]
        model[key] = reshard(pieces, live[key].shape[0], world, rank)
    params = [p for g in engine.sharded.optimizer.param_groups for p in g["params"]]
    optimizer = first["optimizer"]
    opt_states: dict[Any, dict[str, Any]] = {}
    listed = {str(i): keys for i, keys in record.get("optimizer", {}).items()}
    for index, values in optimizer["state"].items():
        here = dict(values)
        for key in listed.get(str(index), []):
            pieces = [s["optimizer"]["state"][index][key] for s in states]
            here[key] = reshard(pieces, params[int(index)].shape[0], world, rank)
        opt_states[index] = here
    return {
        **first,
        "model": model,
        "optimizer": {"state": opt_states, "param_groups": optimizer["param_groups"]},
    }
