"""strategy="ddp": one process per device. Same math as "single"; every failure is named in
one report within seconds; no process is left behind, even when the supervisor is killed.

Starting the workers (spawn, importing torch) costs ~3-10 s per fit() on a 2-core machine,
so fits are shared where the assertions allow it.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import phalanx as px
from ddp_helpers import (
    StepTimes,
    exit_on_sample,
    make_data,
    mlp,
    model_needing_a_missing_package,
    mse_step,
    sgd,
    slow_mlp,
    wrong_shape_step,
)
from phalanx.events import CheckpointSkipped, Event, Resumed
from phalanx.plan import Plan
from phalanx.report import is_secondary
from procs import alive, child_env, started_by, workers_of

TWO = "cpu:0,cpu:1"
THREE = "cpu:0,cpu:1,cpu:2"

# 489 samples in global batches of 44: 11 full batches and a short one of 5, 12 steps an
# epoch, 60 steps in 5 epochs. Two workers split 44 as 22/22 and 5 as 3/2; three workers
# split 44 as 15/15/14 and 5 as 2/2/1.
DATA = make_data(489)
VALID = make_data(101, seed=1)
# (even shares: these runs are compared bit for bit, and balance follows the machine load)
FIT: dict[str, Any] = dict(batch_size=44, epochs=5, seed=3, balance=False)

FAULT_STEP = 3
HANG_TIMEOUT = timedelta(seconds=3)
DECISION_S = 5.0  # from the fault to the report, beyond hang_timeout for hangs


def learner(step: Any = mse_step) -> px.Learner:
    return px.Learner(mlp, sgd, step)


def params(model: nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in model.state_dict().values()]


def rel_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """Largest difference in a tensor relative to that tensor's largest entry."""
    assert [t.shape for t in a] == [t.shape for t in b]
    return max(float((x - y).abs().max() / y.abs().max()) for x, y in zip(a, b, strict=True))


class Recorder:
    """A sink that appends every event to ``into``."""

    def __init__(self, into: list[Event]) -> None:
        self.into = into

    def handle(self, event: Event) -> None:
        self.into.append(event)

    def close(self) -> None:
        pass


# -- shared runs -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def single_run() -> px.FitResult:
    return learner().fit(DATA, VALID, devices="cpu", strategy="single", sinks=[], **FIT)


@pytest.fixture(scope="module")
def ddp2_run() -> tuple[px.FitResult, float]:
    """A clean two-worker run, and its wall time (the reference for the fault cases)."""
    started = time.time()
    result = learner().fit(DATA, VALID, devices=TWO, strategy="ddp", sinks=[], **FIT)
    return result, time.time() - started


# -- 1. the same math as single --------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("devices", [TWO, THREE])
def test_ddp_matches_single(
    devices: str, single_run: px.FitResult, ddp2_run: tuple[px.FitResult, float]
) -> None:
    if devices == TWO:
        result = ddp2_run[0]
    else:
        result = learner().fit(DATA, VALID, devices=devices, strategy="ddp", sinks=[], **FIT)
    assert result.steps == single_run.steps == 60
    assert result.epochs == 5
    a, b = params(result.model), params(single_run.model)
    assert rel_diff(a, b) <= 1e-5
    torch.manual_seed(FIT["seed"])
    assert rel_diff(params(mlp()), b) > 1e-2  # training moved the weights
    assert len(result.history) == len(single_run.history) == 5
    for mine, ref in zip(result.history, single_run.history, strict=True):
        assert mine["epoch"] == ref["epoch"]
        assert mine["train/loss"] == pytest.approx(ref["train/loss"], rel=1e-5)
        assert mine["valid/loss"] == pytest.approx(ref["valid/loss"], rel=1e-5)
        assert mine["train/lr"] == ref["train/lr"]
    assert result.history[-1]["train/loss"] < 0.5 * result.history[0]["train/loss"]
    assert result.failures == []
    assert next(result.model.parameters()).device.type == "cpu"


