"""The run folder tells one run: ``run_dir/run.json`` names it, and a fresh run moves an
earlier run's files aside.

:func:`open_run` is called by ``fit`` in the caller's process once every argument is valid
and before any sink opens a file:

- a fresh run (``resume=False``) gets a new id (``YYYYMMDD-HHMMSS-xxxx``). An earlier run's
  artefacts in the folder (:data:`ARTEFACTS`) move to ``run_dir/earlier/<its id>/``, so
  nothing of it is mixed into the new run's files or left looking current (a ``failures.json``
  of an earlier run, an ``events.jsonl`` appended across runs);
- a resumed run keeps the id in ``run.json`` (a new id if there is none) and adds a session
  (``sessions``: the start time of each process that trained it); its files go on.

``run.json`` holds the id, the configuration, the versions (phalanx, torch, python), the host
and the start time; :class:`~phalanx.sinks.runfile.RunFileSink` adds how the run ended.
Fields are listed in docs/artefacts.md.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import secrets
import shutil
import socket
import time
from pathlib import Path
from typing import Any

from phalanx.events import RunOpened
from phalanx.sinks.jsonl import json_safe
from phalanx.version import __version__

RUN_FILE = "run.json"
EARLIER = "earlier"
# What a run writes into its folder (checkpoints/ is fit's own: PX118 keeps runs apart there).
ARTEFACTS = (
    RUN_FILE,
    "events.jsonl",
    "metrics.csv",
    "steps.csv",
    "failures.json",
    "ledger.json",
    "run.png",
    "model.pt",  # the final weights of a finished run
)


def new_run_id(now: float | None = None) -> str:
    """``20261203-181502-3fa9``: the start time (UTC) and 4 random hex digits."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(now if now is not None else time.time()))
    return f"{stamp}-{secrets.token_hex(2)}"


def read_run(run_dir: str | Path) -> dict[str, Any] | None:
    """The folder's ``run.json``, or None when it has none (or an unreadable one)."""
    path = Path(run_dir) / RUN_FILE
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def write_run(run_dir: str | Path, doc: dict[str, Any]) -> None:
    """Write ``run.json`` atomically."""
    path = Path(run_dir) / RUN_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(json_safe(doc), indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def move_aside(run_dir: str | Path, with_checkpoints: bool = False) -> Path | None:
    """Move an earlier run's artefacts (and its ``checkpoints/`` when ``with_checkpoints``)
    to ``earlier/<its id>/`` (the id from its ``run.json``, else the newest file's time);
    return where, or None when there was nothing to move."""
    folder = Path(run_dir)
    found = [folder / name for name in ARTEFACTS if (folder / name).is_file()]
    checkpoints = folder / "checkpoints"
    if with_checkpoints and checkpoints.is_dir() and any(checkpoints.iterdir()):
        found.append(checkpoints)
    if not found:
        return None
    earlier = read_run(folder) or {}
    old_id = str(earlier.get("run_id") or "")
    if not old_id:
        newest = max(p.stat().st_mtime for p in found)  # a folder's: its last change
        old_id = "before-" + time.strftime("%Y%m%d-%H%M%S", time.gmtime(newest))
    target = folder / EARLIER / old_id
    while target.exists():
        target = target.with_name(target.name + "-x")
    target.mkdir(parents=True)
    for path in found:
        shutil.move(str(path), str(target / path.name))
    return target


def start_over(run_dir: str | os.PathLike[str]) -> Path | None:
    """Make ``run_dir`` ready for a fresh run (``fit`` refuses one among an earlier run's
    checkpoints, PX118): the earlier run's files and its ``checkpoints/`` move to
    ``run_dir/earlier/<its run id>/``; nothing is deleted. Return where they went (None: the
    folder held no run). Done while holding the folder's lock, so a live run's files are
    never moved: that raises ``RunDirLockedError`` (PX143) and leaves them as they are."""
    from phalanx.runlock import RunLock  # (runlock is imported by fit only)

    if not os.path.isdir(run_dir):
        return None
    with RunLock.acquire(os.fspath(run_dir)):
        return move_aside(os.fspath(run_dir), with_checkpoints=True)


def versions() -> dict[str, str]:
    import torch

    return {"phalanx": __version__, "torch": torch.__version__, "python": platform.python_version()}


def config_record(config: Any) -> dict[str, Any]:
    """The run's settings as JSON-friendly values (durations as text)."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        record = dataclasses.asdict(config)
    else:
        record = dict(config)
    safe = json_safe(record)
    assert isinstance(safe, dict)
    return safe


def open_run(
    run_dir: str, config: Any, resume: bool, now: float | None = None
) -> tuple[RunOpened, Path | None]:
    """Name the run in ``run_dir`` (see the module docstring); return the event that tells
    the sinks, and where an earlier run's files went (None: nothing was moved)."""
    now = time.time() if now is None else now
    folder = Path(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    earlier = read_run(folder) if resume else None
    moved = None if resume else move_aside(folder)
    if earlier and earlier.get("run_id"):
        doc = earlier
        doc.setdefault("sessions", []).append(now)
        doc["ended"] = None
    else:
        doc = {
            "run_id": new_run_id(now),
            "started": now,
            "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
            "sessions": [now],
        }
    doc.update(
        {
            "versions": versions(),
            "host": socket.gethostname(),
            "config": config_record(config),
        }
    )
    write_run(folder, doc)
    event = RunOpened(
        str(doc["run_id"]), str(folder), session=len(doc["sessions"]), resumed=resume, time=now
    )
    return event, moved
