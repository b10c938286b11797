"""A copy of each fsdp member's shard snapshot on another machine, so that a machine's loss
(its shared memory with it) leaves a complete set of shard snapshots on the others.

Under fsdp a member's snapshot is the only copy of its shards outside its process: it lives
in its machine's shared memory (:mod:`phalanx.snapshot.shards`). When the machine is lost,
the set it belongs to is incomplete, and the run could only go back to a checkpoint. So,
when a generation spans machines, each member (rank ``r``) also sends each snapshot it
writes to its *buddy*: the next member after it, in rank order and round the end, whose
machine is another one (:func:`buddies`). The buddy's process writes it into the folder
``copy-<slot>`` of its machine's snapshot folder, two buffers as every snapshot store, with
the original's header (step, epoch, tag), so the scan that finds the newest complete set
after a loss (:func:`~phalanx.strategies.ddp.worker.fsdp_handover.restore_from_set`) finds
copies as it finds snapshots.

The transport is one TCP connection per sender and generation, from the sender's snapshot
buffer (a view of its mapping: nothing is pickled or copied in the sender's memory) to the
receiver's buffer (``recv_into`` the mapping). Both ends prove they hold the run's key
before anything is sent (an HMAC of each other's fresh nonce). After a copy, the receiver
answers one byte once the copy's header marks it whole: then the sender counts it.

Off the step's path: the sender's thread runs while the next steps train. A member waits
for its copy of the last snapshot only before it votes on the step after which it takes the
next one (:meth:`~phalanx.snapshot.taker.Snapshotter.before_vote`): so no member commits
that step before every member's last snapshot is whole on another machine, and two buffers
on each side keep a set of one step complete at every moment, whichever machine is lost.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import socket
import struct
import threading
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

from phalanx.snapshot.store import HEADER_SIZE, Header, SnapshotStore

MAGIC = b"PXCOPY01"
NONCE = 16
_HELLO = struct.Struct("<8s16s")  # magic, the receiver's nonce
_CLAIM = struct.Struct("<qqq16s32s")  # generation, slot, start step, sender's nonce, its MAC
_PROOF = struct.Struct("<32s")  # the receiver's MAC of the sender's nonce
ACK = b"\x01"
MAX_PROVING = 16  # connections in their handshake at once, on one receiving end


def copy_folder(folder: str, slot: int) -> str:
    """Where a machine keeps the copies of worker slot ``slot``'s shard snapshots."""
    return str(Path(folder) / f"copy-{slot}")


def held_places(folder: str) -> list[Path]:
    """Every folder of shard snapshots a machine's ``folder`` holds: each slot's own
    (``slot-<n>``), then each copy of another machine's member's (``copy-<n>``)."""
    return [*sorted(Path(folder).glob("slot-*")), *sorted(Path(folder).glob("copy-*"))]


def buddies(places: Sequence[str]) -> list[int | None]:
    """For each rank (``places[r]``: its machine), the rank that keeps a copy of its
    snapshots: the first after it, in rank order and round the end, on another machine;
    None when every member is on its machine."""
    world = len(places)
    found: list[int | None] = []
    for rank, place in enumerate(places):
        later = ((rank + k) % world for k in range(1, world))
        found.append(next((r for r in later if places[r] != place), None))
    return found


def _mac(key: bytes, label: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"|".join((label, *parts)), hashlib.sha256).digest()


def _recv_exact(conn: socket.socket, size: int, deadline: float | None = None) -> bytes:
    chunks, left = [], size
    while left:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("the peer took too long")
            conn.settimeout(remaining)
        chunk = conn.recv(left)
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _recv_into(conn: socket.socket, into: memoryview) -> None:
    at = 0
    while at < len(into):
        got = conn.recv_into(into[at:])
        if not got:
            raise ConnectionError("the peer closed the connection")
        at += got


@dataclass(frozen=True)
class Endpoint:
    """Where a member receives copies (``host``, ``port``), and its machine (``place``: its
    snapshot folder, one per machine)."""

    host: str
    port: int
    place: str