@pytest.mark.timeout(120)
def test_ranks_with_no_sample_in_the_last_batch_do_not_deadlock() -> None:
    """45 samples in global batches of 11: the last batch has one sample, so two of three
    workers have nothing to compute there. They take part in the step with a zero pass
    (no uneven-input deadlock) and the math is the single-device one."""
    # Two epochs: with 1-sample steps at this learning rate, float rounding differences
    # (reduction order) grow about tenfold an epoch (measured: 1.4e-6 after 2, 2.5e-5
    # after 3, for threads as for ddp).
    data, fit_args = make_data(45), {**FIT, "batch_size": 11, "epochs": 2}
    single = learner().fit(data, devices="cpu", strategy="single", sinks=[], **fit_args)
    result = learner().fit(data, devices=THREE, strategy="ddp", sinks=[], **fit_args)
    assert result.steps == single.steps == 10
    assert result.ledger_ok is True
    assert rel_diff(params(result.model), params(single.model)) <= 1e-5


@pytest.mark.timeout(120)
@pytest.mark.parametrize("devices", ["cpu", "auto"])
def test_ddp_on_one_device(devices: str, single_run: px.FitResult) -> None:
    """strategy="ddp" with one worker process ("auto" is one CPU on a machine without
    CUDA): the supervisor and the vote still work, and the math is unchanged."""
    result = learner().fit(DATA, VALID, devices=devices, strategy="ddp", sinks=[], **FIT)
    assert result.steps == single_run.steps
    assert rel_diff(params(result.model), params(single_run.model)) <= 1e-5
    assert result.failures == [] and result.ledger_ok is True


# -- 2. the fault matrix -----------------------------------------------------------------------

# kind -> (root cause kind, code, times)
EXPECTED = {
    "exception": ("exception", "PX204", 2),  # times=2: a poison batch
    "kill": ("crash", "PX201", 1),
    "hang": ("hang", "PX202", 1),
    # An out-of-memory step is first tried again with the share cut into smaller micro-batches
    # (doubling each time, 22 samples: 5 splits); one that still fails at one sample per
    # micro-batch is retried once, then it is a poison batch.
    "oom": ("oom", "PX203", 99),
    # Not a px.Fault: the step calls os._exit(EXIT_CODE) (tests/ddp_helpers.exit_on_sample).
    "exit": ("crash", "PX201", 1),
}
EXIT_CODE = 7


# Phases of a step's local work and vote: the failed worker was computing its share.
STEP_PHASES = ("data", "forward", "backward", "metrics", "sync")
# Stop at the first fallen worker (the default, respawn, would train on).
ABORT = px.Recovery(mode="abort")
CASES = [(kind, rank, "forward") for kind in EXPECTED if kind != "exit" for rank in (0, 1)] + [
    ("exception", 1, "backward"),  # in the middle of backward: the group is rebuilt to retry
    ("exception", 0, "backward"),
    ("exception", 0, "data"),
    ("exception", 0, "metrics"),
    ("kill", 1, "backward"),
    ("kill", 0, "sync"),
    ("hang", 1, "backward"),
    ("hang", 0, "data"),
    ("exception", 1, "optimizer"),  # outside the vote: not retried, the run stops at once
    ("exception", 0, "validation"),  # in the validation after the epoch's last step
    ("exception", 1, "sync"),
    ("oom", 0, "backward"),  # mid-backward: split down to one sample, retried, then poison
    ("kill", 1, "data"),
    ("hang", 0, "sync"),  # the peer waits in the vote, at the same step and phase
    ("exit", 1, "forward"),  # an exit code without a signal
]
CASE_IDS = ["-".join(map(str, getattr(case, "values", case))) for case in CASES]
PLAN = Plan(len(DATA), FIT["batch_size"], FIT["seed"])  # the plan every fault case trains on


def expected(kind: str, phase: str) -> tuple[str, str, int]:
    """(root cause kind, code, times) of a fault case. An exception in the optimizer or in
    validation is not a step's failed attempt: it fails the run at once (PX200)."""
    if kind == "exception" and phase in ("optimizer", "validation"):
        return "exception", "PX200", 1
    return EXPECTED[kind]


