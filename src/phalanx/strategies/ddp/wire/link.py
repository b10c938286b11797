"""The authenticated channel between the head and each node's agent: frames over one TCP
connection, each an HMAC-checked JSON document with an optional binary payload.

Only what carries this run's token is heard. A connection opens with a handshake: the node
sends ``hello`` with a fresh nonce, the head answers with its own, and both derive the
session key ``HMAC(token, "px-link/1" | node nonce | head nonce)``. Every frame after that
carries a sequence number (one counter per direction, starting at 1) and an HMAC-SHA256
with the session key over the sequence number, the document and the payload. A frame whose
MAC fails, or whose number is not the next one (a replay, a reordering, a frame of another
connection), ends the connection: nothing on it is read again. The document is JSON and the
payload is bytes the receiver parses as data (the final weights travel as a ``torch.save``
file that is loaded with ``weights_only=True``): nothing read from the network is unpickled.

Every read has a deadline (a socket timeout): a silently cut link is seen as silence, never
as a call blocked for the kernel's TCP timeout (about 15 minutes).

Before a peer has proved the token, what it can cost is bounded on both sides: the whole
handshake (from the connection to a verified first frame) has one deadline,
:attr:`.timing.Timing.handshake`, however slowly the bytes drip in; that first frame may announce at
most :data:`MAX_HELLO` bytes (the head reading a node's hello, and a node reading the head's
answer alike); and the head's :class:`Listener` lets at most :data:`MAX_UNPROVEN` connections
prove themselves at once (a newer one pushes out the oldest, so a flood of idle connections
holds no place for long: a node's handshake takes milliseconds). Its accept loop outlives a
failed ``accept`` (out of descriptors, a connection aborted before it was taken): it says so
once per kind of error and goes on, until the listener is closed.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import queue
import secrets
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from phalanx.strategies.ddp.timing import DEFAULT, Timing

PROTOCOL = "px-link/1"
HEADER = struct.Struct("!QII")  # sequence number, document length, payload length
MAC_SIZE = 32
MAX_DOC = 64 << 20  # a document bigger than this is not one of ours
MAX_PAYLOAD = 1 << 34
# A node's hello (and the head's answer to it) is a small document: a peer that has not
# proved the token yet cannot make the head (or a joining node) read more than this.
MAX_HELLO = 1 << 20
MAX_UNPROVEN = 16  # connections the head lets prove themselves at once


class LinkError(Exception):
    """The link is unusable: closed, cut, or a frame failed its check (``rejected``)."""

    def __init__(self, message: str, rejected: bool = False) -> None:
        super().__init__(message)
        self.rejected = rejected


class LinkSilent(LinkError):
    """No frame within one read's timeout (the link may still be good)."""


@dataclass(frozen=True)
class Frame:
    kind: str
    doc: dict[str, Any]
    payload: bytes = b""


def _recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """``n`` bytes; by the monotonic ``deadline`` when given (else each read within the
    socket's timeout): TimeoutError past it, however the bytes are spread."""
    chunks, got = [], 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("past the deadline")
            sock.settimeout(left)
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            raise LinkError("the connection was closed")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _mac(key: bytes, seq: int, doc: bytes, payload: bytes) -> bytes:
    mac = hmac.new(key, HEADER.pack(seq, len(doc), len(payload)), hashlib.sha256)
    mac.update(doc)
    mac.update(payload)
    return mac.digest()


def session_key(token: bytes, node_nonce: bytes, head_nonce: bytes) -> bytes:
    return hmac.new(token, PROTOCOL.encode() + node_nonce + head_nonce, hashlib.sha256).digest()


