"""JSONL event log: one JSON object per line, one line per event.

Every line is flushed as it is written, so a run that crashes keeps every event up to the
crash. The file is opened in append mode: a resumed run adds to the same log (a fresh run
finds none: :mod:`phalanx.runinfo` moves an earlier run's files aside). Once a
``RunOpened`` event has named the run, every line carries its id as ``"run"``, so the
sessions of a resumed run can be told apart from anything else in the file. Heartbeats
(``WorkersTick``) are for live displays only and are not written.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import IO, Any

from phalanx.events import Event, RunOpened, WorkersTick, to_record


def json_safe(value: Any) -> Any:
    """``value`` with non-finite floats as the strings ``"NaN"``, ``"Infinity"``,
    ``"-Infinity"`` (strict JSON has no such numbers), tuples and sets as lists, and any
    other non-JSON type as its ``str``."""
    if isinstance(value, float):
        if math.isnan(value):
            return "NaN"
        if math.isinf(value):
            return "Infinity" if value > 0 else "-Infinity"
        return value
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [json_safe(v) for v in value]
    return str(value)


class JsonlSink:
    """Appends ``events.to_record(event)`` as one line of strict JSON per event.

    The parent folder is created if missing. After :meth:`close`, a further event reopens
    the file (append), so nothing is ever silently dropped.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._file: IO[str] | None = None
        self.run_id: str | None = None

    def handle(self, event: Event) -> None:
        if isinstance(event, WorkersTick):
            return
        if isinstance(event, RunOpened):
            self.run_id = event.run_id
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", encoding="utf-8", buffering=1)
        record = to_record(event)
        if self.run_id is not None:
            record["run"] = self.run_id
        line = json.dumps(json_safe(record), allow_nan=False)
        self._file.write(line + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
