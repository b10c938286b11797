"""Sinks: summary table, JSONL log, metrics CSV, progress display, default set."""

from __future__ import annotations

import csv
import functools
import io
import json
import math
import re
from pathlib import Path

import pytest
from rich.console import Console

from phalanx.events import (
    CheckpointSaved,
    CheckpointSkipped,
    EpochEnded,
    EpochStarted,
    Event,
    Fanout,
    Notice,
    Resumed,
    RunEnded,
    RunStarted,
    StepEnded,
    Validated,
    ValidationStarted,
    WorkerFailed,
    to_record,
)
from phalanx.failures import WorkerFailure
from phalanx.sinks import (
    JsonlSink,
    MetricsCsvSink,
    ProgressSink,
    RunFileSink,
    StepsCsvSink,
    SummaryRow,
    SummarySink,
    default_sinks,
    render_summary,
    summarize,
)
from phalanx.sinks.steps import BASE

ANSI = re.compile(r"\x1b\[")

HISTORY = [
    {"train/loss": 1.0, "valid/loss": 1.2, "valid/accuracy": 0.50},
    {"train/loss": 0.6, "valid/loss": 0.9, "valid/accuracy": 0.71},
    {"train/loss": 0.4, "valid/loss": 1.0, "valid/accuracy": 0.70},
]


def _step(epoch: int, step: int, global_step: int, loss: float = 0.5) -> StepEnded:
    return StepEnded(
        epoch=epoch,
        step=step,
        global_step=global_step,
        steps_in_epoch=4,
        loss=loss,
        lr=1e-3,
        samples=64,
        samples_per_s=1234.0,
    )


def _failure() -> WorkerFailure:
    return WorkerFailure(
        worker=1,
        rank=1,
        device="cpu:1",
        kind="exception",
        message="boom [not markup]",
        phase="backward",
        step=5,
        epoch=1,
        exception_type="RuntimeError",
    )


def full_run() -> list[Event]:
    """A run of 2 epochs x 4 steps with a failure, a notice and a skipped checkpoint."""
    events: list[Event] = [
        CheckpointSkipped(path="runs/x/ckpt-3.pt", reason="bad checksum"),
        RunStarted(
            run_dir="runs/x",
            strategy="ddp",
            devices=["cpu:0", "cpu:1"],
            epochs=2,
            steps_per_epoch=4,
            batch_size=64,
            train_samples=250,  # the last global batch of an epoch has 58
            valid_samples=64,
        ),
    ]
    g = 0
    for epoch in range(2):
        events.append(EpochStarted(epoch=epoch, steps=4))
        for step in range(4):
            g += 1
            events.append(_step(epoch, step, g, loss=1.0 / g))
            if (epoch, step) == (1, 0):
                events.append(WorkerFailed(failure=_failure(), action="retried"))
        events.append(ValidationStarted(epoch=epoch, batches=2))
        events.append(EpochEnded(epoch=epoch, metrics=HISTORY[epoch], seconds=1.5))
        events.append(CheckpointSaved(path=f"runs/x/ckpt-{epoch}.pt", step=g, epoch=epoch))
    events.append(Notice(text="early stopping: valid/loss did not improve", level="warning"))
    events.append(RunEnded(history=HISTORY[:2], steps=g, epochs=2, interrupted=None, seconds=3.0))
    return events


# -- summary ---------------------------------------------------------------------------------


def test_summarize_min_max_and_epochs() -> None:
    rows = {(r.split, r.metric): r for r in summarize(HISTORY)}
    assert rows[("train", "loss")] == SummaryRow("train", "loss", 0.4, 3, 1.0, 1)
    assert rows[("valid", "loss")] == SummaryRow("valid", "loss", 0.9, 2, 1.2, 1)
    assert rows[("valid", "accuracy")] == SummaryRow("valid", "accuracy", 0.5, 1, 0.71, 2)
    assert [(r.split, r.metric) for r in summarize(HISTORY)] == [
        ("train", "loss"),
        ("valid", "accuracy"),
        ("valid", "loss"),
    ]