def expected_nccl() -> str | None:
    """The NCCL version failures.json reports: torch's, where CUDA is available."""
    if not torch.cuda.is_available():
        return None
    return ".".join(str(v) for v in torch.cuda.nccl.version())


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("kind", "rank", "phase"), CASES, ids=CASE_IDS)
def test_fault_is_named_within_seconds(
    kind: str, rank: int, phase: str, ddp2_run: tuple[px.FitResult, float], tmp_path: Path
) -> None:
    root_kind, code, times = expected(kind, phase)
    share = PLAN.local_batch(0, FAULT_STEP, rank, 2)  # epoch 0: the step is in the first epoch
    if kind == "exit":
        step: Any = partial(exit_on_sample, DATA[share[0]][0], EXIT_CODE)
        faults = []
    else:
        step = mse_step
        faults = [px.Fault(kind, worker=rank, step=FAULT_STEP, phase=phase, times=times)]
    # A validation fault fires in the validation after the epoch's last step (the step it
    # names has passed by then); every other case fails in step FAULT_STEP.
    in_validation = phase == "validation"
    last_good = PLAN.steps if in_validation else FAULT_STEP  # committed steps before the fault
    # The optimizer phase comes after the step's vote: rank 0 (whose StepEnded the sinks
    # get) commits the step when another rank's optimizer is the one that raises.
    committed = last_good + (1 if phase == "optimizer" and rank != 0 else 0)
    steps = StepTimes()
    run_dir = tmp_path / "run"
    started = time.time()
    with pytest.raises(px.TrainingFailed) as info:
        learner(step).fit(
            DATA,
            VALID if in_validation else None,
            devices=TWO,
            strategy="ddp",
            faults=faults,
            hang_timeout=HANG_TIMEOUT,
            on_failure=ABORT,
            run_dir=str(run_dir),
            sinks=[steps],
            **{**FIT, "epochs": 1},
        )
    decided = time.time()
    err = info.value

    # A decision within seconds: from the end of the last good step (the faulty step begins
    # right after it) to the raised report; and the whole fit no slower than a clean run
    # plus that (the clean run trains 60 steps; startup varies by a few seconds).
    allowance = HANG_TIMEOUT.total_seconds() if kind == "hang" else 0.0
    assert max(steps.ended) == committed
    assert decided - steps.ended[last_good] < allowance + DECISION_S
    clean_wall = ddp2_run[1]
    assert decided - started < clean_wall + allowance + DECISION_S

    # One report whose first line names the root cause.
    first = str(err).splitlines()[0]
    at = "in validation of epoch 1" if in_validation else f"step {FAULT_STEP + 1} "  # 1-based
    for part in (f"device cpu:{rank}", f"rank {rank}", at, f"({phase})"):
        assert part in first, (part, first)
    if kind == "exception":
        assert "InjectedFault: injected exception" in first
    if kind == "oom":
        assert "OutOfMemoryError: injected out of memory" in first
    root = err.root_cause
    assert (root.kind, root.rank, root.worker) == (root_kind, rank, rank)
    assert root.device == f"cpu:{rank}"
    assert (root.step, root.phase) == (None if in_validation else FAULT_STEP, phase)
    assert err.code == code
    assert not is_secondary(root)
    assert "by peer" not in root.message.lower()
    assert root in err.failures
    if times > 1:  # the step was retried (after splits for oom), then aborted the run
        mine = [f for f in err.failures if f.rank == rank and f.kind == root_kind]
        splits = 5 if kind == "oom" else 0
        assert [f.action for f in mine] == ["split"] * splits + ["retried", "aborted"]
        assert root is mine[0]
        assert "poison batch" in str(err)
    else:
        assert root.action == "aborted"
    _check_what_the_worker_left(kind, err)
    for other in err.failures:  # the survivor only ever saw the consequences
        if other.rank != rank:
            assert is_secondary(other), other

    doc = json.loads((run_dir / "failures.json").read_text())
    assert doc["root_cause"]["rank"] == rank
    assert doc["root_cause"]["kind"] == root_kind
    assert doc["root_cause"]["step"] == root.step
    assert doc["root_cause"]["sample_indices"] == root.sample_indices
    env = doc["environment"]
    assert env["devices"] == ["cpu:0", "cpu:1"]
    assert env["torch"] == torch.__version__
    assert env["python"] == platform.python_version()
    assert (env["cuda"], env["nccl"]) == (torch.version.cuda, expected_nccl())
    assert socket.gethostname() in env["hosts"]
    assert root.host == socket.gethostname() and root.pid is not None and root.pid > 0
    assert f"host {root.host}, pid {root.pid})" in first
    assert root.epoch == 0 and root.time <= decided
    assert len(doc["failures"]) == len(err.failures)
    if phase in STEP_PHASES:
        assert root.sample_indices == share, f"{root.sample_indices} != the plan's share {share}"


