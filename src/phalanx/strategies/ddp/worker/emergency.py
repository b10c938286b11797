"""The head lost: a node keeps what the run committed.

Across machines the head (node 0's process) hosts the store and decides; when it is lost,
no generation can form again. Each other node's agent then tells its workers so through
their heartbeats (:data:`.protocol.ORDER_SAVE`; no store, no head needed), and each worker,
once out of its generation (its group is aborted, or broke on the head's closed sockets),
writes an emergency checkpoint of the state it holds: the last step it committed. A member
only ever changes its state after a vote every member took part in, so that state is a step
of the run as the head would have checkpointed it. The workers of all surviving nodes write
into the shared ``run_dir`` one at a time (a lock file): the first writes its step, the
others skip a step already there (or older than one there). The node's ``fit`` then ends
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
from phalanx.checkpoint.io import checkpoint_name, list_checkpoints
from phalanx.loop import TrainLoop
from phalanx.runner import checkpoint_dir
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


def save_committed(loop: TrainLoop, config: FitConfig, slot: int) -> Saved:
    """This worker's emergency checkpoint of ``loop``'s state in ``config.run_dir``, unless
    the folder already holds that step or a newer one (a peer saved first)."""
    step = loop.state.global_step
    if not config.run_dir:
        return Saved(slot, step, note="no run_dir: nothing is saved without one")
    if loop.engine.saves_shards:  # (fsdp: a file of one member's shards is no checkpoint)
        return Saved(
            slot,
            step,
            note="under fsdp a worker holds only its shards, and the head's went with it: "
            "nothing is saved, a resume starts from the newest complete sharded checkpoint "
            "and computes the steps after it again",
        )
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


def keep_committed(loop: TrainLoop | None, config: FitConfig, slot: int) -> Saved:
    """A worker told the head is lost: its emergency checkpoint (pending writes of its own
    checkpointer first, when it is the main member), or why there is none."""
    if loop is None:
        return Saved(slot, 0, note="nothing had trained yet")
    try:
        loop.close_checkpointer()
        return save_committed(loop, config, slot)
    except Exception as exc:
        return Saved(slot, loop.state.global_step, note=f"the save failed: {exc!r}")


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
