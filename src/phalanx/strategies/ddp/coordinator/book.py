"""The run's failures as the coordinator decides them: what was recorded (with the action
taken), the reports waiting for a decision, and the outcome. Pure: the rules are
:mod:`phalanx.policy`'s, the time comes in as arguments.

A record is decided once: :meth:`FailureBook.record` makes the decided copy (a worker's
report is never changed after it was sent); the recovery time is later set on that copy,
which the ``WorkerFailed`` event carries to the sinks.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field, replace
from typing import Literal

from phalanx.failures import NO_SHARD_SET, WorkerFailure
from phalanx.policy import (
    RUN_LEVEL_PHASES,
    Recovery,
    counts_as_attempt,
    failed_attempts,
    judge_step,
    preflight_verdict,
    recover,
    restart_was_possible,
)
from phalanx.report import is_secondary
from phalanx.strategies.ddp.coordinator.actions import Action, Record
from phalanx.strategies.ddp.wire.protocol import Broke, Done

ACTIONS = {"respawn": "respawned", "shrink": "shrunk", "abort": "aborted", "restart": "restarted"}
NO_RUN_DIR = (
    "Every worker had fallen while respawns were left, and no copy of the state outlived "
    "them: with snapshots in shared memory (fit(snapshots=...), on by default) or a run_dir "
    "(checkpoints), the run would have started again from the newest of them."
)
TOO_FEW = (
    "Every worker had fallen while respawns were left, but too few could start again (a lost "
    "node's cannot before it registers) for min_workers."
)
SHARDED = (
    'Under strategy="fsdp" each worker holds only its shard of the model and optimizer state, '
    "and no copy of a lost worker's shards outlived it (snapshots are off and there is no "
    "run_dir, or not every member had written a snapshot yet), so the run cannot go on "
    "without it (docs/fsdp.md)."
)
SHARDED_SHRINK = (
    'Under strategy="fsdp" the survivors go on only from a complete set of shard snapshots on '
    "their own machines, and a lost worker's snapshot was on a machine none of them runs on "
    '(or none was complete): with mode="shrink" nothing starts the other slots again; '
    'mode="respawn" restarts every slot from the set, or from a checkpoint (docs/fsdp.md).'
)
MISSING_SET = (
    'Under strategy="fsdp" the new generation\'s members found no complete set of shard '
    "snapshots where the head counted one (two losses close together: a member's, then "
    "another machine's, before the new generation's first copies were whole; or a snapshot "
    "rewritten while it was read), and no checkpoint to start again from: with a run_dir "
    '(checkpoints) and mode="respawn" every slot would have started again from the newest '
    "checkpoint (docs/fsdp.md)."
)
Fall = Literal["respawn", "shrink", "restart", "preflight", "stopped"]


@dataclass
class FailureBook:
    recovery: Recovery
    run_dir: bool
    failures: list[WorkerFailure] = field(default_factory=list)
    fatal: bool = False  # the run is aborted
    poison: bool = False
    done: Done | None = None
    aborted: set[int] = field(default_factory=set)
    notes: list[str] = field(default_factory=list)  # what would have let the run go on
    held: list[tuple[float, Broke]] = field(default_factory=list)  # Broke, not yet settled
    held_preflight: list[WorkerFailure] = field(default_factory=list)  # until its retry ends
    recovering: list[int] = field(default_factory=list)  # indices waiting for a commit
    sharded: bool = False  # fsdp: a lost member's shard is lost with it (see SHARDED)

    @property
    def decided(self) -> bool:
        return self.fatal or bool(self.aborted)

    def history(self) -> list[WorkerFailure]:
        """Every failure recorded, and the held Broke reports (not decided yet: they failed
        their attempts too)."""
        return [*self.failures, *(m.failure for _, m in self.held if not m.splittable)]

    def evidence(self) -> tuple[tuple[tuple[int, int], ...], tuple[WorkerFailure, ...]]:
        """For an announcement: the failed attempts of each step (step, count) and the
        failures of those attempts (what a repeat is judged by)."""
        history = [(f, is_secondary(f)) for f in self.history()]
        failed = failed_attempts(history)
        known = tuple(f for f, sec in history if counts_as_attempt(f, sec) and f.step in failed)
        return tuple(sorted(failed.items())), known

    def record(
        self, failure: WorkerFailure, action: str | None, out: list[Action], recovers: bool = False
    ) -> WorkerFailure:
        decided = replace(failure, action=action)
        self.failures.append(decided)
        if recovers:
            self.recovering.append(len(self.failures) - 1)
        out.append(Record(decided))
        return decided

    # -- reports the coordinator holds -----------------------------------------------------
    def hold(self, now: float, message: Broke) -> None:
        self.held.append((now, message))

    def settle(
        self, now: float, settle: float, everything: bool, before: int | None
    ) -> list[Broke]:
        """The held reports due for a decision: ``settle`` seconds old, from a generation
        older than ``before``, or all (``everything``)."""
        due: list[tuple[float, Broke]] = []
        kept: list[tuple[float, Broke]] = []
        for received, message in self.held:
            older = before is not None and message.generation < before
            (due if everything or older or now - received >= settle else kept).append(
                (received, message)
            )
        self.held = kept
        return [m for _, m in due]

    def broke(self, message: Broke, out: list[Action]) -> bool:
        """A worker's own failure that no vote carried: recorded and computed again (True:
        the same members' group is to be rebuilt unless a later generation already left
        it), or the run stops (a poison batch, the step's last attempt)."""
        failure = message.failure
        if self.done is not None or self.decided:
            self.record(failure, "ignored" if self.done is not None else "aborted", out)
            return False
        if not message.splittable and self._judged(failure, out):
            return False
        action = "split" if message.splittable else "retried"
        self.record(failure, action, out, recovers=True)
        return True

    def record_voted(self, failure: WorkerFailure, out: list[Action]) -> None:
        """A failure a vote carried: the loop chose its action, the book records it."""
        self.record(failure, failure.action, out, recovers=failure.action in ("retried", "split"))

    def aborted_by(self, slot: int, poison: bool) -> None:
        self.aborted.add(slot)
        self.poison = self.poison or poison

    def recovered(self, when: float, committed: int) -> None:
        """Step ``committed - 1`` was committed at ``when`` (wall clock): the failures of
        that step or an earlier one are recovered. Set on the recorded failure itself: the
        one the ``WorkerFailed`` event carried, so the sinks (the summary's lost column,
        ``run.json``) have it when the run ends."""
        waiting = []
        for i in self.recovering:
            f = self.failures[i]
            if f.step is None or f.step < committed:
                f.recovery_seconds = max(0.0, when - f.time)
            else:
                waiting.append(i)
        self.recovering = waiting

    # -- a fallen worker -----------------------------------------------------------------
    def fall(
        self,
        failure: WorkerFailure,
        survivors: int,
        out: list[Action],
        kept: bool = False,
        can_restart: bool = True,
    ) -> Fall:
        """Judge a fallen worker's failure and choose what the run does; ``kept``: a
        snapshot of the committed state lives outside the workers (see
        :func:`phalanx.policy.recover`); ``can_restart``: enough slots could start again
        (not on lost nodes)."""
        if self.done is not None or self.decided:
            self.record(failure, "ignored" if self.done is not None else "aborted", out)
            return "stopped"
        if failure.phase == "preflight":
            return self._preflight_failed(failure, out)
        if self._judged(failure, out):
            return "stopped"
        history = [*self.failures, *self.held_preflight]
        action = recover(
            self.recovery, failure, history, survivors, (self.run_dir or kept) and can_restart
        )
        sharded = self.sharded and not survivors and restart_was_possible(self.recovery, history)
        if action == "abort" and self.sharded and failure.exception_type == NO_SHARD_SET:
            self.notes.append(MISSING_SET)
        elif action == "abort" and sharded and failure.phase not in RUN_LEVEL_PHASES:
            self.notes.append(SHARDED)
        elif (
            action == "abort" and self.sharded and not survivors and self.recovery.mode == "shrink"
        ):
            self.notes.append(SHARDED_SHRINK)
        elif action == "abort" and not survivors and restart_was_possible(self.recovery, history):
            self.notes.append(NO_RUN_DIR if can_restart else TOO_FEW)
        self.record(failure, ACTIONS[action], out, recovers=action != "abort")
        if action == "abort":
            self.fatal = True
            return "stopped"
        return action

    def _judged(self, failure: WorkerFailure, out: list[Action]) -> bool:
        """A failed attempt of a step that no vote judged: the run stops when it repeats an
        earlier attempt's failure (poison batch) or was the step's last attempt."""
        if not counts_as_attempt(failure, is_secondary(failure)):
            return False
        verdict = judge_step(failure, self.history())
        if verdict == "retry":
            return False
        self.record(failure, "aborted", out)
        if verdict == "poison":
            self.poison = True
            self.aborted.add(failure.worker)
        else:
            self.fatal = True
        return True

    def _preflight_failed(self, failure: WorkerFailure, out: list[Action]) -> Fall:
        """One more preflight for a failure that does not repeat; the run stops before
        training for one that does. The held failure's action is known when its retry
        ends."""
        if preflight_verdict(failure, [*self.held_preflight, *self.failures]) == "retry":
            self.held_preflight.append(failure)
            return "preflight"
        for held in [*self.held_preflight, failure]:
            self.record(held, "aborted", out)
        self.held_preflight = []
        self.fatal = True
        return "stopped"

    def preflight_passed(self, slot: int, out: list[Action]) -> None:
        for held in [f for f in self.held_preflight if f.worker == slot]:
            self.held_preflight.remove(held)
            self.record(held, "retried", out)

    # -- records of what the coordinator saw itself ----------------------------------------
    @staticmethod
    def death(
        where: WorkerFailure, code: int, wall: float, oom_kills: int | None = None
    ) -> WorkerFailure:
        """A worker's death as its exit told it; for a SIGKILL, what the kernel says of its
        out-of-memory killer (``oom_kills``: how many processes it killed on the worker's
        machine while the worker ran, None where that is unknown). No guess."""
        sig = -code if code < 0 else None
        if sig is not None:
            message = f"worker process died from signal {signal.Signals(sig).name}"
            if sig == signal.SIGKILL:
                message += sigkill_cause(oom_kills)
        else:
            message = f"worker process exited with code {code} without a report"
        exit_code = code if sig is None else None
        return replace(where, message=message, exit_code=exit_code, signal=sig, time=wall)

    @staticmethod
    def hang(where: WorkerFailure, stalled: float, stacks: str, limit: float) -> WorkerFailure:
        step = "?" if where.step is None else where.step + 1  # 1-based, as people read it
        message = (
            f"no progress for {stalled:.1f}s in phase {where.phase} of step {step} "
            f"(hang_timeout {limit:g}s)"
        )
        return replace(where, kind="hang", message=message, stacks=stacks)


def sigkill_cause(oom_kills: int | None) -> str:
    """Who sent a SIGKILL, as far as the kernel's count of out-of-memory kills tells."""
    if oom_kills is None:
        return (
            " (sent by another process or by the kernel's out-of-memory killer: dmesg tells which)"
        )
    if oom_kills == 0:
        return (
            " (sent by another process, such as kill -9 or a job scheduler: the kernel's "
            "out-of-memory killer killed no process where the worker ran)"
        )
    return (
        f"; the kernel's out-of-memory killer killed {oom_kills} process(es) in the worker's "
        "memory cgroup (or, where that is not readable, on its machine) while it ran: likely "
        "this worker ran out of host memory; dmesg's 'Killed process' lines name it"
    )
