"""The ddp coordinator's decisions, driven by events on a fake clock: no process, store or
sleep. Each test feeds what workers would say (or what the agent would see) and checks the
actions that come back."""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from pathlib import Path

import pytest

import phalanx as px
from phalanx.events import GenerationStarted, Notice, StepEnded, WorkerState
from phalanx.failures import WorkerFailure
from phalanx.plan import Plan
from phalanx.sinks.summary import lost_seconds
from phalanx.strategies.ddp.coordinator.actions import (
    Action,
    Announce,
    DumpStacks,
    Emit,
    Kill,
    Record,
    SetAbort,
    Spawn,
)
from phalanx.strategies.ddp.coordinator.coordinator import (
    Coordinator,
    CoordinatorEvent,
    Exited,
    Received,
    Spawned,
    StacksTaken,
    Tick,
)
from phalanx.strategies.ddp.coordinator.roster import Now, Setup, SlotStatus
from phalanx.strategies.ddp.timing import Timing
from phalanx.strategies.ddp.wire.protocol import (
    Broke,
    Done,
    Failed,
    Joined,
    Progress,
    Ready,
    Relay,
    Snapshotted,
)

HANG = 3.0
PLAN = Plan(120, 12, seed=0)  # 10 steps an epoch
SIGKILL = -9
COLLECTIVE = "Thread 1 (most recent call first):\n  File torch/distributed/c10d.py, line 1"
USER_CODE = "Thread 1 (most recent call first):\n  File faults.py, line 9 in fire"


class Run:
    """A coordinator and a fake clock."""

    def __init__(
        self,
        world: int = 3,
        recovery: px.Recovery | None = None,
        run_dir: bool = False,
        sharded: bool = False,
    ) -> None:
        devices = [f"cpu:{i}" for i in range(world)]
        timing = Timing(hang=timedelta(seconds=HANG))
        policy = recovery or px.Recovery()
        setup = Setup(PLAN, devices, policy, timing, run_dir, sharded=sharded)
        self.c = Coordinator(setup)
        self.t = 0.0
        self.log: list[Action] = []
        self.log += self.c.start(self.now())
        self.pid = 100
        for slot in range(world):
            self.spawned(slot)

    def now(self) -> Now:
        return Now(self.t, 1_000_000.0 + self.t)

    def at(self, t: float) -> Run:
        self.t = t
        return self

    def feed(self, event: CoordinatorEvent) -> list[Action]:
        actions = self.c.handle(event, self.now())
        self.log += actions
        for a in actions:  # the agent's answers: a pid for every process it starts
            if isinstance(a, Spawn):
                self.spawned(a.slot)
        return actions

    def spawned(self, slot: int) -> None:
        self.pid += 1
        self.log += self.c.handle(Spawned(slot, self.pid), self.now())

    def say(self, slot: int, message: object) -> list[Action]:
        return self.feed(Received(slot, message))

    def tick(self, t: float) -> list[Action]:
        """The decisions a tick at ``t`` brings (the panel's heartbeat events left out)."""
        return [a for a in self.at(t).feed(Tick()) if not isinstance(a, Emit)]

    def form(self, members: list[int], gen: int, step: int = 0) -> list[Action]:
        return [a for slot in members for a in self.say(slot, Joined(slot, gen, step))]

    def start_training(self) -> None:
        for slot in range(self.c.world):
            self.say(slot, Ready(slot))
        self.form(list(range(self.c.world)), 0)

    def at_step(self, slot: int, step: int, phase: str = "forward", attempt: int = 0) -> None:
        self.say(slot, Progress(slot, step, phase, self.t, attempt))


def announced(actions: list[Action]) -> list[tuple[list[int], str]]:
    return [
        (list(a.announcement.members), a.announcement.cause)
        for a in actions
        if isinstance(a, Announce)
    ]


def recorded(actions: list[Action]) -> list[tuple[int, str, int | None, str | None]]:
    return [
        (a.failure.worker, a.failure.kind, a.failure.step, a.failure.action)
        for a in actions
        if isinstance(a, Record)
    ]