class Link:
    """One end of an authenticated connection. :meth:`send` is safe from several threads;
    frames are read by :meth:`recv` (one reader) or by a reader thread (:meth:`start`) into
    :attr:`inbox`."""

    def __init__(self, sock: socket.socket, key: bytes, peer: str) -> None:
        self.sock, self.key, self.peer = sock, key, peer
        self.sent = 0
        self.received = 0
        self.lock = threading.Lock()
        self.inbox: queue.Queue[Frame | LinkError] = queue.Queue()
        self.last_heard = time.monotonic()
        self.closed = False
        self.started = False

    # -- the handshake --------------------------------------------------------------------
    @classmethod
    def connect(
        cls,
        address: tuple[str, int],
        token: bytes,
        hello: Frame,
        timeout: float,
        handshake: timedelta = DEFAULT.handshake,
    ) -> tuple[Link, Frame]:
        """A node's side: connect (within ``timeout`` seconds), prove the token, send
        ``hello`` (a frame of kind ``hello``: the head takes no other first); returns the
        link and the head's answer to the hello (its first frame). Until that answer's MAC
        proves the head holds the token, the head is a stranger: the answer may be at most
        :data:`MAX_HELLO` bytes, and all of it must come within ``handshake``."""
        limit = handshake.total_seconds()
        sock = socket.create_connection(address, timeout=timeout)
        deadline = time.monotonic() + limit
        sock.settimeout(limit)
        try:
            nonce = secrets.token_bytes(16)
            sock.sendall(PROTOCOL.encode() + nonce)
            head_nonce = _recv_exact(sock, 16, deadline)
            link = cls(sock, session_key(token, nonce, head_nonce), f"{address[0]}:{address[1]}")
            link.send_frame(hello)
            answer = link.recv(MAX_HELLO, MAX_HELLO, deadline)
        except (TimeoutError, LinkSilent):
            sock.close()
            raise LinkError(f"no answer from the head within {limit:g}s") from None
        except (OSError, LinkError):
            sock.close()
            raise
        sock.settimeout(limit)  # (proved: reads have their usual timeout again)
        return link, answer

    @classmethod
    def accept(
        cls, sock: socket.socket, token: bytes, handshake: timedelta = DEFAULT.handshake
    ) -> tuple[Link, Frame]:
        """The head's side of a new connection: the node's hello, checked, all of it within
        ``handshake`` of the connection (a peer that drips its bytes is cut off there).
        Raises LinkError (``rejected``) for a peer that does not hold the token."""
        limit = handshake.total_seconds()
        deadline = time.monotonic() + limit
        sock.settimeout(limit)
        try:
            host, port = sock.getpeername()[:2]
            opening = _recv_exact(sock, len(PROTOCOL) + 16, deadline)
            if not opening.startswith(PROTOCOL.encode()):
                raise LinkError("not a phalanx node (no px-link/1 opening)", rejected=True)
            nonce = secrets.token_bytes(16)
            sock.sendall(nonce)
            link = cls(sock, session_key(token, opening[len(PROTOCOL) :], nonce), f"{host}:{port}")
            # (not proved yet: no room for a huge frame)
            hello = link.recv(MAX_HELLO, 0, deadline)
        except (TimeoutError, LinkSilent):
            sock.close()
            why = f"no verified hello within {limit:g}s of connecting"
            raise LinkError(f"the handshake failed: {why}", rejected=True) from None
        except (OSError, LinkError) as exc:
            sock.close()
            if isinstance(exc, LinkError) and not exc.rejected:
                raise LinkError(f"the handshake failed: {exc}", rejected=True) from None
            raise
        if hello.kind != "hello":
            sock.close()
            raise LinkError(f"expected a hello, got {hello.kind!r}", rejected=True)
        sock.settimeout(limit)  # (proved: reads have their usual timeout again)
        return link, hello

    # -- frames ---------------------------------------------------------------------------
    def send(self, kind: str, doc: dict[str, Any], payload: bytes = b"") -> None:
        body = json.dumps({"kind": kind, "doc": doc}).encode()
        with self.lock:
            if self.closed:
                raise LinkError("the link is closed")
            self.sent += 1
            head = HEADER.pack(self.sent, len(body), len(payload))
            try:
                self.sock.sendall(head + body + payload + _mac(self.key, self.sent, body, payload))
            except OSError as exc:
                raise LinkError(f"sending to {self.peer}: {exc}") from None

    def send_frame(self, frame: Frame) -> None:
        self.send(frame.kind, frame.doc, frame.payload)

    def recv(
        self, max_doc: int = MAX_DOC, max_payload: int = MAX_PAYLOAD, deadline: float | None = None
    ) -> Frame:
        """The next frame (blocks up to the socket's timeout, or until the monotonic
        ``deadline`` for the whole frame: then LinkSilent). A frame whose header announces
        more than ``max_doc``/``max_payload`` bytes is refused before any of it is read (its
        MAC comes last)."""
        try:
            seq, size, psize = HEADER.unpack(_recv_exact(self.sock, HEADER.size, deadline))
            if size > max_doc or psize > max_payload:
                raise LinkError(
                    f"a frame larger than any phalanx sends here ({size} + {psize} bytes "
                    f"announced, at most {max_doc} + {max_payload})",
                    rejected=True,
                )
            body = _recv_exact(self.sock, size, deadline)
            payload = _recv_exact(self.sock, psize, deadline)
            mac = _recv_exact(self.sock, MAC_SIZE, deadline)
        except TimeoutError:
            raise LinkSilent(f"no word from {self.peer}") from None
        except OSError as exc:
            raise LinkError(f"reading from {self.peer}: {exc}") from None
        if not hmac.compare_digest(mac, _mac(self.key, seq, body, payload)):
            raise LinkError("a frame with a bad MAC (not this run's token)", rejected=True)
        if seq != self.received + 1:
            raise LinkError(f"frame {seq} where {self.received + 1} was due (a replay)", True)
        self.received = seq
        self.last_heard = time.monotonic()
        try:
            doc = json.loads(body)
            return Frame(str(doc["kind"]), dict(doc["doc"]), payload)
        except (ValueError, KeyError, TypeError):
            raise LinkError("a frame that is not a phalanx document", rejected=True) from None

    def start(self) -> None:
        """Read frames in a thread into :attr:`inbox` until the link fails (the LinkError is
        the last item). The thread's reads block (a timeout in the middle of a frame would
        lose its first bytes): the owner judges silence from :attr:`last_heard` and closes
        the link, which ends the read. Once: a second call does nothing."""
        if self.started:
            return
        self.started = True
        self.sock.settimeout(None)
        threading.Thread(target=self._read_loop, daemon=True, name=f"link-{self.peer}").start()

    def _read_loop(self) -> None:
        while not self.closed:
            try:
                self.inbox.put(self.recv())
            except LinkError as exc:
                self.inbox.put(exc)
                self.close()
                return

    def next(self, timeout: float) -> Frame | LinkError | None:
        """The next item of :attr:`inbox` within ``timeout`` seconds, else None (one at a
        time: what follows stays for the next reader)."""
        try:
            return self.inbox.get(timeout=timeout)
        except queue.Empty:
            return None

    def drain(self) -> list[Frame | LinkError]:
        items: list[Frame | LinkError] = []
        with contextlib.suppress(queue.Empty):
            while True:
                items.append(self.inbox.get_nowait())
        return items

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.sock.close()


