"""The worker panel: one row per worker (device, rank, generation, state, phase, step, seconds
since its last progress), and the line that says who the others wait on. While the others
wait on one worker, its state reads ``no progress`` and theirs ``waiting`` (healthy, blocked
in a collective until it comes), though their idle seconds count up alike.

Balance (:mod:`phalanx.balance`): a member named persistently slower than its peers reads
``slow`` (yellow) instead of ``training``, and once the shares of the global batch have
moved from even, a ``share`` column gives each member's part of it. Both are the current
generation's: a new generation starts even, with no one named.

:class:`Workers` is fed by events (:class:`~phalanx.events.WorkerState`,
:class:`~phalanx.events.WorkersTick`, ``GenerationStarted``, ``Balanced``, and for
in-process strategies ``RunStarted`` and ``StepEnded``) and reads the time only from the
``now`` it is given, so a recorded event stream and a fake clock replay exactly what a user
saw. Steps are shown 1-based.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from phalanx.events import (
    Balanced,
    Event,
    GenerationStarted,
    RunStarted,
    StepEnded,
    WorkerState,
    WorkersTick,
)
from phalanx.failures import phase_rank
from phalanx.sinks.format import fmt_share

NOTICE_AFTER = 2.0  # seconds of silence of every watched worker before a waiting line shows
NOTICE_FRACTION = 0.05  # ... or this share of the hang limit, when that is longer
QUIET_STATES = ("fallen", "replaced", "finished")  # no heartbeat expected


@dataclass
class Row:
    """What the panel shows for one worker slot. ``step`` is the 0-based global index of the
    step in progress; ``since`` the wall time of its last progress."""

    worker: int
    device: str
    state: str = "starting"
    rank: int | None = None
    generation: int | None = None
    phase: str = ""
    step: int | None = None
    since: float | None = None
    limit: float | None = None
    slow: bool = False  # named persistently slower than its peers in this generation
    share: float | None = None  # its part of each global batch (a member's, balance on)


@dataclass(frozen=True)
class Waiting:
    """The peers wait on ``worker``: no progress for ``idle`` seconds in ``phase``."""

    worker: int
    device: str
    idle: float
    phase: str
    step: int | None
    limit: float | None

    def text(self) -> str:
        """One line, under 80 columns for usual devices (the step is in the worker's row)."""
        hang = f"; hang at {self.limit:g} s" if self.limit else ""
        return (
            f"waiting on worker {self.worker} ({self.device}): no progress for "
            f"{self.idle:.1f} s in {self.phase or 'its current phase'}{hang}"
        )


def notice_after(limit: float | None) -> float:
    """Silence that earns a waiting line: 2 s, or 5% of the hang limit when longer (a 60 s
    ``hang_timeout`` speaks up after 3 s)."""
    return max(NOTICE_AFTER, NOTICE_FRACTION * limit) if limit else NOTICE_AFTER


class Workers:
    """The workers as the events describe them (see the module docstring)."""

    def __init__(self) -> None:
        self.rows: dict[int, Row] = {}
        self.regrouped: float | None = None  # when the latest generation was announced
        self.members: list[int] | None = None  # the latest generation's slots, by rank
        self.uneven = False  # this generation's shares have moved (Balanced, changed)

    def update(self, event: Event) -> str | None:
        """Take in ``event``; return a line describing a change of a worker's state, if any."""
        if isinstance(event, WorkerState):
            return self._state(event)
        if isinstance(event, WorkersTick):
            for beat in event.beats:
                row = self.rows.setdefault(beat.worker, Row(beat.worker, f"#{beat.worker}"))
                row.phase, row.step, row.since, row.limit = (
                    beat.phase,
                    beat.step,
                    beat.since,
                    beat.limit,
                )
        elif isinstance(event, GenerationStarted):
            self.regrouped = event.time
            self.members, self.uneven = list(event.members), False
            for row in self.rows.values():  # balance starts even in every generation
                row.slow, row.share = False, None
        elif isinstance(event, Balanced):
            self._balanced(event)
        elif isinstance(event, RunStarted) and event.strategy == "threads" and not self.rows:
            for i, device in enumerate(event.devices):
                self.rows[i] = Row(i, device, "training", rank=i, generation=0, since=event.time)
        elif isinstance(event, StepEnded) and not any(r.limit for r in self.rows.values()):
            for row in self.rows.values():  # in-process: every worker is where the step is
                if row.state == "training":
                    row.phase, row.step, row.since = "step", event.global_step - 1, event.time
        return None

    def _balanced(self, e: Balanced) -> None:
        """The shares decided and the members named slow, from ranks to the rows."""
        self.uneven = self.uneven or e.changed
        for row in self.rows.values():
            row.share = None
        for rank, share in enumerate(e.shares):
            member = self.member(rank)
            if member is not None:
                member.share = share
        for rank in e.slow:
            member = self.member(rank)
            if member is not None:
                member.slow = True

    def member(self, rank: int) -> Row | None:
        """The row of the current generation's member ``rank``: its slot in the latest
        ``GenerationStarted``; without one (in-process strategies), the one live row that
        has that rank."""
        if self.members is not None:
            slot = self.members[rank] if 0 <= rank < len(self.members) else None
            return self.rows.get(slot) if slot is not None else None
        found = [r for r in self.rows.values() if r.rank == rank and r.state not in QUIET_STATES]
        return found[0] if len(found) == 1 else None

    def _state(self, e: WorkerState) -> str:
        row = self.rows.setdefault(e.worker, Row(e.worker, e.device))
        row.device, row.state = e.device, e.state
        if e.state in ("starting", "joining"):  # a new process, or a new group: as told
            row.rank, row.generation = e.rank, e.generation
            row.slow, row.share = False, None
        else:
            row.rank = e.rank if e.rank is not None else row.rank
            row.generation = e.generation if e.generation is not None else row.generation
        if e.state in QUIET_STATES:
            row.limit = None
        if e.state in ("starting", "joining"):
            row.since = e.time
        parts = [f"worker {e.worker} ({e.device}): {e.state}"]
        if e.rank is not None and e.state == "training":
            # (its first beat in a step can be read before the word that it joined)
            gen = "" if e.generation is None else f" of generation {e.generation}"
            parts.append(f"as rank {e.rank}{gen}")
        if e.pid is not None:
            parts.append(f"(pid {e.pid})")
        if e.detail:
            parts.append(f"- {e.detail}")
        return " ".join(parts)

    def waiting(self, now: float) -> Waiting | None:
        """The worker the others wait on: when every watched worker (training, with a hang
        limit) has been silent for :func:`notice_after` its limit, the one furthest behind
        (its step, then its phase in :data:`~phalanx.failures.PHASE_ORDER`, as the hang
        verdict judges), silent longest among those: the others are blocked in a collective
        waiting for it, possibly since before it went silent (a fast peer is already in the
        step's backward when a slow one enters its forward and hangs there). Silence counts
        from a new generation's announcement at the earliest: the members it names leave the
        broken step to regroup (their next heartbeat says so), they wait on nobody."""
        watched = [
            r
            for r in self.rows.values()
            if r.state == "training" and r.since is not None and r.limit
        ]
        if not watched:
            return None
        regrouped = self.regrouped if self.regrouped is not None else -math.inf
        if any(now - max(r.since or now, regrouped) < notice_after(r.limit) for r in watched):
            return None
        silent = min(watched, key=lambda r: (r.step or 0, phase_rank(r.phase), r.since or now))
        idle = now - (silent.since or now)
        return Waiting(silent.worker, silent.device, idle, silent.phase, silent.step, silent.limit)

    def table(self, now: float) -> Table:
        """The panel's rows (fits 80 columns: 8 narrow columns, a 9th, ``share``, once this
        generation's shares have moved from even)."""
        table = Table(box=None, padding=(0, 1), show_edge=False, header_style="bold")
        for name in ("worker", "device", "rank", "gen", "state", "phase", "step"):
            table.add_column(name, no_wrap=True)
        table.add_column("idle", justify="right", no_wrap=True)
        if self.uneven:
            table.add_column("share", justify="right", no_wrap=True)
        wait = self.waiting(now)
        for row in sorted(self.rows.values(), key=lambda r: r.worker):
            quiet = row.state in QUIET_STATES or row.since is None
            waits = row.state in ("starting", "joining")  # no step of its own yet
            state = Text(row.state, style=_STATE_STYLE.get(row.state, ""))
            if row.slow and row.state == "training":
                state = Text("slow", "yellow")  # (persistently slower than its peers)
            if wait is not None and row.state == "training" and row.limit:
                # Silent alike, told apart: the one the others wait on makes no progress;
                # the others are healthy, blocked in a collective until it comes.
                stuck = row.worker == wait.worker
                state = Text(*(("no progress", "bold yellow") if stuck else ("waiting", "dim")))
            cells: list[RenderableType] = [
                str(row.worker),
                row.device,
                _opt(row.rank),
                _opt(row.generation),
                state,
                row.phase if not quiet else "",
                str(row.step + 1) if row.step is not None and not (quiet or waits) else "",
                f"{now - (row.since or now):.1f}s" if not quiet else "",
            ]
            if self.uneven:
                cells.append(fmt_share(row.share) if row.share is not None else "")
            table.add_row(*cells)
        return table

    def renderable(self, now: float) -> RenderableType:
        if not self.rows:
            return Text("")
        wait = self.waiting(now)
        parts: list[RenderableType] = [self.table(now)]
        if wait is not None:
            parts.append(Text(wait.text(), style="bold yellow"))
        return Group(*parts)


_STATE_STYLE = {
    "training": "green",
    "fallen": "bold red",
    "replaced": "dim",
    "joining": "cyan",
    "starting": "cyan",
    "preflight": "cyan",
}


def _opt(value: int | None) -> str:
    return "" if value is None else str(value)


class LivePanel:
    """A rich renderable that draws ``workers`` as of ``clock()`` each time it is drawn, so
    the idle seconds count up between events."""

    def __init__(self, workers: Workers, clock: Callable[[], float]) -> None:
        self.workers = workers
        self.clock = clock

    def __rich__(self) -> RenderableType:
        return self.workers.renderable(self.clock())
