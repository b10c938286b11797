"""Failure as a value: one :class:`WorkerFailure` per thing that went wrong in a worker.

Workers build these from exceptions (:func:`from_exception`); the supervisor builds them
from process deaths and hangs. :func:`headline` gives the one line, in burn's words, that
opens a :class:`~phalanx.errors.TrainingFailed` report.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
import traceback as tb
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, get_args

Kind = Literal["exception", "crash", "hang", "oom"]
Phase = Literal[
    "preflight",
    "data",
    "forward",
    "backward",
    "sync",
    "optimizer",
    "metrics",
    "validation",
    "checkpoint",
]
PHASES: tuple[str, ...] = get_args(Phase)
# The order of a worker's phases within a step (and around it): of two stalled workers, the
# one in an earlier step, or an earlier phase of the same step, is the one the other waits
# on (the coordinator's hang verdict and the panel's waiting line).
PHASE_ORDER = (
    "start",
    "preflight",
    "regroup",
    "data",
    "forward",
    "metrics",
    "sync",  # the vote leaves before the synchronised backward
    "backward",
    "optimizer",
    "validation",
    "checkpoint",
)


def phase_rank(phase: str) -> int:
    """``phase``'s place in :data:`PHASE_ORDER` (unknown phases last)."""
    return PHASE_ORDER.index(phase) if phase in PHASE_ORDER else len(PHASE_ORDER)


# Errors raised when the step function breaks its contract (a loss that is not one finite
# number, a wrong return type): a retry computes the same, so the run stops at once.
# fsdp: what a new generation's members raise when they find no complete set of shard
# snapshots (fsdp_handover.NoShardSet): the state a lost member held is gone, not theirs
NO_SHARD_SET = "NoShardSet"
STEP_CONTRACT_ERRORS = (
    "LossNotScalarError",
    "NonFiniteLossError",
    "StepOutputError",
    "TorchDistributedCallError",  # dist.get_rank() in user code (PX124): a retry calls it again
)


@dataclass
class WorkerFailure:
    """What failed, where, when, and why. Picklable and JSON-friendly (:meth:`to_dict`)."""

    worker: int
    rank: int
    device: str
    kind: Kind
    message: str
    phase: str = "forward"
    step: int | None = None
    epoch: int | None = None
    exception_type: str | None = None
    traceback: str | None = None
    host: str = field(default_factory=socket.gethostname)
    pid: int | None = None
    exit_code: int | None = None
    signal: int | None = None
    stacks: str | None = None
    sample_indices: list[int] | None = None
    time: float = field(default_factory=time.time)
    action: str | None = None  # what the run did: retried, split, shrunk, respawned, aborted
    recovery_seconds: float | None = None  # from the failure to the next committed step
    # Which attempt of its step failed: 0 the first, 1 its retry. Attempts are counted over
    # the whole run, across generations (out-of-memory splits are not new attempts). None
    # outside a step.
    attempt: int | None = None
    # A hang: when the worker last made progress (wall clock), so its cost counts from there.
    last_progress: float | None = None
    # The fall that left no member (action "restarted"), or under fsdp any fall (every member
    # starts from a set of shard snapshots): how many committed steps the run computed
    # again from the snapshot or checkpoint it started from (set once it has).
    replayed_steps: int | None = None
    # fit(on_bad_sample="skip"): the samples of its part this worker found failing alone,
    # each as [dataset index, error] (they are left out from this step on: "quarantined").
    bad_samples: list[list[Any]] | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def breaks_step_contract(self) -> bool:
        """The step function returned something the loop cannot train on (no retry helps)."""
        return self.exception_type in STEP_CONTRACT_ERRORS


def bad_sample_errors(failures: list[WorkerFailure]) -> dict[int, str]:
    """Each sample a bisection found failing alone (dataset index), with the error it failed
    with: the first failure that names it says it."""
    errors: dict[int, str] = {}
    for f in failures:
        for index, error in f.bad_samples or []:
            errors.setdefault(int(index), str(error))
    return errors


def one_line(text: str, limit: int = 120) -> str:
    """``text`` on one line (whitespace runs made one space), cut at ``limit`` with an ellipsis."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def is_oom(exc: BaseException) -> bool:
    import torch

    return isinstance(exc, torch.OutOfMemoryError)


def from_exception(
    exc: BaseException,
    *,
    worker: int,
    rank: int,
    device: str,
    phase: str,
    step: int | None,
    epoch: int | None,
    sample_indices: list[int] | None = None,
    pid: int | None = None,
) -> WorkerFailure:
    """Record ``exc`` raised in ``phase`` of ``step`` on this worker, with its traceback. A
    call on torch's default process group from user code (which phalanx never creates) is
    recorded as a TorchDistributedCallError (PX124) that says what to call instead."""
    from phalanx.ranks import TORCH_DEFAULT_GROUP_FIX, torch_default_group_call

    kind, message = type(exc).__name__, str(exc)
    if torch_default_group_call(exc):
        kind = "TorchDistributedCallError"
        message = f"{TORCH_DEFAULT_GROUP_FIX} (torch said: {type(exc).__name__}: {exc})"
    return WorkerFailure(
        worker=worker,
        rank=rank,
        device=device,
        kind="oom" if is_oom(exc) else "exception",
        message=message,
        phase=phase,
        step=step,
        epoch=epoch,
        exception_type=kind,
        traceback="".join(tb.format_exception(type(exc), exc, exc.__traceback__)),
        pid=pid,
        sample_indices=sample_indices,
    )


class Who(Protocol):
    """Who a failure happened to: a replica's identity."""

    worker: int
    rank: int
    device: str


def failure_of(
    exc: BaseException,
    who: Who,
    phase: str,
    step: int | None,
    epoch: int | None,
    samples: list[int] | None = None,
) -> WorkerFailure:
    """``exc``, raised in ``phase`` on the replica ``who``, as a failure record."""
    return from_exception(
        exc,
        worker=who.worker,
        rank=who.rank,
        device=who.device,
        phase=phase,
        step=step,
        epoch=epoch,
        sample_indices=samples,
        pid=os.getpid(),
    )


def headline(f: WorkerFailure) -> str:
    """One line: ``training worker on device cpu:1 (rank 1, host h, pid p) failed at step 57
    (backward): RuntimeError: <original message>``. Steps and epochs are 1-based here (step
    57 is ``WorkerFailure.step == 56``)."""
    who = f"rank {f.rank}, host {f.host}"
    if f.pid is not None:
        who += f", pid {f.pid}"
    # Shown 1-based, as every line people read (the record keeps 0-based indices).
    if f.phase == "validation" and f.epoch is not None:
        at = f"in validation of epoch {f.epoch + 1}"
    elif f.step is not None:
        at = f"at step {f.step + 1}"
    else:
        at = "before its first step"
    return f"training worker on device {f.device} ({who}) failed {at} ({f.phase}): {cause(f)}"


def cause(f: WorkerFailure) -> str:
    """The original cause in a few words: the exception, the signal or the hang."""
    if f.kind == "hang":
        return f"hung: {f.message}"
    if f.exception_type:
        first = f.message.strip().splitlines()[0] if f.message.strip() else ""
        return f"{f.exception_type}: {first}"
    return f.message


class FailedHere(Exception):
    """Raised by an engine when this member failed where no vote can absorb it (optimizer,
    validation, checkpoint): the run cannot go on with this member as it is."""

    def __init__(self, failure: WorkerFailure) -> None:
        super().__init__(headline(failure))
        self.failure = failure
