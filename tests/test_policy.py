"""The run's decisions as pure functions: the step's commit rule with out-of-memory splits,
the evidence that makes a poison batch, the bound on a step's attempts, the preflight retry
and the recovery rule for a fallen worker (with a restart from the checkpoint when every
member fell)."""

from __future__ import annotations

from datetime import timedelta

import pytest

import phalanx as px
from phalanx.errors import InvalidSettingError
from phalanx.failures import WorkerFailure
from phalanx.policy import (
    counts_as_attempt,
    decide,
    failed_attempts,
    judge_step,
    keeps_failing,
    preflight_verdict,
    recover,
    repeats,
    restart_was_possible,
    same_failure,
)


def failure(
    kind: str = "crash", phase: str = "forward", action: str | None = None
) -> WorkerFailure:
    return WorkerFailure(
        worker=1, rank=1, device="cpu:1", kind=kind, message="x", phase=phase, action=action
    )


def test_out_of_memory_everywhere_it_failed_splits_without_using_a_retry() -> None:
    assert decide(0, 2, splittable=2) == "split"
    assert decide(5, 1, splittable=1) == "split"  # splits do not count as retries


def test_a_failure_that_cannot_split_is_retried_up_to_the_bound() -> None:
    assert decide(0, 2, splittable=1) == "retry"
    assert decide(1, 2, splittable=1) == "retry"  # different failures: no evidence
    assert decide(3, 1, splittable=0) == "abort"  # the fourth attempt failed: keeps failing
    assert decide(1, 1, repeated=1) == "abort"  # the same failure again: a poison batch
    assert decide(0, 1, contract=1) == "abort"


def test_a_gradient_overflow_skips_the_step_but_a_failure_comes_first() -> None:
    assert decide(0, 0, overflow=2) == "skip"  # 16-mixed: every member skips together
    assert decide(0, 0, overflow=0) == "commit"
    assert decide(0, 1, overflow=1) == "retry"  # a failed attempt is retried, not skipped
    assert decide(1, 1, repeated=1, overflow=2) == "abort"


def test_respawn_until_max_restarts_then_shrink_then_abort() -> None:
    policy = px.Recovery(mode="respawn", max_restarts=2, min_workers=2)
    history: list[WorkerFailure] = []
    assert recover(policy, failure(), history, survivors=3) == "respawn"
    history.append(failure(action="respawned"))
    assert recover(policy, failure(), history, survivors=3) == "respawn"
    history.append(failure(action="respawned"))
    assert recover(policy, failure(), history, survivors=2) == "shrink"
    assert recover(policy, failure(), history, survivors=1) == "abort"


def test_shrink_goes_down_to_min_workers() -> None:
    policy = px.Recovery(mode="shrink", min_workers=1)
    assert recover(policy, failure(), [], survivors=1) == "shrink"
    assert recover(policy, failure(), [], survivors=0) == "abort"


def test_abort_mode_and_preflight_failures_always_abort() -> None:
    assert recover(px.Recovery(mode="abort"), failure(), [], survivors=3) == "abort"
    respawn = px.Recovery()
    assert recover(respawn, failure(phase="preflight"), [], survivors=3) == "abort"
    # (a preflight failure reaches recover only once it repeated: see preflight_verdict)


@pytest.mark.parametrize("phase", ["validation", "metrics", "checkpoint"])
def test_an_exception_in_a_run_level_phase_aborts_but_a_death_there_is_recovered(
    phase: str,
) -> None:
    respawn = px.Recovery()
    for kind in ("exception", "oom"):
        assert recover(respawn, failure(kind=kind, phase=phase), [], survivors=2) == "abort"
    for kind in ("crash", "hang"):
        assert recover(respawn, failure(kind=kind, phase=phase), [], survivors=2) == "respawn"
        shrink = px.Recovery(mode="shrink")
        assert recover(shrink, failure(kind=kind, phase=phase), [], survivors=2) == "shrink"
    assert recover(respawn, failure(kind="hang", phase="preflight"), [], survivors=2) == "abort"


def test_retried_failures_do_not_count_as_restarts() -> None:
    policy = px.Recovery(max_restarts=1)
    history = [failure(kind="exception", action="retried")] * 5
    assert recover(policy, failure(), history, survivors=2) == "respawn"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"mode": "restart"},
        {"max_restarts": -1},
        {"min_workers": 0},
        {"hang_timeout": timedelta(seconds=0)},
    ],
)
def test_bad_recovery_settings_name_the_fix(kwargs: dict[str, object]) -> None:
    with pytest.raises(InvalidSettingError) as info:
        px.Recovery(**kwargs)  # type: ignore[arg-type]
    assert info.value.code == "PX108"


# -- attempts across generations: which failures make a poison batch (the supervisor's rule) --


