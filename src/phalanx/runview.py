"""``phalanx report RUN_DIR``: the end of a run as it was printed live, from its files.

The run's events (``events.jsonl``, the lines of the run ``run.json`` names) are replayed
into a :class:`~phalanx.sinks.SummarySink`, so the summary table, the failures and
recoveries, the world size, each respawn's fate, the balance (the last shares, the members
named slow: rank, worker and device, how much slower than their peers) and where the files
are read exactly as at the end of the live run. Failures take their ``recovery_seconds``
from ``run.json`` (known only after the event was logged). A run whose log has no
``RunEnded`` (still running, or its process was killed) is told as such, with what it had
done so far.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from phalanx.events import RunEnded, WorkerFailed, from_record
from phalanx.failures import WorkerFailure, headline
from phalanx.plot import read_events
from phalanx.runinfo import read_run
from phalanx.sinks.summary import SummarySink


def header(run: dict[str, Any]) -> str:
    """``Run <id>, started <UTC>: strategy, devices, epochs, batch; versions``."""
    config = run.get("config") or {}
    versions = run.get("versions") or {}
    started = run.get("started")
    when = (
        time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(started)))
        if started is not None
        else "?"
    )
    sessions = len(run.get("sessions") or [])
    parts = [
        f"Run {run.get('run_id', '?')}, started {when}"
        + (f" ({sessions} sessions: resumed)" if sessions > 1 else ""),
        f"strategy {config.get('strategy', '?')} on {', '.join(config.get('devices') or [])}, "
        f"{config.get('epochs', '?')} epoch(s), global batch {config.get('batch_size', '?')}",
        ", ".join(f"{k} {v}" for k, v in versions.items()),
    ]
    return "\n".join(parts)


def report_run(run_dir: str | Path, console: Console) -> int:
    """Print the run's summary; 0, or 1 when the folder holds no run."""
    folder = Path(run_dir)
    run = read_run(folder)
    records = read_events(folder)
    if run is None and not records:
        console.print(f"phalanx report: no run in {folder} (no run.json, no events.jsonl)")
        return 1
    if run is not None:
        console.print(header(run), highlight=False)
    if not records:  # (fit(sinks=[...]) without the event log: run.json is all there is)
        console.print(
            f"{folder} has no events.jsonl (the run replaced the default sinks without a "
            "JsonlSink): its summary is in run.json, failures.json and quarantine.json.",
            highlight=False,
        )
        _root_cause(folder, run, console)
        return 0
    recovered = [f.get("recovery_seconds") for f in (run or {}).get("failures") or []]
    sink = SummarySink(console, timestamps=False)  # a replay, not a log
    failures = 0
    ended = False
    for record in records:
        event = from_record(record)
        if event is None:
            continue
        if isinstance(event, WorkerFailed):
            if failures < len(recovered) and event.failure.recovery_seconds is None:
                event.failure.recovery_seconds = recovered[failures]
            failures += 1
        ended = ended or isinstance(event, RunEnded)
        sink.handle(event)
    if not ended:
        story = sink.story
        last = float(records[-1].get("time", 0.0)) - float(records[0].get("time", 0.0))
        why = "no end in its log: still running, or its process was killed"
        sink.handle(RunEnded([], story.committed, story.epochs_done, why, last))
    _root_cause(folder, run, console)
    return 0


def _root_cause(folder: Path, run: dict[str, Any] | None, console: Console) -> None:
    """A failed run: the first line of its report (from ``failures.json``)."""
    if (run or {}).get("outcome") != "failed":
        return
    try:
        doc = json.loads((folder / "failures.json").read_text(encoding="utf-8"))
        root = WorkerFailure(**doc["root_cause"])
    except (OSError, ValueError, KeyError, TypeError):
        return
    console.print(f"Root cause: {headline(root)}", highlight=False, style="bold red")
