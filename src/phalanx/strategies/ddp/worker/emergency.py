"""The head lost: a node keeps what the run committed.

Across machines the head (node 0's process) hosts the store and decides; when it is lost,
no generation can form again. Each other node's agent then tells its workers so through
their heartbeats (:data:`.protocol.ORDER_SAVE`; no store, no head needed), and each worker,
once out of its generation (its group is aborted, or broke on the head's closed sockets),
writes an emergency checkpoint of the state it holds: the last step it committed. A member
only ever changes its state after a vote every member took part in, so that state is a step
of the run as the head would have checkpointed it. The workers of all surviving nodes write
into the shared ``run_dir`` one at a time (a lock file): the first writes its step, the
others skip a step already there (or older than one there). Under fsdp a worker holds only
its shards: each writes instead the shard snapshots (and copies) its machine holds, as the
files of a sharded checkpoint (:func:`keep_shard_snapshots`). The node's ``fit`` then ends
with :class:`~phalanx.errors.HeadLost` (exit status 75), and the same command with
``resume=True`` goes on from the newest checkpoint.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Callable, Iterator
from datetime import timedelta

from phalanx.checkpoint import Checkpointer, Checkpoints
from phalanx.checkpoint.checkpointer import META_KEY, shard_record
from phalanx.checkpoint.io import (
    checkpoint_name,
    digest_file,
    list_checkpoints,
    shard_name,
    write_shard,
)
from phalanx.loop import TrainLoop
from phalanx.runner import checkpoint_dir
from phalanx.snapshot import SnapshotStore
from phalanx.snapshot.copies import held_places
from phalanx.snapshot.shards import Written
from phalanx.snapshot.store import Header
from phalanx.spec import FitConfig
from phalanx.strategies.ddp.timing import DEFAULT
from phalanx.strategies.ddp.wire.protocol import Saved

LOCK_NAME = ".emergency.lock"


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    """An exclusive lock on ``path`` (created if missing), across processes and nodes that
    share the folder (flock; NFS emulates it with its own locks)."""
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def save_committed(
    loop: TrainLoop, config: FitConfig, slot: int, snapshots: str | None = None
) -> Saved:
    """This worker's emergency checkpoint of ``loop``'s state in ``config.run_dir``, unless
    the folder already holds that step or a newer one (a peer saved first). Under fsdp, the
    shard snapshots its machine holds in ``snapshots`` instead (:func:`keep_shard_snapshots`)."""
    step = loop.state.global_step
    if not config.run_dir:
        return Saved(slot, step, note="no run_dir: nothing is saved without one")
    if loop.engine.saves_shards:  # (fsdp: a file of one member's shards is no checkpoint)
        return keep_shard_snapshots(snapshots, checkpoint_dir(config.run_dir), slot, step)
    directory = checkpoint_dir(config.run_dir)
    os.makedirs(directory, exist_ok=True)
    with _locked(os.path.join(directory, LOCK_NAME)):
        newest = max((s for _, s in list_checkpoints(directory)), default=-1)
        if newest >= step:
            return Saved(slot, newest, os.path.join(directory, checkpoint_name(newest)))
        writer = Checkpointer(directory, config.checkpoint or Checkpoints(), lambda _: None)
        try:
            writer.save(loop.snapshot(), step=step, epoch=loop.state.epoch, metric=None)
        finally:
            writer.close()
    return Saved(slot, step, os.path.join(directory, checkpoint_name(step)), wrote=True)


def keep_committed(
    loop: TrainLoop | None, config: FitConfig, slot: int, snapshots: str | None = None
) -> Saved:
    """A worker told the head is lost: its emergency checkpoint (pending writes of its own
    checkpointer first, when it is the main member), or why there is none."""
    if loop is None:
        return Saved(slot, 0, note="nothing had trained yet")
    try:
        loop.close_checkpointer()
        return save_committed(loop, config, slot, snapshots)
    except Exception as exc:
        return Saved(slot, loop.state.global_step, note=f"the save failed: {exc!r}")


def keep_shard_snapshots(folder: str | None, directory: str, slot: int, step: int) -> Saved:
    """Under fsdp no worker holds the whole state, and the head's members' shards went with
    it; but each member's snapshots are in its machine's shared memory and copied to another
    machine (:mod:`phalanx.snapshot.copies`), so the survivors' machines together hold a
    complete set (when one was whole before the loss). Each snapshot and copy this machine
    holds (``folder``) of a step past the newest complete checkpoint in ``directory`` is
    written there as its writer's file of a sharded checkpoint at that step (rank ``r`` of
    the world of its generation, its shards and the loop's state of that step; the newest
    step first). Where the survivors' files of one step make every rank's, that step is a
    checkpoint (:func:`~phalanx.checkpoint.io.list_checkpoints`), and a takeover or a
    resume goes on from it: the steps since that snapshot are computed again, not those
    since the last checkpoint. One file at a time under the run_dir's lock, so the
    survivors' workers take turns file by file, each skipping a file already there."""
    if folder is None:
        return Saved(slot, step, note=_NO_SNAPSHOTS)
    os.makedirs(directory, exist_ok=True)
    lock = os.path.join(directory, LOCK_NAME)
    kept: set[int] = set()
    stores = [SnapshotStore(str(place)) for place in held_places(folder)]
    try:
        with _locked(lock):
            newest = max((s for _, s in list_checkpoints(directory)), default=-1)
        held = [
            (written, header, store)
            for store in stores
            for header in store.headers().values()
            if header.whole
            and (written := Written.of(header.tag, header.step, header.epoch)) is not None
            and written.step > newest
        ]
        # (the newest first, the latest generation first: where the time to save runs out,
        # the newest set is the likeliest to be whole)
        for written, header, store in sorted(held, key=lambda h: (-h[0].step, -h[0].generation)):
            with _locked(lock):
                if _write_snapshot(store, header, written, directory):
                    kept.add(written.step)
    finally:
        for store in stores:
            store.close()
    if not kept:
        return Saved(slot, step, note=_NO_SNAPSHOTS)
    steps = ", ".join(map(str, sorted(kept)))
    return Saved(
        slot,
        step,
        note=f"under fsdp a worker holds only its shards: this node kept the shard snapshots "
        f"its machine held, of step(s) {steps}, as sharded checkpoint files in {directory} "
        "(a step is a checkpoint where every member's file is there); the steps after the "
        "newest complete one are computed again",
        kept_files=True,
    )


