"""Exact resume: a run interrupted mid-epoch and resumed ends bitwise equal to a straight run.

CPU, strategy "single". The model has dropout (RNG), the optimizer momentum, the LR a
StepLR schedule and the metrics include accuracy, so every piece of state a checkpoint must
carry (weights, optimizer, scheduler, RNG, sampler position, metric sums, history) matters.
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import phalanx as px
from phalanx.errors import CheckpointError
from phalanx.events import CheckpointSkipped, Event, Notice, Resumed, RunStarted, StepEnded
from phalanx.strategies.ddp.agent.agent import START_METHOD
from recorder import Recorder

SAMPLES, BATCH, EPOCHS = 32, 8, 3
STEPS_PER_EPOCH = SAMPLES // BATCH  # 4
TOTAL_STEPS = STEPS_PER_EPOCH * EPOCHS  # 12
STOP_AT = STEPS_PER_EPOCH * 3 // 2  # 1.5 epochs: global step 6


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 3))


def make_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def make_scheduler(optimizer: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)


def train_step(model: nn.Module, batch: Any) -> px.StepOutput:
    x, y = batch
    logits = model(x)
    return px.StepOutput(nn.functional.cross_entropy(logits, y), logits, y)


def datasets() -> tuple[TensorDataset, TensorDataset]:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(SAMPLES + 12, 4, generator=g)
    y = torch.randint(0, 3, (SAMPLES + 12,), generator=g)
    return TensorDataset(x[:SAMPLES], y[:SAMPLES]), TensorDataset(x[SAMPLES:], y[SAMPLES:])


def learner() -> px.Learner:
    return px.Learner(
        make_model,
        make_optimizer,
        train_step,
        metrics=[px.metrics.Accuracy()],
        lr_scheduler=make_scheduler,
    )


class StopAt(Recorder):
    """Calls ``learner.stop("test")`` when it sees the StepEnded of global step ``at``."""

    def __init__(self, learner: px.Learner, at: int) -> None:
        super().__init__()
        self.learner = learner
        self.at = at

    def handle(self, event: Event) -> None:
        super().handle(event)
        if isinstance(event, StepEnded) and event.global_step == self.at:
            self.learner.stop("test")


def fit(lrn: px.Learner, run_dir: Path | None, sinks: list[Any], **kw: Any) -> px.FitResult:
    train, valid = datasets()
    options: dict[str, Any] = {
        "epochs": EPOCHS,
        "batch_size": BATCH,
        "seed": 7,
        "checkpoint": px.Checkpoints(every_steps=1, keep_last=2),
        "sinks": sinks,
    }
    options.update(kw)
    return lrn.fit(train, valid, run_dir=None if run_dir is None else str(run_dir), **options)


def ckpt(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"ckpt-{step:09d}.pt"


def assert_bitwise_equal(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), f"parameter {key} differs"


def interrupted_run(run_dir: Path) -> px.FitResult:
    lrn = learner()
    stopper = StopAt(lrn, STOP_AT)
    result = fit(lrn, run_dir, [stopper])
    assert result.interrupted == "Training interrupted: test"
    return result


@pytest.fixture(scope="module")
def straight() -> px.FitResult:
    result = fit(learner(), None, [])
    assert result.interrupted is None
    assert result.steps == TOTAL_STEPS
    assert len(result.history) == EPOCHS
    return result


def test_straight_run_is_reproducible(straight: px.FitResult) -> None:
    """The baseline itself is deterministic (otherwise bitwise resume means nothing), and
    dropout is really active (a run with another seed differs)."""
    again = fit(learner(), None, [])
    assert_bitwise_equal(straight.model, again.model)
    assert again.history == straight.history
    other = fit(learner(), None, [], seed=8)
    assert not torch.equal(other.model[0].weight, straight.model[0].weight)


def test_interrupted_and_resumed_run_equals_straight_run(
    straight: px.FitResult, tmp_path: Path
) -> None:
    first = interrupted_run(tmp_path)
    # The stop lands at a step boundary mid-epoch 1 (the stop request travels in the next
    # step's vote, so at most one more step runs), and a checkpoint of that step exists.
    assert STOP_AT <= first.steps <= STOP_AT + 1
    assert first.steps < TOTAL_STEPS
    assert first.steps % STEPS_PER_EPOCH != 0
    assert first.epochs == 1
    assert len(first.history) == 1
    assert first.history[0] == straight.history[0]
    assert ckpt(tmp_path, first.steps).is_file()

    rec = Recorder()
    second = fit(learner(), tmp_path, [rec], resume=True)

    (resumed,) = rec.of(Resumed)
    assert resumed.path == str(ckpt(tmp_path, first.steps))
    assert resumed.global_step == first.steps
    assert (resumed.epoch, resumed.step) == divmod(first.steps, STEPS_PER_EPOCH)
    (started,) = rec.of(RunStarted)
    assert (started.start_epoch, started.start_step) == (resumed.epoch, resumed.step)
    steps = [e.global_step for e in rec.of(StepEnded)]
    assert steps == list(range(first.steps + 1, TOTAL_STEPS + 1))  # nothing replayed, none lost

    assert second.interrupted is None
    assert second.steps == TOTAL_STEPS
    assert second.epochs == EPOCHS
    assert second.history == straight.history
    assert_bitwise_equal(second.model, straight.model)


def test_step_losses_after_resume_match_the_straight_run(tmp_path: Path) -> None:
    """Per-step losses and LRs (dropout masks included) replay exactly after a resume."""
    ref = Recorder()
    fit(learner(), None, [ref])
    first = interrupted_run(tmp_path)
    rec = Recorder()
    fit(learner(), tmp_path, [rec], resume=True)
    expected = {e.global_step: (e.loss, e.lr, e.metrics) for e in ref.of(StepEnded)}
    got = {e.global_step: (e.loss, e.lr, e.metrics) for e in rec.of(StepEnded)}
    assert got == {s: v for s, v in expected.items() if s > first.steps}


def test_interrupt_at_the_last_step_of_an_epoch_resumes_exactly(
    straight: px.FitResult, tmp_path: Path
) -> None:
    lrn = learner()
    fit(lrn, tmp_path, [StopAt(lrn, STEPS_PER_EPOCH - 1)])
    second = fit(learner(), tmp_path, [], resume=True)
    assert second.history == straight.history
    assert_bitwise_equal(second.model, straight.model)


def test_truncated_newest_checkpoint_is_skipped(straight: px.FitResult, tmp_path: Path) -> None:
    first = interrupted_run(tmp_path)
    newest, previous = ckpt(tmp_path, first.steps), ckpt(tmp_path, first.steps - 1)
    assert newest.is_file() and previous.is_file()
    data = newest.read_bytes()
    newest.write_bytes(data[: len(data) // 2])

    rec = Recorder()
    second = fit(learner(), tmp_path, [rec], resume=True)

    skipped = rec.of(CheckpointSkipped)
    assert [s.path for s in skipped] == [str(newest)]
    assert "truncated" in skipped[0].reason
    (resumed,) = rec.of(Resumed)
    assert resumed.path == str(previous)
    assert resumed.global_step == first.steps - 1
    steps = [e.global_step for e in rec.of(StepEnded)]
    assert steps == list(range(first.steps, TOTAL_STEPS + 1))  # the lost step is redone
    assert second.history == straight.history
    assert_bitwise_equal(second.model, straight.model)


def snapshot_files(folder: Path) -> dict[str, tuple[str, int]]:
    return {
        p.name: (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
        for p in sorted(folder.iterdir())
    }


def test_resume_with_another_batch_size_raises_and_touches_nothing(tmp_path: Path) -> None:
    first = interrupted_run(tmp_path)
    before = snapshot_files(tmp_path / "checkpoints")
    assert f"ckpt-{first.steps:09d}.pt" in before

    rec = Recorder()
    with pytest.raises(CheckpointError) as info:
        fit(learner(), tmp_path, [rec], resume=True, batch_size=4)

    err = info.value
    assert err.code == "PX120"
    text = str(err)
    assert "batch_size" in text
    assert "batch_size 8 in the checkpoint, 4 now" in text
    assert "new run_dir" in text  # names the fix
    assert not rec.of(StepEnded)
    assert snapshot_files(tmp_path / "checkpoints") == before


def test_failed_resume_leaves_no_checkpointer_thread(tmp_path: Path) -> None:
    """A resume that raises must still close the run's Checkpointer (no leaked thread)."""
    interrupted_run(tmp_path)
    before = {t.ident for t in threading.enumerate()}
    with pytest.raises(CheckpointError):
        fit(learner(), tmp_path, [], resume=True, batch_size=4)
    leaked = [
        t.name
        for t in threading.enumerate()
        if t.ident not in before and t.name == "phalanx-checkpointer"
    ]
    assert leaked == []


