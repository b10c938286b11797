"""Setting up and running the loop for one member: checkpoints, resume, start/end events.

In-process strategies (single, threads) call :func:`run_member` in the caller's process;
the ddp strategy calls it in every worker process (only rank 0 writes and emits).
"""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from phalanx.checkpoint import Checkpointer, Checkpoints
from phalanx.checkpoint.io import list_checkpoints
from phalanx.errors import CheckpointError, CheckpointMismatchError
from phalanx.events import Emit, Resumed, RunStarted
from phalanx.failures import WorkerFailure
from phalanx.loop import Engine, LoopResult, LoopSettings, TrainLoop
from phalanx.plan import Plan, plan_difference
from phalanx.spec import FitConfig, TrainSpec

if TYPE_CHECKING:
    from phalanx.snapshot import SnapshotStore


@dataclass
class MemberRun:
    loop: LoopResult
    failures: list[WorkerFailure] = field(default_factory=list)
    seconds: float = 0.0


def checkpoint_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def make_checkpointer(config: FitConfig, emit: Emit) -> Checkpointer | None:
    if not config.run_dir:
        return None
    settings = config.checkpoint if config.checkpoint is not None else Checkpoints()
    guard = None
    if config.head_term > 0:  # (a head another node replaced must not write here)
        from phalanx.strategies.ddp.nodes.fencing import replaced_since

        run_dir, term = config.run_dir, config.head_term
        guard = lambda: replaced_since(run_dir, term)  # noqa: E731
    return Checkpointer(checkpoint_dir(config.run_dir), settings, emit, guard)


