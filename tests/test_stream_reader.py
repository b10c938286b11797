"""A stream's reader reads each sample of its part once: the shuffle window's samples, asked
for out of order, come from what a cursor kept, not from opening the shard again."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import pytest

import phalanx as px
from phalanx.plan import Plan

SHARDS, LENGTH, BATCH = 4, 600, 64
READS: Counter[tuple[int, int]] = Counter()  # (shard, offset) -> times read


def read(shard: int) -> Iterator[int]:
    for offset in range(LENGTH):
        READS[shard, offset] += 1
        yield shard * LENGTH + offset


def read_at(shard: int, start: int) -> Iterator[int]:
    for offset in range(start, LENGTH):
        READS[shard, offset] += 1
        yield shard * LENGTH + offset


def served(seek: bool, first_step: int) -> tuple[px.Stream, Plan]:
    """A fresh stream (2 lanes, window 100) whose reader served every step of epoch 0 from
    ``first_step`` on (a resume's place), in the plan's order."""
    READS.clear()
    stream = px.Stream(
        list(range(SHARDS)), read_at if seek else read, lengths=[LENGTH] * SHARDS,
        shuffle_buffer=100, lanes=2,
    )  # fmt: skip
    plan = Plan(len(stream), BATCH, seed=3, stream=stream.layout())
    order = plan.order(0)
    for step in range(first_step, plan.steps):
        for index in plan.global_batch(0, step, order):
            assert stream[index] == index
    return stream, plan


@pytest.mark.parametrize("seek", [False, True])
def test_a_whole_epoch_reads_every_sample_once(seek: bool) -> None:
    stream, _ = served(seek, 0)
    assert stream.reader().skipped == 0
    assert sorted(READS) == [(s, o) for s in range(SHARDS) for o in range(LENGTH)]
    assert set(READS.values()) == {1}


@pytest.mark.parametrize("seek", [False, True])
def test_from_mid_epoch_no_sample_is_read_twice(seek: bool) -> None:
    half = SHARDS * LENGTH // BATCH // 2
    stream, _ = served(seek, half)
    assert set(READS.values()) == {1}
    skipped = stream.reader().skipped
    if seek:
        assert skipped == 0
    else:  # each lane read and dropped up to its place, less two shuffle windows at most
        place = half * BATCH // 2  # (in the first shard of each lane)
        assert 2 * (place - 2 * 100) <= skipped <= 2 * place