@pytest.mark.parametrize("exists", [False, True])
def test_resume_with_empty_run_dir_starts_fresh_with_an_info_notice(
    straight: px.FitResult, tmp_path: Path, exists: bool
) -> None:
    run_dir = tmp_path / "run"
    if exists:
        run_dir.mkdir()
    rec = Recorder()
    result = fit(learner(), run_dir, [rec], resume=True)

    notices = rec.of(Notice)
    assert len(notices) == 1
    assert "no checkpoint" in notices[0].text and "a first run" in notices[0].text
    assert str(run_dir / "checkpoints") in notices[0].text
    assert notices[0].level == "info"  # a first run with resume=True is what the docs advise
    assert not rec.of(Resumed)
    assert result.steps == TOTAL_STEPS
    assert result.history == straight.history
    assert_bitwise_equal(result.model, straight.model)
    assert os.path.isfile(ckpt(run_dir, TOTAL_STEPS))


def linear_model() -> nn.Module:
    return nn.Linear(4, 3)


def adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.01)


def learner_with(model: Any, optimizer: Any) -> px.Learner:
    return px.Learner(
        model, optimizer, train_step, metrics=[px.metrics.Accuracy()], lr_scheduler=make_scheduler
    )


@pytest.mark.parametrize(
    ("writer", "reader", "detail"),
    [
        ((make_model, make_optimizer), (linear_model, make_optimizer), "Missing key(s)"),
        ((make_model, make_optimizer), (make_model, adam), "KeyError"),
        ((make_model, adam), (make_model, make_optimizer), "group 0 has no dampening, momentum"),
    ],
    ids=["Sequential into Linear", "SGD into Adam", "Adam into SGD"],
)
def test_resume_into_another_model_or_optimizer_names_the_file_and_the_fix(
    tmp_path: Path, writer: Any, reader: Any, detail: str
) -> None:
    """A checkpoint resumed with another model or optimizer: one CheckpointMismatchError
    before any step (Adam's state loads into SGD without complaint, but SGD would fail at
    its first step), and the checkpoints stay as they were: the writer's learner resumes
    from them afterwards."""
    from phalanx.errors import CheckpointMismatchError

    lrn = learner_with(*writer)
    first = fit(lrn, tmp_path, [StopAt(lrn, STOP_AT)])
    assert first.interrupted
    before = snapshot_files(tmp_path / "checkpoints")
    rec = Recorder()
    with pytest.raises(CheckpointMismatchError) as info:
        fit(learner_with(*reader), tmp_path, [rec], resume=True)

    err = info.value
    assert isinstance(err, CheckpointError)
    assert err.code == "PX122"
    assert str(ckpt(tmp_path, first.steps)) in err.message
    assert "resume with the same model and optimizer as the run that wrote it" in err.message
    assert "or use a new run_dir" in err.message
    assert detail in err.message, err.message
    assert not rec.of(StepEnded) and not rec.of(Resumed)
    assert snapshot_files(tmp_path / "checkpoints") == before

    rec = Recorder()
    second = fit(learner_with(*writer), tmp_path, [rec], resume=True)
    assert rec.of(Resumed)[0].global_step == first.steps
    assert second.steps == TOTAL_STEPS


