"""Completes ``run_dir/run.json`` (written by :func:`phalanx.runinfo.open_run`) with how the
run ended: ``ended`` (Unix seconds), ``outcome`` (``finished``, ``interrupted``, ``failed``),
``steps`` (committed, over all sessions), ``epochs`` (finished), ``world_size`` (members of
the last generation), ``generations``, and ``failures`` (each as in ``failures.json``, with
``recovery_seconds``). Fields are listed in docs/artefacts.md."""

from __future__ import annotations

import time
from pathlib import Path

from phalanx.events import (
    EpochEnded,
    Event,
    GenerationStarted,
    RunEnded,
    RunStarted,
    StepEnded,
    WorkerFailed,
)
from phalanx.failures import WorkerFailure


class RunFileSink:
    """Gathers the run's end from its events and writes it into ``run.json`` on
    :class:`RunEnded` (only when the folder has a ``run.json``)."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self.steps = 0
        self.epochs = 0
        self.world: int | None = None
        self.generations = 0
        self.failures: list[WorkerFailure] = []

    def handle(self, event: Event) -> None:
        if isinstance(event, RunStarted):
            self.world = self.world or len(event.devices)
            self.steps = event.start_epoch * event.steps_per_epoch + event.start_step
            self.epochs = event.start_epoch
        elif isinstance(event, StepEnded):
            self.steps = event.global_step
        elif isinstance(event, EpochEnded):
            self.epochs = event.epoch + 1
        elif isinstance(event, GenerationStarted):
            self.world, self.generations = len(event.members), event.number + 1
        elif isinstance(event, WorkerFailed):
            self.failures.append(event.failure)
        elif isinstance(event, RunEnded):
            self._write(event)

    def _write(self, end: RunEnded) -> None:
        from phalanx.runinfo import read_run, write_run  # runinfo uses sinks.jsonl

        doc = read_run(self.run_dir)
        if doc is None:
            return
        outcome = "failed" if end.failed else "interrupted" if end.interrupted else "finished"
        doc.update(
            {
                "ended": time.time(),
                "outcome": outcome,
                "interrupted": end.interrupted,
                "steps": self.steps,
                "epochs": self.epochs,
                "world_size": self.world,
                "generations": self.generations,
                "failures": [f.to_dict() for f in self.failures],
            }
        )
        write_run(self.run_dir, doc)

    def close(self) -> None:
        """Nothing held open between events."""
