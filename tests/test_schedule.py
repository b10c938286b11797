"""How long and how often: fit(max_steps=), fit(val_every_steps=), Checkpoints(every_epochs=).

CPU; the model has dropout and the optimizer momentum, so a run that stops at max_steps and is
resumed must match a straight run bitwise, and validation in the middle of an epoch must not
change training."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import phalanx as px
from phalanx.checkpoint import should_save
from phalanx.checkpoint.io import list_checkpoints
from phalanx.errors import InvalidSettingError
from phalanx.events import Notice, StepEnded, Validated
from recorder import Recorder

SAMPLES, BATCH, EPOCHS = 32, 8, 3
STEPS = SAMPLES // BATCH  # 4 per epoch


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 3))


def make_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def datasets() -> tuple[TensorDataset, TensorDataset]:
    g = torch.Generator().manual_seed(99)
    x = torch.randn(SAMPLES + 12, 4, generator=g)
    y = torch.randint(0, 3, (SAMPLES + 12,), generator=g)
    return TensorDataset(x[:SAMPLES], y[:SAMPLES]), TensorDataset(x[SAMPLES:], y[SAMPLES:])


def plain_model() -> nn.Module:
    """Without dropout: ddp's ranks draw other dropout masks than a single replica."""
    return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))


def fit(
    run_dir: Path | None = None,
    sinks: list[Any] | None = None,
    model: Any = make_model,
    **kw: Any,
) -> px.FitResult:
    train, valid = datasets()
    learner = px.Learner(model, make_optimizer, px.cross_entropy_step)
    options: dict[str, Any] = {
        "epochs": EPOCHS,
        "batch_size": BATCH,
        "seed": 3,
        "sinks": sinks or [],
    }
    options.update(kw)
    return learner.fit(train, valid, run_dir=None if run_dir is None else str(run_dir), **options)


def same_weights(a: nn.Module, b: nn.Module) -> bool:
    return all(
        torch.equal(x, y)
        for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )


@pytest.fixture(scope="module")
def straight() -> px.FitResult:
    return fit()


def test_max_steps_stops_mid_epoch_checkpoints_and_resumes_exactly(
    straight: px.FitResult, tmp_path: Path
) -> None:
    rec = Recorder()
    first = fit(tmp_path, [rec], max_steps=6)
    assert (first.steps, first.epochs, first.interrupted) == (6, 1, None)
    assert [e.global_step for e in rec.of(StepEnded)] == [1, 2, 3, 4, 5, 6]
    assert len(first.history) == 1 and first.history[0] == straight.history[0]
    assert first.ledger_ok  # the finished epoch used every sample once
    assert any("max_steps=6 reached (epoch 1, step 2 of 4)" in n.text for n in rec.of(Notice))
    saved = [step for _, step in list_checkpoints(tmp_path / "checkpoints")]
    assert saved[-1] == 6
    assert first.model_path is not None  # reaching max_steps finishes the run
    # going on from there (no max_steps now) ends where a straight run ends
    second = fit(tmp_path, resume=True)
    assert second.steps == EPOCHS * STEPS and second.ledger_ok
    assert second.history == straight.history
    assert same_weights(second.model, straight.model)


def test_max_steps_at_an_epoch_end_finishes_that_epoch() -> None:
    result = fit(max_steps=STEPS)
    assert (result.steps, result.epochs, len(result.history)) == (STEPS, 1, 1)
    assert "valid/loss" in result.history[0]


def test_validation_every_n_steps_reports_the_model_of_that_step(
    straight: px.FitResult,
) -> None:
    rec = Recorder()
    result = fit(sinks=[rec], val_every_steps=2)
    # steps 4, 8 and 12 end an epoch: their validation is the epoch's own
    validated = rec.of(Validated)
    assert [(v.epoch, v.step, v.global_step) for v in validated] == [
        (0, 2, 2),
        (1, 2, 6),
        (2, 2, 10),
    ]
    mid = [h for h in result.history if "global_step" in h]
    assert [h["global_step"] for h in mid] == [2, 6, 10]
    assert [h for h in result.history if "global_step" not in h] == straight.history
    assert mid[0]["valid/loss"] == validated[0].metrics["valid/loss"]
    # validating does not change training
    assert same_weights(result.model, straight.model)
    # the value is the validation loss of the model after step 2, computed by hand
    two = fit(max_steps=2)
    _, valid = datasets()
    two.model.eval()
    with torch.no_grad():
        x, y = valid.tensors
        expected = nn.functional.cross_entropy(two.model(x), y).item()
    assert validated[0].metrics["valid/loss"] == pytest.approx(expected, rel=1e-6)


def test_checkpoints_every_n_epochs(tmp_path: Path) -> None:
    fit(tmp_path, epochs=4, checkpoint=px.Checkpoints(every_epochs=2, keep_last=10))
    assert [s for _, s in list_checkpoints(tmp_path / "checkpoints")] == [2 * STEPS, 4 * STEPS]


@pytest.mark.parametrize(
    ("config", "epochs_done", "expected"),
    [
        (px.Checkpoints(), 1, True),
        (px.Checkpoints(every_epochs=2), 1, False),
        (px.Checkpoints(every_epochs=2), 2, True),
        (px.Checkpoints(every_epochs=3), 6, True),
        (px.Checkpoints(every_epoch=False), 2, False),
    ],
)
def test_should_save_at_epoch_ends(
    config: px.Checkpoints, epochs_done: int, expected: bool
) -> None:
    assert should_save(7, True, config, epochs_done) is expected
    assert should_save(7, False, config, epochs_done) is False  # no every_steps


def test_every_epochs_settings_name_the_fix() -> None:
    with pytest.raises(InvalidSettingError, match=r"every_epochs=0.*>= 1"):
        px.Checkpoints(every_epochs=0)
    with pytest.raises(InvalidSettingError, match="contradict"):
        px.Checkpoints(every_epoch=False, every_epochs=2)


@pytest.mark.timeout(180)
def test_max_steps_and_mid_epoch_validation_under_ddp_and_threads(tmp_path: Path) -> None:
    rec = Recorder()
    single = fit(max_steps=6, val_every_steps=2, model=plain_model)
    ddp = fit(
        tmp_path,
        [rec],
        plain_model,
        max_steps=6,
        val_every_steps=2,
        strategy="ddp",
        devices="cpu:0,cpu:1",
    )
    assert (ddp.steps, ddp.epochs, ddp.ledger_ok) == (6, 1, True)
    assert [v.global_step for v in rec.of(Validated)] == [2, 6]
    assert [h.get("global_step") for h in ddp.history] == [2, None, 6]
    for mine, ref in zip(ddp.history, single.history, strict=True):
        assert mine["valid/loss"] == pytest.approx(ref["valid/loss"], rel=1e-4)
    assert [s for _, s in list_checkpoints(tmp_path / "checkpoints")][-1] == 6
    threads = fit(
        None,
        None,
        plain_model,
        max_steps=6,
        val_every_steps=2,
        strategy="threads",
        devices="cpu:0,cpu:1",
    )
    assert [h.get("global_step") for h in threads.history] == [2, None, 6]
    for mine, ref in zip(threads.history, single.history, strict=True):
        assert mine["valid/loss"] == pytest.approx(ref["valid/loss"], rel=1e-4)
