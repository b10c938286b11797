"""What the user watches while training: live bars on a terminal, plain lines elsewhere.

Terminal (``console.is_terminal``): a rich live display with an epoch bar and a step bar
(with ETA) showing loss, lr and samples/s, updated on every ``StepEnded``, and under them
the worker panel (:mod:`phalanx.sinks.workers`): one row per worker (a member named slow
says so; each member's share once the balance has moved the shares) and, while the others
wait on a silent worker, a line naming it. Narrow terminals get fewer columns (under 120:
no sample count; under 100: loss and throughput only), never broken bars. Epoch results,
failures, notices, resumes and skipped checkpoints are printed above the bars, wrapped at
word boundaries.

Not a terminal (a log file, CI): plain lines with no ANSI codes, each starting with the
event's time (``HH:MM:SS``): one every ``every`` global steps, one per epoch end, one per
notice, failure, resume, skipped checkpoint and change of a worker's state, and one when the
others start waiting on a silent worker (again every ``REPEAT_WAITING`` seconds of it).

Steps and epochs are shown 1-based (events carry 0-based indices, see docs/artefacts.md).
Events may arrive in any order or with gaps (e.g. ``StepEnded`` with no ``RunStarted``):
missing context is shown as unknown.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from rich.console import Console, RenderableType
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
    Balanced,
    CheckpointSkipped,
    EpochEnded,
    EpochStarted,
    Event,
    GenerationStarted,
    Notice,
    Resumed,
    RunEnded,
    RunStarted,
    StepEnded,
    Validated,
    ValidationStarted,
    WorkerFailed,
    WorkerState,
    WorkersTick,
)
from phalanx.failures import cause
from phalanx.sinks.format import balance_line, fmt_metric, fmt_number
from phalanx.sinks.workers import LivePanel, Waiting, Workers

_LEVEL_STYLE = {"warning": "yellow", "warn": "yellow", "error": "bold red"}
REPEAT_WAITING = 10.0  # plain mode: seconds between two lines about the same wait
WIDE, MEDIUM = 120, 100  # console widths for the full step info, and for lr


def _step_info(e: StepEnded, width: int = WIDE) -> str:
    loss = f"loss {fmt_number(e.loss)}"
    if width < MEDIUM:
        return f"{loss}  {e.samples_per_s:,.0f}/s"
    return f"{loss}  lr {fmt_number(e.lr)}  {e.samples_per_s:,.0f} samples/s"


def _metrics_line(metrics: dict[str, float]) -> str:
    return "  ".join(f"{k} {fmt_metric(k, v)}" for k, v in metrics.items())


class _Display(Progress):
    """rich's Progress with the worker panel drawn under the bars."""

    def __init__(self, *columns: Any, panel: LivePanel, **kwargs: Any) -> None:
        self.panel = panel  # before Progress's constructor: it renders once
        super().__init__(*columns, **kwargs)

    def get_renderables(self) -> Iterable[RenderableType]:
        if self.tasks:
            yield from super().get_renderables()
        yield self.panel


