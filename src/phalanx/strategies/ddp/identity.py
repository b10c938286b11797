"""How a ddp worker tells itself apart, to user code and to ``ps``.

The environment variables torchrun sets (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), so user code that reads them works;
set again for each generation the worker joins, since a shrink or a respawn can change its
rank and the world size. All workers run on one host, so the local rank is the rank.
``MASTER_ADDR``/``MASTER_PORT`` name the supervisor's store (the generation's process group
lives under its own prefix there: user code should not build another group on it).

The process title: ``phalanx worker rank R/W cpu:1 (slot S, generation G)`` (``starting``
before the first generation) through
``setproctitle`` when it is installed (``pip install 'phalanx[proctitle]'``: ``ps aux`` and
``top`` show it), else the thread name the kernel keeps in ``/proc/<pid>/comm`` (``ps -e``,
``top``, ``htop``), 15 bytes at most: ``px r1 cpu:1``, set with ``prctl(PR_SET_NAME)``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys

PR_SET_NAME = 15  # from <linux/prctl.h>


def announce(rank: int, world: int, device: str, slot: int, generation: int, port: int) -> None:
    """Set this worker's torchrun-style environment and its process title."""
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    where = f"generation {generation}" if generation >= 0 else "starting"
    title = f"phalanx worker rank {rank}/{world} {device} (slot {slot}, {where})"
    set_title(title, short=f"px r{rank} {device}")


def set_title(title: str, short: str) -> None:
    """``title`` through setproctitle if installed, else ``short`` as the kernel's name of
    this (main) thread on Linux; nowhere else (a title is a convenience, never an error)."""
    try:
        import setproctitle
    except ImportError:
        setproctitle = None
    if setproctitle is not None:
        setproctitle.setproctitle(title)
        return
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_NAME, short.encode()[:15], 0, 0, 0)
