"""The state hand-over's packing, without processes: a snapshot taken apart into its
structure and its tensors and put back together is the same snapshot. The structure travels
as JSON (:mod:`phalanx.skeleton.wire`), never pickled."""

from __future__ import annotations

import os
import pickle
from collections import Counter, OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from phalanx import rng
from phalanx.precision import Precision
from phalanx.skeleton import (
    TensorSlot,
    WireError,
    decode,
    encode,
    fill_tensors,
    split_tensors,
    tensor_slots,
)
from phalanx.spec import TrainSpec
from phalanx.trainable import Trainable


def through_the_wire(state: Any) -> tuple[Any, list[torch.Tensor]]:
    """What a member behind gets: the skeleton as JSON bytes, decoded; the tensors copied."""
    skeleton, tensors = split_tensors(state)
    received = decode(encode(skeleton))
    slots = tensor_slots(received)
    copies = [
        torch.empty(s.shape, dtype=s.dtype).copy_(t) for s, t in zip(slots, tensors, strict=True)
    ]
    return fill_tensors(received, copies), tensors


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
            "numpy": rng.capture()["numpy"],
            "python": rng.capture()["python"],
        },
    }


def test_split_then_fill_gives_back_the_same_state() -> None:
    state = snapshot_like()
    skeleton, tensors = split_tensors(state)
    # The structure travels as JSON without any tensor in it: small, whatever the model's size.
    payload = encode(skeleton)  # (its size is the structure's and Python's RNG state's)
    assert len(payload) < 16000 and payload.count(b'"@": "tensor"') == len(tensors)
    slots = tensor_slots(decode(encode(skeleton)))
    assert [s.index for s in slots] == list(range(len(tensors)))
    assert all(isinstance(s, TensorSlot) for s in slots)
    assert [(s.shape, s.dtype) for s in slots] == [(tuple(t.shape), t.dtype) for t in tensors]
    copies = [
        torch.empty(s.shape, dtype=s.dtype).copy_(t) for s, t in zip(slots, tensors, strict=True)
    ]
    back = fill_tensors(decode(encode(skeleton)), copies)
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
    assert torch.equal(back["rng"]["numpy"]["keys"], state["rng"]["numpy"]["keys"])
    rng.restore(back["rng"])
    # It loads into a fresh model and optimizer.
    fresh = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    fresh.load_state_dict(model_state)
    torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9).load_state_dict(
        back["engine"]["optimizer"]
    )


def test_the_split_is_pytrees_own_skeleton_and_tensor_order() -> None:
    """split_tensors walks the plain containers itself (a snapshot's split is on the loop's
    thread) and gives what torch's pytree gives: the same skeleton, bytes for bytes on the
    wire, and the same tensors in the same order; types it does not walk (a namedtuple, a
    defaultdict, torch.Size) go through pytree."""
    from collections import defaultdict, namedtuple

    from phalanx.skeleton.tree import _keep_metadata
    from phalanx.torchprivate import tree_map_only

    def by_pytree(state: Any) -> tuple[Any, list[torch.Tensor]]:
        tensors: list[torch.Tensor] = []

        def take(t: torch.Tensor) -> TensorSlot:
            tensors.append(t)
            return TensorSlot(len(tensors) - 1, tuple(t.shape), t.dtype, str(t.device))

        return tree_map_only(torch.Tensor, take, _keep_metadata(state)), tensors

    pair = namedtuple("pair", "a b")
    mixed = {
        "snapshot": snapshot_like(),
        "nested": [(torch.ones(1), {"k": [torch.zeros(2), 3]}), [torch.ones(3), 1]],
        "size": torch.Size([2, 3]),
        "scalars": (1, 2.5, "s", None, True, b"b"),
        "empty": ([], (), {}),
        0: OrderedDict([("b", torch.ones(1)), ("a", torch.zeros(1))]),
    }
    mine, tensors = split_tensors(mixed)
    theirs, expected = by_pytree(mixed)
    assert encode(mine) == encode(theirs)
    assert all(a is b for a, b in zip(tensors, expected, strict=True))
    model = mine["snapshot"]["engine"]["model"]
    assert model._metadata == mixed["snapshot"]["engine"]["model"]._metadata
    odd = [pair(torch.ones(3), (1, torch.zeros(1))), defaultdict(list, {"x": [torch.ones(1)]})]
    (mine_odd, odd_tensors), (theirs_odd, odd_expected) = split_tensors(odd), by_pytree(odd)
    assert mine_odd == theirs_odd  # (no wire for these: compared as they are)
    assert type(mine_odd[0]) is pair and type(mine_odd[1]) is defaultdict
    assert all(a is b for a, b in zip(odd_tensors, odd_expected, strict=True))


