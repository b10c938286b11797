"""The end-of-run summary: burn's "Learner Summary" table, plus how the run ended.

:func:`summarize` is pure; :func:`render_summary` prints it; :class:`SummarySink` does both
when the run ends (:class:`~phalanx.events.RunEnded`) and prints nothing before that.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from phalanx.balance import slower_than_peers
from phalanx.events import (
    Balanced,
    CheckpointSaved,
    EpochEnded,
    Event,
    GenerationStarted,
    RunEnded,
    RunOpened,
    RunStarted,
    StepEnded,
    WorkerFailed,
    WorkerState,
)
from phalanx.failures import WorkerFailure, bad_sample_errors, one_line
from phalanx.sinks.format import fmt_number, fmt_share

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


def _fmt(value: float, metric: str = "") -> str:
    if math.isnan(value) or math.isinf(value):
        return str(value)
    if metric.endswith("samples_per_s"):
        return f"{value:,.0f}"
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
            r.split,
            r.metric,
            _fmt(r.min, r.metric),
            str(r.min_epoch),
            _fmt(r.max, r.metric),
            str(r.max_epoch),
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


def lost_seconds(f: WorkerFailure) -> float | None:
    """What a failure cost: from the failure (a hang: from the worker's last progress) to
    the run's next committed step; None when no step was committed after it."""
    if f.recovery_seconds is None:
        return None
    since = f.last_progress
    stalled = max(0.0, f.time - since) if since is not None else 0.0
    return f.recovery_seconds + stalled


def step_label(step: int | None) -> str:
    """A failure's step for people: its 0-based global index shown 1-based (``-``: none)."""
    return "-" if step is None else str(step + 1)


def render_failures(failures: list[WorkerFailure], console: Console) -> None:
    """The failures of a run and what was done about each ("Failures and recoveries"). Steps
    are 1-based; ``lost`` is :func:`lost_seconds`."""
    table = Table(title="Failures and recoveries", title_justify="left")
    for column in ("worker", "device", "kind", "step", "phase", "action"):
        table.add_column(column)
    table.add_column("lost", justify="right")
    for f in failures:
        lost = lost_seconds(f)
        table.add_row(
            str(f.worker),
            f.device,
            f.kind,
            step_label(f.step),
            f.phase,
            f.action or "",
            f"{lost:.1f}s" if lost is not None else "-",
        )
    console.print(table)
    console.print(
        "lost: from the failure (a hang: its last progress) to the next committed step",
        highlight=False,
        style="dim",
    )


@dataclass
class SlowMember:
    """A member named persistently slower than its peers (a ``Balanced`` event's ``slow``):
    its rank in generation ``generation``, the worker slot and device that rank was (None
    when the events do not say), the committed step it was named after (1-based), its pace
    (seconds per sample) and how many times its peers' median that is, and its last share
    of each global batch in that generation."""

    rank: int
    worker: int | None
    device: str | None
    generation: int
    step: int
    pace: float | None
    ratio: float | None
    share: float | None

    def line(self) -> str:
        """``rank 2 is persistently slower (2.0x ...): worker 2 on cpu:2, after step 16``
        (the step it was named after)."""
        times = f" ({self.ratio:.1f}x the time per sample of its peers)" if self.ratio else ""
        where = f"worker {self.worker} on {self.device}, " if self.worker is not None else ""
        return f"rank {self.rank} is persistently slower{times}: {where}after step {self.step}"


def render_slow(slow: list[SlowMember], console: Console) -> None:
    """The members named slow ("Slow members"), one row each: where it ran, when it was
    named, its time per sample against its peers' median, its last share."""
    table = Table(title="Slow members (persistently slower than their peers)", title_justify="left")
    for column in ("rank", "worker", "device", "gen", "named after"):
        table.add_column(column)
    for column in ("time/sample", "vs peers", "last share"):
        table.add_column(column, justify="right")
    for m in slow:
        table.add_row(
            str(m.rank),
            "-" if m.worker is None else str(m.worker),
            m.device or "-",
            str(m.generation),
            f"step {m.step}",
            "-" if m.pace is None else f"{fmt_number(m.pace * 1e3)} ms",
            "-" if m.ratio is None else f"{m.ratio:.2f}x",
            "-" if m.share is None else fmt_share(m.share),
        )
    console.print(table)
    console.print(
        "vs peers: its time per sample over the median of the other members'",
        highlight=False,
        style="dim",
    )


@dataclass
class RunStory:
    """What the end of a run tells, gathered from its events (also replayed from files by
    ``phalanx report``)."""

    run_id: str | None = None
    run_dir: str = ""
    devices: list[str] = field(default_factory=list)
    steps_per_epoch: int | None = None
    committed: int = 0  # global steps committed (the last StepEnded's global_step)
    epochs_done: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    failures: list[WorkerFailed] = field(default_factory=list)
    members: list[int] | None = None  # the last generation's
    generation: int = 0
    states: list[WorkerState] = field(default_factory=list)
    checkpoints: int = 0
    resumed_from: int = 0  # global steps committed before this invocation (a resume)
    balanced: Balanced | None = None  # the latest shares decided (phalanx.balance)
    slow: list[SlowMember] = field(default_factory=list)  # in the order they were named
    # the current generation's (worker slot, device) of each rank: a GenerationStarted's
    # members, else (in-process strategies) the devices in order
    ranks: list[tuple[int, str]] = field(default_factory=list)

    def take(self, event: Event) -> None:
        if isinstance(event, RunOpened):
            self.run_id, self.run_dir = event.run_id, event.run_dir
        elif isinstance(event, RunStarted):
            self.devices, self.steps_per_epoch = list(event.devices), event.steps_per_epoch
            if self.members is None:
                self.ranks = list(enumerate(event.devices))
            self.run_dir = event.run_dir or self.run_dir
            self.committed = event.start_epoch * event.steps_per_epoch + event.start_step
            self.epochs_done = event.start_epoch
            self.resumed_from = self.committed  # (0 for a run from its start)
        elif isinstance(event, StepEnded):
            self.committed = event.global_step
        elif isinstance(event, EpochEnded):
            self.epochs_done = event.epoch + 1
            self.history.append({"epoch": event.epoch, **event.metrics})
        elif isinstance(event, WorkerFailed):
            self.failures.append(event)
        elif isinstance(event, GenerationStarted):
            self.members, self.generation = list(event.members), event.number
            self.ranks = list(zip(event.members, event.devices, strict=False))
        elif isinstance(event, Balanced):
            self._balanced(event)
        elif isinstance(event, WorkerState):
            self.states.append(event)
        elif isinstance(event, CheckpointSaved):
            self.checkpoints += 1

    def _balanced(self, e: Balanced) -> None:
        self.balanced = e if e.changed else self.balanced
        for m in self.slow:  # the shares of those named in this generation, kept up
            if m.generation == self.generation and m.rank < len(e.shares):
                m.share = e.shares[m.rank]
        for rank in e.slow:
            worker, device = self.ranks[rank] if 0 <= rank < len(self.ranks) else (None, None)
            pace = e.paces[rank] if 0 <= rank < len(e.paces) else None
            share = e.shares[rank] if 0 <= rank < len(e.shares) else None
            ratio = slower_than_peers(e.paces, rank)
            self.slow.append(
                SlowMember(rank, worker, device, self.generation, e.global_step, pace, ratio, share)
            )

    def survived(self, failed: bool) -> list[WorkerFailure]:
        """Failures the run went on after (all but the one that stopped it)."""
        return [e.failure for e in self.failures if not (failed and e.action == "aborted")]

    def respawn_fates(self) -> list[str]:
        """For each respawned worker: did its replacement join, and where."""
        fates = []
        for e in self.failures:
            if e.action != "respawned":
                continue
            f = e.failure
            mine = [s for s in self.states if s.worker == f.worker and s.time >= f.time]
            start = next((i for i, s in enumerate(mine) if s.state == "joining"), len(mine))
            later = mine[start:]  # from the replacement's start
            joined = next((s for s in later if s.state == "training"), None)
            fell = next((s for s in later if s.state == "fallen"), None)
            what = f"worker {f.worker} ({f.device}), {f.kind} at step {step_label(f.step)}: "
            if joined is not None and (fell is None or joined.time < fell.time):
                what += f"its replacement joined generation {joined.generation}"
                if fell is not None:
                    what += ", then fell too"
            elif fell is not None:
                what += "its replacement fell before joining"
            else:
                what += "its replacement had not joined when the run ended"
            fates.append(what)
        return fates


def _count_kinds(failures: list[WorkerFailure]) -> str:
    """``1 crash, 2 exception (retried, aborted)``: failures by kind, with what was done."""
    kinds: dict[str, list[str]] = {}
    for f in failures:
        kinds.setdefault(f.kind, []).append(f.action or "?")
    parts = []
    for kind, actions in kinds.items():
        parts.append(
            f"{len(actions)} {kind}" + (f" ({', '.join(actions)})" if len(actions) > 1 else "")
        )
    return ", ".join(parts)


QUARANTINE_SHOWN = 8  # samples listed one by one at the run's end; quarantine.json has all


def quarantine_lines(failures: list[WorkerFailure], run_dir: str | None) -> list[str]:
    """``Quarantined 2 sample(s), left out of every later step: 17 (ValueError: ...), ...``:
    each sample ``on_bad_sample="skip"`` left out, with the error it failed with alone."""
    errors = bad_sample_errors(failures)
    if not errors:
        return []
    first = sorted(errors.items())[:QUARANTINE_SHOWN]
    shown = [f"{index} ({one_line(error)})" for index, error in first]
    more = len(errors) - len(shown)
    where = f"{run_dir}/quarantine.json" if run_dir else "FitResult.quarantined"
    return [
        f"Quarantined {len(errors)} sample(s) (dataset indices), left out of their step and "
        f"every later one: {', '.join(shown)}"
        + (f", and {more} more" if more else "")
        + f"; all in {where}."
    ]


def end_lines(story: RunStory, end: RunEnded) -> list[str]:
    """How the run ended, for people: steps, failures survived, the final world size, each
    respawn's fate, where checkpoints and logs are, how to resume."""
    lines = []
    if end.failed:
        lines.append(
            f"Training failed after {story.committed} committed step(s) "
            f"({story.epochs_done} epoch(s) finished); the error report follows."
        )
    elif story.resumed_from:  # this invocation's time is not the run's: say which is which
        lines.append(
            f"Trained {end.steps - story.resumed_from} step(s) in "
            f"{format_duration(end.seconds)}, resumed after step {story.resumed_from}; the "
            f"run's totals: {end.epochs} epoch(s), {end.steps} step(s)."
        )
    else:
        lines.append(
            f"Trained {end.epochs} epoch(s), {end.steps} step(s) in {format_duration(end.seconds)}."
        )
    survived = story.survived(end.failed)
    if survived and not end.failed:
        lines.append(f"Survived {len(survived)} failure(s): {_count_kinds(survived)}.")
    elif story.failures:
        every = [e.failure for e in story.failures]
        lines.append(f"{len(every)} failure(s): {_count_kinds(every)}.")
    if story.devices:
        world = len(story.members) if story.members is not None else len(story.devices)
        lines.append(
            f"Final world size: {world} of {len(story.devices)} worker(s)"
            + (f" (generation {story.generation})." if story.generation else ".")
        )
    lines += [f"Respawn: {fate}." for fate in story.respawn_fates()]
    if story.balanced is not None:
        shares = "/".join(fmt_share(s).rstrip("%") for s in story.balanced.shares)
        lines.append(f"Balanced: the last shares were {shares}% of each global batch (by rank).")
    lines += [f"Slow: {m.line()}." for m in story.slow]
    lines += quarantine_lines([e.failure for e in story.failures], story.run_dir)
    if story.run_dir:
        folder = story.run_dir
        lines.append(
            f"Run {story.run_id or '?'}: checkpoints in {folder}/checkpoints, logs in "
            f"{folder} (run.json, events.jsonl, metrics.csv, steps.csv); "
            f"`phalanx report {folder}` and `phalanx plot {folder}` show it again."
        )
        lines.append(
            f"To continue after an interruption: fit(..., run_dir={folder!r}, resume=True) "
            "(phalanx demo: --resume)."
        )
    return lines


class SummarySink:
    """Prints the summary table and the run's end on :class:`RunEnded` (before that it only
    gathers the run's story: failures, generations, workers' states).

    The end says steps, epochs and time (a failed run: the steps committed before it
    stopped, and that the error report follows), the failures survived with the table of
    failures and recoveries, the final world size, each respawn's fate, the last shares of
    the global batch and the members named slow (with the table of slow members: where
    each ran, how much slower), where checkpoints and logs are and how to resume; an
    interrupted run adds its ``interrupted`` line (``Training interrupted: <reason>``, as
    ``FitResult`` has it).

    ``timestamps``: start every line with the run's end time (``HH:MM:SS``), as the progress
    sink's plain lines do; None (the default) does so when the console is not a terminal
    (a log file, CI). ``phalanx report`` replays a run without them.
    """

    def __init__(self, console: Console | None = None, timestamps: bool | None = None) -> None:
        self.console = console if console is not None else Console()
        self.timestamps = not self.console.is_terminal if timestamps is None else timestamps
        self.story = RunStory()

    def handle(self, event: Event) -> None:
        if not isinstance(event, RunEnded):
            self.story.take(event)
            return
        if not self.timestamps:
            self._render(event)
        else:
            with self.console.capture() as captured:
                self._render(event)
            stamp = time.strftime("%H:%M:%S", time.localtime(event.time))
            for line in captured.get().splitlines():
                self.console.print(Text.from_ansi(f"{stamp} {line}"), soft_wrap=True)
        self.story = RunStory()

    def _render(self, event: RunEnded) -> None:
        render_summary(event.history or self.story.history, self.console)
        if self.story.failures:
            render_failures([e.failure for e in self.story.failures], self.console)
        if self.story.slow:
            render_slow(self.story.slow, self.console)
        for line in end_lines(self.story, event):  # a log file gets whole lines
            self.console.print(line, highlight=False, soft_wrap=not self.console.is_terminal)
        if event.interrupted:
            self.console.print(Text(event.interrupted, style="yellow"))

    def close(self) -> None:
        """Nothing to release."""
