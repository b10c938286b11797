"""Property tests of the plan (who computes which samples) and the step commit policy."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.plan import DataPrint, Plan, bounds, permutation, split, steps_per_epoch
from phalanx.policy import MAX_ATTEMPTS, decide
from phalanx.stream.order import StreamLayout

FAST = settings(max_examples=150, deadline=None)

unique_batches = st.lists(st.integers(min_value=0, max_value=10_000), unique=True, max_size=200)
members_st = st.integers(min_value=1, max_value=32)


# --- split -------------------------------------------------------------------------------


@FAST
@given(batch=unique_batches, members=members_st)
def test_split_concatenation_is_the_batch(batch: list[int], members: int) -> None:
    parts = split(batch, members)
    assert len(parts) == members
    assert [i for part in parts for i in part] == batch


@FAST
@given(batch=unique_batches, members=members_st)
def test_split_parts_are_disjoint(batch: list[int], members: int) -> None:
    parts = split(batch, members)
    seen: set[int] = set()
    for part in parts:
        assert seen.isdisjoint(part)
        seen.update(part)
    assert seen == set(batch)


@FAST
@given(batch=st.lists(st.integers(), max_size=200), members=members_st)
def test_split_sizes_differ_by_at_most_one_larger_first(batch: list[int], members: int) -> None:
    sizes = [len(p) for p in split(batch, members)]
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)
    assert sum(sizes) == len(batch)


@FAST
@given(data=st.data(), members=members_st)
def test_split_parts_non_empty_when_batch_has_enough(data: st.DataObject, members: int) -> None:
    n = data.draw(st.integers(min_value=members, max_value=members + 100))
    parts = split(list(range(n)), members)
    assert all(len(p) >= 1 for p in parts)


@FAST
@given(batch=st.lists(st.integers(), max_size=50), members=members_st)
def test_split_keeps_duplicates_and_order(batch: list[int], members: int) -> None:
    """Positions, not values, are split: repeated values are all kept, in order."""
    assert [i for p in split(batch, members) for i in p] == batch


def test_split_rejects_no_members() -> None:
    with pytest.raises(ValueError, match="members must be >= 1"):
        split([1, 2, 3], 0)


def test_split_small_examples() -> None:
    assert split([0, 1, 2, 3, 4], 2) == [[0, 1, 2], [3, 4]]
    assert split([0, 1], 3) == [[0], [1], []]
    assert split([], 2) == [[], []]


# --- permutation -------------------------------------------------------------------------

seeds = st.integers(min_value=0, max_value=2**32 - 1)
epochs = st.integers(min_value=0, max_value=10_000)


@FAST
@given(seed=seeds, epoch=epochs, n=st.integers(min_value=0, max_value=300))
def test_permutation_is_a_permutation(seed: int, epoch: int, n: int) -> None:
    order = permutation(seed, epoch, n)
    assert sorted(order) == list(range(n))
    assert all(type(i) is int for i in order)


@FAST
@given(seed=seeds, epoch=epochs, n=st.integers(min_value=0, max_value=300))
def test_permutation_is_stable_for_same_seed_and_epoch(seed: int, epoch: int, n: int) -> None:
    assert permutation(seed, epoch, n) == permutation(seed, epoch, n)


@FAST
@given(seed=seeds, epoch=epochs, n=st.integers(min_value=30, max_value=300))
def test_permutation_differs_across_epochs(seed: int, epoch: int, n: int) -> None:
    # n >= 30: two independent shuffles agree with probability <= 1/30!, i.e. never.
    assert permutation(seed, epoch, n) != permutation(seed, epoch + 1, n)


@FAST
@given(seed=seeds, epoch=epochs, n=st.integers(min_value=30, max_value=300))
def test_permutation_differs_across_seeds(seed: int, epoch: int, n: int) -> None:
    assert permutation(seed, epoch, n) != permutation(seed + 1, epoch, n)


@FAST
@given(seed=seeds, epoch=epochs, n=st.integers(min_value=0, max_value=300))
def test_no_shuffle_is_identity(seed: int, epoch: int, n: int) -> None:
    assert permutation(seed, epoch, n, shuffle=False) == list(range(n))


# --- Plan --------------------------------------------------------------------------------

plans = st.builds(
    Plan,
    samples=st.integers(min_value=1, max_value=300),
    batch_size=st.integers(min_value=1, max_value=64),
    seed=seeds,
    shuffle=st.booleans(),
    drop_last=st.booleans(),
)


def epoch_batches(plan: Plan, epoch: int) -> list[list[int]]:
    order = plan.order(epoch)
    return [plan.global_batch(epoch, s, order) for s in range(plan.steps)]


@FAST
@given(plan=plans, epoch=epochs)
def test_epoch_covers_every_sample_exactly_once_without_drop_last(plan: Plan, epoch: int) -> None:
    plan = Plan(plan.samples, plan.batch_size, plan.seed, plan.shuffle, drop_last=False)
    batches = epoch_batches(plan, epoch)
    flat = [i for b in batches for i in b]
    assert sorted(flat) == list(range(plan.samples))
    assert plan.steps == -(-plan.samples // plan.batch_size)
    assert all(len(b) == plan.batch_size for b in batches[:-1])
    assert 1 <= len(batches[-1]) <= plan.batch_size


@FAST
@given(plan=plans, epoch=epochs)
def test_epoch_with_drop_last_covers_all_but_the_remainder(plan: Plan, epoch: int) -> None:
    plan = Plan(plan.samples, plan.batch_size, plan.seed, plan.shuffle, drop_last=True)
    batches = epoch_batches(plan, epoch)
    flat = [i for b in batches for i in b]
    assert len(flat) == len(set(flat))  # nothing twice
    assert set(flat) <= set(range(plan.samples))
    assert plan.samples - len(flat) == plan.samples % plan.batch_size  # only the remainder left
    assert all(len(b) == plan.batch_size for b in batches)
    assert plan.steps == plan.samples // plan.batch_size
    # the left-out samples are the tail of this epoch's order
    assert flat == plan.order(epoch)[: len(flat)]


@FAST
@given(plan=plans, epoch=epochs, data=st.data())
def test_global_batch_does_not_depend_on_precomputed_order(
    plan: Plan, epoch: int, data: st.DataObject
) -> None:
    step = data.draw(st.integers(min_value=0, max_value=max(plan.steps - 1, 0)))
    assert plan.global_batch(epoch, step) == plan.global_batch(epoch, step, plan.order(epoch))


@FAST
@given(plan=plans, epoch=epochs, members=st.integers(min_value=1, max_value=8), data=st.data())
def test_local_batches_partition_the_global_batch(
    plan: Plan, epoch: int, members: int, data: st.DataObject
) -> None:
    """Membership decides who computes a global batch, never what it is."""
    step = data.draw(st.integers(min_value=0, max_value=max(plan.steps - 1, 0)))
    local = [plan.local_batch(epoch, step, m, members) for m in range(members)]
    assert [i for part in local for i in part] == plan.global_batch(epoch, step)


@FAST
@given(n=st.integers(min_value=0, max_value=10_000), b=st.integers(min_value=1, max_value=500))
def test_steps_per_epoch(n: int, b: int) -> None:
    assert steps_per_epoch(n, b, drop_last=True) * b <= n
    assert steps_per_epoch(n, b, drop_last=False) * b >= n
    assert 0 <= steps_per_epoch(n, b, False) - steps_per_epoch(n, b, True) <= 1


def test_plan_record_names_everything_resume_must_match() -> None:
    assert Plan(10, 3, 7, False, True, DataPrint("ab12", (1.0, 2.0, 3.0))).record() == {
        "samples": 10,
        "batch_size": 3,
        "seed": 7,
        "shuffle": False,
        "drop_last": True,
        "fingerprint": "ab12",
        "float_sums": [1.0, 2.0, 3.0],
        "probes": [],
        "stream": None,  # (an indexed dataset; a checkpoint written before streams has none)
    }
    stream = StreamLayout((4, 6), lanes=2, window=8, names="d1")
    record = Plan(10, 3, 7, stream=stream).record()["stream"]
    assert record["shards"] == "d1" and record["shard_count"] == 2
    assert (record["lanes"], record["shuffle_buffer"]) == (2, 8)
    other = Plan(10, 3, 7, stream=StreamLayout((5, 5), lanes=2, window=8, names="d1"))
    assert not other.matches(Plan(10, 3, 7, stream=stream).record())  # (other lengths)


def test_plan_matches_float_sums_within_a_tolerance_and_everything_else_exactly() -> None:
    plan = Plan(10, 3, 7, fingerprint=DataPrint("ab12", (1.0, 100.0, 2.0)))
    record = plan.record()
    assert plan.matches(record)
    last_bits = {**record, "float_sums": [1.0 + 1e-9, 100.0 - 1e-9, 2.0 + 1e-9]}
    assert plan.matches(last_bits)  # a transcendental's last bit, in another process
    assert not plan.matches({**record, "float_sums": [1.5, 100.0, 2.0]})  # another sample
    assert not plan.matches({**record, "fingerprint": "ab13"})  # another label, shape, dtype
    assert not plan.matches({**record, "float_sums": [1.0, 100.0]})  # another structure
    assert not plan.matches({**record, "seed": 8})
    assert not plan.matches("a plan of another version")
    old = {k: v for k, v in record.items() if k != "float_sums"}
    assert plan.matches({**old, "fingerprint": "written-by-0.0"})  # digest not comparable


# --- bounds ------------------------------------------------------------------------------


@FAST
@given(total=st.integers(min_value=0, max_value=500), parts=st.integers(min_value=1, max_value=64))
def test_bounds_are_contiguous_non_empty_near_equal_pieces(total: int, parts: int) -> None:
    pieces = bounds(total, parts)
    if total == 0:
        assert pieces == []
        return
    assert len(pieces) == min(parts, total)
    assert pieces[0][0] == 0
    assert pieces[-1][1] == total
    for (_, end), (start, _) in itertools.pairwise(pieces):
        assert end == start  # contiguous, no gap, no overlap
    sizes = [end - start for start, end in pieces]
    assert all(s >= 1 for s in sizes)
    assert max(sizes) - min(sizes) <= 1


@FAST
@given(total=st.integers(min_value=1, max_value=500), parts=st.integers(max_value=0))
def test_bounds_with_zero_or_negative_parts_is_one_piece(total: int, parts: int) -> None:
    assert bounds(total, parts) == [(0, total)]


# --- policy.decide -----------------------------------------------------------------------


@FAST
@given(attempt=st.integers(min_value=0, max_value=100))
def test_decide_commits_when_nobody_failed(attempt: int) -> None:
    assert decide(attempt, 0) == "commit"


@FAST
@given(failed=st.integers(min_value=1, max_value=64))
def test_decide_retries_different_failures_up_to_the_bound(failed: int) -> None:
    assert MAX_ATTEMPTS == 4
    assert [decide(a, failed) for a in range(5)] == ["retry"] * 3 + ["abort"] * 2


@FAST
@given(
    attempt=st.integers(min_value=0, max_value=20),
    failed=st.integers(min_value=0, max_value=8),
    max_attempts=st.integers(min_value=1, max_value=10),
    repeated=st.integers(min_value=0, max_value=2),
    data=st.data(),
)
def test_decide_rule(
    attempt: int, failed: int, max_attempts: int, repeated: int, data: st.DataObject
) -> None:
    splittable = data.draw(st.integers(min_value=0, max_value=max(failed - 1, 0)))
    repeated = min(repeated, failed)
    action = decide(attempt, failed, splittable, repeated=repeated, max_attempts=max_attempts)
    if failed == 0:
        assert action == "commit"
    elif repeated:
        assert action == "abort"  # evidence against the batch: a poison batch
    elif attempt + 1 < max_attempts:
        assert action == "retry"
    else:
        assert action == "abort"  # the step keeps failing


def test_decide_with_one_attempt_aborts_at_once() -> None:
    assert decide(0, 1, max_attempts=1) == "abort"
