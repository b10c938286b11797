"""``phalanx plot RUN_DIR``: a picture of one run with its failures.

:func:`load_run` reads the run folder (``run.json`` names the run; ``events.jsonl`` has its
steps, epochs, validations, failures and generations; lines of other runs are left out)
into :class:`RunData`, plain numbers with steps 1-based as everywhere people read them.

:func:`draw` turns that into a PNG (matplotlib, the ``phalanx[plot]`` extra; 10 x 7 in at
150 dpi, taller with more panels) of two columns, against the step (left) and against the
wall time since the run began (right), and one row per panel, each with one y axis:

* the train loss of every step, the validation loss, and each failure as a marker by kind
  (crash/kill, hang, exception, out of memory) at the loss of its step;
* the validation metrics: those within [0, 1] (accuracy, F1...) share a panel, any other
  one has its own; a validation at an epoch's end is a filled marker, one in the middle of
  an epoch (``fit(val_every_steps=N)``) a hollow one, and the legend says which is which;
* the shares of each global batch (``fit(balance=True)``), one step line per worker, only
  when the balance moved them from even in some generation (each generation starts even; a
  worker outside a generation has no share);
* the world size, each generation labelled ``g<n>``, and each member named persistently
  slower than its peers a star on it, labelled ``w<n> slow`` (worker ``n``).

Each failure is also a dotted line across its column (a hang on the time axes is shaded
from the worker's last progress). The curves' colours are pairwise distinct and none is a
failure kind's colour; each row's legend sits to the right of its panels, off the data; the
title names the run, its steps, workers, failures and slow workers.

:func:`draw` returns what it drew (:class:`Drawn`: the failure markers', the curves' and
the slow marks' positions read back from the plot's artists, the panel and colour of each
curve, and the figure itself), so a test can check the picture's content without reading
pixels.
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
from collections import Counter
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
UNKNOWN_KIND = ("D", "#000000", "")  # a failure kind this module does not know
WORLD_COLOUR = "#2ca02c"
SLOW_COLOUR = "#e6ab02"  # a member named slow, on the world size
KEY_COLOUR = "#444444"  # the legend's key to the validation markers
# The curves' colours, in order (train loss first): none is a failure kind's, the world
# size's or the key's; more curves than these get evenly spaced hues (see _colours).
PALETTE = ("#1f77b4", "#17becf", "#e377c2", "#bcbd22", "#393b79", "#7f7f7f", "#637939")
FIGSIZE = (10.0, 7.0)  # inches, with one validation panel; each more adds VALID_HEIGHT
VALID_HEIGHT = 1.8
SHARES_HEIGHT = 1.5  # the shares' panel, when there is one
SHARES_PANEL = "share of each batch"
SHARE_STYLES = ("-", "--", "-.")  # (equal shares draw one line over another: tell them apart)
DPI = 150
SHADE = 0.12  # the alpha of a hang's silence on the time axes
SHAPES = ("o", "s", "D", "^", "p", "h")  # the validation metrics' markers, in each panel


@dataclass(frozen=True)
class Failure:
    """A failure as the plot places it: ``step`` 1-based (the step it failed in)."""

    kind: str
    step: float
    seconds: float
    worker: int
    action: str
    silent_from: float | None = None  # a hang: seconds at the worker's last progress


@dataclass(frozen=True)
class SlowMark:
    """A member named persistently slower than its peers, after committed step ``step``
    (as the world size counts steps: committed so far), its rank then and the worker slot
    that rank was (None when the log does not say), and its time per sample over its
    peers' median."""

    step: float
    seconds: float
    rank: int
    worker: int | None
    ratio: float | None

    @property
    def label(self) -> str:
        return f"w{self.worker} slow" if self.worker is not None else f"rank {self.rank} slow"


