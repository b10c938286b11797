"""Events for the live worker panel (issue 13): a worker's state once per change, and
every live worker's heartbeat a few times a second. Pure: the coordinator calls these at
the places a slot's state or a worker's progress changes and emits what they return."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Protocol

from phalanx.events import Beat, WorkerState, WorkersTick

# What a worker's phase shows as (other phases: training).
PANEL_STATES = {"start": "starting", "preflight": "preflight", "regroup": "joining"}
IDLE_PHASES = ("start", "regroup", "joining")  # bounded by their own timeouts, not hangs
BEFORE_TRAINING = ("starting", "preflight", "joining")  # panel states a Joined ends


class Shown(Protocol):
    step: int
    phase: str
    progress_at: float
    generation: int
    pid: int | None

    @property
    def ended(self) -> bool: ...


@dataclass
class Panel:
    devices: list[str]
    every: timedelta  # between two WorkersTick events (Timing.panel_tick)
    shown: dict[int, str] = field(default_factory=dict)  # each slot's last state shown
    ticked: float = float("-inf")

    def show(
        self,
        slot: int,
        state: str,
        rec: Shown,
        rank: int | None,
        detail: str = "",
        beat: bool = False,
    ) -> WorkerState | None:
        """``slot``'s worker is now in ``state`` (None: nothing new to show). ``beat``: told
        by a heartbeat, which the agent hands over before the messages read with it, so a
        step's beat can come before the ``Joined`` written ahead of it: a worker starting or
        joining is shown training by its ``Joined`` only, with the generation it joined."""
        if self.shown.get(slot) == state:
            return None
        if beat and state == "training" and self.shown.get(slot) in BEFORE_TRAINING:
            return None
        if state not in ("fallen", "replaced", "finished") and rec.ended:
            return None  # a fallen worker's last words do not revive its row
        self.shown[slot] = state
        generation = rec.generation if rec.generation >= 0 else None
        device = self.devices[slot]
        return WorkerState(slot, device, state, rank, generation, rec.pid, detail)

    def tick(
        self,
        mono: float,
        wall: float,
        slots: dict[int, Shown],
        members: list[int],
        limit: Callable[[Shown], float],
    ) -> WorkersTick | None:
        """Every live worker's heartbeat, once ``every`` (``since`` on the wall clock)."""
        if mono - self.ticked < self.every.total_seconds():
            return None
        self.ticked = mono
        beats = [
            Beat(
                slot,
                s.phase,
                s.step,
                wall - (mono - s.progress_at),
                None if s.phase in IDLE_PHASES or slot not in members else limit(s),
            )
            for slot, s in slots.items()
            if not s.ended
        ]
        return WorkersTick(beats)
