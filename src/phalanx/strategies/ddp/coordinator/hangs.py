"""Finding the hung worker among stalled ones (pure functions of slots and stacks)."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Protocol, TypeVar

from phalanx.failures import phase_rank  # (the order of phases, shared with the panel)


class Watched(Protocol):
    step: int
    phase: str
    progress_at: float


W = TypeVar("W", bound=Watched)


def stalled(watched: Mapping[int, W], now: float, limit: Callable[[W], float]) -> bool:
    """Every watched worker has been silent for its limit, counted from its own progress."""
    return all(now - s.progress_at >= limit(s) for s in watched.values())


def tied_behind(watched: Mapping[int, Watched]) -> list[int]:
    """The workers furthest behind (step, then phase): the others wait for them."""
    behind = min((s.step, phase_rank(s.phase)) for s in watched.values())
    return [k for k, s in watched.items() if (s.step, phase_rank(s.phase)) == behind]


def waits_in_collective(stacks: str) -> bool:
    """Whether some thread's innermost Python frame is inside torch's distributed or
    autograd code, or in a collective of the generation's group (``group.py``, and the wait
    on its futures): a rank blocked there is waiting for a peer, not hung itself."""
    lines = stacks.splitlines()
    innermost = [
        lines[i + 1]
        for i, line in enumerate(lines)
        if "most recent call first" in line and i + 1 < len(lines)
    ]
    markers = (
        "torch/distributed",
        "torch/autograd",
        "torch/nn/parallel",
        "torch/futures",
        "ddp/worker/group.py",
    )
    return any(m in frame for frame in innermost for m in markers)


# Where a worker leaves a broken group and waits for, or forms, the next generation: phalanx's
# own regroup path, bounded by its own timeouts (a worker found there is not hung).
REGROUP_FRAMES = re.compile(
    r'ddp/worker/worker\.py", line \d+ in '
    r"(leave_group|left_by|report_unvoted|wait_generation|arrive)\b"
)


def regrouping(stacks: str) -> bool:
    """Whether the worker is on its way to the next generation (see REGROUP_FRAMES)."""
    return REGROUP_FRAMES.search(stacks) is not None


def hung_among(tied: list[int], stacks: Mapping[int, str]) -> list[int]:
    """The hung ones among the stalled workers furthest behind: those neither waiting in a
    collective nor regrouping; if all wait in collectives (a deadlock), all of them; none
    while one is still regrouping (its silence is a broken group's, not its own)."""
    moving = [k for k in tied if not regrouping(stacks.get(k, ""))]
    if len(moving) < len(tied):
        return [k for k in moving if not waits_in_collective(stacks.get(k, ""))]
    return [k for k in tied if not waits_in_collective(stacks.get(k, ""))] or tied
