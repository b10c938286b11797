"""``phalanx plot RUN_DIR``: a picture of one run with its failures.

:func:`load_run` reads the run folder (``run.json`` names the run; ``events.jsonl`` has its
steps, epochs, failures and generations; lines of other runs are left out) into
:class:`RunData`, plain numbers with steps 1-based as everywhere people read them.
:func:`draw` turns that into a PNG (matplotlib, the ``phalanx[plot]`` extra): the loss and
the validation metrics against the step and against the wall time since the run began,
each failure marked by its kind, and the world size with each generation below. It returns
what it drew (:class:`Drawn`: the failure markers' positions read back from the plot's
artists), so a test can check the picture's content without reading pixels.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from phalanx.runinfo import read_run

KIND_STYLE = {  # marker, colour, label
    "crash": ("X", "#d62728", "crash/kill"),
    "hang": ("v", "#ff7f0e", "hang"),
    "exception": ("o", "#9467bd", "exception"),
    "oom": ("s", "#8c564b", "out of memory"),
}


@dataclass(frozen=True)
class Failure:
    """A failure as the plot places it: ``step`` 1-based (the step it failed in)."""

    kind: str
    step: float
    seconds: float
    worker: int
    action: str
    silent_from: float | None = None  # a hang: seconds at the worker's last progress


@dataclass
class RunData:
    """One run's curves. ``seconds`` count from the run's first event; steps are 1-based."""

    run_id: str | None = None
    steps: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    valid: dict[str, list[tuple[int, float, float]]] = field(default_factory=dict)
    failures: list[Failure] = field(default_factory=list)
    # (step, seconds, generation, world size): from the start, and at each new generation
    world: list[tuple[float, float, int, int]] = field(default_factory=list)

    def loss_at(self, step: float) -> float:
        """The loss of the committed step nearest at or before ``step`` (NaN with none)."""
        if not self.steps:
            return math.nan
        i = max(0, bisect.bisect_right(self.steps, step) - 1)
        return self.loss[i]

    def step_at(self, seconds: float) -> float:
        """Steps committed by ``seconds`` (0 before the first)."""
        i = bisect.bisect_right(self.seconds, seconds)
        return float(self.steps[i - 1]) if i else 0.0


@dataclass
class Drawn:
    """What :func:`draw` put in the picture: per failure kind, the markers' positions on
    the step axes and on the time axes, read from the artists."""

    path: Path
    by_step: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    by_time: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    world: list[tuple[float, float]] = field(default_factory=list)


def read_events(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of ``events.jsonl`` that belong to the run ``run.json`` names (all of
    them when either says no run id: a log from before ids existed)."""
    folder = Path(run_dir)
    path = folder / "events.jsonl"
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            try:
                records.append(json.loads(line))
            except ValueError:
                continue  # a line cut short by a crash
    run_id = (read_run(folder) or {}).get("run_id")
    if run_id and any("run" in r for r in records):
        records = [r for r in records if r.get("run") == run_id]
    return records


def load_run(run_dir: str | Path) -> RunData:
    """Read the run folder into :class:`RunData` (see the module docstring)."""
    records = read_events(run_dir)
    data = RunData(run_id=(read_run(run_dir) or {}).get("run_id"))
    if not records:
        return data
    start = min(float(r.get("time", 0.0)) for r in records)
    steps_per_epoch = 0
    for r in records:
        seconds = float(r.get("time", start)) - start
        kind = r.get("event")
        if kind == "RunStarted":
            steps_per_epoch = int(r["steps_per_epoch"])
            if not data.world:
                data.world.append((0.0, seconds, 0, len(r["devices"])))
        elif kind == "StepEnded":
            data.steps.append(int(r["global_step"]))
            data.seconds.append(seconds)
            data.loss.append(float(r["loss"]))
        elif kind in ("EpochEnded", "Validated"):  # (Validated: mid-epoch, val_every_steps)
            at = (int(r["epoch"]) + 1) * steps_per_epoch if steps_per_epoch else data.step_at(1e18)
            at = int(r["global_step"]) if kind == "Validated" else at
            for key, value in r["metrics"].items():
                if key.startswith("valid/"):
                    data.valid.setdefault(key, []).append((int(at), seconds, float(value)))
        elif kind == "WorkerFailed":
            data.failures.append(_failure(r, seconds, data))
        elif kind == "GenerationStarted":
            data.world.append((data.step_at(seconds), seconds, int(r["number"]), len(r["members"])))
    return data


def _failure(record: dict[str, Any], seconds: float, data: RunData) -> Failure:
    f = record["failure"]
    step = f.get("step")
    # The failed step's 0-based index is its number minus one; outside a step, place it
    # after the steps committed so far.
    at = float(step) + 1 if step is not None else data.step_at(seconds) + 0.5
    silent = f.get("last_progress")
    since = seconds - (float(f["time"]) - float(silent)) if silent is not None else None
    action = str(record.get("action", ""))
    return Failure(str(f["kind"]), at, seconds, int(f["worker"]), action, since)


