"""The process group of one fsdp generation: torch's default group, and a device mesh on it.

FSDP2 (``fully_shard``) shards over a ``DeviceMesh``, and a mesh needs torch's default
process group (a mesh made from a group of phalanx's own fails: docs/studies/fsdp, §1). So
an fsdp generation, unlike a ddp one, makes the default group with ``init_process_group`` on
its own store prefix (``g<n>/``) and destroys it when it ends: one generation at a time in a
worker, the only torch global phalanx sets. Every collective of the generation (FSDP2's
all-gathers and reduce-scatters, the vote's box, the clipping norm, buffers, validation
sums) runs on it.

gloo has no abort (its ``abort()`` does nothing), and the sockets of a group stay open while
anything refers to it (torch keeps the first one until the process exits). So a member that
breaks the group (an exception in the middle of forward, where its peers wait in an
all-gather) or a peer that is silent (frozen, cut off) would keep the others blocked until
the group's timeout. :meth:`FsdpGroup.abort` shuts this process's own connections of the
group instead (each TCP socket the group opened, never its listener, the store's or anything
else): every collective of the group then fails at once, here and at each peer (measured:
0.01 s; the study's §11). The next generation's group is new sockets.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from phalanx.strategies.ddp.worker.group import GenerationGroup, broken_on_error


@dataclass
class Sockets:
    """This process's sockets opened between two readings (by fd, with the kernel's name of
    each, so a number reused since is never touched)."""

    opened: dict[int, str] = field(default_factory=dict)

    @staticmethod
    def now() -> dict[int, str]:
        found: dict[int, str] = {}
        with contextlib.suppress(OSError):
            for name in os.listdir("/proc/self/fd"):
                with contextlib.suppress(OSError):
                    link = os.readlink(f"/proc/self/fd/{name}")
                    if link.startswith("socket:"):
                        found[int(name)] = link
        return found

    @classmethod
    def since(cls, before: dict[int, str]) -> Sockets:
        return cls({fd: link for fd, link in cls.now().items() if before.get(fd) != link})

    def shut(self, spare_port: int) -> int:
        """Shut down each still-open TCP connection among them (not a listener, and not one
        to ``spare_port``: the store's); how many."""
        shut = 0
        for fd, link in self.opened.items():
            try:
                if os.readlink(f"/proc/self/fd/{fd}") != link:
                    continue
                sock = socket.socket(fileno=os.dup(fd))
            except OSError:
                continue
            try:
                if sock.family in (socket.AF_INET, socket.AF_INET6):
                    peer = sock.getpeername()  # (a listener has none: OSError)
                    if peer[1] != spare_port:
                        sock.shutdown(socket.SHUT_RDWR)
                        shut += 1
            except OSError:
                pass
            finally:
                sock.close()
        return shut


class FsdpGroup(GenerationGroup):
    """A generation's default group and its 1-D mesh of ``size`` members."""

    def __init__(
        self,
        pg: dist.ProcessGroup,
        rank: int,
        size: int,
        device: torch.device,
        mesh: DeviceMesh,
        sockets: Sockets,
        store_port: int,
    ) -> None:
        super().__init__(pg, rank, size, device, abandonable=False)
        self.mesh = mesh
        self.sockets = sockets
        self.store_port = store_port
        self.destroyed = False
        # Told of each abort, with the slots lost (a copy to another machine under way)
        self.also_abort: list[Callable[[Collection[int] | None], None]] = []

    @classmethod
    def form_default(
        cls,
        store: dist.Store,
        prefix: str,
        rank: int,
        size: int,
        device: torch.device,
        timeout: timedelta,
        store_port: int,
    ) -> FsdpGroup:
        """Make torch's default group under ``prefix`` of ``store`` (every member calls this
        with the same prefix; bounded by the store client's timeout) and its mesh."""
        if dist.is_initialized():  # (a generation that never left it: its group is over)
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        before = Sockets.now()
        backend = "nccl" if device.type == "cuda" else "gloo"
        with broken_on_error(f"forming the group {prefix}"):
            dist.init_process_group(
                backend,
                store=dist.PrefixStore(prefix, store),
                rank=rank,
                world_size=size,
                timeout=timeout,
                device_id=device if device.type == "cuda" else None,
            )
            try:
                mesh = init_device_mesh(device.type, (size,))
            except BaseException:  # (the next generation must find no default group)
                with contextlib.suppress(Exception):
                    dist.destroy_process_group()
                raise
        pg = dist.group.WORLD
        assert isinstance(pg, dist.ProcessGroup)
        return cls(pg, rank, size, device, mesh, Sockets.since(before), store_port)

    def abort(self, lost: Collection[int] | None = None) -> None:
        """Every collective of this group fails at once, here and at each peer: NCCL's
        communicator is aborted, gloo's connections of this process are shut (see the
        module's docstring). Safe from another thread. ``lost``: the slots of the members
        lost (None: not known), told to :attr:`also_abort` (a copy to another machine
        under way ends where it may wait on a lost member's machine, and goes on
        otherwise: see :meth:`~phalanx.snapshot.taker.Snapshotter.end_copies`)."""
        super().abort(lost)
        if self.device.type != "cuda":
            self.sockets.shut(self.store_port)
        for also in list(self.also_abort):
            also(lost)

    def leave(self) -> bool:
        """Abort, then destroy the default group (the next generation makes its own). The
        group object may live on in the modules of this generation until they are dropped;
        its connections are shut already."""
        self.abort()
        self.left = True
        if not self.destroyed:
            self.destroyed = True
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        self.pg = None
        return False
