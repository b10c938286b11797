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

gloo has no abort, and a peer that is frozen or cut off (not dead: its sockets stay open)
would keep a collective blocked until the group's timeout. So on CPU, in a run across
nodes (``abandonable``: on one host the supervisor kills a silent worker, whose closed
sockets end its peers' waits at once, and DDP's own reduction costs less), every wait of this
group, DDP's gradient all-reduce included (a comm hook), is on a future of the group's own
(:class:`Waits`) that :meth:`GenerationGroup.abandon` completes at once when a newer
generation leaves a member out; the abandoned work itself is left to finish or time out
inside torch, and a group with work still in flight is kept by its worker, never destroyed
under it (torch's destructor would wait for that work). Not abandonable: the collectives of
DDP's construction and of its bucket rebuild (second forward), and forming a group: those
stay bounded by the group's timeouts. NCCL (CUDA) keeps torch's own waits, which also order
the streams, and its communicator's abort.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from phalanx.torchprivate import bind_backend, set_nccl_timeout

BackendType = dist.ProcessGroup.BackendType


@dataclass(frozen=True)
class Failure:
    """What a watched future holds when its collective failed or was abandoned: the error's
    type name and message, never the exception (an exception stored in a torch future is a
    reference cycle the garbage collector cannot see: its traceback would keep the group's
    frames, and with them its sockets, alive)."""

    kind: str
    message: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}"


# What a collective this member stopped waiting for says (report.SECONDARY_MARKERS knows it).
ABANDONED = "collective abandoned: a newer generation left this group"


class GroupBroken(Exception):
    """A collective of this generation's group failed (a peer fell, the group was aborted,
    or it did not form in time). The generation is over for this member."""


def _backend(
    store: dist.Store, rank: int, size: int, device: torch.device, timeout: timedelta
) -> tuple[Any, Any]:
    """gloo for CPU devices, NCCL for CUDA ones: (backend object, its type)."""
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        set_nccl_timeout(options, timeout)
        nccl = dist.ProcessGroupNCCL(dist.PrefixStore("cuda/", store), rank, size, options)
        return nccl, BackendType.NCCL
    gloo = dist.ProcessGroupGloo(dist.PrefixStore("cpu/", store), rank, size, timeout)
    return gloo, BackendType.GLOO


class Waits:
    """The futures a member waits on for its group's collectives, and the torch work still in
    flight. Holds no reference to the group: a callback that runs on a torch thread must
    never drop the group's last reference (its destructor would join that very thread)."""

    def __init__(self) -> None:
        self.abandoned = False
        self._lock = threading.RLock()  # (a future's callbacks may run inline under it)
        self._waiting: dict[int, torch.futures.Future[Any]] = {}
        self._in_flight = 0  # torch works not finished yet (abandoned ones included)

    @property
    def busy(self) -> bool:
        with self._lock:
            return self._in_flight > 0

    def watch(self, inner: torch.futures.Future[Any]) -> torch.futures.Future[Any]:
        """A future that completes with ``inner``'s value, with a :class:`Failure` when
        ``inner`` fails, or with ``Failure(ABANDONED)`` at once when :meth:`abandon` comes
        first."""
        outer: torch.futures.Future[Any] = torch.futures.Future()
        key = id(outer)
        with self._lock:
            self._in_flight += 1
            if self.abandoned:
                outer.set_result(Failure("GroupBroken", ABANDONED))
            else:
                self._waiting[key] = outer
        inner.add_done_callback(functools.partial(self._finished, key, outer))
        return outer

    def _finished(
        self, key: int, outer: torch.futures.Future[Any], done: torch.futures.Future[Any]
    ) -> None:
        try:
            value = done.value()
        except Exception as exc:  # (only its text is kept: see Failure)
            value = Failure(type(exc).__name__, str(exc))
        with self._lock:
            self._in_flight -= 1
            if self._waiting.pop(key, None) is not None:  # (else abandoned: its waiter left)
                outer.set_result(value)

    def abandon(self) -> None:
        with self._lock:
            self.abandoned = True
            waiting, self._waiting = list(self._waiting.values()), {}
            for future in waiting:
                future.set_result(Failure("GroupBroken", ABANDONED))