def _check_what_the_worker_left(kind: str, err: px.TrainingFailed) -> None:
    """The root cause's record of how the worker ended: its exception and traceback, its
    exit code or signal, or (hung) its stacks."""
    root = err.root_cause
    if kind in ("exception", "oom"):  # the worker's own exception, with its traceback
        raised = "InjectedFault" if kind == "exception" else "OutOfMemoryError"
        assert root.exception_type == raised
        assert root.traceback is not None
        assert 'faults.py", line' in root.traceback and "in fire" in root.traceback  # raised here
        last = root.traceback.rstrip().splitlines()[-1]
        assert last.startswith(("phalanx.faults.", "torch.")) and raised in last, last
        assert root.exit_code is None and root.signal is None
    if kind == "kill":
        assert root.signal == signal.SIGKILL
        assert root.exit_code is None
    if kind == "exit":
        assert (root.exit_code, root.signal) == (EXIT_CODE, None)
        assert root.exception_type is None and root.traceback is None
        assert f"exit code {EXIT_CODE}, signal None" in str(err)
    if kind == "hang":
        assert root.stacks is not None
        assert "faults.py" in root.stacks
        assert "in fire" in root.stacks
        assert "Stacks of the hung worker" in str(err)


PREFLIGHT = {
    # name -> (fit arguments, the worker named, exception type, text in the first line)
    "injected-exception": (
        dict(faults=[px.Fault("exception", worker=1, step=0, phase="preflight")]),
        1,
        "InjectedFault",
        "injected exception",
    ),
    "injected-oom": (
        dict(faults=[px.Fault("oom", worker=0, step=0, phase="preflight")]),
        0,
        "OutOfMemoryError",
        "injected out of memory",
    ),
    "injected-kill": (  # a death, not an exception: no traceback, the signal instead
        dict(faults=[px.Fault("kill", worker=1, step=0, phase="preflight")]),
        1,
        None,
        "died from signal SIGKILL",
    ),
    "shape-bug": (dict(step=wrong_shape_step), None, "RuntimeError", "cannot be multiplied"),
    "missing-import": (
        dict(model=model_needing_a_missing_package),
        None,
        "ModuleNotFoundError",
        "phalanx_no_such_package",
    ),
}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("case", list(PREFLIGHT))
def test_preflight_names_the_device_before_any_collective(case: str, tmp_path: Path) -> None:
    """Each worker's first forward/backward alone: a bug in the model, the step or the
    worker's environment is that device's preflight failure (PX205), with its own
    exception and traceback, before any step or collective."""
    args, worker, exc_type, text = PREFLIGHT[case]
    fit_args = {k: v for k, v in args.items() if k not in ("step", "model")}
    steps = StepTimes()
    with pytest.raises(px.TrainingFailed) as info:
        px.Learner(args.get("model", mlp), sgd, args.get("step", mse_step)).fit(
            DATA, devices=TWO, strategy="ddp", run_dir=str(tmp_path / "run"), sinks=[steps],
            **fit_args, **FIT,
        )  # fmt: skip
    err = info.value
    root = err.root_cause
    assert err.code == "PX205"
    assert root.phase == "preflight"
    assert root.exception_type == exc_type, root
    if exc_type is None:  # the supervisor saw the process die
        assert (root.kind, root.signal, root.traceback) == ("crash", signal.SIGKILL, None)
    else:
        assert root.kind == ("oom" if exc_type == "OutOfMemoryError" else "exception")
        assert root.traceback is not None and exc_type in root.traceback
    if worker is not None:
        assert (root.worker, root.device) == (worker, f"cpu:{worker}")
    first = str(err).splitlines()[0]
    assert f"device cpu:{root.worker}" in first and "(preflight)" in first and text in first
    assert steps.ended == {}  # no step ran
    assert all(f.phase == "preflight" and f.action == "aborted" for f in err.failures)


