"""The run folder tells one run: ids, run.json, earlier runs moved aside, resume keeps the
id, every log line tagged, per-step rows, ledger column names."""

from __future__ import annotations

import csv
import functools
import json
from pathlib import Path

import pytest
import torch

import phalanx as px
from phalanx.runinfo import read_run


def fit(run_dir: Path, epochs: int = 2, resume: bool = False, **kw: object) -> px.FitResult:
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(48, 4, generator=g), torch.randint(0, 2, (48,), generator=g)
    )
    learner = px.Learner(
        torch.nn.Linear(4, 2), functools.partial(torch.optim.SGD, lr=0.1), px.cross_entropy_step
    )
    return learner.fit(
        data, epochs=epochs, batch_size=16, run_dir=str(run_dir), resume=resume, sinks=None,
        **kw,  # type: ignore[arg-type]
    )  # fmt: skip


def events(run_dir: Path) -> list[dict[str, object]]:
    return [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]


@pytest.mark.timeout(120)
def test_each_fresh_run_has_its_own_id_and_files_and_the_last_ones_move_aside(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    failing = [px.Fault("exception", worker=0, step=1, times=2)]  # a poison batch
    with pytest.raises(px.TrainingFailed):
        fit(run_dir, faults=failing)
    first = read_run(run_dir)
    assert first is not None and first["outcome"] == "failed"
    assert (run_dir / "failures.json").exists()
    assert set(first["versions"]) == {"phalanx", "torch", "python"}
    assert first["config"]["epochs"] == 2 and first["config"]["strategy"] == "single"
    # checkpoints of the failed run would make a fresh run refuse (PX118): none were saved
    fit(run_dir)
    second = read_run(run_dir)
    assert second is not None and second["run_id"] != first["run_id"]
    assert second["outcome"] == "finished" and second["steps"] == 6
    assert not (run_dir / "failures.json").exists()  # the earlier run's, not left current
    earlier = run_dir / "earlier" / str(first["run_id"])
    assert (earlier / "failures.json").exists() and (earlier / "events.jsonl").exists()
    records = events(run_dir)
    assert {r["run"] for r in records} == {second["run_id"]}
    assert records[0]["event"] == "RunOpened"
    assert sum(r["event"] == "RunStarted" for r in records) == 1


@pytest.mark.timeout(120)
def test_a_fresh_run_moves_the_earlier_final_model_aside(tmp_path: Path) -> None:
    """An earlier run's model.pt goes to earlier/<its id>/ with its other files (a run
    that is then interrupted must not leave it looking like its own)."""
    import shutil

    run_dir = tmp_path / "run"
    first = fit(run_dir)
    assert first.model_path == str(run_dir / "model.pt")
    first_id = (read_run(run_dir) or {})["run_id"]
    shutil.rmtree(run_dir / "checkpoints")  # starting over (else PX118)
    second = fit(run_dir, max_steps=1, epochs=1)
    assert second.model_path == str(run_dir / "model.pt")
    earlier = run_dir / "earlier" / str(first_id) / "model.pt"
    assert earlier.exists()
    assert not torch.equal(
        torch.load(earlier, weights_only=True)["weight"],
        torch.load(run_dir / "model.pt", weights_only=True)["weight"],
    )


@pytest.mark.timeout(120)
def test_a_resumed_run_keeps_its_id_and_its_files_tell_each_step_once(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    fit(run_dir, epochs=1, checkpoint=px.Checkpoints(every_steps=2))
    first = read_run(run_dir)
    assert first is not None
    fit(run_dir, epochs=3, resume=True)
    again = read_run(run_dir)
    assert again is not None and again["run_id"] == first["run_id"]
    assert len(again["sessions"]) == 2 and again["steps"] == 9
    records = events(run_dir)
    assert {r["run"] for r in records} == {first["run_id"]}
    assert [r["session"] for r in records if r["event"] == "RunOpened"] == [1, 2]
    with (run_dir / "steps.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [int(r["global_step"]) for r in rows] == list(range(1, 10))
    assert [(r["epoch"], r["step"]) for r in rows[:4]] == [("1", "1"), ("1", "2"), ("1", "3"),
                                                          ("2", "1")]  # fmt: skip
    ledger = json.loads((run_dir / "ledger.json").read_text())
    assert ledger["columns"][:3] == ["epoch", "step", "global_step"]
    assert all(len(row) == len(ledger["columns"]) for row in ledger["steps"])
