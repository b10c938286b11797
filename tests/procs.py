"""Processes seen through /proc (psutil is not a dependency): what the no-process-left-behind
checks and the supervisor-kill tests look at."""

from __future__ import annotations

import os
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parent


def children(pid: int) -> dict[int, str]:
    """The direct children of ``pid`` (scanning /proc: psutil is not a dependency), as
    {pid: state letter}; a zombie ("Z") has exited but was not reaped."""
    found: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        info = proc_stat(int(entry))
        if info is not None and info[1] == pid:
            found[int(entry)] = info[0]
    return found


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, ppid) of ``pid``, or None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # the name may contain spaces
    return fields[0], int(fields[1])


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def is_resource_tracker(pid: int) -> bool:
    """multiprocessing's resource tracker: started once per process by the first spawn and
    kept for the process's lifetime by design (not a leaked worker)."""
    return "resource_tracker" in cmdline(pid)


def is_forkserver(pid: int) -> bool:
    """multiprocessing's fork server: phalanx's workers are forked by it (started with the
    first worker and kept for the process's lifetime by design, like the resource tracker)."""
    return "forkserver" in cmdline(pid)


def started_by(pid: int) -> dict[int, str]:
    """The processes ``pid`` started and that are not its lifetime helpers: its direct
    children but the resource tracker and the fork server, and the fork server's children
    (the workers it forked for ``pid``), as {pid: state letter}."""
    found: dict[int, str] = {}
    for child, state in children(pid).items():
        if is_forkserver(child):
            found.update(children(child))
        elif not is_resource_tracker(child):
            found[child] = state
    return found


def workers_of(pid: int) -> list[int]:
    """The live (not zombie) worker processes under a supervisor process ``pid``."""
    return [p for p, state in started_by(pid).items() if state != "Z"]


def alive(pid: int) -> bool:
    info = proc_stat(pid)
    return info is not None and info[0] != "Z"


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS_DIR), env.get("PYTHONPATH", "")) if p)
    return env


def started_in_test(test: str) -> list[int]:
    """Live processes (not zombies) whose environment says they were started while ``test``
    ran (pytest's ``PYTEST_CURRENT_TEST``, inherited by every descendant, orphans too), other
    than this one and its lifetime helpers (phalanx's fork server: the one that preloads the
    worker module; the resource tracker)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        line = cmdline(int(entry))
        if "phalanx.strategies.ddp.worker.worker" in line and "forkserver" in line:
            continue
        if is_resource_tracker(int(entry)):
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        info = proc_stat(int(entry))
        if (
            info is not None
            and info[0] != "Z"
            and f"PYTEST_CURRENT_TEST={test}".encode() in environ
        ):
            found.append(int(entry))
    return found
