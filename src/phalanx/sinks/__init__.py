"""Sinks: where the training loop's events go (screen, JSONL log, CSV, end summary), and
experiment trackers: TensorBoard, Weights & Biases and MLflow (with the ``tensorboard``,
``wandb`` and ``mlflow`` extras; each imports its library only when built).

Every sink has ``handle(event)`` and ``close()`` (see :class:`phalanx.events.Sink`) and runs
in the caller's process.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from phalanx.events import Sink
from phalanx.sinks.csv import MetricsCsvSink
from phalanx.sinks.jsonl import JsonlSink
from phalanx.sinks.mlflow import MlflowSink
from phalanx.sinks.progress import ProgressSink
from phalanx.sinks.runfile import RunFileSink
from phalanx.sinks.steps import StepsCsvSink
from phalanx.sinks.summary import SummaryRow, SummarySink, render_summary, summarize
from phalanx.sinks.tensorboard import TensorBoardSink
from phalanx.sinks.wandb import WandbSink

__all__ = [
    "JsonlSink",
    "MetricsCsvSink",
    "MlflowSink",
    "ProgressSink",
    "RunFileSink",
    "StepsCsvSink",
    "SummaryRow",
    "SummarySink",
    "TensorBoardSink",
    "WandbSink",
    "default_sinks",
    "render_summary",
    "summarize",
]


def default_sinks(
    run_dir: str | Path | None, console: Console | None = None, every_steps: int = 1
) -> list[Sink]:
    """Progress and summary on ``console`` (one shared stdout Console when ``None``); with a
    ``run_dir`` (created if missing) also ``run_dir/events.jsonl``, ``run_dir/metrics.csv``
    (epoch rows), ``run_dir/steps.csv`` (a row every ``every_steps`` steps) and the end of
    ``run_dir/run.json``. Progress comes before summary, so the live display stops before
    the summary prints."""
    console = console if console is not None else Console()
    sinks: list[Sink] = [ProgressSink(console), SummarySink(console)]
    if run_dir is not None:
        folder = Path(run_dir)
        folder.mkdir(parents=True, exist_ok=True)
        sinks += [
            JsonlSink(folder / "events.jsonl"),
            MetricsCsvSink(folder / "metrics.csv"),
            StepsCsvSink(folder / "steps.csv", every=every_steps),
            RunFileSink(folder),
        ]
    return sinks
