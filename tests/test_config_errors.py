"""Configuration errors: each is a ConfigError with a stable code and a message that names the
fix, raised in the caller's process before any step runs. Plus early stopping."""

from __future__ import annotations

import math
import multiprocessing
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import phalanx as px
from phalanx.catalog import lookup
from phalanx.devices import check_free_memory
from phalanx.errors import (
    BatchSizeError,
    BatchSmallerThanWorkersError,
    ConfigError,
    DataLoaderAsDatasetError,
    DatasetNotPicklableError,
    DeviceBusyError,
    DeviceSpecError,
    DeviceUnavailableError,
    DuplicateDeviceError,
    EmptyDatasetError,
    EpochTooShortError,
    InvalidSettingError,
    MixedDeviceTypesError,
    NoDevicesError,
    NotPicklableError,
    RunDirInUseError,
    UnknownStrategyError,
    UnsizedDatasetError,
)
from phalanx.events import Notice, StepEnded, ValidationStarted
from phalanx.plan import Plan
from phalanx.strategies.ddp.agent.agent import START_METHOD
from recorder import Recorder

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


def learner(step: Callable[[nn.Module, Any], Any] = train_step) -> px.Learner:
    return px.Learner(make_model, make_optimizer, step)


class Stream(torch.utils.data.IterableDataset[Any]):
    """A stream: samples one after another, no len(), no indexing."""

    def __iter__(self) -> Any:
        return iter(dataset())


