"""strategy="single" against a plain torch loop written out by hand: the same data order,
loss, gradient clipping, optimizer and scheduler steps give the same weights. Every other
equality test compares phalanx with itself; this one pins the loop to torch."""

from __future__ import annotations

import functools
import json
from typing import Any, NamedTuple

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

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


# --- batch structures: dicts, nesting and named tuples reach the step intact ------------------


class Sample(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


class Structured(Dataset[Any]):
    """DATA's samples in another structure; every sample carries its index ``id`` so the step
    can check that each leaf of a micro-batch holds the same rows."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def __len__(self) -> int:
        return len(DATA)

    def __getitem__(self, i: int) -> Any:
        x, y = DATA[i]
        ident = torch.tensor(i)
        if self.kind == "dict":
            return {"x": x, "y": y, "id": ident}
        if self.kind == "tuple of dict":
            return ({"x": x, "id": ident}, {"y": y, "id": ident})
        if self.kind == "namedtuple":
            return Sample(x, torch.cat([y, ident.view(1).float()]))
        return (Sample(x, y), ident)  # a named tuple inside a tuple


def unpack(kind: str, batch: Any) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """``(x, y, ids)`` of a collated batch; ``ids`` from every leaf that carries them."""
    if kind == "dict":
        return batch["x"], batch["y"], [batch["id"]]
    if kind == "tuple of dict":
        inputs, targets = batch
        return inputs["x"], targets["y"], [inputs["id"], targets["id"]]
    if kind == "namedtuple":
        return batch.x, batch.y[:, :1], [batch.y[:, 1].long()]
    sample, ident = batch
    return sample.x, sample.y, [ident]


def describe(batch: Any) -> Any:
    """The structure of a batch: container types, tensor shapes and devices."""
    if isinstance(batch, torch.Tensor):
        return ("tensor", tuple(batch.shape), batch.device.type)
    if isinstance(batch, dict):
        return {k: describe(v) for k, v in batch.items()}
    if isinstance(batch, tuple | list):
        return (type(batch).__name__, [describe(v) for v in batch])
    return type(batch).__name__


def recording_step(model: nn.Module, batch: Any, kind: str, seen: list[Any]) -> torch.Tensor:
    x, y, ids = unpack(kind, batch)
    seen.append((describe(batch), [i.tolist() for i in ids]))
    return nn.functional.mse_loss(model(x), y)


def leaf(rows: int, *tail: int) -> tuple[str, tuple[int, ...], str]:
    return ("tensor", (rows, *tail), "cpu")


def expected_structure(kind: str, rows: int) -> Any:
    """What default_collate makes of ``rows`` samples (a sample's tuple becomes a list; a
    named tuple stays one)."""
    if kind == "dict":
        return {"x": leaf(rows, 8), "y": leaf(rows, 1), "id": leaf(rows)}
    if kind == "tuple of dict":
        return (
            "list",
            [{"x": leaf(rows, 8), "id": leaf(rows)}, {"y": leaf(rows, 1), "id": leaf(rows)}],
        )
    if kind == "namedtuple":
        return ("Sample", [leaf(rows, 8), leaf(rows, 2)])
    return ("list", [("Sample", [leaf(rows, 8), leaf(rows, 1)]), leaf(rows)])


KINDS = ["dict", "tuple of dict", "namedtuple", "namedtuple in a tuple"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", KINDS)
def test_structured_batches_reach_the_step_whole_in_every_micro_batch(kind: str) -> None:
    """batch_size=32 in grad_accumulation=2 micro-batches of 16: each call of the step gets
    the collated structure with every leaf cut to the same 16 rows, and the run trains
    exactly as with plain (x, y) batches."""
    seen: list[Any] = []
    step = functools.partial(recording_step, kind=kind, seen=seen)
    result = px.Learner(model(), momentum_sgd, step, grad_accumulation=2).fit(
        Structured(kind), epochs=1, batch_size=BATCH, sinks=[]
    )
    plain = px.Learner(model(), momentum_sgd, mse_step, grad_accumulation=2).fit(
        DATA, epochs=1, batch_size=BATCH, sinks=[]
    )
    assert result.steps == 8 and not result.failures
    # 7 full global batches of 32 in two micro-batches of 16, then 6 samples as 3 + 3
    rows = [16] * 14 + [3, 3]
    assert [structure for structure, _ in seen] == [expected_structure(kind, r) for r in rows]
    for _, ids in seen:
        assert all(i == ids[0] for i in ids), ids  # every leaf holds the same samples
    used = sorted(i for _, ids in seen for i in ids[0])
    assert used == list(range(len(DATA)))
    for mine, ref in zip(result.model.parameters(), plain.model.parameters(), strict=True):
        assert torch.equal(mine, ref)


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
