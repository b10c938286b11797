"""The state hand-over's packing, without processes: a snapshot taken apart into its
structure and its tensors and put back together is the same snapshot."""

from __future__ import annotations

import pickle
import random
from collections import OrderedDict

import numpy as np
import torch
from torch import nn

from phalanx.strategies.ddp.handover import TensorSlot, fill_tensors, split_tensors, tensor_slots


def snapshot_like() -> dict[str, object]:
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    return {
        "engine": {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": None},
        "loop": {"history": [{"epoch": 0, "train/loss": 0.5}], "sums": torch.arange(3.0)},
        "rng": {
            "torch": torch.get_rng_state(),
            "numpy": np.random.get_state(),
            "python": random.getstate(),
        },
    }


def test_split_then_fill_gives_back_the_same_state() -> None:
    state = snapshot_like()
    skeleton, tensors = split_tensors(state)
    # The structure pickles without any tensor in it: small, whatever the model's size.
    assert b"torch._utils" not in pickle.dumps(skeleton)
    slots = tensor_slots(pickle.loads(pickle.dumps(skeleton)))
    assert [s.index for s in slots] == list(range(len(tensors)))
    assert all(isinstance(s, TensorSlot) for s in slots)
    assert [(s.shape, s.dtype) for s in slots] == [(tuple(t.shape), t.dtype) for t in tensors]
    copies = [
        torch.empty(s.shape, dtype=s.dtype).copy_(t) for s, t in zip(slots, tensors, strict=True)
    ]
    back = fill_tensors(pickle.loads(pickle.dumps(skeleton)), copies)
    model_state = back["engine"]["model"]
    assert isinstance(model_state, OrderedDict)
    assert model_state._metadata == state["engine"]["model"]._metadata  # versions for loading
    for key, value in state["engine"]["model"].items():
        assert torch.equal(model_state[key], value)
    momentum = back["engine"]["optimizer"]["state"][0]["momentum_buffer"]
    assert torch.equal(momentum, state["engine"]["optimizer"]["state"][0]["momentum_buffer"])
    assert back["loop"]["history"] == state["loop"]["history"]
    assert torch.equal(back["rng"]["torch"], state["rng"]["torch"])
    assert back["rng"]["python"] == state["rng"]["python"]
    assert np.array_equal(back["rng"]["numpy"][1], state["rng"]["numpy"][1])
    # It loads into a fresh model and optimizer.
    fresh = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    fresh.load_state_dict(model_state)
    torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9).load_state_dict(
        back["engine"]["optimizer"]
    )


def test_any_keys_and_leaves_travel() -> None:
    """The skeleton is the state itself with tensors swapped for slots: keys of any type
    (a user's scheduler or optimizer state) and non-tensor leaves come back as they were."""
    state = {(1, "a"): torch.ones(2), 3: [torch.zeros(1), "x", None], "n": np.arange(3)}
    skeleton, tensors = split_tensors(state)
    back = fill_tensors(pickle.loads(pickle.dumps(skeleton)), tensors)
    assert set(back) == {(1, "a"), 3, "n"}
    assert torch.equal(back[(1, "a")], torch.ones(2)) and back[3][1:] == ["x", None]
    assert np.array_equal(back["n"], np.arange(3))
