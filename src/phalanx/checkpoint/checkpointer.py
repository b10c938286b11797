"""The checkpointer: snapshots state, writes it in the background, applies the retention policy.

Directory layout::

    ckpt-000000120.pt      one file per checkpoint, named by global step: torch.save's format
    checkpoints.json       index: step/epoch/metric, SHA-256 and length per file, so keep_best
                           survives a restart and a damaged file is told apart

Each file holds the saved state's keys plus ``"phalanx": {"format", "step", "epoch",
"metric"}``, and opens with ``torch.load(path, weights_only=True)``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from phalanx.checkpoint.config import Checkpoints
from phalanx.checkpoint.io import (
    Digest,
    checkpoint_name,
    list_checkpoints,
    peek,
    read_checkpoint,
    remove_checkpoint,
    shard_files,
    shard_name,
    stale_shards,
    to_cpu,
    write_atomic,
    write_bytes_atomic,
    write_shard,
)
from phalanx.checkpoint.policy import CheckpointInfo, retention
from phalanx.errors import CheckpointError, CheckpointFormatError
from phalanx.events import CheckpointDeleted, CheckpointSaved, CheckpointSkipped, Emit

INDEX_NAME = "checkpoints.json"
META_KEY = "phalanx"  # the file's own record: format, step, epoch, metric
FORMAT = 2  # 1 had a header before torch's bytes (io.OLD_MAGIC)


@dataclass
class _Job:
    state: dict[str, Any]
    step: int
    epoch: int
    metric: float | None


class Checkpointer:
    """Saves checkpoints into ``directory`` (created if missing) under ``config``.

    - :meth:`save` snapshots the state to CPU before returning; one background thread writes
      snapshots in the order they were saved, then deletes what :func:`retention` says,
      emitting :class:`CheckpointSaved` / :class:`CheckpointDeleted` from that thread.
    - A failed write leaves every existing file untouched (writes are atomic and retention
      runs only after a successful write; the file just written is never deleted). The error
      is kept and re-raised as :class:`~phalanx.errors.CheckpointError` (original as
      ``__cause__``) by the next :meth:`save`, :meth:`wait` or :meth:`close`.
    - :meth:`close` waits for pending saves and joins the thread; call it (or use ``with``).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        config: Checkpoints,
        emit: Emit,
        guard: Callable[[], str | None] | None = None,
    ) -> None:
        self.directory = os.fspath(directory)
        # Read just before each write: why this writer may no longer write here (a head that
        # another took over from), or None; a write it stops is skipped (CheckpointSkipped).
        self.guard = guard
        self.config = config
        self._emit = emit
        os.makedirs(self.directory, exist_ok=True)
        self._index_path = os.path.join(self.directory, INDEX_NAME)
        self._index = read_index(self.directory)  # file name -> meta; touched only by the thread
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._error: CheckpointError | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="phalanx-checkpointer", daemon=True)
        self._thread.start()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def save(self, state: dict[str, Any], *, step: int, epoch: int, metric: float | None) -> None:
        """Queue a checkpoint of ``state`` at global ``step``. The state is copied to CPU
        before this returns, so training may modify it in place right away. ``metric`` is the
        ``keep_best`` value for this checkpoint (None if not known). Raises CheckpointError
        for an earlier failed save, or after :meth:`close`."""
        self._raise_pending()
        if self._closed:
            raise CheckpointError(f"{self.directory}: save() after close()")
        snapshot = to_cpu(state)
        self._queue.put(_Job(snapshot, step, epoch, None if metric is None else float(metric)))

    def wait(self) -> None:
        """Block until every queued save is on disk (and retention applied); raise
        CheckpointError if a save failed since the last check."""
        self._queue.join()
        self._raise_pending()

    def close(self) -> None:
        """Wait for pending saves, stop and join the thread, raise any pending error.
        Calling it again only re-checks for errors."""
        if not self._closed:
            self._closed = True
            self._queue.put(None)
            self._thread.join()
        self._raise_pending()

    def load_latest(
        self, member: tuple[int, int] | None = None
    ) -> tuple[dict[str, Any], CheckpointInfo] | None:
        """The newest checkpoint that verifies, as ``(state, info)``; None if there is none.
        Waits for queued saves first. Each newer file that fails verification is skipped with
        a :class:`CheckpointSkipped` event naming it and the reason; nothing is deleted."""
        self._queue.join()
        for path, step in reversed(list_checkpoints(self.directory)):
            try:
                state, info = self._read(path, step, member)
            except CheckpointFormatError:
                raise  # never released: say so rather than quietly resume from older files
            except CheckpointError as exc:
                self._emit(CheckpointSkipped(path=path, reason=exc.message))
                continue
            return state, info
        return None

    def _read(
        self, path: str, step: int, member: tuple[int, int] | None = None
    ) -> tuple[dict[str, Any], CheckpointInfo]:
        """A file's state (without its record) and info, verified against the index (a
        sharded one cut to ``member``'s rows when given: see ``read_checkpoint``)."""
        payload = read_checkpoint(path, self._digest(os.path.basename(path)), member)
        meta = payload.pop(META_KEY, None)
        try:
            metric = meta["metric"]
            epoch = int(meta["epoch"])
            info = CheckpointInfo(path, step, epoch, None if metric is None else float(metric))
        except (KeyError, TypeError, ValueError) as exc:  # (None[...] is a TypeError)
            raise CheckpointError(
                f"{path}: not written by a Checkpointer (no {META_KEY!r} record: {exc!r})"
            ) from exc
        return payload, info

    def _digest(self, name: str) -> Digest | None:
        return digest_of(self._index.get(name, {}))

    # --- background thread -------------------------------------------------------------

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                self._write(job)
            except BaseException as exc:
                step = "?" if job is None else job.step
                error = CheckpointError(
                    f"checkpoint for step {step} was not saved in "
                    f"{self.directory}: {exc!r}; earlier checkpoints are untouched"
                )
                error.__cause__ = exc
                error.step = None if job is None else job.step  # (not the step that finds it)
                with self._lock:
                    if self._error is None:
                        self._error = error
            finally:
                self._queue.task_done()

    def _write(self, job: _Job) -> None:
        name = checkpoint_name(job.step)
        path = os.path.join(self.directory, name)
        stopped = None if self.guard is None else self.guard()
        if stopped is not None:
            self._emit(CheckpointSkipped(path=path, reason=stopped))
            return
        meta = {"step": job.step, "epoch": job.epoch, "metric": job.metric}
        if self._index.pop(name, None) is not None:  # the same step again (an epoch end that
            self._write_index()  # is a step multiple too): never leave its old checksum listed
        digest = write_atomic(path, {**job.state, META_KEY: {"format": FORMAT, **meta}})
        self._index[name] = {**meta, "sha256": digest.sha256, "bytes": digest.size}
        self._write_index()
        self._emit(CheckpointSaved(path=path, step=job.step, epoch=job.epoch))
        self._retain(path)

    def _retain(self, path: str) -> None:
        """Delete what the retention policy says, never ``path`` (just written)."""
        deleted = False
        for info in retention(self._existing(), self.config):
            if info.path == path:  # never delete what was just written
                continue
            remove_checkpoint(info.path)
            self._index.pop(os.path.basename(info.path), None)
            deleted = True
            self._emit(CheckpointDeleted(path=info.path))
        if deleted:
            self._write_index()

    def _existing(self) -> list[CheckpointInfo]:
        """Checkpoints on disk, with epoch/metric from the index (or, for a file the index
        does not know, from the file itself; -1/None if it does not verify)."""
        found = []
        for path, step in list_checkpoints(self.directory):
            name = os.path.basename(path)
            if name not in self._index:
                self._index[name] = self._meta_from_file(path, step)
            meta = self._index[name]
            metric = meta.get("metric")
            found.append(
                CheckpointInfo(
                    path, step, int(meta.get("epoch", -1)), None if metric is None else metric
                )
            )
        return found

    def _meta_from_file(self, path: str, step: int) -> dict[str, Any]:
        """Epoch and metric of a file the index does not list (no checksum is recorded for
        it: its contents were never checked against one)."""
        try:
            if shard_files(path) is not None:  # (rank 0's record only: never the whole model)
                meta = peek(path, META_KEY)
                metric = meta["metric"]
                return {"step": step, "epoch": int(meta["epoch"]), "metric": metric}
            _, info = self._read(path, step)
            return {"step": step, "epoch": info.epoch, "metric": info.metric}
        except (CheckpointError, KeyError, TypeError, ValueError):
            return {"step": step, "epoch": -1, "metric": None}

    def _write_index(self) -> None:
        on_disk = {os.path.basename(p) for p, _ in list_checkpoints(self.directory)}
        entries = {
            name: {**meta, "metric": _json_metric(meta.get("metric"))}
            for name, meta in sorted(self._index.items())
            if name in on_disk
        }
        data = json.dumps({"version": 1, "checkpoints": entries}, indent=1, allow_nan=False)
        write_bytes_atomic(self._index_path, data.encode("utf-8") + b"\n")

    def _raise_pending(self) -> None:
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            raise error


