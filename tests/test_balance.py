"""Balance: shares in proportion to each member's measured speed, decided alike on every
member; the math and the ledger unchanged (the final weights equal a one-device run's)."""

from __future__ import annotations

import functools
import io
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from rich.console import Console

import phalanx as px
from ddp_helpers import make_data, mlp, sgd, slow_rank_step
from phalanx.balance import CONFIRM, EVERY, WARMUP, Balancer, cut, sizes, slower_than_peers
from phalanx.events import Balanced
from phalanx.sinks import ProgressSink, SummarySink
from phalanx.sinks.format import balance_line
from recorder import Recorder

DATA = make_data(360)
FIT: dict[str, Any] = dict(batch_size=30, epochs=2, seed=4)


@given(
    total=st.integers(min_value=0, max_value=500),
    shares=st.lists(st.floats(min_value=0.01, max_value=10), min_size=1, max_size=8),
)
def test_sizes_cover_the_batch_in_proportion_and_never_leave_a_member_empty(
    total: int, shares: list[float]
) -> None:
    cut_sizes = sizes(total, shares)
    assert sum(cut_sizes) == total and len(cut_sizes) == len(shares)
    if total >= len(shares):
        assert min(cut_sizes) >= 1
    exact = [total * s / sum(shares) for s in shares]
    if all(e >= 1 for e in exact):  # (no member lifted to one sample: within one of exact)
        assert all(abs(c - e) < 1 for c, e in zip(cut_sizes, exact, strict=True))
    parts = cut(list(range(total)), shares, len(shares))
    assert [i for p in parts for i in p] == list(range(total))  # contiguous, in order


def test_a_member_twice_as_slow_gets_half_the_share_after_the_decision() -> None:
    b = Balancer(3)
    decisions = [b.observe([1e-3, 1e-3, 2e-3]) for _ in range(CONFIRM * EVERY)]
    # Decided every EVERY steps, not between: the first decision names the slow member,
    # the shares move once CONFIRM decisions in a row wanted them to.
    assert [i + 1 for i, d in enumerate(decisions) if d is not None] == [
        EVERY * k for k in range(1, CONFIRM + 1)
    ]
    first, last = decisions[EVERY - 1], decisions[-1]
    assert first is not None and first.slow == [2] and not first.changed
    assert last is not None and last.changed and last.slow == []
    assert last.shares == pytest.approx([0.4, 0.4, 0.2])
    # The same paces again: nothing new to say (the slow member was named once).
    assert all(b.observe([1e-3, 1e-3, 2e-3]) is None for _ in range(EVERY))


def test_noise_does_not_move_the_shares() -> None:
    b = Balancer(2)
    gen = torch.Generator().manual_seed(0)
    for _ in range(20 * EVERY):
        noise = (torch.rand(2, generator=gen) * 0.1 + 1.0).tolist()  # +-5% around equal
        d = b.observe([1e-3 * n for n in noise])
        assert d is None or not d.changed
    assert b.shares == [0.5, 0.5]


def test_without_balance_shares_stay_even_and_the_slow_member_is_still_named() -> None:
    b = Balancer(3, enabled=False)
    found = [b.observe([1e-3, 3e-3, 1e-3]) for _ in range(max(EVERY, WARMUP))]
    named = [d for d in found if d is not None]
    assert len(named) == 1 and named[0].slow == [1] and not named[0].changed
    assert b.shares == [1 / 3] * 3


FAST, SLOW3, SLOW9 = [1e-3, 1e-3, 1e-3], [1e-3, 1e-3, 3e-3], [1e-3, 1e-3, 9e-3]


@pytest.mark.parametrize(
    ("stretches", "put_out"),
    [
        # (paces for EVERY steps, one stretch per decision) -> too_slow at each decision
        ([SLOW9, SLOW9], [[], [2]]),  # over the bound at two decisions in a row: out
        ([SLOW9, FAST, FAST], [[], [], []]),  # one loaded stretch: no one
        ([SLOW9, FAST, SLOW9, FAST], [[], [], [], []]),  # over, under, over: never twice running
        ([SLOW3, SLOW3, SLOW3], [[], [], []]),  # slower, but under slow_worker=4: named only
        ([SLOW9, SLOW9, SLOW9], [[], [2], [2]]),  # (until the engine puts it out)
    ],
)
def test_slow_worker_puts_a_member_out_only_at_the_second_decision_in_a_row(
    stretches: list[list[float]], put_out: list[list[int]]
) -> None:
    b = Balancer(3, limit=4.0, paces=[1e-3] * 3)
    found = []
    for paces in stretches:  # (a decision at the last step of each stretch)
        decisions = [b.observe(paces) for _ in range(EVERY)]
        assert all(d is None for d in decisions[:-1])
        found.append(decisions[-1].too_slow if decisions[-1] is not None else [])
    assert found == put_out


def test_members_with_no_samples_keep_their_pace() -> None:
    b = Balancer(2)
    b.observe([1e-3, 2e-3])
    b.observe([1e-3, 0.0])  # member 1 had nothing to compute: its average stays
    assert b.paces[1] == pytest.approx(2e-3)


def test_the_line_compares_with_the_median_the_balancer_names_by() -> None:
    """Two peers: their median is their mean (as :meth:`Balancer.slow_members` has it), not
    the larger; a share under 1% is not shown as 0%."""
    paces = [1e-3, 1.4e-3, 3e-3]
    assert slower_than_peers(paces, 2) == pytest.approx(2.5)
    b = Balancer(3, paces=list(paces))
    assert b.slow_members() == [2]
    event = Balanced(16, [0.6, 0.395, 0.005], paces, slow=[2])
    assert balance_line(event) == (
        "balance: shares 60/40/0.5% of each global batch (by rank) from step 17; "
        "rank 2 is persistently slower (2.5x the time per sample of its peers)"
    )