def exception(
    slot: int, step: int, attempt: int, samples: list[int], message: str = "boom"
) -> WorkerFailure:
    return WorkerFailure(
        worker=slot,
        rank=slot,
        device=f"cpu:{slot}",
        kind="exception",
        message=message,
        phase="backward",
        step=step,
        attempt=attempt,
        exception_type="RuntimeError",
        sample_indices=samples,
    )


# -- the first generation -------------------------------------------------------------------


def test_the_first_generation_waits_until_every_worker_is_ready() -> None:
    run = Run()
    assert [a.slot for a in run.log if isinstance(a, Spawn)] == [0, 1, 2]
    assert announced(run.say(0, Ready(0)) + run.say(2, Ready(2))) == []
    assert announced(run.say(1, Ready(1))) == [([0, 1, 2], "start")]
    assert all(s.status is SlotStatus.MEMBER for s in run.c.slots.values())


def test_a_preflight_failure_that_does_not_repeat_gets_one_more_preflight() -> None:
    run = Run()
    run.say(0, Ready(0))
    run.say(2, Ready(2))
    first = exception(1, 0, 0, [1], message="flaky device")
    first.phase = "preflight"
    actions = run.say(1, Failed(first, fatal=True))
    assert [(a.slot, a.replaces) for a in actions if isinstance(a, Spawn)] == [(1, None)]
    assert recorded(actions) == []  # its action is known when the retry ends
    actions = run.say(1, Ready(1))
    assert recorded(actions) == [(1, "exception", 0, "retried")]
    assert announced(actions) == [([0, 1, 2], "start")]


def test_a_preflight_failure_that_repeats_stops_the_run_before_training() -> None:
    run = Run()
    first = exception(1, 0, 0, [1], message="no module named x")
    first.phase = "preflight"
    run.say(1, Failed(first, fatal=True))
    actions = run.at(1).feed(Exited(1, SIGKILL))  # its second preflight dies
    assert recorded(actions) == [(1, "exception", 0, "aborted"), (1, "crash", 0, "aborted")]
    assert any(isinstance(a, SetAbort) for a in actions)
    assert announced(run.log) == []


# -- deaths, rebuilds, admissions --------------------------------------------------------------


def test_a_death_is_respawned_and_the_replacement_admitted_once_the_group_formed() -> None:
    run = Run()
    run.start_training()
    run.at_step(1, 4)
    actions = run.at(1).feed(Exited(1, SIGKILL))
    assert recorded(actions) == [(1, "crash", 4, "respawned")]
    assert announced(actions) == [([0, 2], "worker 1 crash: respawned")]
    assert [(a.slot, a.replaces is not None) for a in actions if isinstance(a, Spawn)] == [
        (1, True)
    ]
    run.at(3).say(1, Ready(1))
    run.say(0, Joined(0, 1, 4))
    assert announced(run.tick(3.1)) == []  # worker 2 has not formed generation 1 yet
    run.say(2, Joined(2, 1, 4))
    assert announced(run.tick(3.2)) == [([0, 2, 1], "workers [1] rejoin")]
    run.say(1, Joined(1, 2, 9))
    assert run.c.respawn_fates() == [
        "worker 1's replacement (after its crash at step 5) joined before step 10"
    ]


def test_a_replacement_still_starting_at_the_end_is_said_so() -> None:
    run = Run(world=2)
    run.start_training()
    run.at(1).feed(Exited(1, SIGKILL))
    run.say(0, Done(0, "w.pt"))
    assert run.c.respawn_fates() == [
        "worker 1's replacement (after its crash at step 1) had not joined when the run ended "
        "(still starting)"
    ]
    assert [a.slot for a in run.log if isinstance(a, Kill)] == [1]  # dismissed


