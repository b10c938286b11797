"""Failures at the edges of a step: a sample that cannot be read once, a metric that raises
after the synchronised backward, an optimizer failure on a model with buffers, and the root
cause when an earlier failure was recovered. Each injects the failure for real."""

from __future__ import annotations

import pytest
import torch

import phalanx as px
from ddp_helpers import (
    FlakyData,
    bn_mlp,
    decay,
    make_data,
    mlp,
    mse_step,
    sgd,
    sgd_decaying,
    sgd_unsavable,
)

N, BATCH = 64, 8


def params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.timeout(60)
def test_a_sample_that_fails_once_is_read_again_on_retry() -> None:
    """The retry of a step whose data failed loads the same slice, not the next one."""
    clean = px.Learner(mlp, sgd, mse_step).fit(
        make_data(N), batch_size=BATCH, shuffle=False, sinks=[]
    )
    flaky = FlakyData(N, bad=8, failures=1)  # the first sample of step 1
    result = px.Learner(mlp, sgd, mse_step).fit(flaky, batch_size=BATCH, shuffle=False, sinks=[])
    assert [(f.phase, f.step, f.action) for f in result.failures] == [("data", 1, "retried")]
    assert sorted(flaky.served) == list(range(N))  # every sample served exactly once
    assert result.ledger_ok
    for a, b in zip(params(result.model), params(clean.model), strict=True):
        assert torch.equal(a, b)


class RaisingMetric(px.metrics.Metric):
    """Raises in ``state`` on one worker at one step: after that step's backward."""

    name = "fragile"

    def __init__(self) -> None:
        self.calls = 0

    def size(self) -> int:
        return 1

    def state(self, output: px.StepOutput, samples: int) -> torch.Tensor:
        self.calls += 1
        return torch.tensor([float(samples)], dtype=torch.float64)

    def compute(self, state: torch.Tensor) -> float:
        return float(state[0])


@pytest.mark.timeout(120)
def test_metrics_phase_failure_under_ddp_is_retried_not_a_collective_mismatch() -> None:
    """A failure after the synchronised backward must not run a second one (the zero pass):
    the peers would all-reduce a different number of times."""
    fault = px.Fault("exception", worker=1, step=1, phase="metrics")
    clean = px.Learner(mlp, sgd, mse_step, metrics=[RaisingMetric()]).fit(
        make_data(N),
        batch_size=BATCH,
        strategy="ddp",
        devices="cpu:0,cpu:1",
        sinks=[],
        on_failure=px.Recovery(mode="abort"),
    )
    result = px.Learner(mlp, sgd, mse_step, metrics=[RaisingMetric()]).fit(
        make_data(N),
        batch_size=BATCH,
        strategy="ddp",
        devices="cpu:0,cpu:1",
        sinks=[],
        faults=[fault],
        on_failure=px.Recovery(mode="abort"),
    )
    assert [(f.worker, f.phase, f.action) for f in result.failures] == [(1, "metrics", "retried")]
    assert result.ledger_ok
    for a, b in zip(params(result.model), params(clean.model), strict=True):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.timeout(120)
def test_optimizer_failure_on_a_model_with_buffers_applies_no_step_twice() -> None:
    """Worker 1's optimizer fails at step 1 (fatal for it): worker 0 must not have stepped
    its optimizer and scheduler for a step the shrunk group then computes again."""
    fault = px.Fault("exception", worker=1, step=1, phase="optimizer")
    fit = dict(batch_size=BATCH, strategy="ddp", devices="cpu:0,cpu:1", sinks=[], epochs=1)
    learner = px.Learner(bn_mlp, sgd_decaying, mse_step, lr_scheduler=decay)
    clean = learner.fit(make_data(32), **fit)
    result = px.Learner(bn_mlp, sgd_decaying, mse_step, lr_scheduler=decay).fit(
        make_data(32), faults=[fault], on_failure=px.Recovery(mode="shrink"), **fit
    )
    assert [(f.worker, f.phase, f.action) for f in result.failures] == [(1, "optimizer", "shrunk")]
    assert result.steps == clean.steps == 4
    assert result.history[-1]["train/lr"] == pytest.approx(clean.history[-1]["train/lr"])
    assert result.ledger_ok


@pytest.mark.timeout(60)
def test_root_cause_is_the_failure_that_ended_the_run_not_a_recovered_one() -> None:
    faults = [px.Fault("exception", worker=0, step=1), px.Fault("exception", 0, 3, "optimizer")]
    with pytest.raises(px.TrainingFailed) as info:
        px.Learner(mlp, sgd, mse_step).fit(make_data(N), batch_size=BATCH, faults=faults, sinks=[])
    err = info.value
    assert (err.root_cause.step, err.root_cause.phase) == (3, "optimizer")
    assert "failed at step 4 (optimizer)" in str(err).splitlines()[0]  # step 3, 1-based
    assert [f.action for f in err.failures] == ["retried", "aborted"]


@pytest.mark.timeout(60)
def test_a_checkpoint_that_cannot_be_written_fails_the_run_with_its_phase(tmp_path) -> None:
    with pytest.raises(px.TrainingFailed) as info:
        px.Learner(mlp, sgd_unsavable, mse_step).fit(
            make_data(N),
            batch_size=BATCH,
            sinks=[],
            run_dir=str(tmp_path),
            checkpoint=px.Checkpoints(every_steps=2),
        )
    err = info.value
    assert err.root_cause.phase == "checkpoint"
    assert err.root_cause.exception_type == "CheckpointError"
    assert err.code == "PX120"
    assert "(checkpoint)" in str(err).splitlines()[0]


@pytest.mark.timeout(120)
def test_ddp_checkpoint_failure_on_the_main_worker_stops_the_run_at_once(tmp_path) -> None:
    """Replacing the worker cannot fix a checkpoint that cannot be written: no respawn."""
    with pytest.raises(px.TrainingFailed) as info:
        px.Learner(mlp, sgd_unsavable, mse_step).fit(
            make_data(N),
            batch_size=BATCH,
            sinks=[],
            run_dir=str(tmp_path),
            strategy="ddp",
            devices="cpu:0,cpu:1",
            checkpoint=px.Checkpoints(every_steps=2),
        )
    err = info.value
    assert (err.root_cause.worker, err.root_cause.phase) == (0, "checkpoint")
    assert err.code == "PX120"
    assert [f.action for f in err.failures if f.phase == "checkpoint"] == ["aborted"]