def test_summarize_ignores_nan_and_handles_missing_keys_and_ties() -> None:
    history = [{"train/loss": math.nan}, {"train/loss": 2.0, "lr": 0.1}, {"train/loss": 2.0}]
    rows = {(r.split, r.metric): r for r in summarize(history)}
    assert rows[("train", "loss")] == SummaryRow("train", "loss", 2.0, 2, 2.0, 2)
    assert rows[("", "lr")] == SummaryRow("", "lr", 0.1, 2, 0.1, 2)
    only_nan = summarize([{"valid/loss": math.nan}])[0]
    assert math.isnan(only_nan.min) and only_nan.min_epoch == 1
    assert summarize([]) == []


def test_render_summary_prints_learner_summary_table() -> None:
    console = Console(file=io.StringIO(), width=100)
    render_summary(HISTORY, console)
    out = console.file.getvalue()  # type: ignore[attr-defined]
    assert "Learner Summary" in out
    for header in ("Split", "Metric", "Min.", "Epoch", "Max."):
        assert header in out
    assert re.search(r"train\s+│\s+loss\s+│\s+0\.400\s+│\s+3\s+│\s+1\.000\s+│\s+1", out)


def test_summary_sink_prints_only_at_run_end_with_interrupt_reason() -> None:
    console = Console(file=io.StringIO(), width=100)
    sink = SummarySink(console)
    sink.handle(_step(0, 0, 1))
    assert console.file.getvalue() == ""  # type: ignore[attr-defined]
    reason = "Training interrupted: received SIGTERM"  # as the loop sets it
    sink.handle(RunEnded(history=HISTORY, steps=12, epochs=3, interrupted=reason, seconds=75.0))
    out = console.file.getvalue()  # type: ignore[attr-defined]
    assert "Learner Summary" in out
    assert "3 epoch(s), 12 step(s) in 1m 15s" in out
    assert out.count("Training interrupted") == 1
    assert reason in out


# -- JSONL -----------------------------------------------------------------------------------


