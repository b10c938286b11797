"""What the head and each node's agent tell each other over their :class:`~.link.Link`:
one frozen dataclass per kind of frame, and one codec for all of them: :func:`encode` (a
message to a frame) and :func:`decode` (a frame to its message, every field checked). A
frame that is not one of these, or has a field missing, of the wrong type or out of range,
raises :class:`BadMessage`, which names the kind and the field. Nothing else builds or reads
a frame's document.

The head tells a node: ``welcome`` (:class:`Welcome`), ``refused`` (:class:`Refused`) or
``parked`` (:class:`Parked`) in answer to its hello; ``spawn`` (:class:`SpawnOrder`),
``kill`` (:class:`KillOrder`) and ``dump`` (:class:`DumpOrder`: stacks asked for);
``fenced`` (:class:`Fenced`: the head went on without it) and ``end`` (:class:`End`: how
the run ended). A node tells the head: ``hello`` (:class:`Hello`), ``seen``
(:class:`Seen`: what its agent saw), ``weights`` (:class:`FinalWeights`), ``spawned``
(:class:`Started`), ``stacks`` (:class:`Stacks`) and ``stop`` (:class:`StopAsked`: its
Ctrl-C). Both send ``beat`` (:class:`KeepAlive`). Bytes (the final weights) travel as the
frame's payload, never in its JSON document.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from phalanx.failures import WorkerFailure
from phalanx.launch import SPARE
from phalanx.strategies.ddp.wire.link import Frame
from phalanx.strategies.ddp.wire.protocol import from_wire, to_wire


class BadMessage(ValueError):
    """A frame that is not a message this version reads: ``kind`` and ``field`` name
    what is wrong (``field`` is ``kind`` for a kind no message has)."""

    def __init__(self, kind: str, field: str, why: str) -> None:
        super().__init__(f"a {kind!r} frame: {field}: {why}")
        self.kind, self.field, self.why = kind, field, why


# -- the head to a node -------------------------------------------------------------------
@dataclass(frozen=True)
class Heir:
    """A node in the run's succession (what the head's :class:`Welcome` and
    :class:`KeepAlive` carry): its node rank, host and devices, and the node port it
    would lead the run from (``port`` 0: none; the head's own entry has none)."""

    rank: int
    host: str
    port: int
    devices: tuple[str, ...] = ()


@dataclass(frozen=True)
class Hello:
    """A node's registration (its ``hello`` frame, read by :func:`decode`)."""

    rank: int  # the node rank it claims (-1: a spare's, or a hello the head could not read)
    host: str = "?"
    devices: tuple[str, ...] = ()
    spare: bool = False  # PHALANX_NODE_RANK=spare: it waits to take a lost node's place
    check: Mapping[str, Any] = field(default_factory=dict)  # its agreement (see nodes)
    standby: int = 0  # the node port it would lead the run from, were the head lost (0: none)


@dataclass(frozen=True)
class Welcome:
    """A node is in (at start-up, taken back, or a spare placed): its node rank, every
    slot's device, its first slot, the store's address and the run's keys' prefix there,
    and the run id its signing key is made from; the head's fencing ``term`` (in the shared
    run_dir's ``head.json``; 0: none) and the run's ``succession`` (see :class:`Heir`)."""

    node: int
    devices: tuple[str, ...]
    first: int
    store: tuple[str, int]
    prefix: str
    run: str
    term: int = 0
    succession: tuple[Heir, ...] = ()


@dataclass(frozen=True)
class Refused:
    """A hello refused (PX144), with why."""

    code: str
    message: str


@dataclass(frozen=True)
class Parked:
    """A spare is kept (its link beating) until a node is lost."""


@dataclass(frozen=True)
class Fenced:
    """The head went on without this node: it was ``silent`` that long (``limit``: the
    run's ``node_timeout``), in seconds."""

    silent: float
    limit: float


@dataclass(frozen=True)
class SpawnOrder:
    """What the coordinator's :class:`~.actions.Spawn` says: start a worker on ``slot``."""

    slot: int
    replacement: bool = False
    faults_after: int = -1
    restart_after: int | None = None


@dataclass(frozen=True)
class KillOrder:
    slot: int


@dataclass(frozen=True)
class DumpOrder:
    """Dump the stacks of these slots' workers (answered with :class:`Stacks`)."""

    slots: tuple[int, ...]


@dataclass(frozen=True)
class End:
    """How the run ended: ``ok`` with the main worker's results and its final weights (the
    payload), else the failures that stopped it (``poison``, ``notes``)."""

    ok: bool
    failures: tuple[WorkerFailure, ...] = ()
    fates: tuple[str, ...] = ()
    poison: bool = False
    notes: tuple[str, ...] = ()
    history: tuple[dict[str, Any], ...] = ()
    steps: int = 0
    epochs: int = 0
    interrupted: str | None = None
    ledger: tuple[tuple[float, ...], ...] = ()
    quarantine: tuple[tuple[int, int], ...] = ()  # (dataset index, global step)
    model_path: str | None = None  # the head's final weights file (a shared run_dir)
    weights: bytes = b""


# -- a node to the head -------------------------------------------------------------------
@dataclass(frozen=True)
class Seen:
    """What an agent saw: a message from ``slot``'s worker (``message``), or its exit
    (``code``). The head's agent hands these out; a node's sends them to the head."""

    slot: int
    message: object = None
    code: int | None = None
    exited: bool = False
    stale: bool = False  # from the process the slot's new one replaced
    # An exit: the processes the kernel's OOM killer killed on this machine while it ran
    oom_kills: int | None = None
    # The process that wrote or ended (None: unknown): the head tells a process it
    # replaced from the slot's new one when both are seen in one poll or in flight
    pid: int | None = None
    # An exit by a crash in native code: the stacks its faulthandler wrote (None: none)
    stacks: str | None = None


@dataclass(frozen=True)
class FinalWeights:
    """The main worker's final weights (a ``torch.save`` file), before its ``Done``."""

    slot: int
    weights: bytes


@dataclass(frozen=True)
class Started:
    """A worker started on ``slot`` as ordered (``pid`` None: it could not be)."""

    slot: int
    pid: int | None


@dataclass(frozen=True)
class Stacks:
    """The stacks of workers, by slot, as asked for."""

    stacks: Mapping[int, str] = field(default_factory=dict)


@dataclass(frozen=True)
class StopAsked:
    """A stop asked for on a node (its Ctrl-C), with why."""

    reason: str


# -- both ways ----------------------------------------------------------------------------
@dataclass(frozen=True)
class KeepAlive:
    """Nothing new: the link is alive. The head's carries the run's succession (every live
    node in rank order, the head first), which a node follows if the head is lost."""

    succession: tuple[Heir, ...] = ()


Message = (
    Hello
    | Welcome
    | Refused
    | Parked
    | Fenced
    | SpawnOrder
    | KillOrder
    | DumpOrder
    | End
    | Seen
    | FinalWeights
    | Started
    | Stacks
    | StopAsked
    | KeepAlive
)


# -- reading a document -------------------------------------------------------------------
class _Doc:
    """One frame's document, read field by field (each read checks its type and range)."""

    def __init__(self, kind: str, doc: Mapping[str, Any]) -> None:
        self.kind, self.doc = kind, doc

    def bad(self, name: str, why: str) -> BadMessage:
        return BadMessage(self.kind, name, why)

    def value(self, name: str) -> Any:
        if name not in self.doc:
            raise self.bad(name, "missing")
        return self.doc[name]

    def check_int(self, name: str, value: Any, least: int | None = None) -> int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise self.bad(name, f"{value!r} is not an int")
        if least is not None and value < least:
            raise self.bad(name, f"{value} is below {least}")
        return value

    def integer(self, name: str, least: int | None = None) -> int:
        return self.check_int(name, self.value(name), least)

    def maybe_integer(self, name: str, least: int | None = None) -> int | None:
        value = self.value(name)
        return None if value is None else self.check_int(name, value, least)

    def check_number(self, name: str, value: Any) -> float | int:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise self.bad(name, f"{value!r} is not a number")
        return value

    def seconds(self, name: str) -> float:
        value = float(self.check_number(name, self.value(name)))
        if not math.isfinite(value) or value < 0:
            raise self.bad(name, f"{value!r} is not a duration")
        return value

    def flag(self, name: str) -> bool:
        value = self.value(name)
        if not isinstance(value, bool):
            raise self.bad(name, f"{value!r} is not a bool")
        return value

    def check_text(self, name: str, value: Any) -> str:
        if not isinstance(value, str):
            raise self.bad(name, f"{value!r} is not a str")
        return value

    def text(self, name: str) -> str:
        return self.check_text(name, self.value(name))

    def maybe_text(self, name: str) -> str | None:
        value = self.value(name)
        return None if value is None else self.check_text(name, value)

    def check_list(self, name: str, value: Any) -> list[Any]:
        if not isinstance(value, list):
            raise self.bad(name, f"{type(value).__name__} where a list is due")
        return value

    def items(self, name: str) -> list[Any]:
        return self.check_list(name, self.value(name))

    def integers(self, name: str, least: int | None = None) -> tuple[int, ...]:
        values = self.items(name)
        return tuple(self.check_int(f"{name}[{i}]", v, least) for i, v in enumerate(values))

    def texts(self, name: str) -> tuple[str, ...]:
        values = self.items(name)
        return tuple(self.check_text(f"{name}[{i}]", v) for i, v in enumerate(values))

    def check_object(self, name: str, value: Any) -> dict[str, Any]:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise self.bad(name, f"{type(value).__name__} where a JSON object is due")
        return value

    def mapping(self, name: str) -> dict[str, Any]:
        return self.check_object(name, self.value(name))


# -- each kind ----------------------------------------------------------------------------
def _port(d: _Doc, name: str, value: Any) -> int:
    port = d.check_int(name, value, least=0)
    if port > 65535:
        raise d.bad(name, f"{port} is not a port")
    return port


def _hello(d: _Doc, payload: bytes) -> Hello:
    return Hello(
        rank=d.integer("node", least=SPARE),
        host=d.text("host"),
        devices=d.texts("devices"),
        spare=d.flag("spare"),
        check=d.mapping("check"),
        standby=_port(d, "standby", d.doc.get("standby", 0)),  # (an older node: none)
    )


def _succession(d: _Doc) -> tuple[Heir, ...]:
    """The succession a welcome or a keep-alive carries (none from an older head)."""
    if "succession" not in d.doc:
        return ()
    heirs = []
    for i, item in enumerate(d.items("succession")):
        name = f"succession[{i}]"
        doc = d.check_object(name, item)
        for key in ("node", "host", "port", "devices"):
            if key not in doc:
                raise d.bad(f"{name}.{key}", "missing")
        devices = d.check_list(f"{name}.devices", doc["devices"])
        heirs.append(
            Heir(
                rank=d.check_int(f"{name}.node", doc["node"], least=0),
                host=d.check_text(f"{name}.host", doc["host"]),
                port=_port(d, f"{name}.port", doc["port"]),
                devices=tuple(
                    d.check_text(f"{name}.devices[{j}]", v) for j, v in enumerate(devices)
                ),
            )
        )
    return tuple(heirs)


def _welcome(d: _Doc, payload: bytes) -> Welcome:
    store = d.items("store")
    if len(store) != 2:
        raise d.bad("store", f"{len(store)} items where (host, port) is due")
    host = d.check_text("store[0]", store[0])
    port = _port(d, "store[1]", store[1])
    return Welcome(
        node=d.integer("node", least=0),
        devices=d.texts("devices"),
        first=d.integer("first", least=0),
        store=(host, port),
        prefix=d.text("prefix"),
        run=d.text("run"),
        term=d.integer("term", least=0) if "term" in d.doc else 0,
        succession=_succession(d),
    )


def _fenced(d: _Doc, payload: bytes) -> Fenced:
    return Fenced(d.seconds("silent"), d.seconds("limit"))


def _spawn(d: _Doc, payload: bytes) -> SpawnOrder:
    return SpawnOrder(
        d.integer("slot", least=0),
        d.flag("replacement"),
        d.integer("faults_after", least=-1),
        d.maybe_integer("restart_after", least=-1),
    )


def _end(d: _Doc, payload: bytes) -> End:
    known = {f.name for f in fields(WorkerFailure)}
    failures = []
    for i, value in enumerate(d.items("failures")):
        name = f"failures[{i}]"
        doc = {k: v for k, v in d.check_object(name, value).items() if k in known}
        try:
            failures.append(WorkerFailure(**doc))
        except TypeError as exc:
            raise d.bad(name, str(exc)) from None
    history = tuple(d.check_object(f"history[{i}]", h) for i, h in enumerate(d.items("history")))
    ledger = []
    for i, row in enumerate(d.items("ledger")):
        row = d.check_list(f"ledger[{i}]", row)
        ledger.append(tuple(d.check_number(f"ledger[{i}][{j}]", v) for j, v in enumerate(row)))
    quarantine = []
    for i, pair in enumerate(d.items("quarantine")):
        pair = d.check_list(f"quarantine[{i}]", pair)
        if len(pair) != 2:
            raise d.bad(f"quarantine[{i}]", f"{len(pair)} items where (index, step) is due")
        quarantine.append(tuple(d.check_int(f"quarantine[{i}]", v, least=0) for v in pair))
    return End(
        ok=d.flag("ok"),
        failures=tuple(failures),
        fates=d.texts("fates"),
        poison=d.flag("poison"),
        notes=d.texts("notes"),
        history=history,
        steps=d.integer("steps", least=0),
        epochs=d.integer("epochs", least=0),
        interrupted=d.maybe_text("interrupted"),
        ledger=tuple(ledger),
        quarantine=tuple((i, g) for i, g in quarantine),
        model_path=d.maybe_text("model_path"),
        weights=payload,
    )


def _seen(d: _Doc, payload: bytes) -> Seen:
    exited, code = d.flag("exited"), d.maybe_integer("code")
    if exited and code is None:
        raise d.bad("code", "an exit without its exit code")
    message = d.value("message")
    if message is not None:
        doc = d.check_object("message", message)
        try:
            message = from_wire(doc)
        except (KeyError, TypeError, ValueError) as exc:
            raise d.bad("message", str(exc)) from None
    return Seen(
        slot=d.integer("slot", least=0),
        message=message,
        code=code,
        exited=exited,
        stale=d.flag("stale"),
        oom_kills=d.maybe_integer("oom_kills", least=0),
        pid=d.maybe_integer("pid", least=0),
        stacks=d.maybe_text("stacks"),
    )


def _stacks(d: _Doc, payload: bytes) -> Stacks:
    stacks: dict[int, str] = {}
    for key, text in d.mapping("stacks").items():
        name = f"stacks[{key!r}]"
        if not key.isdigit():  # (JSON's keys are strings: a slot's decimal digits)
            raise d.bad(name, f"{key!r} is not a slot")
        stacks[int(key)] = d.check_text(name, text)
    return Stacks(stacks)


_DECODERS: dict[str, Callable[[_Doc, bytes], Message]] = {
    "hello": _hello,
    "welcome": _welcome,
    "refused": lambda d, p: Refused(d.text("code"), d.text("message")),
    "parked": lambda d, p: Parked(),
    "fenced": _fenced,
    "spawn": _spawn,
    "kill": lambda d, p: KillOrder(d.integer("slot", least=0)),
    "dump": lambda d, p: DumpOrder(d.integers("slots", least=0)),
    "end": _end,
    "seen": _seen,
    "weights": lambda d, p: FinalWeights(d.integer("slot", least=0), p),
    "spawned": lambda d, p: Started(d.integer("slot", least=0), d.maybe_integer("pid", 0)),
    "stacks": _stacks,
    "stop": lambda d, p: StopAsked(d.text("reason")),
    "beat": lambda d, p: KeepAlive(_succession(d)),
}


def decode(frame: Frame) -> Message:
    """The message ``frame`` holds. Raises :class:`BadMessage` for anything else: a kind no
    message has, a field missing, of the wrong type or out of range (fields this version
    does not know are left out)."""
    read = _DECODERS.get(frame.kind)
    if read is None:
        raise BadMessage(frame.kind, "kind", "not a kind of message this version knows")
    return read(_Doc(frame.kind, frame.doc), frame.payload)


# -- writing ------------------------------------------------------------------------------
def _end_doc(m: End) -> dict[str, Any]:
    return {
        "ok": m.ok,
        "failures": [f.to_dict() for f in m.failures],
        "fates": list(m.fates),
        "poison": m.poison,
        "notes": list(m.notes),
        "history": list(m.history),
        "steps": m.steps,
        "epochs": m.epochs,
        "interrupted": m.interrupted,
        "ledger": [list(row) for row in m.ledger],
        "quarantine": [list(pair) for pair in m.quarantine],
        "model_path": m.model_path,
    }


def _hello_doc(m: Hello) -> dict[str, Any]:
    doc = {"node": m.rank, "host": m.host, "devices": list(m.devices), "spare": m.spare}
    return {**doc, "check": dict(m.check), "standby": m.standby}


def _heirs_doc(heirs: tuple[Heir, ...]) -> list[dict[str, Any]]:
    return [
        {"node": h.rank, "host": h.host, "port": h.port, "devices": list(h.devices)} for h in heirs
    ]


def _welcome_doc(m: Welcome) -> dict[str, Any]:
    doc = {"node": m.node, "devices": list(m.devices), "first": m.first}
    doc.update(store=list(m.store), prefix=m.prefix, run=m.run, term=m.term)
    return {**doc, "succession": _heirs_doc(m.succession)}


def _spawn_doc(m: SpawnOrder) -> dict[str, Any]:
    doc = {"slot": m.slot, "replacement": m.replacement, "faults_after": m.faults_after}
    return {**doc, "restart_after": m.restart_after}


def _seen_doc(m: Seen) -> dict[str, Any]:
    message = None if m.message is None else to_wire(m.message)
    doc = {"slot": m.slot, "exited": m.exited, "code": m.code, "stale": m.stale}
    return {**doc, "message": message, "oom_kills": m.oom_kills, "pid": m.pid, "stacks": m.stacks}


# Each message's kind and document (its payload: End's and FinalWeights' ``weights``).
_ENCODERS: dict[type, tuple[str, Callable[[Any], dict[str, Any]]]] = {
    Hello: ("hello", _hello_doc),
    Welcome: ("welcome", _welcome_doc),
    Refused: ("refused", lambda m: {"code": m.code, "message": m.message}),
    Parked: ("parked", lambda m: {}),
    Fenced: ("fenced", lambda m: {"silent": m.silent, "limit": m.limit}),
    SpawnOrder: ("spawn", _spawn_doc),
    KillOrder: ("kill", lambda m: {"slot": m.slot}),
    DumpOrder: ("dump", lambda m: {"slots": list(m.slots)}),
    End: ("end", _end_doc),
    Seen: ("seen", _seen_doc),
    FinalWeights: ("weights", lambda m: {"slot": m.slot}),
    Started: ("spawned", lambda m: {"slot": m.slot, "pid": m.pid}),
    Stacks: ("stacks", lambda m: {"stacks": {str(s): t for s, t in m.stacks.items()}}),
    StopAsked: ("stop", lambda m: {"reason": m.reason}),
    KeepAlive: ("beat", lambda m: {"succession": _heirs_doc(m.succession)}),
}


def encode(message: Message) -> Frame:
    """The frame that carries ``message`` (read back by :func:`decode`)."""
    found = _ENCODERS.get(type(message))
    if found is None:
        raise TypeError(f"not a node message: {type(message).__name__}")
    kind, doc = found
    payload = message.weights if isinstance(message, (End, FinalWeights)) else b""
    return Frame(kind, doc(message), payload)
