"""Bad samples: tell bad data from a bad worker, find the samples, leave them out.

With ``fit(on_bad_sample="skip")`` a failure that repeats on the same samples (an exception,
or a loss that is not finite) no longer stops the run as a poison batch. Every member takes
the same steps, decided from the votes alone (each member's row of the ballot says whether
it failed and which samples it found bad), so no message of its own is needed:

1. **Blame**: the step is attempted again with its parts rotated (:class:`Twist`
   ``rotation=1``: the part that failed is computed by the next member). Whoever holds a
   suspect part bisects it on failure. If the part passes on the other member, the member
   that failed on it is at fault (it is put out: respawn or shrink under ddp); if it fails
   there too, the data is. One device has nobody to ask: the data is suspected at once.
2. **Bisection** (:func:`find_bad`), on the member that failed, alone: forward passes on
   halves of its part (no backward, no collective; buffers and random state kept), down
   to single samples, so one bad sample among 64 costs about 2 log2(64) forward passes of
   ever smaller pieces, not 64 steps. A sample that raises while being read is found the
   same way. Up to :data:`BAD_SLOTS` found samples travel in that member's vote.
3. **Quarantine**: the found samples are left out of their global batch (the step's loss
   is the mean over the rest: each member's share is scaled by the samples kept), the step
   is committed, and the same samples are left out of every later epoch without failing
   again. The ledger accounts for them (computed exactly once until quarantined, left out
   from then on) and ``FitResult.quarantined``, ``run_dir/quarantine.json`` and the summary
   list each with its error. ``max_bad_samples`` stops the run when data is broken
   wholesale.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

BAD_SLOTS = 8  # found samples one member's vote can carry per attempt
ON_BAD_SAMPLE = ("stop", "skip")


@dataclass(frozen=True)
class Twist:
    """How one attempt of a step differs from the plan's: ``leave_out`` samples of its global
    batch are not computed (quarantined ones, and none else); parts are handed ``rotation``
    members on (member ``m`` computes part ``(m - rotation) % members``); ``bisect``: the parts
    whose holder, when it fails on one, finds the bad samples in it before it votes (only a
    suspect part: a member at fault failing on another part must not blame its samples)."""

    leave_out: frozenset[int] = frozenset()
    rotation: int = 0
    bisect: frozenset[int] = frozenset()  # the parts whose holder bisects them on failure

    @property
    def plain(self) -> bool:
        return not self.leave_out and not self.rotation and not self.bisect


PLAIN = Twist()


def find_bad(samples: Sequence[int], fails: Callable[[list[int]], str | None]) -> dict[int, str]:
    """The samples of ``samples`` that fail alone, with their errors: ``fails(part)`` runs
    ``part`` (None: it passed, else the error). Halves are tested and only failing halves
    split further; a half that passes is clean. Stops after :data:`BAD_SLOTS` found."""
    found: dict[int, str] = {}
    pending = [list(samples)]
    while pending and len(found) < BAD_SLOTS:
        part = pending.pop(0)
        if len(part) == 1:
            error = fails(part)
            if error is not None:
                found[part[0]] = error
            continue
        half = len(part) // 2
        for piece in (part[:half], part[half:]):
            if fails(piece) is not None:
                pending.append(piece)
    return found


@dataclass
class Triage:
    """One step's course under ``on_bad_sample="skip"``, the same on every member (it reads
    only what every member's vote says). ``suspects``: the parts (by index) whose holders
    failed alike in two attempts."""

    members: int
    stage: str = "plain"  # plain -> blame (rotated, bisecting) -> kept (leaving out)
    suspects: list[int] = field(default_factory=list)
    faulty: list[int] = field(default_factory=list)  # members found at fault (blame)

    def after_repeat(self, failed_ranks: Sequence[int]) -> Twist:
        """A failure repeated: the next attempt rotates the parts (blame) and bisects on
        failure; alone, it only bisects."""
        self.suspects = sorted(failed_ranks) or [0]
        self.stage = "blame"
        return Twist(rotation=1 if self.members > 1 else 0, bisect=frozenset(self.suspects))

    def at_fault(self, failed_ranks: Sequence[int]) -> list[int]:
        """After the blame attempt: the members that failed on a part which then passed on
        another member (rotation 1: part ``p`` was held by ``p + 1``)."""
        if self.members < 2:
            return []
        failed = set(failed_ranks)
        return [p for p in self.suspects if (p + 1) % self.members not in failed]
