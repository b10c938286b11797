"""Signed control values in the store: only this run's supervisor and workers are heard.

torch's TCPStore has no authentication: any process that reaches its port reads and writes
every key. So each control value the workers act on (``gen/<n>``, ``control/stop``,
``control/abort``, the arrival keys ``arrived/g<n>/<rank>``) is an envelope: the payload, a
sequence number, and an HMAC-SHA256 with the run's token over the key's name, the sequence
number and the payload. A reader acts on a value only when its MAC checks out, it was sealed
for the key it is read from (a genuine message replayed under another key fails), and its
sequence number is not below one already accepted under that key (a replay of an older
message). Anything else (a bad MAC, not an envelope at all, a pickle) is ignored: the run
goes on, and the reader reports it once (:class:`~.protocol.Rejected`), which the supervisor
turns into one warning per rejected value (PX150).

The token (32 random bytes per run, or ``PHALANX_TOKEN``) is never used as it is: each run
signs with its own key, ``HMAC(token, "px-run/1" | run id)``, the run id fresh for every run
(:meth:`Signer.for_run`), so a value recorded from an earlier run with the same
``PHALANX_TOKEN`` does not check out in this one. That key goes to the workers in their spawn
arguments, and the run id to the nodes in the head's authenticated ``welcome``; neither goes
through the store.

``control/version``, which every worker's watch thread reads each tick to learn whether to
read the other keys, is signed too (its payload the sequence number of the head's last
write): a rogue who could set it could hide a stop, an abort or a generation from the
workers by setting the number the head writes next. ``gen/latest`` is a hint only, never
signed: a worker learns of generation n only from a verified ``gen/<n>``, walking up from
the last one it verified, and reads the counter only to report a forged announcement beyond
it. The head writes both with ``set``, never with the store's ``add`` (which fails, and
closes the client's connection, when a rogue left a value that is not a number there), and
reads nothing back. No value read from the store is parsed outside this module's readers
(:meth:`SignedStore.get`, :meth:`SignedStore.read`, :meth:`SignedStore.hint`): a value that
does not parse or verify is reported (PX150) and ignored, never raised.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from phalanx.events import Notice
from phalanx.strategies.ddp.wire.protocol import GEN_LATEST, GEN_PREFIX, Rejected

T = TypeVar("T")
TOKEN_ENV = "PHALANX_TOKEN"
ENVELOPE = "px-signed/1"
RUN_KEY = "px-run/1"


def run_token() -> bytes:
    """``PHALANX_TOKEN`` (UTF-8) when set, else 32 fresh random bytes for this run."""
    given = os.environ.get(TOKEN_ENV)
    return given.encode() if given else secrets.token_bytes(32)


def new_run_id() -> str:
    """A fresh id for one run (16 random bytes, hex): what tells its messages from another
    run's made with the same token."""
    return secrets.token_hex(16)


class Rejection(Exception):
    """A store value that is not a genuine control message of this run; says why."""


@dataclass(frozen=True)
class Signer:
    """Seals and opens control values with ``token``: one run's key (:meth:`for_run`)."""

    token: bytes = field(repr=False)

    @classmethod
    def for_run(cls, token: bytes, run_id: str) -> Signer:
        """The signer of run ``run_id``: its key is ``HMAC(token, "px-run/1" | run_id)``, so a
        value signed in another run with the same token (a fixed ``PHALANX_TOKEN``) is
        rejected, as a replay from that run would be."""
        key = hmac.new(token, f"{RUN_KEY}|{run_id}".encode(), hashlib.sha256).digest()
        return cls(key)

    def _mac(self, key: str, seq: int, payload: str) -> str:
        message = json.dumps([key, seq, payload]).encode()
        return hmac.new(self.token, message, hashlib.sha256).hexdigest()

    def seal(self, key: str, payload: str, seq: int) -> str:
        mac = self._mac(key, seq, payload)
        return json.dumps({"format": ENVELOPE, "seq": seq, "payload": payload, "mac": mac})

    def open(self, key: str, raw: bytes) -> tuple[int, str]:
        """(seq, payload) of a value sealed for ``key``; :class:`Rejection` otherwise."""
        try:
            doc = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise Rejection("not a signed control message") from None
        if not isinstance(doc, dict) or doc.get("format") != ENVELOPE:
            raise Rejection("not a signed control message")
        seq, payload, mac = doc.get("seq"), doc.get("payload"), doc.get("mac")
        if type(seq) is not int or not isinstance(payload, str) or not isinstance(mac, str):
            raise Rejection("a malformed envelope")
        if not hmac.compare_digest(mac, self._mac(key, seq, payload)):
            raise Rejection("a bad MAC: not signed with this run's token for this key")
        return seq, payload


