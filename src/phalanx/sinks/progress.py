"""What the user watches while training: live bars on a terminal, plain lines elsewhere.

Terminal (``console.is_terminal``): a rich live display with an epoch bar and a step bar
(with ETA) showing loss, lr and samples/s, updated on every ``StepEnded``. Epoch results,
failures, notices, resumes and skipped checkpoints are printed above the bars.

Not a terminal (a log file, CI): plain lines with no ANSI codes: one every ``every`` global
steps, one per epoch end, one per notice, failure, resume and skipped checkpoint.

Epochs are shown 1-based (events carry 0-based epochs). Events may arrive in any order or
with gaps (e.g. ``StepEnded`` with no ``RunStarted``): missing context is shown as unknown.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
)
from rich.text import Text

from phalanx.events import (
    CheckpointSkipped,
    EpochEnded,
    EpochStarted,
    Event,
    Notice,
    Resumed,
    RunEnded,
    RunStarted,
    StepEnded,
    Validated,
    ValidationStarted,
    WorkerFailed,
)
from phalanx.failures import cause

_LEVEL_STYLE = {"warning": "yellow", "warn": "yellow", "error": "bold red"}


def _step_info(e: StepEnded) -> str:
    return f"loss {e.loss:.4f}  lr {e.lr:.2e}  {e.samples_per_s:,.0f} samples/s"


def _metrics_line(metrics: dict[str, float]) -> str:
    return "  ".join(f"{k} {v:.4f}" for k, v in metrics.items())


class ProgressSink:
    """Shows training progress on ``console`` (a new stdout Console when ``None``).

    ``every`` (>= 1) is the number of global steps between step lines in plain mode.
    :meth:`close` stops the live display; it is safe to call more than once.
    """

    def __init__(self, console: Console | None = None, every: int = 10) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.console = console if console is not None else Console()
        self.every = every
        self.live = self.console.is_terminal
        self.epochs: int | None = None
        self._epoch: int | None = None  # the epoch the step bar shows
        self._batch: int | None = None  # global batch and samples of an epoch (RunStarted)
        self._epoch_samples = 0
        self._progress: Progress | None = None
        self._epoch_task = TaskID(0)
        self._step_task = TaskID(0)
        self._handlers: dict[type[Event], Callable[[Any], None]] = {
            RunStarted: self._run_started,
            EpochStarted: self._epoch_started,
            StepEnded: self._step_ended,
            ValidationStarted: self._validation_started,
            EpochEnded: self._epoch_ended,
            Validated: self._validated,
            CheckpointSkipped: self._checkpoint_skipped,
            Resumed: self._resumed,
            Notice: self._notice,
            WorkerFailed: self._worker_failed,
            RunEnded: lambda _e: self.close(),
        }

    # -- Sink protocol -------------------------------------------------------------------

    def handle(self, event: Event) -> None:
        handler = self._handlers.get(type(event))
        if handler is None:
            return
        try:
            handler(event)
        except Exception:
            self.close()  # never leave a live display running behind a broken sink
            raise

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    # -- helpers ---------------------------------------------------------------------------

    def _say(self, text: str, style: str | None = None) -> None:
        self.console.print(
            Text(text, style=(style or "") if self.live else ""), soft_wrap=True, highlight=False
        )

    def _epoch_label(self, epoch: int) -> str:
        total = f"/{self.epochs}" if self.epochs is not None else ""
        return f"epoch {epoch + 1}{total}"

    def _bars(self) -> Progress:
        """The live display, started on first use."""
        if self._progress is None:
            self._progress = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[info]}"),
                console=self.console,
            )
            self._epoch_task = self._progress.add_task("epochs", total=self.epochs, info="")
            self._step_task = self._progress.add_task("steps", total=None, info="")
            self._progress.start()
        return self._progress

    def _show_epoch(self, epoch: int, steps: int | None, done: int) -> None:
        bars = self._bars()
        self._epoch = epoch
        bars.reset(self._step_task, total=steps, completed=done, info="")
        bars.update(self._step_task, description=self._epoch_label(epoch))
        bars.update(self._epoch_task, completed=epoch, total=self.epochs)

    # -- handlers --------------------------------------------------------------------------

    def _samples_done(self, e: StepEnded) -> str:
        """Samples of the epoch processed so far, of all devices together (every global
        batch is full but an epoch's last)."""
        if self._batch is None:
            return ""
        done = min((e.step + 1) * self._batch, self._epoch_samples)
        return f"{done:,}/{self._epoch_samples:,} samples  "

    def _run_started(self, e: RunStarted) -> None:
        self.epochs = e.epochs
        self._batch = e.batch_size
        self._epoch_samples = min(e.steps_per_epoch * e.batch_size, e.train_samples)
        self._say(
            f"Training {e.epochs} epoch(s) on {', '.join(e.devices)} (strategy {e.strategy}): "
            f"global batch {e.batch_size}, {e.steps_per_epoch} steps/epoch, "
            f"{e.train_samples} train / {e.valid_samples} valid samples; run dir {e.run_dir}",
            "bold",
        )
        if self.live:
            self._show_epoch(e.start_epoch, e.steps_per_epoch, e.start_step)

    def _epoch_started(self, e: EpochStarted) -> None:
        if self.live:
            self._show_epoch(e.epoch, e.steps, e.start_step)

    def _step_ended(self, e: StepEnded) -> None:
        if not self.live:
            if e.global_step % self.every == 0:
                self._say(
                    f"{self._epoch_label(e.epoch)} step {e.step + 1}/{e.steps_in_epoch} "
                    f"(global {e.global_step}): {self._samples_done(e)}{_step_info(e)}"
                )
            return
        if self._epoch != e.epoch:
            self._show_epoch(e.epoch, e.steps_in_epoch, e.step)
        self._bars().update(
            self._step_task,
            completed=e.step + 1,
            total=e.steps_in_epoch,
            info=self._samples_done(e) + _step_info(e),
        )

    def _validation_started(self, e: ValidationStarted) -> None:
        if self.live:
            label = f"{self._epoch_label(e.epoch)} (validating {e.batches} batches)"
            self._bars().update(self._step_task, description=label)

    def _epoch_ended(self, e: EpochEnded) -> None:
        metrics = _metrics_line(e.metrics) or "no metrics"
        self._say(f"{self._epoch_label(e.epoch)} done in {e.seconds:.1f}s: {metrics}")
        if self.live:
            bars = self._bars()
            bars.update(self._epoch_task, completed=e.epoch + 1, total=self.epochs)
            bars.update(self._step_task, description=self._epoch_label(e.epoch))

    def _validated(self, e: Validated) -> None:
        metrics = _metrics_line(e.metrics) or "no metrics"
        self._say(f"{self._epoch_label(e.epoch)}, step {e.global_step}: {metrics}")

    def _checkpoint_skipped(self, e: CheckpointSkipped) -> None:
        self._say(f"checkpoint skipped: {e.path}: {e.reason}", "yellow")

    def _resumed(self, e: Resumed) -> None:
        self._say(
            f"resumed from {e.path} at {self._epoch_label(e.epoch)}, step {e.step} "
            f"(global step {e.global_step})",
            "cyan",
        )

    def _notice(self, e: Notice) -> None:
        prefix = "" if e.level == "info" else f"{e.level}: "
        self._say(f"{prefix}{e.text}", _LEVEL_STYLE.get(e.level))

    def _worker_failed(self, e: WorkerFailed) -> None:
        f = e.failure
        at = f"at step {f.step}" if f.step is not None else "before its first step"
        if f.epoch is not None:
            at += f" of {self._epoch_label(f.epoch)}"
        self._say(
            f"worker {f.worker} (rank {f.rank}) on device {f.device} failed {at} "
            f"({f.phase}): {cause(f)} -> {e.action}",
            "bold red",
        )
