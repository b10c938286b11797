"""Turning failures into one report: :class:`~phalanx.errors.TrainingFailed` and
``run_dir/failures.json``.

The root cause is the first *primary* failure: secondary errors of survivors (a peer's
socket closed: ``Connection reset by peer``, a collective aborted) are kept in ``failures``
but never named as the cause while a primary failure exists.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import socket
from typing import Any

import torch

from phalanx.errors import InvalidStepError, TrainingFailed
from phalanx.failures import NO_SHARD_SET, WorkerFailure, bad_sample_errors, headline, one_line
from phalanx.policy import MAX_ATTEMPTS, keeps_failing

# What a survivor's collective says when a peer fell (gloo's socket errors name its source
# files; NCCL reports an aborted communicator or a remote process gone). Specific phrases
# only: a user's own error that mentions a "peer" is still the user's.
SECONDARY_MARKERS = (
    "connection reset by peer",
    "connection closed by peer",
    "broken pipe",
    "/gloo/",
    "gloo/transport",
    "nccl communicator was aborted",
    "remote process exited",
    "socket timeout",
    "has been shut down",
    "collective abandoned",  # (group.ABANDONED: a newer generation left a peer out)
    # torch's distributed errors by name, where only their text came through (group.Failure)
    "distbackenderror:",
    "distnetworkerror:",
)
SECONDARY_TYPES = ("DistBackendError", "DistNetworkError", "DistStoreError")

KIND_CODES = {"exception": "PX200", "crash": "PX201", "hang": "PX202", "oom": "PX203"}


def is_secondary(f: WorkerFailure) -> bool:
    """A survivor's error caused by another worker's failure (not a cause of its own). Under
    fsdp a new generation's member that finds no complete set of shard snapshots
    (``NoShardSet``) says the state a lost member held is gone: the loss is the cause."""
    if f.exception_type == NO_SHARD_SET:
        return True
    if f.kind != "exception" or f.phase not in ("sync", "backward", "forward", "preflight"):
        return False
    if f.exception_type in SECONDARY_TYPES:
        return True
    text = f.message.lower()
    return any(marker in text for marker in SECONDARY_MARKERS)


def root_cause(failures: list[WorkerFailure], poison: bool = False) -> WorkerFailure:
    """The failure that stopped the run: the earliest primary one among those the run did
    not recover from (failures it retried, shrank or respawned past are context). For a
    poison batch, the first failure of the step that failed again; for a step that keeps
    failing, that step's first failure."""
    primary = [f for f in failures if not is_secondary(f)] or failures
    stuck = None if poison else keeps_failing(primary)
    if stuck is not None:
        return min((f for f in primary if f.step == stuck), key=lambda f: f.time)
    fatal = [f for f in primary if f.action == "aborted"] or primary
    if not poison:  # a broken step contract is why an attempt stopped the run at once
        fatal = [f for f in fatal if f.breaks_step_contract] or fatal
    if poison:
        last = max(fatal, key=lambda f: f.time)
        fatal = [f for f in primary if f.step == last.step]
    return min(fatal, key=lambda f: f.time)


def code_for(root: WorkerFailure, poison: bool, keeps: bool = False) -> str:
    """A phalanx error raised inside a step (a NaN loss, a non-scalar loss) keeps its own
    code; otherwise the code says the failure's kind."""
    from phalanx.errors import all_error_classes

    own = {cls.__name__: cls.code for cls in all_error_classes()}
    if root.exception_type in own and root.exception_type != "TrainingFailed":
        return own[root.exception_type]
    if root.phase == "preflight":
        return "PX205"
    if keeps:
        return "PX206"
    if poison and root.kind in ("exception", "crash", "hang"):
        return "PX204"
    return KIND_CODES.get(root.kind, "PX200")


def build(
    failures: list[WorkerFailure], poison: bool = False, notes: tuple[str, ...] = ()
) -> TrainingFailed:
    """One :class:`TrainingFailed` whose first line names the root cause; ``notes`` are
    lines on what would have let the run go on."""
    from phalanx.catalog import lookup

    root = root_cause(failures, poison)
    stuck = None if poison else keeps_failing([f for f in failures if not is_secondary(f)])
    code = code_for(root, poison, keeps=stuck is not None and root.step == stuck)
    lines = [headline(root)]
    if poison:
        lines.append(
            f"The same step failed the same way in its attempts: a poison batch "
            f"(samples {_short(root.sample_indices)} on worker {root.worker})."
        )
        lines += _alone(root, failures)
    elif code == "PX206" and stuck is not None:
        lines.append(
            f"Step {stuck + 1} failed in all {MAX_ATTEMPTS} attempts, each differently (no failure "
            "repeated on the same samples: not a poison batch); its failures are listed below."
        )
    lines += list(notes)
    if root.exit_code is not None or root.signal is not None:
        lines.append(f"exit code {root.exit_code}, signal {root.signal}")
    if root.traceback:
        lines += ["", "Traceback of the failed worker:", root.traceback.rstrip()]
    if root.stacks:
        whose = "hung worker" if root.kind == "hang" else "worker when it crashed"
        lines += ["", f"Stacks of the {whose}:", root.stacks.rstrip()]
    others = [f for f in failures if f is not root]
    if others:
        lines += ["", f"{len(others)} other failure(s) in this run:"]
        lines += [f"  - {headline(f)}" + (f" [{f.action}]" if f.action else "") for f in others]
    entry = lookup(code)
    lines += ["", f"What to try ({code}: {entry.title}):"]
    lines += [f"  - {fix}" for fix in entry.fixes[:3]]
    cls = InvalidStepError if root.breaks_step_contract else TrainingFailed
    return cls("\n".join(lines), root, failures, code)


def write_json(
    run_dir: str | None,
    failures: list[WorkerFailure],
    root: WorkerFailure | None,
    devices: list[str],
    respawns: list[str] | None = None,
) -> str | None:
    """``run_dir/failures.json``: every failure, the root cause, what became of each
    respawned worker and the environment."""
    if not run_dir:
        return None
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, "failures.json")
    doc = {
        "root_cause": root.to_dict() if root else None,
        "failures": [f.to_dict() for f in failures],
        "respawns": respawns or [],
        "environment": environment(devices, failures),
    }
    tmp = path + ".tmp"
    try:
        with open(tmp, "w") as fh:
            json.dump(doc, fh, indent=2, default=str)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):  # (no half-written file left behind)
            os.remove(tmp)
        raise
    return path


def environment(devices: list[str], failures: list[WorkerFailure]) -> dict[str, Any]:
    nccl = None
    if torch.cuda.is_available():
        try:
            nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
        except Exception:
            nccl = None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": nccl,
        "platform": platform.platform(),
        "hosts": sorted({socket.gethostname(), *(f.host for f in failures)}),
        "devices": devices,
    }


def _alone(root: WorkerFailure, failures: list[WorkerFailure]) -> list[str]:
    """The samples of the poison batch that failed alone (dataset indices), found when the
    retry of its step bisected the failing part."""
    bad = bad_sample_errors([f for f in failures if f.step == root.step])
    if not bad:
        return []
    found = ", ".join(f"{i} ({one_line(e)})" for i, e in sorted(bad.items()))
    return [
        f"Sample(s) that fail alone: {found}. fit(on_bad_sample='skip') would leave them out "
        "and go on."
    ]


def _short(items: list[int] | None, limit: int = 16) -> str:
    if not items:
        return "none"
    text = ", ".join(str(i) for i in items[:limit])
    return f"[{text}{', ...' if len(items) > limit else ''}]"