def at(
    attempt: int | None, step: int = 4, phase: str = "forward", kind: str = "crash", **kw: object
) -> WorkerFailure:
    f = WorkerFailure(
        worker=1, rank=1, device="cpu:1", kind=kind, message="x", phase=phase, step=step, **kw
    )
    f.attempt = attempt
    return f


def test_two_workers_killed_in_one_attempt_fail_it_once() -> None:
    history = [(at(0), False), (at(0), False)]
    assert failed_attempts(history) == {4: 1}
    assert not any(repeats(f, [g for g, _ in history]) for f, _ in history)


def test_a_death_in_the_retry_is_the_second_failed_attempt_in_either_order() -> None:
    share = [8, 9]
    voted = at(0, kind="exception", action="retried", sample_indices=share)
    died = at(1, sample_indices=share)
    for history in ([(voted, False), (died, False)], [(died, False), (voted, False)]):
        assert failed_attempts(history) == {4: 2}
    # an exception, then a death on the same share: two faults (issue 23), retried
    assert judge_step(died, [voted]) == "retry"


def test_failures_outside_the_step_or_caused_by_others_fail_no_attempt() -> None:
    after_vote = at(None, phase="optimizer")  # killed once the vote came back all ok
    split = at(1, kind="oom", action="split")
    ignored = at(1, action="ignored")  # the run had its result
    for f in (after_vote, split, ignored, at(1, phase="validation")):
        assert not counts_as_attempt(f)
    assert not counts_as_attempt(at(1, kind="exception"), secondary=True)  # a closed socket
    assert not repeats(at(1), [split, ignored])  # splits and late failures are no evidence
    assert failed_attempts([(f, False) for f in (after_vote, split, ignored)]) == {}


def test_attempts_are_counted_per_step() -> None:
    history = [(at(0, step=3), False), (at(0, step=4), False), (at(1, step=3), False)]
    assert failed_attempts(history) == {3: 2, 4: 1}


# -- the evidence that makes a poison batch ---------------------------------------------------


def f(
    worker: int,
    kind: str,
    samples: list[int] | None,
    attempt: int = 0,
    message: str = "boom",
    exc: str | None = "RuntimeError",
    step: int = 5,
    phase: str = "forward",
) -> WorkerFailure:
    return WorkerFailure(
        worker=worker,
        rank=worker,
        device=f"cpu:{worker}",
        kind=kind,  # type: ignore[arg-type]
        message=message,
        phase=phase,
        step=step,
        attempt=attempt,
        exception_type=exc if kind in ("exception", "oom") else None,
        sample_indices=samples,
    )


SAME_FAILURE = [
    # (first, second, same failure?)
    (f(1, "exception", [1, 2]), f(1, "exception", [1, 2], 1), True),  # a bad sample, twice
    (f(1, "exception", [1, 2]), f(2, "exception", [2, 3], 1), True),  # moved with the split
    (f(1, "exception", [1, 2]), f(1, "exception", [1, 2], 1, message="other"), False),
    (f(1, "exception", [1, 2]), f(1, "exception", [1, 2], 1, exc="ValueError"), False),
    (f(1, "exception", [1, 2]), f(2, "exception", [3, 4], 1), False),  # no sample in common
    (f(1, "crash", [1, 2]), f(2, "crash", [2, 3], 1), True),  # a sample that kills its reader
    (f(1, "hang", [1, 2]), f(2, "hang", [2, 3], 1), True),
    (f(1, "crash", [1, 2]), f(2, "crash", [3, 4], 1), False),
    # two deaths on overlapping shares in different phases: two faults, not one sample
    (f(1, "crash", [1, 2]), f(2, "crash", [2, 3], 1, phase="data"), False),
    (f(1, "hang", [1, 2], phase="data"), f(2, "hang", [2, 3], 1, phase="data"), True),
    # a hang, then a one-off exception on another worker in the retry (the case)
    (f(0, "hang", [0, 1, 2]), f(2, "exception", [2, 5], 1), False),
    # a one-off exception, then a one-off kill on the same worker and share (issue 23):
    # two kinds of failure are two faults, whoever had the samples
    (f(1, "exception", [1, 2]), f(1, "crash", [1, 2], 1), False),
    (f(1, "exception", [1, 2]), f(1, "crash", [1, 2, 3], 1), False),
    (f(1, "exception", None), f(1, "exception", None, 1), True),  # unknown shares: same worker
    (f(1, "exception", None), f(2, "exception", None, 1), False),
]


@pytest.mark.parametrize(("first", "second", "same"), SAME_FAILURE)
def test_same_failure_needs_the_same_kind_on_the_same_samples(
    first: WorkerFailure, second: WorkerFailure, same: bool
) -> None:
    assert same_failure(first, second) is same
    assert same_failure(second, first) is same
    # (an exception repeated is evidence; a death or a hang needs more, see below)
    evidence = same and first.kind in ("exception", "oom")
    assert judge_step(second, [first]) == ("poison" if evidence else "retry")


