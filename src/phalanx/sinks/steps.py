"""Per-step scalars as CSV (``run_dir/steps.csv``), beside ``metrics.csv``'s epoch rows.

One row every ``every`` committed steps (and the last step of each epoch): ``global_step``,
``epoch`` and ``step`` (all three 1-based, as shown on screen: ``global_step`` is the number
of steps committed since the run began, ``step`` the step within its epoch), ``time`` (Unix
seconds), ``loss`` (the step's mean loss), ``lr``, ``samples`` (of the global batch),
``samples_per_s``, then the epoch's running train metrics as ``train/<name>`` (the columns of
the first row written; a key that appears later is left out; ``lr`` and ``samples_per_s``
are not repeated). Each row is flushed.

Resume: rows of steps the run will compute again (after the ``RunStarted``'s start) are
dropped, so the file tells each step once.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import IO, Any

from phalanx.events import Event, RunStarted, StepEnded

_SAME = ("lr", "samples_per_s")  # loop metrics: the step's own columns already say them
BASE = ("global_step", "epoch", "step", "time", "loss", "lr", "samples", "samples_per_s")


class StepsCsvSink:
    """Writes ``steps.csv``; see the module docstring."""

    def __init__(self, path: str | Path, every: int = 1) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.path = Path(path)
        self.every = every
        self.columns: list[str] | None = None
        self._file: IO[str] | None = None
        self._writer: Any = None

    def handle(self, event: Event) -> None:
        if isinstance(event, RunStarted):
            self._keep_until(event.start_epoch * event.steps_per_epoch + event.start_step)
        elif isinstance(event, StepEnded):
            last = event.step + 1 == event.steps_in_epoch
            if event.global_step % self.every == 0 or last:
                self._write(event)

    def _keep_until(self, committed: int) -> None:
        """Drop the rows after ``committed`` steps (a resume computes them again)."""
        self.close()
        if not self.path.exists():
            return
        with self.path.open(newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            columns = list(reader.fieldnames or [])
            rows = [r for r in reader if int(r.get("global_step") or 0) <= committed]
        if "global_step" not in columns:
            return
        self.columns = columns
        tmp = self.path.with_name(self.path.name + ".tmp")
        with tmp.open("w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=columns, restval="")
            writer.writeheader()
            writer.writerows(rows)
        tmp.replace(self.path)

    def _write(self, e: StepEnded) -> None:
        row: dict[str, Any] = {
            "global_step": e.global_step,
            "epoch": e.epoch + 1,
            "step": e.step + 1,
            "time": round(e.time, 3),
            "loss": repr(float(e.loss)),
            "lr": repr(float(e.lr)),
            "samples": e.samples,
            "samples_per_s": round(e.samples_per_s, 1),
        }
        row.update({f"train/{k}": repr(float(v)) for k, v in e.metrics.items() if k not in _SAME})
        if self._file is None:
            fresh = not self.path.exists() or self.path.stat().st_size == 0
            if self.columns is None:
                self.columns = [*BASE, *(k for k in row if k not in BASE)]
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", newline="", encoding="utf-8")
            self._writer = csv.DictWriter(
                self._file, fieldnames=self.columns, restval="", extrasaction="ignore"
            )
            if fresh:
                self._writer.writeheader()
        self._writer.writerow(row)
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
