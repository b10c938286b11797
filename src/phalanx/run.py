"""A run's inputs and its end, the same for every strategy.

:class:`RunInputs` is what ``fit()`` hands a strategy once everything is validated: what to
train, how, the plan and the data. A strategy hands back a :class:`RunEnd` (the main
member's final state), or the failures that stopped it; :func:`finish` and :func:`stopped`
turn those into the :class:`FitResult` or the :class:`~phalanx.errors.TrainingFailed` the
caller sees, checking the data ledger and writing ``run_dir``'s reports on the way. No
strategy builds a ``FitResult`` itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torch.utils.data import Dataset

from phalanx import ledger, report
from phalanx.errors import TrainingFailed
from phalanx.failures import WorkerFailure, bad_sample_errors
from phalanx.launch import Launch
from phalanx.plan import Plan
from phalanx.spec import FitConfig, TrainSpec


@dataclass(frozen=True, kw_only=True)
class RunInputs:
    """What every strategy is given."""

    spec: TrainSpec  # what to train
    config: FitConfig  # where and how long
    plan: Plan  # which samples make each global batch
    train: Dataset[Any]
    valid: Dataset[Any] | None
    valid_size: int  # 0 without a validation set
    launch: Launch | None = None  # how this process was started (several nodes: ddp or fsdp)
    notices: list[str] = field(default_factory=list)  # said once the run's sinks are open
    # Across nodes, the head was lost and this node goes on: the ddp strategy's ``Failover``
    # (this node leads the run from here, or follows the node that does)
    failover: Any = None

    @property
    def valid_or_none(self) -> int | None:
        """The validation set's size, or None without one (what the loop is built with)."""
        return self.valid_size if self.valid is not None else None


@dataclass
class FitResult:
    """What ``fit()`` returns. ``model`` is on CPU (None under ``fit(strategy="fsdp",
    gather=False)``: the final weights stay in the sharded checkpoint ``model_path`` names,
    which ``px.load_checkpoint`` reads whole); ``history`` has one dict per epoch."""

    model: nn.Module | None
    history: list[dict[str, Any]]
    steps: int
    epochs: int
    interrupted: str | None = None
    failures: list[WorkerFailure] = field(default_factory=list)
    run_dir: str | None = None
    seconds: float = 0.0
    ledger_ok: bool | None = None  # every sample used exactly once in each finished epoch
    ledger_problems: list[str] = field(default_factory=list)
    model_path: str | None = None  # run_dir/model.pt: the final state dict of a finished run
    # fit(on_bad_sample="skip"): the dataset indices found bad and left out (quarantine.json)
    quarantined: list[int] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class RunEnd:
    """How a strategy's training ended, when nothing stopped it: the main member's state."""

    model: nn.Module | None  # on CPU (None: fsdp's gather=False, model_path has the weights)
    history: list[dict[str, Any]]
    steps: int  # committed optimizer steps
    epochs: int  # finished epochs
    interrupted: str | None
    ledger: list[list[float]]  # one entry per committed step (see TrainState.ledger)
    failures: list[WorkerFailure]  # the ones the run recovered from
    seconds: float
    fates: list[str] = field(default_factory=list)  # what became of each respawn (ddp)
    # Across nodes, on a node other than the head: the final weights' file the head wrote
    # in the shared run_dir (None where this node cannot see it).
    model_path: str | None = None
    # fit(on_bad_sample="skip"): dataset index -> the global step it is left out from
    quarantine: dict[int, int] = field(default_factory=dict)


def finish(end: RunEnd, run: RunInputs) -> FitResult:
    """The ledger checked against the plan (and written), the failures the run recovered
    from written, the result."""
    config = run.config
    if end.failures:
        report.write_json(config.run_dir, end.failures, None, config.devices, end.fates)
    problems = ledger.check(run.plan, end.ledger, end.epochs, end.quarantine)
    ledger.write(config.run_dir, end.ledger, problems)
    write_quarantine(config.run_dir, end.quarantine, end.failures)
    return FitResult(
        model=end.model,
        history=end.history,
        steps=end.steps,
        epochs=end.epochs,
        interrupted=end.interrupted,
        failures=end.failures,
        run_dir=config.run_dir,
        seconds=end.seconds,
        ledger_ok=not problems,
        ledger_problems=problems,
        quarantined=sorted(end.quarantine),
        model_path=end.model_path if end.model is None else None,
    )


def write_quarantine(
    run_dir: str | None, quarantine: dict[int, int], failures: list[WorkerFailure]
) -> None:
    """``run_dir/quarantine.json``: each sample left out, the step from which (1-based) and
    the error it failed with alone (from the failure whose bisection found it)."""
    if not run_dir or not quarantine:
        return
    errors = bad_sample_errors(failures)
    rows = [
        {"index": i, "step": g + 1, "error": errors.get(i, "")}
        for i, g in sorted(quarantine.items())
    ]
    import json
    import os

    path = os.path.join(run_dir, "quarantine.json")
    with open(path + ".tmp", "w") as fh:
        json.dump({"quarantined": rows}, fh, indent=2)
    os.replace(path + ".tmp", path)


def stopped(
    failures: list[WorkerFailure],
    poison: bool,
    config: FitConfig,
    notes: tuple[str, ...] = (),
    fates: list[str] | None = None,
) -> TrainingFailed:
    """The error that ends a run stopped by ``failures`` (``run_dir/failures.json`` written,
    with its root cause and what became of each respawn): for the caller to raise.
    ``notes`` are lines the report adds after the root cause (what would have helped)."""
    error = report.build(failures, poison=poison, notes=notes)
    try:
        report.write_json(config.run_dir, failures, error.root_cause, config.devices, fates or [])
    except OSError as exc:  # (a full disk, say: the report itself still reaches the caller)
        error.message += f"\n(failures.json could not be written in {config.run_dir}: {exc})"
    return error
