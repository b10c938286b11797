"""``fit(loggers=[...])`` adds sinks to those in force (``sinks=`` still replaces them), and
the Weights & Biases and MLflow sinks, tested against the real libraries with no network:
W&B in offline mode (its run file read back), MLflow on a local file store (read back with
its own client)."""

from __future__ import annotations

import csv
import functools
import json
import re
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import TensorDataset

import phalanx as px
from ddp_helpers import make_data, mlp, mse_step, sgd
from phalanx.events import (
    EpochEnded,
    Event,
    Notice,
    RunEnded,
    RunStarted,
    StepEnded,
    WorkerFailed,
)
from phalanx.failures import WorkerFailure
from procs import child_env
from recorder import Recorder

# -- the environment: nothing may reach a network ----------------------------------------------


@pytest.fixture
def offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """W&B offline with every folder of its own under ``tmp_path``; MLflow's file store
    allowed (recent MLflow refuses it otherwise). Yields the folder for the trackers; ends
    W&B's service process afterwards (it outlives a run)."""
    where = tmp_path / "trackers"
    for name, value in {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_DIR": str(where),
        "WANDB_CONFIG_DIR": str(where / "wandb-config"),
        "WANDB_CACHE_DIR": str(where / "wandb-cache"),
        "WANDB_DATA_DIR": str(where / "wandb-data"),
        "WANDB_X_DISABLE_STATS": "true",
        "MLFLOW_ALLOW_FILE_STORE": "true",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    where.mkdir()
    yield where
    if "wandb" in sys.modules:
        sys.modules["wandb"].teardown()


def wandb_sink(where: Path, **kwargs: Any) -> Any:
    pytest.importorskip("wandb")
    from phalanx.sinks import WandbSink

    return WandbSink("phalanx-tests", dir=where, mode="offline", **kwargs)


def mlflow_sink(where: Path, **kwargs: Any) -> Any:
    pytest.importorskip("mlflow")
    from phalanx.sinks import MlflowSink

    return MlflowSink((where / "mlruns").as_uri(), "tests", **kwargs)


# -- reading an offline W&B run back -----------------------------------------------------------


def _records(raw: bytes) -> Iterator[bytes]:
    """The records of a ``.wandb`` file: a 7-byte header, then LevelDB's log format (32 KiB
    blocks; each record a 7-byte header: CRC, length, type: full, first, middle, last)."""
    assert raw[:4] == b":W&B"
    block, pos, parts = 32768, 7, b""
    while pos + 7 <= len(raw):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        data, pos = raw[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 1:
            yield data
        elif kind == 2:
            parts = data
        elif kind == 3:
            parts += data
        elif kind == 4:
            yield parts + data


def _key(item: Any) -> str:
    return str(item.key or "/".join(item.nested_key))


def read_wandb(sink: Any) -> dict[str, Any]:
    """What the sink's offline run wrote, parsed with W&B's own record schema: ``history``
    (step -> row), ``config``, ``summary``, ``name``, ``exit_code`` and ``files`` (the run's
    files folder). ``run.finish()`` may return before W&B's service process has written the
    whole file (seen: 1 run in 15 had only its first 32 KiB); ending the service closes it."""
    import wandb
    from wandb.proto import wandb_internal_pb2

    wandb.teardown()
    run_dir = Path(sink.run.dir).parent
    (path,) = run_dir.glob("run-*.wandb")
    found: dict[str, Any] = {"history": {}, "config": {}, "summary": {}, "exit_code": None}
    for data in _records(Path(path).read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            found["name"] = record.run.display_name
            for item in record.run.config.update:
                found["config"][item.key] = json.loads(item.value_json)
        elif kind == "config":
            for item in record.config.update:
                found["config"][item.key] = json.loads(item.value_json)
        elif kind == "history":
            row = {_key(i): json.loads(i.value_json) for i in record.history.item}
            found["history"].setdefault(record.history.step.num, {}).update(row)
        elif kind == "summary":
            found["summary"].update(
                {_key(i): json.loads(i.value_json) for i in record.summary.update}
            )
        elif kind == "exit":
            found["exit_code"] = record.exit.exit_code
    found["files"] = run_dir / "files"
    return found


def series(history: dict[int, dict[str, Any]], key: str) -> list[tuple[int, Any]]:
    return [(step, row[key]) for step, row in sorted(history.items()) if key in row]


def wandb_table(files: Path, key: str) -> list[dict[str, Any]]:
    (path,) = (files / "media" / "table").glob(f"{key}_*.table.json")
    table = json.loads(path.read_text())
    return [dict(zip(table["columns"], row, strict=True)) for row in table["data"]]


# -- one short real run, as the TensorBoard test's ---------------------------------------------


def fit_with(logger: Any, run_dir: Path) -> tuple[px.FitResult, list[dict[str, str]]]:
    """2 epochs of 4 steps, a mid-epoch validation every 2 steps, an exception injected in
    the 4th step (retried), the default sinks kept: the result and ``steps.csv``'s rows."""
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 4, generator=g), torch.randint(0, 3, (32,), generator=g))
    learner = px.Learner(
        torch.nn.Linear(4, 3),
        functools.partial(torch.optim.SGD, lr=0.1),
        px.cross_entropy_step,
        metrics=[px.metrics.Accuracy()],
    )
    result = learner.fit(
        data,
        data,
        epochs=2,
        batch_size=8,
        val_every_steps=2,
        run_dir=str(run_dir),
        faults=[px.Fault("exception", worker=0, step=3)],
        loggers=[logger],
    )
    assert len(result.failures) == 1
    with (run_dir / "steps.csv").open(newline="") as f:
        steps = list(csv.DictReader(f))
    assert [int(r["global_step"]) for r in steps] == list(range(1, 9))
    return result, steps


def epoch_entries(result: px.FitResult) -> list[dict[str, float]]:
    """The history's epoch-end entries (a mid-epoch validation's entry has a global_step)."""
    return [h for h in result.history if "global_step" not in h]


def run_id_of(run_dir: Path) -> str:
    return str(json.loads((run_dir / "run.json").read_text())["run_id"])


def test_wandb_sink_logs_steps_epochs_failures_and_the_configuration(
    tmp_path: Path, offline: Path
) -> None:
    sink = wandb_sink(offline, config={"lr": 0.1, "seed": 123})
    result, steps = fit_with(sink, tmp_path / "run")
    run = read_wandb(sink)
    history = run["history"]

    losses = series(history, "step/train/loss")
    assert losses == [(int(r["global_step"]), float(r["loss"])) for r in steps]  # the step's own
    accuracy = series(history, "step/train/accuracy")
    assert accuracy == [(int(r["global_step"]), float(r["train/accuracy"])) for r in steps]
    assert [s for s, _ in series(history, "step/train/lr")] == list(range(1, 9))
    assert [s for s, _ in series(history, "step/valid/loss")] == [2, 6]  # mid-epoch only

    epochs = epoch_entries(result)
    assert series(history, "epoch") == [(4, 1), (8, 2)]  # at each epoch's last step
    for key in ("train/loss", "train/accuracy", "valid/loss", "valid/accuracy"):
        assert series(history, f"epoch/{key}") == [(4, epochs[0][key]), (8, epochs[1][key])]

    assert series(history, "failures") == [(4, 1)]  # the 4th step (Fault step=3 counts from 0)
    (failure,) = wandb_table(run["files"], "failure_log")
    assert failure["step"] == 4 and failure["worker"] == 0 and failure["action"] == "retried"
    assert failure["kind"] == "exception" and failure["phase"] == "forward"
    assert "worker 0 (rank 0) on device cpu failed at step 4 (forward)" in failure["text"]
    assert "injected exception" in failure["cause"]
    assert run["summary"]["failures"] == 1 and run["summary"]["outcome"] == "finished"
    assert run["exit_code"] == 0

    config = run["config"]
    assert config["lr"] == 0.1 and config["seed"] == 123  # the caller's values kept
    assert (config["epochs"], config["batch_size"], config["strategy"]) == (2, 8, "single")
    assert (config["steps_per_epoch"], config["train_samples"], config["val_every_steps"]) == (
        4,
        32,
        2,
    )
    assert config["devices"] == ["cpu"] and config["recovery"]["mode"] == "respawn"
    assert config["run_id"] == run["name"] == run_id_of(tmp_path / "run")


def test_mlflow_sink_logs_steps_epochs_failures_and_the_configuration(
    tmp_path: Path, offline: Path
) -> None:
    sink = mlflow_sink(offline, tags={"team": "vision"}, params={"lr": 0.1, "seed": 123})
    result, steps = fit_with(sink, tmp_path / "run")
    from mlflow.tracking import MlflowClient

    client = MlflowClient((offline / "mlruns").as_uri())  # a client of our own, to read back
    assert sink.run_id is not None
    run = client.get_run(sink.run_id)

    def history(key: str) -> list[tuple[int, float]]:
        return [(m.step, m.value) for m in client.get_metric_history(sink.run_id, key)]

    assert history("step/train/loss") == [(int(r["global_step"]), float(r["loss"])) for r in steps]
    accuracy = history("step/train/accuracy")
    assert accuracy == [(int(r["global_step"]), float(r["train/accuracy"])) for r in steps]
    assert [s for s, _ in history("step/train/lr")] == list(range(1, 9))
    assert [s for s, _ in history("step/valid/loss")] == [2, 6]

    epochs = epoch_entries(result)
    for key in ("train/loss", "train/accuracy", "valid/loss", "valid/accuracy"):
        assert history(f"epoch/{key}") == [(1, epochs[0][key]), (2, epochs[1][key])]

    assert history("failures") == [(4, 1.0)]
    tags = run.data.tags
    assert "worker 0 (rank 0) on device cpu failed at step 4 (forward)" in tags["failure/1"]
    assert "injected exception" in tags["failure/1"] and "-> retried" in tags["failure/1"]
    assert "failure/2" not in tags
    assert tags["team"] == "vision"

    params = run.data.params
    assert (params["epochs"], params["batch_size"], params["strategy"]) == ("2", "8", "single")
    assert (params["steps_per_epoch"], params["lr"]) == ("4", "0.1")
    assert params["seed"] == "123"  # the caller's value kept (the fit's seed is 0)
    assert params["recovery.mode"] == "respawn" and params["val_every_steps"] == "2"
    run_id = run_id_of(tmp_path / "run")
    assert params["run_id"] == tags["phalanx.run_id"] == run.info.run_name == run_id
    assert run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "tests"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_both_loggers_in_a_ddp_run_where_a_worker_is_killed(tmp_path: Path, offline: Path) -> None:
    """Two worker processes, worker 1 killed in the 4th step and respawned: each committed
    step is logged once, with the loss the run folder has, and the failure is in both."""
    wb, ml = wandb_sink(offline), mlflow_sink(offline)
    run_dir = tmp_path / "run"
    result = px.Learner(mlp, sgd, mse_step).fit(
        make_data(96),
        make_data(32, seed=1),
        epochs=2,
        batch_size=16,
        devices="cpu:0,cpu:1",
        strategy="ddp",
        run_dir=str(run_dir),
        faults=[px.Fault("kill", worker=1, step=3)],
        loggers=[wb, ml],
    )
    assert result.steps == 12
    ((failure, action),) = [(f, f.action) for f in result.failures]
    assert failure.kind == "crash" and failure.step == 3
    with (run_dir / "steps.csv").open(newline="") as f:
        losses = [(int(r["global_step"]), float(r["loss"])) for r in csv.DictReader(f)]
    assert [s for s, _ in losses] == list(range(1, 13))

    run = read_wandb(wb)
    assert series(run["history"], "step/train/loss") == losses
    assert series(run["history"], "failures") == [(4, 1)]
    (row,) = wandb_table(run["files"], "failure_log")
    assert (row["worker"], row["step"], row["kind"], row["action"]) == (1, 4, "crash", action)
    assert run["config"]["strategy"] == "ddp" and run["config"]["devices"] == ["cpu:0", "cpu:1"]
    assert run["exit_code"] == 0

    client = ml.client
    metric = client.get_metric_history(ml.run_id, "step/train/loss")
    assert [(m.step, m.value) for m in metric] == losses
    tags = client.get_run(ml.run_id).data.tags
    assert "worker 1 (rank 1) on device cpu:1 failed at step 4" in tags["failure/1"]
    assert tags["failure/1"].endswith(f"-> {action}")
    assert client.get_run(ml.run_id).info.status == "FINISHED"


# -- events given by hand: a restart, NaN, a failed run ----------------------------------------


def _step(global_step: int, loss: float) -> StepEnded:
    epoch, step = divmod(global_step - 1, 4)
    return StepEnded(epoch, step, global_step, 4, loss, 0.1, 8, 100.0, {"loss": 9.0})


def restarted_failed_run() -> list[Event]:
    """Steps 1-5, every worker falls, the run restarts from step 3 (steps 4 and 5 computed
    again), a NaN loss at step 6, an epoch end, a warning, then a failure that ends it."""
    started = RunStarted("", "ddp", ["cpu:0", "cpu:1"], 3, 4, 8, 96, 0)
    again = RunStarted("", "ddp", ["cpu:0", "cpu:1"], 3, 4, 8, 96, 0, start_epoch=0, start_step=3)
    crash = WorkerFailure(1, 1, "cpu:1", "crash", "SIGKILL", "forward", step=6)
    return [
        started,
        *[_step(g, 1.0 / g) for g in range(1, 6)],
        again,
        _step(4, 0.4),
        _step(5, 0.5),
        _step(6, float("nan")),
        EpochEnded(1, {"train/loss": 0.3}, 1.0),
        Notice("loss is NaN", level="warning"),
        WorkerFailed(crash, "aborted"),
        RunEnded([], 6, 1, None, 2.0, failed=True),
    ]


def test_wandb_sink_keeps_steps_increasing_and_marks_a_failed_run(offline: Path) -> None:
    sink = wandb_sink(offline)
    for event in restarted_failed_run():
        sink.handle(event)
    sink.close()
    sink.close()  # once
    run = read_wandb(sink)
    history = run["history"]
    # W&B takes no step below its latest: 4 and 5 keep their first values; NaN left out
    assert series(history, "step/train/loss") == [(g, 1.0 / g) for g in range(1, 6)]
    assert series(history, "epoch/train/loss") == [(6, 0.3)]
    assert series(history, "failures") == [(7, 1)]
    assert run["summary"]["outcome"] == "failed" and run["exit_code"] == 1
    (notice,) = wandb_table(run["files"], "notices")
    assert notice == {"step": 6, "level": "warning", "text": "loss is NaN"}
    (failure,) = wandb_table(run["files"], "failure_log")
    assert failure["action"] == "aborted" and failure["cause"] == "SIGKILL"
    assert run["config"]["start_step"] == 0  # the first announcement's
    assert "run_id" not in run["config"]  # no run_dir: no run.json


def test_mlflow_sink_logs_every_value_and_marks_a_failed_run(offline: Path) -> None:
    sink = mlflow_sink(offline, run_name="by-hand")
    for event in restarted_failed_run():
        sink.handle(event)
    sink.close()
    sink.handle(_step(7, 0.7))  # after close: ignored
    client, run_id = sink.client, sink.run_id
    losses = [(m.step, m.value) for m in client.get_metric_history(run_id, "step/train/loss")]
    # MLflow keeps both values of a step computed again; NaN left out
    assert sorted(losses) == sorted([(g, 1.0 / g) for g in range(1, 6)] + [(4, 0.4), (5, 0.5)])
    run = client.get_run(run_id)
    assert run.info.status == "FAILED" and run.info.run_name == "by-hand"
    assert run.data.tags["notice/1"] == "warning: loss is NaN"
    assert "failed at step 7 (forward): SIGKILL -> aborted" in run.data.tags["failure/1"]
    assert run.data.params["start_step"] == "0" and "run_id" not in run.data.params


@pytest.mark.parametrize(("interrupted", "status"), [(None, "FINISHED"), ("SIGTERM", "KILLED")])
def test_mlflow_run_status_follows_the_runs_end(
    offline: Path, interrupted: str | None, status: str
) -> None:
    sink = mlflow_sink(offline)
    sink.handle(_step(1, 0.5))
    sink.handle(RunEnded([], 1, 0, interrupted, 1.0))
    sink.close()
    assert sink.client.get_run(sink.run_id).info.status == status


# -- loggers= adds, sinks= replaces -------------------------------------------------------------


def _fit(**kwargs: Any) -> px.FitResult:
    data = TensorDataset(torch.randn(16, 3), torch.randn(16, 1))
    learner = px.Learner(
        torch.nn.Linear(3, 1), functools.partial(torch.optim.SGD, lr=0.1), mse_step
    )
    return learner.fit(data, epochs=1, batch_size=4, **kwargs)


def _steps(sink: Recorder) -> list[int]:
    return [e.global_step for e in sink.events if isinstance(e, StepEnded)]


def test_loggers_add_to_the_default_sinks_and_sinks_replace_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    logger = Recorder()
    _fit(run_dir=str(tmp_path / "added"), loggers=[logger])
    out = capsys.readouterr().out
    assert "Learner Summary" in out and "Trained 1 epoch(s), 4 step(s)" in out
    assert (tmp_path / "added" / "events.jsonl").is_file()
    assert (tmp_path / "added" / "steps.csv").is_file()
    assert _steps(logger) == [1, 2, 3, 4] and logger.closed

    replacing = Recorder()
    _fit(run_dir=str(tmp_path / "replaced"), sinks=[replacing])
    assert capsys.readouterr().out == ""
    assert not (tmp_path / "replaced" / "events.jsonl").exists()
    assert _steps(replacing) == [1, 2, 3, 4]

    given, added = Recorder(), Recorder()
    _fit(sinks=[given], loggers=[added])  # both: the given sinks, then the loggers
    assert capsys.readouterr().out == ""
    assert added.events == given.events and _steps(added) == [1, 2, 3, 4]
    assert isinstance(added.events[-1], RunEnded) and added.closed


# -- the extras --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "module", "extra"),
    [("WandbSink", "wandb", "phalanx[wandb]"), ("MlflowSink", "mlflow", "phalanx[mlflow]")],
)
def test_a_missing_library_is_named_with_its_extra(
    monkeypatch: pytest.MonkeyPatch, name: str, module: str, extra: str
) -> None:
    import phalanx.sinks

    for loaded in [m for m in sys.modules if m.split(".")[0] == module] or [module]:
        monkeypatch.setitem(sys.modules, loaded, None)  # imports fail, as when not installed
    with pytest.raises(ImportError, match=re.escape(f'pip install "{extra}"')):
        getattr(phalanx.sinks, name)()


def test_importing_the_sinks_imports_no_tracker() -> None:
    code = (
        "import sys, phalanx, phalanx.sinks\n"
        "print(sorted(m for m in ('wandb', 'mlflow', 'tensorboard') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=child_env(), capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"