def test_checkpoints_and_the_final_model_open_with_plain_torch(
    straight: px.FitResult, tmp_path: Path
) -> None:
    """Every checkpoint (scheduler, early stopping, RNG, history, ledger, plan inside) opens
    with torch.load(weights_only=True); px.load_checkpoint gives the same dict; the model's
    state dict loads into a fresh model. A finished run leaves run_dir/model.pt; an
    interrupted one does not."""
    lrn = learner()
    first = fit(
        lrn,
        tmp_path,
        [StopAt(lrn, STOP_AT)],
        early_stopping=px.EarlyStopping(metric="valid/loss", patience=5),
    )
    assert first.interrupted and first.model_path is None
    assert not (tmp_path / "model.pt").exists()
    path = ckpt(tmp_path, first.steps)
    plain = torch.load(path, weights_only=True)
    assert {"model", "optimizer", "scheduler", "loop", "early_stopping", "plan", "rng"} <= set(
        plain
    )
    assert plain["phalanx"]["step"] == first.steps and plain["phalanx"]["format"] == 2
    assert plain["loop"]["global_step"] == first.steps
    assert plain["loop"]["history"] == first.history
    assert plain["early_stopping"]["bad_epochs"] == 0
    assert plain["plan"]["samples"] == SAMPLES and len(plain["plan"]["fingerprint"]) == 16
    assert plain["scheduler"]["last_epoch"] == first.steps
    mine = px.load_checkpoint(path)
    assert mine.keys() == plain.keys()
    assert px.load_checkpoint(tmp_path)["phalanx"] == plain["phalanx"]  # a run_dir: newest
    model = make_model()
    model.load_state_dict(px.load_checkpoint(path)["model"])
    assert torch.equal(model[0].weight, first.model[0].weight)

    second = fit(learner(), tmp_path, [], resume=True)
    assert second.model_path == str(tmp_path / "model.pt")
    final = make_model()
    final.load_state_dict(torch.load(second.model_path, weights_only=True))
    assert_bitwise_equal(final, straight.model)


