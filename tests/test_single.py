"""strategy="single" against a plain torch loop written out by hand: the same data order,
loss, gradient clipping, optimizer and scheduler steps give the same weights. Every other
equality test compares phalanx with itself; this one pins the loop to torch."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from torch import nn

import phalanx as px
from ddp_helpers import make_data, mse_step
from phalanx.plan import Plan

DATA = make_data(230, seed=2)
BATCH, EPOCHS, CLIP = 32, 3, 0.5  # 8 steps an epoch, the last of 6 samples


def model() -> nn.Module:
    torch.manual_seed(11)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def momentum_sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.2, momentum=0.9)


def step_lr(optimizer: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)


def by_hand() -> tuple[nn.Module, list[float]]:
    """The textbook loop: no shuffle, mean loss per global batch, clip, step, schedule."""
    net = model()
    optimizer = momentum_sgd(net.parameters())
    scheduler = step_lr(optimizer)
    x, y = DATA.tensors
    lrs = []
    for _ in range(EPOCHS):
        for start in range(0, len(x), BATCH):
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(net(x[start : start + BATCH]), y[start : start + BATCH])
            loss.backward()
            nn.utils.clip_grad_norm_(net.parameters(), CLIP)
            optimizer.step()
            scheduler.step()
            lrs.append(optimizer.param_groups[0]["lr"])
    return net, lrs


@pytest.mark.parametrize("accumulation", [1, 3])
def test_single_matches_a_plain_torch_loop(accumulation: int) -> None:
    reference, lrs = by_hand()
    learner = px.Learner(
        model(),  # a module: copied, so both start from the same weights
        momentum_sgd,
        mse_step,
        lr_scheduler=step_lr,
        grad_accumulation=accumulation,  # micro-batches: the same mean gradient
        grad_clip_norm=CLIP,
    )
    result = learner.fit(DATA, epochs=EPOCHS, batch_size=BATCH, shuffle=False, sinks=[])
    assert result.steps == len(lrs) == 24
    assert result.history[-1]["train/lr"] == pytest.approx(lrs[-1])  # 0.2 * 0.5**4
    pairs = zip(result.model.state_dict().values(), reference.state_dict().values(), strict=True)
    for mine, ref in pairs:
        assert torch.allclose(mine, ref, rtol=1e-5, atol=1e-6), (mine - ref).abs().max()
    # The clip mattered (else this would not test it): unclipped, the weights differ.
    unclipped = px.Learner(model(), momentum_sgd, mse_step, lr_scheduler=step_lr).fit(
        DATA, epochs=EPOCHS, batch_size=BATCH, shuffle=False, sinks=[]
    )
    diffs = [
        (a - b).abs().max().item()
        for a, b in zip(
            unclipped.model.state_dict().values(), reference.state_dict().values(), strict=True
        )
    ]
    assert max(diffs) > 1e-3


def test_a_failed_run_writes_failures_json(tmp_path: Any) -> None:
    """strategy="single" writes run_dir/failures.json as ddp and threads do."""
    fault = px.Fault("exception", worker=0, step=2, phase="forward", times=2)
    run_dir = tmp_path / "run"
    with pytest.raises(px.TrainingFailed) as info:
        px.Learner(model, momentum_sgd, mse_step).fit(
            DATA, batch_size=BATCH, seed=4, faults=[fault], run_dir=str(run_dir), sinks=[]
        )
    err = info.value
    doc = json.loads((run_dir / "failures.json").read_text())
    root = doc["root_cause"]
    assert (root["worker"], root["device"], root["step"], root["phase"]) == (0, "cpu", 2, "forward")
    assert root["exception_type"] == "InjectedFault" and "injected exception" in root["message"]
    assert root["sample_indices"] == Plan(len(DATA), BATCH, 4).global_batch(0, 2)
    assert root == err.root_cause.to_dict()
    assert [f["action"] for f in doc["failures"]] == ["retried", "aborted"]
    assert doc["environment"]["devices"] == ["cpu"]
    assert doc["environment"]["torch"] == torch.__version__
