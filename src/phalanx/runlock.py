"""One live run per run folder: ``run_dir/phalanx.lock``.

``fit`` takes the lock after its checks and before anything in ``run_dir`` is moved or
written, and releases it when it returns or raises. The lock is ``fcntl.flock`` on that file
(the kernel drops it when the process ends, however it ends); the holder writes its pid, host
and start time into the file, so a second ``fit`` is refused (PX143) with whose it is.

- Released cleanly, the file stays, empty (removing it would let a process that opened the
  old file and one that created a new one both hold "the" lock).
- Free but not empty: its holder ended without releasing it (killed). The lock is taken over
  and :attr:`RunLock.stale` tells the earlier holder, for a notice.
- A file system without ``flock`` (some network file systems): the pid in the file is
  checked instead, which only sees holders on this host (:attr:`RunLock.unlocked` says why).

The lock does not pass to ddp worker processes (they are spawned: file descriptors do not
survive ``exec``); a process forked while it is held (a DataLoader worker) shares it until
it exits.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from phalanx.errors import RunDirLockedError

LOCK_FILE = "phalanx.lock"


@dataclass(frozen=True)
class Holder:
    """Who holds (or held) a run folder's lock, as written in its lock file."""

    pid: int
    host: str
    started: float = 0.0
    command: str = ""

    @classmethod
    def me(cls) -> Holder:
        return cls(os.getpid(), socket.gethostname(), time.time(), " ".join(sys.argv)[:200])

    @classmethod
    def read(cls, text: str) -> Holder | None:
        try:
            doc = json.loads(text)
            started, command = float(doc.get("started", 0.0)), str(doc.get("command", ""))
            return cls(int(doc["pid"]), str(doc["host"]), started, command)
        except (ValueError, KeyError, TypeError):
            return None

    def text(self) -> str:
        return json.dumps(self.__dict__) + "\n"

    def here(self) -> bool:
        return self.host == socket.gethostname()

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.started))
        command = f", {self.command!r}" if self.command else ""
        return f"pid {self.pid} on host {self.host} (since {when}{command})"


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid runs on this host (a zombie counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    with contextlib.suppress(OSError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat[stat.rindex(")") + 2] != "Z"
    return True


class RunLock:
    """The held lock of one run folder; :meth:`release` (or ``with``) gives it back."""

    def __init__(self, path: Path, fd: int, stale: Holder | None, unlocked: str = "") -> None:
        self.path = path
        self._fd: int | None = fd
        self.stale = stale  # an earlier holder that ended without releasing it
        self.unlocked = unlocked  # why only the pid protects this folder ("" with flock)

    @classmethod
    def acquire(cls, run_dir: str | Path) -> RunLock:
        """Hold ``run_dir``'s lock (creating the folder and the file), or raise
        RunDirLockedError (PX143) naming the live holder; nothing else is touched."""
        folder = Path(run_dir)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            unlocked = _flock(fd)
            earlier = Holder.read(_read(fd))
            if unlocked and earlier and earlier.here() and pid_alive(earlier.pid):
                raise BlockingIOError  # no flock here: a live pid on this host holds it
            _write(fd, Holder.me().text())
        except BlockingIOError:
            holder = Holder.read(_read(fd))
            os.close(fd)
            raise RunDirLockedError(_held_message(folder, holder)) from None
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, stale=earlier, unlocked=unlocked)

    def release(self) -> None:
        """Empty the file and unlock it; a second call does nothing."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
        except OSError:
            pass  # an unlocked file system, or a folder removed under the run
        finally:
            os.close(fd)

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def notice(self) -> str | None:
        """What the user should hear about this lock, or None."""
        if self.stale is not None:
            return (
                f"run_dir lock {self.path}: took over the stale lock of "
                f"{self.stale.describe()}, which ended without releasing it (killed?)"
            )
        if self.unlocked:
            return (
                f"run_dir lock {self.path}: {self.unlocked}; only a run on this host is seen "
                "(by its pid): do not start two runs in this run_dir from different hosts"
            )
        return None


def _flock(fd: int) -> str:
    """Lock ``fd`` exclusively without waiting: "" when locked, the reason when the file
    system cannot lock; BlockingIOError when another open file holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            raise BlockingIOError from None
        return f"this file system cannot lock files ({os.strerror(exc.errno or 0)})"
    return ""


def _read(fd: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    return os.read(fd, 4096).decode(errors="replace")


def _write(fd: int, text: str) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, text.encode(), 0)


def _held_message(folder: Path, holder: Holder | None) -> str:
    who = holder.describe() if holder else "another process (its lock file names no holder yet)"
    gone = ""
    if holder is not None and holder.here() and not pid_alive(holder.pid):
        gone = (
            f" (pid {holder.pid} has ended, but a process it started still holds the lock: "
            f"end that one first, e.g. a DataLoader worker shown by `fuser {folder / LOCK_FILE}`)"
        )
    return (
        f"run_dir {str(folder)!r} is in use by a live run: {who}{gone}. Two runs in one "
        "folder would overwrite each other's checkpoints and files. Wait for that run to end "
        "(or stop it: Ctrl-C, or kill its pid), or pass another run_dir"
    )
