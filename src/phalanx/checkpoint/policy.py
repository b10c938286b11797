"""Checkpoint policy: pure decisions, no I/O.

The :class:`~phalanx.checkpoint.checkpointer.Checkpointer` does the I/O and asks these
functions what to do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from phalanx.checkpoint.config import Checkpoints


@dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint on disk. ``step`` is the global (committed optimizer) step; ``metric`` is
    the value of ``Checkpoints.keep_best`` when it was saved (None if unknown)."""

    path: str
    step: int
    epoch: int
    metric: float | None


def should_save(
    global_step: int, epoch_end: bool, config: Checkpoints, epochs_done: int = 1
) -> bool:
    """True at an epoch end when ``every_epoch`` is set and ``epochs_done`` (finished epochs,
    counting the one that just ended) is a multiple of ``every_epochs`` (default 1), or when
    ``every_steps`` is set and ``global_step`` (> 0) is a multiple of it. Callers ask once
    after each step (``epoch_end=False``) and once after validation (``epoch_end=True``);
    saving the same step twice just replaces the file."""
    if epoch_end and config.every_epoch and epochs_done % (config.every_epochs or 1) == 0:
        return True
    every = config.every_steps
    return every is not None and global_step > 0 and global_step % every == 0


def best(existing: list[CheckpointInfo], config: Checkpoints) -> CheckpointInfo | None:
    """The best checkpoint by ``metric`` under ``config.mode()``. None, NaN and infinite
    metrics never count; ties go to the older (lower step) one. None when ``keep_best`` is
    unset or nothing has a usable metric."""
    if config.keep_best is None:
        return None
    scored = [c for c in existing if c.metric is not None and math.isfinite(c.metric)]
    if not scored:
        return None
    sign = 1.0 if config.mode() == "min" else -1.0
    return min(scored, key=lambda c: (sign * (c.metric or 0.0), c.step, c.path))


def retention(existing: list[CheckpointInfo], config: Checkpoints) -> list[CheckpointInfo]:
    """The checkpoints to DELETE, oldest first: everything except the newest ``keep_last`` by
    step and (when ``keep_best`` is set) the single best by metric, see :func:`best`."""
    newest_first = sorted(existing, key=lambda c: (c.step, c.epoch, c.path), reverse=True)
    keep = {c.path for c in newest_first[: config.keep_last]}
    top = best(existing, config)
    if top is not None:
        keep.add(top.path)
    return [c for c in reversed(newest_first) if c.path not in keep]
