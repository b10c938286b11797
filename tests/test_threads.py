"""strategy="threads": one replica and one thread per device, the same math as "single"."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta
from functools import partial
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import phalanx as px
from ddp_helpers import make_data, mlp, mse_step, sgd
from phalanx.events import Event, StepEnded
from phalanx.metrics import Metric
from phalanx.plan import Plan
from phalanx.step import StepOutput

TWO = "cpu:0,cpu:1"
THREE = "cpu:0,cpu:1,cpu:2"


def learner(step: Any = mse_step, metrics: tuple[Any, ...] = ()) -> px.Learner:
    return px.Learner(mlp, sgd, step, metrics=metrics)


def params(model: nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in model.state_dict().values()]


def rel_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """Largest difference in a tensor relative to that tensor's largest entry, over all
    tensors (float32 rounding alone gives about 1e-7 here)."""
    assert [t.shape for t in a] == [t.shape for t in b]
    return max(float((x - y).abs().max() / y.abs().max()) for x, y in zip(a, b, strict=True))


# 490 samples in global batches of 45: 10 full batches and a short one of 40, 11 steps an
# epoch; 5 epochs are 55 optimizer steps.
DATA = make_data(490)
VALID = make_data(101, seed=1)
# (even shares: these runs are compared bit for bit, and balance follows the machine load)
FIT: dict[str, Any] = dict(batch_size=45, epochs=5, seed=3, sinks=[], balance=False)


@pytest.fixture(scope="module")
def single_run() -> px.FitResult:
    return learner().fit(DATA, VALID, devices="cpu", strategy="single", **FIT)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("devices", [TWO, THREE])
def test_threads_matches_single(devices: str, single_run: px.FitResult) -> None:
    result = learner().fit(DATA, VALID, devices=devices, strategy="threads", **FIT)
    assert result.steps == single_run.steps == 55
    a, b = params(result.model), params(single_run.model)
    assert rel_diff(a, b) <= 1e-5
    torch.manual_seed(3)
    assert rel_diff(params(mlp()), b) > 1e-2  # training moved the weights
    for mine, ref in zip(result.history, single_run.history, strict=True):
        assert mine["train/loss"] == pytest.approx(ref["train/loss"], rel=1e-5)
        assert mine["valid/loss"] == pytest.approx(ref["valid/loss"], rel=1e-5)
    assert result.history[-1]["train/loss"] < 0.5 * result.history[0]["train/loss"]
    assert result.failures == []
    assert next(result.model.parameters()).device.type == "cpu"


@pytest.mark.timeout(60)
def test_uneven_split_with_short_last_batch() -> None:
    """Global batch 50 over 3 devices (17/17/16); 230 samples leave a last batch of 30."""
    data = make_data(230, seed=5)
    fit: dict[str, Any] = dict(batch_size=50, epochs=10, seed=7)
    ref = learner().fit(data, devices="cpu", strategy="single", sinks=[], **fit)
    steps: list[StepEnded] = []
    got = learner().fit(data, devices=THREE, strategy="threads", sinks=[Steps(steps)], **fit)
    assert got.steps == ref.steps == 50
    assert rel_diff(params(got.model), params(ref.model)) <= 1e-5
    # Progress counts the samples of all devices together: each global batch whole.
    assert [e.samples for e in steps[:5]] == [50, 50, 50, 50, 30]


class Steps:
    def __init__(self, into: list[StepEnded]) -> None:
        self.into = into

    def handle(self, event: Event) -> None:
        if isinstance(event, StepEnded):
            self.into.append(event)

    def close(self) -> None:
        pass


def mlp64() -> nn.Module:
    return mlp().double()


@pytest.mark.timeout(60)
def test_same_math_up_to_rounding_in_float64() -> None:
    """In float64 the only difference left is the order of the gradient sum."""
    x, y = make_data(230, seed=5).tensors
    data = TensorDataset(x.double(), y.double())
    fit: dict[str, Any] = dict(batch_size=50, epochs=10, seed=7, sinks=[])
    ref = px.Learner(mlp64, sgd, mse_step).fit(data, devices="cpu", strategy="single", **fit)
    got = px.Learner(mlp64, sgd, mse_step).fit(data, devices=THREE, strategy="threads", **fit)
    assert params(got.model)[0].dtype == torch.float64
    assert rel_diff(params(got.model), params(ref.model)) <= 1e-12


@pytest.mark.timeout(60)
def test_last_batch_smaller_than_devices() -> None:
    """101 samples in batches of 50: the last batch has one sample, so two of the three
    members get nothing at that step (they take a zero pass) and the sum is still exact."""
    data = make_data(101, seed=6)
    fit: dict[str, Any] = dict(batch_size=50, epochs=3, seed=1, sinks=[])
    ref = learner().fit(data, devices="cpu", strategy="single", **fit)
    got = learner().fit(data, devices=THREE, strategy="threads", **fit)
    assert got.steps == ref.steps == 9
    assert rel_diff(params(got.model), params(ref.model)) <= 1e-5


@pytest.mark.timeout(60)
@pytest.mark.parametrize("worker", [1, 0])
def test_transient_exception_is_retried_and_changes_nothing(worker: int) -> None:
    """The failed attempt's gradients (of the healthy replica too) are all thrown away."""
    fit: dict[str, Any] = dict(
        batch_size=45, epochs=1, seed=3, sinks=[], devices=TWO, strategy="threads"
    )
    clean = learner().fit(DATA, **fit)
    fault = px.Fault(kind="exception", worker=worker, step=3, times=1)
    retried = learner().fit(DATA, faults=[fault], **fit)
    assert retried.steps == clean.steps == 11
    assert all(
        torch.equal(x, y) for x, y in zip(params(retried.model), params(clean.model), strict=True)
    )
    assert len(retried.failures) == 1
    failure = retried.failures[0]
    where = (failure.worker, failure.device, failure.step, failure.phase)
    assert where == (worker, f"cpu:{worker}", 3, "forward")
    assert "injected exception" in failure.message
    assert failure.recovery_seconds is not None and 0.0 <= failure.recovery_seconds < 5.0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("worker", [1, 0, 2])  # a middle one, the main device, the last