def test_a_damaged_checkpoint_is_named_by_load_checkpoint(tmp_path: Path) -> None:
    first = interrupted_run(tmp_path)
    path = ckpt(tmp_path, first.steps)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        px.load_checkpoint(path)
    older = px.load_checkpoint(tmp_path)  # a run_dir: the newest that verifies
    assert older["phalanx"]["step"] == first.steps - 1


def test_resume_with_another_dataset_of_the_same_size_raises_and_touches_nothing(
    tmp_path: Path,
) -> None:
    """An unseeded random_split gives another training set of the same size on every run:
    resuming on it would train on other samples (and leak validation data). Refused."""
    first = interrupted_run(tmp_path)
    before = snapshot_files(tmp_path / "checkpoints")
    train, valid = datasets()
    swapped = TensorDataset(train.tensors[0].flip(0), train.tensors[1].flip(0))
    assert len(swapped) == len(train)
    rec = Recorder()
    with pytest.raises(CheckpointError) as info:
        learner().fit(
            swapped,
            valid,
            epochs=EPOCHS,
            batch_size=BATCH,
            seed=7,
            run_dir=str(tmp_path),
            resume=True,
            sinks=[rec],
        )
    err = info.value
    assert err.code == "PX120"
    assert str(ckpt(tmp_path, first.steps)) in err.message
    assert f"another training dataset of the same size ({SAMPLES} samples)" in err.message
    assert "generator=" in err.message and "new run_dir" in err.message
    # which samples differ, and how: the labels moved with the rows (another order)
    assert "of the 8 samples phalanx reads (indices " in err.message
    assert "differ in shapes, dtypes, integers (labels)" in err.message
    assert "values differ" not in err.message
    assert not rec.of(StepEnded) and not rec.of(Resumed)
    assert snapshot_files(tmp_path / "checkpoints") == before
    # the same data again (a fresh but equal dataset object) resumes
    again = fit(learner(), tmp_path, [], resume=True)
    assert again.steps == TOTAL_STEPS


