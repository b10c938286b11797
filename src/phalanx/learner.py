"""The Learner: *what* to train. ``fit()`` validates everything, then hands the run to a
strategy (*where*), which drives the same training loop on one or several devices."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.data import Dataset

from phalanx import argtypes
from phalanx.checkpoint import Checkpoints
from phalanx.data import fingerprint
from phalanx.devices import DeviceSpec, check_free_memory, parse_devices
from phalanx.early_stopping import EarlyStopping
from phalanx.errors import HeadLost, NodeFencedError, RunDirLockedError
from phalanx.events import Fanout, Notice, RunEnded, RunOpened, Sink
from phalanx.failures import FailedHere
from phalanx.faults import Fault
from phalanx.interrupt import Interrupter, handle_signals
from phalanx.launch import Launch
from phalanx.loop import StepAborted
from phalanx.metrics import LoopMetric, Metric
from phalanx.plan import DataPrint, Plan
from phalanx.policy import Recovery
from phalanx.precision import Precision, canonical, cpu_notice
from phalanx.run import FitResult, RunEnd, RunInputs, finish, stopped
from phalanx.runlock import RunLock
from phalanx.runner import check_resume_plan
from phalanx.sharding import ShardRule
from phalanx.snapshot import Snapshots, settings_of
from phalanx.spec import FitConfig, ModelSource, OptimizerFactory, SchedulerFactory, TrainSpec
from phalanx.strategies import process_based
from phalanx.stream import Stream
from phalanx.validate import check_launch, dataset_size, validate_fit, validate_run_dir

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy


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
        argtypes.check(argtypes.learner_kinds(), dict(locals()), "Learner")  # (PX125)
        self.spec = TrainSpec(
            model=model,
            optimizer=optimizer,
            step=step,
            metrics=list(metrics),
            lr_scheduler=lr_scheduler,
            grad_accumulation=grad_accumulation,
            grad_clip_norm=grad_clip_norm,
            precision=Precision(canonical(precision), dict(grad_scaler or {})),
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
        hang_timeout: timedelta | float = timedelta(seconds=60),
        node_timeout: timedelta | float = timedelta(seconds=10),
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool = False,
        max_steps: int | None = None,
        val_every_steps: int | None = None,
        balance: bool | None = None,
        slow_worker: float | None = None,
        on_bad_sample: str = "stop",
        max_bad_samples: int = 8,
        min_free_memory: int | None = None,
        on_failure: Recovery | None = None,
        snapshots: Snapshots | bool = True,
        shard: ShardRule = None,
        gather: bool = True,
        mp_policy: MixedPrecisionPolicy | None = None,
        sinks: Sequence[Sink] | None = None,
        loggers: Sequence[Sink] = (),
    ) -> FitResult:
        """Train for ``epochs`` over ``train``, validating on ``valid`` after each epoch.

        ``batch_size`` is the GLOBAL batch, split among devices. Raises a ConfigError before
        anything starts when the configuration is wrong, and TrainingFailed when a worker
        failed and the run could not go on. Interrupts are not failures: the run finishes
        its step and checkpoints; then :meth:`stop` returns with ``interrupted`` set, Ctrl-C
        raises ``KeyboardInterrupt`` and SIGTERM ``px.FitTerminated``
        (a SystemExit with code 143), each carrying the result as ``.result``.
        ``run_dir=""`` is the same as None: nothing is written.
        ``strategy="fsdp"`` shards the model's parameters, gradients and optimizer state
        among the devices (``shard``: which modules are its units, see
        :mod:`phalanx.sharding` and docs/fsdp.md); ``gather=False`` leaves its final
        weights in the run's last sharded checkpoint instead of gathering them into one
        process (``FitResult.model`` is then None, ``model_path`` names that checkpoint);
        ``mp_policy`` (FSDP2's ``MixedPrecisionPolicy``) gathers and computes its units in
        the policy's dtypes, their float32 shards kept as the optimizer's master weights.
        ``sinks`` replaces the default sinks (terminal, run folder); ``loggers`` adds to the
        sinks in force (``px.sinks.WandbSink``, ``MlflowSink``, ``TensorBoardSink``), on the
        head node only when a run has several (the other nodes' sinks see only their notices).
        """
        argtypes.check(argtypes.fit_kinds(), dict(locals()), "fit()")  # (PX125) first of all
        run_dir = run_dir or None  # "" is no run_dir, everywhere below (not the cwd)
        if not isinstance(hang_timeout, timedelta):  # seconds (validated below)
            hang_timeout = timedelta(seconds=hang_timeout)
        if not isinstance(node_timeout, timedelta):
            node_timeout = timedelta(seconds=node_timeout)
        # One process per node; several nodes with ddp or fsdp (PX140-PX142), before all else.
        launch = check_launch(os.environ, strategy)
        requeued = _requeued(launch, run_dir, resume)
        resume = resume or requeued is not None
        labels = parse_devices(devices)
        recovery = on_failure if on_failure is not None else Recovery()
        config = FitConfig(
            epochs=epochs,
            batch_size=batch_size,
            devices=labels,
            strategy=strategy,
            seed=seed,
            run_dir=run_dir,
            checkpoint=checkpoint,
            early_stopping=early_stopping,
            resume=resume,
            drop_last=drop_last,
            shuffle=shuffle,
            faults=list(faults),
            preflight=preflight,
            hang_timeout=recovery.hang_timeout or hang_timeout,
            node_timeout=node_timeout,
            num_workers=int(num_workers),  # (numpy's and torch's ints pass the type check)
            min_free_memory=min_free_memory,
            recovery=recovery,
            collate_fn=collate_fn,
            pin_memory=bool(pin_memory),
            max_steps=max_steps,
            val_every_steps=val_every_steps,
            # (None: on, but for a stream, where a moving share reads other lanes too)
            balance=not isinstance(train, Stream) if balance is None else bool(balance),
            slow_worker=slow_worker,
            on_bad_sample=on_bad_sample,
            max_bad_samples=max_bad_samples,
            snapshots=settings_of(snapshots),
            shard=shard,
            gather=gather,
            mp_policy=mp_policy,
        )
        # A stream's lengths, counted once unless given (kept in run_dir for a resume).
        learned = [
            data.learn_lengths(run_dir, reuse=resume)
            for data in (train, valid)
            if isinstance(data, Stream)
        ]
        train_size = dataset_size(train, "training")
        valid_size = dataset_size(valid, "validation") if valid is not None else 0
        validate_fit(
            self.spec,
            config,
            train_size,
            has_valid=valid is not None,
            train=train,
            valid=valid,
            nodes=launch.nnodes,
        )
        check_free_memory(labels, min_free_memory)
        remote = launch.remote
        # A node other than the head writes nothing in run_dir (the head's lock, files and
        # sinks): it only reads the token and, resuming, the checkpoints there.
        # PX143 while another live run holds run_dir.
        with _holding(None if remote else run_dir) as lock:
            if not remote:
                validate_run_dir(config)
            # A run that writes checkpoints needs the data's fingerprint (it reads samples),
            # and so does one over several nodes (every node must train on the same data).
            wanted = run_dir or launch.nnodes > 1
            sample_hash = fingerprint(train, train_size) if wanted else DataPrint("")
            layout = train.layout() if isinstance(train, Stream) else None
            plan = Plan(train_size, batch_size, seed, shuffle, drop_last, sample_hash, layout)
            check_resume_plan(config, plan)  # before anything starts, as the checks above
            run = RunInputs(
                spec=self.spec,
                config=config,
                plan=plan,
                train=train,
                valid=valid,
                valid_size=valid_size,
                launch=launch,
                notices=[text for text in [requeued, *learned] if text],
            )
            if remote:  # (the head's loggers log the run, and a successor's)
                return self._run_node(run, sinks, loggers)
            return self._run(run, lock, sinks, loggers)

    def _run(
        self,
        run: RunInputs,
        lock: RunLock | None,
        sinks: Sequence[Sink] | None,
        loggers: Sequence[Sink] = (),
        fresh: bool = True,
    ) -> FitResult:
        """Open the run folder and the sinks, train, close; the caller holds the lock.
        ``fresh``: a new fit (a stop asked for before it is forgotten); False for a node
        that takes over from a lost head, where a stop asked for meanwhile holds."""
        config = run.config
        run_dir = config.run_dir
        opened = _open_run(config)  # run.json; an earlier run's files moved aside
        if sinks is None:
            from phalanx.sinks import default_sinks

            sinks = default_sinks(run_dir)
        emit = Fanout([*sinks, *loggers])
        if opened is not None:
            emit(opened)
        notice = lock.notice() if lock is not None else None
        if notice is not None:
            emit(Notice(notice, level="warning"))
        for text in run.notices:
            emit(Notice(text))
        slow = cpu_notice(run.spec.precision.name, config.devices)
        if slow is not None:
            emit(Notice(slow, level="warning"))
        if fresh:
            self.interrupter.reset()
        try:
            with handle_signals(self.interrupter), _keep_rng(config.devices):
                result = finish(self._dispatch(run, emit), run)
            if run_dir and result.interrupted is None and result.model is not None:
                result.model_path = save_final_model(run_dir, result.model)
            emit(
                RunEnded(
                    result.history, result.steps, result.epochs, result.interrupted, result.seconds
                )
            )
        except (NodeFencedError, HeadLost):
            # (a head replaced by another: the run goes on there, its record too; a
            # successor that stopped short: the run is paused, resume=True goes on)
            raise
        except BaseException:
            emit(RunEnded([], 0, 0, None, 0.0, failed=True))
            raise
        finally:
            emit.close()
        self.interrupter.raise_if_signalled(result)  # Ctrl-C, SIGTERM: not a success
        return result

    def _run_node(
        self, run: RunInputs, sinks: Sequence[Sink] | None, loggers: Sequence[Sink] = ()
    ) -> FitResult:
        """A node other than the head: its agent trains this node's workers as the head
        orders and returns the run's end as the head tells it. Its sinks see only its own
        notices (the head's have the run); it writes nothing in run_dir. When the head is
        lost and this node goes on (the ddp strategy's ``Failover``), it follows the new
        head, or leads the run from here as the head (:meth:`_take_over`)."""
        from phalanx.strategies.ddp.nodes.failover import Failover, head_lost_after

        self.interrupter.reset()
        while True:
            try:
                return self._node_once(run, sinks)
            except Failover as failover:
                try:
                    if self.interrupter.should_stop():  # (asked to stop: no new start)
                        why = f"a stop was asked for ({self.interrupter.reason})"
                        from phalanx.sinks import default_sinks

                        say = Fanout(list(sinks) if sinks is not None else default_sinks(None))
                        lost = head_lost_after(failover, why, say)
                        say.close()
                        raise lost from None
                    run = _after_failover(run, failover)
                    if failover.leads:
                        return self._take_over(run, sinks, loggers)
                except BaseException:
                    failover.release()  # (its node port, and the hellos waiting there)
                    raise

    def _node_once(self, run: RunInputs, sinks: Sequence[Sink] | None) -> FitResult:
        """One run of this node under one head (the interrupter is the caller's to reset:
        a stop asked for during a failover holds)."""
        from dataclasses import replace

        from phalanx.strategies.ddp import run_ddp

        if sinks is None:
            from phalanx.sinks import default_sinks

            sinks = default_sinks(None)
        emit = Fanout(list(sinks))
        try:
            with handle_signals(self.interrupter), _keep_rng(run.config.devices):
                end = run_ddp(run, emit, self.interrupter, run.launch)
                result = finish(end, replace(run, config=replace(run.config, run_dir=None)))
            result.model_path = end.model_path  # (the head's file, where this node sees it)
        finally:
            emit.close()
        self.interrupter.raise_if_signalled(result)
        return result

    def _take_over(
        self, run: RunInputs, sinks: Sequence[Sink] | None, loggers: Sequence[Sink]
    ) -> FitResult:
        """This node leads the run from here: as the head, from the newest checkpoint in
        the shared run_dir (its workers' emergency one), its sinks opened there again
        (appending: one run, one record). The lost head may still hold run_dir's lock
        (frozen): the fencing term the new head takes is what keeps it out then."""
        run_dir = run.config.run_dir
        assert run_dir is not None
        with contextlib.ExitStack() as stack:
            lock: RunLock | None = None
            try:
                lock = stack.enter_context(RunLock.acquire(run_dir))
            except RunDirLockedError as exc:
                run.notices.append(
                    f"the lost head still holds {run_dir}'s lock ({exc.args[0][:200]}); this "
                    "node takes over under a newer fencing term, which keeps it out"
                )
            return self._run(run, lock, sinks, loggers, fresh=False)

    def _dispatch(self, run: RunInputs, emit: Fanout) -> RunEnd:
        """Train with the run's strategy; raises TrainingFailed when it stopped."""
        if process_based(run.config.strategy):
            from phalanx.strategies.ddp import run_ddp

            return run_ddp(run, emit, self.interrupter, run.launch)
        return self._in_process(run, emit)

    def _in_process(self, run: RunInputs, emit: Fanout) -> RunEnd:
        from phalanx.runner import build_loop, make_checkpointer, run_member

        engine: Any
        if run.config.strategy == "threads":
            from phalanx.strategies.threads import ThreadsEngine

            engine = ThreadsEngine(run)
        else:
            from phalanx.strategies.single import SingleEngine

            engine = SingleEngine(run)
        config, plan = run.config, run.plan
        checkpointer = make_checkpointer(config, emit)
        loop = build_loop(
            engine, run.spec, config, plan, emit, self._stop_reason, run.valid_or_none, checkpointer
        )
        try:
            member = run_member(loop, plan, config, emit, plan.samples, run.valid_size)
        except (StepAborted, FailedHere) as exc:
            if isinstance(exc, FailedHere):
                exc.failure.action = "aborted"  # the failure that ends the run
            failures = loop.failures + ([exc.failure] if isinstance(exc, FailedHere) else [])
            poison = isinstance(exc, StepAborted) and exc.poison
            raise stopped(failures, poison, config) from None
        finally:
            close = getattr(engine, "close", None)
            if close is not None:
                close()
        st = member.loop.state
        return RunEnd(
            model=engine.final_model(),
            history=st.history,
            steps=st.global_step,
            epochs=st.epoch,
            interrupted=member.loop.interrupted,
            ledger=st.ledger,
            failures=member.failures,
            seconds=member.seconds,
            quarantine=dict(st.quarantine),
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


def _after_failover(run: RunInputs, failover: Any) -> RunInputs:
    """The run as this node goes on with it after the head's loss: from the newest
    checkpoint in run_dir (``resume``), in its new place (the new head, or a node of it)."""
    from dataclasses import replace

    config = replace(run.config, resume=True)
    check_resume_plan(config, run.plan)
    assert run.launch is not None
    launch = failover.launch(run.launch)
    return replace(run, config=config, launch=launch, failover=failover, notices=[])


def _requeued(launch: Launch | None, run_dir: str | None, resume: bool) -> str | None:
    """Why this fit resumes though not asked to (a notice), or None: Slurm requeued the job
    (``SLURM_RESTART_COUNT`` > 0) and it has a run_dir to continue from."""
    if resume or launch is None or launch.source != "slurm" or not run_dir:
        return None
    if launch.restart_count < 1:
        return None
    return (
        f"Slurm requeued this job (SLURM_RESTART_COUNT={launch.restart_count}): resuming from "
        f"{run_dir} (as resume=True)"
    )


def _open_run(config: FitConfig) -> RunOpened | None:
    """With a run_dir: name the run (:func:`phalanx.runinfo.open_run`), after every check."""
    if not config.run_dir:
        return None
    from phalanx.runinfo import open_run

    return open_run(config.run_dir, config, config.resume)[0]


@contextlib.contextmanager
def _holding(run_dir: str | None) -> Iterator[RunLock | None]:
    """``run_dir``'s lock (:mod:`phalanx.runlock`) for the block, released however it ends."""
    if not run_dir:
        yield None
        return
    with RunLock.acquire(run_dir) as lock:
        yield lock


def _keep_rng(labels: list[str]) -> contextlib.AbstractContextManager[Any]:
    """Training reseeds torch's RNG; give the caller theirs back afterwards."""
    cuda = [torch.device(d).index or 0 for d in labels if d.startswith("cuda")]
    return torch.random.fork_rng(devices=cuda)