@dataclass
class RunData:
    """One run's curves. ``seconds`` count from the run's first event; steps are 1-based.

    ``valid`` maps each validation metric to its points ``(step, seconds, value)``: at an
    epoch's end (an ``EpochEnded`` event) or, for the steps in ``mid_epoch``, after a
    committed step in the middle of an epoch (a ``Validated`` event:
    ``fit(val_every_steps=N)``)."""

    run_id: str | None = None
    steps: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    valid: dict[str, list[tuple[int, float, float]]] = field(default_factory=dict)
    mid_epoch: set[int] = field(default_factory=set)
    failures: list[Failure] = field(default_factory=list)
    # (step, seconds, generation, world size): from the start, and at each new generation
    world: list[tuple[float, float, int, int]] = field(default_factory=list)
    # (step, seconds, {worker slot: share}): the shares of each global batch from the start,
    # at each new generation (even) and at each decision of the balance (Balanced events)
    shares: list[tuple[float, float, dict[int, float]]] = field(default_factory=list)
    uneven: bool = False  # the balance moved the shares at least once (a changed Balanced)
    slow: list[SlowMark] = field(default_factory=list)
    devices: list[str] = field(default_factory=list)  # each worker slot's (RunStarted)

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

    def world_at(self, x: float, column: int = 0) -> float:
        """The world size in force at ``x`` (a step, or ``column`` 1: seconds)."""
        sizes = [float(w[3]) for w in self.world if w[column] <= x]
        return sizes[-1] if sizes else math.nan

    def val_every(self) -> int | None:
        """The steps between mid-epoch validations (``val_every_steps``), as the log shows
        them: the greatest common divisor of their steps; None without any."""
        return math.gcd(*self.mid_epoch) if self.mid_epoch else None


@dataclass(frozen=True)
class Series:
    """A curve as drawn: its legend label, colour, the panel it is on (its axes' y label)
    and its points on the step axes, read from its artists; a validation's points also
    split into those at an epoch's end (filled markers) and mid-epoch ones (hollow)."""

    label: str
    colour: str
    panel: str
    points: list[tuple[float, float]]
    epoch_end: list[tuple[float, float]] = field(default_factory=list)
    mid_epoch: list[tuple[float, float]] = field(default_factory=list)


@dataclass
class Drawn:
    """What :func:`draw` put in the picture: per failure kind, the markers' positions on
    the step axes and on the time axes, read from the artists; the world size's steps; per
    curve (``train/loss``, ``valid/<metric>``, ``share/worker <n>``: a worker's share of
    each batch, NaN where it was no member), a :class:`Series`; each slow mark's label and
    position; and the matplotlib ``Figure`` as saved (its axes and legends, for a test to
    measure)."""

    path: Path
    by_step: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    by_time: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    world: list[tuple[float, float]] = field(default_factory=list)
    series: dict[str, Series] = field(default_factory=dict)
    # the slow marks on the world size: (label, x, y) on the step axes and on the time axes
    slow: list[tuple[str, float, float]] = field(default_factory=list)
    slow_by_time: list[tuple[str, float, float]] = field(default_factory=list)
    figure: Any = None


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
    members: list[int] | None = None  # the current generation's slots, by rank
    for r in records:
        seconds = float(r.get("time", start)) - start
        kind = r.get("event")
        if kind == "RunStarted":
            steps_per_epoch = int(r["steps_per_epoch"])
            data.devices = [str(d) for d in r["devices"]]
            if not data.world:
                data.world.append((0.0, seconds, 0, len(r["devices"])))
            if not data.shares:
                members = list(range(len(r["devices"])))
                data.shares.append((0.0, seconds, _even(members)))
        elif kind == "StepEnded":
            data.steps.append(int(r["global_step"]))
            data.seconds.append(seconds)
            data.loss.append(float(r["loss"]))
        elif kind in ("EpochEnded", "Validated"):
            _validation(r, seconds, steps_per_epoch, data)
        elif kind == "WorkerFailed":
            data.failures.append(_failure(r, seconds, data))
        elif kind == "GenerationStarted":
            data.world.append((data.step_at(seconds), seconds, int(r["number"]), len(r["members"])))
            members = [int(m) for m in r["members"]]
            data.shares.append((data.step_at(seconds), seconds, _even(members)))
        elif kind == "Balanced":
            _balanced(r, seconds, members, data)
    return data


def _even(members: list[int]) -> dict[int, float]:
    return {m: 1.0 / len(members) for m in members}