@dataclass
class _ShardJob(_Job):
    rank: int = 0
    world: int = 1


class ShardedCheckpointer(Checkpointer):
    """Under fsdp every member saves its own shards of a checkpoint: rank ``r`` of a world
    of ``w`` writes ``ckpt-{step:09d}.rank-{r}-of-{w}.pt`` and its digest beside it, each
    atomically, and no member gathers the model. A checkpoint exists once every rank's file
    is there (:func:`~phalanx.checkpoint.io.list_checkpoints` lists no other), so a run
    killed while writing one keeps the one before. Rank 0 waits up to ``complete_wait``
    seconds for the others' files (looking every ``poll`` seconds), then indexes the
    checkpoint and applies the retention policy (deleting every rank's file of a checkpoint
    it drops). Read back, a sharded
    checkpoint is the whole state (:func:`~phalanx.checkpoint.io.read_checkpoint`), which
    any strategy resumes from, and fsdp on any number of members (each cuts its rows).
    :attr:`rank` and :attr:`world` follow the member's generation; each save keeps its own."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        config: Checkpoints,
        emit: Emit,
        complete_wait: float,
        poll: float,
    ) -> None:
        self.rank, self.world = 0, 1
        self.complete_wait, self.poll = complete_wait, poll  # (seconds: the run's Timing)
        super().__init__(directory, config, emit)

    def save(self, state: dict[str, Any], *, step: int, epoch: int, metric: float | None) -> None:
        self._raise_pending()
        if self._closed:
            raise CheckpointError(f"{self.directory}: save() after close()")
        value = None if metric is None else float(metric)
        self._queue.put(_ShardJob(to_cpu(state), step, epoch, value, self.rank, self.world))

    def _write(self, job: _Job) -> None:
        assert isinstance(job, _ShardJob)
        meta = {"step": job.step, "epoch": job.epoch, "metric": job.metric}
        mine = os.path.join(self.directory, shard_name(job.step, job.rank, job.world))
        record = shard_record(job.step, job.epoch, job.rank, job.world, job.metric)
        write_shard(mine, {**job.state, META_KEY: record})
        if job.rank != 0:
            return
        files = shard_files(mine) or [mine]
        deadline = time.monotonic() + self.complete_wait
        while not all(os.path.exists(f) for f in files):
            if time.monotonic() > deadline:
                missing = [os.path.basename(f) for f in files if not os.path.exists(f)]
                why = (
                    f"not every rank's shard was written within {self.complete_wait:g}s "
                    "(across nodes, run_dir must be a folder every node shares)"
                )
                self._emit(CheckpointSkipped(path=mine, reason=f"{why} ({', '.join(missing)})"))
                return
            time.sleep(self.poll)
        # (read again: rank 0 of an earlier generation, another process, may have written it)
        self._index = {**read_index(self.directory), **self._index}
        self._index[os.path.basename(mine)] = meta  # (each shard's digest is beside it)
        self._write_index()
        self._emit(CheckpointSaved(path=mine, step=job.step, epoch=job.epoch))
        self._retain(mine)
        for stale in stale_shards(self.directory, job.step):
            with contextlib.suppress(FileNotFoundError):
                os.remove(stale)


def shard_record(
    step: int, epoch: int, rank: int, world: int, metric: float | None = None
) -> dict[str, Any]:
    """The record a rank's file of a sharded checkpoint holds under :data:`META_KEY`."""
    record = {"format": FORMAT, "step": step, "epoch": epoch, "metric": metric}
    return {**record, "rank": rank, "world": world}


