"""TensorBoard: scalars per step and per epoch, failures and warnings as text.

Needs the ``tensorboard`` package (``pip install "phalanx[tensorboard]"``); it writes with
torch's own ``torch.utils.tensorboard.SummaryWriter``. Tags:

- ``step/<key>`` at each committed global step: ``train/loss`` (the step's own loss),
  ``train/lr``, ``train/samples_per_s`` and the epoch's running train metrics
  (``train/accuracy``, ...),
  and ``valid/<metric>`` of a mid-epoch validation (``fit(val_every_steps=N)``);
- ``epoch/<key>`` at each epoch end (x = the epoch, counted from 1): every key of the
  epoch's history entry (``train/loss``, ``valid/accuracy``, ...);
- text ``failures`` (each failure the run saw: worker, device, step, phase, cause, action),
  at the step it failed in, numbered from 1 as on screen (one before the first step: at the
  latest committed step), and ``notices`` (warnings such as a skipped checkpoint or early
  stopping), at the latest committed step.
"""

from __future__ import annotations

import os
from typing import Any

from phalanx.events import (
    CheckpointSkipped,
    EpochEnded,
    Event,
    Notice,
    RunEnded,
    RunStarted,
    StepEnded,
    Validated,
    WorkerFailed,
)
from phalanx.sinks.trackers import failed_at, failure_text, finite, notice_text, step_scalars


class TensorBoardSink:
    """Writes the run's events into ``log_dir`` (created if missing) for ``tensorboard
    --logdir``. Pass it to ``fit(loggers=[TensorBoardSink(f"{run_dir}/tb")])`` to keep the
    terminal and run-folder output. Raises ImportError naming the extra when the
    ``tensorboard`` package is missing."""

    def __init__(self, log_dir: str | os.PathLike[str]) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:  # torch's module imports tensorboard itself
            raise ImportError(
                'TensorBoardSink needs the tensorboard package: pip install "phalanx[tensorboard]"'
            ) from exc
        self.log_dir = os.fspath(log_dir)
        self._writer: Any = SummaryWriter(log_dir=self.log_dir)
        self._step = 0  # the latest committed global step: where text goes

    def handle(self, event: Event) -> None:
        if isinstance(event, StepEnded):
            self._step = event.global_step
            self._scalars("step", step_scalars(event), event.global_step)
        elif isinstance(event, Validated):
            self._scalars("step", event.metrics, event.global_step)
        elif isinstance(event, EpochEnded):
            self._scalars("epoch", event.metrics, event.epoch + 1)
        elif isinstance(event, WorkerFailed):
            at = failed_at(event, self._step)
            self._writer.add_text("failures", failure_text(event), at)
        elif isinstance(event, (CheckpointSkipped, Notice)):
            self._writer.add_text("notices", notice_text(event), self._step)
        elif isinstance(event, RunStarted):  # (after a resume: where it goes on)
            self._step = event.start_epoch * event.steps_per_epoch + event.start_step
        elif isinstance(event, RunEnded):
            self._writer.flush()

    def _scalars(self, prefix: str, values: dict[str, float], step: int) -> None:
        for key, number in finite(values).items():
            self._writer.add_scalar(f"{prefix}/{key}", number, step)

    def close(self) -> None:
        self._writer.close()