def test_a_broke_report_waits_for_a_peers_death_which_carries_the_retry() -> None:
    """Worker 0's own failure broke the group in step 4 while worker 1 died in it: the
    death's generation (without worker 1) carries the retry, not a rebuild."""
    run = Run()
    run.start_training()
    run.at_step(1, 4)
    own = exception(0, 4, 0, [0, 1])
    assert run.at(1.0).say(0, Broke(own, generation=0)) == []  # held
    actions = run.at(1.1).feed(Exited(1, SIGKILL))
    assert announced(actions) == [([0, 2], "worker 1 crash: respawned")]
    actions = run.tick(1.4)  # settled: recorded, no rebuild
    assert recorded(actions) == [(0, "exception", 4, "retried")]
    assert announced(actions) == []


def test_a_broke_report_alone_rebuilds_the_group_with_the_same_members() -> None:
    run = Run()
    run.start_training()
    run.at(1.0).say(2, Broke(exception(2, 7, 0, [5]), generation=0))
    assert announced(run.tick(1.1)) == []
    actions = run.tick(1.25)
    assert recorded(actions) == [(2, "exception", 7, "retried")]
    assert announced(actions) == [([0, 1, 2], "worker 2 exception in backward: rebuilt")]
    doc = next(a.announcement for a in actions if isinstance(a, Announce))
    assert doc.rebuild and dict(doc.failed) == {7: 1}
    assert [(f.worker, f.step, f.attempt) for f in doc.known] == [(2, 7, 0)]  # the evidence


# -- hangs -------------------------------------------------------------------------------------


def hung_run() -> Run:
    run = Run()
    run.start_training()
    run.at(0.0)
    run.at_step(0, 5, "forward")
    run.at_step(1, 5, "sync")
    run.at_step(2, 5, "sync")
    return run


def test_the_worker_behind_that_does_not_wait_in_a_collective_is_the_hung_one() -> None:
    run = hung_run()
    assert run.tick(HANG - 0.1) == []
    asked = run.tick(HANG + 0.05)
    assert [a.slots for a in asked if isinstance(a, DumpStacks)] == [[0]]
    actions = run.feed(StacksTaken({0: USER_CODE}))
    assert Kill(0) in actions
    assert recorded(actions) == [(0, "hang", 5, "respawned")]
    hang = next(a.failure for a in actions if isinstance(a, Record))
    assert hang.stacks == USER_CODE and hang.sample_indices == PLAN.local_batch(0, 5, 0, 3)
    assert "no progress for 3.0s in phase forward of step 6" in hang.message  # 1-based
    assert hang.last_progress == 1_000_000.0  # the wall clock of its own last progress


def test_the_recorded_hang_gets_its_recovery_time_when_a_later_step_commits() -> None:
    """The failure a Record carries (the one the supervisor emits as WorkerFailed, kept by
    the summary and run.json) gets ``recovery_seconds`` once the step it failed in is
    committed, so the summary's lost column counts from the hung worker's last progress."""
    run = hung_run()
    run.tick(HANG + 0.05)
    actions = run.feed(StacksTaken({0: USER_CODE}))
    hang = next(a.failure for a in actions if isinstance(a, Record))
    assert hang.recovery_seconds is None
    run.at(3.5).say(1, Relay(StepEnded(0, 4, 5, 10, 0.5, 0.1, 12, 1.0, time=1_000_003.5)))
    assert hang.recovery_seconds is None  # step 5 (0-based 4) is before the hung step
    run.at(4.0).say(1, Relay(StepEnded(0, 5, 6, 10, 0.5, 0.1, 12, 1.0, time=1_000_004.0)))
    assert hang.recovery_seconds == pytest.approx(4.0 - (HANG + 0.05))
    assert lost_seconds(hang) == pytest.approx(4.0)  # from its last progress at 0.0
    assert run.c.book.failures == [hang]


def test_a_join_or_regroup_elsewhere_does_not_restart_a_workers_hang_clock() -> None:
    """Worker 0 hangs at t=0; worker 2 dies at t=1 and a new generation is announced; the
    hang is still named hang_timeout after worker 0's own last progress (plus the short
    grace an announcement gives members to leave their group), not after the join."""
    run = hung_run()
    run.at(1.0).feed(Exited(2, SIGKILL))
    run.at(1.1).at_step(1, 5, "regroup")
    run.say(1, Joined(1, 1, 5))
    asked = run.tick(HANG + 0.05)
    assert [a.slots for a in asked if isinstance(a, DumpStacks)] == [[0]]