def _balanced(
    record: dict[str, Any], seconds: float, members: list[int] | None, data: RunData
) -> None:
    """A decision of the balance: its shares from the next step (by worker slot), and the
    members it names slow."""
    from phalanx.balance import slower_than_peers

    def slot(rank: int) -> int | None:
        if members is None:
            return rank  # (no generation, no RunStarted: ranks are all the log knows)
        return members[rank] if 0 <= rank < len(members) else None

    step = float(record["global_step"])
    shares = [float(x) for x in record["shares"]]
    if record.get("changed", True):
        data.uneven = True
        by_slot = {slot(rank): share for rank, share in enumerate(shares)}
        data.shares.append((step, seconds, {w: x for w, x in by_slot.items() if w is not None}))
    paces = [float(x) for x in record.get("paces", [])]
    for rank in record.get("slow", []):
        ratio = slower_than_peers(paces, int(rank))
        data.slow.append(SlowMark(step, seconds, int(rank), slot(int(rank)), ratio))


def _validation(
    record: dict[str, Any], seconds: float, steps_per_epoch: int, data: RunData
) -> None:
    """An epoch's end's or a mid-epoch validation's ``valid/`` metrics, at its step."""
    if record["event"] == "Validated":  # mid-epoch (val_every_steps), after its global step
        at = int(record["global_step"])
        data.mid_epoch.add(at)
    elif steps_per_epoch:
        at = (int(record["epoch"]) + 1) * steps_per_epoch
    else:
        at = int(data.step_at(1e18))
    for key, value in record["metrics"].items():
        if key.startswith("valid/"):
            data.valid.setdefault(key, []).append((at, seconds, float(value)))


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


@dataclass
class _Panel:
    """One row of the figure: its y label and the validation metrics drawn on it."""

    ylabel: str
    metrics: list[str]


def _panels(data: RunData) -> list[_Panel]:
    """The rows above the world size: the loss (with each validation metric named like a
    loss), the metrics within [0, 1] together, and any other metric on its own."""
    losses = sorted(k for k in data.valid if k.endswith("loss"))
    others = sorted(k for k in data.valid if k not in losses)
    unit = [k for k in others if all(0.0 <= p[2] <= 1.0 for p in data.valid[k])]
    panels = [_Panel("loss", losses)]
    if unit:
        panels.append(_Panel("validation score (0-1)", unit))
    panels += [_Panel(k, [k]) for k in others if k not in unit]
    return panels


def _colours(n: int) -> list[str]:
    """``n`` colours, pairwise distinct, none a failure kind's, the world size's or the
    key's: :data:`PALETTE`, then evenly spaced hues."""
    import colorsys

    taken = {c for _, c, _ in KIND_STYLE.values()}
    taken |= {UNKNOWN_KIND[1], WORLD_COLOUR, KEY_COLOUR, SLOW_COLOUR}
    colours = list(PALETTE[:n])
    extra = n - len(colours)
    for i in range(extra):
        r, g, b = colorsys.hsv_to_rgb((i + 0.5) / extra, 0.75, 0.55)
        colour = f"#{round(r * 255):02x}{round(g * 255):02x}{round(b * 255):02x}"
        while colour in taken or colour in colours:  # (a coincidence: nudge it)
            colour = f"#{(int(colour[1:], 16) + 1) % 0xFFFFFF:06x}"
        colours.append(colour)
    return colours


