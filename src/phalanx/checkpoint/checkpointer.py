"""The checkpointer: snapshots state, writes it in the background, applies the retention policy.

Directory layout::

    ckpt-000000120.pt      one file per checkpoint, named by global step (see io.py's format)
    checkpoints.json       index: step/epoch/metric per file, so keep_best survives a restart

Each file's payload is ``{"meta": {"step", "epoch", "metric"}, "state": <the saved state>}``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import queue
import threading
from dataclasses import dataclass
from typing import Any

from phalanx.checkpoint.config import Checkpoints
from phalanx.checkpoint.io import (
    checkpoint_name,
    list_checkpoints,
    read_verified,
    to_cpu,
    write_atomic,
    write_bytes_atomic,
)
from phalanx.checkpoint.policy import CheckpointInfo, retention
from phalanx.errors import CheckpointError
from phalanx.events import CheckpointDeleted, CheckpointSaved, CheckpointSkipped, Emit

INDEX_NAME = "checkpoints.json"


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

    def __init__(self, directory: str | os.PathLike[str], config: Checkpoints, emit: Emit) -> None:
        self.directory = os.fspath(directory)
        self.config = config
        self._emit = emit
        os.makedirs(self.directory, exist_ok=True)
        self._index_path = os.path.join(self.directory, INDEX_NAME)
        self._index = self._read_index()  # file name -> meta; touched only by the thread
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

    def load_latest(self) -> tuple[dict[str, Any], CheckpointInfo] | None:
        """The newest checkpoint that verifies, as ``(state, info)``; None if there is none.
        Waits for queued saves first. Each newer file that fails verification is skipped with
        a :class:`CheckpointSkipped` event naming it and the reason; nothing is deleted."""
        self._queue.join()
        for path, _ in reversed(list_checkpoints(self.directory)):
            try:
                payload = read_verified(path)
                meta, state = payload["meta"], payload["state"]
                metric = meta["metric"]
                info = CheckpointInfo(
                    path,
                    int(meta["step"]),
                    int(meta["epoch"]),
                    None if metric is None else float(metric),
                )
            except CheckpointError as exc:
                self._emit(CheckpointSkipped(path=path, reason=exc.message))
                continue
            except (KeyError, TypeError, ValueError) as exc:
                reason = f"{path}: not written by a Checkpointer (no meta/state: {exc!r})"
                self._emit(CheckpointSkipped(path=path, reason=reason))
                continue
            return state, info
        return None

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
                with self._lock:
                    if self._error is None:
                        self._error = error
            finally:
                self._queue.task_done()

    def _write(self, job: _Job) -> None:
        name = checkpoint_name(job.step)
        path = os.path.join(self.directory, name)
        meta = {"step": job.step, "epoch": job.epoch, "metric": job.metric}
        write_atomic(path, {"meta": meta, "state": job.state})
        self._index[name] = meta
        self._write_index()
        self._emit(CheckpointSaved(path=path, step=job.step, epoch=job.epoch))
        deleted = False
        for info in retention(self._existing(), self.config):
            if info.path == path:  # never delete what was just written
                continue
            with contextlib.suppress(FileNotFoundError):
                os.remove(info.path)
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

    @staticmethod
    def _meta_from_file(path: str, step: int) -> dict[str, Any]:
        try:
            meta = read_verified(path)["meta"]
            return {"step": step, "epoch": int(meta["epoch"]), "metric": meta["metric"]}
        except (CheckpointError, KeyError, TypeError, ValueError):
            return {"step": step, "epoch": -1, "metric": None}

    def _read_index(self) -> dict[str, dict[str, Any]]:
        """The index on disk; empty if missing or unreadable (it is rebuilt from the files)."""
        try:
            with open(self._index_path, encoding="utf-8") as f:
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


def _json_metric(metric: Any) -> float | None:
    """Non-finite metrics never count as best (see policy.best), so they are stored as null,
    which keeps the index strict JSON."""
    if metric is None or not math.isfinite(float(metric)):
        return None
    return float(metric)
