"""`phalanx plot` and `phalanx report` on real run folders: a run with injected failures
(threads, exception faults), and a hand-made log with a kill, a hang and generations."""

from __future__ import annotations

import functools
import io
import itertools
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from rich.console import Console

import phalanx as px
from phalanx import cli
from phalanx.events import (
    Balanced,
    EpochEnded,
    GenerationStarted,
    RunEnded,
    RunOpened,
    RunStarted,
    StepEnded,
    Validated,
    WorkerFailed,
    WorkerState,
    to_record,
)
from phalanx.failures import WorkerFailure
from phalanx.plot import KIND_STYLE, SHARES_PANEL, SLOW_COLOUR, draw, load_run, plot_run
from phalanx.runinfo import write_run
from phalanx.runview import report_run

pytest.importorskip("matplotlib")
from matplotlib.colors import to_hex


def tiny_model() -> torch.nn.Module:
    return torch.nn.Linear(4, 2)


def tiny_fit(run_dir: Path, faults: list[px.Fault]) -> px.FitResult:
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(64, 4, generator=g), torch.randint(0, 2, (64,), generator=g)
    )
    learner = px.Learner(
        tiny_model, functools.partial(torch.optim.SGD, lr=0.1), px.cross_entropy_step
    )
    return learner.fit(
        data,
        valid=data,
        epochs=2,
        batch_size=16,
        strategy="threads",
        devices="cpu:0,cpu:1",
        run_dir=str(run_dir),
        faults=faults,
    )


