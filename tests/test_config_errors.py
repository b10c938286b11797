"""Configuration errors: each is a ConfigError with a stable code and a message that names the
fix, raised in the caller's process before any step runs. Plus early stopping."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import phalanx as px
from phalanx.catalog import lookup
from phalanx.errors import (
    BatchSizeError,
    ConfigError,
    DeviceSpecError,
    DeviceUnavailableError,
    DuplicateDeviceError,
    EmptyDatasetError,
    EpochTooShortError,
    InvalidSettingError,
    NoDevicesError,
    RunDirInUseError,
    UnknownStrategyError,
)
from phalanx.events import Event, Notice, StepEnded, ValidationStarted
from phalanx.plan import Plan

N = 40


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def make_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def frozen_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.0)


def train_step(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def classify_step(model: nn.Module, batch: Any) -> px.StepOutput:
    x, y = batch
    logits = model(x)
    return px.StepOutput(nn.functional.cross_entropy(logits, y), logits, y)


def per_sample_loss_step(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y, reduction="none")  # forgot .mean()


def nan_step(model: nn.Module, batch: Any) -> torch.Tensor:
    return train_step(model, batch) * float("nan")


def dataset(n: int = N) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g))


class Recorder:
    def __init__(self) -> None:
        self.events: list[Event] = []

    def handle(self, event: Event) -> None:
        self.events.append(event)

    def close(self) -> None:
        pass


def learner(step: Callable[[nn.Module, Any], Any] = train_step) -> px.Learner:
    return px.Learner(make_model, make_optimizer, step)


# --- ConfigErrors before anything starts -------------------------------------------------


CASES: list[tuple[str, type[ConfigError], str, dict[str, Any], str]] = [
    # id, class, code, fit() arguments, pattern the message must contain (the fix)
    ("empty", EmptyDatasetError, "PX101", {"train": dataset(0)}, r"dataset is empty"),
    ("batch0", BatchSizeError, "PX102", {"batch_size": 0}, r"batch_size=0; it must be >= 1"),
    ("batch-neg", BatchSizeError, "PX102", {"batch_size": -3}, r"it must be >= 1"),
    ("strategy", UnknownStrategyError, "PX103", {"strategy": "magic"}, r"use one of single"),
    ("gpu:x", DeviceSpecError, "PX104", {"devices": "gpu:x"}, r"write e\.g\. cpu, cpu:1, cuda:0"),
    (
        "too-small",
        EpochTooShortError,
        "PX105",
        {"batch_size": N + 1},
        rf"lower batch_size to at most {N}",
    ),
    ("no-devices", NoDevicesError, "PX110", {"devices": ""}, r'pass devices="cpu"'),
    (
        "duplicate",
        DuplicateDeviceError,
        "PX111",
        {"devices": "cpu:0,cpu:0"},
        r'listed twice.*list each device once.*"cpu:0,cpu:1"',
    ),
    (
        "single-two-devices",
        InvalidSettingError,
        "PX108",
        {"devices": "cpu:0,cpu:1"},
        r'strategy="single" runs on one device but 2 were given.*use strategy="ddp"',
    ),
    (
        "fault-worker",
        InvalidSettingError,
        "PX108",
        {"faults": [px.Fault("exception", worker=3, step=1)]},
        r"targets worker 3 but there are only 1 devices \(workers 0\.\.0\)",
    ),
    (
        "epochs0",
        InvalidSettingError,
        "PX108",
        {"epochs": 0},
        r"pass epochs >= 1",
    ),
]


@pytest.mark.parametrize(
    ("cls", "code", "kwargs", "fix"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_config_error_before_anything_starts(
    cls: type[ConfigError], code: str, kwargs: dict[str, Any], fix: str
) -> None:
    rec = Recorder()
    args = {"batch_size": 8, "sinks": [rec], **kwargs}
    train = args.pop("train", dataset())
    with pytest.raises(cls) as info:
        learner().fit(train, **args)
    err = info.value
    assert isinstance(err, ConfigError) and isinstance(err, ValueError)
    assert err.code == code
    assert re.search(fix, err.message), err.message
    text = str(err)
    assert text.startswith(f"[{code}] ")
    assert f"phalanx explain {code}" in text
    assert lookup(code).fixes  # `phalanx explain` has something to say
    assert rec.events == []  # raised before any event, step, thread or process


@pytest.mark.skipif(torch.cuda.device_count() > 7, reason="this machine has a cuda:7")
def test_missing_cuda_device() -> None:
    with pytest.raises(DeviceUnavailableError) as info:
        learner().fit(dataset(), devices="cuda:7", sinks=[])
    err = info.value
    assert err.code == "PX112"
    if torch.cuda.is_available():
        assert "does not exist" in err.message
        assert "CUDA_VISIBLE_DEVICES" in err.message
    else:
        assert "CUDA is not available" in err.message
        assert 'use devices="cpu"' in err.message


def test_dataset_without_len() -> None:
    class Stream(torch.utils.data.IterableDataset[Any]):
        def __iter__(self) -> Any:
            return iter([])

    with pytest.raises(InvalidSettingError, match="map-style torch Dataset"):
        learner().fit(Stream(), sinks=[])


def test_a_fresh_run_among_old_checkpoints_is_refused_and_touches_nothing(tmp_path: Any) -> None:
    run_dir = tmp_path / "run"
    first = learner().fit(dataset(), batch_size=8, epochs=2, run_dir=str(run_dir), sinks=[])
    folder = run_dir / "checkpoints"
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    assert any(name.startswith("ckpt-") for name in before)
    events = Recorder()
    with pytest.raises(RunDirInUseError) as info:
        learner().fit(dataset(), batch_size=8, epochs=3, run_dir=str(run_dir), sinks=[events])
    err = info.value
    assert err.code == "PX118"
    assert "resume=True" in err.message and "new run_dir" in err.message
    assert f"step {first.steps}" in err.message
    assert events.events == []  # nothing started
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    # Resuming is what the message says to do, and it continues the earlier run.
    resumed = learner().fit(
        dataset(), batch_size=8, epochs=3, run_dir=str(run_dir), resume=True, sinks=[]
    )
    assert resumed.steps == first.steps * 3 // 2


def test_validation_announces_its_global_batch_count() -> None:
    events = Recorder()
    learner().fit(dataset(), valid=dataset(10), batch_size=4, epochs=2, sinks=[events])
    started = [e for e in events.events if isinstance(e, ValidationStarted)]
    assert [(e.epoch, e.batches) for e in started] == [(0, 3), (1, 3)]  # 10 samples, 4 a batch


# --- errors that show up in a step -------------------------------------------------------


def test_non_scalar_loss_names_the_fix() -> None:
    """A per-sample loss is LossNotScalarError (PX106) raised inside the step: the user sees
    an InvalidStepError (a TrainingFailed and a ConfigError) whose root cause is that error
    and whose first line says .mean(). No retry: it would compute the same."""
    with pytest.raises(px.ConfigError) as info:
        learner(per_sample_loss_step).fit(dataset(), batch_size=8, sinks=[])
    err = info.value
    assert isinstance(err, px.InvalidStepError) and isinstance(err, px.TrainingFailed)
    root = err.root_cause
    assert root.exception_type == "LossNotScalarError"
    assert "[PX106]" in root.message
    assert root.step == 0 and root.phase == "forward"
    first_line = str(err).splitlines()[0]
    assert "LossNotScalarError" in first_line
    assert "shape (8,)" in first_line
    assert "loss.mean()" in first_line
    # a phalanx error raised inside the step keeps its own code (not "poison batch")
    assert err.code == "PX106"
    assert [f.action for f in err.failures] == ["aborted"]
    assert "poison batch" not in str(err)


def test_nan_loss_names_step_and_samples() -> None:
    with pytest.raises(px.InvalidStepError) as info:
        learner(nan_step).fit(dataset(), batch_size=8, seed=5, sinks=[])
    err = info.value
    assert len(err.failures) == 1
    root = err.root_cause
    assert root.exception_type == "NonFiniteLossError"
    assert "[PX107]" in root.message
    plan_first_batch = Plan(N, 8, 5).global_batch(0, 0)
    assert root.step == 0
    assert root.sample_indices == plan_first_batch
    samples = ", ".join(str(i) for i in plan_first_batch)
    first_line = str(err).splitlines()[0]
    assert f"the loss is nan at step 0 on samples [{samples}]" in first_line
    assert "lower the learning rate" in first_line and "grad_clip_norm" in first_line
    assert err.code == "PX107"


def test_step_returning_a_wrong_type_names_the_fix() -> None:
    def bad_step(model: nn.Module, batch: Any) -> Any:
        return {"loss": train_step(model, batch)}

    with pytest.raises(px.InvalidStepError) as info:
        learner(bad_step).fit(dataset(), batch_size=8, sinks=[])
    assert info.value.code == "PX109" and len(info.value.failures) == 1
    root = info.value.root_cause
    assert root.exception_type == "StepOutputError"
    assert "[PX109]" in root.message
    assert "px.StepOutput(loss=" in root.message


# --- early stopping: settings and the rule -----------------------------------------------


def test_early_stopping_on_an_unknown_metric_is_raised_before_training() -> None:
    rec = Recorder()
    with pytest.raises(InvalidSettingError) as info:
        learner().fit(
            dataset(),
            dataset(16),
            batch_size=8,
            epochs=2,
            early_stopping=px.EarlyStopping("valid/acc"),
            sinks=[rec],
        )
    err = info.value
    assert err.code == "PX108"
    assert "'valid/acc'" in err.message
    assert "valid/loss" in err.message  # names what it could be
    steps = [e for e in rec.events if isinstance(e, StepEnded)]
    assert steps == [], f"raised only after {len(steps)} training steps"


def test_early_stopping_on_a_valid_metric_without_valid_names_the_fix() -> None:
    es = px.EarlyStopping("valid/loss")
    with pytest.raises(InvalidSettingError, match=r"add valid= to fit\(\)") as info:
        es.update(0, {"train/loss": 1.0, "train/lr": 0.1})
    assert info.value.code == "PX108"
    assert "train/loss" in info.value.message


@pytest.mark.parametrize("kwargs", [{"patience": 0}, {"min_delta": -0.1}, {"warmup": -1}], ids=str)
def test_early_stopping_settings(kwargs: dict[str, Any]) -> None:
    with pytest.raises(InvalidSettingError, match="patience >= 1, min_delta >= 0") as info:
        px.EarlyStopping(**kwargs)
    assert info.value.code == "PX108"


@pytest.mark.parametrize(
    ("metric", "mode", "expected"),
    [
        ("valid/loss", None, "min"),
        ("train/Loss", None, "min"),
        ("valid/top1_error", None, "min"),
        ("valid/accuracy", None, "max"),
        ("valid/f1", None, "max"),
        ("valid/loss", "max", "max"),
        ("valid/accuracy", "min", "min"),
    ],
)
def test_early_stopping_mode_inference(metric: str, mode: Any, expected: str) -> None:
    assert px.EarlyStopping(metric, mode=mode).direction() == expected


def run_rule(es: px.EarlyStopping, values: list[float]) -> int | None:
    """The epoch at which ``es`` says stop, or None."""
    for epoch, v in enumerate(values):
        reason = es.update(epoch, {es.metric: v})
        if reason is not None:
            return epoch
    return None


def test_patience_counts_epochs_without_improvement() -> None:
    es = px.EarlyStopping("valid/loss", patience=2)
    assert run_rule(es, [1.0, 0.9, 0.95, 0.91, 0.5]) == 3
    assert es.best == 0.9
    assert es.bad_epochs == 2


def test_improvement_resets_patience() -> None:
    es = px.EarlyStopping("valid/loss", patience=2)
    assert run_rule(es, [1.0, 1.1, 0.9, 1.0, 0.8, 0.85, 0.7]) is None
    assert es.best == 0.7 and es.bad_epochs == 0


def test_stop_reason_text() -> None:
    es = px.EarlyStopping("valid/loss", patience=1)
    assert es.update(0, {"valid/loss": 0.5}) is None
    reason = es.update(1, {"valid/loss": 0.5})
    assert reason == "early stopping: valid/loss did not improve for 1 epochs (best 0.5)"


def test_min_delta_improvement_must_exceed_it() -> None:
    es = px.EarlyStopping("valid/loss", patience=2, min_delta=0.1)
    # 1.0 -> 0.95 (-0.05) and -> 0.9 (-0.1, not more than min_delta) are not improvements
    assert run_rule(es, [1.0, 0.95, 0.9]) == 2
    es = px.EarlyStopping("valid/loss", patience=2, min_delta=0.1)
    assert run_rule(es, [1.0, 0.85, 0.7, 0.55]) is None
    assert es.best == 0.55


def test_max_mode() -> None:
    es = px.EarlyStopping("valid/accuracy", patience=2)
    assert run_rule(es, [0.5, 0.6, 0.6, 0.59]) == 3
    assert es.best == 0.6
    es = px.EarlyStopping("valid/accuracy", patience=1, min_delta=0.05)
    assert run_rule(es, [0.5, 0.56, 0.6]) == 2


def test_warmup_epochs_are_not_judged() -> None:
    es = px.EarlyStopping("valid/loss", patience=1, warmup=3)
    # epochs 0..2 are ignored, even though they are better than what follows
    assert es.update(0, {"valid/loss": 0.1}) is None
    assert es.update(1, {"valid/loss": 0.2}) is None
    assert es.update(2, {"valid/loss": 0.3}) is None
    assert es.best is None and es.bad_epochs == 0
    assert es.update(3, {"valid/loss": 1.0}) is None
    assert es.best == 1.0
    assert es.update(4, {"valid/loss": 1.0}) is not None


def test_nan_is_not_judged() -> None:
    es = px.EarlyStopping("valid/loss", patience=1)
    assert es.update(0, {"valid/loss": 1.0}) is None
    assert es.update(1, {"valid/loss": math.nan}) is None
    assert es.best == 1.0 and es.bad_epochs == 0


def test_state_dict_round_trip() -> None:
    es = px.EarlyStopping("valid/loss", patience=3)
    run_rule(es, [1.0, 0.5, 0.7])
    other = px.EarlyStopping("valid/loss", patience=3)
    other.load_state_dict(es.state_dict())
    assert (other.best, other.bad_epochs) == (0.5, 1)


# --- early stopping end to end -----------------------------------------------------------


def test_early_stop_end_to_end() -> None:
    """lr=0: the validation loss never improves, so with patience 2 the run stops after
    epoch 2 of 10, with a Notice, not as an interruption."""
    es = px.EarlyStopping("valid/loss", patience=2)
    rec = Recorder()
    lrn = px.Learner(make_model, frozen_optimizer, classify_step, metrics=[px.metrics.Accuracy()])
    result = lrn.fit(
        dataset(), dataset(16), epochs=10, batch_size=8, early_stopping=es, sinks=[rec]
    )
    assert len(result.history) == 3 < 10
    assert result.epochs == 3
    assert result.steps == 3 * (N // 8)
    assert result.interrupted is None
    notices = [e for e in rec.events if isinstance(e, Notice)]
    assert len(notices) == 1
    assert notices[0].text.startswith("early stopping: valid/loss did not improve for 2 epochs")
    losses = [h["valid/loss"] for h in result.history]
    assert losses[0] == losses[1] == losses[2]
    # the caller's EarlyStopping object is a template: the run works on a copy
    assert es.best is None and es.bad_epochs == 0


def test_early_stop_on_an_improving_metric_runs_every_epoch() -> None:
    es = px.EarlyStopping("train/loss", patience=1)
    rec = Recorder()
    result = learner().fit(dataset(), epochs=4, batch_size=8, early_stopping=es, sinks=[rec])
    assert len(result.history) == 4
    assert not [e for e in rec.events if isinstance(e, Notice)]