def test_jsonl_one_valid_json_line_per_event_including_nan(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "events.jsonl"
    sink = JsonlSink(path)
    events = full_run()
    events.insert(3, _step(0, 0, 1, loss=math.nan))
    events.insert(4, EpochEnded(epoch=0, metrics={"train/loss": math.inf}, seconds=1.0))
    for e in events:
        sink.handle(e)
    # flushed as written: readable before close
    lines = path.read_text().splitlines()
    assert len(lines) == len(events)
    sink.close()
    records = [json.loads(line, parse_constant=pytest.fail) for line in lines]
    assert [r["event"] for r in records] == [type(e).__name__ for e in events]
    assert records[3]["loss"] == "NaN"
    assert records[4]["metrics"] == {"train/loss": "Infinity"}
    failed = next(r for r in records if r["event"] == "WorkerFailed")
    assert failed["failure"]["device"] == "cpu:1" and failed["action"] == "retried"


def test_jsonl_appends_after_close(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    sink = JsonlSink(path)
    sink.handle(Notice(text="one"))
    sink.close()
    sink.handle(Notice(text="two"))
    sink.close()
    assert [json.loads(x)["text"] for x in path.read_text().splitlines()] == ["one", "two"]


# -- CSV -------------------------------------------------------------------------------------


def _read_csv(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), list(reader)


def test_csv_columns_grow_and_file_is_rewritten(tmp_path: Path) -> None:
    path = tmp_path / "metrics.csv"
    sink = MetricsCsvSink(path)
    sink.handle(_step(0, 0, 1))  # ignored
    sink.handle(EpochEnded(epoch=0, metrics={"train/loss": 1.0}, seconds=1.0))
    assert _read_csv(path) == (["epoch", "train/loss"], [{"epoch": "1", "train/loss": "1.0"}])
    sink.handle(EpochEnded(epoch=1, metrics={"train/loss": 0.5, "valid/loss": 0.7}, seconds=1))
    sink.handle(EpochEnded(epoch=2, metrics={"train/loss": 0.25, "valid/loss": 0.6}, seconds=1))
    columns, rows = _read_csv(path)
    assert columns == ["epoch", "train/loss", "valid/loss"]
    assert rows == [
        {"epoch": "1", "train/loss": "1.0", "valid/loss": ""},
        {"epoch": "2", "train/loss": "0.5", "valid/loss": "0.7"},
        {"epoch": "3", "train/loss": "0.25", "valid/loss": "0.6"},
    ]
    sink.close()


def test_csv_resume_keeps_finished_epochs_and_fresh_run_starts_clean(tmp_path: Path) -> None:
    path = tmp_path / "metrics.csv"
    first = MetricsCsvSink(path)
    for epoch in range(3):
        first.handle(EpochEnded(epoch=epoch, metrics={"train/loss": float(epoch)}, seconds=1))
    start = RunStarted(
        run_dir=str(tmp_path),
        strategy="single",
        devices=["cpu"],
        epochs=5,
        steps_per_epoch=4,
        batch_size=8,
        train_samples=32,
        valid_samples=8,
        start_epoch=2,
    )
    resumed = MetricsCsvSink(path)
    resumed.handle(start)
    resumed.handle(EpochEnded(epoch=2, metrics={"train/loss": 9.0}, seconds=1))
    assert [(r["epoch"], r["train/loss"]) for r in _read_csv(path)[1]] == [
        ("1", "0.0"),
        ("2", "1.0"),
        ("3", "9.0"),
    ]
    start.start_epoch = 0
    fresh = MetricsCsvSink(path)
    fresh.handle(start)
    assert _read_csv(path)[1] == []


# -- progress --------------------------------------------------------------------------------


def _plain_lines(out: str) -> list[str]:
    """Plain output's lines without their timestamps (every line must have one)."""
    lines = out.splitlines()
    for line in lines:
        assert re.match(r"\d\d:\d\d:\d\d ", line), line
    return [line[9:] for line in lines]


def test_progress_plain_mode_writes_plain_lines_without_ansi() -> None:
    console = Console(file=io.StringIO(), force_terminal=False, width=80)
    sink = ProgressSink(console, every=2)
    for e in full_run():
        sink.handle(e)
    sink.close()
    out = console.file.getvalue()  # type: ignore[attr-defined]
    assert not ANSI.search(out)
    lines = _plain_lines(out)
    step_lines = [x for x in lines if " step " in x and "global" in x]
    assert len(step_lines) == 4  # 8 global steps, every 2
    assert (
        "epoch 1/2 step 2/4 (global 2): 128/250 samples  loss 0.5000  lr 0.001000  1,234 samples/s"
    ) in lines
    assert any(x.startswith("epoch 2/2 step 4/4 (global 8): 250/250 samples  loss") for x in lines)
    assert any(x.startswith("epoch 2/2 done in 1.5s: train/loss 0.6000") for x in lines)
    assert "checkpoint skipped: runs/x/ckpt-3.pt: bad checksum" in lines
    # the failure's step 5 (0-based over the run) is the 6th step, the 2nd of epoch 2
    assert (
        "worker 1 (rank 1) on device cpu:1 failed at step 6 (epoch 2/2, step 2/4) (backward): "
        "RuntimeError: boom [not markup] -> retried"
    ) in lines
    assert "warning: early stopping: valid/loss did not improve" in lines
    assert any("Training 2 epoch(s) on cpu:0, cpu:1 (strategy ddp)" in x for x in lines)


def test_small_learning_rates_and_throughput_read_as_numbers() -> None:
    """A learning rate of 2e-5 must not print as 0.0000, nor throughput with 4 decimals."""
    console = Console(file=io.StringIO(), force_terminal=False, width=160)
    sink = ProgressSink(console, every=1)
    step = _step(0, 0, 1)
    step.lr = 2e-5
    sink.handle(step)
    metrics = {"train/lr": 2e-5, "train/samples_per_s": 1234.5678, "train/loss": 0.25}
    sink.handle(EpochEnded(epoch=0, metrics=metrics, seconds=1.0))
    out = console.file.getvalue()  # type: ignore[attr-defined]
    assert "lr 2.000e-05" in out and "0.0000" not in out
    assert "train/samples_per_s 1,235" in out and "1234.5678" not in out
    assert "train/loss 0.2500" in out


def test_progress_plain_mode_survives_events_out_of_order() -> None:
    console = Console(file=io.StringIO(), force_terminal=False, width=80)
    sink = ProgressSink(console, every=1)
    sink.handle(_step(3, 1, 7))
    sink.handle(EpochEnded(epoch=3, metrics={}, seconds=0.2))
    sink.handle(Resumed(path="ckpt.pt", epoch=3, step=1, global_step=7))
    out = console.file.getvalue()  # type: ignore[attr-defined]
    assert "epoch 4 step 2/4 (global 7)" in out
    assert "epoch 4 done in 0.2s: no metrics" in out
    assert (
        "resumed from ckpt.pt after 7 committed step(s): next is epoch 4 step 2 (global 8)" in out
    )


def test_mid_epoch_validation_in_progress_and_summary() -> None:
    console = Console(file=io.StringIO(), force_terminal=False, width=80)
    sink = ProgressSink(console, every=1)
    sink.handle(Validated(epoch=1, step=2, global_step=6, metrics={"valid/loss": 0.75}))
    out = console.file.getvalue()  # type: ignore[attr-defined]
    assert "epoch 2, step 6: valid/loss 0.7500" in out
    history = [{"epoch": 0, "global_step": 2, "valid/loss": 0.5}, {"epoch": 0, "valid/loss": 0.7}]
    rows = summarize(history)
    assert [(r.split, r.metric) for r in rows] == [("valid", "loss")]  # no global_step row
    assert rows[0] == SummaryRow("valid", "loss", 0.5, 1, 0.7, 1)


def test_progress_terminal_mode_runs_a_full_sequence_and_stops() -> None:
    console = Console(file=io.StringIO(), force_terminal=True, width=120)
    sink = ProgressSink(console)
    assert sink.live
    sink.handle(_step(0, 2, 3))  # before RunStarted: starts bars with unknown epochs
    for e in full_run():
        sink.handle(e)
    assert sink._progress is None  # RunEnded stopped the live display
    sink.handle(_step(1, 3, 8))  # after the end: restarts, close stops again
    sink.close()
    sink.close()
    assert sink._progress is None
    out = console.file.getvalue()  # type: ignore[attr-defined]
    assert ANSI.search(out)
    assert "epoch 2/2 done in 1.5s" in out
    assert "failed at step 6" in out and "boom [not markup]" in out
    assert "early stopping" in out


def test_progress_rejects_every_below_one() -> None:
    with pytest.raises(ValueError, match="every must be >= 1"):
        ProgressSink(Console(file=io.StringIO()), every=0)


# -- default set -----------------------------------------------------------------------------


def test_default_sinks_with_and_without_run_dir(tmp_path: Path) -> None:
    console = Console(file=io.StringIO(), force_terminal=False)
    assert [type(s) for s in default_sinks(None, console)] == [ProgressSink, SummarySink]
    run_dir = tmp_path / "runs" / "a"
    sinks = default_sinks(str(run_dir), console)
    assert run_dir.is_dir()
    assert [type(s) for s in sinks] == [
        ProgressSink,
        SummarySink,
        JsonlSink,
        MetricsCsvSink,
        StepsCsvSink,
        RunFileSink,
    ]
    for e in full_run():
        for s in sinks:
            s.handle(e)
    for s in sinks:
        s.close()
    assert len((run_dir / "events.jsonl").read_text().splitlines()) == len(full_run())
    assert _read_csv(run_dir / "metrics.csv")[0] == [
        "epoch",
        "train/loss",
        "valid/loss",
        "valid/accuracy",
    ]
    assert "Learner Summary" in console.file.getvalue()  # type: ignore[attr-defined]
    steps = _read_csv(run_dir / "steps.csv")
    assert steps[0][:8] == list(BASE)
    assert [(r["global_step"], r["epoch"], r["step"]) for r in steps[1]][:5] == [
        ("1", "1", "1"),
        ("2", "1", "2"),
        ("3", "1", "3"),
        ("4", "1", "4"),
        ("5", "2", "1"),
    ]


# -- a sink that raises -------------------------------------------------------------------------


class Recording:
    def __init__(self) -> None:
        self.events: list[Event] = []
        self.closed = False

    def handle(self, event: Event) -> None:
        self.events.append(event)

    def close(self) -> None:
        self.closed = True


class RaisesOnStep(Recording):
    """Raises on every StepEnded: it must be called once for it, then never again."""

    def handle(self, event: Event) -> None:
        super().handle(event)
        if isinstance(event, StepEnded):
            raise RuntimeError("display gone")


def test_a_sink_that_raises_is_named_once_to_the_others_and_switched_off() -> None:
    first, broken, last = Recording(), RaisesOnStep(), Recording()
    emit = Fanout([first, broken, last])
    events = full_run()
    for e in events:
        emit(e)
    emit.close()

    steps = [i for i, e in enumerate(events) if isinstance(e, StepEnded)]
    assert broken.events == events[: steps[0] + 1]  # nothing after the event that raised
    assert not broken.closed
    for sink in (first, last):
        notices = [e for e in sink.events if isinstance(e, Notice) and "sink" in e.text]
        assert len(notices) == 1, sink.events
        assert notices[0].level == "warning"
        assert "sink RaisesOnStep raised RuntimeError: display gone" in notices[0].text
        assert "on a StepEnded event" in notices[0].text
        assert "switched off" in notices[0].text
        at = sink.events.index(notices[0])
        assert sink.events[at - 1] is events[steps[0]]  # right after the event that raised
        assert [e for e in sink.events if e is not notices[0]] == events
        assert sink.closed
    assert [(s, type(x)) for s, x in emit.broken] == [(broken, RuntimeError)]


def test_a_sink_that_raises_during_fit_does_not_stop_training() -> None:
    import torch
    from torch import nn

    import phalanx as px

    data = torch.utils.data.TensorDataset(torch.randn(16, 3), torch.randn(16, 1))
    good, broken = Recording(), RaisesOnStep()
    learner = px.Learner(lambda: nn.Linear(3, 1), lambda p: torch.optim.SGD(p, lr=0.1), px.mse_step)
    result = learner.fit(data, epochs=2, batch_size=4, sinks=[broken, good])
    assert result.steps == 8
    notices = [e for e in good.events if isinstance(e, Notice)]
    assert [n.text.split(";")[0] for n in notices] == [
        "sink RaisesOnStep raised RuntimeError: display gone on a StepEnded event"
    ]
    assert len([e for e in good.events if isinstance(e, StepEnded)]) == 8
    assert len([e for e in broken.events if isinstance(e, StepEnded)]) == 1


def test_fit_with_an_empty_run_dir_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """run_dir="" is no run_dir: the default sinks write no events.jsonl or metrics.csv into
    the current directory, and no checkpoints or ledger go there either."""
    import torch
    from torch import nn

    import phalanx as px

    monkeypatch.chdir(tmp_path)
    data = torch.utils.data.TensorDataset(torch.randn(16, 3), torch.randn(16, 1))
    learner = px.Learner(lambda: nn.Linear(3, 1), lambda p: torch.optim.SGD(p, lr=0.1), px.mse_step)
    result = learner.fit(
        data, epochs=1, batch_size=4, run_dir="", checkpoint=px.Checkpoints(every_steps=1)
    )
    assert result.steps == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    assert result.run_dir is None


def test_a_failed_run_ends_with_its_committed_steps_and_the_report_to_follow() -> None:
    """The poison report: no "Trained 0 epoch(s), 0 step(s)" after committed steps, and no
    "see the report above" above the report (it comes after the summary)."""
    console = Console(file=io.StringIO(), width=120)
    sink = SummarySink(console)
    sink.handle(RunStarted("runs/x", "single", ["cpu"], 8, 23, 64, 1437, 360))
    for g in range(1, 6):
        sink.handle(_step(0, g - 1, g))
    first = _failure()
    first.action = "retried"
    sink.handle(WorkerFailed(first, "retried"))
    again = _failure()
    again.action = "aborted"
    sink.handle(WorkerFailed(again, "aborted"))
    sink.handle(RunEnded([], 0, 0, None, 0.0, failed=True))
    out = console.file.getvalue()  # type: ignore[attr-defined]
    assert "Training failed after 5 committed step(s) (0 epoch(s) finished); the error " in out
    assert "Trained 0" not in out and "report above" not in out and "Survived" not in out
    assert "2 failure(s): 2 exception (retried, aborted)." in out
    assert "Failures and recoveries" in out
    assert "fit(..., run_dir='runs/x', resume=True)" in out


def test_the_lost_column_counts_a_hang_from_its_last_progress() -> None:
    """The summary's recovery column says what it measures: from the failure to the next
    committed step, and for a hang from the worker's last progress (it was silent for
    ``time - last_progress`` before anyone could tell)."""
    from phalanx.sinks.summary import lost_seconds, render_failures

    crash = WorkerFailure(1, 1, "cpu:1", "crash", "SIGKILL", "forward", step=3, time=100.0,
                          action="respawned", recovery_seconds=0.4)  # fmt: skip
    hang = WorkerFailure(0, 0, "cpu:0", "hang", "silent", "forward", step=20, time=160.0,
                         action="respawned", recovery_seconds=0.43,
                         last_progress=100.0)  # fmt: skip
    pending = WorkerFailure(0, 0, "cpu:0", "exception", "boom", "backward", step=30,
                            time=170.0, action="aborted")  # fmt: skip
    assert lost_seconds(crash) == pytest.approx(0.4)
    assert lost_seconds(hang) == pytest.approx(60.43)  # not "back in 0.43 s"
    assert lost_seconds(pending) is None  # no step committed after it
    console = Console(file=io.StringIO(), width=120)
    render_failures([crash, hang, pending], console)
    out = console.file.getvalue()  # type: ignore[attr-defined]
    rows = re.findall(r"│ (\d) +│ cpu:\d +│ (\w+) +│ (\d+) +│ \w+ +│ \w+ +│ +(\S+) │", out)
    assert rows == [("1", "crash", "4", "0.4s"), ("0", "hang", "21", "60.4s"),
                    ("0", "exception", "31", "-")]  # fmt: skip
    assert "lost: from the failure (a hang: its last progress) to the next committed step" in out


def test_the_end_of_a_run_says_where_its_files_are_and_how_to_resume() -> None:
    console = Console(file=io.StringIO(), width=300)
    sink = SummarySink(console)
    for e in full_run():
        if isinstance(e, RunEnded):
            sink.handle(RunEnded(e.history, e.steps, e.epochs, "Training interrupted: SIGINT", 3.0))
        else:
            sink.handle(e)
    out = console.file.getvalue()  # type: ignore[attr-defined]
    assert "Trained 2 epoch(s), 8 step(s) in 3.0s." in out
    assert "Survived 1 failure(s): 1 exception." in out
    assert "Final world size: 2 of 2 worker(s)." in out
    assert "checkpoints in runs/x/checkpoints, logs in runs/x (run.json, events.jsonl" in out
    assert "To continue after an interruption: fit(..., run_dir='runs/x', resume=True)" in out
    assert out.rstrip().endswith("Training interrupted: SIGINT")


def test_the_end_of_a_run_in_a_log_file_has_a_timestamp_on_every_line() -> None:
    """Plain output (not a terminal): the summary tables and the run's end start with the
    time, like every progress line; on a terminal, and in ``phalanx report``, they do not."""
    plain = Console(file=io.StringIO(), width=100)
    terminal = Console(file=io.StringIO(), width=100, force_terminal=True)
    replay = Console(file=io.StringIO(), width=100)
    for console, stamps in ((plain, None), (terminal, None), (replay, False)):
        sink = SummarySink(console, timestamps=stamps)
        for e in full_run():
            sink.handle(e)
    lines = plain.file.getvalue().splitlines()  # type: ignore[attr-defined]
    assert len(lines) > 10 and all(re.match(r"\d\d:\d\d:\d\d \S", line) for line in lines)
    assert any(re.match(r"\d\d:\d\d:\d\d Learner Summary", line) for line in lines)
    assert any(line[9:].startswith("Survived 1 failure(s)") for line in lines)
    for console in (terminal, replay):
        out = console.file.getvalue()  # type: ignore[attr-defined]
        assert "Survived 1 failure(s)" in out and not re.search(r"^\d\d:\d\d:\d\d ", out, re.M)


def test_steps_csv_writes_every_nth_step_and_each_epochs_last(tmp_path: Path) -> None:
    sink = StepsCsvSink(tmp_path / "steps.csv", every=3)
    for e in full_run():  # 2 epochs of 4 steps
        sink.handle(e)
    sink.close()
    rows = _read_csv(tmp_path / "steps.csv")[1]
    assert [r["global_step"] for r in rows] == ["3", "4", "6", "8"]  # 4 and 8 end an epoch
    with pytest.raises(ValueError, match="every must be >= 1"):
        StepsCsvSink(tmp_path / "other.csv", every=0)
    every_two = default_sinks(str(tmp_path / "run"), Console(file=io.StringIO()), every_steps=2)
    (steps,) = [s for s in every_two if isinstance(s, StepsCsvSink)]
    assert steps.every == 2


def test_a_log_line_turns_back_into_its_event() -> None:
    from phalanx.events import Beat, GenerationStarted, WorkerState, WorkersTick, from_record

    events = [
        *full_run(),
        WorkerState(1, "cpu:1", "fallen", rank=1, generation=2, pid=7, detail="hang"),
        GenerationStarted(3, [0, 2], ["cpu:0", "cpu:2"], "worker 1 hang: shrunk"),
        WorkersTick([Beat(0, "forward", 5, 12.5, 60.0)]),
    ]
    for event in events:
        record = json.loads(json.dumps({**to_record(event), "run": "r1"}))
        assert from_record(record) == event
    assert from_record({"event": "NoSuchEvent"}) is None


# --- TensorBoard ---------------------------------------------------------------------------


def test_tensorboard_sink_writes_steps_epochs_and_failures_as_text(tmp_path: Path) -> None:
    """A real fit with an injected exception (retried): per-step and per-epoch scalars and the
    failure's text land in the event file, read back with tensorboard's own reader."""
    pytest.importorskip("tensorboard")
    import torch
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.data import TensorDataset

    import phalanx as px
    from phalanx.sinks import TensorBoardSink

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 4, generator=g), torch.randint(0, 3, (32,), generator=g))
    learner = px.Learner(
        torch.nn.Linear(4, 3),
        functools.partial(torch.optim.SGD, lr=0.1),
        px.cross_entropy_step,
        metrics=[px.metrics.Accuracy()],
    )
    sink = TensorBoardSink(tmp_path / "tb")
    result = learner.fit(
        data,
        data,
        epochs=2,
        batch_size=8,
        val_every_steps=2,
        faults=[px.Fault("exception", worker=0, step=3)],
        run_dir=str(tmp_path / "run"),
        loggers=[sink],  # with the default sinks: steps.csv has each step's own loss
    )
    assert len(result.failures) == 1
    steps = _read_csv(tmp_path / "run" / "steps.csv")[1]

    board = EventAccumulator(str(tmp_path / "tb"))
    board.Reload()
    scalars = board.Tags()["scalars"]
    assert {"step/train/loss", "step/train/lr", "step/train/accuracy"} <= set(scalars)
    assert {"epoch/train/loss", "epoch/valid/accuracy", "step/valid/loss"} <= set(scalars)
    losses = board.Scalars("step/train/loss")
    assert [s.step for s in losses] == list(range(1, 9))
    assert [s.value for s in losses] == pytest.approx([float(r["loss"]) for r in steps], rel=1e-6)
    epochs = board.Scalars("epoch/valid/loss")
    assert [e.step for e in epochs] == [1, 2]
    assert epochs[-1].value == pytest.approx(result.history[-1]["valid/loss"], rel=1e-6)
    assert [s.step for s in board.Scalars("step/valid/loss")] == [2, 6]  # mid-epoch only
    (failure,) = board.Tensors("failures/text_summary")
    text = failure.tensor_proto.string_val[0].decode()
    # the 4th step (Fault step=3 counts from 0), numbered as every line on screen numbers it
    assert "worker 0 (rank 0) on device cpu failed at step 4 (forward)" in text
    assert "injected exception" in text and "-> retried" in text
    assert failure.step == 4
