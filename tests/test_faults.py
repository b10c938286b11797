"""Fault injection as a user feature: parsing, when a fault fires, chaos plans."""

from __future__ import annotations

import pytest
import torch

import phalanx as px
from phalanx.errors import InvalidSettingError
from phalanx.faults import FaultInjector, InjectedFault, chaos


def fires(injector: FaultInjector, step: int, phase: str = "forward") -> bool:
    try:
        injector.check(step, phase)
    except (InjectedFault, torch.OutOfMemoryError):
        return True
    return False


def test_parse_reads_kind_worker_step_phase_and_times() -> None:
    assert px.Fault.parse("kill:1@30") == px.Fault("kill", 1, 30, "forward", 1)
    assert px.Fault.parse("exception:0@5/backwardx2") == px.Fault("exception", 0, 5, "backward", 2)
    assert px.Fault.parse("hang:2@7/validation").phase == "validation"


@pytest.mark.parametrize("text", ["kill", "kill:1", "boom:1@3", "kill:1@3/checkpoint", "x:1@"])
def test_unreadable_or_impossible_faults_are_refused_with_the_syntax(text: str) -> None:
    with pytest.raises(InvalidSettingError) as info:
        px.Fault.parse(text)
    assert "KIND" in str(info.value) or "use one of" in str(info.value)


def test_a_fault_fires_at_its_step_and_phase_for_its_worker_only() -> None:
    faults = [px.Fault("exception", worker=1, step=3, phase="backward")]
    other = FaultInjector(faults, worker=0)
    mine = FaultInjector(faults, worker=1)
    assert not fires(other, 3, "backward")
    assert not fires(mine, 2, "backward")
    assert not fires(mine, 3, "forward")
    assert fires(mine, 3, "backward")
    assert not fires(mine, 3, "backward")  # times=1: the retry of step 3 goes through
    assert not fires(mine, 4, "backward")


def test_times_makes_every_attempt_of_the_step_fail() -> None:
    mine = FaultInjector([px.Fault("oom", worker=0, step=2, times=3)], worker=0)
    assert [fires(mine, 2) for _ in range(4)] == [True, True, True, False]


def test_a_worker_that_was_not_there_at_the_step_fires_after_the_step_it_joined() -> None:
    """A replacement that joined at step 9 still gets the fault meant for step 6, in the
    step after it joined."""
    late = FaultInjector([px.Fault("exception", worker=1, step=6)], worker=1)
    assert not fires(late, 9)  # the join step (and its retries) go through
    assert not fires(late, 9)
    assert fires(late, 10)
    assert not fires(late, 11)


def test_missed_faults_fire_one_per_step_and_never_beside_a_fault_of_that_step() -> None:
    """Three missed faults and one meant for step 12: a late joiner fires them one step
    apart, never two in the attempts of one step (unrelated faults must not look like a
    poison batch), and the one meant for step 12 fires at step 12, every attempt."""
    faults = [
        px.Fault("exception", worker=0, step=2),
        px.Fault("oom", worker=0, step=3),
        px.Fault("exception", worker=0, step=4),
        px.Fault("exception", worker=0, step=12, times=2),
    ]
    late = FaultInjector(faults, worker=0)
    fired = {step: [fires(late, step) for _ in range(3)] for step in (10, 11, 12, 13, 14)}
    assert fired == {
        10: [False, False, False],  # joined here
        11: [True, False, False],  # one missed fault, the retry goes through
        12: [True, True, False],  # its own fault, times=2 (no missed one beside it)
        13: [True, False, False],
        14: [True, False, False],
    }
    assert not fires(late, 15)


def test_validation_faults_fire_in_the_validation_after_their_step() -> None:
    mine = FaultInjector([px.Fault("exception", worker=0, step=20, phase="validation")], 0)
    assert not fires(mine, 19, "validation")
    assert not fires(mine, 20, "forward")
    assert fires(mine, 20, "validation")


def test_chaos_plans_kill_hang_exception_in_turn_spread_over_the_run() -> None:
    plan = chaos(6, workers=3, total_steps=200, seed=4)
    assert [f.kind for f in plan] == ["kill", "hang", "exception"] * 2
    steps = [f.step for f in plan]
    assert steps == sorted(steps) and len(set(steps)) == 6
    assert max(steps) < 150  # the last quarter is left for the last recovery
    assert {f.worker for f in plan} <= {0, 1, 2}
    assert chaos(6, workers=3, total_steps=200, seed=4) == plan  # seeded
    assert chaos(0, workers=3, total_steps=200) == []