def _title(data: RunData) -> str:
    name = f"phalanx run {data.run_id}" if data.run_id else "phalanx run"
    parts = [_count(len(data.steps), "step")]
    if data.world:
        first, last = data.world[0][3], data.world[-1][3]
        workers = _count(first, "worker")
        parts.append(workers if first == last else f"{workers} ({last} at the end)")
    kinds = Counter(
        KIND_STYLE[f.kind][2] if f.kind in KIND_STYLE else f.kind for f in data.failures
    )
    names = ", ".join(k if n == 1 else f"{k} x{n}" for k, n in sorted(kinds.items()))
    parts.append(f"{_count(len(data.failures), 'failure')} ({names})" if kinds else "no failures")
    slow = sorted({(m.worker is None, m.rank if m.worker is None else m.worker) for m in data.slow})
    if slow:
        who = (f"rank {n}" if unknown else f"worker {n}" for unknown, n in slow)
        parts.append("named slow: " + ", ".join(who))
    return f"{name}: " + ", ".join(parts)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def draw(data: RunData, path: str | Path) -> Drawn:
    """Draw ``data`` into the PNG ``path``; return what was drawn (see :class:`Drawn`).
    Needs matplotlib (``pip install 'phalanx[plot]'``)."""
    from matplotlib.figure import Figure

    panels = _panels(data)
    workers = _share_workers(data)
    heights = [3.0] + [2.0] * (len(panels) - 1) + [1.2] * bool(workers) + [1.0]
    height = FIGSIZE[1] + (len(panels) - 2) * VALID_HEIGHT  # (less without a metric's panel)
    height += SHARES_HEIGHT if workers else 0.0
    fig = Figure(figsize=(FIGSIZE[0], height), layout="constrained")
    axes = fig.subplots(
        len(heights), 2, sharex="col", sharey="row", gridspec_kw={"height_ratios": heights}
    )
    keys = ["train/loss", *(k for p in panels for k in p.metrics)]
    keys += [f"share/worker {w}" for w in workers]
    colours = dict(zip(keys, _colours(len(keys)), strict=True))
    drawn = Drawn(Path(path), figure=fig)
    for column in (0, 1):
        for row, panel in enumerate(panels):
            ax = axes[row][column]
            handles = _draw_panel(ax, data, panel, row, column, colours, drawn)
            if column == 0:
                ax.set_ylabel(panel.ylabel)
            else:
                _legend(ax, handles + _key(data, panel))
        if workers:
            ax = axes[-2][column]
            lines = _draw_shares(ax, data, workers, column, colours, drawn)
            _mark_failures(ax, data, column)
            if column == 0:
                ax.set_ylabel(SHARES_PANEL)
            else:
                _legend(ax, lines)
        bottom = axes[-1][column]
        world = _draw_world(bottom, data, column)
        slow, stars = _draw_slow(bottom, data, column)
        _mark_failures(bottom, data, column)
        if column == 0:
            drawn.world, drawn.slow = world, slow
            bottom.set_ylabel("workers")
        else:
            drawn.slow_by_time = slow
            handles = [*bottom.lines[:1], *stars]
            labels = ["world size (g<n>: generation n)", "named slow (w<n>: worker n)"]
            _legend(bottom, handles, labels[: len(handles)])
        bottom.set_xlabel(("step (1-based)", "wall time since the run began (s)")[column])
        axes[0][column].set_title(("against the step", "against the wall time")[column])
    fig.suptitle(_title(data))
    fig.savefig(path, dpi=DPI)
    return drawn


def _draw_panel(
    ax: Any, data: RunData, panel: _Panel, row: int, column: int, colours: dict[str, str],
    drawn: Drawn,
) -> list[Any]:  # fmt: skip
    """One panel above the world size: on the first row, the train loss and the failures'
    markers; its validation metrics; the failures' lines. Fills in ``drawn`` (from the
    step axes: ``column`` 0) and returns the artists for the row's legend."""
    from matplotlib.colors import to_hex
    from matplotlib.patches import Patch

    handles: list[Any] = []
    if row == 0:
        xs = (data.steps, data.seconds)[column]
        (line,) = ax.plot(xs, data.loss, color=colours["train/loss"], linewidth=1,
                          label="train loss (each step)")  # fmt: skip
        handles.append(line)
        if column == 0:
            colour = to_hex(line.get_color())
            drawn.series["train/loss"] = Series(line.get_label(), colour, panel.ylabel, _xy(line))
    for key, shape in zip(panel.metrics, itertools.cycle(SHAPES), strict=False):
        series, handle = _draw_valid(ax, data, key, column, colours[key], shape)
        handles.append(handle)
        if column == 0:
            drawn.series[key] = Series(**series, panel=panel.ylabel)
    _mark_failures(ax, data, column)
    if row == 0:
        markers, scatters = _draw_failures(ax, data, column)
        (drawn.by_step if column == 0 else drawn.by_time).update(markers)
        handles += scatters
        if any(f.silent_from is not None for f in data.failures):
            handles.append(
                Patch(color=KIND_STYLE["hang"][1], alpha=SHADE, linewidth=0,
                      label="hang: silent since its last progress")
            )  # fmt: skip
    return handles


