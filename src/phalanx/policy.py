"""Decisions as pure functions, testable without processes.

:func:`recover` is the run's rule when a worker falls: respawn, shrink, restart from the
newest snapshot or checkpoint (every member fell) or abort (:class:`Recovery` is the user's policy).

:func:`decide` is the step's commit rule: all voted ok -> commit; a failed attempt ->
retry the same global batch, unless a failure repeats one of an earlier attempt
(:func:`same_failure`: the evidence that the batch is the cause, a poison batch) or the
step has used its ``MAX_ATTEMPTS`` (the run stops: "step keeps failing"). Deaths and hangs
carry no message, so they need more evidence (:data:`SILENT_EVIDENCE` attempts, see
:func:`repeats`).

:func:`judge_step` is the same rule for failures no vote carried (deaths, hangs, broken
groups: the ddp supervisor judges them), :func:`failed_attempts` carries the attempt count
across generations, :func:`preflight_verdict` gives a preflight failure that does not repeat
one more preflight.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

from phalanx.failures import WorkerFailure

StepAction = Literal["commit", "skip", "retry", "split", "abort"]

# Attempts of one step before the run stops with "step keeps failing" (PX206), when no two
# of its failures are evidence against its batch.
MAX_ATTEMPTS = 4


def decide(
    attempt: int,
    failed: int,
    splittable: int = 0,
    contract: int = 0,
    repeated: int = 0,
    max_attempts: int = MAX_ATTEMPTS,
    overflow: int = 0,
) -> StepAction:
    """The commit rule of one step attempt.

    ``attempt`` counts the failed attempts of this step so far (over the run); ``failed``
    the members that voted failed; ``splittable`` those of them that ran out of memory and
    can still cut their share into smaller micro-batches; ``contract`` those whose step
    function broke its contract (a non-scalar or non-finite loss, a wrong return type: the
    same again on a retry, so the run stops at once); ``repeated`` those whose failure is
    evidence against the batch (:func:`same_failure` as an earlier attempt's). When every
    failure is such an out-of-memory, the step is tried again with the split ("split": no
    attempt is used up). A repeated failure stops the run (a poison batch); any other is
    retried, up to ``max_attempts`` attempts of the step ("step keeps failing").
    ``overflow`` counts the members whose gradients were not finite under ``"16-mixed"``
    precision: with no failure, the step is committed without an optimizer step ("skip",
    on every member; the loss scale backs off). Not a failure: nothing is retried."""
    if failed == 0:
        return "skip" if overflow else "commit"
    if contract or repeated:
        return "abort"
    if splittable == failed:
        return "split"
    return "retry" if attempt + 1 < max_attempts else "abort"


# Phases in which a worker computes its share of a step's global batch: a failure there
# fails that attempt of the step.
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


def same_samples(a: WorkerFailure, b: WorkerFailure) -> bool:
    """Whether two failures were computing some sample in common (shares that overlap);
    where a share is unknown, whether they are the same worker's."""
    if a.sample_indices is not None and b.sample_indices is not None:
        return not set(a.sample_indices).isdisjoint(b.sample_indices)
    return a.worker == b.worker


def same_failure(a: WorkerFailure, b: WorkerFailure) -> bool:
    """Whether two failures are alike enough to have one cause in the batch: the same kind
    on samples in common, and for exceptions and out-of-memory errors the same type and
    message, for deaths and hangs the same phase (a sample that kills its reader does it
    while loading, or in forward, every time). Two failures of different kinds (an
    exception, then a crash) are two faults, whoever had the samples."""
    if a.kind != b.kind or not same_samples(a, b):
        return False
    if a.kind in ("exception", "oom"):
        return (a.exception_type, a.message) == (b.exception_type, b.message)
    return a.phase == b.phase


# Deaths and hangs carry no message to compare: two one-off kills on shares that happen to
# overlap look exactly like a sample that kills its reader. A poison batch by deaths or hangs
# needs this many attempts of the step to fail alike, with a sample common to all of them.
SILENT_EVIDENCE = 3


def repeats(failure: WorkerFailure, earlier: list[WorkerFailure]) -> bool:
    """Whether ``failure`` repeats failures of the same step in earlier attempts: the
    evidence that makes a poison batch. An exception or out-of-memory error: one earlier
    attempt's failure like it (:func:`same_failure`: same type and message, samples in
    common). A death or a hang: :data:`SILENT_EVIDENCE` attempts in all (this one
    included) that failed alike, with a sample every one of those shares held."""
    if failure.step is None or failure.attempt is None:
        return False
    before = [
        e
        for e in earlier
        if e.step == failure.step
        and e.attempt is not None
        and e.attempt < failure.attempt
        and e.action not in ("split", "ignored")
        and same_failure(failure, e)
    ]
    if failure.kind in ("exception", "oom"):
        return bool(before)
    by_attempt: dict[int, list[WorkerFailure]] = {}
    for e in before:
        assert e.attempt is not None
        by_attempt.setdefault(e.attempt, []).append(e)
    needed = SILENT_EVIDENCE - 1
    for attempts in itertools.combinations(sorted(by_attempt), needed):
        for chosen in itertools.product(*(by_attempt[a] for a in attempts)):
            if _common_sample([failure, *chosen]):
                return True
    return False


def _common_sample(failures: list[WorkerFailure] | tuple[WorkerFailure, ...]) -> bool:
    """A sample every one of ``failures`` was computing (where a share is unknown: all of
    them the same worker's)."""
    shares = [f.sample_indices for f in failures]
    if any(share is None for share in shares):
        return len({f.worker for f in failures}) == 1
    common = set(shares[0] or [])
    for share in shares[1:]:
        common &= set(share or [])
    return bool(common)


StepVerdict = Literal["retry", "poison", "keeps_failing"]


def judge_step(
    failure: WorkerFailure, earlier: list[WorkerFailure], max_attempts: int = MAX_ATTEMPTS
) -> StepVerdict:
    """A failed attempt of a step that no vote judged (a death, a hang, a broken group):
    a poison batch on evidence (:func:`repeats`), the end of the step's attempts
    (``max_attempts``), or one more attempt."""
    if repeats(failure, earlier):
        return "poison"
    assert failure.attempt is not None
    return "retry" if failure.attempt + 1 < max_attempts else "keeps_failing"


def keeps_failing(failures: list[WorkerFailure], max_attempts: int = MAX_ATTEMPTS) -> int | None:
    """The step whose attempts all failed, up to the bound, without evidence against its
    batch (the run stopped with "step keeps failing"), or None."""
    attempts: dict[int, set[int]] = {}
    for f in failures:
        if f.step is not None and f.attempt is not None and f.action not in ("split", "ignored"):
            attempts.setdefault(f.step, set()).add(f.attempt)
    full = [step for step, seen in attempts.items() if len(seen) >= max_attempts]
    return min(full) if full else None


def preflight_verdict(failure: WorkerFailure, earlier: list[WorkerFailure]) -> StepVerdict:
    """A failure in preflight: it repeats (the same worker's preflight failed before, or
    another worker's failed the same way) -> the run stops before training ("poison");
    otherwise the worker gets one more preflight ("retry")."""
    for e in earlier:
        if e.phase != "preflight":
            continue
        if e.worker == failure.worker or (
            e.kind == failure.kind
            and (e.exception_type, e.message) == (failure.exception_type, failure.message)
        ):
            return "poison"
    return "retry"


RecoveryAction = Literal["respawn", "shrink", "abort", "restart"]
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

    When every member has fallen and respawns are left, every slot starts again from the
    newest snapshot in shared memory (``fit(snapshots=...)``, on by default) or intact
    checkpoint in ``run_dir``, and computes the steps since it again. A poison batch (a failure that
    repeats on the same samples), a step that keeps failing, a preflight failure that
    repeats and an exception in validation, metrics or checkpoint (``RUN_LEVEL_PHASES``)
    stop the run in every mode.
    ``hang_timeout`` (None: fit's ``hang_timeout``) is how long a worker may make no
    progress while its peers wait.
    ``head_failover`` (across nodes, with a ``run_dir`` every node shares): when the head's
    node is lost, the lowest surviving node rank takes over as the head and the run goes on
    from its last committed step (see docs/multinode.md); False (or ``mode="abort"``): every
    node keeps that step in an emergency checkpoint and exits 75 for a launcher to restart.
    """

    mode: str = "respawn"
    max_restarts: int = 3
    min_workers: int = 1
    hang_timeout: timedelta | None = None
    head_failover: bool = True

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
    policy: Recovery,
    failure: WorkerFailure,
    history: list[WorkerFailure],
    survivors: int,
    kept: bool = False,
) -> RecoveryAction:
    """The decision for a fallen worker: a pure function of the policy, the failure, the
    failures before it (with the actions taken), how many members are left and whether the
    committed state is ``kept`` outside the workers (a snapshot in a live node's shared
    memory, or checkpoints in a ``run_dir``). When none is left but respawns are, the run is
    not lost while it is: every slot is started again from the newest snapshot or intact
    checkpoint ("restart"; the steps after it are computed again with the same batches)."""
    run_level = failure.phase == "preflight" or (
        failure.kind in RUN_LEVEL_KINDS and failure.phase in RUN_LEVEL_PHASES
    )
    if policy.mode == "abort" or run_level:
        return "abort"
    respawns_left = restart_was_possible(policy, history)
    if survivors < 1:
        return "restart" if respawns_left and kept else "abort"
    if respawns_left:
        return "respawn"
    return "shrink" if survivors >= policy.min_workers else "abort"


def restarts(history: list[WorkerFailure]) -> int:
    """Replacements started so far (each fall answered by a respawn or a restart)."""
    return sum(1 for f in history if f.action in ("respawned", "restarted"))


def restart_was_possible(policy: Recovery, history: list[WorkerFailure]) -> bool:
    """Respawns are left: when every member has fallen, a snapshot or a ``run_dir`` lets the
    run start again from it (without either, the report says one would have)."""
    return policy.mode == "respawn" and restarts(history) < policy.max_restarts