@dataclass
class Listener:
    """The head's listening socket for node agents: accepts and checks connections in a
    thread each; good ones wait in :attr:`joined`, rejected ones in :attr:`rejected` (address,
    why) for one warning each. At most :data:`MAX_UNPROVEN` connections prove themselves at
    once: a newer one pushes out the oldest (named once per address: a flood is one warning,
    not thousands). A failed ``accept`` is put in :attr:`troubles` (once per kind of error)
    and the loop goes on; only :meth:`close` ends it."""

    sock: socket.socket
    token: bytes = field(repr=False)
    joined: queue.Queue[tuple[Link, Frame]] = field(default_factory=queue.Queue)
    rejected: queue.Queue[tuple[str, str]] = field(default_factory=queue.Queue)
    troubles: queue.Queue[str] = field(default_factory=queue.Queue)
    closed: bool = False
    # The connections proving themselves now, oldest first; those pushed out of that place.
    unproven: list[socket.socket] = field(default_factory=list)
    pushed_out: set[socket.socket] = field(default_factory=set)
    named: set[str] = field(default_factory=set)  # hosts warned about for being pushed out
    troubled: set[str] = field(default_factory=set)  # kinds of accept error told already
    lock: threading.Lock = field(default_factory=threading.Lock)
    timing: Timing = DEFAULT  # the run's: its handshake and accept_retry

    @classmethod
    def open(cls, host: str, port: int, token: bytes, timing: Timing = DEFAULT) -> Listener:
        sock = socket.create_server((host, port), reuse_port=False)
        listener = cls(sock, token, timing=timing)
        threading.Thread(target=listener._accept_loop, daemon=True, name="px-listener").start()
        return listener

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])

    def _accept_loop(self) -> None:
        while not self.closed:
            try:
                conn, addr = self.sock.accept()
            except OSError as exc:
                if self.closed:
                    return
                self._trouble(exc)  # (out of descriptors, a connection reset before it was
                time.sleep(self.timing.accept_retry.total_seconds())  # taken: try again)
                continue
            self._admit(conn, addr)

    def _admit(self, conn: socket.socket, addr: Any) -> None:
        """Give ``conn`` its own thread to prove itself in, pushing out the oldest
        connection that is still proving itself when :data:`MAX_UNPROVEN` are."""
        with self.lock:
            self.unproven.append(conn)
            oldest = self.unproven.pop(0) if len(self.unproven) > MAX_UNPROVEN else None
            if oldest is not None:
                self.pushed_out.add(oldest)
        if oldest is not None:  # (its thread's read ends now, and reports it)
            with contextlib.suppress(OSError):
                oldest.shutdown(socket.SHUT_RDWR)
        try:
            thread = threading.Thread(target=self._check, args=(conn, addr), daemon=True)
            thread.start()
        except RuntimeError as exc:  # (no thread to be had: out of resources)
            self._done(conn)
            conn.close()
            self._trouble(exc)

    def _check(self, conn: socket.socket, addr: Any) -> None:
        address = f"{addr[0]}:{addr[1]}"
        try:
            link, hello = Link.accept(conn, self.token, self.timing.handshake)
        except (LinkError, OSError) as exc:
            if self._done(conn):
                self._pushed_out(addr[0], address)
            else:
                self.rejected.put((address, str(exc)))
            return
        if self._done(conn):  # (pushed out as it finished: its socket is shut, it retries)
            link.close()
            self._pushed_out(addr[0], address)
        else:
            self.joined.put((link, hello))

    def _pushed_out(self, host: str, address: str) -> None:
        with self.lock:
            if host in self.named:
                return
            self.named.add(host)
        why = (
            f"more than {MAX_UNPROVEN} connections were proving themselves at once: the "
            "oldest are closed (no further warning for this address)"
        )
        self.rejected.put((address, why))

    def _done(self, conn: socket.socket) -> bool:
        """``conn`` no longer proves itself; whether it had been pushed out."""
        with self.lock:
            if conn in self.unproven:
                self.unproven.remove(conn)
            pushed = conn in self.pushed_out
            self.pushed_out.discard(conn)
        return pushed

    def _trouble(self, exc: BaseException) -> None:
        kind = type(exc).__name__ + (f" {exc.errno}" if isinstance(exc, OSError) else "")
        if kind not in self.troubled:
            self.troubled.add(kind)
            self.troubles.put(f"{type(exc).__name__}: {exc}")

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):  # (wakes the accept loop: it ends)
            self.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.sock.close()
        while True:  # (hellos nobody answered: their nodes see the link close, not a wait)
            try:
                link, _ = self.joined.get_nowait()
            except queue.Empty:
                return
            link.close()


def address_towards(host: str, port: int) -> str:
    """This machine's address on the route to ``host`` (the interface the other nodes
    reach it on; no packet is sent)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))
        return str(probe.getsockname()[0])
