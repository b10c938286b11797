"""Decisions as pure functions, testable without processes.

:func:`decide` is the step's commit rule: all voted ok -> commit; a first failed attempt ->
retry the same global batch with the same members; a second -> abort (a poison batch: a bug
in user code or a bad sample must not cascade into killing healthy workers).
"""

from __future__ import annotations

from typing import Literal

StepAction = Literal["commit", "retry", "abort"]

MAX_RETRIES = 1


def decide(attempt: int, failed: int, max_retries: int = MAX_RETRIES) -> StepAction:
    """``attempt`` is 0 for the first try of a step; ``failed`` the members that voted failed."""
    if failed == 0:
        return "commit"
    return "retry" if attempt < max_retries else "abort"