def digest(raw: bytes) -> str:
    """A short name of a raw value, so the same rejected value is reported once."""
    return hashlib.sha256(raw).hexdigest()[:16]


@dataclass
class SignedStore:
    """A worker's view of the control keys on one store client: signed writes, checked
    reads. ``report(key, reason, digest)`` is called once per rejected value."""

    store: Any
    signer: Signer
    report: Callable[[str, str, str], None]
    accepted: dict[str, int] = field(default_factory=dict)  # key -> highest seq accepted
    rejected: set[tuple[str, str]] = field(default_factory=set)  # (key, digest) reported

    def set(self, key: str, payload: str, seq: int) -> None:
        self.store.set(key, self.signer.seal(key, payload, seq))

    def get(self, key: str) -> str | None:
        """The verified payload under ``key``, or None (absent, or rejected and reported)."""
        raw = self._raw(key)
        if raw is None:
            return None
        try:
            seq, payload = self.signer.open(key, raw)
            if seq < self.accepted.get(key, seq):
                raise Rejection(f"a replay of an older message (seq {seq})")
        except Rejection as exc:
            self._reject(key, str(exc), raw)
            return None
        self.accepted[key] = seq
        return payload

    def read(self, key: str, parse: Callable[[str], T]) -> T | None:
        """``parse`` of the verified payload under ``key``, or None: absent, rejected, or a
        signed payload that ``parse`` refuses (reported as well: only a bug of the head's
        could write one, and the reader must not die of it)."""
        payload = self.get(key)
        if payload is None:
            return None
        try:
            return parse(payload)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raw = payload.encode()
            self._reject(key, f"a signed value that does not parse ({type(exc).__name__})", raw)
            return None

    def hint(self, key: str) -> int | None:
        """The number under an unsigned counter (``gen/latest``), or None: absent, or not a
        number (reported once, as a rejected value: a counter is only a hint)."""
        raw = self._raw(key)
        if raw is None:
            return None
        try:
            return int(raw)
        except ValueError:
            self._reject(key, "not a number (a counter the head writes)", raw)
            return None

    def _raw(self, key: str) -> bytes | None:
        if not self.store.check([key]):
            return None
        return bytes(self.store.get(key))

    def _reject(self, key: str, reason: str, raw: bytes) -> None:
        name = digest(raw)
        if (key, name) not in self.rejected:
            self.rejected.add((key, name))
            self.report(key, reason, name)

    def all_present(self, keys: list[str]) -> bool:
        """Every key holds a verified value."""
        return self.store.check(keys) and all(self.get(k) is not None for k in keys)


def latest_generation(store: SignedStore, known: int) -> int:
    """The newest generation announced, by verified ``gen/<n>`` only: announcements are
    numbered one after another, so walk up from ``known`` while the next one checks out.
    The counter is a hint: when it points past that, its ``gen/<n>`` is read too, only so a
    forged one is reported (a counter that is not a number is reported and ignored)."""
    n = known
    while store.get(f"{GEN_PREFIX}{n + 1}") is not None:
        n += 1
    hint = store.hint(GEN_LATEST)
    if hint is not None and hint > n + 1:
        store.get(f"{GEN_PREFIX}{hint}")
    return n


def rejected_notice(msg: Rejected) -> Notice:
    """The supervisor's one warning for a rejected control value (PX150)."""
    return Notice(
        f"PX150: ignored a control message under store key {msg.key!r} that is not this "
        f"run's ({msg.reason}; value {msg.digest}, first read by worker {msg.slot}; the "
        "address it came from is unknown: torch's store does not record who writes a key). "
        "The run goes on. See `phalanx explain PX150`.",
        level="warning",
    )
