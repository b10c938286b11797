"""The end-of-run summary: burn's "Learner Summary" table, plus how the run ended.

:func:`summarize` is pure; :func:`render_summary` prints it; :class:`SummarySink` does both
when the run ends (:class:`~phalanx.events.RunEnded`) and prints nothing before that.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from phalanx.events import Event, RunEnded

_SPLIT_ORDER = {"train": 0, "valid": 1, "test": 2}


@dataclass(frozen=True)
class SummaryRow:
    """One metric over the run. Epochs are 1-based positions in the history."""

    split: str
    metric: str
    min: float
    min_epoch: int
    max: float
    max_epoch: int


def _split_key(key: str) -> tuple[str, str]:
    split, sep, metric = key.partition("/")
    return (split, metric) if sep else ("", key)


def summarize(history: list[dict[str, Any]]) -> list[SummaryRow]:
    """One row per metric key seen in ``history``. Each record's ``epoch`` key (0-based) names
    its epoch, shown 1-based; without it, ``history[i]`` holds epoch ``i + 1``.

    ``"train/loss"`` gives split ``train``, metric ``loss``; a key without ``/`` has split
    ``""``. NaN values are ignored (a metric that is only ever NaN reports NaN at its first
    epoch); ties go to the earliest epoch. Rows are ordered train, valid, test, other splits,
    then by metric name.
    """
    values: dict[str, list[tuple[int, float]]] = {}
    for index, metrics in enumerate(history):
        epoch = int(metrics.get("epoch", index)) + 1
        for key, value in metrics.items():
            if key in ("epoch", "global_step"):  # (global_step: a mid-epoch validation's)
                continue
            values.setdefault(key, []).append((epoch, float(value)))
    rows = []
    for key, seen in values.items():
        split, metric = _split_key(key)
        usable = [(e, v) for e, v in seen if not math.isnan(v)] or [seen[0]]
        lo = min(usable, key=lambda ev: ev[1])
        hi = max(usable, key=lambda ev: ev[1])
        rows.append(SummaryRow(split, metric, lo[1], lo[0], hi[1], hi[0]))
    rows.sort(key=lambda r: (_SPLIT_ORDER.get(r.split, len(_SPLIT_ORDER)), r.split, r.metric))
    return rows


def _fmt(value: float) -> str:
    if math.isnan(value) or math.isinf(value):
        return str(value)
    return f"{value:.3f}" if abs(value) >= 1e-3 or value == 0 else f"{value:.3e}"


def render_summary(history: list[dict[str, Any]], console: Console) -> None:
    """Print the "Learner Summary" table (Split, Metric, Min., Epoch, Max., Epoch)."""
    rows = summarize(history)
    if not rows:
        console.print("Learner Summary: no epoch finished, no metrics recorded.")
        return
    table = Table(title="Learner Summary", title_justify="left")
    table.add_column("Split")
    table.add_column("Metric")
    for name in ("Min.", "Epoch", "Max.", "Epoch"):
        table.add_column(name, justify="right")
    for r in rows:
        table.add_row(
            r.split, r.metric, _fmt(r.min), str(r.min_epoch), _fmt(r.max), str(r.max_epoch)
        )
    console.print(table)


def format_duration(seconds: float) -> str:
    """``75.2`` -> ``"1m 15s"``; ``3.4`` -> ``"3.4s"``; ``3725`` -> ``"1h 02m 05s"``."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    if seconds < 60:
        return f"{seconds:.1f}s"
    s = round(seconds)
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}h {m:02d}m {sec:02d}s" if h else f"{m}m {sec:02d}s"


class SummarySink:
    """Prints the summary table and the run's end on :class:`RunEnded`; ignores the rest.

    The end line gives steps, epochs and time; an interrupted run adds its
    ``interrupted`` line (``Training interrupted: <reason>``, as ``FitResult`` has it); a
    failed run adds ``Training failed``.
    """

    def __init__(self, console: Console | None = None) -> None:
        self.console = console if console is not None else Console()

    def handle(self, event: Event) -> None:
        if not isinstance(event, RunEnded):
            return
        render_summary(event.history, self.console)
        self.console.print(
            f"Trained {event.epochs} epoch(s), {event.steps} step(s) "
            f"in {format_duration(event.seconds)}.",
            highlight=False,
        )
        if event.interrupted:
            self.console.print(Text(event.interrupted, style="yellow"))
        if event.failed:
            self.console.print(Text("Training failed (see the report above).", style="bold red"))

    def close(self) -> None:
        """Nothing to release."""
