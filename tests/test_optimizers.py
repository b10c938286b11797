"""Optimizer factories that see the model (named weight-decay groups, as minGPT builds
them), optimizer objects refused before start, and the scheduler's interval."""

from __future__ import annotations

import functools
import multiprocessing
from typing import Any

import pytest
import torch
from torch import nn

import phalanx as px
from amp_helpers import decay_groups, halve_each, mlp, mse_step, norm_mlp, sgd
from ddp_helpers import make_data
from phalanx.errors import InvalidSettingError, OptimizerInstanceError
from phalanx.spec import factory_takes_model
from phalanx.strategies.ddp.agent.agent import START_METHOD

DATA = make_data(192, seed=6)
BATCH, EPOCHS = 32, 3  # 6 steps an epoch


def takes_params(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def takes_annotated(net: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(net.parameters(), lr=0.1)


def takes_module(module: Any, lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(module.parameters(), lr=lr)


@pytest.mark.parametrize(
    ("factory", "model"),
    [
        (torch.optim.AdamW, False),  # a class gets the parameters
        (functools.partial(torch.optim.SGD, lr=0.1), False),
        (functools.partial(functools.partial(torch.optim.SGD, lr=0.1), momentum=0.9), False),
        (takes_params, False),  # a plain def make_optimizer(params), as before
        (decay_groups, True),  # first parameter named model
        (takes_annotated, True),  # annotated nn.Module
        (functools.partial(takes_module, lr=0.1), True),
    ],
)
def test_which_factories_get_the_model(factory: Any, model: bool) -> None:
    assert factory_takes_model(factory) is model
    optimizer = px.Learner(mlp, factory, mse_step).spec.build_optimizer(mlp())
    assert isinstance(optimizer, torch.optim.Optimizer)


def by_hand() -> tuple[nn.Module, torch.optim.Optimizer]:
    net = norm_mlp()
    optimizer = decay_groups(net)
    x, y = DATA.tensors
    for _ in range(EPOCHS):
        for start in range(0, len(x), BATCH):
            optimizer.zero_grad()
            nn.functional.mse_loss(
                net(x[start : start + BATCH]), y[start : start + BATCH]
            ).backward()
            optimizer.step()
    return net, optimizer


@pytest.mark.parametrize(("strategy", "devices"), [("single", "cpu"), ("threads", "cpu:0,cpu:1")])
def test_named_weight_decay_groups_train_like_plain_torch(strategy: str, devices: str) -> None:
    reference, optimizer = by_hand()
    groups = optimizer.param_groups
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert [len(g["params"]) for g in groups] == [2, 4]  # 2 Linear weights; biases, LayerNorm
    learner = px.Learner(norm_mlp, decay_groups, mse_step)
    result = learner.fit(
        DATA, epochs=EPOCHS, batch_size=BATCH, shuffle=False, strategy=strategy,
        devices=devices, sinks=[],
    )  # fmt: skip
    for (name, p), q in zip(
        result.model.state_dict().items(), reference.state_dict().values(), strict=True
    ):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), name
    # The decay mattered: without it (one group, no decay) the weights differ.
    adamw = functools.partial(torch.optim.AdamW, lr=0.01, betas=(0.9, 0.95), weight_decay=0.0)
    plain = px.Learner(norm_mlp, adamw, mse_step).fit(
        DATA, epochs=EPOCHS, batch_size=BATCH, shuffle=False, sinks=[]
    )
    assert not torch.allclose(plain.model[0].weight, result.model[0].weight, atol=1e-6)


@pytest.mark.parametrize("strategy", ["single", "ddp"])
def test_an_optimizer_object_is_refused_before_anything_starts(
    strategy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[str] = []

    def start(self: Any) -> None:  # ddp's worker context: a start fails the test at once
        started.append(self.name)
        raise RuntimeError("a worker process was started")

    monkeypatch.setattr(multiprocessing.get_context(START_METHOD).Process, "start", start)
    model = mlp()
    learner = px.Learner(model, torch.optim.SGD(model.parameters(), lr=0.1), mse_step)
    devices = "cpu:0,cpu:1" if strategy == "ddp" else "cpu"
    with pytest.raises(OptimizerInstanceError, match=r"functools.partial\(torch.optim.SGD") as info:
        learner.fit(DATA, strategy=strategy, devices=devices, sinks=[])
    assert info.value.code == "PX131"
    assert "phalanx explain PX131" in str(info.value)
    assert started == []  # refused in the caller, not as a worker's failure
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    with pytest.raises(OptimizerInstanceError, match="StepLR object"):
        px.Learner(model, sgd, mse_step, lr_scheduler=scheduler).fit(DATA, sinks=[])


@pytest.mark.parametrize(
    ("interval", "lrs"),
    [
        ("epoch", [0.05, 0.025, 0.0125]),  # once per epoch, after its train/lr was read
        ("step", [0.05 * 0.5**6, 0.05 * 0.5**12, 0.05 * 0.5**18]),  # 6 steps an epoch
    ],
)
@pytest.mark.parametrize(("strategy", "devices"), [("single", "cpu"), ("threads", "cpu:0,cpu:1")])
def test_the_scheduler_steps_per_epoch_or_per_step(
    interval: str, lrs: list[float], strategy: str, devices: str
) -> None:
    learner = px.Learner(
        mlp, sgd, mse_step, lr_scheduler=halve_each, lr_scheduler_interval=interval
    )
    result = learner.fit(
        DATA, epochs=EPOCHS, batch_size=BATCH, strategy=strategy, devices=devices, sinks=[]
    )
    assert [h["train/lr"] for h in result.history] == pytest.approx(lrs)


def test_an_unknown_scheduler_interval_is_refused() -> None:
    learner = px.Learner(mlp, sgd, mse_step, lr_scheduler=halve_each, lr_scheduler_interval="batch")
    with pytest.raises(InvalidSettingError, match="'step'"):
        learner.fit(DATA, sinks=[])