def test_poison_batch_names_device_step_phase_and_message(worker: int, tmp_path: Any) -> None:
    fault = px.Fault(kind="exception", worker=worker, step=3, phase="backward", times=2)
    run_dir = tmp_path / "run"
    with pytest.raises(px.TrainingFailed) as info:
        learner().fit(
            DATA, devices=THREE, strategy="threads", batch_size=45, sinks=[], faults=[fault],
            run_dir=str(run_dir),
        )  # fmt: skip
    err = info.value
    first = str(err).splitlines()[0]
    assert f"device cpu:{worker}" in first
    assert "at step 4 " in first  # step 3, 1-based
    assert "(backward)" in first
    assert "injected exception" in first
    root = err.root_cause
    assert root.worker == worker
    assert root.kind == "exception"
    assert err.code == "PX204"
    assert [f.worker for f in err.failures] == [worker, worker]
    share = Plan(len(DATA), 45).local_batch(0, 3, worker, 3)
    assert root.sample_indices == share

    # failures.json, as under ddp: every failure, the root cause, the environment.
    doc = json.loads((run_dir / "failures.json").read_text())
    assert doc["root_cause"]["worker"] == worker
    assert doc["root_cause"]["device"] == f"cpu:{worker}"
    assert (doc["root_cause"]["step"], doc["root_cause"]["phase"]) == (3, "backward")
    assert doc["root_cause"]["exception_type"] == "InjectedFault"
    assert doc["root_cause"]["sample_indices"] == share
    assert [f["action"] for f in doc["failures"]] == ["retried", "aborted"]
    env = doc["environment"]
    assert env["devices"] == ["cpu:0", "cpu:1", "cpu:2"]
    assert (env["torch"], env["python"]) == (torch.__version__, platform.python_version())


class Exploding(Metric):
    name = "exploding"

    def size(self) -> int:
        return 1

    def state(self, output: StepOutput, samples: int) -> torch.Tensor:
        raise ValueError("this metric cannot count")

    def compute(self, state: torch.Tensor) -> float:
        return 0.0


@pytest.mark.timeout(60)
def test_exception_in_a_metric_is_reported_in_phase_metrics() -> None:
    with pytest.raises(px.TrainingFailed) as info:
        learner(metrics=(Exploding(),)).fit(
            DATA, devices=TWO, strategy="threads", batch_size=45, sinks=[]
        )
    err = info.value
    first = str(err).splitlines()[0]
    assert "(metrics)" in first and "this metric cannot count" in first
    assert "metric 'exploding' (Exploding.state) raised" in first
    assert err.code == "PX121"
    assert err.root_cause.phase == "metrics"
    assert err.root_cause.step == 0
    assert {f.device for f in err.failures} == {"cpu:0", "cpu:1"}


@pytest.mark.timeout(60)
def test_oom_is_absorbed_by_splitting_the_share_into_micro_batches() -> None:
    """Out of memory on one replica: the step is tried again while that replica cuts its
    share into micro-batches; the global batch and the math are unchanged."""
    clean = learner().fit(DATA, devices=TWO, strategy="threads", batch_size=45, sinks=[])
    fault = px.Fault(kind="oom", worker=1, step=2, times=2)
    result = learner().fit(
        DATA, devices=TWO, strategy="threads", batch_size=45, sinks=[], faults=[fault]
    )
    assert [(f.kind, f.action, f.worker) for f in result.failures] == [("oom", "split", 1)] * 2
    assert rel_diff(params(clean.model), params(result.model)) <= 1e-5
    assert result.ledger_ok


