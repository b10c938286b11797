"""The Learner: *what* to train. ``fit()`` validates everything, then hands the run to a
strategy (*where*), which drives the same training loop on one or several devices."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from phalanx import ledger
from phalanx.checkpoint import Checkpoints
from phalanx.data import fingerprint
from phalanx.devices import DeviceSpec, check_free_memory, parse_devices
from phalanx.early_stopping import EarlyStopping
from phalanx.events import Fanout, RunEnded, RunOpened, Sink
from phalanx.failures import FailedHere, WorkerFailure
from phalanx.faults import Fault
from phalanx.interrupt import Interrupter, handle_signals
from phalanx.loop import StepAborted
from phalanx.metrics import LoopMetric, Metric
from phalanx.plan import Plan
from phalanx.policy import Recovery
from phalanx.precision import Precision
from phalanx.runner import check_resume_plan
from phalanx.spec import FitConfig, ModelSource, OptimizerFactory, SchedulerFactory, TrainSpec
from phalanx.validate import dataset_size, validate_fit


@dataclass
class FitResult:
    """What ``fit()`` returns. ``model`` is on CPU; ``history`` has one dict per epoch."""

    model: nn.Module
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


class Learner:
    """A model factory, an optimizer factory and a step function, trained by :meth:`fit`.

    ``step(model, batch)`` returns the mean loss over the local batch, or a
    :class:`~phalanx.StepOutput` with outputs and targets for classification metrics.
    ``grad_accumulation=k`` computes each global batch in ``k`` micro-batches per device:
    the same math with less memory (the optimizer steps once per global batch).

    ``optimizer`` is a factory: a torch optimizer class or a ``functools.partial`` of one gets
    ``model.parameters()``; a function whose first parameter is named ``model`` (or annotated
    ``nn.Module``) gets the model, for parameter groups; any other function gets the
    parameters. ``lr_scheduler(optimizer)`` builds the scheduler, stepped after every
    optimizer step (``lr_scheduler_interval="step"``) or after every epoch (``"epoch"``).
    ``precision`` is ``"32"``, ``"bf16-mixed"`` or ``"16-mixed"`` (autocast, plus a gradient
    scaler for 16-mixed, built with ``grad_scaler`` as keyword arguments of
    ``torch.amp.GradScaler``); see :mod:`phalanx.precision`.
    """

    def __init__(
        self,
        model: ModelSource,
        optimizer: OptimizerFactory,
        step: Callable[[nn.Module, Any], Any],
        metrics: Sequence[Metric | LoopMetric] = (),
        lr_scheduler: SchedulerFactory | None = None,
        grad_accumulation: int = 1,
        grad_clip_norm: float | None = None,
        *,
        precision: str = "32",
        grad_scaler: dict[str, float] | None = None,
        lr_scheduler_interval: str = "step",
    ) -> None:
        self.spec = TrainSpec(
            model,
            optimizer,
            step,
            list(metrics),
            lr_scheduler,
            grad_accumulation,
            grad_clip_norm,
            precision=Precision(str(precision), dict(grad_scaler or {})),
            lr_scheduler_interval=lr_scheduler_interval,
        )
        self.interrupter = Interrupter()

    def stop(self, reason: str = "stop requested") -> None:
        """Ask a running ``fit`` to finish its current step, checkpoint and return.
        Safe to call from any thread (e.g. a sink reacting to an event)."""
        self.interrupter.stop(reason)

    def fit(
        self,
        train: Dataset[Any],
        valid: Dataset[Any] | None = None,
        *,
        epochs: int = 1,
        batch_size: int = 32,
        devices: DeviceSpec = "cpu",
        strategy: str = "single",
        seed: int = 0,
        run_dir: str | None = None,
        checkpoint: Checkpoints | None = None,
        early_stopping: EarlyStopping | None = None,
        resume: bool = False,
        drop_last: bool = False,
        shuffle: bool = True,
        faults: Sequence[Fault] = (),
        preflight: bool = True,
        hang_timeout: timedelta = timedelta(seconds=60),
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool = False,
        max_steps: int | None = None,
        val_every_steps: int | None = None,
        min_free_memory: int | None = None,
        on_failure: Recovery | None = None,
        sinks: Sequence[Sink] | None = None,
    ) -> FitResult:
        """Train for ``epochs`` over ``train``, validating on ``valid`` after each epoch.

        ``batch_size`` is the GLOBAL batch, split among devices. Raises a ConfigError before
        anything starts when the configuration is wrong, and TrainingFailed when a worker
        failed and the run could not go on. Interrupts are not failures: the run finishes
        its step and checkpoints; then :meth:`stop` returns with ``interrupted`` set, Ctrl-C
        raises ``KeyboardInterrupt`` and SIGTERM ``px.FitTerminated``
        (a SystemExit with code 143), each carrying the result as ``.result``.
        ``run_dir=""`` is the same as None: nothing is written.
        """
        run_dir = run_dir or None  # "" is no run_dir, everywhere below (not the cwd)
        labels = parse_devices(devices)
        config = FitConfig(
            epochs,
            batch_size,
            labels,
            strategy,
            seed,
            run_dir,
            checkpoint,
            early_stopping,
            resume,
            drop_last,
            shuffle,
            list(faults),
            preflight,
            on_failure.hang_timeout if on_failure and on_failure.hang_timeout else hang_timeout,
            num_workers,
            min_free_memory,
            on_failure if on_failure is not None else Recovery(),
            collate_fn=collate_fn,
            pin_memory=pin_memory,
            max_steps=max_steps,
            val_every_steps=val_every_steps,
        )
        train_size = dataset_size(train, "training")
        valid_size = dataset_size(valid, "validation") if valid is not None else 0
        validate_fit(
            self.spec, config, train_size, has_valid=valid is not None, train=train, valid=valid
        )
        check_free_memory(labels, min_free_memory)
        # Only a run that writes checkpoints needs the data's fingerprint (it reads samples).
        sample_hash = fingerprint(train, train_size) if run_dir else ""
        plan = Plan(train_size, batch_size, seed, shuffle, drop_last, sample_hash)
        check_resume_plan(config, plan)  # before anything starts, as the checks above
        opened = _open_run(config)  # run.json; an earlier run's files moved aside
        if sinks is None:
            from phalanx.sinks import default_sinks

            sinks = default_sinks(run_dir)
        emit = Fanout(list(sinks))
        if opened is not None:
            emit(opened)
        self.interrupter.reset()
        try:
            with handle_signals(self.interrupter), _keep_rng(labels):
                result = self._dispatch(config, plan, train, valid, valid_size, emit)
            if run_dir and result.interrupted is None:
                result.model_path = save_final_model(run_dir, result.model)
            emit(
                RunEnded(
                    result.history, result.steps, result.epochs, result.interrupted, result.seconds
                )
            )
        except BaseException:
            emit(RunEnded([], 0, 0, None, 0.0, failed=True))
            raise
        finally:
            emit.close()
        self.interrupter.raise_if_signalled(result)  # Ctrl-C, SIGTERM: not a success
        return result

    def _dispatch(
        self,
        config: FitConfig,
        plan: Plan,
        train: Dataset[Any],
        valid: Dataset[Any] | None,
        valid_size: int,
        emit: Fanout,
    ) -> FitResult:
        if config.strategy == "ddp":
            from phalanx.strategies.ddp import run_ddp

            return run_ddp(
                self.spec, config, plan, train, valid, valid_size, emit, self.interrupter
            )
        return self._in_process(config, plan, train, valid, valid_size, emit)

    def _in_process(
        self,
        config: FitConfig,
        plan: Plan,
        train: Dataset[Any],
        valid: Dataset[Any] | None,
        valid_size: int,
        emit: Fanout,
    ) -> FitResult:
        from phalanx import report
        from phalanx.runner import build_loop, make_checkpointer, run_member

        engine: Any
        if config.strategy == "threads":
            from phalanx.strategies.threads import ThreadsEngine

            engine = ThreadsEngine(self.spec, config, plan, train, valid, valid_size)
        else:
            from phalanx.strategies.single import SingleEngine

            engine = SingleEngine(self.spec, config, plan, train, valid, valid_size)
        checkpointer = make_checkpointer(config, emit)
        loop = build_loop(
            engine,
            self.spec,
            config,
            plan,
            emit,
            self._stop_reason,
            valid_size if valid is not None else None,
            checkpointer,
        )
        try:
            run = run_member(loop, plan, config, emit, plan.samples, valid_size)
        except (StepAborted, FailedHere) as exc:
            if isinstance(exc, FailedHere):
                exc.failure.action = "aborted"  # the failure that ends the run
            failures = loop.failures + ([exc.failure] if isinstance(exc, FailedHere) else [])
            error = report.build(failures, poison=isinstance(exc, StepAborted) and exc.poison)
            report.write_json(config.run_dir, failures, error.root_cause, config.devices)
            raise error from None
        finally:
            close = getattr(engine, "close", None)
            if close is not None:
                close()
        st = run.loop.state
        problems = ledger.check(plan, st.ledger, st.epoch)
        ledger.write(config.run_dir, st.ledger, problems)
        return FitResult(
            engine.final_model(),
            st.history,
            st.global_step,
            st.epoch,
            run.loop.interrupted,
            run.failures,
            config.run_dir,
            run.seconds,
            not problems,
            problems,
        )

    def _stop_reason(self) -> str | None:
        return self.interrupter.reason if self.interrupter.should_stop() else None


FINAL_MODEL = "model.pt"


def save_final_model(run_dir: str, model: nn.Module) -> str:
    """``run_dir/model.pt``: the trained model's ``state_dict()`` (``torch.save``, atomically),
    written when a run finishes (all epochs, ``max_steps`` or early stopping), never after an
    interrupt or a failure. Load it with ``model.load_state_dict(torch.load(path,
    weights_only=True))``."""
    from phalanx.checkpoint.io import write_atomic

    path = os.path.join(run_dir, FINAL_MODEL)
    write_atomic(path, model.state_dict())
    return path


def _open_run(config: FitConfig) -> RunOpened | None:
    """With a run_dir: name the run (:func:`phalanx.runinfo.open_run`), after every check."""
    if not config.run_dir:
        return None
    from phalanx.runinfo import open_run

    return open_run(config.run_dir, config, config.resume)[0]


def _keep_rng(labels: list[str]) -> contextlib.AbstractContextManager[Any]:
    """Training reseeds torch's RNG; give the caller theirs back afterwards."""
    cuda = [torch.device(d).index or 0 for d in labels if d.startswith("cuda")]
    return torch.random.fork_rng(devices=cuda)
