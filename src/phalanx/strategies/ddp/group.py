"""The process group of one generation, owned by it.

Each generation builds its own group object on its own store prefix (``g<n>/``), passes it
to DDP, and runs every collective of that generation through it: the vote, validation sums,
buffer broadcasts, the hand-over and its barrier. torch's default process group is never
created, so no torch global is touched or reset between generations. A generation that
ends drops its group (the last reference closes its sockets, so peers still blocked on
them get an error at once); an NCCL group is aborted first, since an NCCL collective with a
dead peer never returns.

A collective that fails raises :class:`GroupBroken` (the torch error is its cause): the
worker reads that as "this generation is over", never as a bug of its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

BackendType = dist.ProcessGroup.BackendType


class GroupBroken(Exception):
    """A collective of this generation's group failed (a peer fell, the group was aborted,
    or it did not form in time). The generation is over for this member."""


def _backend(
    store: dist.Store, rank: int, size: int, device: torch.device, timeout: timedelta
) -> tuple[Any, Any]:
    """gloo for CPU devices, NCCL for CUDA ones: (backend object, its type)."""
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        nccl = dist.ProcessGroupNCCL(dist.PrefixStore("cuda/", store), rank, size, options)
        return nccl, BackendType.NCCL
    gloo = dist.ProcessGroupGloo(dist.PrefixStore("cpu/", store), rank, size, timeout)
    return gloo, BackendType.GLOO


class GenerationGroup:
    """``size`` members, this one at ``rank``, on ``device``; built by :meth:`form`."""

    def __init__(self, pg: dist.ProcessGroup, rank: int, size: int, device: torch.device):
        self.pg: dist.ProcessGroup | None = pg  # None once left
        self.rank, self.size, self.device = rank, size, device

    @classmethod
    def form(
        cls,
        store: dist.Store,
        prefix: str,
        rank: int,
        size: int,
        device: torch.device,
        timeout: timedelta,
    ) -> GenerationGroup:
        """Build the group under ``prefix`` of ``store`` (every member calls this with the
        same prefix: the backend's rendezvous waits for all of them, bounded by the store
        client's timeout). ``timeout`` bounds each collective."""
        scoped = dist.PrefixStore(prefix, store)
        with _broken_on_error(f"forming the group {prefix}"):
            backend, kind = _backend(scoped, rank, size, device, timeout)
        pg = dist.ProcessGroup(scoped, rank, size)
        pg._set_default_backend(kind)
        pg._register_backend(torch.device(device.type), kind, backend)
        if device.type == "cuda":
            pg.bound_device_id = device  # (the device barrier() and DDP use, never guessed)
        return cls(pg, rank, size, device)

    def _group(self) -> dist.ProcessGroup:
        if self.pg is None:
            raise GroupBroken("the group was left")
        return self.pg

    # -- collectives ----------------------------------------------------------------------
    # Through torch's functions (not the group's methods): a worker blocked in one then has
    # its innermost Python frame in torch.distributed, which tells the supervisor's hang
    # finder that it waits for a peer rather than hangs itself.
    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the members, in place."""
        with _broken_on_error("all_reduce"):
            dist.all_reduce(tensor, group=self._group())

    def all_reduce_async(self, tensor: torch.Tensor) -> dist.Work:
        """Start summing ``tensor`` over the members, in place; :meth:`wait` for it."""
        with _broken_on_error("all_reduce"):
            work = dist.all_reduce(tensor, group=self._group(), async_op=True)
        assert work is not None
        return work

    def wait(self, work: dist.Work) -> None:
        """Until ``work`` (from :meth:`all_reduce_async`) is done."""
        with _broken_on_error("all_reduce"):
            work.wait()

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """``src``'s ``tensor`` into every member's, in place."""
        with _broken_on_error("broadcast"):
            dist.broadcast(tensor, group=self._group(), group_src=src)

    def barrier(self) -> None:
        with _broken_on_error("barrier"):
            dist.barrier(group=self._group())

    def broadcast_bytes(self, data: bytes, src: int) -> bytes:
        """``src``'s ``data``, on every member (its length first, then the bytes). Bytes
        only: what comes off the network is parsed as data by the caller, never unpickled."""
        if self.rank != src:
            data = b""
        length = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        self.broadcast(length, src)
        if self.rank == src:
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
        else:
            buf = torch.empty(int(length.item()), dtype=torch.uint8, device=self.device)
        self.broadcast(buf, src)
        return data if self.rank == src else buf.cpu().numpy().tobytes()

    # -- DDP ------------------------------------------------------------------------------
    def wrap(self, module: nn.Module, init_sync: bool) -> DistributedDataParallel:
        """``module`` under DDP over this group. Buffers are not synced in forward (a zero
        pass after a failed forward would run that collective twice on one rank; the engine
        syncs them at commit). ``init_sync``: rank 0's weights to everyone at construction
        (the first generation only: later, rank 0 may be the member behind)."""
        ids = [self.device.index] if self.device.type == "cuda" else None
        with _broken_on_error("building DDP"):
            return DistributedDataParallel(
                module,
                device_ids=ids,
                process_group=self._group(),
                forward_sync_buffers=False,
                init_sync=init_sync,
            )

    # -- the end --------------------------------------------------------------------------
    def abort(self) -> None:
        """NCCL: make a collective blocked on a dead peer return with an error. Safe from
        another thread; a no-op for gloo (its collectives fail when a peer's socket closes)."""
        pg = self.pg
        if pg is not None and self.device.type == "cuda":
            with contextlib.suppress(Exception):  # the main thread may be leaving already
                pg.abort()

    def leave(self) -> None:
        """Drop this member's reference (the caller drops the DDP module that holds another):
        the group's sockets close once the last one goes. Never waits for pending work."""
        self.abort()
        self.pg = None


def subgroup_ranks(ranks: Sequence[int], rank: int) -> int | None:
    """This member's rank in a subgroup of ``ranks`` (sorted), or None outside it."""
    ordered = sorted(ranks)
    return ordered.index(rank) if rank in ordered else None


@contextlib.contextmanager
def _broken_on_error(what: str) -> Iterator[None]:
    """A torch error inside (gloo raises plain RuntimeErrors, c10d its DistErrors) is the
    group's end: :class:`GroupBroken`."""
    try:
        yield
    except GroupBroken:
        raise
    except RuntimeError as exc:
        raise GroupBroken(f"{what}: {exc}") from exc
