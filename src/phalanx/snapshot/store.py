"""A node's snapshots of the committed state, in shared memory that outlives the workers.

A :class:`SnapshotStore` is a folder (under ``/dev/shm`` where there is one) holding two
buffers, ``state-0`` and ``state-1``. A writer copies the state into the buffer that does
not hold the newest complete snapshot, so a writer killed half-way never spoils the last
good one. Each buffer is a file the writer maps into memory once: a snapshot is one copy of
each tensor into pages that already exist (no pickle, no page allocation), about 13 GB/s on
the development machine where writing a new file ran at 2.

Layout of a buffer: a 64-byte header, the tensors' bytes (each at a 64-byte aligned
offset, in the order of their :class:`~phalanx.skeleton.TensorSlot` indices),
then the skeleton (the state with each tensor replaced by its slot, as the hand-over's JSON:
data that cannot run code). The header holds a sequence number that is odd while the buffer
is being written and even once it is whole (a seqlock): a reader copies what it needs, then
reads the number again, and keeps the copy only when the number did not move and is even.
A lock file makes sure that only one process writes the folder's buffers at a time.

The folder is the agent's: made when the run starts on this machine (named after the agent's
pid, so :func:`sweep` can remove what an agent killed before its cleanup left), removed when
the run ends. Workers find it in their spawn arguments.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import mmap
import os
import re
import shutil
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from phalanx.skeleton import (
    TensorSlot,
    WireError,
    decode,
    encode,
    fill_tensors,
    slot_of,
    split_tensors,
    tensor_slots,
)

MAGIC = b"PXSNAP01"
# magic, seq, step, epoch, data end, skeleton bytes, serial, tag
_HEADER = struct.Struct("<8sQqqQQQq")
HEADER_SIZE = 64
ALIGN = 64
BUFFERS = ("state-0", "state-1")
LOCK = "writer.lock"
OWNER = "owner.lock"  # held by the agent whose folder it is (see sweep)
PREFIX = "phalanx-snap-"
MAPPED_BYTES = 1 << 16  # a mapped read's views: tensors this large or larger (read())
MAX_COPY = 1 << 46  # the largest snapshot a copy from another machine may announce


@dataclass(frozen=True)
class Header:
    """What a buffer's header says: ``seq`` odd while it is written; ``serial`` orders the
    snapshots written into the folder (the newest has the highest); ``tag`` is the writer's
    (under ddp the generation it wrote in)."""

    seq: int
    step: int
    epoch: int
    data_end: int
    skeleton_bytes: int
    serial: int
    tag: int = -1

    @property
    def whole(self) -> bool:
        return self.seq > 0 and self.seq % 2 == 0

    def pack(self) -> bytes:
        return _HEADER.pack(
            MAGIC,
            self.seq,
            self.step,
            self.epoch,
            self.data_end,
            self.skeleton_bytes,
            self.serial,
            self.tag,
        ).ljust(HEADER_SIZE, b"\0")

    @classmethod
    def unpack(cls, raw: bytes) -> Header | None:
        if len(raw) < _HEADER.size:
            return None
        magic, *values = _HEADER.unpack(raw[: _HEADER.size])
        return cls(*values) if magic == MAGIC else None


@dataclass(frozen=True)
class Snapshot:
    """A snapshot read back: the state (the loop's ``snapshot()``, tensors on the CPU) at
    committed step ``step`` of epoch ``epoch``."""

    step: int
    epoch: int
    state: dict[str, Any]
    nbytes: int
    tag: int = -1
    # (mapped: the buffer it was read from, and its header then; see SnapshotStore.unchanged)
    source: tuple[str, Header] | None = None


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 tensor on its own device (any dtype)."""
    flat = tensor.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    return flat.view(torch.uint8)


def layout(slots: list[TensorSlot]) -> tuple[list[int], int]:
    """Each tensor's offset in a buffer, and where the tensors end (the skeleton's offset)."""
    offsets, at = [], HEADER_SIZE
    for slot in slots:
        offsets.append(at)
        nbytes = _numel(slot.shape) * _itemsize(slot.dtype)
        at += -(-nbytes // ALIGN) * ALIGN
    return offsets, at


class SnapshotStore:
    """The two buffers of one folder (see the module's docstring)."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self._maps: dict[str, tuple[int, mmap.mmap, torch.Tensor]] = {}  # fd, mapping, view

    # -- reading ---------------------------------------------------------------------------
    def headers(self) -> dict[str, Header]:
        """The header of each buffer that exists and has one."""
        found = {}
        for name in BUFFERS:
            try:
                with open(os.path.join(self.folder, name), "rb") as fh:
                    header = Header.unpack(fh.read(HEADER_SIZE))
            except OSError:
                continue
            if header is not None:
                found[name] = header
        return found

    def newest(self) -> Header | None:
        """The header of the newest whole snapshot (the furthest step; the later written of
        two at the same step), without reading it."""
        whole = [h for h in self.headers().values() if h.whole]
        return max(whole, key=lambda h: (h.step, h.serial)) if whole else None

    def read(
        self, want: Callable[[Header], bool] | None = None, mapped: bool = False
    ) -> Snapshot | None:
        """The newest whole snapshot (of those ``want`` accepts), copied out of shared
        memory (a buffer rewritten while it was read is dropped, and the other one tried);
        None when there is none. ``mapped``: each tensor of at least :data:`MAPPED_BYTES`
        is a copy-on-write view of the buffer instead, read only where it is used (fsdp's
        restore cuts a member's rows out of every old rank's shards); whoever uses it
        checks :meth:`unchanged` afterwards."""
        order = sorted(
            ((h, n) for n, h in self.headers().items() if h.whole and (want is None or want(h))),
            key=lambda item: (item[0].step, item[0].serial),
            reverse=True,
        )
        for header, name in order:
            snap = self._read(name, header, mapped)
            if snap is not None:
                return snap
        return None

    def unchanged(self, snap: Snapshot) -> bool:
        """Whether the buffer a mapped snapshot was read from still holds it (nobody began
        to write it since): what was cut out of its views is then that snapshot's."""
        if snap.source is None:
            return True
        name, header = snap.source
        return self.headers().get(name) == header

    def _read(self, name: str, header: Header, mapped: bool = False) -> Snapshot | None:
        """One buffer's snapshot, each tensor copied into storage of its own (torch's
        generators, say, want a tensor that owns its storage), or, ``mapped``, each large
        one a view of the buffer (see :meth:`read`)."""
        path = os.path.join(self.folder, name)
        try:
            with open(path, "rb") as fh:
                skeleton_raw = os.pread(fh.fileno(), header.skeleton_bytes, header.data_end)
                skeleton = decode(skeleton_raw)
                slots = tensor_slots(skeleton)
                offsets, _ = layout(slots)
                view = None
                if mapped:  # (private: writing a view never reaches the buffer)
                    view = mmap.mmap(fh.fileno(), header.data_end, access=mmap.ACCESS_COPY)
                tensors = []
                for slot, offset in zip(slots, offsets, strict=True):
                    nbytes = _numel(slot.shape) * _itemsize(slot.dtype)
                    if view is not None and nbytes >= MAPPED_BYTES:
                        raw = torch.frombuffer(view, dtype=torch.uint8, count=nbytes, offset=offset)
                        tensors.append(raw.view(slot.dtype).view(slot.shape))
                        continue
                    tensor = torch.empty(slot.shape, dtype=slot.dtype)
                    if tensor.numel():
                        fh.seek(offset)
                        fh.readinto(tensor_bytes(tensor).numpy())  # type: ignore[arg-type]
                    tensors.append(tensor)
                after = Header.unpack(os.pread(fh.fileno(), HEADER_SIZE, 0))
        except (OSError, WireError, ValueError):
            return None
        if after != header:
            return None  # rewritten while it was read
        state = fill_tensors(skeleton, tensors)
        nbytes = header.data_end + header.skeleton_bytes
        source = (name, header) if mapped else None
        return Snapshot(header.step, header.epoch, state, nbytes, header.tag, source)

    # -- writing ---------------------------------------------------------------------------
    def forget(self, drop: Callable[[Header], bool]) -> int:
        """Mark each whole snapshot that ``drop`` accepts as not whole: it is never read
        again, and its buffer is the next one written. Only the folder's writer calls it.
        How many it marked."""
        marked = 0
        for name, header in self.headers().items():
            if header.whole and drop(header):
                fd = os.open(os.path.join(self.folder, name), os.O_RDWR)
                try:
                    os.pwrite(fd, dataclasses.replace(header, seq=header.seq + 1).pack(), 0)
                finally:
                    os.close(fd)
                marked += 1
        return marked

    def lock(self) -> int | None:
        """Take the folder's writer lock without waiting: its descriptor, or None while
        another live process holds it (a dead holder's lock is released by the kernel).
        :meth:`unlock` gives it back."""
        fd = os.open(os.path.join(self.folder, LOCK), os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return fd

    @staticmethod
    def unlock(fd: int) -> None:
        os.close(fd)  # (releases the lock)

    def begin(self, state: dict[str, Any], tag: int = -1) -> Writing:
        """Start writing ``state`` (a loop's ``snapshot()``) into the buffer that does not
        hold the newest whole snapshot: the skeleton is made now (it copies every value
        that is not a tensor), the tensors are copied by :meth:`Writing.copy`. ``tag`` goes
        into the header (see :class:`Header`)."""
        skeleton, tensors = split_tensors(state)
        raw = encode(skeleton)
        slots = [slot_of(i, t) for i, t in enumerate(tensors)]  # (not walked again)
        offsets, data_end = layout(slots)
        target, seq, serial, first = self._next_buffer(data_end + len(raw))
        view = self._maps[target][2]
        loop = state.get("loop") or {}
        header = Header(
            seq + 1,
            int(loop.get("global_step", -1)),
            int(loop.get("epoch", -1)),
            data_end,
            len(raw),
            serial,
            tag,
        )
        self._header(target, Header(seq, -1, -1, 0, 0, serial, tag))
        tensor_offsets = list(zip(tensors, offsets, strict=True))
        writing = Writing(self, target, header, raw, tensor_offsets, view)
        writing.first = first
        return writing

    def _next_buffer(self, size: int) -> tuple[str, int, int, bool]:
        """The buffer the next snapshot goes into (the one not holding the newest whole
        snapshot), mapped with ``size`` bytes: its name, the odd sequence number that marks
        it being written, the next serial, and whether this process maps it anew."""
        headers = self.headers()
        newest = self.newest()
        target = next(
            (n for n in BUFFERS if newest is None or headers.get(n) != newest), BUFFERS[0]
        )
        serial = max((h.serial for h in headers.values()), default=0) + 1
        old = headers.get(target)
        seq = (old.seq if old is not None else 0) + 1
        seq += seq % 2 == 0  # odd: being written
        first = target not in self._maps or len(self._maps[target][1]) < size
        self._map(target, size)
        return target, seq, serial, first

    # -- copies between machines (phalanx.snapshot.copies) ----------------------------------
    def payload(self, header: Header) -> tuple[str, memoryview] | None:
        """The bytes after the header of the buffer that holds ``header``'s snapshot (its
        tensors and skeleton), as a view of this process's mapping (the writer's: it mapped
        the buffer to write it); None when no buffer holds it now. Release the view before
        this store is closed or the buffer is remapped."""
        name = next((n for n, h in self.headers().items() if h == header), None)
        if name is None or name not in self._maps:
            return None
        end = header.data_end + header.skeleton_bytes
        mapped = self._maps[name][1]
        if len(mapped) < end:
            return None
        return name, memoryview(mapped)[HEADER_SIZE:end]

    def begin_copy(self, header: Header) -> Copying:
        """Start writing a snapshot that another machine's store holds (its ``header``; the
        bytes after it come through :attr:`Copying.into`) into the buffer that does not hold
        the newest whole snapshot here. The copy keeps the original's step, epoch and tag;
        its serial and sequence number are this folder's."""
        end = header.data_end + header.skeleton_bytes
        if header.data_end < HEADER_SIZE or end > MAX_COPY:
            raise ValueError(f"a snapshot header that does not fit a buffer: {header}")
        target, seq, serial, _ = self._next_buffer(end)
        self._header(target, Header(seq, -1, -1, 0, 0, serial, header.tag))
        whole = dataclasses.replace(header, seq=seq + 1, serial=serial)
        into = memoryview(self._maps[target][1])[HEADER_SIZE:end]
        return Copying(self, target, whole, into)

    def _map(self, name: str, size: int) -> torch.Tensor:
        """The buffer ``name`` mapped in this process, at least ``size`` bytes, as a uint8
        tensor over the mapping. A buffer is made (or grown) with room to spare: the
        skeleton grows with the run (the ledger has a row a step), and a buffer remapped at
        every snapshot would fault its pages in anew each time."""
        held = self._maps.get(name)
        if held is not None and len(held[1]) >= size:
            return held[2]
        self._unmap(name)
        path = os.path.join(self.folder, name)
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
        try:
            length = max(os.fstat(fd).st_size, size)
            if os.fstat(fd).st_size < size:
                length = _room(size)
                # Pages reserved now: a full tmpfs is an OSError here, not a SIGBUS later
                # when the mapping is written.
                _reserve(fd, length)
            mapped = mmap.mmap(fd, length)
        except BaseException:
            os.close(fd)
            raise
        view = torch.frombuffer(mapped, dtype=torch.uint8)
        self._maps[name] = (fd, mapped, view)
        return view

    def _put(self, name: str, offset: int, raw: bytes) -> None:
        mapped = self._maps[name][1]
        mapped[offset : offset + len(raw)] = raw

    def _header(self, name: str, header: Header) -> None:
        """Written with a system call, after every store into the mapping: a reader that
        sees the new header sees what it covers, whatever the processor's memory order."""
        os.pwrite(self._maps[name][0], header.pack(), 0)

    def _unmap(self, name: str) -> None:
        """Only once no copy into the mapping is in flight (the loop fences first): torch's
        views of it do not keep it mapped."""
        held = self._maps.pop(name, None)
        if held is None:
            return
        fd, mapped, _ = held
        mapped.close()
        os.close(fd)

    def close(self) -> None:
        for name in list(self._maps):
            self._unmap(name)


class Copying:
    """A copy of another machine's snapshot being written (see
    :meth:`SnapshotStore.begin_copy`): fill :attr:`into`, then :meth:`finish`."""

    def __init__(self, store: SnapshotStore, name: str, header: Header, into: memoryview):
        self.store, self.name, self.header, self.into = store, name, header, into

    def finish(self) -> None:
        """Mark it whole (the header, written after every byte it covers)."""
        self.into.release()
        self.store._header(self.name, self.header)

    def drop(self) -> None:
        """Give up (the buffer stays marked as being written: never read)."""
        self.into.release()


class Writing:
    """One snapshot being written (see :meth:`SnapshotStore.begin`): :meth:`copy` copies
    the tensors (all, or those the caller names), :meth:`finish` writes the skeleton and
    marks the buffer whole."""

    def __init__(
        self,
        store: SnapshotStore,
        name: str,
        header: Header,
        skeleton: bytes,
        tensors: list[tuple[torch.Tensor, int]],
        view: torch.Tensor,
    ) -> None:
        self.store, self.name, self.header = store, name, header
        self.skeleton, self.tensors, self.view = skeleton, tensors, view
        self.copied = [False] * len(tensors)
        # Into a buffer this process had not mapped before (made, or grown): its first copy
        # faults the pages in, so it costs about three times a later one.
        self.first = False

    @property
    def step(self) -> int:
        return self.header.step

    def copy(self, which: set[int] | None = None) -> None:
        """Copy the tensors whose indices are in ``which`` (every one not copied yet when
        None) into the buffer."""
        for i, (tensor, offset) in enumerate(self.tensors):
            if self.copied[i] or (which is not None and i not in which):
                continue
            src = tensor_bytes(tensor)
            self.view[offset : offset + src.numel()].copy_(src)
            self.copied[i] = True

    def finish(self) -> int:
        """The rest of the tensors, the skeleton, then the header that makes it whole;
        returns the bytes written."""
        self.copy()
        h = self.header
        self.store._put(self.name, h.data_end, self.skeleton)
        self.store._header(self.name, h)
        self.tensors = []  # (drop the references to the live state)
        self.view = torch.empty(0, dtype=torch.uint8)  # (and to the mapping)
        return h.data_end + h.skeleton_bytes


def folder_for(run_id: str, base: str | None = None) -> tuple[str, int]:
    """A new snapshot folder for the agent of this process, in ``/dev/shm`` (memory) where
    it exists, else the temporary directory, and the descriptor of its owner lock (an
    ``flock`` the agent holds while it lives: closing it, or the agent's death, frees it).
    Stale folders of agents that are gone are swept first."""
    base = base or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    sweep(base)
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", run_id)[:40]
    folder = os.path.join(base, f"{PREFIX}{os.getpid()}-{safe}")
    making = tempfile.mkdtemp(prefix=".making-", dir=base)  # (no sweep looks at it)
    fd = os.open(os.path.join(making, OWNER), os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    shutil.rmtree(folder, ignore_errors=True)
    os.rename(making, folder)  # (the lock goes with it: it is on the open file)
    return folder, fd


def sweep(base: str) -> list[str]:
    """Remove the snapshot folders in ``base`` whose agent is gone (killed before it could
    remove its own): those whose owner lock can be taken. (Not by pid: containers that share
    ``/dev/shm`` do not see each other's processes.) Returns the folders removed."""
    removed: list[str] = []
    try:
        names = os.listdir(base)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(PREFIX):
            continue
        folder = os.path.join(base, name)
        try:
            fd = os.open(os.path.join(folder, OWNER), os.O_RDWR)
        except OSError:
            continue  # (being made, or not a snapshot folder: left alone)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # its agent lives
        finally:
            os.close(fd)
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(name)
    return removed


def _room(size: int) -> int:
    """A buffer's length for ``size`` bytes: a quarter more, in whole MiB."""
    mib = 1 << 20
    return -(-(size + size // 4) // mib) * mib


def _reserve(fd: int, size: int) -> None:
    """The file at ``size`` bytes with its pages allocated (ENOSPC raises), or only sized
    where the file system cannot allocate ahead."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        os.ftruncate(fd, size)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize
