"""fit(on_bad_sample="skip"): bad samples found by bisection and left out, a worker at fault
told from bad data and put out, the math exact against a run whose step leaves the samples
out; the default still stops and names the sample."""

from __future__ import annotations

import functools
import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console

import phalanx as px
from ddp_helpers import BadSamples, broken_worker_step, indexed_step, mlp, sgd
from phalanx.badsamples import Triage, find_bad
from phalanx.sinks import SummarySink

FIT: dict[str, Any] = dict(batch_size=24, epochs=2, seed=3)
BAD = {"raise_at": (17,), "nan_at": (42,)}


def _rel(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(
        float((x - y).abs().max() / y.abs().max())
        for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )


@pytest.fixture(scope="module")
def leaving_out() -> px.FitResult:
    """The reference: one device, a step that leaves samples 17 and 42 out of every batch."""
    step = functools.partial(indexed_step, drop=(17, 42))
    return px.Learner(mlp, sgd, step).fit(BadSamples(240), sinks=[], **FIT)


def test_one_bad_sample_among_64_costs_a_few_tries_not_64() -> None:
    tried: list[list[int]] = []

    def fails(part: list[int]) -> str | None:
        tried.append(part)
        return "ValueError: corrupt" if 37 in part else None

    assert find_bad(list(range(64)), fails) == {37: "ValueError: corrupt"}
    assert len(tried) <= 2 * 6 + 1  # two halves per level of six, and the last one


def test_several_bad_samples_are_all_found() -> None:
    bad = {3, 4, 60}
    found = find_bad(list(range(64)), lambda p: "x" if bad & set(p) else None)
    assert set(found) == bad


def test_blame_names_the_member_whose_part_passed_elsewhere() -> None:
    triage = Triage(3)
    twist = triage.after_repeat([1])
    assert twist.rotation == 1 and twist.bisect == frozenset({1})
    assert triage.at_fault([]) == [1]  # part 1 passed on member 2: member 1 is at fault
    assert triage.at_fault([2]) == []  # it failed on member 2 too: the data
    alone = Triage(1)
    assert alone.after_repeat([0]).rotation == 0 and alone.at_fault([]) == []


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("strategy", "devices"),
    [("single", "cpu"), ("threads", "cpu:0,cpu:1,cpu:2"), ("ddp", "cpu:0,cpu:1,cpu:2")],
)
def test_a_raising_and_a_nan_sample_are_quarantined_and_the_model_is_exact(
    leaving_out: px.FitResult, strategy: str, devices: str, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    console = Console(file=io.StringIO(), width=300)
    result = px.Learner(mlp, sgd, indexed_step).fit(
        BadSamples(240, **BAD),
        strategy=strategy,
        devices=devices,
        on_bad_sample="skip",
        run_dir=str(run_dir),
        sinks=[SummarySink(console, timestamps=False)],
        **FIT,
    )
    assert result.quarantined == [17, 42]
    assert result.ledger_ok, result.ledger_problems  # exactly once, or quarantined
    assert result.steps == leaving_out.steps
    assert _rel(result.model, leaving_out.model) <= 1e-5
    found = {i: e for f in result.failures for i, e in (f.bad_samples or [])}
    assert found == {
        17: "ValueError: corrupt record 17",
        42: "NonFiniteSampleLoss: the loss is nan",
    }
    assert [f.action for f in result.failures].count("quarantined") == 2
    doc = json.loads((run_dir / "quarantine.json").read_text())
    assert [(r["index"], r["error"]) for r in doc["quarantined"]] == sorted(found.items())
    # later epochs left them out without failing again: every failure is in the first epoch
    assert all(f.epoch == 0 for f in result.failures)
    # the run's end lists each with its error
    end = console.file.getvalue()  # type: ignore[attr-defined]
    assert (
        "Quarantined 2 sample(s) (dataset indices), left out of their step and every later "
        "one: 17 (ValueError: corrupt record 17), 42 (NonFiniteSampleLoss: the loss is nan); "
        f"all in {run_dir}/quarantine.json."
    ) in " ".join(end.split()), end


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["respawn", "shrink"])
def test_a_worker_that_fails_every_step_is_put_out_and_no_sample_is_blamed(
    tmp_path: Path, mode: str
) -> None:
    step = functools.partial(broken_worker_step, folder=str(tmp_path))
    result = px.Learner(mlp, sgd, step).fit(
        BadSamples(240),
        strategy="ddp",
        devices="cpu:0,cpu:1,cpu:2",
        on_bad_sample="skip",
        on_failure=px.Recovery(mode),
        sinks=[],
        **FIT,
    )
    clean = px.Learner(mlp, sgd, indexed_step).fit(BadSamples(240), sinks=[], **FIT)
    assert result.quarantined == []
    assert result.ledger_ok and result.steps == clean.steps
    assert _rel(result.model, clean.model) <= 1e-5
    put_out = [f for f in result.failures if f.exception_type == "WorkerAtFault"]
    assert len(put_out) == 1 and put_out[0].worker == 1
    assert put_out[0].action == ("respawned" if mode == "respawn" else "shrunk")
    assert "passed on another member" in put_out[0].message


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("strategy", "devices"),
    [("threads", "cpu:0,cpu:1"), pytest.param("ddp", "cpu:0,cpu:1", marks=pytest.mark.slow)],
)
def test_the_default_still_stops_and_names_the_sample(strategy: str, devices: str) -> None:
    # The dataset's error does not say which record: the report finds it (the retry bisects
    # the failing part), in a part of 48 samples (more than the part's list shows).
    with pytest.raises(px.TrainingFailed) as caught:
        px.Learner(mlp, sgd, indexed_step).fit(
            BadSamples(240, raise_at=(17,), say_index=False),
            strategy=strategy,
            devices=devices,
            sinks=[],
            **{**FIT, "batch_size": 96},
        )
    assert caught.value.code == "PX204"  # a poison batch, as before
    text = str(caught.value)
    assert "Sample(s) that fail alone: 17 (ValueError: corrupt record)." in text, text
    assert len(caught.value.failures[0].sample_indices) == 48
    assert caught.value.failures[0].action != "quarantined"