def test_an_announcement_gives_members_a_moment_to_leave_their_group() -> None:
    run = hung_run()
    run.at(HANG - 0.1).feed(Exited(2, SIGKILL))  # a generation at t = 2.9
    assert not [a for a in run.tick(HANG + 0.1) if isinstance(a, DumpStacks)]
    assert [a for a in run.tick(HANG + 0.45) if isinstance(a, DumpStacks)]


# -- poison, and faults that arrive together ------------------------------------------------


def test_a_sample_that_kills_its_reader_in_three_attempts_is_a_poison_batch() -> None:
    """A death carries no message: the second death on overlapping shares may be a second
    one-off fault, so it is retried; the third attempt that dies on a sample common to all
    three shares stops the run (the first death the root cause)."""
    run = Run()
    run.start_training()
    run.at_step(1, 4, "data")
    run.at(1).feed(Exited(1, SIGKILL))  # generation 1: [0, 2]
    run.form([0, 2], 1, 4)
    for slot in (0, 2):
        run.at_step(slot, 4, "data", attempt=1)
    # the retry's new split gives one of worker 1's samples to worker 0 (or 2): it dies
    share1 = set(PLAN.local_batch(0, 4, 1, 3))
    reader = next(s for s, r in ((0, 0), (2, 1)) if share1 & set(PLAN.local_batch(0, 4, r, 2)))
    actions = run.at(2).feed(Exited(reader, SIGKILL))
    assert recorded(actions) == [(reader, "crash", 4, "respawned")]  # not evidence enough
    last = 2 if reader == 0 else 0
    run.form([last], 2, 4)
    run.at_step(last, 4, "data", attempt=2)  # alone: the whole batch, the bad sample too
    actions = run.at(3).feed(Exited(last, SIGKILL))
    assert recorded(actions) == [(last, "crash", 4, "aborted")]
    assert any(isinstance(a, SetAbort) for a in actions)
    assert run.c.book.poison


def test_a_hang_then_a_death_elsewhere_in_the_retry_is_retried_not_poison() -> None:
    run = hung_run()
    run.tick(HANG + 0.05)
    run.feed(StacksTaken({0: USER_CODE}))  # generation 1: [1, 2]
    run.form([1, 2], 1, 5)
    for slot in (1, 2):
        run.at_step(slot, 5, "forward", attempt=1)
    actions = run.at(HANG + 1).feed(Exited(2, SIGKILL))
    assert recorded(actions) == [(2, "crash", 5, "respawned")]  # a different failure
    assert not run.c.book.decided


def test_the_fourth_failed_attempt_of_a_step_stops_the_run_as_keeps_failing() -> None:
    run = Run()
    run.start_training()
    for attempt in range(4):  # each on another sample, another message
        failure = exception(attempt % 3, 6, attempt, [attempt], message=f"m{attempt}")
        run.at(attempt + 1.0).say(failure.worker, Broke(failure, generation=attempt))
        actions = run.tick(attempt + 1.3)
        run.form([0, 1, 2], attempt + 1, 6)
    assert recorded(actions) == [(0, "exception", 6, "aborted")]
    assert run.c.book.fatal and not run.c.book.poison
    assert [f.action for f in run.c.book.failures] == ["retried"] * 3 + ["aborted"]


@pytest.mark.parametrize(
    ("kills", "says"),
    [
        (0, "(sent by another process, such as kill -9 or a job scheduler: the kernel's "),
        (2, "the kernel's out-of-memory killer killed 2 process(es) in the worker's memory"),
        (None, "(sent by another process or by the kernel's out-of-memory killer: dmesg tells"),
    ],
)
def test_a_sigkill_is_told_as_the_kernels_count_of_oom_kills_says_without_a_guess(
    kills: int | None, says: str
) -> None:
    run = Run()
    run.start_training()
    actions = run.at(1).feed(Exited(1, SIGKILL, kills))
    [failure] = [a.failure for a in actions if isinstance(a, Record)]
    assert failure.message.startswith("worker process died from signal SIGKILL")
    assert says in failure.message and "possibly" not in failure.message


