"""The head's fencing term, kept in the shared ``run_dir`` (``head.json``): which node leads
the run, and since which term. A head takes a term once, when it starts (the first head)
or takes over (a successor); a head whose term is older than the one in the file was
replaced and must commit nothing more (:class:`Fence`, read before each generation the
head announces and once a second). Writes are serialised by ``flock`` on ``head.lock``
and the file is replaced atomically, so two successors can never hold one term."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass

from phalanx.strategies.ddp.coordinator.nodeplan import fenced

HEAD_FILE = "head.json"
LOCK_FILE = "head.lock"


@dataclass(frozen=True)
class Term:
    """A head's term as ``head.json`` holds it."""

    term: int
    node: int  # its node rank when it took the term
    host: str
    port: int  # its node port
    pid: int
    since: float  # wall-clock time it took the term

    def describe(self) -> str:
        return f"node {self.node} ({self.host}:{self.port}, pid {self.pid}), term {self.term}"


def read_term(run_dir: str) -> Term | None:
    """The term in ``run_dir`` (None: none, or a file this version cannot read)."""
    try:
        with open(os.path.join(run_dir, HEAD_FILE), encoding="utf-8") as fh:
            doc = json.load(fh)
        return Term(
            int(doc["term"]),
            int(doc["node"]),
            str(doc["host"]),
            int(doc["port"]),
            int(doc["pid"]),
            float(doc["since"]),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


@contextlib.contextmanager
def _locked(run_dir: str) -> Iterator[None]:
    os.makedirs(run_dir, exist_ok=True)
    fd = os.open(os.path.join(run_dir, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # (releases the lock)


def claim(run_dir: str, node: int, host: str, port: int) -> Term:
    """Take the next term for this process (node ``node`` listening on ``host:port``):
    one more than the file's (1 when there is none), written before any store opens."""
    with _locked(run_dir):
        old = read_term(run_dir)
        term = Term((old.term if old else 0) + 1, node, host, port, os.getpid(), time.time())
        path = os.path.join(run_dir, HEAD_FILE)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(asdict(term), fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    return term


class Fence:
    """A head's check that it still leads: :meth:`replaced` reads ``head.json`` (at most
    once per ``every`` seconds unless ``now``) and returns the newer term that replaced
    this head, if any."""

    def __init__(self, run_dir: str, term: Term, every: float) -> None:
        self.run_dir, self.term, self.every = run_dir, term, every
        self.read_at = time.monotonic()

    def replaced(self, now: bool = False) -> Term | None:
        if not now and time.monotonic() - self.read_at < self.every:
            return None
        self.read_at = time.monotonic()
        current = read_term(self.run_dir)
        if current is not None and fenced(self.term.term, current.term):
            return current
        return None


def replaced_since(run_dir: str, term: int) -> str | None:
    """Why a writer of head term ``term`` may no longer write in ``run_dir`` (a newer head
    leads), or None: a worker's checkpoint guard."""
    current = read_term(run_dir)
    if current is None or not fenced(term, current.term):
        return None
    return (
        f"not written: {current.describe()} leads the run now (this worker's head had term {term})"
    )