def test_a_retry_that_passes_names_no_sample_and_changes_nothing() -> None:
    # A one-off exception: the retry (which would bisect on failure) passes; the model is
    # the clean run's.
    clean = px.Learner(mlp, sgd, indexed_step).fit(
        BadSamples(240), strategy="threads", devices="cpu:0,cpu:1", sinks=[], **FIT
    )
    once = px.Learner(mlp, sgd, indexed_step).fit(
        BadSamples(240),
        strategy="threads",
        devices="cpu:0,cpu:1",
        faults=[px.Fault("exception", worker=1, step=3, phase="forward")],
        sinks=[],
        **FIT,
    )
    assert [f.action for f in once.failures] == ["retried"]
    assert not once.failures[0].bad_samples
    assert _rel(once.model, clean.model) <= 1e-5


@pytest.mark.timeout(120)
def test_data_broken_wholesale_stops_at_max_bad_samples() -> None:
    with pytest.raises(px.TrainingFailed) as caught:
        px.Learner(mlp, sgd, indexed_step).fit(
            BadSamples(240, raise_at=tuple(range(0, 240, 7))),
            on_bad_sample="skip",
            max_bad_samples=3,
            sinks=[],
            **FIT,
        )
    assert caught.value.code == "PX207"
    assert "max_bad_samples=3" in str(caught.value)


def test_on_bad_sample_is_checked() -> None:
    with pytest.raises(px.ConfigError, match="on_bad_sample='drop'"):
        px.Learner(mlp, sgd, indexed_step).fit(BadSamples(24), on_bad_sample="drop", sinks=[])


def test_phalanx_report_lists_the_quarantined_samples_with_their_errors(tmp_path: Path) -> None:
    from phalanx.runview import report_run

    run_dir = tmp_path / "run"
    px.Learner(mlp, sgd, indexed_step).fit(
        BadSamples(240, **BAD), on_bad_sample="skip", run_dir=str(run_dir), **FIT
    )
    console = Console(file=io.StringIO(), width=300)
    assert report_run(run_dir, console) == 0
    out = " ".join(console.file.getvalue().split())  # type: ignore[attr-defined]
    assert (
        "Quarantined 2 sample(s) (dataset indices), left out of their step and every later "
        "one: 17 (ValueError: corrupt record 17), 42 (NonFiniteSampleLoss: the loss is nan)"
    ) in out, out
    # a run that replaced the default sinks left no event log: said, not a traceback
    bare = tmp_path / "bare"
    px.Learner(mlp, sgd, indexed_step).fit(
        BadSamples(240), run_dir=str(bare), sinks=[], **{**FIT, "epochs": 1}
    )
    console = Console(file=io.StringIO(), width=300)
    assert report_run(bare, console) == 0
    assert "has no events.jsonl" in console.file.getvalue()  # type: ignore[attr-defined]