@pytest.mark.timeout(90)
def test_without_preflight_a_model_bug_fails_in_step_0_forward() -> None:
    """preflight=False: no lone forward/backward before the first group. The same shape bug
    as above is then step 0's forward failure, on every worker (retried once: a poison
    batch), not a preflight failure."""
    steps = StepTimes()
    with pytest.raises(px.TrainingFailed) as info:
        px.Learner(mlp, sgd, wrong_shape_step).fit(
            DATA, devices=TWO, strategy="ddp", preflight=False, sinks=[steps], **FIT
        )
    err = info.value
    root = err.root_cause
    assert (root.step, root.phase, root.exception_type) == (0, "forward", "RuntimeError")
    assert err.code == "PX204"
    first = str(err).splitlines()[0]
    assert f"device cpu:{root.worker}" in first and "at step 1 (forward)" in first
    assert "cannot be multiplied" in first
    assert all(f.phase == "forward" and f.step == 0 for f in err.failures), err.failures
    assert {f.worker for f in err.failures} == {0, 1}
    assert steps.ended == {}


# -- 3. a transient fault is retried and changes nothing -------------------------------------


@pytest.mark.timeout(90)
def test_transient_exception_is_retried(ddp2_run: tuple[px.FitResult, float]) -> None:
    clean = ddp2_run[0]
    fault = px.Fault("exception", worker=1, step=FAULT_STEP, times=1)
    result = learner().fit(
        DATA, VALID, devices=TWO, strategy="ddp", faults=[fault], sinks=[], **FIT
    )
    assert result.steps == clean.steps == 60
    assert len(result.failures) == 1
    failure = result.failures[0]
    assert (failure.rank, failure.kind, failure.step, failure.action) == (
        1,
        "exception",
        FAULT_STEP,
        "retried",
    )
    assert "injected exception" in failure.message
    # From the failure to the retried step's commit (set by the supervisor, from rank 0's
    # StepEnded): a retry costs one step, far below a second.
    assert failure.recovery_seconds is not None and 0.0 <= failure.recovery_seconds < 5.0
    for a, b in zip(params(result.model), params(clean.model), strict=True):
        assert torch.allclose(a, b, rtol=1e-6)
    for mine, ref in zip(result.history, clean.history, strict=True):
        assert mine["train/loss"] == pytest.approx(ref["train/loss"], rel=1e-6)


# -- 5. the supervisor killed: its workers exit ---------------------------------------------

SCRIPT = """\
# {marker}
import sys

import ddp_helpers as h
import phalanx as px

if __name__ == "__main__":
    px.Learner(h.mlp, h.sgd, h.slow_step).fit(
        h.make_data(KILL_SAMPLES), epochs=KILL_EPOCHS, batch_size=20, devices="cpu:0,cpu:1",
        strategy="ddp", run_dir=sys.argv[1], checkpoint=px.Checkpoints(every_steps=2),
    )
"""
KILL_SAMPLES, KILL_EPOCHS = 400, 10  # 20 steps an epoch, 0.2 s each: minutes of training


