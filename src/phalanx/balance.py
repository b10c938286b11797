"""Balance: each member's share of the global batch in proportion to its measured speed.

The plan fixes the global batch of every step; who computes which part of it is free (the
loss is scaled by each member's share, so the step's gradient does not depend on the split:
:mod:`phalanx.replica`). A member that is slower (a throttled GPU, a noisy neighbour) makes
every step wait for it. With ``fit(balance=True)``, the default, each member's vote carries
its *pace*: the seconds per sample of its own work in the step, from the step's start to
the moment its vote leaves (before the synchronised backward, so no wait for a peer counts),
and every member reads every member's pace from the vote (ddp: the ballot's slots; threads:
the replicas' votes). :class:`Balancer` turns those paces into shares, on every member alike
(the same floats in, the same shares out: no message of its own):

- each member's pace is smoothed (an exponential average, :data:`SMOOTHING`), steps whose
  pace is unknown for a member (no samples) leave its average as it was;
- every :data:`EVERY` committed steps the shares are re-decided: each member's share in
  proportion to its speed (1 / pace), and changed only when one share would move by more
  than :data:`DEAD_BAND` of itself in :data:`CONFIRM` decisions in a row (noise does not
  move them, so two runs on an even machine split alike and give the same bits); every
  share keeps at least one sample (:func:`sizes`);
- a member persistently slower than its peers (its pace above :data:`SLOW` times the
  median of the others') is named once, when first seen.

Shares start even with every new generation and every run (a resume starts even too): the
history is each generation's own, so a replacement and its peers decide alike. They apply
from the step after the decision (each engine re-cuts its slices of the epoch from there).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

EVERY = 8  # committed steps between two decisions
SMOOTHING = 0.3  # weight of a step's pace in the running average
DEAD_BAND = 0.15  # a share moves only when it would change by more than this of itself,
CONFIRM = 2  # in this many decisions in a row (noise moves no share: runs stay repeatable)
SLOW = 1.5  # a member this many times slower than the median of its peers is named
WARMUP = 3  # steps observed before the first decision (the first steps warm caches up)


def sizes(total: int, shares: Sequence[float]) -> list[int]:
    """``total`` samples cut in proportion to ``shares`` (largest remainders first, ties to
    the lower rank), each at least one when ``total`` allows; the same on every member."""
    n = len(shares)
    weight = sum(shares)
    if n == 0:
        return []
    if weight <= 0 or not all(math.isfinite(s) and s > 0 for s in shares):
        shares, weight = [1.0] * n, float(n)
    exact = [total * s / weight for s in shares]
    cut = [math.floor(x) for x in exact]
    order = sorted(range(n), key=lambda i: (-(exact[i] - cut[i]), i))
    for i in order[: total - sum(cut)]:
        cut[i] += 1
    if total >= n:  # every member computes something: take from the largest
        for i in range(n):
            while cut[i] < 1:
                donor = max(range(n), key=lambda j: (cut[j], -j))
                cut[donor] -= 1
                cut[i] += 1
    return cut


def peers_median(paces: Sequence[float], member: int) -> float:
    """The median of the other members' paces (the mean of the middle two for an even
    count; 0 without peers): what a member is compared with to be named slow."""
    others = sorted(p for j, p in enumerate(paces) if j != member)
    if not others:
        return 0.0
    half = len(others) // 2
    return others[half] if len(others) % 2 else (others[half - 1] + others[half]) / 2


def slower_than_peers(paces: Sequence[float], member: int) -> float | None:
    """How many times the median of its peers' time per sample ``member``'s pace is (None
    when unknown: no peers, or a pace that is not a positive number)."""
    middle = peers_median(paces, member)
    if not 0 <= member < len(paces) or middle <= 0 or not math.isfinite(middle):
        return None
    pace = paces[member]
    return pace / middle if pace > 0 and math.isfinite(pace) else None


def cut(batch: Sequence[int], shares: Sequence[float] | None, members: int) -> list[list[int]]:
    """``batch`` in ``members`` contiguous parts: even (:func:`phalanx.plan.split`) without
    ``shares``, else sized by :func:`sizes`."""
    from phalanx.plan import split

    if shares is None:
        return split(batch, members)
    parts, start = [], 0
    for size in sizes(len(batch), shares):
        parts.append(list(batch[start : start + size]))
        start += size
    return parts


@dataclass
class Decision:
    """New shares (one per member, summing to 1) from the next step on; ``slow``: members
    named slow for the first time; ``paces``: the smoothed seconds per sample it used."""

    shares: list[float]
    slow: list[int]
    paces: list[float]
    changed: bool
    too_slow: list[int] = field(default_factory=list)  # over fit(slow_worker=): put out


@dataclass
class Balancer:
    """The shares of one generation's ``members``, decided from the paces every member sees.
    ``enabled`` False keeps even shares (the paces are still watched: slow members named)."""

    members: int
    enabled: bool = True
    # fit(slow_worker=F): a member F times slower than the median of its peers is put out
    limit: float | None = None
    shares: list[float] = field(default_factory=list)
    paces: list[float] = field(default_factory=list)  # smoothed seconds per sample
    seen: int = 0  # committed steps observed
    named: set[int] = field(default_factory=set)
    beyond: int = 0  # decisions in a row whose proposal left the dead band
    over: dict[int, int] = field(default_factory=dict)  # decisions in a row over the limit

    def __post_init__(self) -> None:
        if not self.shares:
            self.shares = [1.0 / self.members] * self.members

    @property
    def even(self) -> bool:
        return all(s == self.shares[0] for s in self.shares)

    def observe(self, paces: Sequence[float]) -> Decision | None:
        """Take one committed step's paces (``len == members``); a :class:`Decision` when
        shares change or a member is named slow, else None."""
        if len(paces) != self.members:
            return None
        for i, pace in enumerate(paces):
            if pace > 0 and math.isfinite(pace):
                old = self.paces[i] if i < len(self.paces) else 0.0
                mixed = pace if old <= 0 else SMOOTHING * pace + (1 - SMOOTHING) * old
                if i < len(self.paces):
                    self.paces[i] = mixed
                else:
                    self.paces.append(mixed)
        self.seen += 1
        if len(self.paces) != self.members or self.seen < WARMUP or self.seen % EVERY:
            return None
        slow = [i for i in self.slow_members() if i not in self.named]
        self.named.update(slow)
        shares = self._proposed() if self.enabled else self.shares
        outside = any(
            abs(new - old) > DEAD_BAND * old for new, old in zip(shares, self.shares, strict=True)
        )
        self.beyond = self.beyond + 1 if outside else 0
        moved = self.beyond >= CONFIRM
        if moved:
            self.shares, self.beyond = shares, 0
        too_slow = self.too_slow()
        if not moved and not slow and not too_slow:
            return None
        return Decision(list(self.shares), slow, list(self.paces), moved, too_slow)

    def too_slow(self) -> list[int]:
        """Members slower than the ``limit`` (times the median of their peers), if set, in
        :data:`CONFIRM` decisions in a row: one noisy stretch (a loaded machine, a peer's
        hiccup that moves the median of two) puts no one out. Called once per decision."""
        if self.limit is None:
            return []
        for i in range(self.members):
            ratio = slower_than_peers(self.paces, i)
            over = ratio is not None and ratio > self.limit
            self.over[i] = self.over.get(i, 0) + 1 if over else 0
        return [i for i in range(self.members) if self.over[i] >= CONFIRM]

    def slow_members(self) -> list[int]:
        """Members whose smoothed pace is above :data:`SLOW` times the median of the others'."""
        if self.members < 2 or len(self.paces) != self.members:
            return []
        found = []
        for i, pace in enumerate(self.paces):
            middle = peers_median(self.paces, i)
            if middle > 0 and pace > SLOW * middle:
                found.append(i)
        return found

    def _proposed(self) -> list[float]:
        speeds = [1.0 / p for p in self.paces]
        total = sum(speeds)
        return [s / total for s in speeds]
