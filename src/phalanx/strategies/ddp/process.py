"""A process seen through a pidfd (Linux): the very process, even when its pid is reused
once it is gone, and even when it is not this process's child (workers are forked by the
fork server, not by their agent). Where pidfds are missing, the pid itself is asked."""

from __future__ import annotations

import os
import select


def pidfd_of(pid: int | None) -> int | None:
    """A pidfd of ``pid``, or None (no pidfd here, or the process is gone already)."""
    if pid is None:
        return None
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def exited(fd: int) -> bool:
    """Whether the process of pidfd ``fd`` has exited (its pidfd is readable then)."""
    readable, _, _ = select.select([fd], [], [], 0)
    return bool(readable)


class Lifeline:
    """Whether the agent that started a worker still lives. A worker's parent is the fork
    server, so its parent says nothing of the agent."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.fd = pidfd_of(pid)
        self.gone = self.fd is None and not _exists(pid)

    def alive(self) -> bool:
        if not self.gone:
            self.gone = exited(self.fd) if self.fd is not None else not _exists(self.pid)
        return not self.gone


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