@pytest.mark.timeout(60)
def test_oom_even_at_one_sample_per_micro_batch_is_px203() -> None:
    fault = px.Fault(kind="oom", worker=1, step=2, times=100)
    with pytest.raises(px.TrainingFailed) as info:
        learner().fit(
            DATA, devices=TWO, strategy="threads", batch_size=45, sinks=[], faults=[fault]
        )
    err = info.value
    assert err.root_cause.kind == "oom"
    assert err.code == "PX203"
    assert "PX203" in str(err)
    assert "device cpu:1" in str(err).splitlines()[0]


@pytest.mark.timeout(60)
def test_optimizer_fault_on_a_non_main_device_is_fatal() -> None:
    fault = px.Fault(kind="exception", worker=2, step=1, phase="optimizer")
    with pytest.raises(px.TrainingFailed) as info:
        learner().fit(
            DATA, devices=THREE, strategy="threads", batch_size=45, sinks=[], faults=[fault]
        )
    root = info.value.root_cause
    assert (root.device, root.step, root.phase) == ("cpu:2", 1, "optimizer")


@pytest.mark.timeout(60)
def test_transient_sync_fault_is_retried() -> None:
    fault = px.Fault(kind="exception", worker=1, step=4, phase="sync")
    result = learner().fit(
        DATA, devices=TWO, strategy="threads", batch_size=45, sinks=[], faults=[fault]
    )
    assert result.steps == 11
    assert [(f.device, f.step, f.phase) for f in result.failures] == [("cpu:1", 4, "sync")]


def blocking_step(
    release: threading.Event, entered: list[float], model: nn.Module, batch: Any
) -> torch.Tensor:
    """On device cpu:1's thread: note when it starts to hang (in ``entered``), then hang."""
    if threading.current_thread().name.endswith("cpu:1"):
        entered.append(time.monotonic())
        wait_for_release_forever(release)
    return mse_step(model, batch)


def wait_for_release_forever(release: threading.Event) -> None:
    release.wait()


@pytest.mark.timeout(30)
def test_hang_is_reported_within_bound_with_stacks() -> None:
    release = threading.Event()
    entered: list[float] = []
    hang_timeout = timedelta(seconds=2)
    try:
        with pytest.raises(px.TrainingFailed) as info:
            learner(step=partial(blocking_step, release, entered)).fit(
                DATA,
                devices=TWO,
                strategy="threads",
                batch_size=45,
                sinks=[],
                hang_timeout=hang_timeout,
            )
        decided = time.monotonic()
    finally:
        release.set()
    err = info.value
    # From the moment the thread started to hang (not from the start of fit: building the
    # replicas and threads is no part of the bound) to the report.
    assert len(entered) == 1
    elapsed = decided - entered[0]
    bound = hang_timeout.total_seconds()
    assert bound - 0.5 <= elapsed < bound + 5.0, elapsed
    root = err.root_cause
    assert (root.kind, root.device, root.worker, root.step, root.phase) == (
        "hang",
        "cpu:1",
        1,
        0,
        "forward",
    )
    assert err.code == "PX202"
    assert root.stacks is not None
    assert "wait_for_release_forever" in root.stacks and "blocking_step" in root.stacks
    assert "wait_for_release_forever" in str(err)
    assert "device cpu:1" in str(err).splitlines()[0] and "hung" in str(err).splitlines()[0]