def draw(data: RunData, path: str | Path) -> Drawn:
    """Draw ``data`` into the PNG ``path``; return what was drawn (see :class:`Drawn`).
    Needs matplotlib (``pip install 'phalanx[plot]'``)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, axes = plt.subplots(
        2, 2, figsize=(12, 6.5), sharex="col", gridspec_kw={"height_ratios": [3, 1]}
    )
    drawn = Drawn(Path(path))
    for column, (xs, name) in enumerate(((data.steps, "step"), (data.seconds, "seconds"))):
        top, bottom = axes[0][column], axes[1][column]
        top.plot(xs, data.loss, color="#1f77b4", linewidth=1, label="train loss (step)")
        top.set_ylabel("loss")
        _draw_valid(top, data, column)
        markers = _draw_failures(top, data, column)
        (drawn.by_step if column == 0 else drawn.by_time).update(markers)
        world = _draw_world(bottom, data, column)
        if column == 0:
            drawn.world = world
        bottom.set_xlabel("step (1-based)" if name == "step" else "seconds since the run began")
        top.legend(loc="upper right", fontsize=8)
    title = f"phalanx run {data.run_id}" if data.run_id else "phalanx run"
    fig.suptitle(f"{title}: {len(data.failures)} failure(s)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return drawn


def _draw_valid(ax: Any, data: RunData, column: int) -> None:
    """``valid/loss`` on the loss axes; the other validation metrics on a second y axis."""
    others = {k: v for k, v in data.valid.items() if k != "valid/loss"}
    if "valid/loss" in data.valid:
        points = data.valid["valid/loss"]
        xs, ys = [p[column] for p in points], [p[2] for p in points]
        style = {"marker": "o", "linestyle": "--", "linewidth": 1, "color": "#17becf"}
        ax.plot(xs, ys, label="valid/loss (epoch)", **style)
    if not others:
        return
    twin = ax.twinx()
    for key, points in sorted(others.items()):
        xs = [p[column] for p in points]
        twin.plot(xs, [p[2] for p in points], marker=".", linestyle="--", linewidth=1, label=key)
    twin.set_ylabel("validation metrics")
    twin.legend(loc="center right", fontsize=8)


def _draw_failures(ax: Any, data: RunData, column: int) -> dict[str, list[tuple[float, float]]]:
    """One scatter per kind, and a dotted line at each failure; the markers' positions as
    the artists hold them."""
    drawn: dict[str, list[tuple[float, float]]] = {}
    for kind in sorted({f.kind for f in data.failures}):
        mine = [f for f in data.failures if f.kind == kind]
        xs = [f.step if column == 0 else f.seconds for f in mine]
        ys = [data.loss_at(f.step) for f in mine]
        marker, colour, label = KIND_STYLE.get(kind, ("D", "black", kind))
        for x in xs:
            ax.axvline(x, color=colour, linestyle=":", linewidth=1)
        for f in mine:  # a hang on the time axes: shaded from its last progress
            if column == 1 and f.silent_from is not None:
                ax.axvspan(f.silent_from, f.seconds, color=colour, alpha=0.15)
        artist = ax.scatter(xs, ys, marker=marker, color=colour, s=80, zorder=5, label=label)
        drawn[kind] = [(float(x), float(y)) for x, y in artist.get_offsets()]
    return drawn


def _draw_world(ax: Any, data: RunData, column: int) -> list[tuple[float, float]]:
    """World size as a step line, each generation labelled ``g<n>``."""
    from matplotlib.ticker import MaxNLocator

    if not data.world:
        return []
    ends = (data.steps, data.seconds)[column]
    end = float(ends[-1]) if ends else None
    xs = [w[column] for w in data.world]
    ys = [float(w[3]) for w in data.world]
    if end is not None and end > xs[-1]:
        xs, ys = [*xs, float(end)], [*ys, ys[-1]]
    (line,) = ax.step(xs, ys, where="post", color="#2ca02c")
    for w in data.world:
        ax.annotate(f"g{w[2]}", (w[column], w[3]), fontsize=7, xytext=(2, 2),
                    textcoords="offset points")  # fmt: skip
    ax.set_ylabel("workers")
    ax.set_ylim(0, max(ys) + 1)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    return [(float(x), float(y)) for x, y in zip(*line.get_data(), strict=True)]


def plot_run(run_dir: str | Path, output: str | Path | None = None) -> Drawn:
    """Draw the run in ``run_dir`` into ``output`` (default ``run_dir/run.png``)."""
    target = Path(output) if output is not None else Path(run_dir) / "run.png"
    return draw(load_run(run_dir), target)