def test_any_keys_and_leaves_travel() -> None:
    """Keys of the types a state dict uses come back with their types (an optimizer's int
    keys stay ints), and so do tuples, torch.Size, dtypes, devices and special floats."""
    state = {
        (1, "a"): torch.ones(2),
        3: [torch.zeros(1), "x", None, True, 2.5],
        "3": (1, (2.0, "b")),
        "size": torch.Size([2, 3]),
        "dtype": torch.bfloat16,
        "device": torch.device("cpu"),
        "floats": [float("inf"), float("-inf"), 1e-300, 0.1],
        "big": 2**70,
        "milestones": Counter({30: 1, 80: 2}),  # MultiStepLR's state
        "set": {1, "a"},
        "bytes": (b"\x00\xff", bytearray(b"ab")),
        "complex": 1 + 2j,
    }
    back, _ = through_the_wire(state)
    assert set(back) == set(state)
    assert torch.equal(back[(1, "a")], torch.ones(2)) and back[3][1:] == ["x", None, True, 2.5]
    assert back["3"] == (1, (2.0, "b")) and type(back["3"][1]) is tuple
    assert back["size"] == (2, 3)  # (torch's pytree rebuilds a torch.Size as a tuple)
    assert type(decode(encode(torch.Size([2, 3])))) is torch.Size  # the wire keeps it
    assert back["dtype"] is torch.bfloat16 and back["device"] == torch.device("cpu")
    assert back["floats"] == state["floats"] and back["big"] == 2**70
    assert type(back["milestones"]) is Counter and back["milestones"] == state["milestones"]
    assert back["set"] == {1, "a"} and back["complex"] == 1 + 2j
    assert back["bytes"] == (b"\x00\xff", bytearray(b"ab"))
    assert type(back["bytes"][1]) is bytearray
    nan = decode(encode({"x": float("nan")}))["x"]
    assert nan != nan


def linear() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))


def trained(optimizer: Any, precision: str = "32-true") -> Trainable:
    """A real Trainable after two steps (optimizer state filled in)."""
    spec = TrainSpec(
        model=linear,
        optimizer=optimizer,
        step=lambda m, b: m(b).pow(2).mean(),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.MultiStepLR(opt, [1, 3], gamma=0.5),
        precision=Precision(precision),
    )
    t = Trainable(spec, torch.device("cpu"), seed=0)
    for _ in range(2):
        loss = t.module(torch.randn(5, 3))[0]
        (t.scaler.scale(loss) if t.scaler is not None else loss).backward()
        t.overflowed()
        t.commit()
    return t


def assert_same(a: Any, b: Any) -> None:
    """Equal values with equal types, all the way down (tensors by value and dtype)."""
    assert type(a) is type(b), (a, b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b) and [type(k) for k in a] == [type(k) for k in b]
        assert getattr(a, "_metadata", None) == getattr(b, "_metadata", None)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b or (a != a and b != b)


@pytest.mark.parametrize(
    ("optimizer", "precision"),
    [
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), "32-true"),
        (lambda p: torch.optim.Adam(p, lr=0.01), "32-true"),
        (lambda p: torch.optim.AdamW(p, lr=0.01, amsgrad=True), "16-mixed"),
    ],
    ids=["sgd-momentum", "adam", "adamw-scaler"],
)
def test_a_real_trainables_state_round_trips_exactly(optimizer: Any, precision: str) -> None:
    t = trained(optimizer, precision)
    state = {**t.state_dict(), "rng": rng.capture()}
    if precision == "16-mixed":
        assert state["scaler"]  # (a real GradScaler's state: scale, growth tracker, ...)
    back, _ = through_the_wire(state)
    assert_same(back, state)
    fresh = trained(optimizer, precision)
    fresh.load_state_dict(back)
    assert_same(fresh.state_dict(), t.state_dict())


class Planted:
    """Unpickling this would create a file: the payload a rogue peer would send."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (open, (self.path, "w"))


def test_a_pickle_payload_is_refused_and_never_run(tmp_path: Path) -> None:
    target = tmp_path / "pwned"
    payload = pickle.dumps({"model": Planted(str(target))})
    with pytest.raises(WireError, match="not a skeleton document"):
        decode(payload)
    with pytest.raises(WireError, match="not a skeleton document"):
        decode(b'{"value": 1}')  # JSON, but not ours
    with pytest.raises(WireError, match="unknown node"):
        decode(b'{"format": "phalanx.skeleton/1", "value": {"@": "pickle", "v": "x"}}')
    with pytest.raises(WireError, match="unknown dtype"):
        decode(b'{"format": "phalanx.skeleton/1", "value": {"@": "dtype", "v": "__class__"}}')
    assert not os.path.exists(target)


def test_a_value_it_cannot_carry_is_a_loud_error() -> None:
    class Custom:
        pass

    with pytest.raises(WireError, match=r"Custom \(at \['optimizer'\]\['x'\]\)"):
        encode({"optimizer": {"x": Custom()}})
    with pytest.raises(WireError, match="frozenset"):
        encode([frozenset()])
    with pytest.raises(WireError, match="defaultdict"):
        encode({"x": __import__("collections").defaultdict(int)})
    with pytest.raises(WireError, match="a key"):
        encode({frozenset(): 1})
