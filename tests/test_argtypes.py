"""A Learner or fit argument of the wrong type is named with PX125 before anything starts."""

from __future__ import annotations

import functools
import inspect
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import TensorDataset

import phalanx as px
from phalanx import argtypes


def _learner(**kwargs: Any) -> px.Learner:
    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    return px.Learner(torch.nn.Linear(3, 1), sgd, px.mse_step, **kwargs)


DATA = TensorDataset(torch.randn(16, 3), torch.randn(16, 1))


@pytest.mark.parametrize(
    ("name", "value", "fix"),
    [
        ("grad_clip_norm", "1.0", "pass grad_clip_norm=1.0"),
        ("grad_clip_norm", True, None),
        ("grad_accumulation", 2.0, None),
        ("grad_accumulation", "2", "pass grad_accumulation=2"),
        ("grad_scaler", 65536.0, None),
        ("precision", 16.5, None),
        ("metrics", px.metrics.Accuracy(), "pass metrics=[Accuracy()]"),
        ("metrics", ["accuracy"], None),
    ],
)
def test_learner_argument_of_wrong_type(name: str, value: Any, fix: str | None) -> None:
    with pytest.raises(px.ConfigError) as caught:
        _learner(**{name: value})
    err = caught.value
    assert err.code == "PX125"
    assert f"Learner's {name} must be" in str(err)
    assert repr(value) in str(err) and type(value).__name__ in str(err)
    if fix is not None:
        assert fix in str(err)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("epochs", 2.5),
        ("epochs", "3"),
        ("batch_size", None),
        ("seed", "0"),
        ("strategy", None),
        ("run_dir", 7),
        ("checkpoint", {"every_steps": 1}),
        ("early_stopping", "valid/loss"),
        ("resume", "yes"),
        ("drop_last", 1),
        ("shuffle", None),
        ("faults", "kill:1@2"),
        ("faults", ["kill:1@2"]),
        ("preflight", "false"),
        ("hang_timeout", "30s"),
        ("node_timeout", None),
        ("num_workers", 1.0),
        ("pin_memory", "no"),
        ("max_steps", 10.0),
        ("val_every_steps", "5"),
        ("min_free_memory", 1.5e9),
        ("on_failure", "shrink"),
        ("snapshots", "off"),
        ("sinks", [object()]),
        ("loggers", None),
        ("loggers", [print]),
        ("devices", 2.0),
        ("devices", [0, 1]),
        ("balance", "yes"),
        ("slow_worker", "3x"),
        ("on_bad_sample", True),
        ("max_bad_samples", 2.5),
    ],
)
def test_fit_argument_of_wrong_type(tmp_path: Path, name: str, value: Any) -> None:
    run_dir = tmp_path / "run"
    kwargs: dict[str, Any] = {"run_dir": str(run_dir), "batch_size": 4, name: value}
    with pytest.raises(px.ConfigError) as caught:
        _learner().fit(DATA, **kwargs)
    assert caught.value.code == "PX125"
    assert f"fit()'s {name} must be" in str(caught.value)
    assert not run_dir.exists()  # refused before anything was written


def test_right_types_in_other_spellings_train() -> None:
    """What the checks let through: numpy and torch integers, a timeout in seconds, a
    tuple of faults, a Path run_dir (none given here), an int precision."""
    import numpy as np

    result = _learner(precision=32, grad_clip_norm=1).fit(
        DATA,
        epochs=np.int64(1),
        batch_size=int(torch.tensor(4)),
        hang_timeout=30,
        node_timeout=timedelta(seconds=5),
        faults=(),
        shuffle=np.bool_(True),
        num_workers=np.int64(0),
        pin_memory=np.bool_(False),
        sinks=[],
    )
    assert result.steps == 4


def test_lightnings_device_count_is_refused_with_the_labels_to_pass() -> None:
    with pytest.raises(px.ConfigError) as caught:
        _learner().fit(DATA, batch_size=4, devices=2)
    assert caught.value.code == "PX125"
    assert "pass devices='cuda:0,cuda:1' (GPUs) or 'cpu:0,cpu:1' (CPU workers)" in str(caught.value)


@pytest.mark.parametrize("where", ["training", "validation"])
def test_a_string_is_not_a_dataset(where: str) -> None:
    kwargs: dict[str, Any] = {"batch_size": 4}
    train: Any = "data/train.csv" if where == "training" else DATA
    if where == "validation":
        kwargs["valid"] = "data/valid.csv"
    with pytest.raises(px.ConfigError) as caught:
        _learner().fit(train, **kwargs)
    assert caught.value.code == "PX128"
    assert f"the {where} dataset is a str ('data/" in str(caught.value)


@pytest.mark.parametrize(
    ("where", "method", "kinds"),
    [
        ("Learner", px.Learner.__init__, argtypes.learner_kinds),
        ("fit", px.Learner.fit, argtypes.fit_kinds),
    ],
)
def test_every_argument_has_a_check(where: str, method: Any, kinds: Any) -> None:
    names = [n for n in inspect.signature(method).parameters if n != "self"]
    covered = set(kinds()) | set(argtypes.CHECKED_ELSEWHERE[where])
    assert [n for n in names if n not in covered] == []
    assert [n for n in covered if n not in names] == []  # (nothing stale)
