"""Weights & Biases: scalars per step and per epoch, the run's configuration, failures and
notices as tables.

Needs the ``wandb`` package (``pip install "phalanx[wandb]"``). The W&B run starts with the
first event of ``fit`` (``wandb.init``) and finishes when ``fit`` closes its sinks. Written
into it:

- history at each committed global step (W&B's ``step``): ``step/train/loss`` (the
  step's own loss), ``step/train/lr``, ``step/train/samples_per_s`` and the epoch's running
  train metrics (``step/train/accuracy``, ...), and ``step/valid/<metric>`` of a mid-epoch
  validation (``fit(val_every_steps=N)``);
- ``epoch/<key>`` at each epoch end, every key of the epoch's history entry
  (``epoch/train/loss``, ``epoch/valid/accuracy``, ...), with ``epoch`` (counted from 1) in the
  same row, at the epoch's last step; the ``epoch/*`` charts use ``epoch`` as their x axis;
- ``failures``: the count of failures so far, at the step each failure happened in (numbered
  from 1 as on screen), and at the end the table ``failure_log`` (one row per failure:
  worker, rank, device, step, phase, kind, cause, action, and the line the screen shows);
- the table ``notices`` at the end (warnings such as a skipped checkpoint or early stopping:
  the latest committed step, level, text), when there were any;
- the configuration (``run.config``): with a ``run_dir``, ``run_id`` and every ``fit``
  setting as ``run.json`` keeps it; always ``strategy``, ``devices``, ``epochs``,
  ``batch_size``, ``steps_per_epoch``, ``train_samples``, ``valid_samples``, ``start_epoch``,
  ``start_step``. Keys the caller gave ``config=`` keep the caller's values;
- the summary: ``failures`` (0 for a run without any) and ``outcome`` (``finished``,
  ``interrupted``, ``failed``); a failed run finishes with exit code 1.

NaN values are left out. W&B's steps only increase: when every ddp worker fell and the run
restarted from an earlier state, the steps it computes again keep their first values.
``mode="offline"`` (or ``WANDB_MODE=offline``) writes the run under ``dir`` for a later
``wandb sync``; phalanx's tests use it, with no network.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from phalanx.events import (
    CheckpointSkipped,
    EpochEnded,
    Event,
    Notice,
    RunEnded,
    RunOpened,
    StepEnded,
    Validated,
    WorkerFailed,
)
from phalanx.failures import cause
from phalanx.sinks.trackers import (
    RunConfig,
    failed_at,
    failure_text,
    finite,
    notice_text,
    step_scalars,
)

FAILURE_COLUMNS = [
    "failure",
    "worker",
    "rank",
    "device",
    "step",
    "phase",
    "kind",
    "cause",
    "action",
    "text",
]
NOTICE_COLUMNS = ["step", "level", "text"]


class WandbSink:
    """Logs the run to Weights & Biases; see the module docstring. ``project``, ``name``,
    ``dir``, ``mode`` and ``init_kwargs`` (``entity=``, ``config=``, ``tags=``, ...) go to
    ``wandb.init``; left out, W&B's own defaults and ``WANDB_*`` variables apply, except the
    name: with a ``run_dir``, the phalanx run id. Pass it to ``fit(loggers=[...])`` to keep the
    terminal and run-folder output. ``run`` is the W&B run once ``fit`` has started. Raises
    ImportError naming the extra when the ``wandb`` package is missing."""

    def __init__(
        self,
        project: str | None = None,
        *,
        name: str | None = None,
        dir: str | os.PathLike[str] | None = None,
        mode: str | None = None,
        **init_kwargs: Any,
    ) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise ImportError(
                'WandbSink needs the wandb package: pip install "phalanx[wandb]"'
            ) from exc
        self._wandb: Any = wandb
        if dir is not None:
            os.makedirs(dir, exist_ok=True)
        given = {"project": project, "name": name, "dir": dir, "mode": mode}
        self._init = {k: v for k, v in given.items() if v is not None} | init_kwargs
        self.run: Any = None
        self._lock = threading.Lock()  # events may come from several threads
        self._closed = False
        self._config = RunConfig()
        self._step = 0  # the latest step logged: W&B takes none below it
        self._committed = 0  # the latest committed step logged
        self._failures: list[list[Any]] = []
        self._notices: list[list[Any]] = []
        self._exit_code = 0

    def handle(self, event: Event) -> None:
        with self._lock:
            if self._closed:
                return
            if self.run is None:
                self._start(event)
            config = self._config.take(event)
            if config is not None:
                self.run.config.setdefaults(config)
            self._take(event)

    def _start(self, event: Event) -> None:
        kwargs = dict(self._init)
        if isinstance(event, RunOpened):
            kwargs.setdefault("name", event.run_id)
        self.run = self._wandb.init(**kwargs)
        self.run.define_metric("epoch/*", step_metric="epoch")

    def _take(self, event: Event) -> None:
        if isinstance(event, StepEnded):
            if event.global_step <= self._committed:  # computed again after a restart
                return
            self._committed = event.global_step
            self._log(_prefixed("step", step_scalars(event)), event.global_step)
        elif isinstance(event, Validated):
            self._log(_prefixed("step", event.metrics), event.global_step)
        elif isinstance(event, EpochEnded):
            self._log(_prefixed("epoch", event.metrics), self._step, epoch=event.epoch + 1)
        elif isinstance(event, WorkerFailed):
            f = event.failure
            row = [len(self._failures) + 1, f.worker, f.rank, f.device]
            row += [None if f.step is None else f.step + 1, f.phase, f.kind, cause(f)]
            self._failures.append([*row, event.action, failure_text(event)])
            at = max(failed_at(event, self._step), self._step)
            self._log({}, at, failures=len(self._failures))
        elif isinstance(event, CheckpointSkipped):
            self._notices.append([self._step, "warning", notice_text(event)])
        elif isinstance(event, Notice):
            self._notices.append([self._step, event.level, event.text])
        elif isinstance(event, RunEnded):
            self._end(event)

    def _log(self, values: dict[str, float], step: int, **counts: int) -> None:
        """``values`` (NaN left out) and ``counts`` at ``step``, unless W&B has a later step
        (a step computed again after a restart keeps its first values)."""
        row: dict[str, Any] = {**finite(values), **counts}
        if step < self._step or not row:
            return
        self._step = step
        self.run.log(row, step=step)

    def _end(self, event: RunEnded) -> None:
        tables = {}
        if self._failures:
            tables["failure_log"] = self._wandb.Table(FAILURE_COLUMNS, self._failures)
        if self._notices:
            tables["notices"] = self._wandb.Table(NOTICE_COLUMNS, self._notices)
        if tables:
            self.run.log(tables, step=self._step)
        outcome = "failed" if event.failed else "interrupted" if event.interrupted else "finished"
        self.run.summary["failures"] = len(self._failures)
        self.run.summary["outcome"] = outcome
        self._exit_code = 1 if event.failed else 0

    def close(self) -> None:
        """Finish the W&B run (once); later events are ignored."""
        with self._lock:
            if self.run is not None and not self._closed:
                self.run.finish(exit_code=self._exit_code)
            self._closed = True


def _prefixed(prefix: str, values: dict[str, float]) -> dict[str, float]:
    return {f"{prefix}/{key}": value for key, value in values.items()}