class LockedDataset(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """A module-level dataset holding a lock (as one holding an open file or a connection
    would): it cannot be pickled, so no ddp worker could get a copy."""

    def __init__(self, n: int = N) -> None:
        self.data = dataset(n)
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[i]


def local_class_dataset() -> torch.utils.data.Dataset[Any]:
    """A dataset whose class is defined inside a function: pickle cannot name it."""

    class Local(torch.utils.data.Dataset[Any]):
        def __len__(self) -> int:
            return N

        def __getitem__(self, i: int) -> Any:
            return torch.zeros(4), 0

    return Local()


@pytest.fixture
def process_starts(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The names of the processes fit() tried to start (through the context ddp starts
    workers in); a start is refused, so a check that comes too late fails the test at once."""
    started: list[str] = []
    before = multiprocessing.active_children()

    def start(self: Any) -> None:
        started.append(self.name)
        raise RuntimeError(f"process {self.name} started before the configuration error")

    monkeypatch.setattr(multiprocessing.get_context(START_METHOD).Process, "start", start)
    yield started
    assert multiprocessing.active_children() == before


@pytest.fixture
def two_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch sees two CUDA devices, whatever this machine has: the device checks before
    launch only ask torch.cuda.is_available() and torch.cuda.device_count()."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


# --- ConfigErrors before anything starts -------------------------------------------------


CASES: list[tuple[str, type[ConfigError], str, dict[str, Any], str]] = [
    # id, class, code, fit() arguments, pattern the message must contain (the fix)
    ("empty", EmptyDatasetError, "PX101", {"train": dataset(0)}, r"dataset is empty"),
    ("batch0", BatchSizeError, "PX102", {"batch_size": 0}, r"batch_size=0; it must be >= 1"),
    ("batch-neg", BatchSizeError, "PX102", {"batch_size": -3}, r"it must be >= 1"),
    ("strategy", UnknownStrategyError, "PX103", {"strategy": "magic"}, r"use one of single"),
    ("gpu:x", DeviceSpecError, "PX104", {"devices": "gpu:x"}, r"write e\.g\. cpu, cpu:1, cuda:0"),
    ("meta", DeviceSpecError, "PX104", {"devices": "meta"}, r"use one of cpu, cuda, mps, xpu"),
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
    (
        "dataloader",
        DataLoaderAsDatasetError,
        "PX127",
        {"train": DataLoader(dataset(), batch_size=16, shuffle=True)},
        r"training dataset is a torch DataLoader.*pass loader\.dataset and batch_size=16",
    ),
    (
        "valid-dataloader",
        DataLoaderAsDatasetError,
        "PX127",
        {"valid": DataLoader(dataset(8), batch_size=4)},
        r"validation dataset is a torch DataLoader.*loader\.dataset and batch_size=4",
    ),
    (
        "iterable",
        UnsizedDatasetError,
        "PX128",
        {"train": Stream()},
        r"an IterableDataset.*cannot plan it exactly once per epoch.*px\.Stream\(shards, "
        r"read\).*map-style torch Dataset",
    ),
    (
        "generator",
        UnsizedDatasetError,
        "PX128",
        {"train": (dataset()[i] for i in range(N))},
        r"a generator, without __len__ and __getitem__.*map-style",
    ),
    (
        "collate-not-callable",
        InvalidSettingError,
        "PX108",
        {"collate_fn": "pad"},
        r"collate_fn='pad' is not callable",
    ),
    ("max-steps-0", InvalidSettingError, "PX108", {"max_steps": 0}, r"max_steps=0; pass a whole"),
    (
        "val-every-steps-without-valid",
        InvalidSettingError,
        "PX108",
        {"val_every_steps": 2},
        r"val_every_steps=2 needs a validation set: pass valid=",
    ),
]
# The same mistakes under ddp (where a late check would start worker processes), except
# those about the strategy itself; and the ddp-only ones.
DDP = {"strategy": "ddp"}
DDP_CASES = [
    (f"ddp-{name}", cls, code, {**DDP, **kwargs}, fix)
    for name, cls, code, kwargs, fix in CASES
    if name not in ("strategy", "single-two-devices")
] + [
    (
        "ddp-batch-smaller-than-devices",
        BatchSmallerThanWorkersError,
        "PX113",
        {**DDP, "devices": "cpu:0,cpu:1,cpu:2", "batch_size": 2},
        r"GLOBAL batch: raise it to at least 3",
    ),
    (
        "ddp-preflight-fault-without-preflight",
        InvalidSettingError,
        "PX108",
        {
            **DDP,
            "devices": "cpu:0,cpu:1",
            "preflight": False,
            "faults": [px.Fault("kill", worker=1, step=0, phase="preflight")],
        },
        r'preflight fault needs strategy="ddp" or "fsdp", and preflight=True',
    ),
    (
        "ddp-node-timeout-within-a-keep-alive",
        InvalidSettingError,
        "PX108",
        {**DDP, "devices": "cpu:0,cpu:1", "node_timeout": 1.5},
        r"node_timeout must be more than 2 seconds \(each node says something every second",
    ),
    (
        "ddp-train-not-picklable",
        DatasetNotPicklableError,
        "PX119",
        {**DDP, "devices": "cpu:0,cpu:1", "train": LockedDataset()},
        r"the training dataset \(LockedDataset\) cannot be pickled .*_thread\.lock.*"
        r"Define the Dataset class at module level, keep tensors",
    ),
    (
        "ddp-valid-not-picklable",
        DatasetNotPicklableError,
        "PX119",
        {**DDP, "devices": "cpu:0,cpu:1", "valid": LockedDataset(8)},
        r"the validation dataset \(LockedDataset\) cannot be pickled",
    ),
    (
        "ddp-collate-lambda",
        NotPicklableError,
        "PX114",
        {**DDP, "devices": "cpu:0,cpu:1", "collate_fn": lambda samples: samples},
        r"the collate_fn argument \(<lambda>\) cannot be pickled.*module-level function",
    ),
    (
        "ddp-dataset-class-in-a-function",
        DatasetNotPicklableError,
        "PX119",
        {**DDP, "train": local_class_dataset()},
        r"\(local_class_dataset\.<locals>\.Local\) cannot be pickled.*Can't pickle local "
        r"object.*module level",
    ),
]
ALL_CASES = CASES + DDP_CASES


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("cls", "code", "kwargs", "fix"), [c[1:] for c in ALL_CASES], ids=[c[0] for c in ALL_CASES]
)
def test_config_error_before_anything_starts(
    cls: type[ConfigError],
    code: str,
    kwargs: dict[str, Any],
    fix: str,
    process_starts: list[str],
) -> None:
    args = {"batch_size": 8, "sinks": [], **kwargs}
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
    assert process_starts == []  # raised before any worker process was started


def test_the_ddp_dataset_check_does_not_copy_tensors_or_arrays(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The check pickles like spawn but skips tensors and numeric arrays (they always
    pickle): 64 MiB of each cost a few bytes, not a copy, and the tensors are not moved to
    shared memory by the check (as spawn's own pickling would do)."""
    from phalanx import validate

    written: list[int] = []

    def write(self: Any, data: bytes) -> int:
        written.append(len(data))
        return len(data)

    monkeypatch.setattr(validate._Discard, "write", write)
    tensors = TensorDataset(torch.zeros(2**22, 4))  # 64 MiB of float32
    arrays = [np.zeros((2**20, 8))]  # 64 MiB of float64 (anything with a len() passes here)
    validate._validate_datasets_picklable({"training": tensors, "validation": arrays})
    assert 0 < sum(written) < 2**16
    assert not tensors.tensors[0].is_shared()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("devices", ["cpu:0,cuda:0", "cuda:1,cpu:0,cuda:0"])
def test_ddp_refuses_cuda_mixed_with_cpu(
    devices: str, two_gpus: None, process_starts: list[str]
) -> None:
    with pytest.raises(MixedDeviceTypesError) as info:
        learner().fit(dataset(), batch_size=8, devices=devices, strategy="ddp", sinks=[])
    err = info.value
    assert err.code == "PX123"
    assert "would join the group over NCCL" in err.message
    cuda = ",".join(d for d in devices.split(",") if d.startswith("cuda"))
    assert f'list only CUDA devices (devices="{cuda}") or only CPU workers' in err.message
    assert lookup("PX123").fixes
    assert process_starts == []


GiB = 2**30


@pytest.mark.timeout(30)
def test_a_busy_gpu_is_named_before_launch(
    two_gpus: None, monkeypatch: pytest.MonkeyPatch, process_starts: list[str]
) -> None:
    """min_free_memory: a CUDA device with less free memory is named (PX117) with the fix,
    before any worker starts; every device in the list is asked."""
    asked: list[int | None] = []

    def mem_get_info(device: Any = None) -> tuple[int, int]:
        index = torch.device(device).index
        asked.append(index)
        return (30 * GiB if index == 0 else 2 * GiB), 80 * GiB

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    with pytest.raises(DeviceBusyError) as info:
        learner().fit(
            dataset(), batch_size=8, devices="cuda:0,cuda:1", strategy="ddp", sinks=[],
            min_free_memory=10 * GiB,
        )  # fmt: skip
    err = info.value
    assert err.code == "PX117"
    assert "device cuda:1 has 2.0 GiB free of 80.0 GiB" in err.message
    assert "less than min_free_memory=10.0 GiB" in err.message
    assert "nvidia-smi" in err.message and "pick another device or free it" in err.message
    assert "cuda:0" not in err.message  # the device with room is not blamed
    assert asked == [0, 1]
    assert process_starts == []


def test_enough_free_memory_passes_and_cpu_devices_are_not_asked(
    two_gpus: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[int | None] = []

    def mem_get_info(device: Any = None) -> tuple[int, int]:
        asked.append(torch.device(device).index)
        return 30 * GiB, 80 * GiB

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    check_free_memory(["cuda:0", "cpu:1", "cuda:1"], 10 * GiB)  # raises nothing
    assert asked == [0, 1]
    check_free_memory(["cuda:0", "cuda:1"], None)  # min_free_memory not set: nothing asked
    check_free_memory(["cuda:0", "cuda:1"], 0)
    assert asked == [0, 1]


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
    class Sized:  # a len() but no indexing
        def __len__(self) -> int:
            return N

    with pytest.raises(UnsizedDatasetError, match=r"a .*Sized, without __len__ and __getitem__"):
        learner().fit(Sized(), sinks=[])


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
    assert f"the loss is nan at step 1 on samples [{samples}]" in first_line  # 1-based
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


@pytest.mark.parametrize(
    ("keep_best", "with_valid"),
    [("valid/acurracy", True), ("valid/accuracy", False), ("accuracy", True)],
    ids=["typo", "valid key without valid=", "no prefix"],
)
def test_keep_best_on_an_unknown_key_is_raised_before_training(
    tmp_path: Path, keep_best: str, with_valid: bool
) -> None:
    """Checkpoints(keep_best=...) is checked like EarlyStopping's metric: same class and
    code, the known keys in the message, before any step or checkpoint."""
    rec = Recorder()
    lrn = px.Learner(make_model, make_optimizer, classify_step, metrics=[px.metrics.Accuracy()])
    with pytest.raises(InvalidSettingError) as info:
        lrn.fit(
            dataset(),
            dataset(16) if with_valid else None,
            batch_size=8,
            run_dir=str(tmp_path / "run"),
            checkpoint=px.Checkpoints(every_steps=1, keep_best=keep_best),
            sinks=[rec],
        )
    err = info.value
    assert err.code == "PX108"
    assert f"keep_best {keep_best!r} is not in the epoch results" in err.message
    known = "train/accuracy, train/loss, train/lr"
    if with_valid:
        known += ", valid/accuracy, valid/loss"
    assert f"epoch results ({known})" in err.message  # the known keys
    assert "add valid= to fit()" in err.message
    assert not rec.events
    assert not (tmp_path / "run").exists()


def test_keep_best_on_a_known_key_trains() -> None:
    lrn = px.Learner(make_model, make_optimizer, classify_step, metrics=[px.metrics.Accuracy()])
    result = lrn.fit(
        dataset(),
        dataset(16),
        batch_size=8,
        checkpoint=px.Checkpoints(keep_best="valid/accuracy"),
        sinks=[],
    )
    assert result.steps == N // 8


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
    ((name, value),) = kwargs.items()
    assert info.value.message.startswith(f"EarlyStopping({name}={value!r}):")  # the wrong one


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
    """lr=0: the validation loss never improves, so with patience 2 the run stops after 3
    of 10 epochs (epoch 0 sets the best, epochs 1 and 2 use up the patience), with a Notice,
    not as an interruption."""
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
