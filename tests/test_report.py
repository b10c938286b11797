"""The report's choices, without processes: which failures are a survivor's consequence
(never the root cause) and which failure is the root cause."""

from __future__ import annotations

from pathlib import Path

import pytest

from phalanx.failures import WorkerFailure
from phalanx.report import is_secondary, root_cause


def failure(
    message: str, phase: str = "sync", kind: str = "exception", **kw: object
) -> WorkerFailure:
    return WorkerFailure(
        worker=0, rank=0, device="cpu:0", kind=kind, message=message, phase=phase, **kw
    )


@pytest.mark.parametrize(
    "message",
    [
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
        "[127.0.0.1]:41234",
        "[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out "
        "waiting 60000ms for recv operation to complete",
        "Read error [127.0.0.1]:5555: Connection reset by peer",
        "NCCL communicator was aborted on rank 1.",
    ],
)
def test_a_collective_broken_by_a_fallen_peer_is_secondary(message: str) -> None:
    assert is_secondary(failure(message))
    assert is_secondary(failure(message, phase="backward"))


def test_a_distributed_error_type_is_secondary_whatever_it_says() -> None:
    assert is_secondary(failure("something odd", exception_type="DistBackendError"))


@pytest.mark.parametrize(
    ("message", "phase", "kind"),
    [
        ("expected peer count 3, got 2", "forward", "exception"),  # the user's own words
        ("the model was shut down by the user", "forward", "exception"),
        ("Connection closed by peer", "validation", "exception"),  # not in a step phase
        ("Connection closed by peer", "sync", "crash"),  # a death is never a consequence
    ],
)
def test_a_failure_of_its_own_is_not_secondary(message: str, phase: str, kind: str) -> None:
    assert not is_secondary(failure(message, phase=phase, kind=kind))


def test_the_root_cause_is_the_earliest_primary_failure_not_a_survivors_error() -> None:
    survivor = failure("Connection reset by peer", time=1.0, action="aborted")
    died = failure("worker process died from signal SIGKILL", kind="crash", time=2.0)
    died.action = "aborted"
    assert root_cause([survivor, died]) is died


def test_a_poison_batch_names_the_first_failure_of_the_step_that_failed_twice() -> None:
    first = failure("boom", phase="forward", step=4, time=1.0, action="retried")
    second = failure("boom", phase="forward", step=4, time=3.0, action="aborted")
    earlier = failure("other", phase="forward", step=2, time=0.5, action="retried")
    assert root_cause([earlier, second, first], poison=True) is first


def test_a_broken_step_contract_is_the_root_cause_of_the_attempt_it_stopped() -> None:
    """An ordinary exception (which alone would have been retried) and a NaN loss in the
    same attempt: the NaN is why the run stopped at once, so it is the root cause, and the
    error is an InvalidStepError with its code."""
    from phalanx.errors import ConfigError, InvalidStepError
    from phalanx.report import build

    other = failure("boom", phase="forward", step=2, time=1.0, action="aborted")
    nan = failure("[PX107] the loss is nan", phase="forward", step=2, time=2.0, action="aborted")
    nan.exception_type = "NonFiniteLossError"
    assert root_cause([other, nan]) is nan
    err = build([other, nan])
    assert isinstance(err, InvalidStepError) and isinstance(err, ConfigError)
    assert err.code == "PX107" and err.root_cause is nan


def test_a_failures_json_that_cannot_be_written_keeps_the_report(tmp_path: Path) -> None:
    """The run folder cannot take failures.json (here its temporary file's name is taken
    by a folder): the error still names the root cause, and says the file is missing."""
    from phalanx.failures import WorkerFailure
    from phalanx.run import stopped
    from phalanx.spec import FitConfig

    (tmp_path / "failures.json.tmp").mkdir()
    failure = WorkerFailure(1, 1, "cpu:1", "exception", "boom", "forward", step=4, action="aborted")
    config = FitConfig(epochs=1, batch_size=8, devices=["cpu:0", "cpu:1"], strategy="ddp",
                       run_dir=str(tmp_path))  # fmt: skip
    error = stopped([failure], False, config)
    text = str(error)
    assert "failed at step 5 (forward)" in text.splitlines()[0]
    assert "failures.json could not be written" in text
    assert not (tmp_path / "failures.json").exists()