class BlockInBackward(torch.autograd.Function):
    """Identity forward; its backward waits for ``release`` on device cpu:1's thread."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, release: threading.Event) -> torch.Tensor:
        ctx.release = release
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        if threading.current_thread().name.endswith("cpu:1"):
            wait_for_release_forever(ctx.release)
        return grad, None


def backward_blocking_step(release: threading.Event, model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(BlockInBackward.apply(model(x), release), y)


@pytest.mark.timeout(30)
def test_a_hang_in_backward_is_named_in_backward() -> None:
    release = threading.Event()
    try:
        with pytest.raises(px.TrainingFailed) as info:
            learner(step=partial(backward_blocking_step, release)).fit(
                DATA, devices=TWO, strategy="threads", batch_size=45, sinks=[],
                hang_timeout=timedelta(seconds=2),
            )  # fmt: skip
    finally:
        release.set()
    root = info.value.root_cause
    assert (root.kind, root.device, root.phase) == ("hang", "cpu:1", "backward")
    assert root.stacks is not None and "wait_for_release_forever" in root.stacks


SCRIPT = textwrap.dedent(
    """
    import threading, time
    from datetime import timedelta
    import phalanx as px
    from test_threads import DATA, learner, mse_step

    def step(model, batch):
        if threading.current_thread().name.endswith("cpu:1"):
            threading.Event().wait()  # never released
        return mse_step(model, batch)

    try:
        learner(step=step).fit(DATA, devices="cpu:0,cpu:1", strategy="threads",
                               batch_size=45, sinks=[], hang_timeout=timedelta(seconds=1))
    except px.TrainingFailed as err:
        print("FAILED", err.root_cause.kind, flush=True)
    """
)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_abandoned_hung_thread_does_not_block_process_exit() -> None:
    tests = __file__.rsplit("/", 1)[0]
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=tests, capture_output=True, text=True, timeout=45
    )
    assert proc.returncode == 0, proc.stderr
    assert "FAILED hang" in proc.stdout


@pytest.mark.timeout(60)
def test_resume_matches_an_uninterrupted_run(tmp_path: Any) -> None:
    fit: dict[str, Any] = dict(batch_size=45, seed=3, sinks=[], devices=THREE, strategy="threads")
    straight = learner().fit(DATA, epochs=3, **fit)
    learner().fit(DATA, epochs=2, run_dir=str(tmp_path), **fit)
    resumed = learner().fit(DATA, epochs=3, run_dir=str(tmp_path), resume=True, **fit)
    assert resumed.steps == straight.steps == 33
    assert rel_diff(params(resumed.model), params(straight.model)) <= 1e-6


@pytest.mark.timeout(30)
def test_threads_are_released_after_fit() -> None:
    before = {t.name for t in threading.enumerate()}
    learner().fit(DATA, devices=TWO, strategy="threads", batch_size=245, sinks=[])
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        left = {t.name for t in threading.enumerate() if t.name.startswith("phalanx-threads")}
        if not left - before:
            break
        time.sleep(0.05)
    assert not left - before


# -- hang_timeout bounds a replica's silence, not a whole attempt or validation pass ----------

PROGRESS_TIMEOUT = timedelta(seconds=1)
PAUSE_S = 0.3  # each forward of the slow part: under hang_timeout, five of them well over it


def pausing_step(when_training: bool, model: nn.Module, batch: Any) -> torch.Tensor:
    """Sleeps ``PAUSE_S`` in each forward while training (``when_training``) or in each
    validation batch (otherwise)."""
    if model.training == when_training:
        time.sleep(PAUSE_S)
    return mse_step(model, batch)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("slow", ["grad_accumulation", "validation"])
def test_long_work_that_makes_progress_is_not_a_hang(slow: str) -> None:
    """Five micro-batches of a step, or five validation batches, each a third of
    hang_timeout: each replica enters a phase every 0.3 s, so neither the attempt nor the
    validation pass (1.5 s a replica) is a hang."""
    training = slow == "grad_accumulation"
    data, valid = make_data(40), make_data(100, seed=1) if not training else None
    fit: dict[str, Any] = dict(batch_size=20, epochs=1, seed=3, sinks=[])
    result = px.Learner(
        mlp, sgd, partial(pausing_step, training), grad_accumulation=5 if training else 1
    ).fit(data, valid, devices=TWO, strategy="threads", hang_timeout=PROGRESS_TIMEOUT, **fit)
    assert result.steps == 2
    assert result.failures == []
    assert ("valid/loss" in result.history[-1]) == (not training)


@pytest.mark.timeout(60)
def test_an_injected_hang_is_still_named_within_hang_timeout() -> None:
    times: dict[int, float] = {}

    class Ended:
        def handle(self, event: Event) -> None:
            if isinstance(event, StepEnded):
                times[event.global_step] = time.time()

        def close(self) -> None:
            pass

    with pytest.raises(px.TrainingFailed) as info:
        learner().fit(
            DATA, devices=TWO, strategy="threads", batch_size=45, sinks=[Ended()],
            faults=[px.Fault("hang", worker=1, step=3, phase="backward")],
            hang_timeout=PROGRESS_TIMEOUT,
        )  # fmt: skip
    decided = time.time()
    root = info.value.root_cause
    assert (root.kind, root.device, root.step, root.phase) == ("hang", "cpu:1", 3, "backward")
    assert info.value.code == "PX202"
    assert "no progress for" in root.message and "in phase backward" in root.message
    assert root.stacks is not None and "in fire" in root.stacks
    assert max(times) == 3  # steps 0-2 committed; the fault fired at the start of step 3
    assert decided - times[3] < PROGRESS_TIMEOUT.total_seconds() + 5.0