def test_resume_with_a_smaller_dataset_names_both_sizes(tmp_path: Path) -> None:
    first = interrupted_run(tmp_path)
    before = snapshot_files(tmp_path / "checkpoints")
    train, valid = datasets()
    fewer = TensorDataset(train.tensors[0][:-20], train.tensors[1][:-20])
    with pytest.raises(CheckpointError) as info:
        learner().fit(
            fewer,
            valid,
            epochs=EPOCHS,
            batch_size=BATCH,
            seed=7,
            run_dir=str(tmp_path),
            resume=True,
            sinks=[],
        )
    err = info.value
    assert err.code == "PX120"
    assert str(ckpt(tmp_path, first.steps)) in err.message
    assert f"samples {SAMPLES} in the checkpoint, {SAMPLES - 20} now" in err.message
    assert snapshot_files(tmp_path / "checkpoints") == before


def test_another_dataset_is_refused_under_ddp_before_any_process_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plan record of the checkpoint a resume would load is read in the caller (mapped,
    not loaded), so under ddp the refusal comes before any worker process, as a
    CheckpointError, not as a worker's failure."""
    import multiprocessing

    interrupted_run(tmp_path)
    before = snapshot_files(tmp_path / "checkpoints")
    started: list[str] = []

    def start(self: Any) -> None:
        started.append(self.name)
        raise RuntimeError("a process was started")

    monkeypatch.setattr(multiprocessing.get_context(START_METHOD).Process, "start", start)
    train, valid = datasets()
    swapped = TensorDataset(train.tensors[0].flip(0), train.tensors[1].flip(0))
    with pytest.raises(CheckpointError, match="another training dataset of the same size"):
        learner().fit(
            swapped,
            valid,
            epochs=EPOCHS,
            batch_size=BATCH,
            seed=7,
            run_dir=str(tmp_path),
            resume=True,
            strategy="ddp",
            devices="cpu:0,cpu:1",
            sinks=[],
        )
    assert started == []
    assert snapshot_files(tmp_path / "checkpoints") == before


def test_resume_where_every_checkpoint_is_damaged_warns(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    fit(learner(), run_dir, [], max_steps=2)
    for path in (run_dir / "checkpoints").glob("*.pt"):
        path.write_bytes(b"not a checkpoint")
    rec = Recorder()
    fit(learner(), run_dir, [rec], resume=True)
    notices = [n for n in rec.of(Notice) if n.text.startswith("resume:")]
    assert len(notices) == 1
    assert notices[0].level == "warning"
    assert "starting from scratch" in notices[0].text
    assert rec.of(CheckpointSkipped)  # each damaged file named


def test_resume_with_data_drawn_again_at_random_names_the_values(tmp_path: Path) -> None:
    """The ported script's case: the features come from an unseeded torch.randn each run,
    the labels are the same: the refusal says which samples differ, by how much, and that
    they are float values only (the likely cause: data made at random)."""
    interrupted_run(tmp_path)
    train, valid = datasets()
    noisy = TensorDataset(
        train.tensors[0] + 0.01 * torch.randn(train.tensors[0].shape), train.tensors[1]
    )
    with pytest.raises(CheckpointError) as info:
        learner().fit(
            noisy, valid, epochs=EPOCHS, batch_size=BATCH, seed=7, run_dir=str(tmp_path),
            resume=True, sinks=[],
        )  # fmt: skip
    message = info.value.message
    assert "8 of the 8 samples phalanx reads" in message
    assert (
        "other floating-point values" in message and "same shapes, dtypes and integers" in message
    )
    assert "torch.randn" in message and "fixed seed" in message
    assert len(message) < 1200


def test_the_end_of_a_resumed_run_tells_this_invocations_steps_from_the_runs_totals(
    tmp_path: Path,
) -> None:
    import io

    from rich.console import Console

    from phalanx.sinks import SummarySink

    first = interrupted_run(tmp_path)
    console = Console(file=io.StringIO(), width=300)
    result = fit(learner(), tmp_path, [SummarySink(console)], resume=True)
    out = console.file.getvalue()  # type: ignore[attr-defined]
    done = TOTAL_STEPS - first.steps
    assert f"Trained {done} step(s) in " in out
    assert f"resumed after step {first.steps}; the run's totals: {EPOCHS} epoch(s), " in out
    assert f"{TOTAL_STEPS} step(s)." in out and result.steps == TOTAL_STEPS
