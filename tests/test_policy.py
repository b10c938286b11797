"""The run's decisions as pure functions: the step's commit rule with out-of-memory splits,
and the recovery rule for a fallen worker."""

from __future__ import annotations

from datetime import timedelta

import pytest

import phalanx as px
from phalanx.errors import InvalidSettingError
from phalanx.failures import WorkerFailure
from phalanx.policy import decide, recover


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
