"""The messages between the head and the nodes, as tables: every kind crosses the link (as
JSON, its bytes as the payload) and comes back equal; a document with a field missing, of
the wrong type or out of range, or of a kind no message has, is refused with the kind and
the field named."""

from __future__ import annotations

import ast
import json
import math
import typing
from pathlib import Path
from typing import Any

import pytest

from phalanx.failures import WorkerFailure
from phalanx.launch import SPARE
from phalanx.strategies.ddp.wire.link import Frame
from phalanx.strategies.ddp.wire.messages import (
    BadMessage,
    DumpOrder,
    End,
    Fenced,
    FinalWeights,
    Heir,
    Hello,
    KeepAlive,
    KillOrder,
    Message,
    Parked,
    Refused,
    Seen,
    SpawnOrder,
    Stacks,
    Started,
    StopAsked,
    Welcome,
    decode,
    encode,
)
from phalanx.strategies.ddp.wire.protocol import Done, Progress

FAILURE = WorkerFailure(
    worker=2, rank=1, device="cpu:2", kind="crash", message="killed", host="gpu7", time=5.0
)
DONE = Done(0, "/tmp/w.pt", [{"train/loss": 0.1}], 40, 4, None, [[0, 1, 2, 0.5]], [[7, 3]])
OK = End(
    ok=True,
    failures=(FAILURE,),
    fates=("worker 2's replacement joined",),
    history=({"epoch": 1, "train/loss": 0.25},),
    steps=40,
    epochs=4,
    ledger=((0, 1, 2, 0.5), (0, 2, 3, 0.25)),
    quarantine=((7, 3),),
    model_path="/shared/run/model.pt",
    weights=b"\x00PK weights",
)
FAILED = End(ok=False, failures=(FAILURE,), poison=True, notes=("a poison batch",))

EXAMPLES: list[Message] = [
    Hello(1, "gpu7", ("cuda:0",), False, {"torch": "2.13.0", "plan": {"n": 1}}),
    Hello(SPARE, "gpu9", ("cpu:0",), True, {}),
    Hello(2, "gpu8", ("cpu:0",), False, {}, standby=40001),
    Welcome(2, ("cpu:0", "cpu:1", "cuda:0"), 2, ("10.0.0.1", 29400), "phalanx/r1", "run-7"),
    Welcome(1, ("cpu:0", "cpu:0"), 1, ("h", 1), "", "run-8", 3, (Heir(0, "n0", 0, ("cpu:0",)),)),
    Refused("PX144", "nodes disagree: epochs: the head has 4, this node 5"),
    Parked(),
    Fenced(12.5, 10.0),
    SpawnOrder(3),
    SpawnOrder(3, replacement=True, faults_after=7, restart_after=2),
    KillOrder(0),
    DumpOrder((2, 3)),
    OK,
    FAILED,
    Seen(2, Progress(2, 7, "backward", 12.5, 1)),
    Seen(3, DONE, stale=True),
    Seen(2, code=-9, exited=True, oom_kills=1, pid=4242),
    FinalWeights(0, b"\x00\x01 any bytes"),
    Started(3, 4242),
    Started(3, None),
    Stacks({2: "Thread 0x1 (most recent call first):", 3: ""}),
    StopAsked("SIGINT"),
    KeepAlive(),
    KeepAlive((Heir(0, "gpu7", 0, ("cuda:0",)), Heir(2, "gpu8", 40001, ("cuda:0", "cuda:1")))),
]


def across(frame: Frame) -> Frame:
    """``frame`` as the other end reads it: its document through JSON, its payload as is."""
    return Frame(frame.kind, json.loads(json.dumps(frame.doc)), frame.payload)


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_crosses_the_link_and_comes_back_equal(message: Message) -> None:
    frame = encode(message)
    assert decode(across(frame)) == message
    held = frame.payload
    assert held == getattr(message, "weights", b"")  # (bytes never in the document)


def test_every_kind_of_message_has_an_example() -> None:
    assert {type(m) for m in EXAMPLES} == set(typing.get_args(Message))
    kinds = {encode(m).kind for m in EXAMPLES}
    assert len(kinds) == len(typing.get_args(Message))  # (one kind a message, both ways)


def test_what_each_kind_is_called_on_the_wire() -> None:
    kinds = {type(m).__name__: encode(m).kind for m in EXAMPLES}
    assert kinds == {
        "Hello": "hello",
        "Welcome": "welcome",
        "Refused": "refused",
        "Parked": "parked",
        "Fenced": "fenced",
        "SpawnOrder": "spawn",
        "KillOrder": "kill",
        "DumpOrder": "dump",
        "End": "end",
        "Seen": "seen",
        "FinalWeights": "weights",
        "Started": "spawned",
        "Stacks": "stacks",
        "StopAsked": "stop",
        "KeepAlive": "beat",
    }


