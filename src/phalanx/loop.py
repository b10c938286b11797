"""The training loop, the same for every strategy.

The loop decides *when* (epochs, steps, retries, validation, checkpoints, stopping); an
:class:`Engine` decides *where* (one replica, threads, or one DDP rank). Step ``s``:

1. ``engine.attempt`` runs the local part(s) of global batch ``s`` and returns the
   :class:`Vote`, reduced over all members: failed count, stop requests, metric sums.
2. All ok: ``engine.commit()`` (clip, optimizer, scheduler). Any failed: nobody steps; the
   policy (:func:`phalanx.policy.decide`) retries the step, unless a failure repeats on the
   same samples (poison batch) or the step has used its attempts (step keeps failing).
3. Interrupt requests travel in the vote, so every member stops after the same step.

Only the main member emits events and writes checkpoints.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, cast

import numpy as np
import torch

from phalanx import rng
from phalanx.badsamples import BAD_SLOTS, PLAIN, Triage, Twist
from phalanx.balance import Balancer, Decision, slower_than_peers
from phalanx.checkpoint import Checkpointer, should_save
from phalanx.checkpoint.io import list_checkpoints
from phalanx.early_stopping import EarlyStopping
from phalanx.errors import CheckpointError, TooManyBadSamples, WorkerAtFault, WorkerTooSlow
from phalanx.events import (
    Balanced,
    Emit,
    EpochEnded,
    EpochStarted,
    Event,
    Notice,
    StepEnded,
    Validated,
    ValidationStarted,
    WorkerFailed,
)
from phalanx.failures import FailedHere, Who, WorkerFailure, failure_of
from phalanx.ledger import EMPTY, Fingerprint
from phalanx.metrics import LoopMetric, LoopStats, Metric, compute_all
from phalanx.plan import Plan
from phalanx.policy import decide, repeats

if TYPE_CHECKING:
    from phalanx.snapshot import Snapshotting


@dataclass
class Vote:
    """A step attempt's outcome, the same on every member."""

    failed: int
    stop: bool
    sums: list[float]  # the members' metric states summed (float64)
    failures: list[WorkerFailure] = field(default_factory=list)  # the ones seen locally
    splittable: int = 0  # failed members that ran out of memory and can split further
    regroup: bool = False  # a new generation waits: leave the group after this step
    # of the sample indices actually computed, over all members
    ledger: Fingerprint = EMPTY
    # failed members whose step broke its contract (engines whose vote sees only the local
    # failure count them all; the others leave 0 and the loop counts ``failures``)
    contract: int = 0
    # members whose gradients were not finite ("16-mixed" precision): every member skips
    # the optimizer step of this step together (policy answer "skip")
    overflow: int = 0
    # this member's seconds per sample (before a sum; see phalanx.balance), and, once the
    # engine has counted the vote, every member's in rank order (the same on every member)
    pace: float = 0.0
    paces: list[float] = field(default_factory=list)
    # members whose failure repeats an earlier attempt's (the evidence of a bad sample)
    repeated: int = 0
    # samples this member found bad in its part (phalanx.badsamples), and once counted,
    # which members failed and every member's found samples (the same on every member)
    bad: list[int] = field(default_factory=list)
    failed_ranks: list[int] = field(default_factory=list)
    found: list[int] = field(default_factory=list)

    def read_rows(self, rows: Sequence[Sequence[float]]) -> None:
        """Every member's own packed vote (rank order): the paces, who failed, what each
        found bad."""
        self.paces = [float(r[PACE_AT]) for r in rows]
        self.failed_ranks = [i for i, r in enumerate(rows) if r[0] > 0]
        self.found = sorted({int(v) - 1 for r in rows for v in r[PACE_AT + 1 : VOTE_HEAD] if v > 0})


