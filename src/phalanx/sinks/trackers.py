"""What the experiment-tracker sinks (TensorBoard, Weights & Biases, MLflow) share: a step's
scalars, a failure in one line, and the run's configuration gathered from its events."""

from __future__ import annotations

import math
from typing import Any

from phalanx.events import (
    CheckpointSkipped,
    Event,
    Notice,
    RunOpened,
    RunStarted,
    StepEnded,
    WorkerFailed,
)
from phalanx.failures import cause


def step_scalars(event: StepEnded) -> dict[str, float]:
    """A committed step's ``train/loss`` (its own mean loss, as ``steps.csv``'s ``loss``),
    ``train/lr``, ``train/samples_per_s``, and the epoch's running train metrics
    (``train/accuracy``, ...; not the running mean of the loss, which the step's own loss
    stands for here: the epoch's mean comes with the epoch's end)."""
    values = {f"train/{k}": v for k, v in event.metrics.items()}
    values.update({"train/loss": event.loss, "train/lr": event.lr})
    values["train/samples_per_s"] = event.samples_per_s
    return values


def finite(values: dict[str, float]) -> dict[str, float]:
    """The values as floats, NaN left out (a tracker's chart has no point for it)."""
    numbers = {key: float(value) for key, value in values.items()}
    return {key: number for key, number in numbers.items() if not math.isnan(number)}


def failed_at(event: WorkerFailed, committed: int) -> int:
    """The failed step's number (1-based, as on screen); ``committed`` (the latest committed
    step) for a failure outside a step."""
    step = event.failure.step
    return step + 1 if step is not None else committed


def failure_text(event: WorkerFailed) -> str:
    """``worker 1 (rank 1) on device cpu:1 failed at step 4 (backward): RuntimeError: boom
    -> retried``."""
    f = event.failure
    at = f"step {f.step + 1}" if f.step is not None else "before its first step"
    return (
        f"worker {f.worker} (rank {f.rank}) on device {f.device} failed at {at} "
        f"({f.phase}): {cause(f)} -> {event.action}"
    )


def notice_text(event: Notice | CheckpointSkipped) -> str:
    """``warning: early stopping: ...``, ``checkpoint skipped: <path>: <reason>``."""
    if isinstance(event, CheckpointSkipped):
        return f"checkpoint skipped: {event.path}: {event.reason}"
    return f"{event.level}: {event.text}"


class RunConfig:
    """Gathers the run's configuration for a tracker: with a ``run_dir``, ``run_id`` and every
    ``fit`` setting as ``run.json`` keeps it (``seed``, ``checkpoint``, ``recovery``, ...),
    read on :class:`RunOpened`; always the :class:`RunStarted` values (``strategy``,
    ``devices``, ``epochs``, ``batch_size``, ``steps_per_epoch``, ``train_samples``,
    ``valid_samples``, ``start_epoch``, ``start_step``)."""

    def __init__(self) -> None:
        self.run_id: str | None = None
        self._settings: dict[str, Any] = {}
        self._told = False

    def take(self, event: Event) -> dict[str, Any] | None:
        """The configuration once, at the first :class:`RunStarted` (a ddp run that restarts
        after every worker fell announces itself again); None for every other event."""
        if isinstance(event, RunOpened):
            from phalanx.runinfo import read_run  # (runinfo imports the sinks package)

            self.run_id = event.run_id
            config = (read_run(event.run_dir) or {}).get("config")
            self._settings = {"run_id": event.run_id}
            if isinstance(config, dict):
                self._settings.update(config)
            return None
        if not isinstance(event, RunStarted) or self._told:
            return None
        self._told = True
        return {
            **self._settings,
            "run_dir": event.run_dir or None,
            "strategy": event.strategy,
            "devices": list(event.devices),
            "epochs": event.epochs,
            "batch_size": event.batch_size,
            "steps_per_epoch": event.steps_per_epoch,
            "train_samples": event.train_samples,
            "valid_samples": event.valid_samples,
            "start_epoch": event.start_epoch,
            "start_step": event.start_step,
        }