def test_the_kernels_count_of_oom_kills_is_read_from_vmstat(tmp_path: Path) -> None:
    from phalanx.strategies.ddp.agent.agent import oom_kill_count

    vmstat, none = tmp_path / "vmstat", str(tmp_path / "none")
    vmstat.write_text("nr_free_pages 12\noom_kill 7\npgfault 3\n")
    assert oom_kill_count(str(vmstat), cgroups=none) == 7
    vmstat.write_text("nr_free_pages 12\n")  # (a kernel before 4.13)
    assert oom_kill_count(str(vmstat), cgroups=none) is None
    assert oom_kill_count(none, cgroups=none) is None


def test_the_memory_cgroups_count_of_oom_kills_comes_before_the_machines(tmp_path: Path) -> None:
    """Where the kernel keeps a count for the worker's memory cgroup (a container's limit),
    that count says; the machine's (other containers' kills) does not."""
    from phalanx.strategies.ddp.agent.agent import oom_kill_count

    vmstat = tmp_path / "vmstat"
    vmstat.write_text("oom_kill 40\n")
    root = tmp_path / "cgroup"
    (root / "memory").mkdir(parents=True)  # v1: memory/memory.oom_control; v2: memory.events
    (root / "memory" / "memory.oom_control").write_text("oom_kill_disable 0\noom_kill 1\n")
    (root / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    assert oom_kill_count(str(vmstat), cgroups=str(root)) == 1


# -- every member fell ---------------------------------------------------------------------------


def test_every_member_fallen_with_a_run_dir_restarts_all_from_the_checkpoint() -> None:
    run = Run(world=2, run_dir=True)
    run.start_training()
    run.at(1).feed(Exited(1, SIGKILL))  # generation 1: [0]; worker 1's replacement starts
    actions = run.at(1.5).feed(Exited(0, SIGKILL))
    assert recorded(actions) == [(0, "crash", 0, "restarted")]
    assert Kill(1) in actions  # the replacement still starting: it would wait for nobody
    spawns = [(a.slot, a.restart_after) for a in actions if isinstance(a, Spawn)]
    assert spawns == [(0, 1), (1, 1)]
    assert not any(isinstance(a, SetAbort) for a in actions)
    run.at(4).say(0, Ready(0))
    restart = "restart from the newest snapshot or checkpoint"
    assert announced(run.say(1, Ready(1))) == [([0, 1], restart)]
    assert run.c.respawn_fates() == [
        "worker 1's replacement (after its crash at step 1) was still starting when every "
        "worker fell: dropped"
    ]


def test_exits_seen_with_the_one_that_restarts_are_the_replaced_processes_not_the_new() -> None:
    """fsdp, snapshots off: every member killed in one step, their exits read in one poll.
    The first restarts every slot (the survivors' shards are not the whole state), and
    the others' exits, handled after the restart's spawns, are of the
    processes those spawns replaced (by their pids): no failure of the new processes, which
    start as the restart's (a preflight retry of one of them restores as it would have)."""
    run = Run(world=3, run_dir=True, sharded=True)
    run.start_training()
    old = {slot: run.c.slots[slot].pid for slot in range(3)}
    first = run.at(1).feed(Exited(0, SIGKILL, pid=old[0]))
    assert recorded(first) == [(0, "crash", 0, "restarted")]
    assert [(a.slot, a.restart_after) for a in first if isinstance(a, Spawn)] == [
        (0, 0), (1, 0), (2, 0),
    ]  # fmt: skip
    later = run.feed(Exited(1, SIGKILL, pid=old[1])) + run.feed(Exited(2, SIGKILL, pid=old[2]))
    late_word = run.feed(Received(1, Progress(1, 9, "forward", 1.0, 0), pid=old[1]))
    assert recorded(later + late_word) == []
    assert [run.c.slots[s].status for s in range(3)] == [SlotStatus.STARTING] * 3
    assert run.c.slots[1].phase == "start"  # (its old process's progress is not its own)
    # A real failure of a restarted process in its preflight: it starts again as it was
    actions = run.at(2).feed(Exited(2, SIGKILL, pid=run.c.slots[2].pid))
    assert recorded(actions) == []  # (held until its retry passes or fails the same way)
    [retry] = [a for a in actions if isinstance(a, Spawn)]
    assert retry == next(a for a in first if isinstance(a, Spawn) and a.slot == 2)
    for slot in range(3):
        run.say(slot, Ready(slot))
    restart = "restart from the newest snapshot or checkpoint"
    assert [c for _, c in announced(run.log)][-1] == restart


def step_ended(global_step: int) -> Relay:
    """The main worker's event for committed step ``global_step`` (1-based count)."""
    event = StepEnded(0, global_step - 1, global_step, 10, 0.5, 0.1, 12, 100.0)
    return Relay(event)


def test_every_member_fallen_restarts_from_a_snapshot_without_a_run_dir() -> None:
    """A snapshot in shared memory keeps the state: the run restarts without a run_dir, and
    the fall's record says how many committed steps were computed again."""
    run = Run(world=2, run_dir=False)
    run.start_training()
    run.say(0, Snapshotted(0, 4))
    for step in range(1, 8):
        run.say(0, step_ended(step))
    run.at(1).feed(Exited(1, SIGKILL))
    actions = run.at(1.5).feed(Exited(0, SIGKILL))
    assert recorded(actions) == [(0, "crash", 0, "restarted")]
    assert [(a.slot, a.restart_after) for a in actions if isinstance(a, Spawn)] == [(0, 1), (1, 1)]
    run.at(2).say(0, Ready(0))
    run.say(1, Ready(1))
    notices = [
        a.event.text
        for a in run.form([0, 1], 2, step=4)
        if isinstance(a, Emit) and isinstance(a.event, Notice)
    ]
    assert "restarted from committed step 4: 3 committed step(s) to compute again" in notices
    restarted = [f for f in run.c.book.failures if f.action == "restarted"]
    assert [f.replayed_steps for f in restarted] == [3]


def test_a_replacement_let_in_but_not_joined_holds_no_state_so_the_last_holders_fall_restarts() -> (
    None
):
    """Worker 1 falls; its replacement is ready and let in (generation 2: [0, 1]), but
    before it has joined (taken the state) worker 0 falls: nobody holds the state, so the
    run restarts from the snapshot (not a generation of the replacement alone, which would
    start from its fresh model)."""
    run = Run(world=2, run_dir=False)
    run.start_training()
    run.say(0, Snapshotted(0, 4))
    run.at(1).feed(Exited(1, SIGKILL))  # generation 1: [0]; a replacement for 1 starts
    run.form([0], 1, 5)
    run.at(1.2).say(1, Ready(1))
    assert announced(run.tick(1.3)) == [([0, 1], "workers [1] rejoin")]
    actions = run.at(1.5).feed(Exited(0, SIGKILL))
    assert recorded(actions) == [(0, "crash", 0, "restarted")]
    assert Kill(1) in actions


def test_without_a_snapshot_or_a_run_dir_the_run_stops_and_says_what_would_have_kept_it() -> None:
    run = Run(world=2, run_dir=False)
    run.start_training()
    run.at(1).feed(Exited(1, SIGKILL))
    actions = run.at(1.5).feed(Exited(0, SIGKILL))
    assert recorded(actions) == [(0, "crash", 0, "aborted")]
    assert any(isinstance(a, SetAbort) for a in actions)
    assert run.c.book.notes and "snapshots" in run.c.book.notes[0]
    assert "run_dir" in run.c.book.notes[0]


def test_exits_the_coordinator_asked_for_are_no_failures() -> None:
    run = Run(world=2)
    run.start_training()
    run.say(0, Done(0, "w.pt"))
    run.say(1, Done(1))
    assert recorded(run.at(1).feed(Exited(1, 0)) + run.feed(Exited(0, 0))) == []


REGROUPING = (
    "Current thread 0x1 (most recent call first):\n  Garbage-collecting\n"
    '  File "/x/phalanx/strategies/ddp/worker/worker.py", line 386 in leave_group'
)


def test_a_stalled_member_on_its_way_to_the_next_generation_is_not_hung() -> None:
    """After the hung worker is replaced, a survivor slow to leave its broken group (its
    stacks are in phalanx's regroup path) is not named hung: its silence is the group's."""
    run = hung_run()
    run.tick(HANG + 0.05)
    run.feed(StacksTaken({0: USER_CODE}))  # generation 1: [1, 2], neither has regrouped yet
    asked = run.tick(HANG + 0.6)
    assert [a.slots for a in asked if isinstance(a, DumpStacks)] == [[1, 2]]
    actions = run.feed(StacksTaken({1: REGROUPING, 2: REGROUPING}))
    assert not [a for a in actions if isinstance(a, Kill | Record)]
    assert run.tick(HANG + 0.7) == []  # not asked again at once
    run.at_step(1, 5, "regroup")
    run.at_step(2, 5, "regroup")
    assert run.tick(HANG + 20) == []  # regroup is bounded by its own timeouts


def test_the_worker_panel_sees_each_state_change_once_and_the_generations() -> None:
    run = Run(world=2)
    run.start_training()
    run.at_step(1, 3)
    run.at_step(1, 3)  # the same state again: nothing new to show
    run.at(1).feed(Exited(1, SIGKILL))
    states = [
        (e.event.worker, e.event.state, e.event.detail)
        for e in run.log
        if isinstance(e, Emit) and isinstance(e.event, WorkerState)
    ]
    assert states == [
        (0, "starting", ""),
        (1, "starting", ""),
        (0, "training", ""),
        (1, "training", ""),
        (1, "fallen", "crash in forward"),
        (1, "replaced", "by pid 103"),
        (1, "joining", ""),
    ]
    gens = [
        e.event for e in run.log if isinstance(e, Emit) and isinstance(e.event, GenerationStarted)
    ]
    assert [(g.number, g.members, g.cause) for g in gens] == [
        (0, [0, 1], "start"),
        (1, [0], "worker 1 crash: respawned"),
    ]
    assert all(g.time == 1_000_000.0 + (1 if g.number else 0) for g in gens)  # the fake clock


def test_a_replacement_is_shown_training_by_its_joined_with_its_generation() -> None:
    """The agent hands over each heartbeat before the messages read with it, so a
    replacement's first step beat can come before the Joined it wrote first: the panel shows
    it training once, by the Joined, with the generation it joined (not "generation None")."""
    run = Run(world=2)
    run.start_training()
    run.at_step(1, 3)
    run.at(1).feed(Exited(1, SIGKILL))
    run.form([0], 1, step=3)
    run.at(2).say(1, Ready(1))  # the replacement
    run.at_step(1, 5, "data")  # its first step's beat, handed over before its Joined
    run.at_step(0, 5, "data")
    run.form([0, 1], 2, step=5)
    shown = [
        (e.event.worker, e.event.state, e.event.generation)
        for e in run.log
        if isinstance(e, Emit) and isinstance(e.event, WorkerState)
    ]
    mine = [s for s in shown if s[0] == 1]
    assert mine[-2:] == [(1, "joining", None), (1, "training", 2)], shown
    assert (1, "training", None) not in shown


def test_fsdp_under_shrink_a_loss_without_a_set_in_reach_stops_and_says_why() -> None:
    """fsdp, mode="shrink": a lost member's shards are out of the survivors' reach (no set
    here), and nothing would start the other slots again: the run stops, and the report's
    note says so and names mode="respawn"."""
    run = Run(world=2, run_dir=True, sharded=True, recovery=px.Recovery(mode="shrink"))
    run.start_training()
    actions = run.at(1).feed(Exited(1, SIGKILL, pid=run.c.slots[1].pid))
    assert recorded(actions) == [(1, "crash", 0, "aborted")]
    assert any(isinstance(a, SetAbort) for a in actions)
    [note] = run.c.book.notes
    assert 'mode="shrink"' in note and 'mode="respawn"' in note


def no_set(slot: int, step: int) -> Failed:
    """A new generation's member found no complete set of shard snapshots (fsdp)."""
    from phalanx.failures import NO_SHARD_SET
    from phalanx.strategies.ddp.worker.fsdp_handover import NoShardSet

    assert NoShardSet.__name__ == NO_SHARD_SET  # (the name the coordinator knows it by)
    failure = dataclasses.replace(
        exception(slot, step, 0, []), phase="regroup", attempt=None, exception_type=NO_SHARD_SET
    )
    return Failed(failure, fatal=True)


@pytest.mark.parametrize("run_dir", [True, False])
def test_fsdp_a_set_counted_but_not_found_is_told_once_and_leaves_no_holder(run_dir: bool) -> None:
    """fsdp: every member's snapshot of step 4 heard of, so a lost member's survivors go
    on (respawned). They find no set (NoShardSet): the first word is recorded, the set is
    no longer counted, and the run restarts every slot (a run_dir) or stops with the note
    that says why; the other survivor's word is the same news, not recorded."""
    run = Run(world=3, run_dir=run_dir, sharded=True)
    run.start_training()
    for slot in range(3):
        run.say(slot, Snapshotted(slot, 4, generation=0))
    first = run.at(1).feed(Exited(1, SIGKILL, pid=run.c.slots[1].pid))
    assert recorded(first) == [(1, "crash", 0, "respawned")]
    assert announced(first) and run.c.holders([0, 2]) == 2
    told = run.at(2).say(0, no_set(0, 4))
    again = run.say(2, no_set(2, 4))
    assert recorded(again) == [] and run.c.holders([0, 2]) == 0
    if run_dir:
        assert recorded(told) == [(0, "exception", 4, "restarted")]
        assert sorted(a.slot for a in told if isinstance(a, Spawn)) == [0, 1, 2]
        assert run.c.book.notes == []
    else:
        assert recorded(told) == [(0, "exception", 4, "aborted")]
        assert any(isinstance(a, SetAbort) for a in told)
        [note] = run.c.book.notes
        assert "found no complete set of shard snapshots where the head counted one" in note


def test_a_pid_used_again_by_a_later_process_of_the_slot_is_that_process() -> None:
    """A node that starts afresh (or pids that wrap) may give a replacement the pid of the
    process it replaces: once the new process is known by it, its exit is its own."""
    run = Run(world=2, run_dir=True)
    run.start_training()
    first = run.c.slots[1].pid
    assert first is not None
    run.at(1).feed(Exited(1, SIGKILL, pid=first))  # respawned: the replacement starts
    run.c.handle(Spawned(1, first), run.now())  # (its pid is the one it replaces)
    actions = run.at(2).feed(Exited(1, SIGKILL, pid=first))
    assert [r[0] for r in recorded(actions)] == [1]  # its own fall, named


@pytest.mark.parametrize(
    ("lost_at", "resumed", "replayed", "notice"),
    [
        (24, 24, 0, False),  # a node's emergency checkpoint held the last committed step
        (24, 20, 4, True),  # fsdp: the newest sharded checkpoint, four steps before
        (None, 20, None, False),  # nothing known of the lost head's step: nothing counted
    ],
)
def test_the_lost_heads_failure_counts_the_steps_the_new_head_computes_again(
    lost_at: int | None, resumed: int, replayed: int | None, notice: bool
) -> None:
    run = Run(world=2)
    lost = WorkerFailure(0, 0, "cpu:0@node0", "crash", "the head lost", step=lost_at)
    run.log += run.c.inherit(dataclasses.replace(lost, action="shrunk"), run.now())
    for slot in range(2):
        run.say(slot, Ready(slot))
    actions = run.form([0, 1], 0, step=resumed)
    [fall] = run.c.book.failures
    assert fall.replayed_steps == replayed
    said = [a.event.text for a in actions if isinstance(a, Emit) and isinstance(a.event, Notice)]
    assert any("committed step(s) to compute again" in t for t in said) == notice