# The vote's layout on the wire: these fields (booleans travel as 0/1 and come back as "any
# member"), then the ledger fingerprint, this member's pace (:data:`PACE_AT`) and the
# samples it found bad (index + 1, :data:`~phalanx.badsamples.BAD_SLOTS` values, 0 unused):
# their sums mean nothing, each member's are read from its own row (Vote.read_rows); then
# the metric sums. One member packs its own
# vote; the sum of the members' packed votes (an all-reduce, or a sum over threads) unpacks
# to the step's vote. A new field needs its name here and nowhere else.
VOTE_FIELDS = ("failed", "stop", "regroup", "splittable", "contract", "overflow", "repeated")
_FLAGS = ("stop", "regroup")
PACE_AT = len(VOTE_FIELDS) + len(EMPTY)  # where a member's pace sits in its packed vote
VOTE_HEAD = PACE_AT + 1 + BAD_SLOTS  # the values before the metric sums


def vote_values(vote: Vote) -> list[float]:
    """One member's vote as the float64 values of its packed layout (see
    :data:`VOTE_FIELDS`; Python floats hold every float64 exactly)."""
    head = [float(getattr(vote, name)) for name in VOTE_FIELDS]
    bad = [float(i + 1) for i in vote.bad[:BAD_SLOTS]]
    bad += [0.0] * (BAD_SLOTS - len(bad))
    return [*head, *vote.ledger, float(vote.pace), *bad, *vote.sums]


def pack_vote(vote: Vote) -> np.ndarray:
    """One member's vote as one float64 array (:func:`vote_values`)."""
    return np.array(vote_values(vote), dtype=np.float64)


def unpack_vote(
    packed: list[float] | np.ndarray, failures: list[WorkerFailure] | None = None
) -> Vote:
    """The vote of a packed sum over members (float64 values, on the CPU); ``failures`` are
    the ones seen locally."""
    flat = packed if isinstance(packed, list) else np.asarray(packed, np.float64).tolist()
    n, m = len(VOTE_FIELDS), PACE_AT
    head = zip(VOTE_FIELDS, flat[:n], strict=True)
    fields: dict[str, Any] = {k: v > 0 if k in _FLAGS else round(v) for k, v in head}
    fingerprint = cast(Fingerprint, tuple(flat[n:m]))
    return Vote(
        sums=flat[VOTE_HEAD:],
        failures=list(failures or []),
        ledger=fingerprint,
        **fields,
    )


class Engine(Protocol):
    """Where replicas run. Every method is called at the same point on every member."""

    is_main: bool
    rank: int
    # A member can leave its group and be replaced (ddp); in one process (single, threads)
    # nothing can leave: a member at fault stops the run instead.
    can_leave: bool
    # Every member saves its own shards of each checkpoint (fsdp); else the main member
    # saves the whole state.
    saves_shards: bool

    @property
    def identity(self) -> Who:
        """Who this member is, for failures outside a step's vote."""
        ...

    def begin_epoch(self, epoch: int, start_step: int) -> None: ...

    def attempt(
        self,
        epoch: int,
        step: int,
        global_step: int,
        stop: Callable[[], bool],
        twist: Twist = PLAIN,
    ) -> Vote: ...

    def reshare(self, shares: list[float], epoch: int, start_step: int) -> None:
        """Every member's share of each global batch from ``start_step`` of ``epoch`` on."""
        ...

    def commit(self, skip: bool = False) -> None: ...

    def end_epoch(self) -> None: ...

    def discard(self) -> None: ...

    def evaluate(self) -> torch.Tensor: ...

    def lr(self) -> float: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


LEDGER_ROW = 3 + len(EMPTY)  # [epoch, step, global_step, *fingerprint]


