"""How a ddp worker's generation ends, without processes: each exception out of a
generation becomes one :class:`Exit` in one place (``Worker.left_by``), as a table."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from phalanx.failures import FailedHere, WorkerFailure
from phalanx.loop import Regroup, StepAborted
from phalanx.plan import Plan
from phalanx.spec import FitConfig, TrainSpec
from phalanx.strategies.ddp.timing import Timing
from phalanx.strategies.ddp.wire.protocol import Broke
from phalanx.strategies.ddp.worker.engine import Member
from phalanx.strategies.ddp.worker.group import GroupBroken
from phalanx.strategies.ddp.worker.worker import Exit, Superseded, Worker, WorkerArgs


class Pipe:
    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send(self, message: Any) -> None:
        self.sent.append(message)


def mse(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def a_worker() -> tuple[Worker, Member, Pipe]:
    config = FitConfig(epochs=1, batch_size=4, devices=["cpu:0", "cpu:1"], strategy="ddp")
    pipe = Pipe()
    args = WorkerArgs(
        slot=1, store_port=0, token=b"t", user=b"", config=config, plan=Plan(8, 4, 0),
        train=[], valid=None, valid_size=0, conn=pipe, parent_pid=0, stack_file="",
        weights_path="", threads=1, timing=Timing.of(config),
    )  # fmt: skip
    spec = TrainSpec(
        model=nn.Linear(2, 1), optimizer=lambda p: torch.optim.SGD(p, lr=0.1), step=mse
    )
    member = Member.build(spec, config, 1, -1, lambda step, phase: None)
    return Worker(args), member, pipe


def own_failure(message: str = "bad sample") -> WorkerFailure:
    return WorkerFailure(worker=1, rank=1, device="cpu:1", kind="exception", message=message)


def raised(exc: Exception) -> Exception:
    try:
        raise exc
    except Exception as caught:
        return caught


failure = own_failure()
CASES = [
    ("regroup", Regroup(), None, Exit.REGROUP),
    ("superseded", Superseded(3), None, Exit.SUPERSEDED),
    ("aborted", StepAborted(5, [], poison=True), None, Exit.ABORTED),
    ("failed here", FailedHere(failure), None, Exit.FAILED),
    ("a collective broke", GroupBroken("all_reduce: Connection closed by peer"), None, Exit.BROKEN),
    ("own step failed, then the reducer", RuntimeError("reduction"), failure, Exit.BROKEN),
    ("a bug in phalanx", KeyError("bug"), None, Exit.FAILED),
]


@pytest.mark.parametrize(
    ("exc", "unvoted", "exit"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_each_exception_is_one_exit(
    exc: Exception, unvoted: WorkerFailure | None, exit: Exit
) -> None:
    worker, member, pipe = a_worker()
    member.replica.unvoted = unvoted
    left = worker.left_by(raised(exc), member)
    assert left.exit is exit
    if isinstance(exc, StepAborted):
        assert (left.step, left.poison) == (5, True)
    if isinstance(exc, FailedHere):
        assert left.failure is failure
    # Only the worker's own unvoted failure is told (as Broke): the rest is the caller's.
    sent = [m for m in pipe.sent if isinstance(m, Broke)]
    assert [m.failure for m in sent] == ([unvoted] if unvoted is not None else [])


def test_a_bug_in_phalanx_carries_its_traceback() -> None:
    worker, member, _ = a_worker()
    left = worker.left_by(raised(KeyError("no such key")), member)
    assert left.exit is Exit.FAILED and left.failure is not None
    assert left.failure.exception_type == "KeyError"
    assert left.failure.traceback is not None and "raise exc" in left.failure.traceback
    assert left.failure.worker == 1