class ProgressSink:
    """Shows training progress on ``console`` (a new stdout Console when ``None``).

    ``every`` (>= 1) is the number of global steps between step lines in plain mode.
    :meth:`close` stops the live display; it is safe to call more than once.
    """

    def __init__(
        self,
        console: Console | None = None,
        every: int = 10,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.console = console if console is not None else Console()
        self.every = every
        self.clock = clock
        self.live = self.console.is_terminal
        self.workers = Workers()
        self._waiting: tuple[Waiting, float] | None = None  # plain mode: the wait last told
        self._steps: int | None = None  # steps per epoch (RunStarted)
        self._when = clock()  # the time of the event being handled
        self.epochs: int | None = None
        self._epoch: int | None = None  # the epoch the step bar shows
        self._batch: int | None = None  # global batch and samples of an epoch (RunStarted)
        self._epoch_samples = 0
        self._progress: Progress | None = None
        self._epoch_task: TaskID | None = None
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
            Balanced: self._balanced,
            WorkerFailed: self._worker_failed,
            WorkerState: self._worker_state,
            WorkersTick: self._tick,
            RunEnded: lambda _e: self.close(),
        }

    # -- Sink protocol -------------------------------------------------------------------

    def handle(self, event: Event) -> None:
        if isinstance(event, (RunStarted, StepEnded, GenerationStarted, Balanced)):
            self.workers.update(event)  # (in-process strategies: rows follow the steps)
        handler = self._handlers.get(type(event))
        if handler is None:
            return
        self._when = event.time
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
        """One line above the bars (wrapped at word boundaries), or a plain line that starts
        with the time of the event it tells."""
        if self.live:
            self.console.print(Text(text, style=style or ""), highlight=False)
            return
        stamp = time.strftime("%H:%M:%S", time.localtime(self._when))
        self.console.print(Text(f"{stamp} {text}"), soft_wrap=True, highlight=False)

    def _epoch_label(self, epoch: int) -> str:
        total = f"/{self.epochs}" if self.epochs is not None else ""
        return f"epoch {epoch + 1}{total}"

    def _display(self) -> Progress:
        """The live display (bars and worker panel), started on first use."""
        if self._progress is None:
            wide = self.console.width >= WIDE
            self._progress = _Display(
                TextColumn("{task.description}"),
                BarColumn(bar_width=40 if wide else 20),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[info]}"),
                console=self.console,
                panel=LivePanel(self.workers, self.clock),
            )
            self._epoch_task = None
            self._progress.start()
        return self._progress

    def _bars(self) -> Progress:
        """The live display with its epoch and step bars."""
        display = self._display()
        if self._epoch_task is None:
            self._epoch_task = display.add_task("epochs", total=self.epochs, info="")
            self._step_task = display.add_task("steps", total=None, info="")
        return display

    def _show_epoch(self, epoch: int, steps: int | None, done: int) -> None:
        bars = self._bars()
        assert self._epoch_task is not None
        self._epoch = epoch
        bars.reset(self._step_task, total=steps, completed=done, info="")
        bars.update(self._step_task, description=self._epoch_label(epoch))
        bars.update(self._epoch_task, completed=epoch, total=self.epochs)

    # -- handlers --------------------------------------------------------------------------

    def _samples_done(self, e: StepEnded) -> str:
        """Samples of the epoch processed so far, of all devices together (every global
        batch is full but an epoch's last)."""
        if self._batch is None or (self.live and self.console.width < WIDE):
            return ""
        done = min((e.step + 1) * self._batch, self._epoch_samples)
        return f"{done:,}/{self._epoch_samples:,} samples  "

    def _run_started(self, e: RunStarted) -> None:
        self.epochs = e.epochs
        self._steps = e.steps_per_epoch
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
            info=self._samples_done(e) + _step_info(e, self.console.width),
        )

    def _validation_started(self, e: ValidationStarted) -> None:
        if self.live:
            label = f"{self._epoch_label(e.epoch)} (valid)"
            self._bars().update(self._step_task, description=label)

    def _epoch_ended(self, e: EpochEnded) -> None:
        metrics = _metrics_line(e.metrics) or "no metrics"
        self._say(f"{self._epoch_label(e.epoch)} done in {e.seconds:.1f}s: {metrics}")
        if self.live:
            bars = self._bars()
            assert self._epoch_task is not None
            bars.update(self._epoch_task, completed=e.epoch + 1, total=self.epochs)
            bars.update(self._step_task, description=self._epoch_label(e.epoch))

    def _validated(self, e: Validated) -> None:
        metrics = _metrics_line(e.metrics) or "no metrics"
        self._say(f"{self._epoch_label(e.epoch)}, step {e.global_step}: {metrics}")

    def _checkpoint_skipped(self, e: CheckpointSkipped) -> None:
        self._say(f"checkpoint skipped: {e.path}: {e.reason}", "yellow")

    def _resumed(self, e: Resumed) -> None:
        self._say(
            f"resumed from {e.path} after {e.global_step} committed step(s): next is "
            f"{self._epoch_label(e.epoch)} step {e.step + 1} (global {e.global_step + 1})",
            "cyan",
        )

    def _balanced(self, e: Balanced) -> None:
        self._say(balance_line(e, where=self._worker_of))

    def _worker_of(self, rank: int) -> str | None:
        """Where the current generation's member ``rank`` runs, as the panel knows it."""
        row = self.workers.member(rank)
        return None if row is None else f"worker {row.worker} on {row.device}"

    def _notice(self, e: Notice) -> None:
        prefix = "" if e.level == "info" else f"{e.level}: "
        self._say(f"{prefix}{e.text}", _LEVEL_STYLE.get(e.level))

    def _where(self, step: int | None, epoch: int | None, phase: str) -> str:
        """A failure's place for people, 1-based: ``at step 27 (epoch 2/8, step 4/23)``."""
        if phase == "validation" and epoch is not None:
            return f"in validation of {self._epoch_label(epoch)}"
        if step is None:
            return "before its first step"
        at = f"at step {step + 1}"
        if epoch is not None and self._steps:
            within = step - epoch * self._steps + 1
            at += f" ({self._epoch_label(epoch)}, step {within}/{self._steps})"
        elif epoch is not None:
            at += f" ({self._epoch_label(epoch)})"
        return at

    def _worker_failed(self, e: WorkerFailed) -> None:
        f = e.failure
        self._say(
            f"worker {f.worker} (rank {f.rank}) on device {f.device} failed "
            f"{self._where(f.step, f.epoch, f.phase)} ({f.phase}): {cause(f)} -> {e.action}",
            "bold red",
        )

    def _worker_state(self, e: WorkerState) -> None:
        line = self.workers.update(e)
        if self.live:
            self._display()  # the panel shows it (the display starts with the first worker)
        elif line:
            self._say(line)

    def _tick(self, e: WorkersTick) -> None:
        self.workers.update(e)
        if self.live:
            self._display()
            return
        wait = self.workers.waiting(e.time)
        told = self._waiting
        if wait is None:
            self._waiting = None
            return
        if told is None or told[0].worker != wait.worker or e.time - told[1] >= REPEAT_WAITING:
            self._waiting = (wait, e.time)
            self._say(wait.text())