@dataclass
class TrainState:
    """Where the run is: everything besides model/optimizer/scheduler that resume needs."""

    epoch: int = 0
    step: int = 0  # next step within ``epoch``
    global_step: int = 0  # committed optimizer steps
    history: list[dict[str, Any]] = field(default_factory=list)
    epoch_sums: list[float] | None = None  # train metric sums of the epoch so far
    epoch_samples: int = 0
    # One entry per committed step: [epoch, step, global_step, *ledger.fingerprint]
    ledger: list[list[float]] = field(default_factory=list)
    # fit(on_bad_sample="skip"): dataset index -> the global step from which it is left out
    quarantine: dict[int, int] = field(default_factory=dict)

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "step": self.step,
            "global_step": self.global_step,
            "history": [dict(h) for h in self.history],
            "epoch_sums": (  # (a float64 tensor in a checkpoint)
                None
                if self.epoch_sums is None
                else torch.tensor(self.epoch_sums, dtype=torch.float64)
            ),
            "epoch_samples": self.epoch_samples,
            # (a float64 tensor, a row a step: as nested lists it cost every checkpoint,
            # hand-over and snapshot time in proportion to the run's length)
            "ledger": torch.tensor(self.ledger, dtype=torch.float64).reshape(-1, LEDGER_ROW),
            # (an int64 tensor: [index, global step] a row)
            "quarantine": torch.tensor(sorted(self.quarantine.items()), dtype=torch.int64).reshape(
                -1, 2
            ),
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> TrainState:
        sums, rows = state.get("epoch_sums"), state.get("ledger")
        if isinstance(sums, torch.Tensor):
            state = {**state, "epoch_sums": sums.tolist()}
        if isinstance(rows, torch.Tensor):  # (a list of rows in checkpoints before)
            ledger = [[int(e), int(s), int(g), *f] for e, s, g, *f in rows.tolist()]
            state = {**state, "ledger": ledger}
        left = state.get("quarantine")
        if isinstance(left, torch.Tensor):
            state = {**state, "quarantine": {int(i): int(g) for i, g in left.tolist()}}
        return cls(**state)