@pytest.mark.timeout(120)
def test_plot_marks_each_injected_failure_at_its_step(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    faults = [px.Fault("exception", worker=1, step=2), px.Fault("exception", worker=0, step=5)]
    result = tiny_fit(run_dir, faults)
    assert [f.step for f in result.failures] == [2, 5]
    assert cli.main(["plot", str(run_dir)]) == 0
    png = run_dir / "run.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = load_run(run_dir)
    assert data.steps == list(range(1, 9))  # 2 epochs x 4 steps, 1-based
    assert cli.main(["plot", str(run_dir), "-o", str(tmp_path / "cli.png")]) == 0
    assert (tmp_path / "cli.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    drawn = plot_run(run_dir, tmp_path / "other.png")
    assert (tmp_path / "other.png").exists()
    # the 3rd and 6th steps (0-based 2 and 5), at the loss of the step committed there
    assert drawn.by_step == {
        "exception": [(3.0, data.loss_at(3)), (6.0, data.loss_at(6))],
    }
    times = [x for x, _ in drawn.by_time["exception"]]
    assert times == sorted(times) and all(0 <= t <= data.seconds[-1] for t in times)
    assert drawn.world[0] == (0.0, 2.0)  # threads on 2 devices, all along
    assert set(data.valid) == {"valid/loss"}


def valid_metrics(step: int) -> dict[str, float]:
    loss = 2.2 / step + 0.1
    return {"train/loss": 2.0 / step, "valid/loss": loss, "valid/accuracy": 0.5 + 0.05 * step,
            "valid/f1": 0.45 + 0.05 * step, "valid/perplexity": math.exp(loss)}  # fmt: skip


def hand_made_run(
    run_dir: Path,
    *,
    failures: bool = True,
    valid: bool = False,
    val_every: int | None = None,
    balance: bool = False,
) -> None:
    """A ddp run's log as the supervisor writes it: worker 1 killed in step 4 (respawned, its
    replacement rejoins), worker 0 hung in step 7 (shrunk), plus a line of another run.
    ``failures=False``: none of them; ``valid``: validation metrics at each epoch's end (steps
    4 and 8) and, with ``val_every``, after every ``val_every``-th step in between;
    ``balance``: :func:`balance_events` (with ``failures``, generation 2 is workers 1 and 0)."""
    run_dir.mkdir(parents=True)
    write_run(run_dir, {"run_id": "r2", "started": 100.0, "sessions": [100.0]})
    devices = ["cpu:0", "cpu:1"]
    crash = WorkerFailure(1, 1, "cpu:1", "crash", "SIGKILL", "forward", step=3, epoch=0,
                          time=104.5, action="respawned")  # fmt: skip
    hang = WorkerFailure(0, 0, "cpu:0", "hang", "no progress", "forward", step=6, epoch=1,
                         time=112.0, action="shrunk", last_progress=107.0)  # fmt: skip
    members = [1, 0] if balance else [0, 1]  # (ranks by slot: the rejoined worker first)
    events = [
        RunOpened("r2", str(run_dir), time=100.0),
        GenerationStarted(0, [0, 1], devices, "start", time=100.5),
        RunStarted(str(run_dir), "ddp", devices, 2, 4, 8, 32, 8, time=101.0),
    ]
    for g in range(1, 9):
        t = 101.0 + g
        events.append(StepEnded((g - 1) // 4, (g - 1) % 4, g, 4, 2.0 / g, 0.1, 8, 8.0, time=t))
        if valid and g % 4 == 0:
            events.append(EpochEnded((g - 1) // 4, valid_metrics(g), 4.0, time=t + 0.2))
        elif valid and val_every and g % val_every == 0:
            events.append(Validated((g - 1) // 4, (g - 1) % 4 + 1, g, valid_metrics(g), time=t))
        if balance:
            events += balance_events(g, t)
        if not failures:
            continue
        if g == 4:
            events += [
                WorkerFailed(crash, "respawned", time=104.5),
                WorkerState(1, "cpu:1", "fallen", time=104.5),
                GenerationStarted(1, [0], devices[:1], "worker 1 crash", time=104.6),
                WorkerState(1, "cpu:1", "replaced", pid=7, time=104.6),
                WorkerState(1, "cpu:1", "joining", pid=8, time=104.6),
                WorkerState(
                    1, "cpu:1", "training", rank=members.index(1), generation=2, time=105.5
                ),
                GenerationStarted(
                    2, members, [devices[m] for m in members], "workers [1] rejoin", time=105.5
                ),
            ]
        if g == 7:
            events += [
                WorkerFailed(hang, "shrunk", time=112.0),
                GenerationStarted(3, [1], devices[1:], "worker 0 hang", time=112.1),
            ]
    events.append(RunEnded([], 8, 2, None, 12.0, time=113.0))
    lines = [json.dumps({**to_record(StepEnded(0, 0, 1, 4, 9.0, 0.1, 8, 8.0)), "run": "r1"})]
    lines += [json.dumps({**to_record(e), "run": "r2"}) for e in events]
    (run_dir / "events.jsonl").write_text("\n".join(lines) + "\n")


def balance_events(g: int, t: float) -> list[Balanced]:
    """The balance's decisions after step ``g`` (at ``t + 0.1``): after step 2, rank 1 named
    slow (2.2x its peer), shares kept even; after step 3, 65/35; after step 6 (generation
    2, where :func:`hand_made_run` makes worker 1 rank 0), rank 1 named (3x), 75/25."""
    if g == 2:
        return [Balanced(2, [0.5, 0.5], [1e-3, 2.2e-3], slow=[1], changed=False, time=t + 0.1)]
    if g == 3:
        return [Balanced(3, [0.65, 0.35], [1e-3, 1.9e-3], time=t + 0.1)]
    if g == 6:
        return [Balanced(6, [0.75, 0.25], [1e-3, 3e-3], slow=[1], time=t + 0.1)]
    return []


def test_plot_marks_a_kill_and_a_hang_and_shows_world_size_and_generations(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    hand_made_run(run_dir)
    data = load_run(run_dir)
    assert data.loss[0] == 2.0  # the other run's line (loss 9) is left out
    drawn = plot_run(run_dir)
    assert (run_dir / "run.png").exists()
    assert drawn.by_step == {"crash": [(4.0, 0.5)], "hang": [(7.0, 2.0 / 7)]}
    assert drawn.by_time["crash"][0][0] == pytest.approx(4.5)
    assert drawn.by_time["hang"][0][0] == pytest.approx(12.0)
    (hang,) = [f for f in data.failures if f.kind == "hang"]
    assert hang.silent_from == pytest.approx(7.0)  # its last progress, shaded up to 12 s
    # world size over steps: 2, down to 1 after step 4's kill, 2 again, 1 after the hang
    assert [y for _, y in drawn.world] == [2.0, 1.0, 2.0, 1.0, 1.0]
    assert [g for *_, g, _ in data.world] == [0, 1, 2, 3]


def test_report_tells_the_run_end_from_its_files(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    hand_made_run(run_dir)
    console = Console(file=io.StringIO(), width=100)
    assert report_run(run_dir, console) == 0
    out = console.file.getvalue()  # type: ignore[attr-defined]
    assert "Run r2" in out
    assert "Trained 2 epoch(s), 8 step(s)" in out
    assert "Survived 2 failure(s): 1 crash, 1 hang." in out
    assert "Final world size: 1 of 2 worker(s) (generation 3)." in out
    assert "Respawn: worker 1 (cpu:1), crash at step 4: its replacement joined generation 2" in out
    assert "Failures and recoveries" in out
    assert f"checkpoints in {run_dir}/checkpoints, logs in {run_dir}" in out.replace("\n", " ")
    assert "To continue after an interruption" in out
    assert report_run(tmp_path / "nothing", console) == 1
    assert "Slow members" not in out and "Balanced:" not in out


def test_report_names_each_slow_member_where_it_ran_and_the_last_shares(tmp_path: Path) -> None:
    """Rank 1 is worker 1 in generation 0 and worker 0 in generation 2: each naming says
    which worker and device, how much slower than the median of its peers, its last share."""
    run_dir = tmp_path / "run"
    hand_made_run(run_dir, balance=True)
    console = Console(file=io.StringIO(), width=100)
    assert report_run(run_dir, console) == 0
    lines = [x.rstrip() for x in console.file.getvalue().splitlines()]  # type: ignore[attr-defined]
    title = lines.index("Slow members (persistently slower than their peers)")
    cells = [re.split("[│┃]", line)[1:-1] for line in lines[title + 1 :]]
    table = [[c.strip() for c in row] for row in cells if len(row) > 2]
    assert table == [
        ["rank", "worker", "device", "gen", "named after", "time/sample", "vs peers",
         "last share"],
        ["1", "1", "cpu:1", "0", "step 2", "2.200 ms", "2.20x", "35%"],
        ["1", "0", "cpu:0", "2", "step 6", "3.000 ms", "3.00x", "25%"],
    ]  # fmt: skip
    assert "Balanced: the last shares were 75/25% of each global batch (by rank)." in lines
    assert (
        "Slow: rank 1 is persistently slower (2.2x the time per sample of its peers): worker 1 "
        "on cpu:1, after step 2." in lines
    )
    assert (
        "Slow: rank 1 is persistently slower (3.0x the time per sample of its peers): worker 0 "
        "on cpu:0, after step 6." in lines
    )


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_ddp_run_logs_its_workers_and_generations_and_plots_the_kill(tmp_path: Path) -> None:
    """A real ddp run (2 CPU workers, worker 1 killed in step 4 and respawned): the
    supervisor's WorkerState and GenerationStarted events reach events.jsonl (its heartbeats
    do not), and the plot marks the kill where it happened."""
    from recovery_helpers import linear, make_data, sgd, slow_step

    run_dir = tmp_path / "run"
    learner = px.Learner(linear, sgd, slow_step)
    result = learner.fit(
        make_data(256), epochs=2, batch_size=16, strategy="ddp", devices="cpu:0,cpu:1",
        run_dir=str(run_dir), faults=[px.Fault("kill", worker=1, step=3)],
    )  # fmt: skip
    assert [(f.kind, f.step, f.action) for f in result.failures] == [("crash", 3, "respawned")]
    records = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    kinds = {r["event"] for r in records}
    assert "WorkersTick" not in kinds
    states = [(r["worker"], r["state"]) for r in records if r["event"] == "WorkerState"]
    for expected in [(0, "starting"), (1, "starting"), (0, "training"), (1, "training"),
                     (1, "fallen"), (1, "replaced"), (1, "joining"), (0, "finished")]:  # fmt: skip
        assert expected in states, (expected, states)
    assert states.index((1, "fallen")) < states.index((1, "replaced"))
    generations = [r["members"] for r in records if r["event"] == "GenerationStarted"]
    assert generations[:2] == [[0, 1], [0]]
    drawn = plot_run(run_dir)
    assert [x for x, _ in drawn.by_step["crash"]] == [4.0]
    assert drawn.world[0] == (0.0, 2.0) and drawn.world[1][1] == 1.0


def test_plot_without_matplotlib_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    hand_made_run(tmp_path / "run")
    for name in [n for n in sys.modules if n == "matplotlib" or n.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # any import of it now fails
    assert cli.main(["plot", str(tmp_path / "run")]) == 2
    assert "pip install 'phalanx[plot]'" in capsys.readouterr().err
    assert not (tmp_path / "run" / "run.png").exists()


def test_mid_epoch_validations_are_plotted_at_their_step(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(64, 4, generator=g), torch.randint(0, 2, (64,), generator=g)
    )
    learner = px.Learner(
        tiny_model, functools.partial(torch.optim.SGD, lr=0.1), px.cross_entropy_step
    )
    result = learner.fit(
        data,
        valid=data,
        epochs=2,
        batch_size=16,
        val_every_steps=2,
        run_dir=str(tmp_path),
        sinks=None,
    )
    points = load_run(tmp_path).valid["valid/loss"]
    assert [step for step, _, _ in points] == [2, 4, 6, 8]  # 2 and 6 mid-epoch, 4 and 8 ends
    assert load_run(tmp_path).mid_epoch == {2, 6}
    assert load_run(tmp_path).val_every() == 2
    assert points[-1][2] == pytest.approx(result.history[-1]["valid/loss"])


# The figure a report can show (issue 28): what a reader of the PNG sees, measured on the
# figure draw() returns.


def legends(fig: Any) -> list[Any]:
    return [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend())]


def legend_entries(fig: Any) -> list[tuple[str, Any]]:
    """(text, handle) of every entry of every legend in the figure."""
    return [
        (text.get_text(), handle)
        for legend in legends(fig)
        for text, handle in zip(legend.get_texts(), legend.legend_handles, strict=True)
    ]


def colour_of(handle: Any) -> str:
    if hasattr(handle, "get_color") and not hasattr(handle, "get_offsets"):
        return to_hex(handle.get_color())
    return to_hex(handle.get_facecolor()[0])


def plotted_points(ax: Any) -> np.ndarray:
    """Where the axes' lines (sampled along each segment) and markers lie on the screen,
    as far as they are inside the axes."""
    parts = []
    for line in ax.lines:
        xy = line.get_transform().transform(line.get_xydata())
        xy = xy[np.isfinite(xy).all(axis=1)]
        parts.append(xy)
        for a, b in itertools.pairwise(xy):
            parts.append(a + np.linspace(0, 1, 50)[:, None] * (b - a))
    for collection in ax.collections:
        offsets = np.asarray(collection.get_offsets(), dtype=float).reshape(-1, 2)
        parts.append(collection.get_offset_transform().transform(offsets))
    points = np.concatenate(parts) if parts else np.empty((0, 2))
    box = ax.get_window_extent()
    inside = (points[:, 0] >= box.x0) & (points[:, 0] <= box.x1)
    return points[inside & (points[:, 1] >= box.y0) & (points[:, 1] <= box.y1)]


@pytest.mark.parametrize("balance", [False, True])
def test_the_legends_sit_off_the_data(tmp_path: Path, balance: bool) -> None:
    hand_made_run(tmp_path / "run", valid=True, balance=balance)
    fig = plot_run(tmp_path / "run").figure
    fig.draw_without_rendering()
    assert legends(fig)
    for legend in legends(fig):
        box = legend.get_window_extent()
        for ax in fig.axes:
            points = plotted_points(ax)
            assert len(points)
            covered = (
                (points[:, 0] >= box.x0) & (points[:, 0] <= box.x1)
                & (points[:, 1] >= box.y0) & (points[:, 1] <= box.y1)
            )  # fmt: skip
            assert not covered.any(), ([t.get_text() for t in legend.get_texts()], ax.get_ylabel())
            assert not box.overlaps(ax.get_window_extent())  # outside every axes


def test_loss_and_validation_metrics_have_panels_of_their_own(tmp_path: Path) -> None:
    hand_made_run(tmp_path / "run", valid=True)
    drawn = plot_run(tmp_path / "run")
    fig = drawn.figure
    fig.draw_without_rendering()
    positions = [tuple(ax.get_position().bounds) for ax in fig.axes]
    assert len(set(positions)) == len(positions)  # no twin axes over another
    assert all(ax.yaxis.get_label_position() == "left" for ax in fig.axes)  # one y axis each

    def axes_of(label: str) -> Any:
        (ax,) = [ax for ax in fig.axes[::2] for x in ax.lines if x.get_label().startswith(label)]
        return ax

    assert axes_of("train loss") is axes_of("valid/loss")
    assert axes_of("valid/accuracy") is axes_of("valid/f1")
    assert axes_of("valid/accuracy") is not axes_of("train loss")
    assert axes_of("valid/perplexity") not in (axes_of("valid/accuracy"), axes_of("train loss"))
    panels = {key: series.panel for key, series in drawn.series.items()}
    assert panels == {
        "train/loss": "loss",
        "valid/loss": "loss",
        "valid/accuracy": "validation score (0-1)",
        "valid/f1": "validation score (0-1)",
        "valid/perplexity": "valid/perplexity",
    }
    assert [y for _, y in drawn.series["valid/accuracy"].points] == pytest.approx([0.7, 0.9])
    # a title naming the run, its workers and failures; report-sized
    title = fig.get_suptitle()
    assert "run r2" in title and "8 steps" in title and "2 workers (1 at the end)" in title
    assert "2 failures (crash/kill, hang)" in title
    assert fig.get_size_inches()[0] == 10
    png = (tmp_path / "run" / "run.png").read_bytes()
    assert int.from_bytes(png[16:20], "big") == 1500  # 10 in at 150 dpi


@pytest.mark.parametrize(("failures", "balance"), [(False, False), (True, False), (True, True)])
def test_curves_and_failure_kinds_never_share_a_colour(
    tmp_path: Path, failures: bool, balance: bool
) -> None:
    hand_made_run(tmp_path / "run", failures=failures, valid=True, balance=balance)
    drawn = plot_run(tmp_path / "run")
    entries = legend_entries(drawn.figure)
    kinds = {label for _, _, label in KIND_STYLE.values()}
    curves = {text: colour_of(h) for text, h in entries if text.partition(":")[0] not in kinds}
    assert any(text.startswith("train loss") for text in curves)
    assert any(text.startswith("valid/accuracy") for text in curves)
    assert len(set(curves.values())) == len(curves), curves  # pairwise distinct
    assert not set(curves.values()) & {colour for _, colour, _ in KIND_STYLE.values()}
    shown = {text: colour_of(h) for text, h in entries if text in kinds}
    assert shown == ({"crash/kill": "#d62728", "hang": "#ff7f0e"} if failures else {})
    colours = [series.colour for series in drawn.series.values()]
    assert len(drawn.series) == 5 + 2 * balance and len(set(colours)) == len(colours)
    if balance:
        assert any(text.endswith(": share") for text in curves)
        assert curves["named slow (w<n>: worker n)"] == SLOW_COLOUR


def test_mid_epoch_validations_are_labelled_as_such(tmp_path: Path) -> None:
    hand_made_run(tmp_path / "run", valid=True, val_every=2)
    drawn = plot_run(tmp_path / "run")
    entries = legend_entries(drawn.figure)
    assert not [t for t, _ in entries if "(epoch)" in t]  # not all are at an epoch's end
    mid = [(t, h) for t, h in entries if "mid-epoch" in t]
    end = [(t, h) for t, h in entries if "epoch's end" in t]
    assert mid and end
    assert all("every 2 steps" in t for t, _ in mid)
    # the key: hollow markers mid-epoch, filled ones at an epoch's end
    assert {to_hex(h.get_markerfacecolor()) for _, h in mid} == {"#ffffff"}
    assert "#ffffff" not in {to_hex(h.get_markerfacecolor()) for _, h in end}
    for key in ("valid/loss", "valid/accuracy"):
        series = drawn.series[key]
        assert [x for x, _ in series.mid_epoch] == [2.0, 6.0]
        assert [x for x, _ in series.epoch_end] == [4.0, 8.0]
        ax = drawn.figure.axes[0 if key == "valid/loss" else 2]
        for points, hollow in ((series.mid_epoch, True), (series.epoch_end, False)):
            (artist,) = [c for c in ax.collections if _offsets(c) == points]
            assert (to_hex(artist.get_facecolor()[0]) == "#ffffff") is hollow
            assert to_hex(artist.get_edgecolor()[0]) == series.colour

    hand_made_run(tmp_path / "ends", valid=True)  # only at epochs' ends: no mid-epoch key
    drawn = plot_run(tmp_path / "ends")
    texts = [text for text, _ in legend_entries(drawn.figure)]
    assert not [t for t in texts if "mid-epoch" in t]
    assert [t for t in texts if "epoch's end" in t]
    assert drawn.series["valid/loss"].mid_epoch == []


def _offsets(collection: Any) -> list[tuple[float, float]]:
    return [(float(x), float(y)) for x, y in collection.get_offsets()]


# Balance (phalanx.balance): each worker's share of the batch, and the members named slow.


def _nan_free(points: list[tuple[float, float]]) -> list[tuple[float, float | None]]:
    return [(x, None if math.isnan(y) else y) for x, y in points]


def test_plot_shows_each_workers_share_and_marks_the_members_named_slow(tmp_path: Path) -> None:
    """Shares by worker slot (rank 0 of generation 2 is worker 1), even again at each new
    generation, a gap where a worker was no member; a star where each was named slow."""
    hand_made_run(tmp_path / "run", balance=True)
    data = load_run(tmp_path / "run")
    assert data.uneven and data.devices == ["cpu:0", "cpu:1"]
    drawn = plot_run(tmp_path / "run")
    # steps committed when each took effect: the start, the decision after step 3, gen 1
    # (after step 3, by its time), gen 2, the decision after step 6, gen 3 (after step 7);
    # on to the last step
    xs = [0.0, 3.0, 3.0, 4.0, 6.0, 7.0, 8.0]
    shares = {key: _nan_free(series.points) for key, series in drawn.series.items()
              if series.panel == SHARES_PANEL}  # fmt: skip
    assert shares == {
        "share/worker 0": list(zip(xs, [0.5, 0.65, 1.0, 0.5, 0.25, None, None], strict=True)),
        "share/worker 1": list(zip(xs, [0.5, 0.35, None, 0.5, 0.75, 1.0, 1.0], strict=True)),
    }
    assert drawn.series["share/worker 1"].label == "worker 1 (cpu:1): share"
    # named after steps 2 and 6, on the world size (2 both times)
    assert drawn.slow == [("w1 slow", 2.0, 2.0), ("w0 slow", 6.0, 2.0)]
    by_time = [(label, round(x, 6)) for label, x, _ in drawn.slow_by_time]
    assert by_time == [("w1 slow", 3.1), ("w0 slow", 7.1)]
    fig = drawn.figure
    (share_ax,) = [ax for ax in fig.axes[::2] if ax.get_ylabel() == SHARES_PANEL]
    assert share_ax.get_ylim()[1] <= 1.05
    assert "named slow: worker 0, worker 1" in fig.get_suptitle()
    entries = dict(legend_entries(fig))
    assert colour_of(entries["named slow (w<n>: worker n)"]) == SLOW_COLOUR
    assert set(entries) >= {"worker 0 (cpu:0): share", "worker 1 (cpu:1): share"}
    # without balance events: no shares' panel, no slow marks
    hand_made_run(tmp_path / "plain")
    drawn = plot_run(tmp_path / "plain")
    assert SHARES_PANEL not in [ax.get_ylabel() for ax in drawn.figure.axes]
    assert drawn.slow == [] and not [k for k in drawn.series if k.startswith("share/")]


def test_a_slow_member_with_even_shares_is_marked_without_a_shares_panel(tmp_path: Path) -> None:
    """``fit(balance=False)``: shares never move, the slow member is named all the same."""
    hand_made_run(tmp_path / "run", balance=True)
    data = load_run(tmp_path / "run")
    data.uneven = False  # as if only the naming (a Balanced event with changed false) came
    drawn = draw(data, tmp_path / "even.png")
    assert SHARES_PANEL not in [ax.get_ylabel() for ax in drawn.figure.axes]
    assert [label for label, _, _ in drawn.slow] == ["w1 slow", "w0 slow"]
    texts = [t.get_text() for ax in drawn.figure.axes for t in ax.texts]
    assert texts.count("w1 slow") == 2  # on the step axes and on the time axes
