"""The plan: which samples each member computes at each step. Pure functions, no torch.

Step ``s`` of epoch ``e`` always consumes slice ``s`` of a permutation seeded by
``(seed, e)``: the global batch. Membership only decides who computes which part of it
(:func:`split`), never what is computed, so a failure, a shrink or a respawn leaves the
math and the data ledger unchanged.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from phalanx.stream.order import StreamLayout


def permutation(seed: int, epoch: int, n: int, shuffle: bool = True) -> list[int]:
    """The order of the ``n`` samples in ``epoch``; the same for the same (seed, epoch)."""
    if not shuffle:
        return list(range(n))
    rng = np.random.default_rng([seed, epoch])
    order: list[int] = rng.permutation(n).tolist()
    return order


def steps_per_epoch(n: int, batch_size: int, drop_last: bool) -> int:
    """Number of global batches in an epoch of ``n`` samples."""
    return n // batch_size if drop_last else -(-n // batch_size)


def split(batch: Sequence[int], members: int) -> list[list[int]]:
    """Cut ``batch`` into ``members`` contiguous parts whose sizes differ by at most one
    (the first parts are the larger). Parts are non-empty whenever ``len(batch) >= members``."""
    if members < 1:
        raise ValueError("members must be >= 1")
    base, extra = divmod(len(batch), members)
    parts: list[list[int]] = []
    start = 0
    for m in range(members):
        end = start + base + (1 if m < extra else 0)
        parts.append(list(batch[start:end]))
        start = end
    return parts


def bounds(total: int, parts: int) -> list[tuple[int, int]]:
    """``(start, end)`` of each of ``parts`` contiguous, near-equal, non-empty pieces of
    ``range(total)`` (fewer pieces when ``total < parts``): how a local batch is cut into
    micro-batches."""
    parts = max(1, min(parts, total))
    cuts = split(range(total), parts)
    return [(p[0], p[-1] + 1) for p in cuts if p]


@dataclass(frozen=True)
class DataPrint:
    """A dataset's fingerprint: ``digest`` hashes a few samples' structure and exact values
    (dtypes, shapes, integers, strings); ``sums`` holds three sums per floating-point leaf
    (its sum, sum of magnitudes and a position-weighted sum), compared with a tolerance:
    torch's vectorized transcendentals (``tanh``, ``exp``) may differ in the last bit
    between two processes (the buffer's alignment picks the code path), so float bytes
    cannot be hashed exactly without telling a dataset apart from itself."""

    digest: str
    sums: tuple[float, ...] = ()
    # Per sample read: (dataset index, a digest of that sample alone, how many of ``sums``
    # are its own), in the order of ``sums``: what lets a refusal say which samples differ.
    probes: tuple[tuple[int, str, int], ...] = ()


def same_data(a: DataPrint, b: DataPrint, rel: float = 1e-5) -> bool:
    """Whether two fingerprints are of the same data: equal digests, and float sums equal
    within ``rel`` of each leaf's magnitude (last-bit differences, never another sample)."""
    if a.digest != b.digest or len(a.sums) != len(b.sums):
        return False
    for i in range(0, len(a.sums), 3):
        mine, theirs = a.sums[i : i + 3], b.sums[i : i + 3]
        scale = max(abs(mine[1]), abs(theirs[1]), 1e-30)
        if any(abs(x - y) > rel * scale for x, y in zip(mine, theirs, strict=True)):
            return False
    return True


# The plan record's fields about the data's contents (compared with a tolerance).
DATA_FIELDS = ("fingerprint", "float_sums", "probes")


def data_difference(then: DataPrint, now: DataPrint, rel: float = 1e-5) -> str:
    """Which of the samples read for two fingerprints differ, and how, in words (for a
    refusal; ``then``/``now`` may be a checkpoint's and this run's, or two nodes')."""
    if not then.probes or not now.probes:  # (a record written before per-sample probes)
        return "the contents of the samples phalanx reads differ"
    if [p[0] for p in then.probes] != [p[0] for p in now.probes]:
        return "phalanx read other samples (another phalanx version's fingerprint)"
    changed, values_only, worst = [], True, 0.0
    a = b = 0
    for (index, d_then, n_then), (_, d_now, n_now) in zip(then.probes, now.probes, strict=True):
        mine, theirs = then.sums[a : a + n_then], now.sums[b : b + n_now]
        a, b = a + n_then, b + n_now
        gap = _relative_gap(mine, theirs) if n_then == n_now else math.inf
        if d_then == d_now and gap <= rel:
            continue
        changed.append(index)
        values_only = values_only and d_then == d_now
        worst = max(worst, gap)
    if not changed:
        return "the samples phalanx reads are the same"
    shown = ", ".join(str(i) for i in changed)
    of = f"{len(changed)} of the {len(now.probes)} samples phalanx reads (indices {shown})"
    if values_only:
        return (
            f"{of} hold other floating-point values (up to {worst:.2g} apart, relative to "
            "their magnitude), with the same shapes, dtypes and integers (labels): data made "
            "at random each run (torch.randn/torch.rand or numpy without a fixed seed, a "
            "random augmentation outside the dataset)"
        )
    return (
        f"{of} differ in shapes, dtypes, integers (labels) or text: another dataset, the same "
        "one in another order (a random_split without generator=torch.Generator()"
        ".manual_seed(0), a shuffled file list), or other preprocessing"
    )


def _relative_gap(mine: Sequence[float], theirs: Sequence[float]) -> float:
    """The largest difference of two samples' float sums, relative to their magnitudes."""
    worst = 0.0
    for i in range(0, len(mine), 3):
        scale = max(abs(mine[i + 1]), abs(theirs[i + 1]), 1e-30)
        for x, y in zip(mine[i : i + 3], theirs[i : i + 3], strict=True):
            worst = max(worst, abs(x - y) / scale)
    return worst


def stream_record(layout: StreamLayout) -> dict[str, Any]:
    """A stream's part of the plan record: its shard list (a digest of the names), each
    shard's length (a digest, and the count), its lanes and shuffle window."""
    lengths = hashlib.sha256(repr(layout.lengths).encode()).hexdigest()[:16]
    return {
        "shards": layout.names,
        "shard_count": len(layout.lengths),
        "lengths": lengths,
        "lanes": layout.lanes,
        "shuffle_buffer": layout.window,
    }


def print_of(record: dict[str, Any]) -> DataPrint:
    """The data fingerprint inside a plan record (``Plan.record()``)."""
    probes = tuple((int(i), str(d), int(n)) for i, d, n in record.get("probes") or [])
    sums = tuple(float(v) for v in record.get("float_sums") or [])
    return DataPrint(str(record.get("fingerprint", "")), sums, probes)


def plan_difference(saved: dict[str, Any], now: Plan) -> tuple[list[str], str | None]:
    """How a plan record differs from ``now``'s: ``(fields, data)``: the plan's fields
    that differ, each as ``"name then -> now"``, and the data's difference in words (None
    when the data is the same)."""
    record = now.record()
    fields = [
        f"{k} {saved.get(k)!r} -> {record[k]!r}"
        for k in record
        if k not in DATA_FIELDS and saved.get(k) != record[k]
    ]
    then = print_of(saved)
    resized = saved.get("samples") != record["samples"]  # (other samples read: says itself)
    same = resized or "float_sums" not in saved or same_data(then, now.fingerprint)
    return fields, None if same else data_difference(then, now.fingerprint)


@dataclass(frozen=True)
class Plan:
    """The plan of one run: dataset size, global batch size and seed. ``fingerprint`` is of
    a few samples' contents (``data.fingerprint``): a checkpoint of another dataset of the
    same size does not match the record (``matches``)."""

    samples: int
    batch_size: int
    seed: int = 0
    shuffle: bool = True
    drop_last: bool = False
    fingerprint: DataPrint = DataPrint("")
    # A streamed dataset (``px.Stream``): its epoch order is laid out in lanes of shards
    # read front to back (:mod:`phalanx.stream.order`), not a permutation of every sample.
    stream: StreamLayout | None = None

    @property
    def steps(self) -> int:
        return steps_per_epoch(self.samples, self.batch_size, self.drop_last)

    def order(self, epoch: int) -> list[int]:
        if self.stream is not None:
            return self.stream.order(self.seed, epoch, self.shuffle, self.batch_size)
        return permutation(self.seed, epoch, self.samples, self.shuffle)

    def global_batch(self, epoch: int, step: int, order: Sequence[int] | None = None) -> list[int]:
        """Sample indices of step ``step`` of ``epoch`` (pass ``order`` to avoid recomputing)."""
        order = self.order(epoch) if order is None else order
        return list(order[step * self.batch_size : (step + 1) * self.batch_size])

    def record(self) -> dict[str, object]:
        """What a checkpoint must match to be resumed by this plan."""
        return {
            "samples": self.samples,
            "batch_size": self.batch_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "fingerprint": self.fingerprint.digest,
            "float_sums": list(self.fingerprint.sums),
            "probes": [list(p) for p in self.fingerprint.probes],
            "stream": None if self.stream is None else stream_record(self.stream),
        }

    def matches(self, saved: object) -> bool:
        """Whether a checkpoint's plan record (``record()`` then) fits this plan: every
        field equal, the data's float sums within a tolerance (``same_data``)."""
        if not isinstance(saved, dict):
            return False
        now = self.record()
        if any(saved.get(k) != now[k] for k in now if k not in DATA_FIELDS):
            return False
        if "float_sums" not in saved:  # written before float sums: its digest is not this one
            return True
        then = DataPrint(str(saved.get("fingerprint", "")), tuple(saved["float_sums"]))
        return same_data(then, self.fingerprint)

    def local_batch(self, epoch: int, step: int, member: int, members: int) -> list[int]:
        return split(self.global_batch(epoch, step), members)[member]