def test_the_failover_fields_left_out_read_as_none() -> None:
    """A hello without a node port, a welcome without a term or succession and a bare
    keep-alive (what a node or head without the failover sends) read as "no failover"."""
    hello = {k: v for k, v in encode(EXAMPLES[2]).doc.items() if k != "standby"}
    assert decode(Frame("hello", hello)).standby == 0  # type: ignore[union-attr]
    welcome = {k: v for k, v in encode(EXAMPLES[4]).doc.items() if k not in ("term", "succession")}
    read = decode(Frame("welcome", welcome))
    assert isinstance(read, Welcome) and (read.term, read.succession) == (0, ())
    assert decode(Frame("beat", {})) == KeepAlive()


def test_fields_this_version_does_not_know_are_left_out() -> None:
    frame = encode(KillOrder(4))
    assert decode(Frame("kill", {**frame.doc, "later": [1, 2]})) == KillOrder(4)
    frame = encode(FAILED)
    failures = [{**FAILURE.to_dict(), "later": 1}]
    assert decode(Frame("end", {**frame.doc, "failures": failures})) == FAILED


# -- what is refused ------------------------------------------------------------------------
GONE = object()  # the field is left out of the document


def doc_of(kind: str) -> dict[str, Any]:
    """A good document of ``kind`` (the first example's)."""
    return dict(next(f.doc for f in map(encode, EXAMPLES) if f.kind == kind))


MALFORMED = [
    # (the kind, what is changed in a good document, the field named)
    ("hello", {"node": GONE}, "node"),
    ("hello", {"node": "1"}, "node"),
    ("hello", {"node": -2}, "node"),
    ("hello", {"node": 1.0}, "node"),
    ("hello", {"host": None}, "host"),
    ("hello", {"devices": "cpu:0"}, "devices"),
    ("hello", {"devices": ["cpu:0", 1]}, "devices[1]"),
    ("hello", {"spare": "no"}, "spare"),
    ("hello", {"check": None}, "check"),
    ("welcome", {"node": -1}, "node"),
    ("welcome", {"first": -1}, "first"),
    ("welcome", {"store": ["10.0.0.1"]}, "store"),
    ("welcome", {"store": ["10.0.0.1", "29400"]}, "store[1]"),
    ("welcome", {"store": ["10.0.0.1", 70000]}, "store[1]"),
    ("welcome", {"store": [None, 29400]}, "store[0]"),
    ("welcome", {"run": GONE}, "run"),
    ("welcome", {"prefix": 3}, "prefix"),
    ("welcome", {"term": -1}, "term"),
    ("welcome", {"succession": {}}, "succession"),
    ("welcome", {"succession": [3]}, "succession[0]"),
    ("welcome", {"succession": [{"node": 1, "host": "h", "port": 1}]}, "succession[0].devices"),
    (
        "beat",
        {"succession": [{"node": -1, "host": "h", "port": 1, "devices": []}]},
        "succession[0].node",
    ),
    (
        "beat",
        {"succession": [{"node": 1, "host": "h", "port": 1 << 20, "devices": []}]},
        "succession[0].port",
    ),
    (
        "beat",
        {"succession": [{"node": 1, "host": "h", "port": 2, "devices": [0]}]},
        "succession[0].devices[0]",
    ),
    ("hello", {"standby": -1}, "standby"),
    ("refused", {"message": GONE}, "message"),
    ("refused", {"code": 144}, "code"),
    ("fenced", {"silent": "long"}, "silent"),
    ("fenced", {"limit": math.inf}, "limit"),
    ("fenced", {"limit": True}, "limit"),
    ("fenced", {"silent": -1.0}, "silent"),
    ("spawn", {"slot": -1}, "slot"),
    ("spawn", {"slot": GONE}, "slot"),
    ("spawn", {"replacement": 1}, "replacement"),
    ("spawn", {"faults_after": -2}, "faults_after"),
    ("spawn", {"restart_after": "2"}, "restart_after"),
    ("kill", {"slot": True}, "slot"),
    ("kill", {"slot": "0"}, "slot"),
    ("kill", {"slot": GONE}, "slot"),
    ("dump", {"slots": 3}, "slots"),
    ("dump", {"slots": [2, -3]}, "slots[1]"),
    ("end", {"ok": GONE}, "ok"),
    ("end", {"ok": "yes"}, "ok"),
    ("end", {"failures": [{"worker": 1}]}, "failures[0]"),
    ("end", {"failures": ["crash"]}, "failures[0]"),
    ("end", {"steps": -1}, "steps"),
    ("end", {"epochs": None}, "epochs"),
    ("end", {"history": [3]}, "history[0]"),
    ("end", {"ledger": [[0, 1, "x"]]}, "ledger[0][2]"),
    ("end", {"ledger": [5]}, "ledger[0]"),
    ("end", {"quarantine": [[7]]}, "quarantine[0]"),
    ("end", {"quarantine": [[7, -1]]}, "quarantine[0]"),
    ("end", {"interrupted": 1}, "interrupted"),
    ("end", {"model_path": ["/x"]}, "model_path"),
    ("end", {"fates": [None]}, "fates[0]"),
    ("seen", {"slot": -1}, "slot"),
    ("seen", {"exited": True, "code": None}, "code"),
    ("seen", {"code": "9"}, "code"),
    ("seen", {"message": {"type": "Popen", "args": ["rm"]}}, "message"),
    ("seen", {"message": {"type": "Failed", "failure": 3}}, "message"),
    ("seen", {"message": "Ready"}, "message"),
    ("seen", {"stale": None}, "stale"),
    ("seen", {"oom_kills": -1}, "oom_kills"),
    ("weights", {"slot": "0"}, "slot"),
    ("spawned", {"slot": GONE}, "slot"),
    ("spawned", {"pid": -5}, "pid"),
    ("stacks", {"stacks": []}, "stacks"),
    ("stacks", {"stacks": {"x": "text"}}, "stacks['x']"),
    ("stacks", {"stacks": {"-1": "text"}}, "stacks['-1']"),
    ("stacks", {"stacks": {"2": 5}}, "stacks['2']"),
    ("stop", {"reason": None}, "reason"),
]