class CopyListener:
    """A member's receiving end (for its whole process): accepts the senders whose buddy it
    is, each on a thread of its own, and writes their copies under ``folder`` (its machine's
    snapshot folder). ``timeout``: the longest a copy, once begun, may take."""

    def __init__(
        self, folder: str, key: bytes, host: str, timeout: float, handshake: float
    ) -> None:
        self.folder, self.key, self.timeout, self.handshake = folder, key, timeout, handshake
        # (connections not proven yet: a few at a time, each for ``handshake`` at most, so
        # a process without the key cannot hold this end's threads or descriptors)
        self._proving: dict[socket.socket, float] = {}  # unproven -> when it came
        self.server = socket.create_server((host, 0))
        self.endpoint = Endpoint(host, self.server.getsockname()[1], folder)
        self.generation = -1
        self._open: dict[socket.socket, int] = {}  # connection -> its sender's generation
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, name="phalanx-copies", daemon=True).start()

    def begin(self, generation: int) -> None:
        """This member is in ``generation`` now: connections of earlier ones are shut (their
        senders left them; a frozen one would keep its slot's folder locked)."""
        with self._lock:
            self.generation = generation
            stale = [conn for conn, g in self._open.items() if g < generation]
        for conn in stale:
            _shut(conn)

    def close(self) -> None:
        self._closed = True
        _shut(self.server)
        self.server.close()
        with self._lock:
            conns = list(self._open)
        for conn in conns:
            _shut(conn)

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            _no_delay(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with contextlib.closing(conn):
            self._prove_from(conn)
            try:
                claim = self._handshake(conn, time.monotonic() + self.handshake)
            except (OSError, ValueError, struct.error):
                return  # (not a member of this run, or gone: nothing was written)
            finally:
                with self._lock:
                    self._proving.pop(conn, None)
            generation, slot, start = claim
            with self._lock:
                if generation < self.generation or self._closed:
                    return
                self._open[conn] = generation
            try:
                self._receive(conn, slot, start)
            except (OSError, ValueError):
                pass  # (the sender counts a copy only when it is answered)
            finally:
                with self._lock:
                    self._open.pop(conn, None)

    def _prove_from(self, conn: socket.socket) -> None:
        """``conn`` is to prove itself; with :data:`MAX_PROVING` unproven already, the
        oldest is shut (a member's connection proves itself at once: only one that does not
        would wait that long)."""
        with self._lock:
            oldest = None
            if len(self._proving) >= MAX_PROVING:
                oldest = min(self._proving, key=self._proving.__getitem__)
                del self._proving[oldest]
            self._proving[conn] = time.monotonic()
        if oldest is not None:
            _shut(oldest)

    def _handshake(self, conn: socket.socket, deadline: float) -> tuple[int, int, int]:
        """(generation, slot, start step) of a sender that proved it holds the run's key
        by ``deadline`` (all of it: a sender that trickles bytes gains no time), after
        proving this end holds it too. Raises ValueError otherwise."""
        mine = os.urandom(NONCE)
        conn.settimeout(max(0.0, deadline - time.monotonic()))
        conn.sendall(_HELLO.pack(MAGIC, mine))
        generation, slot, start, theirs, mac = _CLAIM.unpack(
            _recv_exact(conn, _CLAIM.size, deadline)
        )
        said = struct.pack("<qqq", generation, slot, start)
        if not hmac.compare_digest(mac, _mac(self.key, b"send", mine, said, theirs)):
            raise ValueError("a sender that does not hold the run's key")
        conn.sendall(_PROOF.pack(_mac(self.key, b"recv", theirs, mine)))
        return generation, slot, start

    def _receive(self, conn: socket.socket, slot: int, start: int) -> None:
        folder = copy_folder(self.folder, slot)
        os.makedirs(folder, exist_ok=True)
        store = SnapshotStore(folder)
        lock = _lock_within(store, self.timeout)
        try:
            # Copies of steps past the one this generation started from are of a run that
            # fell (the same values, but of another world): the next copies must not spare
            # them over the one kept of that step.
            store.forget(lambda h: h.step > start)
            while True:
                conn.settimeout(None)  # (a sender may wait many steps between copies)
                raw = conn.recv(HEADER_SIZE, socket.MSG_WAITALL)
                if len(raw) < HEADER_SIZE:
                    return  # (the sender closed it between copies)
                conn.settimeout(self.timeout)
                header = Header.unpack(raw)
                if header is None or not header.whole:
                    raise ValueError("not a snapshot's header")
                copying = store.begin_copy(header)
                try:
                    _recv_into(conn, copying.into)
                except BaseException:
                    copying.drop()
                    raise
                copying.finish()
                conn.sendall(ACK)
        finally:
            SnapshotStore.unlock(lock)
            store.close()


def _lock_within(store: SnapshotStore, timeout: float) -> int:
    """The store's writer lock, waiting up to ``timeout`` for a receiver that is ending."""
    deadline = time.monotonic() + timeout
    while (fd := store.lock()) is None:
        if time.monotonic() > deadline:
            raise OSError(f"another live process writes {store.folder}")
        time.sleep(0.05)
    return fd


def _no_delay(sock: socket.socket) -> None:
    """Small writes go at once: a header, then the answer's one byte, would otherwise wait
    for the peer's delayed acknowledgement (40 ms on Linux) before they leave."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


@dataclass(frozen=True)
class Copied:
    """A copy of the snapshot of ``step`` is whole on the buddy's machine: ``nbytes`` sent
    in ``seconds`` (wall time, beside the steps)."""

    step: int
    nbytes: int
    seconds: float


class CopySender:
    """A member's sending end in one generation: one copy at a time, each in a thread of its
    own, over one connection to its buddy (``to``). The loop's thread learns the outcome
    (:meth:`outcome`); the thread never reports."""

    def __init__(
        self,
        to: Endpoint,
        key: bytes,
        generation: int,
        slot: int,
        start: int,
        timeout: float,
        handshake: float | None = None,
    ) -> None:
        self.to, self.key, self.timeout = to, key, timeout
        self.handshake = timeout if handshake is None else handshake  # (connect and prove)
        self.holder = -1  # the buddy's slot, where the worker knows it (see abort_for)
        self.claim = struct.pack("<qqq", generation, slot, start)
        self.sock: socket.socket | None = None
        self.thread: threading.Thread | None = None
        self.step: int | None = None  # of the copy under way, or of the last one
        self.done: Copied | None = None  # the last whole copy, not yet told
        self.error: BaseException | None = None  # the first failure; no copy after it
        self.seconds: float | None = None  # the last whole copy's wall time
        self.sent = 0  # whole copies (the first of a generation is waited for: Snapshotter)
        self._closed = False
        self._told = False

    @property
    def busy(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def start(self, store: SnapshotStore, header: Header) -> None:
        """Send the snapshot ``header`` names (whole in ``store``, this member's own)."""
        self.wait()
        if self.error is not None or self._closed:
            return
        self.step = header.step
        self.thread = threading.Thread(
            target=self._send, args=(store, header), name="phalanx-copy", daemon=True
        )
        self.thread.start()

    def wait(self, most: float | None = None) -> None:
        """Until the copy under way is whole on the buddy's machine, or failed; ``most``
        seconds at most, then it is aborted (a failure: no copy after it)."""
        if self.thread is None:
            return
        self.thread.join(most)
        if self.thread.is_alive():
            self.error = self.error or TimeoutError(f"a copy took more than {most:g}s")
            self.abort()
            self.thread.join()
        self.thread = None

    def outcome(self) -> tuple[Copied | None, BaseException | None]:
        """The copy that became whole since the last call, and the failure that stopped the
        copies (each told once)."""
        if self.busy:
            return None, None
        done, self.done = self.done, None
        error = None if self._told else self.error
        self._told = self._told or error is not None
        return done, error

    def abort(self) -> None:
        """A copy under way fails at once, and no other starts (from any thread: the
        group's abort calls it, so a member waiting for its copy is freed as from a
        collective)."""
        self._closed = True
        sock = self.sock
        if sock is not None:
            _shut(sock)

    def abort_for(self, lost: Collection[int] | None) -> None:
        """The group was aborted with the slots of the members ``lost`` (None: not known):
        :meth:`abort` when the buddy (slot :attr:`holder`) may be among them, where the
        copy may wait on it; else the copy goes on (a rebuild by the same members)."""
        if lost is None or self.holder in lost:
            self.abort()

    def close(self) -> None:
        """The generation ended: :meth:`abort`, and wait for the thread."""
        self.abort()
        self.wait()
        if self.sock is not None:
            self.sock.close()

    def _connect(self) -> socket.socket:
        # (the socket is this sender's before it connects: abort() shuts it even while the
        # connect or the handshake waits on a buddy that does not answer)
        sock = self.sock = socket.socket(_family(self.to.host), socket.SOCK_STREAM)
        try:
            if self._closed:
                raise ConnectionError("aborted")
            sock.settimeout(self.handshake)  # (a dead host: given up after it)
            sock.connect((self.to.host, self.to.port))
            _no_delay(sock)
            deadline = time.monotonic() + self.handshake
            magic, theirs = _HELLO.unpack(_recv_exact(sock, _HELLO.size, deadline))
            if magic != MAGIC:
                raise ConnectionError("not a phalanx copy receiver")
            mine = os.urandom(NONCE)
            mac = _mac(self.key, b"send", theirs, self.claim, mine)
            sock.sendall(self.claim + mine + mac)
            (proof,) = _PROOF.unpack(_recv_exact(sock, _PROOF.size, deadline))
            if not hmac.compare_digest(proof, _mac(self.key, b"recv", mine, theirs)):
                raise ConnectionError("a receiver that does not hold the run's key")
        except BaseException:
            self.sock = None
            sock.close()
            raise
        return sock

    def _send(self, store: SnapshotStore, header: Header) -> None:
        started = time.perf_counter()
        try:
            if self.sock is None:
                self._connect().settimeout(None)  # (a large copy may take long: abort ends it)
            assert self.sock is not None
            found = store.payload(header)
            if found is None:
                raise RuntimeError(f"the snapshot of step {header.step} was rewritten unsent")
            _, view = found
            try:
                self.sock.sendall(header.pack())
                self.sock.sendall(view)
                nbytes = HEADER_SIZE + len(view)
            finally:
                view.release()
            if _recv_exact(self.sock, len(ACK)) != ACK:
                raise ConnectionError("the receiver did not take the copy")
        except Exception as exc:
            if not self._closed:
                self.error = exc
            self._closed = True
            return
        self.seconds = time.perf_counter() - started
        self.done = Copied(header.step, nbytes, self.seconds)
        self.sent += 1