def _legend(ax: Any, handles: list[Any], labels: list[str] | None = None) -> None:
    """A row's legend, right of its right-hand axes: off the data."""
    if handles:
        ax.legend(
            handles, labels or [h.get_label() for h in handles], loc="upper left",
            bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, fontsize=8, frameon=False,
        )  # fmt: skip


def _xy(artist: Any) -> list[tuple[float, float]]:
    """A line's or a scatter's points, as the artist holds them."""
    points = artist.get_xydata() if hasattr(artist, "get_xydata") else artist.get_offsets()
    return [(float(x), float(y)) for x, y in points]


def _draw_valid(
    ax: Any, data: RunData, key: str, column: int, colour: str, shape: str
) -> tuple[dict[str, Any], Any]:
    """A validation metric: a dashed line through its points, markers of ``shape``:
    filled at an epoch's end, hollow mid-epoch. Its :class:`Series` fields but the panel,
    and its legend entry."""
    from matplotlib.colors import to_hex
    from matplotlib.lines import Line2D

    points = data.valid[key]
    xs, ys = [p[column] for p in points], [p[2] for p in points]
    (line,) = ax.plot(xs, ys, color=colour, linestyle="--", linewidth=1.2, label=key)
    handle = Line2D([], [], color=colour, linestyle="--", linewidth=1.2, marker=shape, label=key)
    ends = [(x, y) for p, x, y in zip(points, xs, ys, strict=True) if p[0] not in data.mid_epoch]
    mids = [(x, y) for p, x, y in zip(points, xs, ys, strict=True) if p[0] in data.mid_epoch]
    drawn: dict[str, Any] = {"label": key, "colour": to_hex(line.get_color()), "points": _xy(line)}
    for name, chosen, face in (("epoch_end", ends, colour), ("mid_epoch", mids, "white")):
        scatter = ax.scatter(
            [x for x, _ in chosen], [y for _, y in chosen], marker=shape, s=30, zorder=4,
            facecolors=face, edgecolors=colour, linewidths=1.2, label=f"_{key} {name}",
        )  # fmt: skip
        drawn[name] = _xy(scatter)
    return drawn, handle


def _key(data: RunData, panel: _Panel) -> list[Any]:
    """The legend's entries that tell the validation markers apart, as far as the panel's
    metrics have such points: filled at an epoch's end, hollow mid-epoch."""
    from matplotlib.lines import Line2D

    steps = {p[0] for k in panel.metrics for p in data.valid[k]}
    entries = []
    style: dict[str, Any] = {
        "color": KEY_COLOUR,
        "marker": "o",
        "linestyle": "none",
        "markersize": 5,
    }
    if steps - data.mid_epoch:
        entries.append(Line2D([], [], **style, label="filled: validation at an epoch's end"))
    if steps & data.mid_epoch:
        label = f"hollow: mid-epoch validation (every {data.val_every()} steps)"
        entries.append(Line2D([], [], **style, markerfacecolor="white", label=label))
    return entries


def _mark_failures(ax: Any, data: RunData, column: int) -> None:
    """A dotted line at each failure; a hang on the time axes shaded from its last progress."""
    for f in data.failures:
        colour = KIND_STYLE.get(f.kind, UNKNOWN_KIND)[1]
        ax.axvline(f.step if column == 0 else f.seconds, color=colour, linestyle=":", linewidth=1)
        if column == 1 and f.silent_from is not None:
            ax.axvspan(f.silent_from, f.seconds, color=colour, alpha=SHADE, linewidth=0)


