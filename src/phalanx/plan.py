"""The plan: which samples each member computes at each step. Pure functions, no torch.

Step ``s`` of epoch ``e`` always consumes slice ``s`` of a permutation seeded by
``(seed, e)``: the global batch. Membership only decides who computes which part of it
(:func:`split`), never what is computed, so a failure, a shrink or a respawn leaves the
math and the data ledger unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


def permutation(seed: int, epoch: int, n: int, shuffle: bool = True) -> list[int]:
    """The order of the ``n`` samples in ``epoch``; the same for the same (seed, epoch)."""
    if not shuffle:
        return list(range(n))
    rng = np.random.default_rng([seed, epoch])
    return [int(i) for i in rng.permutation(n)]


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
class Plan:
    """The plan of one run: dataset size, global batch size and seed. ``fingerprint`` is a
    hash of a few samples' contents (``data.fingerprint``): a checkpoint of another dataset of
    the same size does not match the record."""

    samples: int
    batch_size: int
    seed: int = 0
    shuffle: bool = True
    drop_last: bool = False
    fingerprint: str = ""

    @property
    def steps(self) -> int:
        return steps_per_epoch(self.samples, self.batch_size, self.drop_last)

    def order(self, epoch: int) -> list[int]:
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
            "fingerprint": self.fingerprint,
        }

    def local_batch(self, epoch: int, step: int, member: int, members: int) -> list[int]:
        return split(self.global_batch(epoch, step), members)[member]