SILENT = [
    # (the attempts' deaths or hangs in order, poison at the last?)
    # a sample that kills whichever worker reads it: the third death on it stops the run
    ([f(0, "crash", [1, 2, 3]), f(1, "crash", [3, 4], 1), f(2, "crash", [3], 2)], True),
    ([f(0, "hang", [1, 2]), f(1, "hang", [2, 5], 1), f(0, "hang", [0, 2], 2)], True),
    # two one-off kills whose shares overlap (issue 23's soak): retried, not poison
    ([f(0, "crash", [1, 2, 3]), f(1, "crash", [3, 4], 1)], False),
    # three kills, each pair overlapping, but no sample common to all three: three faults
    ([f(0, "crash", [1, 2]), f(1, "crash", [2, 3], 1), f(2, "crash", [1, 3], 2)], False),
    # in another phase, or of another kind, they do not add up
    ([f(0, "crash", [1, 2]), f(1, "crash", [2], 1), f(2, "crash", [2], 2, phase="data")], False),
    ([f(0, "crash", [1, 2]), f(1, "hang", [2], 1), f(2, "crash", [2], 2)], False),
    # two workers killed in one attempt count as one attempt
    ([f(0, "crash", [1, 2]), f(1, "crash", [2, 3]), f(2, "crash", [2], 1)], False),
]


@pytest.mark.parametrize(("failures", "poison"), SILENT)
def test_deaths_and_hangs_are_poison_only_in_three_attempts_on_a_common_sample(
    failures: list[WorkerFailure], poison: bool
) -> None:
    *earlier, last = failures
    assert all(judge_step(g, failures[:i]) == "retry" for i, g in enumerate(earlier))
    assert judge_step(last, earlier) == ("poison" if poison else "retry")


def test_only_an_earlier_attempt_of_the_same_step_is_evidence() -> None:
    first = f(1, "exception", [1, 2])
    assert not repeats(f(2, "exception", [1, 2], attempt=0), [first])  # the same attempt
    assert not repeats(f(1, "exception", [1, 2], attempt=1, step=6), [first])  # another step
    assert repeats(f(1, "exception", [1, 2], attempt=3), [first])  # any earlier attempt


def test_a_step_is_tried_four_times_then_keeps_failing() -> None:
    kinds = ["hang", "exception", "crash", "exception"]
    history: list[WorkerFailure] = []
    verdicts = []
    for attempt, kind in enumerate(kinds):  # each on another worker's samples: no evidence
        failure = f(attempt % 3, kind, [10 * attempt], attempt, message=f"m{attempt}")
        verdicts.append(judge_step(failure, history))
        history.append(failure)
    assert verdicts == ["retry", "retry", "retry", "keeps_failing"]
    assert keeps_failing(history) == 5
    assert keeps_failing(history[:3]) is None


def test_a_preflight_failure_gets_one_more_preflight_unless_it_repeats() -> None:
    first = f(1, "exception", None, message="no module named x")
    first.phase = "preflight"
    again = f(1, "crash", None)
    again.phase = "preflight"
    elsewhere = f(0, "exception", None, message="no module named x")
    elsewhere.phase = "preflight"
    other = f(0, "exception", None, message="something else")
    other.phase = "preflight"
    assert preflight_verdict(first, []) == "retry"
    assert preflight_verdict(again, [first]) == "poison"  # the same slot failed twice
    assert preflight_verdict(elsewhere, [first]) == "poison"  # the same error on another slot
    assert preflight_verdict(other, [first]) == "retry"


RESTART = [
    # (mode, max_restarts, restarts so far, state kept (a snapshot or a run_dir), decision)
    ("respawn", 3, 0, True, "restart"),
    ("respawn", 3, 0, False, "abort"),  # the report says a snapshot or run_dir would have
    ("respawn", 3, 3, True, "abort"),  # no respawn left
    ("shrink", 3, 0, True, "abort"),
    ("abort", 3, 0, True, "abort"),
]


@pytest.mark.parametrize(("mode", "limit", "used", "kept", "decision"), RESTART)
def test_when_every_member_fell_a_kept_state_restarts_the_run_from_it(
    mode: str, limit: int, used: int, kept: bool, decision: str
) -> None:
    policy = px.Recovery(mode=mode, max_restarts=limit)
    history = [failure(action="respawned")] * used
    assert recover(policy, failure(), history, survivors=0, kept=kept) == decision
    possible = decision == "restart" or (mode == "respawn" and used < limit)
    assert restart_was_possible(policy, history) is possible
