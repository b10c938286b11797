"""The vote carried by DDP's gradient all-reduce (strategies/ddp/worker/ballot.py): exact for any
float64 and any world size, counted the same on every member, the gradients and the loss
of the model untouched, nothing left over from one step in the next."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from phalanx.replica import StepModule, backward
from phalanx.strategies.ddp.worker.ballot import Ballot, Decoder, decode, encode, pieces
from phalanx.strategies.ddp.worker.group import GenerationGroup

CPU = torch.device("cpu")
TIMEOUT = timedelta(seconds=20)


def _hard_values(rng: np.random.Generator, world: int, size: int) -> np.ndarray:
    """float64 votes no float32 holds: wide exponents, integers up to 2**64, signs,
    infinities; one NaN."""
    v = rng.standard_normal((world, size)) * 10.0 ** rng.integers(-300, 300, (world, size))
    v[:, 0] = rng.integers(0, 2**53, world)
    v[:, 1] = 2.0**64 - 2.0**12  # a fingerprint's hash term: beyond int64
    v[:, 2] = -(10.0 ** rng.integers(-20, 20, world)) / 3.0
    if size > 4:
        v[0, 3], v[-1, 4] = np.inf, np.nan
    return v


def _rank_order_sum(values: np.ndarray) -> np.ndarray:
    total = np.zeros(values.shape[1])
    for row in values:
        total = total + row
    return total


@pytest.mark.parametrize("world", [1, 2, 3, 5, 7, 64, 1000])
def test_a_ballot_sum_is_the_exact_float64_sum_in_rank_order(world: int) -> None:
    rng = np.random.default_rng(world)
    size = 13
    votes = _hard_values(rng, world, size)
    # What DDP does to the box's gradient: each member's ballot divided by the world size
    # (float32), then summed over members in some order (here: reversed), in float32.
    reduced = np.zeros(world * size * 4, dtype=np.float32)
    for r in reversed(range(world)):
        reduced += encode(votes[r], r, world) / np.float32(world)
    got = decode(reduced, world, size)
    want = _rank_order_sum(votes)
    assert got.dtype == np.float64
    assert np.array_equal(got, want, equal_nan=True)
    finite = np.isfinite(want)  # (bit for bit: -0.0 and 0.0 differ there)
    assert np.array_equal(got[finite].view(np.uint64), want[finite].view(np.uint64))


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_8_bit_pieces_survive_bfloat16_exactly(world: int) -> None:
    """fsdp's box under a bfloat16 mp_policy: each member's ballot in 8-bit pieces is cast
    to bfloat16 (the unsharded box's dtype), accumulated with zeros in float32 and summed
    (FSDP2's reduce); the decoded sum is the exact float64 sum in rank order. 16-bit pieces
    would not survive the cast."""
    rng = np.random.default_rng(world)
    size = 9
    votes = _hard_values(rng, world, size)
    reduced = torch.zeros(world * size * 8)
    for r in reversed(range(world)):
        ballot = np.zeros((world, size * 8), dtype=np.float32)
        ballot[r] = pieces(votes[r], 8)
        reduced += torch.from_numpy(ballot.reshape(-1)).to(torch.bfloat16).float()
    got = Decoder(world, size, scale=1.0, bits=8)(reduced.numpy())
    assert np.array_equal(got, _rank_order_sum(votes), equal_nan=True)
    wide = torch.from_numpy(pieces(votes[0], 16).astype(np.float32)).to(torch.bfloat16)
    assert not np.array_equal(wide.float().numpy(), pieces(votes[0], 16).astype(np.float32))


def test_a_ballot_holds_only_its_own_slot() -> None:
    ballot = encode(np.array([1.5, -2.0, 3.0]), 1, 3).reshape(3, -1)
    assert not ballot[0].any() and not ballot[2].any()
    assert ballot[1].any() and ballot.dtype == np.float32
    assert (ballot == np.rint(ballot)).all() and ballot.max() <= 0xFFFF and ballot.min() >= 0


def _step(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def _in_ranks(world: int, body: Any) -> list[Any]:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    out: list[Any] = [None] * world

    def rank(r: int) -> None:
        store = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=TIMEOUT)
        group = GenerationGroup.form(store, "g0/", r, world, CPU, TIMEOUT, False)
        try:
            out[r] = body(group)
        except Exception as exc:
            out[r] = exc
        finally:
            group.leave()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    assert not any(t.is_alive() for t in threads)
    assert not any(isinstance(r, Exception) for r in out), out
    return out


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(12, 5, generator=g), torch.randn(12, 2, generator=g)


def _vote(rank: int, step: int) -> torch.Tensor:
    values = [rank + 1.0, 1 / 3 + rank, 2.0**60 + step, -1e-300 * (rank + 1)]
    return torch.tensor(values, dtype=torch.float64)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_the_vote_rides_the_gradients_and_leaves_them_as_plain_ddp_has_them(world: int) -> None:
    """Three steps under DDP over a generation's group: every member counts the exact sum
    of the members' votes, each step's own (the box starts empty each step); the model's
    gradients are those of the whole batch, as without a ballot."""

    torch.manual_seed(0)
    reference = nn.Linear(5, 2)
    start = {k: v.clone() for k, v in reference.state_dict().items()}

    def body(group: GenerationGroup) -> list[Any]:
        model = nn.Linear(5, 2)
        model.load_state_dict(start)
        module = StepModule(model, _step)
        ballot = Ballot(module, group.rank, group.size, 4, CPU)
        ddp = group.wrap(ballot, init_sync=True)
        seen = []
        for step in range(3):
            x, y = _data(step)
            rows = slice(group.rank * 12 // world, (group.rank + 1) * 12 // world)
            loss, _, _ = ddp((x[rows], y[rows]))
            backward(loss, ballot.cast(_vote(group.rank, step).tolist()))
            grads = [p.grad.clone() for p in module.parameters()]  # type: ignore[union-attr]
            seen.append((ballot.count(), grads))
            for p in module.parameters():
                p.grad = None
        return seen

    results = _in_ranks(world, body)
    for step in range(3):
        want = sum((_vote(r, step) for r in range(world)), torch.zeros(4, dtype=torch.float64))
        x, y = _data(step)
        reference.zero_grad()
        # DDP averages the members' mean losses: the whole batch's (equal slices of 12).
        _step(reference, (x, y)).backward()
        for seen in results:
            counted, grads = seen[step]
            assert np.array_equal(counted, want.numpy()), (step, counted, want)
            for got, ref in zip(grads, reference.parameters(), strict=True):
                assert ref.grad is not None
                torch.testing.assert_close(got, ref.grad)
    for seen in results[1:]:  # every member the same gradients, bit for bit
        for (_, a), (_, b) in zip(seen, results[0], strict=True):
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
