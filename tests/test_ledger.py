"""The data ledger's check, on hand-made entries: an exact run passes; a step committed
twice, a step never committed, a member that computed the wrong slice, and other samples
with the same count, sum and sum of squares are each named."""

from __future__ import annotations

import numpy as np
import pytest

from phalanx import ledger
from phalanx.plan import Plan, split

PLAN = Plan(samples=23, batch_size=5, seed=1)  # 5 steps an epoch, the last of 3 samples


def entry(epoch: int, step: int, computed: list[int]) -> list[float]:
    return [epoch, step, epoch * PLAN.steps + step, *ledger.fingerprint(computed)]


def exact(epochs: int) -> list[list[float]]:
    """What members split any way report: the union of their slices is the global batch."""
    out = []
    for e in range(epochs):
        for s in range(PLAN.steps):
            parts = split(PLAN.global_batch(e, s), 1 + s % 3)  # membership changes: no matter
            out.append(entry(e, s, [i for part in parts for i in part]))
    return out


def test_an_exact_run_has_no_problem() -> None:
    assert ledger.check(PLAN, exact(2), epochs_done=2) == []


def test_a_step_committed_twice_is_named() -> None:
    entries = exact(1)
    entries.insert(3, entries[2])
    problems = ledger.check(PLAN, entries, epochs_done=1)
    assert problems == ["epoch 0 step 2 committed twice (global steps 2 and 2)"]


def test_a_step_never_committed_is_named() -> None:
    entries = [e for e in exact(2) if (e[0], e[1]) != (1, 4)]
    assert ledger.check(PLAN, entries, epochs_done=2) == ["epoch 1: steps [4] were never committed"]
    assert ledger.check(PLAN, entries, epochs_done=1) == []  # epoch 1 did not finish


def test_a_member_computing_a_stale_slice_is_named() -> None:
    """After a shrink from three members to two, one member computes its part of the old
    three-way split: a sample is missed and the count is short."""
    batch = PLAN.global_batch(0, 1)
    new = split(batch, 2)
    old = split(batch, 3)
    wrong = new[0] + old[2]  # member 1 computed its old share
    entries = exact(1)
    entries[1] = entry(0, 1, wrong)
    problems = ledger.check(PLAN, entries, epochs_done=1)
    assert len(problems) == 1 and problems[0].startswith("epoch 0 step 1: computed")
    assert f"the plan's global batch has {len(batch)}" in problems[0]


def test_the_same_count_and_sum_with_other_samples_is_named() -> None:
    """Swapping samples for others with the same count and sum is caught by the squares."""
    batch = PLAN.global_batch(0, 0)
    a, b = batch[0], batch[1]
    others = [i for i in range(PLAN.samples) if i not in batch]
    pair = next(
        (x, y) for x in others for y in others if x < y and x + y == a + b and {x, y} != {a, b}
    )
    swapped = [*pair, *batch[2:]]
    entries = exact(1)
    entries[0] = entry(0, 0, swapped)
    assert len(ledger.check(PLAN, entries, epochs_done=1)) == 1


def test_other_samples_with_the_same_sums_of_powers_are_named() -> None:
    """{1, 5, 6} and {2, 3, 7} have the same count, sum and sum of squares: only the hash
    term tells them apart."""
    plan = Plan(samples=12, batch_size=3, seed=0)
    for epoch in range(50):
        for step in range(plan.steps):
            if sorted(plan.global_batch(epoch, step)) == [1, 5, 6]:
                break
        else:
            continue
        break
    else:
        raise AssertionError("no step of the first 50 epochs takes {1, 5, 6}")
    right, wrong = ledger.fingerprint([1, 5, 6]), ledger.fingerprint([2, 3, 7])
    assert right[:3] == wrong[:3] and right[3] != wrong[3]
    entries = [
        [epoch, s, s, *ledger.fingerprint(plan.global_batch(epoch, s))] for s in range(plan.steps)
    ]
    entries[step] = [epoch, step, step, *wrong]
    problems = ledger.check(plan, entries, epochs_done=epoch + 1)
    assert [p for p in problems if "computed" in p] == [
        f"epoch {epoch} step {step}: computed 3 samples (fingerprint [12, 62, {int(wrong[3])}]), "
        f"the plan's global batch has 3 (fingerprint [12, 62, {int(right[3])}])"
    ]


def test_an_entry_of_an_older_checkpoint_is_checked_on_its_three_terms() -> None:
    entries = [e[:6] for e in exact(1)]
    assert ledger.check(PLAN, entries, epochs_done=1) == []
    entries[2][3] += 1
    assert len(ledger.check(PLAN, entries, epochs_done=1)) == 1


def test_the_check_computes_each_epochs_order_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """An epoch's order is as long as the dataset: computing it again for every step made
    the check after a run cost O(steps x samples) (48 s for 1500 steps of 192,000 samples),
    charged to every step of a run that measures its wall time."""
    entries = exact(3)
    calls: list[int] = []
    real = Plan.order

    def counted(self: Plan, epoch: int) -> list[int]:
        calls.append(epoch)
        return real(self, epoch)

    monkeypatch.setattr(Plan, "order", counted)
    assert ledger.check(PLAN, entries, epochs_done=3) == []
    assert sorted(calls) == [0, 1, 2]


def test_the_hash_of_many_indices_at_once_is_mix_of_each() -> None:
    rng = np.random.default_rng(0)
    indices = [0, 1, 2**26 - 1, 2**40 + 7, *rng.integers(0, 2**31, size=500).tolist()]
    assert ledger.mix_all(np.asarray(indices, dtype=np.uint64)).tolist() == [
        ledger.mix(i) for i in indices
    ]
    count, total, squares, hashed = ledger.fingerprint(indices)
    exact = (len(indices), sum(indices), sum(i * i for i in indices))
    assert (count, total, squares) == tuple(float(x) for x in exact)
    assert hashed == float(sum(ledger.mix(i) for i in indices))
    assert ledger.fingerprint([]) == ledger.EMPTY


@pytest.mark.parametrize("largest", [10, 5000, 2**28, 2**31, 2**40])
def test_an_epochs_fingerprints_at_once_are_each_steps_own(largest: int) -> None:
    """The same floats as slice by slice, bit for bit: empty slices, one sample, indices
    whose squares sum past 2**64 in a slice (computed slice by slice then)."""
    rng = np.random.default_rng(largest)
    slices = [
        [int(i) for i in rng.integers(0, largest, size=int(n))]
        for n in rng.choice([0, 1, 3, 64, 200], size=40)
    ]
    slices.append([largest - 1] * 64)  # (the largest sums this size allows)
    assert ledger.fingerprints(slices) == [ledger.fingerprint(s) for s in slices]
    assert ledger.fingerprints([]) == [] and ledger.fingerprints([[]]) == [ledger.EMPTY]