@pytest.mark.parametrize(("kind", "change", "field"), MALFORMED)
def test_a_malformed_document_is_refused_naming_its_kind_and_field(
    kind: str, change: dict[str, Any], field: str
) -> None:
    doc = doc_of(kind)
    for key, value in change.items():
        if value is GONE:
            del doc[key]
        else:
            doc[key] = value
    with pytest.raises(BadMessage) as info:
        decode(Frame(kind, doc))
    assert (info.value.kind, info.value.field) == (kind, field)
    assert f"{kind!r}" in str(info.value) and field in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("kind", ["", "Stacks", "exec", "spawned "])
def test_a_kind_no_message_has_is_refused(kind: str) -> None:
    with pytest.raises(BadMessage) as info:
        decode(Frame(kind, {"slot": 0}))
    assert (info.value.kind, info.value.field) == (kind, "kind")


def test_only_the_codec_builds_or_reads_a_frames_document() -> None:
    """Outside messages.py (and the link, which carries frames), no module of the strategy
    builds a Frame, reads its ``doc`` or sends a kind by name."""
    ddp = Path(__file__).resolve().parent.parent / "src" / "phalanx" / "strategies" / "ddp"
    found = []
    for path in sorted(ddp.rglob("*.py")):
        if path.name in ("messages.py", "link.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "doc":
                found.append(f"{path.name}:{node.lineno} .doc")
            elif isinstance(node, ast.Call):
                name = getattr(node.func, "attr", getattr(node.func, "id", ""))
                literal = node.args and isinstance(node.args[0], ast.Constant)
                if name == "Frame" or (name == "send" and literal):
                    found.append(f"{path.name}:{node.lineno} {name}(...)")
    assert not found, found


class FakeLink:
    def __init__(self) -> None:
        self.sent: list[Message] = []
        self.closed = False

    def send_frame(self, frame: Frame) -> None:
        self.sent.append(decode(frame))

    def close(self) -> None:
        self.closed = True


def test_a_hello_the_head_cannot_read_is_refused_saying_why() -> None:
    """As a node of no rank that says nothing (the same rule refuses it): during the run
    the supervisor warns, at start-up the head fails too (PX144)."""
    from types import SimpleNamespace

    from phalanx.errors import NodesDisagreeError
    from phalanx.plan import Plan
    from phalanx.strategies.ddp.nodes.hub import NodeHub
    from phalanx.strategies.ddp.timing import DEFAULT

    hub = NodeHub(SimpleNamespace(), 2, DEFAULT)  # type: ignore[arg-type]
    hub.check, hub.plan = {}, Plan(120, 12, seed=0)
    link = FakeLink()
    unread = Frame("hello", {**doc_of("hello"), "node": "1"})
    found = hub._hello(link, unread, admits=lambda rank: True)  # type: ignore[arg-type]
    assert found is not None
    node, why = found
    assert node.rank == -1 and why.startswith("nodes disagree: a 'hello' frame: node: '1'")
    assert link.sent == [Refused("PX144", why)] and link.closed
    with pytest.raises(NodesDisagreeError, match="'hello' frame: node"):
        hub._hello(FakeLink(), unread)  # type: ignore[arg-type]


def test_a_run_end_with_a_nan_in_its_record_still_crosses() -> None:
    """A NaN loss is a legitimate record (JSON as Python writes it carries it)."""
    end = End(ok=True, history=({"train/loss": math.nan},), ledger=((0, 1, 2, math.nan),))
    back = decode(across(encode(end)))
    assert isinstance(back, End)
    assert math.isnan(back.history[0]["train/loss"]) and math.isnan(back.ledger[0][3])