def _wait_for_step(events: Path, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, f"the training script exited early ({proc.returncode})"
        if events.exists() and '"StepEnded"' in events.read_text():
            return
        time.sleep(0.1)
    raise AssertionError(f"no StepEnded in {events} within {timeout}s")


def _wait_for_checkpoint(directory: Path, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, f"the training script exited early ({proc.returncode})"
        if list(directory.glob("ckpt-*.pt")):
            return
        time.sleep(0.1)
    raise AssertionError(f"no checkpoint in {directory} within {timeout}s")


@pytest.mark.timeout(180)
def test_workers_exit_when_the_supervisor_is_killed(tmp_path: Path) -> None:
    marker = f"phalanx-supervisor-kill-{os.getpid()}-{time.time_ns()}"
    script = tmp_path / "train.py"
    script.write_text(
        SCRIPT.format(marker=marker)
        .replace("KILL_SAMPLES", str(KILL_SAMPLES))
        .replace("KILL_EPOCHS", str(KILL_EPOCHS))
    )
    run_dir = tmp_path / "run"
    log = (tmp_path / "log.txt").open("wb")
    proc = subprocess.Popen(
        [sys.executable, str(script), str(run_dir)],
        env=child_env(),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    workers: dict[int, str] = {}
    try:
        _wait_for_step(run_dir / "events.jsonl", proc, timeout=90)
        _wait_for_checkpoint(run_dir / "checkpoints", proc, timeout=30)
        workers = dict.fromkeys(workers_of(proc.pid), "")
        assert len(workers) >= 2, f"expected two workers under {proc.pid}: {workers}"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.time() + 5.0
        while time.time() < deadline and any(alive(pid) for pid in workers):
            time.sleep(0.05)
        still = [pid for pid in workers if alive(pid)]
        assert not still, f"workers still running 5 s after the supervisor died: {still}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in workers:  # never leave them behind, even when the test fails
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        log.close()
    assert proc.returncode == -signal.SIGKILL

    # The last checkpoint is intact (its checksum holds: no file is skipped) and the run
    # resumes from it. The resumed run keeps the plan (data, batch size, seed) and trains a
    # fast step for the rest of the first epoch only.
    saved = [int(p.stem.split("-")[1]) for p in (run_dir / "checkpoints").glob("ckpt-*.pt")]
    assert saved, "no checkpoint was written before the supervisor died"
    assert max(saved) < KILL_SAMPLES // 20, "killed after the first epoch: resume has no work"
    events: list[Event] = []
    result = learner().fit(
        make_data(KILL_SAMPLES), epochs=1, batch_size=20, devices=TWO, strategy="ddp",
        run_dir=run_dir, resume=True, sinks=[Recorder(events)],
    )  # fmt: skip
    resumed = [e for e in events if isinstance(e, Resumed)]
    assert [e.global_step for e in resumed] == [max(saved)]
    assert not [e for e in events if isinstance(e, CheckpointSkipped)]
    assert result.steps == KILL_SAMPLES // 20 and result.ledger_ok


# -- 6. configuration errors, before any process starts ---------------------------------------


def _nested_optimizer() -> Any:
    def adam(params: Any) -> torch.optim.Optimizer:
        return torch.optim.Adam(params)

    return adam


def _nested_step() -> Any:
    def step(model: nn.Module, batch: Any) -> torch.Tensor:
        return mse_step(model, batch)

    return step


CONFIG_ERRORS = {
    "model-lambda": (
        lambda: px.Learner(lambda: mlp(), sgd, mse_step),
        {},
        "PX114",
        "module-level function",
    ),
    "optimizer-nested": (
        lambda: px.Learner(mlp, _nested_optimizer(), mse_step),
        {},
        "PX114",
        "module-level function",
    ),
    "step-lambda": (
        lambda: px.Learner(mlp, sgd, lambda m, b: mse_step(m, b)),
        {},
        "PX115",
        "module level",
    ),
    "step-nested": (
        lambda: px.Learner(mlp, sgd, _nested_step()),
        {},
        "PX115",
        "_nested_step.<locals>.step) is a local function",
    ),
    "batch-smaller-than-devices": (
        lambda: px.Learner(mlp, sgd, mse_step),
        {"batch_size": 2, "devices": THREE},
        "PX113",
        "at least 3",
    ),
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", list(CONFIG_ERRORS))
def test_config_errors_before_any_process(case: str) -> None:
    make, overrides, code, hint = CONFIG_ERRORS[case]
    before = set(started_by(os.getpid()))
    kwargs: dict[str, Any] = {"batch_size": 20, "devices": TWO, **overrides}
    with pytest.raises(px.ConfigError) as info:
        make().fit(make_data(100), strategy="ddp", sinks=[], **kwargs)
    assert info.value.code == code
    assert hint in str(info.value)
    assert set(started_by(os.getpid())) == before
    assert multiprocessing.active_children() == []


# -- setup is not a hang --------------------------------------------------------------------


@pytest.mark.timeout(90)
def test_slow_setup_is_not_a_hang() -> None:
    """A model factory that takes 3 s (e.g. loading weights) with hang_timeout=2 s: setup
    is not a step, so it is no hang; the steps themselves take milliseconds."""
    result = px.Learner(slow_mlp, sgd, mse_step).fit(
        make_data(100),
        batch_size=20,
        devices=TWO,
        strategy="ddp",
        sinks=[],
        hang_timeout=timedelta(seconds=2),
    )
    assert result.steps == 5
