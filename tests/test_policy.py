"""The run's decisions as pure functions: the step's commit rule with out-of-memory splits,
and the recovery rule for a fallen worker."""

from __future__ import annotations

from datetime import timedelta

import pytest

import phalanx as px
from phalanx.errors import InvalidSettingError
from phalanx.failures import WorkerFailure
from phalanx.policy import counts_as_attempt, decide, failed_attempts, is_poison, recover


def failure(
    kind: str = "crash", phase: str = "forward", action: str | None = None
) -> WorkerFailure:
    return WorkerFailure(
        worker=1, rank=1, device="cpu:1", kind=kind, message="x", phase=phase, action=action
    )


def test_out_of_memory_everywhere_it_failed_splits_without_using_a_retry() -> None:
    assert decide(0, 2, splittable=2) == "split"
    assert decide(5, 1, splittable=1) == "split"  # splits do not count as retries


def test_a_failure_that_cannot_split_makes_it_a_plain_retry_or_abort() -> None:
    assert decide(0, 2, splittable=1) == "retry"
    assert decide(1, 2, splittable=1) == "abort"
    assert decide(1, 1, splittable=0) == "abort"


def test_a_gradient_overflow_skips_the_step_but_a_failure_comes_first() -> None:
    assert decide(0, 0, overflow=2) == "skip"  # 16-mixed: every member skips together
    assert decide(0, 0, overflow=0) == "commit"
    assert decide(0, 1, overflow=1) == "retry"  # a failed attempt is retried, not skipped
    assert decide(1, 1, overflow=2) == "abort"


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
    assert not any(is_poison(f, s) for f, s in history)


def test_a_death_in_the_retry_is_the_second_failed_attempt_in_either_order() -> None:
    voted, died = at(0, kind="exception", action="retried"), at(1)
    for history in ([(voted, False), (died, False)], [(died, False), (voted, False)]):
        assert failed_attempts(history) == {4: 2}
    assert is_poison(died) and not is_poison(voted)


def test_failures_outside_the_step_or_caused_by_others_fail_no_attempt() -> None:
    after_vote = at(None, phase="optimizer")  # killed once the vote came back all ok
    split = at(1, kind="oom", action="split")
    ignored = at(1, action="ignored")  # the run had its result
    for f in (after_vote, split, ignored, at(1, phase="validation")):
        assert not counts_as_attempt(f) and not is_poison(f)
    assert not is_poison(at(1, kind="exception"), secondary=True)  # a peer's closed socket
    assert failed_attempts([(f, False) for f in (after_vote, split, ignored)]) == {}


def test_attempts_are_counted_per_step() -> None:
    history = [(at(0, step=3), False), (at(0, step=4), False), (at(1, step=3), False)]
    assert failed_attempts(history) == {3: 2, 4: 1}
