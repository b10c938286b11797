"""How a ddp worker tells itself apart, to user code and to ``ps``.

The environment variables torchrun sets (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), so user code that reads them works;
set again for each generation the worker joins, since a shrink or a respawn can change its
rank and the world size. ``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` count the members on this
machine (in rank order), as torchrun counts its workers on a node: on one host the local
rank is the rank; across nodes, node 1's first worker has ``LOCAL_RANK=0``, so
``torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))`` picks this node's device.
``MASTER_ADDR``/``MASTER_PORT`` name the supervisor's store (the head's, across machines; the
generation's process group lives under its own prefix there: user code should not build
another group on it).

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
from collections.abc import Sequence

PR_SET_NAME = 15  # from <linux/prctl.h>


def torchrun_env(
    slot: int, members: Sequence[int], here: Sequence[int], host: str, port: int
) -> dict[str, str]:
    """The variables torchrun would give worker ``slot`` among ``members`` (slots in rank
    order), ``here`` being the slots this machine runs and ``host:port`` the store."""
    local = [m for m in members if m in here]
    return {
        "RANK": str(list(members).index(slot)),
        "LOCAL_RANK": str(local.index(slot)),
        "WORLD_SIZE": str(len(members)),
        "LOCAL_WORLD_SIZE": str(len(local)),
        "MASTER_ADDR": host,
        "MASTER_PORT": str(port),
    }


def announce(
    members: Sequence[int],
    here: Sequence[int],
    device: str,
    slot: int,
    generation: int,
    store: tuple[str, int],
) -> None:
    """Set this worker's torchrun-style environment and its process title."""
    env = torchrun_env(slot, members, here, *store)
    os.environ.update(env)
    rank, world = int(env["RANK"]), len(members)
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