class Interrupted(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Regroup(Exception):
    """A new generation is waiting: every member leaves the group after the same step."""


class StepAborted(Exception):
    """The policy stopped the run at this step; ``failures`` are the ones seen locally."""

    def __init__(self, step: int, failures: list[WorkerFailure], poison: bool) -> None:
        super().__init__(f"step {step} aborted")
        self.step = step
        self.failures = failures
        self.poison = poison


@dataclass
class LoopSettings:
    plan: Plan
    epochs: int
    metrics: list[Metric]
    loop_metrics: list[LoopMetric]
    seed: int
    has_valid: bool = False
    valid_batches: int = 0  # global batches of one validation pass
    max_steps: int | None = None  # end the run after this many committed steps
    val_every_steps: int | None = None  # validate after every N-th committed step too
    balance: bool = True  # shares in proportion to each member's speed (phalanx.balance)
    slow_worker: float | None = None  # put out a member this many times slower than its peers
    on_bad_sample: str = "stop"  # "skip": find bad samples, leave them out (badsamples)
    max_bad_samples: int = 8


@dataclass
class LoopResult:
    state: TrainState
    interrupted: str | None


class TrainLoop:
    """Runs epochs of committed steps over an :class:`Engine`."""

    def __init__(
        self,
        engine: Engine,
        settings: LoopSettings,
        emit: Emit,
        checkpointer: Checkpointer | None,
        early_stopping: EarlyStopping | None,
        stop_requested: Any,
        on_failure: Callable[[WorkerFailure], None] | None = None,
    ) -> None:
        self.engine = engine
        self.s = settings
        self._emit = emit
        self.checkpointer = checkpointer
        self.early_stopping = early_stopping
        self.stop_requested = stop_requested  # () -> str | None: this member's stop reason
        # Failures seen on this member, with the action taken. Default: a WorkerFailed event.
        self.on_failure = on_failure or (lambda f: self.emit(WorkerFailed(f, f.action or "")))
        self.state = TrainState()
        self.failures: list[WorkerFailure] = []
        # Attempts of a step that already failed before this member's group formed (global
        # step -> count): a ddp generation that computes a step again after a fallen worker
        # broke it goes on counting there, so its next failure of that step is the retry's.
        self.failed_before: dict[int, int] = {}
        self.attempt = 0  # of the step in progress, counted over the run (see failed_before)
        # Failures of earlier attempts seen elsewhere (ddp: the generation's announcement),
        # the evidence :func:`phalanx.policy.repeats` compares a new failure with.
        self.known_failures: list[WorkerFailure] = []
        self.epoch_started = time.time()
        # (when, epoch samples then): where this process began training the epoch, for the
        # epoch's throughput (a resume or a regroup begins a new window)
        self.window = (time.time(), 0)
        self.saved_step = -1  # the global step of the last checkpoint this member saved
        # ddp: the member that writes its machine's snapshots of the committed state (see
        # phalanx.snapshot); None elsewhere.
        self.snapshots: Snapshotting | None = None
        # The shares of the current generation's members (phalanx.balance), and the engine
        # they are for: a new generation (a new engine) starts even.
        self.balancer: Balancer | None = None
        self._balanced: Engine | None = None
        self._order: tuple[int, list[int]] = (-1, [])  # (epoch, its order): quarantine

    def emit(self, event: Event) -> None:
        """Only the main member (rank 0 of the current group) speaks."""
        if self.engine.is_main:
            self._emit(event)

    # -- resume -------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """Everything a checkpoint holds: the engine's state (``model``, ``optimizer``,
        ``scheduler``, ...) at the top, so ``torch.load(path)["model"]`` is the model's state
        dict, then ``loop``, ``early_stopping``, ``plan`` and ``rng``."""
        return {
            **self.engine.state_dict(),
            "loop": self.state.state_dict(),
            "early_stopping": self.early_stopping.state_dict() if self.early_stopping else None,
            "plan": self.s.plan.record(),
            "rng": rng.capture(),
        }

    def restore(self, snap: dict[str, Any]) -> None:
        self.fence()
        self.engine.load_state_dict(snap)
        self.state = TrainState.from_state_dict(snap["loop"])
        if self.early_stopping and snap.get("early_stopping"):
            self.early_stopping.load_state_dict(snap["early_stopping"])
        rng.restore(snap["rng"])

    def fence(self) -> None:
        """Wait for a snapshot's copy in flight (it reads the state the caller is about to
        change: the next optimizer step, a restore) or that must be whole (the loop ends)."""
        if self.snapshots is not None:
            self.snapshots.fence()

    # -- the loop -----------------------------------------------------------------------
    def run(self) -> LoopResult:
        try:
            return self._run()
        finally:
            self.fence()

    def _run(self) -> LoopResult:
        try:
            while self.state.epoch < self.s.epochs and not self._reached_max_steps():
                self._epoch()
                if self.state.step < self.s.plan.steps:  # max_steps ended it mid-epoch
                    break
                reason = self._end_epoch()
                if reason:
                    self.emit(Notice(reason))
                    return LoopResult(self.state, None)
            if self._reached_max_steps():
                st = self.state
                self.emit(
                    Notice(
                        f"max_steps={self.s.max_steps} reached (epoch {st.epoch}, "
                        f"step {st.step} of {self.s.plan.steps})"
                    )
                )
                self._checkpoint(epoch_end=False, force=True)
        except Interrupted as stop:
            self._checkpoint(epoch_end=False, force=True)
            return LoopResult(self.state, f"Training interrupted: {stop.reason}")
        return LoopResult(self.state, None)

    def _reached_max_steps(self) -> bool:
        return self.s.max_steps is not None and self.state.global_step >= self.s.max_steps

    def _epoch(self) -> None:
        st = self.state
        steps = self.s.plan.steps
        self.emit(EpochStarted(st.epoch, steps, st.step))
        if st.step == 0:  # not when a regroup or a resume goes on mid-epoch
            self.epoch_started = time.time()
        self.window = (time.time(), st.epoch_samples)
        self.fence()  # (a DataLoader with workers forks here: not beside a copying thread)
        self.engine.begin_epoch(st.epoch, st.step)
        if st.epoch_sums is None:
            st.epoch_sums = [0.0] * _size(self.s.metrics)
        while st.step < steps and not self._reached_max_steps():
            self._step()

    def _step(self) -> None:
        st = self.state
        started = time.perf_counter()
        vote, action, absorbed, faulty = self._attempts()
        skipped = action == "skip"
        self.fence()
        self.engine.commit(skip=skipped)
        for failure in absorbed:  # (ddp: the supervisor sets its own copy's, the same way)
            failure.recovery_seconds = max(0.0, time.time() - failure.time)
        st.ledger.append([st.epoch, st.step, st.global_step, *vote.ledger])
        assert st.epoch_sums is not None
        st.epoch_sums = [a + b for a, b in zip(st.epoch_sums, vote.sums, strict=True)]
        loss_sum, samples = vote.sums[0], int(vote.sums[1])  # (the Loss metric's state first)
        st.epoch_samples += samples
        st.step += 1
        st.global_step += 1
        self._emit_step(loss_sum, samples, time.perf_counter() - started, skipped)
        self._balance(vote)
        metrics = self._validate_mid_epoch() if self._validating_now(vote) else None
        if self.checkpointer and should_save(st.global_step, False, self.checkpointer.config):
            self._checkpoint(epoch_end=False, metrics=metrics)
        if self.snapshots is not None and not vote.stop:
            # (at a regroup, maybe one whole before the member leaves: a replacement may take it)
            self.snapshots.after_commit(self.snapshot, st.global_step, regroup=vote.regroup)
        if faulty:  # its part passed on another member: the worker is at fault, not the data
            self._put_out(faulty, vote, committed=True)
        if vote.stop:
            raise Interrupted(self.stop_requested() or "stop requested by another worker")
        if vote.regroup:
            raise Regroup()

    def _attempts(self) -> tuple[Vote, str, list[WorkerFailure], list[int]]:
        """Attempts of the current step until one commits (or the run stops): its vote, the
        action (commit or skip), the failures it absorbed, and the members found at fault
        (``on_bad_sample="skip"``: to put out once the step is committed)."""
        st = self.state
        attempt = self.failed_before.get(st.global_step, 0)
        absorbed: list[WorkerFailure] = []  # this step's failures that a retry or split absorbed
        skip_bad = self.s.on_bad_sample == "skip"
        base = self._left_out()  # samples of this global batch quarantined before
        twist = Twist(leave_out=base) if base else PLAIN
        triage = Triage(1)
        while True:
            self.attempt = attempt
            rng.reseed(step_seed(self.s.seed, st.global_step, self.engine.rank))
            if skip_bad and hasattr(self.engine, "judge"):
                self.engine.judge = self._repeats_now  # (the evidence rides in the vote)
            # Read when the vote is built, after the local work: a stop asked for during
            # this step ends the run after this step.
            vote = self.engine.attempt(st.epoch, st.step, st.global_step, self._stopping, twist)
            contract = max(vote.contract, sum(f.breaks_step_contract for f in vote.failures))
            for failure in vote.failures:
                failure.attempt = attempt
            # Evidence against the batch: a failure that repeats an earlier attempt's (this
            # member's own, or one the supervisor announced). Under ddp a member sees only its
            # own failure: the one whose failure repeats stops, and its peers cannot commit
            # the retry without it (the supervisor ends the run when it reads the Aborted).
            # With on_bad_sample="skip" every member counts the evidence from the vote.
            earlier = [*self.known_failures, *self.failures]
            repeated = sum(repeats(f, earlier) for f in vote.failures)
            if skip_bad and not contract:
                repeated = max(repeated, vote.repeated)
                nxt = self._triage(triage, vote, repeated, base)
                if nxt is not None:
                    self._record(vote.failures, "retried")
                    absorbed += vote.failures
                    self.engine.discard()
                    twist, attempt = nxt, attempt + 1
                    continue
            action = decide(
                attempt,
                vote.failed,
                vote.splittable,
                contract,
                repeated,
                overflow=vote.overflow,
            )
            self._record(vote.failures, _ACTION_NAMES.get(action, action))
            absorbed += vote.failures
            if action in ("commit", "skip"):
                return vote, action, absorbed, triage.faulty
            self.engine.discard()
            if action == "abort":
                raise StepAborted(
                    st.global_step, vote.failures, poison=bool(repeated) and not contract
                )
            if action == "retry":
                attempt += 1
                if not skip_bad:
                    twist = self._bisecting(vote, twist)

    @staticmethod
    def _bisecting(vote: Vote, twist: Twist) -> Twist:
        """The retry of a step whose parts raised (``on_bad_sample="stop"``): the members
        that failed bisect their part if it fails again, so that a poison batch's report
        names the samples that fail alone, not the whole part. Costs nothing when the retry
        passes; a crash, a hang or an out-of-memory failure is retried as planned."""
        if not vote.failures or any(f.kind != "exception" for f in vote.failures):
            return twist
        return Twist(bisect=frozenset(vote.failed_ranks or [0]))

    def _record(self, failures: list[WorkerFailure], action: str) -> None:
        """This attempt's failures, with what became of them (a failure whose bisection
        found its bad samples under ``on_bad_sample="skip"``: quarantined)."""
        skip_bad = self.s.on_bad_sample == "skip"
        for failure in failures:
            failure.action = "quarantined" if skip_bad and failure.bad_samples else action
            self.failures.append(failure)
            self.on_failure(failure)

    # -- bad samples (fit(on_bad_sample="skip"), phalanx.badsamples) ---------------------
    def _left_out(self) -> frozenset[int]:
        """The quarantined samples of the current step's global batch."""
        if not self.state.quarantine:
            return frozenset()
        return frozenset(self._batch_set() & set(self.state.quarantine))

    def _repeats_now(self, failure: WorkerFailure) -> bool:
        """Whether this member's failure of the attempt in progress repeats an earlier one."""
        failure.attempt = self.attempt
        return repeats(failure, [*self.known_failures, *self.failures])

    def _triage(
        self, triage: Triage, vote: Vote, repeated: int, base: frozenset[int]
    ) -> Twist | None:
        """The next attempt of a step under ``on_bad_sample="skip"`` (None: the usual rule
        decides): after a repeat, one rotated and bisecting attempt (blame); the samples
        found bad are quarantined and left out from then on; the members whose part passed
        elsewhere are at fault (``triage.faulty``: put out now if the step failed, else once
        it is committed)."""
        triage.members = max(1, len(vote.paces))
        if triage.stage == "plain":
            return triage.after_repeat(vote.failed_ranks) if vote.failed and repeated else None
        found = [i for i in vote.found if i not in self.state.quarantine]
        self._quarantine(found, vote)
        left = frozenset(base | (set(self.state.quarantine) & self._batch_set()))
        if triage.stage == "blame":
            triage.stage = "kept"
            triage.faulty = triage.at_fault(vote.failed_ranks)
            if not vote.failed:
                return None  # (it passed whole: commit)
            self._put_out(triage.faulty, vote)
            return Twist(leave_out=left)
        return Twist(leave_out=left) if vote.failed and found else None

    def _batch_set(self) -> set[int]:
        """The current step's global batch."""
        st = self.state
        if self._order[0] != st.epoch:
            self._order = (st.epoch, self.s.plan.order(st.epoch))
        return set(self.s.plan.global_batch(st.epoch, st.step, self._order[1]))

    def _quarantine(self, found: list[int], vote: Vote) -> None:
        st = self.state
        for index in found:
            st.quarantine[index] = st.global_step
        if found:
            self.emit(
                Notice(
                    f"quarantined sample(s) {found} at step {st.global_step + 1}: left out of "
                    "their global batch from now on (fit(on_bad_sample='skip'))",
                    level="warning",
                )
            )
        if len(st.quarantine) > self.s.max_bad_samples:
            failure = failure_of(
                TooManyBadSamples(
                    f"{len(st.quarantine)} samples failed alone (more than max_bad_samples="
                    f"{self.s.max_bad_samples}): the data is broken wholesale, not a few "
                    f"samples; the quarantined ones: {sorted(st.quarantine)[:20]}"
                ),
                self.engine.identity,
                "data",
                st.global_step,
                st.epoch,
            )
            failure.attempt = self.attempt
            self._record(vote.failures, "retried")
            self._record([failure], "aborted")
            raise StepAborted(st.global_step, [failure], poison=False)

    def _put_out(self, faulty: list[int], vote: Vote, committed: bool = False) -> None:
        """Members whose part failed twice on them and passed on another member are at fault:
        under ddp the member leaves (FailedHere: respawned or shrunk like any fallen worker);
        in one process (threads) nothing can leave, so the run stops naming it."""
        if not faulty:
            return
        st = self.state
        step = st.global_step - 1 if committed else st.global_step
        names = ", ".join(f"rank {r}" for r in faulty)
        text = (
            f"{names}: its part of step {step + 1} failed on it in two attempts and passed on "
            "another member: the worker is at fault, not the data"
        )
        if self.engine.can_leave:
            if self.engine.rank in faulty:
                failure = failure_of(
                    WorkerAtFault(text), self.engine.identity, "forward", step, st.epoch
                )
                raise FailedHere(failure)
            return
        failure = failure_of(WorkerAtFault(text), self.engine.identity, "forward", step, st.epoch)
        failure.attempt = self.attempt
        raise StepAborted(step, [*vote.failures, failure], poison=False)

    def _balance(self, vote: Vote) -> None:
        """Each member's pace in the committed vote, into this generation's balancer; new
        shares apply from the next step (the same decision on every member)."""
        if len(vote.paces) < 2:
            return
        if self._balanced is not self.engine or self.balancer is None:
            self.balancer = Balancer(len(vote.paces), self.s.balance, self.s.slow_worker)
            self._balanced = self.engine
        decision = self.balancer.observe(vote.paces)
        if decision is None:
            return
        st = self.state
        if decision.changed and st.step < self.s.plan.steps:
            self.fence()  # (a DataLoader with workers may fork: not beside a copying thread)
            self.engine.reshare(decision.shares, st.epoch, st.step)
        self.emit(
            Balanced(
                st.global_step, decision.shares, decision.paces, decision.slow, decision.changed
            )
        )
        if decision.too_slow:
            self._too_slow(decision)

    def _too_slow(self, decision: Decision) -> None:
        """Members over ``fit(slow_worker=)``: under ddp each leaves like a failed worker
        (respawned or shrunk); in one process nothing can leave: a warning says so."""
        assert self.s.slow_worker is not None
        ranks = ", ".join(f"rank {r}" for r in decision.too_slow)
        times = max(slower_than_peers(decision.paces, r) or 0.0 for r in decision.too_slow)
        text = (
            f"{ranks}: {times:.1f}x the time per sample of its peers, over slow_worker="
            f"{self.s.slow_worker:g}: put out like a failed worker"
        )
        if not self.engine.can_leave:
            self.emit(Notice(f"{text} (not in one process: it stays)", level="warning"))
            return
        if self.engine.rank in decision.too_slow:
            st = self.state
            failure = failure_of(
                WorkerTooSlow(text), self.engine.identity, "forward", st.global_step - 1, st.epoch
            )
            raise FailedHere(failure)

    def _validating_now(self, vote: Vote) -> bool:
        """After every ``val_every_steps``-th committed step, unless the epoch ends here (its
        own validation follows) or the run is stopping."""
        every, st = self.s.val_every_steps, self.state
        return (
            every is not None
            and st.global_step % every == 0
            and st.step < self.s.plan.steps
            and not vote.stop
        )

    def _validate_mid_epoch(self) -> dict[str, float]:
        st = self.state
        results = self._validate()
        st.history.append({"epoch": st.epoch, "global_step": st.global_step, **results})
        self.emit(Validated(st.epoch, st.step, st.global_step, results))
        return results

    def _validate(self) -> dict[str, float]:
        """One pass over the validation set on every member: ``valid/<metric>`` values."""
        self.emit(ValidationStarted(self.state.epoch, self.s.valid_batches))
        self.fence()  # (as at an epoch's start)
        sums = self.engine.evaluate()
        with self._fails_as("metrics"):
            valid = compute_all(self.s.metrics, sums)
        return {f"valid/{k}": v for k, v in valid.items()}

    def _stopping(self) -> bool:
        return self.stop_requested() is not None

    def _emit_step(self, loss_sum: float, samples: int, seconds: float, skipped: bool) -> None:
        if not self.engine.is_main:  # (only the main member speaks: nothing to build)
            return
        st = self.state
        stats = LoopStats(lr=self.engine.lr(), samples_per_s=samples / max(seconds, 1e-9))
        assert st.epoch_sums is not None
        with self._fails_as("metrics"):
            running = compute_all(self.s.metrics, st.epoch_sums)
        running.update({m.name: m.read(stats) for m in self.s.loop_metrics})
        loss = loss_sum / max(samples, 1)
        self.emit(
            StepEnded(
                st.epoch,
                st.step - 1,
                st.global_step,
                self.s.plan.steps,
                loss,
                stats.lr,
                samples,
                stats.samples_per_s,
                running,
                skipped,
            )
        )

    def _end_epoch(self) -> str | None:
        st = self.state
        assert st.epoch_sums is not None
        with self._fails_as("metrics"):
            train = compute_all(self.s.metrics, st.epoch_sums)
        results = {f"train/{k}": v for k, v in train.items()}
        results["train/lr"] = self.engine.lr()
        since, samples_then = self.window
        throughput = (st.epoch_samples - samples_then) / max(time.time() - since, 1e-9)
        stats = LoopStats(lr=self.engine.lr(), samples_per_s=throughput)
        results.update({f"train/{m.name}": m.read(stats) for m in self.s.loop_metrics})
        if self.s.has_valid:
            results.update(self._validate())
        st.history.append({"epoch": st.epoch, **results})
        self.engine.end_epoch()  # a per-epoch scheduler steps (after train/lr was read)
        self.emit(EpochEnded(st.epoch, results, time.time() - self.epoch_started))
        reason = self.early_stopping.update(st.epoch, results) if self.early_stopping else None
        st.epoch, st.step, st.epoch_sums, st.epoch_samples = st.epoch + 1, 0, None, 0
        self._checkpoint(epoch_end=True, metrics=results)
        return reason

    def _checkpoint(
        self, epoch_end: bool, force: bool = False, metrics: dict[str, float] | None = None
    ) -> None:
        if self.checkpointer is None or not (self.engine.is_main or self.engine.saves_shards):
            return
        config = self.checkpointer.config
        if not (force or should_save(self.state.global_step, epoch_end, config, self.state.epoch)):
            return
        if force and self.saved_step == self.state.global_step:
            return  # a stop right after a save of this very state: nothing new to save
        self.saved_step = self.state.global_step
        metric = None
        if config.keep_best and metrics is not None:
            metric = metrics.get(config.keep_best)
        with self._fails_as("checkpoint"):
            self.checkpointer.save(
                self.snapshot(), step=self.state.global_step, epoch=self.state.epoch, metric=metric
            )

    def save_final(self) -> None:
        """A checkpoint of the state as the run ends, unless this very state was saved
        (fsdp's ``gather=False``: the final weights' only copy)."""
        self._checkpoint(epoch_end=False, force=True)

    def final_checkpoint(self) -> str:
        """After :meth:`close_checkpointer`: the complete checkpoint of the state as the run
        ends (a sharded one: every rank's file there), by its path; raises FailedHere when
        there is none (the final weights would be lost)."""
        with self._fails_as("checkpoint"):
            assert self.checkpointer is not None
            step = self.state.global_step
            found = [p for p, s in list_checkpoints(self.checkpointer.directory) if s == step]
            if not found:
                raise CheckpointError(
                    f"the final checkpoint (step {step}) is not complete in "
                    f"{self.checkpointer.directory}: not every rank's shard file was written "
                    "(across nodes, run_dir must be a folder every node shares); with "
                    "gather=False it holds the only copy of the final weights"
                )
            return os.path.abspath(found[-1])
        raise AssertionError("unreachable")  # (_fails_as raises)

    def close_checkpointer(self) -> None:
        """Wait for pending checkpoint writes; a write that failed fails this member."""
        if self.checkpointer is not None:
            with self._fails_as("checkpoint"):
                self.checkpointer.close()

    @contextlib.contextmanager
    def _fails_as(self, phase: str) -> Iterator[None]:
        """Outside a step's vote, an exception fails this member in ``phase`` (FailedHere),
        named like any other failure."""
        try:
            yield
        except (FailedHere, Interrupted, Regroup, StepAborted):
            raise
        except Exception as exc:
            st = self.state
            step, epoch = st.global_step, st.epoch
            written = getattr(exc, "step", None) if isinstance(exc, CheckpointError) else None
            if written is not None:  # a background write: named at the checkpoint's step
                step = max(written - 1, 0)
            failure = failure_of(exc, self.engine.identity, phase, step, epoch)
            raise FailedHere(failure) from exc


_ACTION_NAMES = {"retry": "retried", "abort": "aborted", "split": "split"}


def step_seed(seed: int, global_step: int, rank: int) -> int:
    """Torch's RNG is reseeded at every step attempt: dropout and any randomness in the step
    depend only on (seed, step, rank), so a retried step and a resumed run replay exactly.
    (A 64-bit hash of the three: well mixed for neighbouring steps and ranks, ~1 us where
    numpy's SeedSequence took ~10.)"""
    key = b"%d,%d,%d" % (seed, global_step, rank)
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")


def _size(metrics: list[Metric]) -> int:
    from phalanx.metrics import total_size

    return total_size(metrics)
