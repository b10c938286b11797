"""Decisions as pure functions, testable without processes.

:func:`recover` is the run's rule when a worker falls: respawn, shrink or abort
(:class:`Recovery` is the user's policy).

:func:`decide` is the step's commit rule: all voted ok -> commit; a first failed attempt ->
retry the same global batch with the same members; a second -> abort (a poison batch: a bug
in user code or a bad sample must not cascade into killing healthy workers).

:func:`failed_attempts` and :func:`is_poison` carry that rule across generations (ddp): a
worker that dies or hangs fails the attempt it was in, and the next generation computes the
step again as its next attempt.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

from phalanx.failures import WorkerFailure

StepAction = Literal["commit", "skip", "retry", "split", "abort"]

MAX_RETRIES = 1


def decide(
    attempt: int,
    failed: int,
    splittable: int = 0,
    max_retries: int = MAX_RETRIES,
    contract: int = 0,
    overflow: int = 0,
) -> StepAction:
    """The commit rule of one step attempt, the same on every member.

    ``attempt`` counts the retries of this step so far; ``failed`` the members that voted
    failed; ``splittable`` those of them that ran out of memory and can still cut their share
    into smaller micro-batches; ``contract`` those whose step function broke its contract (a
    non-scalar or non-finite loss, a wrong return type: the same again on a retry, so the
    run stops at once). When every failure is such an out-of-memory, the step is tried
    again with the split ("split": no retry is used up, the global batch and the math are
    unchanged). Otherwise a step is retried once, then the run aborts (poison batch).
    ``overflow`` counts the members whose gradients were not finite under ``"16-mixed"``
    precision: with no failure, the step is committed without an optimizer step ("skip",
    on every member; the loss scale backs off). Not a failure: nothing is retried.
    """
    if failed == 0:
        return "skip" if overflow else "commit"
    if contract:
        return "abort"
    if splittable == failed:
        return "split"
    return "retry" if attempt < max_retries else "abort"


# Phases in which a worker computes its share of a step's global batch: a failure there
# fails that attempt of the step (two failed attempts make a poison batch, whatever kinds).
STEP_PHASES = ("data", "forward", "backward", "metrics", "sync")


def counts_as_attempt(failure: WorkerFailure, secondary: bool = False) -> bool:
    """Whether ``failure`` failed an attempt of its step: it happened while the worker
    computed its share (``STEP_PHASES``), in a known attempt, and is neither a survivor's
    ``secondary`` error (a peer's closed socket) nor an out-of-memory split or a failure
    that came after the run was decided."""
    return (
        failure.phase in STEP_PHASES
        and failure.attempt is not None
        and failure.step is not None
        and failure.action not in ("split", "ignored")
        and not secondary
    )


def failed_attempts(history: list[tuple[WorkerFailure, bool]]) -> dict[int, int]:
    """Global step -> how many attempts of it have failed, from ``(failure, secondary)``
    pairs: one more than the highest attempt any counted failure of the step was in. Two
    workers killed in the same attempt fail one attempt; a vote-carried failure and a death
    in the retry fail two."""
    failed: dict[int, int] = {}
    for failure, secondary in history:
        if counts_as_attempt(failure, secondary):
            assert failure.step is not None and failure.attempt is not None
            failed[failure.step] = max(failed.get(failure.step, 0), failure.attempt + 1)
    return failed


def is_poison(failure: WorkerFailure, secondary: bool = False) -> bool:
    """Whether ``failure`` fails a step that had already failed before: the attempt it was in
    is a retry (attempt numbers count failed attempts over the run). The loop applies the
    same rule to failures its vote carries (:func:`decide`); this one is for deaths, hangs
    and failures that broke the group, which the supervisor judges."""
    if not counts_as_attempt(failure, secondary):
        return False
    assert failure.attempt is not None
    return decide(failure.attempt, failed=1) == "abort"


RecoveryAction = Literal["respawn", "shrink", "abort"]
RECOVERY_MODES = ("respawn", "shrink", "abort")
# An exception in these phases is not one worker's accident: the same model, data, metric or
# disk fails the same way on any worker, so replacing or dropping the worker cannot help. A
# death or a hang in them (the OOM killer during validation, say) is recovered like any other,
# except in preflight, whose point is to stop before training starts.
RUN_LEVEL_PHASES = ("preflight", "checkpoint", "metrics", "validation")
RUN_LEVEL_KINDS = ("exception", "oom")


@dataclass(frozen=True)
class Recovery:
    """What a ddp run does when a worker falls (dies, hangs, or fails where no vote can
    absorb it).

    - ``respawn`` (default): the survivors go on at once, and a replacement started on the
      fallen worker's device joins them at a step boundary, up to ``max_restarts`` times in
      the run; after that, as ``shrink``.
    - ``shrink``: the survivors go on without it, down to ``min_workers``.
    - ``abort``: the run stops with one report.

    A poison batch (the same step failing twice), any failure in preflight and an exception
    in validation, metrics or checkpoint (``RUN_LEVEL_PHASES``) stop the run in every mode.
    ``hang_timeout`` (None: fit's ``hang_timeout``) is how long a worker may make no
    progress while its peers wait.
    """

    mode: str = "respawn"
    max_restarts: int = 3
    min_workers: int = 1
    hang_timeout: timedelta | None = None

    def __post_init__(self) -> None:
        from phalanx.errors import InvalidSettingError

        if self.mode not in RECOVERY_MODES:
            raise InvalidSettingError(
                f"Recovery mode {self.mode!r} is unknown; use one of {', '.join(RECOVERY_MODES)}"
            )
        if self.max_restarts < 0 or self.min_workers < 1:
            raise InvalidSettingError("Recovery needs max_restarts >= 0 and min_workers >= 1")
        if self.hang_timeout is not None and self.hang_timeout.total_seconds() <= 0:
            raise InvalidSettingError("Recovery hang_timeout must be a positive timedelta")


def recover(
    policy: Recovery, failure: WorkerFailure, history: list[WorkerFailure], survivors: int
) -> RecoveryAction:
    """The decision for a fallen worker: a pure function of the policy, the failure, the
    failures before it (with the actions taken) and how many members are left."""
    run_level = failure.phase == "preflight" or (
        failure.kind in RUN_LEVEL_KINDS and failure.phase in RUN_LEVEL_PHASES
    )
    if policy.mode == "abort" or run_level or survivors < 1:
        return "abort"
    restarts = sum(1 for f in history if f.action == "respawned")
    if policy.mode == "respawn" and restarts < policy.max_restarts:
        return "respawn"
    return "shrink" if survivors >= policy.min_workers else "abort"
