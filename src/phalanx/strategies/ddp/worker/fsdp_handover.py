"""The state of a new fsdp generation whose members are not the last one's (a shrink, a
replacement let in): no member holds the whole state, and a lost one's shards went with it.
Every member therefore takes it from the newest complete set of shard snapshots
(:mod:`phalanx.snapshot.shards`): each old rank's snapshot of one committed step, written in
its slot's folder in its machine's shared memory. Each member cuts its own rows out of them
for the new world, takes the loop's state of that step (ledger, metric sums, RNG), and the
steps since are computed again (the run's steps are a pure function of their number, so the
weights end as a run without the failure).

A machine holds its members' snapshots (``slot-<n>``) and the copies it keeps of other
machines' members' (``copy-<n>``, :mod:`phalanx.snapshot.copies`): a set may be made of
both. Every member tells the others which snapshots its machine holds (two small all-reduces;
the old generation's writers are dead or fenced), so every member chooses the same set. An
old rank's snapshot that some member's machine lacks (across nodes) is sent by the first
member whose machine holds it, over the new group (:func:`.handover.broadcast_state`); on
one machine nothing travels.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

from phalanx.loop import TrainLoop
from phalanx.snapshot import SnapshotStore
from phalanx.snapshot.copies import held_places
from phalanx.snapshot.shards import ShardSet, Written, newest_set, reshard, tag
from phalanx.snapshot.store import MAPPED_BYTES, Header, Snapshot
from phalanx.strategies.ddp.worker.fsdp_engine import FsdpEngine
from phalanx.strategies.ddp.worker.fsdp_group import FsdpGroup
from phalanx.strategies.ddp.worker.handover import broadcast_state

WRITTEN = ("generation", "world", "rank", "step", "epoch")  # a Written, as a table's row
FIELDS = len(WRITTEN)


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
    stores = [SnapshotStore(str(p)) for p in held_places(folder)]
    found: list[tuple[Written, SnapshotStore]] = []
    for store in stores:
        for header in store.headers().values():
            written = Written.of(header.tag, header.step, header.epoch) if header.whole else None
            if written is not None:
                found.append((written, store))
    everyone = _found_by_all(group, [w for w, _ in found])
    chosen = newest_set(w for held in everyone for w in held)
    if past is not None and (chosen is None or chosen.step <= past):
        return None
    if chosen is None:
        raise NoShardSet(
            "no complete set of shard snapshots on the new generation's machines: a member "
            "was lost before every member of its generation had written one, or with the "
            "snapshots of the newest set (or their copies), so its shards are lost with it"
        )
    read: list[tuple[SnapshotStore, Snapshot]] = []
    states = [_state_of(group, chosen, rank, found, everyone, read) for rank in range(chosen.world)]
    engine = loop.engine
    assert isinstance(engine, FsdpEngine)
    gone = [rank for rank, state in enumerate(states) if state is None]
    whole = [state for state in states if state is not None]
    mine = None if gone else assemble(whole, engine, group.size, group.rank)
    del states, whole  # (the views of the buffers: only this member's rows were read)
    # Every member's verdict on what it read (sent included), so that all go on or none.
    seen = float(bool(gone) or not all(store.unchanged(snap) for store, snap in read))
    torn = torch.tensor([seen], dtype=torch.float64, device=group.device)
    group.all_reduce(torn)
    if mine is None or float(torn.item()) > 0:
        ranks = f" (rank {', '.join(map(str, gone))} here)" if gone else ""
        raise NoShardSet(f"a snapshot of step {chosen.step} was rewritten while it was read{ranks}")
    loop.restore(mine)
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


def _found_by_all(group: FsdpGroup, mine: list[Written]) -> list[list[Written]]:
    """What every member's machine holds (in member rank order), from two all-reduces: the
    counts, then a table whose row ``r`` member ``r`` fills (a sum of it and zeros)."""
    counts = torch.zeros(group.size, dtype=torch.float64, device=group.device)
    counts[group.rank] = len(mine)
    group.all_reduce(counts)
    most = int(counts.max().item())
    table = torch.zeros(group.size, max(1, most), FIELDS, dtype=torch.float64)
    for i, w in enumerate(mine):
        table[group.rank, i] = torch.tensor([float(getattr(w, f)) for f in WRITTEN])
    table = table.to(group.device)
    group.all_reduce(table)
    rows = table.cpu().tolist()
    return [
        [Written(*(int(v) for v in rows[m][i])) for i in range(int(counts[m].item()))]
        for m in range(group.size)
    ]


def _state_of(
    group: FsdpGroup,
    chosen: ShardSet,
    rank: int,
    found: list[tuple[Written, SnapshotStore]],
    everyone: list[list[Written]],
    read: list[tuple[SnapshotStore, Snapshot]],
) -> dict[str, Any] | None:
    """Old rank ``rank``'s snapshot of the chosen set: read from this machine's shared
    memory (mapped: its large tensors are views of the buffer, listed in ``read``), or sent
    by the first member whose machine holds it when some member's lacks it (every member
    takes part in that broadcast). None when it was rewritten before it could be read (the
    caller tells every member, so that all give up on the set together)."""
    wanted = tag(chosen.generation, chosen.world, rank)
    holder = next((s for w, s in found if _of(w, chosen, rank)), None)
    want = functools.partial(_is, wanted, chosen.step)
    snap = None if holder is None else holder.read(want, mapped=True)
    if holder is not None and snap is not None:
        read.append((holder, snap))
    state = None if snap is None else snap.state
    have = [m for m, held in enumerate(everyone) if any(_of(w, chosen, rank) for w in held)]
    if len(have) < group.size:  # (a member on another machine: sent over the group)
        sent = broadcast_state(group, state if group.rank == have[0] else None, have[0])
        state = sent if state is None or sent is None else state  # (None: none has it now)
    return state


def assemble(
    states: list[dict[str, Any]], engine: FsdpEngine, world: int, rank: int
) -> dict[str, Any]:
    """The loop snapshot of member ``rank`` of ``world`` from an old world's snapshots
    (``states``, in old rank order): its rows of every parameter and optimizer state, the
    rest (buffers, scheduler, loop, RNG: the same on every old rank) from old rank 0's."""
    first = states[0]
    record = first.get("shards") or {}
    live = engine.sharded.model.state_dict()
    sharded = set(record.get("model", []))
    model = {k: _owned(v) for k, v in first["model"].items() if k not in sharded}
    for key in record.get("model", []):
        pieces = [s["model"][key] for s in states]
        model[key] = reshard(pieces, live[key].shape[0], world, rank)
    params = [p for g in engine.sharded.optimizer.param_groups for p in g["params"]]
    optimizer = first["optimizer"]
    opt_states: dict[Any, dict[str, Any]] = {}
    listed = {str(i): keys for i, keys in record.get("optimizer", {}).items()}
    for index, values in optimizer["state"].items():
        cut = listed.get(str(index), [])
        here = {k: _owned(v) for k, v in values.items() if k not in cut}
        for key in cut:
            pieces = [s["optimizer"]["state"][index][key] for s in states]
            here[key] = reshard(pieces, params[int(index)].shape[0], world, rank)
        opt_states[index] = here
    rest = {k: _owned(v) for k, v in first.items() if k not in ("model", "optimizer")}
    return {
        **rest,
        "model": model,
        "optimizer": {"state": opt_states, "param_groups": optimizer["param_groups"]},
    }


def _owned(value: Any) -> Any:
    """``value`` with each tensor of a mapped read (large ones: a small one such a read
    copied already) copied into storage of its own, in nested dicts, lists and tuples."""
    if isinstance(value, torch.Tensor):
        return value.clone() if value.nbytes >= MAPPED_BYTES else value
    if isinstance(value, dict):
        return {k: _owned(v) for k, v in value.items()}
    if isinstance(value, list | tuple) and not hasattr(value, "_fields"):
        return type(value)(_owned(v) for v in value)
    return value