class GenerationGroup:
    """``size`` members, this one at ``rank``, on ``device``; built by :meth:`form`."""

    def __init__(
        self,
        pg: dist.ProcessGroup,
        rank: int,
        size: int,
        device: torch.device,
        abandonable: bool = False,
    ):
        self.pg: dist.ProcessGroup | None = pg  # None once left (and no work in flight)
        self.rank, self.size, self.device = rank, size, device
        self.left = False
        self.waits = Waits()
        # CPU (gloo) across nodes: waits that abandon() can end; CUDA: torch's own (they
        # order the streams); one host: torch's own too (a silent peer is killed there).
        self.watched = abandonable and device.type != "cuda"

    @classmethod
    def form(
        cls,
        store: dist.Store,
        prefix: str,
        rank: int,
        size: int,
        device: torch.device,
        timeout: timedelta,
        abandonable: bool = False,
    ) -> GenerationGroup:
        """Build the group under ``prefix`` of ``store`` (every member calls this with the
        same prefix: the backend's rendezvous waits for all of them, bounded by the store
        client's timeout). ``timeout`` bounds each collective; ``abandonable``: see the
        module's docstring."""
        scoped = dist.PrefixStore(prefix, store)
        with broken_on_error(f"forming the group {prefix}"):
            backend, kind = _backend(scoped, rank, size, device, timeout)
        pg = dist.ProcessGroup(scoped, rank, size)
        bind_backend(pg, device, kind, backend)
        if device.type == "cuda":
            pg.bound_device_id = device  # (the device barrier() and DDP use, never guessed)
        return cls(pg, rank, size, device, abandonable)

    def _group(self) -> dist.ProcessGroup:
        if self.watched and self.waits.abandoned:  # (no new work a peer may never serve)
            raise GroupBroken(ABANDONED)
        if self.pg is None or self.left:
            raise GroupBroken("the group was left")
        return self.pg

    @property
    def busy(self) -> bool:
        """Whether torch still runs work of this group (an abandoned collective)."""
        return self.waits.busy

    def _run(self, what: str, start: Callable[[dist.ProcessGroup], dist.Work | None]) -> None:
        """Start a collective on the group and wait for it (or for the group's abandon)."""
        self.wait(self._start(what, start), what)

    def _start(self, what: str, start: Callable[[dist.ProcessGroup], dist.Work | None]) -> Any:
        """The collective started: something to :meth:`wait` for (a watched future on CPU,
        torch's work on CUDA)."""
        with broken_on_error(what):
            work = start(self._group())
            assert work is not None
            return self.waits.watch(work.get_future()) if self.watched else work

    # -- collectives ----------------------------------------------------------------------
    # Through torch's functions (not the group's methods): a worker blocked in one then has
    # its innermost Python frame in torch.distributed, which tells the supervisor's hang
    # finder that it waits for a peer rather than hangs itself.
    # The waits are on the group's own futures (torch/futures frames, also a wait).
    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the members, in place."""
        self._run("all_reduce", lambda pg: dist.all_reduce(tensor, group=pg, async_op=True))

    def all_reduce_async(self, tensor: torch.Tensor) -> Any:
        """Start summing ``tensor`` over the members, in place; :meth:`wait` for it."""
        return self._start(
            "all_reduce", lambda pg: dist.all_reduce(tensor, group=pg, async_op=True)
        )

    def wait(self, pending: Any, what: str = "all_reduce") -> None:
        """Until ``pending`` (from :meth:`all_reduce_async`) is done, or abandoned."""
        with broken_on_error(what):
            value = pending.wait()
        if isinstance(value, Failure):
            raise GroupBroken(f"{what}: {value}")

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """``src``'s ``tensor`` into every member's, in place. On CPU a receiver's copy
        lands in a staging tensor first, copied in only once the broadcast succeeded: an
        abandoned one may still complete later (a peer that wakes up) and must not write
        into a tensor that lives on."""
        staged = tensor.clone() if self.watched and self.rank != src else tensor
        self._run(
            "broadcast",
            lambda pg: dist.broadcast(staged, group=pg, group_src=src, async_op=True),
        )
        if staged is not tensor:
            tensor.copy_(staged)

    def barrier(self) -> None:
        self._run("barrier", lambda pg: dist.barrier(group=pg, async_op=True))

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
        with broken_on_error("building DDP"):
            ddp = DistributedDataParallel(
                module,
                device_ids=ids,
                process_group=self._group(),
                forward_sync_buffers=False,
                init_sync=init_sync,
            )
        if self.watched:
            # (a lambda: DDP checks a hook's annotations, which this module keeps as strings)
            ddp.register_comm_hook(None, lambda _state, bucket: self._gradient_hook(bucket))
        return ddp

    def _gradient_hook(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """DDP's gradient all-reduce as its own reduction does it (scale by 1/world, then
        sum: the same numbers), waited for on a future :meth:`abandon` can end."""
        buffer = bucket.buffer()
        buffer.mul_(1.0 / self.size)
        work = dist.all_reduce(buffer, group=self._group(), async_op=True)
        assert work is not None
        return self.waits.watch(work.get_future()).then(_bucket_or_raise)

    # -- the end --------------------------------------------------------------------------
    def abandon(self) -> None:
        """Stop waiting: every collective this member waits for, and any it starts later,
        fails at once with :data:`ABANDONED` (the torch work goes on until it finishes or
        times out). Safe from another thread."""
        self.waits.abandon()

    def abort(self, lost: Collection[int] | None = None) -> None:
        """Make a collective blocked on a peer that fell, froze or was cut off return with
        an error: :meth:`abandon`, and for NCCL the communicator's abort. Safe from another
        thread. ``lost``: the slots of the members lost (none: a rebuild by the same
        members), None when not known."""
        self.abandon()
        pg = self.pg
        if pg is not None and self.device.type == "cuda":
            with contextlib.suppress(Exception):  # the main thread may be leaving already
                pg.abort()

    def leave(self) -> bool:
        """Abort, and drop this member's reference to the group (the caller drops the DDP
        module that holds another), unless torch still runs its work: then it returns True,
        and the caller keeps this object until :meth:`release` finds it idle (destroying a
        group waits for its work). A group whose last reference goes closes its sockets:
        peers blocked on them error out. Never waits for pending work."""
        self.abort()
        self.left = True
        return not self.release()

    def release(self) -> bool:
        """Drop the group once no work of it is in flight; whether it was dropped."""
        if self.busy:
            return False
        self.pg = None
        return True


def _bucket_or_raise(done: torch.futures.Future[Any]) -> torch.Tensor:
    """The gradient hook's result: the reduced bucket, or an error DDP's backward raises
    (a fresh one, with the failure's type and text: see :class:`Failure`)."""
    value = done.value()
    if isinstance(value, Failure):
        raise RuntimeError(str(value))
    bucket: torch.Tensor = value[0]
    return bucket


def subgroup_ranks(ranks: Sequence[int], rank: int) -> int | None:
    """This member's rank in a subgroup of ``ranks`` (sorted), or None outside it."""
    ordered = sorted(ranks)
    return ordered.index(rank) if rank in ordered else None


@contextlib.contextmanager
def broken_on_error(what: str) -> Iterator[None]:
    """A torch error inside (gloo raises plain RuntimeErrors, c10d its DistErrors) is the
    group's end: :class:`GroupBroken`."""
    try:
        yield
    except GroupBroken:
        raise
    except RuntimeError as exc:
        raise GroupBroken(f"{what}: {exc}") from exc
