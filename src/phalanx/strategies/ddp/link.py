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
from typing import Any

PROTOCOL = "px-link/1"
HEADER = struct.Struct("!QII")  # sequence number, document length, payload length
MAC_SIZE = 32
MAX_DOC = 64 << 20  # a document bigger than this is not one of ours
MAX_PAYLOAD = 1 << 34
# A node's hello is a small document with no payload: a peer that has not proved the token
# yet cannot make the head read more than this.
MAX_HELLO = 1 << 20
HANDSHAKE_TIMEOUT = 10.0  # seconds a new connection has to prove itself


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


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
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
        cls, address: tuple[str, int], token: bytes, hello: dict[str, Any], timeout: float
    ) -> tuple[Link, Frame]:
        """A node's side: connect, prove the token, send ``hello``; returns the link and the
        head's answer to the hello (its first frame)."""
        sock = socket.create_connection(address, timeout=timeout)
        sock.settimeout(HANDSHAKE_TIMEOUT)
        try:
            nonce = secrets.token_bytes(16)
            sock.sendall(PROTOCOL.encode() + nonce)
            head_nonce = _recv_exact(sock, 16)
            link = cls(sock, session_key(token, nonce, head_nonce), f"{address[0]}:{address[1]}")
            link.send("hello", hello)
            answer = link.recv()
        except (OSError, LinkError):
            sock.close()
            raise
        return link, answer

    @classmethod
    def accept(cls, sock: socket.socket, token: bytes) -> tuple[Link, Frame]:
        """The head's side of a new connection: the node's hello, checked. Raises LinkError
        (``rejected``) for a peer that does not hold the token."""
        sock.settimeout(HANDSHAKE_TIMEOUT)
        host, port = sock.getpeername()[:2]
        try:
            opening = _recv_exact(sock, len(PROTOCOL) + 16)
            if not opening.startswith(PROTOCOL.encode()):
                raise LinkError("not a phalanx node (no px-link/1 opening)", rejected=True)
            nonce = secrets.token_bytes(16)
            sock.sendall(nonce)
            link = cls(sock, session_key(token, opening[len(PROTOCOL) :], nonce), f"{host}:{port}")
            hello = link.recv(MAX_HELLO, 0)  # (not proved yet: no room for a huge frame)
        except (OSError, LinkError) as exc:
            sock.close()
            if isinstance(exc, LinkError) and not exc.rejected:
                raise LinkError(f"the handshake failed: {exc}", rejected=True) from None
            raise
        if hello.kind != "hello":
            sock.close()
            raise LinkError(f"expected a hello, got {hello.kind!r}", rejected=True)
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

    def recv(self, max_doc: int = MAX_DOC, max_payload: int = MAX_PAYLOAD) -> Frame:
        """The next frame (blocks up to the socket's timeout: then LinkError). A frame
        whose header announces more than ``max_doc``/``max_payload`` bytes is refused before
        any of it is read (its MAC comes last)."""
        try:
            seq, size, psize = HEADER.unpack(_recv_exact(self.sock, HEADER.size))
            if size > max_doc or psize > max_payload:
                raise LinkError("a frame larger than any phalanx sends", rejected=True)
            body = _recv_exact(self.sock, size)
            payload = _recv_exact(self.sock, psize)
            mac = _recv_exact(self.sock, MAC_SIZE)
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
    thread; good ones wait in :attr:`joined`, rejected ones in :attr:`rejected` (address,
    why) for one warning each."""

    sock: socket.socket
    token: bytes = field(repr=False)
    joined: queue.Queue[tuple[Link, Frame]] = field(default_factory=queue.Queue)
    rejected: queue.Queue[tuple[str, str]] = field(default_factory=queue.Queue)
    closed: bool = False

    @classmethod
    def open(cls, host: str, port: int, token: bytes) -> Listener:
        sock = socket.create_server((host, port), reuse_port=False)
        listener = cls(sock, token)
        threading.Thread(target=listener._accept_loop, daemon=True, name="px-listener").start()
        return listener

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])

    def _accept_loop(self) -> None:
        while not self.closed:
            try:
                conn, addr = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._check, args=(conn, addr), daemon=True).start()

    def _check(self, conn: socket.socket, addr: Any) -> None:
        try:
            self.joined.put(Link.accept(conn, self.token))
        except (LinkError, OSError) as exc:
            self.rejected.put((f"{addr[0]}:{addr[1]}", str(exc)))

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.close()
