"""A sink for tests that keeps every event it is handed (sinks run in the calling process,
under ddp too: the supervisor relays the main worker's events)."""

from __future__ import annotations

from typing import Any

from phalanx.events import Event


class Recorder:
    def __init__(self) -> None:
        self.events: list[Event] = []
        self.closed = False

    def handle(self, event: Event) -> None:
        self.events.append(event)

    def close(self) -> None:
        self.closed = True

    def of(self, kind: type) -> list[Any]:
        """The events of one type, in the order they came."""
        return [e for e in self.events if isinstance(e, kind)]