_NO_SNAPSHOTS = (
    "under fsdp a worker holds only its shards, and this machine held no shard snapshot "
    "past the newest checkpoint: a resume starts from the newest complete sharded "
    "checkpoint and computes the steps after it again"
)


def _write_snapshot(store: SnapshotStore, header: Header, written: Written, directory: str) -> bool:
    """One snapshot as its writer's file of a sharded checkpoint, unless that file is there
    (the same rank's shards of the same step: the same state, to float rounding where
    another generation computed it); whether the file is there after. Read into this
    process whole and checked (a buffer rewritten while it was read is dropped, never
    written: a file once there is whole)."""
    path = os.path.join(directory, shard_name(written.step, written.rank, written.world))
    if os.path.exists(path) and os.path.exists(digest_file(path)):
        return True
    snap = store.read(lambda h: h == header)
    if snap is None:
        return False
    record = shard_record(written.step, written.epoch, written.rank, written.world)
    write_shard(path, {**snap.state, META_KEY: record})
    return True


def await_verdict(
    lost: Callable[[], bool],
    probe: Callable[[], object],
    limit: timedelta,
    every: timedelta = DEFAULT.probe_every,
) -> bool:
    """A worker out of its generation across machines: whether the head is lost. While
    ``probe()`` (a call to the head's store) fails, wait up to ``limit`` for the node's
    agent to say so (``lost()``; it decides within node_timeout), probing again ``every``
    while it does not; once the store answers, the head is there."""
    deadline = time.monotonic() + limit.total_seconds()
    while not lost() and time.monotonic() < deadline:
        try:
            probe()
            return lost()
        except Exception:
            time.sleep(every.total_seconds())
    return lost()
