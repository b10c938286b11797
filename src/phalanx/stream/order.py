"""The order of a stream's epoch: a pure function of ``(seed, epoch)``, the shards' lengths,
the lanes and the shuffle window. No torch, no reading.

A stream cannot be indexed at random, so its epoch is not a permutation of every sample.
Instead (sample ``i`` is sample ``i - base[s]`` of shard ``s``, in the order of the shard
list):

1. the shards are put in a seeded order (``shuffle=False``: the list's order);
2. dealt to ``lanes`` lanes, each shard to the lane that holds the fewest samples so far,
   so that lanes are as long as one another within one shard;
3. each lane is its shards read front to back, shuffled within consecutive blocks of
   ``window`` samples (a bounded shuffle: a sample moves less than ``window`` places in
   its lane; not a full permutation);
4. each global batch takes its samples lane after lane: an even share of the batch from
   every lane that still has samples (a lane that runs out gives its share to the others).

Step ``s`` is then rows ``s * batch_size ...`` of this order as for an indexed dataset, and
the members cut each global batch into contiguous parts as always. Because a batch is laid
out lane after lane, a member's part covers a few whole lanes and at most two partial
ones: each member reads about its own part of the stream (plus the two partial lanes),
front to back, instead of every member reading everything.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

_SHARDS, _BLOCKS = 1, 2  # (streams of the epoch's seeded generator: one use each)


@dataclass(frozen=True)
class StreamLayout:
    """What a stream's epoch order depends on besides ``(seed, epoch)`` and the batch."""

    lengths: tuple[int, ...]
    lanes: int
    window: int
    names: str = ""  # a digest of the shard list (the plan record compares it)

    @property
    def samples(self) -> int:
        return sum(self.lengths)

    def bases(self) -> list[int]:
        return shard_bases(self.lengths)

    def lane_shards(self, seed: int, epoch: int, shuffle: bool) -> list[list[int]]:
        """Which shards each lane reads in ``epoch``, in order."""
        count = len(self.lengths)
        if shuffle:
            order = np.random.default_rng([seed, epoch, _SHARDS]).permutation(count).tolist()
        else:
            order = list(range(count))
        lanes = max(1, min(self.lanes, count))
        heap = [(0, lane) for lane in range(lanes)]
        dealt: list[list[int]] = [[] for _ in range(lanes)]
        for shard in order:
            held, lane = heapq.heappop(heap)
            dealt[lane].append(shard)
            heapq.heappush(heap, (held + self.lengths[shard], lane))
        return dealt

    def lane_orders(self, seed: int, epoch: int, shuffle: bool) -> list[np.ndarray]:
        """Each lane's samples (global indices) in the order the epoch uses them."""
        bases = self.bases()
        out = []
        for lane, shards in enumerate(self.lane_shards(seed, epoch, shuffle)):
            parts = [np.arange(bases[s], bases[s] + self.lengths[s]) for s in shards]
            seq = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
            if shuffle and self.window > 1:
                rng = np.random.default_rng([seed, epoch, _BLOCKS, lane])
                for start in range(0, len(seq), self.window):
                    block = seq[start : start + self.window]
                    seq[start : start + self.window] = block[rng.permutation(len(block))]
            out.append(seq)
        return out

    def order(self, seed: int, epoch: int, shuffle: bool, batch_size: int) -> list[int]:
        """The epoch's samples, batch after batch, each batch laid out lane after lane."""
        lanes = self.lane_orders(seed, epoch, shuffle)
        left = [len(seq) for seq in lanes]
        at = [0] * len(lanes)
        pieces: list[np.ndarray] = []
        total = sum(left)
        while total:
            quota = quotas(min(batch_size, total), left)
            for lane, take in enumerate(quota):
                if take:
                    pieces.append(lanes[lane][at[lane] : at[lane] + take])
                    at[lane] += take
                    left[lane] -= take
            total = sum(left)
        if not pieces:
            return []
        result: list[int] = np.concatenate(pieces).tolist()
        return result


def quotas(batch: int, left: list[int]) -> list[int]:
    """How many samples each lane gives to a batch of ``batch``: as even as can be among the
    lanes with samples left (the first ones one more), none more than it has left; what a
    short lane cannot give goes to the others."""
    take = [0] * len(left)
    need = batch
    while need:
        open_lanes = [i for i, n in enumerate(left) if n - take[i] > 0]
        if not open_lanes:
            break
        base, extra = divmod(need, len(open_lanes))
        for rank, lane in enumerate(open_lanes):
            want = base + (1 if rank < extra else 0)
            got = min(want, left[lane] - take[lane])
            take[lane] += got
            need -= got
    return take


def shard_bases(lengths: Sequence[int]) -> list[int]:
    """Index of each shard's first sample (shards in the order of the list)."""
    return [0, *itertools.accumulate(lengths[:-1])]


def names_digest(shards: list[object]) -> str:
    """A digest of the shard list (by ``repr``: names are opaque)."""
    digest = hashlib.sha256()
    for name in shards:
        digest.update(repr(name).encode())
        digest.update(b"\0")
    return digest.hexdigest()[:16]