def read_index(directory: str) -> dict[str, dict[str, Any]]:
    """The index in ``directory``: file name -> step, epoch, metric, sha256, bytes. Empty if
    missing or unreadable (the Checkpointer rebuilds it from the files; their checksums are
    lost then, and a file is accepted when torch opens it)."""
    try:
        with open(os.path.join(directory, INDEX_NAME), encoding="utf-8") as f:
            entries = json.load(f)["checkpoints"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    if not isinstance(entries, dict):
        return {}
    return {
        name: meta
        for name, meta in entries.items()
        if isinstance(meta, dict)
        and (meta.get("metric") is None or isinstance(meta.get("metric"), (int, float)))
    }


def digest_of(meta: dict[str, Any]) -> Digest | None:
    """The SHA-256 and length an index entry records (None when it has none)."""
    sha, size = meta.get("sha256"), meta.get("bytes")
    if isinstance(sha, str) and isinstance(size, int):
        return Digest(sha, size)
    return None


def load_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A checkpoint written by phalanx, as the dict ``torch.load(path, weights_only=True)``
    gives (tensors on CPU), after checking it against the checksum its directory's index
    records. ``path`` is a checkpoint file, or a ``run_dir`` (or its ``checkpoints/``) for the
    newest one that verifies. Keys: ``model`` (the model's state dict, for
    ``model.load_state_dict``), ``optimizer``, ``scheduler``, ``loop`` (``epoch``, ``step``,
    ``global_step``, ``history``, ...), ``early_stopping``, ``plan``, ``rng`` and ``phalanx``
    (``format``, ``step``, ``epoch``, ``metric``). Raises CheckpointError when nothing
    usable is found (the reason per file), CheckpointFormatError for a first-format file."""
    name = os.fspath(path)
    if not os.path.isdir(name):
        folder = os.path.dirname(os.path.abspath(name))
        digest = digest_of(read_index(folder).get(os.path.basename(name), {}))
        return read_checkpoint(name, digest)
    nested = os.path.join(name, "checkpoints")
    folder = nested if os.path.isdir(nested) else name
    index = read_index(folder)
    reasons = []
    for file, _ in reversed(list_checkpoints(folder)):
        try:
            return read_checkpoint(file, digest_of(index.get(os.path.basename(file), {})))
        except CheckpointFormatError:
            raise
        except CheckpointError as exc:
            reasons.append(exc.message)
    found = "; ".join(reasons) if reasons else "no ckpt-*.pt file"
    raise CheckpointError(f"no usable checkpoint in {folder}: {found}")


def _json_metric(metric: Any) -> float | None:
    """Non-finite metrics never count as best (see policy.best), so they are stored as null,
    which keeps the index strict JSON."""
    if metric is None or not math.isfinite(float(metric)):
        return None
    return float(metric)