def build_loop(
    engine: Engine,
    spec: TrainSpec,
    config: FitConfig,
    plan: Plan,
    emit: Emit,
    stop_requested: Callable[[], str | None],
    valid_size: int | None,
    checkpointer: Checkpointer | None,
    on_failure: Callable[[WorkerFailure], None] | None = None,
) -> TrainLoop:
    """The loop of one member; ``valid_size`` is None without a validation set."""
    settings = LoopSettings(
        plan=plan,
        epochs=config.epochs,
        metrics=spec.summed_metrics(),
        loop_metrics=spec.loop_metrics(),
        seed=config.seed,
        has_valid=valid_size is not None,
        valid_batches=-(-(valid_size or 0) // config.batch_size),
        max_steps=config.max_steps,
        val_every_steps=config.val_every_steps,
        balance=config.balance,
        on_bad_sample=config.on_bad_sample,
        slow_worker=config.slow_worker,
        max_bad_samples=config.max_bad_samples,
    )
    stopping = copy.deepcopy(config.early_stopping)
    return TrainLoop(engine, settings, emit, checkpointer, stopping, stop_requested, on_failure)


def resume(loop: TrainLoop, plan: Plan, config: FitConfig, emit: Emit) -> None:
    """Restore the newest valid checkpoint in ``run_dir`` (checksums verified; a corrupt
    one is skipped with a CheckpointSkipped event). Nothing to resume from: start fresh.
    A checkpoint of another plan raises CheckpointError; one that does not fit the model or
    optimizer, CheckpointMismatchError."""
    from phalanx.events import Notice

    assert config.run_dir
    reader = Checkpointer(checkpoint_dir(config.run_dir), Checkpoints(), emit)
    try:
        engine = loop.engine  # (an fsdp member reads only its rows of a sharded checkpoint)
        member = (getattr(engine, "world", 1), engine.rank) if engine.saves_shards else None
        found = reader.load_latest(member)
    finally:
        reader.close()
    if found is None:
        folder = checkpoint_dir(config.run_dir)
        if not list_checkpoints(folder):  # a first run with resume=True: as meant
            emit(Notice(f"resume: no checkpoint in {folder} yet: a first run, from step 1"))
            return
        emit(
            Notice(
                f"resume: no valid checkpoint in {folder} (each was skipped, named above); "
                "starting from scratch",
                level="warning",
            )
        )
        return
    snap, info = found
    saved = snap.get("plan")
    if not plan.matches(saved):
        raise CheckpointError(f"{info.path} {plan_mismatch(saved, plan)}")
    restore_fitting(loop, snap, info.path)
    st = loop.state
    emit(Resumed(info.path, st.epoch, st.step, st.global_step))


def check_resume_plan(config: FitConfig, plan: Plan) -> None:
    """In the caller, before anything starts: the checkpoint a resume will load (the newest
    that verifies) must have this run's plan, else CheckpointError (PX120) naming what
    differs; a first-format file, CheckpointFormatError (PX126). Reads only the plan record
    (the file is mapped, its tensors never read); the loading member checks it again."""
    from phalanx.checkpoint.checkpointer import digest_of, read_index
    from phalanx.checkpoint.io import list_checkpoints, peek
    from phalanx.errors import CheckpointFormatError

    if not (config.resume and config.run_dir):
        return
    folder = checkpoint_dir(config.run_dir)
    index = read_index(folder)
    for path, _ in reversed(list_checkpoints(folder)):
        try:
            saved = peek(path, "plan", digest_of(index.get(os.path.basename(path), {})))
        except CheckpointFormatError:
            raise
        except CheckpointError:
            continue  # the loading member skips it too, and says so
        if not plan.matches(saved):
            raise CheckpointError(f"{path} {plan_mismatch(saved, plan)}")
        return


def plan_mismatch(saved: Any, now: Plan) -> str:
    """Why a checkpoint's plan record does not match this run's plan: which fields differ,
    which samples differ and how, the likely cause and the fix."""
    if not isinstance(saved, dict):
        return f"has no plan record this version understands ({saved!r}); use a new run_dir"
    fields, data = plan_difference(saved, now)
    parts = []
    if fields:
        named = [f.replace(" -> ", " in the checkpoint, ", 1) + " now" for f in fields]
        parts.append(f"another plan ({', '.join(named)})")
    if data is not None:
        size = now.samples
        parts.append(f"another training dataset{' of the same size' if not fields else ''} "
                     f"({size} samples): {data}")  # fmt: skip
    return (
        f"was written with {'; and '.join(parts)}. Resume with the same dataset, batch_size, "
        "seed, shuffle and drop_last (data built at random needs a fixed seed, e.g. "
        "torch.manual_seed(0) before building it, and a random_split "
        "generator=torch.Generator().manual_seed(0)), or use a new run_dir"
    )


def restore_fitting(loop: TrainLoop, snap: dict[str, Any], path: str) -> None:
    """``loop.restore(snap)``, or CheckpointMismatchError naming ``path`` when the snapshot
    does not fit the loop's model or optimizer (the file itself is never touched)."""
    before = _group_keys(loop.engine.state_dict())
    try:
        loop.restore(snap)
    except (RuntimeError, KeyError, ValueError, TypeError, IndexError) as exc:
        raise _mismatch(path, f"{type(exc).__name__}: {exc}") from exc
    problem = _lost_settings(before, _group_keys(loop.engine.state_dict()))
    if problem:
        raise _mismatch(path, problem)


def _mismatch(path: str, detail: str) -> CheckpointMismatchError:
    detail = " ".join(detail.split())  # load_state_dict's messages span lines
    if len(detail) > _DETAIL:
        detail = detail[: _DETAIL - 3] + "..."
    return CheckpointMismatchError(
        f"{path} does not fit this run's model or optimizer: resume with the same model and "
        f"optimizer as the run that wrote it, or use a new run_dir ({detail})"
    )


_DETAIL = 400  # characters of the original error quoted in a CheckpointMismatchError
# Added to the optimizer's groups by an LR scheduler, not by the optimizer itself.
_SCHEDULER_KEYS = frozenset({"initial_lr"})


def _group_keys(engine_state: dict[str, Any]) -> list[set[str]] | None:
    """The setting names of each optimizer parameter group (None if not the usual shape)."""
    try:
        groups = engine_state["optimizer"]["param_groups"]
        return [set(g) - {"params"} - _SCHEDULER_KEYS for g in groups]
    except (KeyError, TypeError):
        return None


def _lost_settings(before: list[set[str]] | None, after: list[set[str]] | None) -> str | None:
    """Loading another optimizer's state (SGD's into Adam) succeeds, but leaves out settings
    the optimizer needs at its first step (Adam's betas): say so now instead. (Settings a
    newer torch added are filled in by the optimizer's own load_state_dict.)"""
    if before is None or after is None:
        return None
    for i, (wanted, loaded) in enumerate(zip(before, after, strict=False)):
        missing = sorted(wanted - loaded)
        if missing:
            return (
                f"the optimizer's parameter group {i} has no {', '.join(missing)} after "
                "loading: the checkpoint was written with another optimizer"
            )
    return None


def restore_newest(
    loop: TrainLoop, plan: Plan, config: FitConfig, emit: Emit, snapshots: SnapshotStore | None
) -> None:
    """A member restarted after every member fell: the newest state it can find, its
    machine's snapshot in shared memory (``snapshots``) or the newest intact checkpoint in
    ``run_dir``, whichever is further; nothing found: it starts from scratch, and the
    generation's hand-over gives it a peer's state if one found more."""
    header = snapshots.newest() if snapshots is not None else None
    resumed = False
    if config.run_dir:
        from phalanx.checkpoint.io import list_checkpoints

        listed = list_checkpoints(checkpoint_dir(config.run_dir))
        if listed and (header is None or listed[-1][1] > header.step):
            resume(loop, plan, config, emit)
            resumed = True
            if header is None or loop.state.global_step >= header.step:
                return  # (else the newest files did not verify: the snapshot is further)
    snap = snapshots.read() if snapshots is not None else None
    if snap is None or (resumed and snap.step <= loop.state.global_step):
        if not resumed and config.run_dir:
            resume(loop, plan, config, emit)
        return
    loop.restore(snap.state)
    st = loop.state
    where = f"shared memory (snapshot of step {snap.step}, {snap.nbytes / 1e6:.1f} MB)"
    emit(Resumed(where, st.epoch, st.step, st.global_step))


def start_run(
    loop: TrainLoop,
    plan: Plan,
    config: FitConfig,
    emit: Emit,
    train_size: int,
    valid_size: int,
    restart: bool = False,
    snapshots: SnapshotStore | None = None,
) -> None:
    """Resume if asked (``restart``: from the newest state, see :func:`restore_newest`);
    announce the run."""
    if restart:
        restore_newest(loop, plan, config, emit, snapshots)
    elif config.resume:
        resume(loop, plan, config, emit)
    emit(
        RunStarted(
            config.run_dir or "",
            config.strategy,
            config.devices,
            config.epochs,
            plan.steps,
            plan.batch_size,
            train_size,
            valid_size,
            loop.state.epoch,
            loop.state.step,
        )
    )


def run_member(
    loop: TrainLoop,
    plan: Plan,
    config: FitConfig,
    emit: Emit,
    train_size: int,
    valid_size: int,
) -> MemberRun:
    """Resume if asked, run the loop, and always flush checkpoints."""
    started = time.time()
    try:
        start_run(loop, plan, config, emit, train_size, valid_size)
        result = loop.run()
    finally:
        loop.close_checkpointer()
    return MemberRun(result, loop.failures, time.time() - started)