def _fit(strategy: str, devices: str, balance: bool, sinks: list[Any]) -> px.FitResult:
    step = functools.partial(slow_rank_step, rank=len(devices.split(",")) - 1, per_sample=2e-3)
    learner = px.Learner(mlp, sgd, step)
    return learner.fit(
        DATA, strategy=strategy, devices=devices, balance=balance, sinks=sinks, **FIT
    )


@pytest.fixture(scope="module")
def alone() -> px.FitResult:
    return _fit("single", "cpu", True, [])


def _rel(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(
        float((x - y).abs().max() / y.abs().max())
        for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("strategy", "devices"), [("threads", "cpu:0,cpu:1,cpu:2"), ("ddp", "cpu:0,cpu:1,cpu:2")]
)
def test_a_slow_member_gets_a_smaller_share_and_the_model_is_unchanged(
    alone: px.FitResult, strategy: str, devices: str
) -> None:
    rec = Recorder()
    console = Console(file=io.StringIO(), width=200)
    result = _fit(strategy, devices, True, [rec, ProgressSink(console), SummarySink(console)])
    decided = rec.of(Balanced)
    moved = [d for d in decided if d.changed]
    assert moved, decided
    shares = moved[-1].shares
    assert shares[2] < 0.8 * min(shares[0], shares[1])  # the slow one computes less
    assert sum(shares) == pytest.approx(1.0)
    assert any(2 in d.slow for d in decided)  # and is named
    assert result.ledger_ok and result.steps == alone.steps
    assert _rel(result.model, alone.model) <= 1e-5
    out = console.file.getvalue()  # type: ignore[attr-defined]
    assert "balance: shares " in out and "% of each global batch (by rank) from step " in out
    assert "rank 2 is persistently slower (" in out  # said when seen, where it runs,
    assert "x the time per sample of its peers): worker 2 on cpu:2" in out  # and at the end:
    assert "Balanced: the last shares were " in out and "Slow: rank 2 is persistently" in out


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_balance_off_keeps_even_shares_and_names_the_slow_member() -> None:
    rec = Recorder()
    result = _fit("threads", "cpu:0,cpu:1,cpu:2", False, [rec])
    decided = rec.of(Balanced)
    assert decided and not any(d.changed for d in decided)
    assert any(2 in d.slow for d in decided)
    assert result.ledger_ok


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_worker_over_slow_worker_is_put_out_and_the_model_is_unchanged(
    alone: px.FitResult,
) -> None:
    """Rank 2 four times slower, slow_worker=2.5: put out (shrink), the others finish."""
    step = functools.partial(slow_rank_step, rank=2, per_sample=4e-3)
    result = px.Learner(mlp, sgd, step).fit(
        DATA,
        strategy="ddp",
        devices="cpu:0,cpu:1,cpu:2",
        slow_worker=2.5,
        on_failure=px.Recovery("shrink"),
        sinks=[],
        **FIT,
    )
    slow = [f for f in result.failures if f.exception_type == "WorkerTooSlow"]
    assert len(slow) == 1 and slow[0].worker == 2 and slow[0].action == "shrunk"
    assert "over slow_worker=2.5" in slow[0].message
    assert result.ledger_ok and result.steps == alone.steps
    assert _rel(result.model, alone.model) <= 1e-5


def test_slow_worker_is_checked() -> None:
    with pytest.raises(px.ConfigError, match=r"slow_worker=0\.5"):
        px.Learner(mlp, sgd, px.mse_step).fit(DATA, slow_worker=0.5, sinks=[])


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("strategy", "devices"), [("threads", "cpu:0,cpu:1,cpu:2"), ("ddp", "cpu:0,cpu:1,cpu:2")]
)
def test_an_out_of_memory_split_of_a_moved_share_keeps_the_math(
    alone: px.FitResult, strategy: str, devices: str
) -> None:
    """A fast member runs out of memory after the shares moved (its share is then larger
    than an even one): its part is split in micro-batches and retried; the same model."""
    step = functools.partial(slow_rank_step, rank=2, per_sample=2e-3)
    rec = Recorder()
    result = px.Learner(mlp, sgd, step).fit(
        DATA,
        strategy=strategy,
        devices=devices,
        faults=[px.Fault("oom", worker=0, step=20, phase="backward")],
        sinks=[rec],
        **FIT,
    )
    moved = [d for d in rec.of(Balanced) if d.changed and d.global_step < 20]
    assert moved and moved[-1].shares[0] > 1 / 3  # (split a share that had grown)
    assert [(f.kind, f.step, f.action) for f in result.failures] == [("oom", 20, "split")]
    assert result.ledger_ok and result.steps == alone.steps
    assert _rel(result.model, alone.model) <= 1e-5


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_balance_with_gradient_accumulation_keeps_the_math(alone: px.FitResult) -> None:
    """Shares move while each member cuts its share into micro-batches: the same model."""
    step = functools.partial(slow_rank_step, rank=2, per_sample=2e-3)
    rec = Recorder()
    result = px.Learner(mlp, sgd, step, grad_accumulation=2).fit(
        DATA, strategy="threads", devices="cpu:0,cpu:1,cpu:2", sinks=[rec], **FIT
    )
    assert any(d.changed for d in rec.of(Balanced))
    assert result.ledger_ok and _rel(result.model, alone.model) <= 1e-5