def _draw_failures(
    ax: Any, data: RunData, column: int
) -> tuple[dict[str, list[tuple[float, float]]], list[Any]]:
    """One scatter per kind, at the loss of the failed step: the markers' positions as the
    artists hold them, and the artists."""
    drawn: dict[str, list[tuple[float, float]]] = {}
    artists = []
    for kind in sorted({f.kind for f in data.failures}):
        mine = [f for f in data.failures if f.kind == kind]
        xs = [f.step if column == 0 else f.seconds for f in mine]
        ys = [data.loss_at(f.step) for f in mine]
        marker, colour, label = KIND_STYLE.get(kind, (*UNKNOWN_KIND[:2], kind))
        artist = ax.scatter(xs, ys, marker=marker, color=colour, s=80, zorder=5, label=label)
        drawn[kind] = _xy(artist)
        artists.append(artist)
    return drawn, artists


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
    (line,) = ax.step(xs, ys, where="post", color=WORLD_COLOUR)
    for w in data.world:
        ax.annotate(f"g{w[2]}", (w[column], w[3]), fontsize=7, xytext=(2, 2),
                    textcoords="offset points")  # fmt: skip
    ax.set_ylim(0, max(ys) + 1)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    return _xy(line)


def _share_workers(data: RunData) -> list[int]:
    """The worker slots whose shares the plot shows: every one that had a share, when the
    balance moved the shares at least once; none otherwise (even all along: no panel)."""
    if not data.uneven:
        return []
    return sorted({w for _, _, shares in data.shares for w in shares})


def _draw_shares(
    ax: Any, data: RunData, workers: list[int], column: int, colours: dict[str, str],
    drawn: Drawn,
) -> list[Any]:  # fmt: skip
    """Each worker's share of each global batch as a step line (a gap while it is no
    member; solid, dashed, dash-dotted in turn, so equal shares stay apart); fills in
    ``drawn.series`` from the step axes. Returns the lines."""
    from matplotlib.colors import to_hex
    from matplotlib.ticker import PercentFormatter

    ends = (data.steps, data.seconds)[column]
    xs = [p[0] if column == 0 else p[1] for p in data.shares]
    if ends and float(ends[-1]) > xs[-1]:
        xs.append(float(ends[-1]))
    lines = []
    for w, style in zip(workers, itertools.cycle(SHARE_STYLES), strict=False):
        ys = [p[2].get(w, math.nan) for p in data.shares]
        ys += ys[-1:] * (len(xs) - len(ys))
        device = f" ({data.devices[w]})" if 0 <= w < len(data.devices) else ""
        key = f"share/worker {w}"
        (line,) = ax.step(xs, ys, where="post", color=colours[key], linewidth=1.4,
                          linestyle=style, label=f"worker {w}{device}: share")  # fmt: skip
        lines.append(line)
        if column == 0:
            colour = to_hex(line.get_color())
            drawn.series[key] = Series(line.get_label(), colour, SHARES_PANEL, _xy(line))
    ax.set_ylim(0, 1.05)
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    return lines


def _draw_slow(
    ax: Any, data: RunData, column: int
) -> tuple[list[tuple[str, float, float]], list[Any]]:
    """Each member named slow, a star on the world size where it was named, labelled: the
    labels and the positions as the artists hold them, and the stars' artist (if any)."""
    if not data.slow:
        return [], []
    xs = [m.step if column == 0 else m.seconds for m in data.slow]
    ys = [data.world_at(x, column) for x in xs]
    artist = ax.scatter(xs, ys, marker="*", s=110, color=SLOW_COLOUR, zorder=5,
                        label="named slow")  # fmt: skip
    labels = []
    for m, x, y in zip(data.slow, xs, ys, strict=True):
        note = ax.annotate(m.label, (x, y), fontsize=7, color=SLOW_COLOUR, xytext=(3, -9),
                           textcoords="offset points")  # fmt: skip
        labels.append(note.get_text())
    return [(label, x, y) for label, (x, y) in zip(labels, _xy(artist), strict=True)], [artist]


def plot_run(run_dir: str | Path, output: str | Path | None = None) -> Drawn:
    """Draw the run in ``run_dir`` into ``output`` (default ``run_dir/run.png``)."""
    target = Path(output) if output is not None else Path(run_dir) / "run.png"
    return draw(load_run(run_dir), target)
