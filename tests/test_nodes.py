"""Across machines, without processes: the link's checks (token, MAC, replay), worker
messages as data, the coordinator's rule for a lost node, and the run's token file."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import stat
import threading
import time
import tracemalloc
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import phalanx as px
from phalanx.data import fingerprint
from phalanx.errors import NoTokenError
from phalanx.events import Notice, StepEnded
from phalanx.failures import WorkerFailure
from phalanx.plan import Plan
from phalanx.strategies.ddp.coordinator.actions import Announce, Record, SetAbort, Spawn
from phalanx.strategies.ddp.coordinator.coordinator import (
    Exited,
    NodeCoordinator,
    NodeLost,
    Received,
    Spawned,
)
from phalanx.strategies.ddp.coordinator.nodeplan import disagreements
from phalanx.strategies.ddp.coordinator.roster import Now, Setup
from phalanx.strategies.ddp.nodes.hub import NodeHub
from phalanx.strategies.ddp.nodes.shared import head_token, node_token
from phalanx.strategies.ddp.timing import DEFAULT, Timing
from phalanx.strategies.ddp.wire.control import Signer
from phalanx.strategies.ddp.wire.link import (
    HEADER,
    MAX_UNPROVEN,
    Frame,
    Link,
    LinkError,
    Listener,
)
from phalanx.strategies.ddp.wire.protocol import (
    Aborted,
    Broke,
    Done,
    Failed,
    Joined,
    Progress,
    Ready,
    Rejected,
    Relay,
    Snapshotted,
    from_wire,
    to_wire,
)

TOKEN = b"the run's token"
HELLO = Frame("hello", {"node": 1})  # (a hello as the link carries it)


# -- the link -------------------------------------------------------------------------------
def listener() -> Listener:
    return Listener.open("127.0.0.1", 0, TOKEN)


def test_a_node_with_the_token_is_heard_both_ways() -> None:
    lis = listener()
    try:
        link, answer = None, None

        def head() -> None:
            peer, hello = lis.joined.get(timeout=10)
            assert hello.doc == {"node": 1}
            peer.send("welcome", {"devices": ["cpu:0"]}, b"\x00payload")
            peer.start()
            peer.send("beat", {})

        t = threading.Thread(target=head)
        t.start()
        link, answer = Link.connect(("127.0.0.1", lis.port), TOKEN, HELLO, 10)
        t.join(10)
        assert answer.kind == "welcome" and answer.payload == b"\x00payload"
        assert link.recv().kind == "beat"
        link.close()
    finally:
        lis.close()


def test_a_connection_without_the_token_is_refused_and_named() -> None:
    lis = listener()
    try:
        with pytest.raises((LinkError, OSError)):
            Link.connect(("127.0.0.1", lis.port), b"a guess", HELLO, 10)
        address, why = lis.rejected.get(timeout=10)
        assert address.startswith("127.0.0.1:") and "bad MAC" in why
        assert lis.joined.empty()
        raw = socket.create_connection(("127.0.0.1", lis.port))  # not phalanx at all
        raw.sendall(b"GET / HTTP/1.1\r\n\r\n" + b" " * 20)
        address, why = lis.rejected.get(timeout=10)
        assert "not a phalanx node" in why
        raw.close()
    finally:
        lis.close()


def test_a_peer_without_the_token_cannot_make_the_head_read_a_huge_frame() -> None:
    """The MAC comes after the frame: before the token is proved, a hello's header that
    announces gigabytes is refused at once, not read into memory."""
    lis = listener()
    try:
        raw = socket.create_connection(("127.0.0.1", lis.port))
        raw.sendall(b"px-link/1" + b"n" * 16)
        assert len(raw.recv(16)) == 16  # the head's nonce
        raw.sendall(HEADER.pack(1, 100, 1 << 31))  # 2 GiB
        address, why = lis.rejected.get(timeout=5)
        assert address.startswith("127.0.0.1:") and "larger than" in why
        assert lis.joined.empty()
        raw.close()
    finally:
        lis.close()


def head_answers(lis: Listener, answer: dict[str, Any]) -> threading.Thread:
    """The head's part for one node that joins: its hello taken, ``answer`` sent back."""

    def head() -> None:
        peer, _ = lis.joined.get(timeout=10)
        peer.send("welcome", answer)

    t = threading.Thread(target=head, daemon=True)
    t.start()
    return t


def is_closed(sock: socket.socket) -> bool:
    """Whether the other end closed ``sock`` (read at once, without waiting)."""
    sock.setblocking(False)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def test_a_flood_of_idle_connections_does_not_keep_a_node_out() -> None:
    """Connections that never prove themselves hold at most MAX_UNPROVEN places; a newer
    one pushes out the oldest at once, so a node's handshake (milliseconds) gets through
    while the flood stays open, and the flood is one warning, not one per connection."""
    lis = listener()
    flood = [socket.create_connection(("127.0.0.1", lis.port)) for _ in range(40)]
    try:
        time.sleep(0.3)  # (every one of them accepted)
        head = head_answers(lis, {"devices": ["cpu:0"]})
        started = time.monotonic()
        link, answer = Link.connect(("127.0.0.1", lis.port), TOKEN, HELLO, 10)
        joined_in = time.monotonic() - started
        head.join(10)
        assert answer.kind == "welcome" and joined_in < 2.0, joined_in
        link.close()
        time.sleep(0.3)
        # The 24 oldest were pushed out by the flood, one more by the node; the rest wait.
        open_ = [sock for sock in flood if not is_closed(sock)]
        assert len(open_) == MAX_UNPROVEN - 1
        assert open_ == flood[-(MAX_UNPROVEN - 1) :]
        address, why = lis.rejected.get(timeout=5)
        assert address.startswith("127.0.0.1:") and f"more than {MAX_UNPROVEN}" in why
        assert lis.rejected.empty()  # (once for the address, however many were pushed out)
    finally:
        for sock in flood:
            sock.close()
        lis.close()


def test_a_connection_that_drips_its_handshake_is_cut_off_at_the_deadline() -> None:
    """The deadline is the whole handshake's, not one read's: a byte every 0.2 s (each read
    well within any per-read timeout) is cut off the timing's ``handshake`` after
    connecting."""
    timing = dataclasses.replace(DEFAULT, handshake=timedelta(seconds=1))
    lis = Listener.open("127.0.0.1", 0, TOKEN, timing)
    try:
        raw = socket.create_connection(("127.0.0.1", lis.port))
        started = time.monotonic()
        raw.sendall(b"px-link/1" + b"n" * 16)
        raw.settimeout(5)
        assert len(raw.recv(16)) == 16  # the head's nonce
        raw.settimeout(0.2)
        cut_after = None
        while time.monotonic() - started < 5:
            try:
                if raw.recv(1) == b"":
                    cut_after = time.monotonic() - started
                    break
            except TimeoutError:
                raw.sendall(b"\x00")  # the next byte of a header that never ends
            except OSError:
                cut_after = time.monotonic() - started
                break
        raw.close()
        assert cut_after is not None and 0.9 <= cut_after < 2.0, cut_after
        address, why = lis.rejected.get(timeout=5)
        assert address.startswith("127.0.0.1:") and "no verified hello within 1s" in why
    finally:
        lis.close()


def test_a_joining_node_refuses_a_huge_first_frame_from_an_unproved_head() -> None:
    """A fake head (no token) answers a node's hello with a header announcing 64 MiB (the
    most a proved peer may send) and streams it: the node refuses the frame from its header,
    at once, without reading (or allocating) any of it."""
    server = socket.create_server(("127.0.0.1", 0))
    chunk = b"\x00" * (1 << 20)

    def fake_head() -> None:
        conn, _ = server.accept()
        with conn, contextlib.suppress(OSError):
            conn.recv(len(b"px-link/1") + 16)
            conn.sendall(b"h" * 16)  # its nonce
            conn.sendall(HEADER.pack(1, 64 << 20, 0))
            for _ in range(64):
                conn.sendall(chunk)

    t = threading.Thread(target=fake_head, daemon=True)
    t.start()
    tracemalloc.start()
    started = time.monotonic()
    try:
        with pytest.raises(LinkError) as info:
            Link.connect(("127.0.0.1", server.getsockname()[1]), TOKEN, HELLO, 5)
        took = time.monotonic() - started
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        server.close()
    assert info.value.rejected and "larger than" in str(info.value)
    assert str(64 << 20) in str(info.value)
    assert took < 2.0 and peak < 4 << 20, (took, peak)
    t.join(5)


def test_the_node_port_outlives_a_failed_accept(monkeypatch: pytest.MonkeyPatch) -> None:
    """Out of file descriptors (EMFILE), ``accept`` fails while a connection waits: the
    accept loop says so once (a warning note for the head's sinks) and goes on; a node that
    comes once descriptors are free again joins."""
    import resource

    lis = listener()
    hub = NodeHub(lis, 2, dataclasses.replace(DEFAULT, node=timedelta(seconds=5)))
    waiting = socket.socket()  # (made now: no descriptor can be made below)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        lowest_free = os.dup(0)
        os.close(lowest_free)
        resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))
        try:
            waiting.connect(("127.0.0.1", lis.port))
            deadline = time.monotonic() + 5
            while lis.troubles.empty() and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(3 * DEFAULT.accept_retry.total_seconds())  # (tries again: told once)
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        head = head_answers(lis, {})
        _, answer = Link.connect(("127.0.0.1", lis.port), TOKEN, HELLO, 10)
        head.join(10)
        assert answer.kind == "welcome"
        hub.poll()
        [(level, text)] = hub.notes
        assert level == "warning" and "failed to accept" in text
        assert "Too many open files" in text and "it listens on" in text
    finally:
        waiting.close()
        lis.close()


def test_a_closed_listener_stops_accepting() -> None:
    lis = listener()
    port = lis.port
    lis.close()
    time.sleep(0.2)
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2)


def pair() -> tuple[Link, Link, socket.socket]:
    a, b = socket.socketpair()
    return Link(a, b"k" * 32, "a"), Link(b, b"k" * 32, "b"), b


def test_a_frame_with_a_bad_mac_or_replayed_is_rejected() -> None:
    sender, receiver, _ = pair()
    sender.send("beat", {"n": 1})
    assert receiver.recv().doc == {"n": 1}
    # a replay: the same genuine frame again (its number is not the next one)
    sender.sent = 0
    sender.send("beat", {"n": 1})
    with pytest.raises(LinkError) as info:
        receiver.recv()
    assert info.value.rejected and "replay" in str(info.value)

    sender, receiver, _ = pair()
    body = json.dumps({"kind": "end", "doc": {"ok": False}}).encode()
    forged = HEADER.pack(1, len(body), 0) + body + b"\x00" * 32
    sender.sock.sendall(forged)
    with pytest.raises(LinkError) as info:
        receiver.recv()
    assert info.value.rejected and "bad MAC" in str(info.value)


# -- worker messages as data ----------------------------------------------------------------
FAILURE = WorkerFailure(1, 1, "cpu:1", "exception", "boom", sample_indices=[3, 4], attempt=1)


@pytest.mark.parametrize(
    "message",
    [
        Relay(Notice("hello")),
        Relay(
            StepEnded(
                epoch=0,
                step=2,
                global_step=3,
                loss=0.5,
                samples=8,
                steps_in_epoch=10,
                lr=0.1,
                samples_per_s=80.0,
            )
        ),
        Progress(1, 7, "backward", 12.5, 1),
        Failed(FAILURE, fatal=True),
        Broke(FAILURE, 3, splittable=True),
        Aborted(2, 9, True),
        Done(0, "/tmp/w.pt", [{"train/loss": 0.1}], 40, 4, None, [[0.0, 1.0, 2.0]]),
        Ready(1),
        Joined(1, 2, 30),
        Rejected(1, "gen/1", "a bad MAC", "abcd"),
        Snapshotted(2, 40, 1_000_000, 0.004),
    ],
    ids=lambda m: type(m).__name__,
)
def test_every_worker_message_crosses_as_json_and_comes_back_equal(message: object) -> None:
    assert from_wire(json.loads(json.dumps(to_wire(message)))) == message


def test_anything_else_is_not_a_message() -> None:
    for doc in ({"type": "Popen", "args": ["rm"]}, {"type": "Ready", "slot": 1, "x": 2}, {}):
        try:
            message = from_wire(doc)
        except ValueError:
            continue
        assert message == Ready(1)  # (unknown fields of a known message are left out)


# -- the coordinator: a lost node -----------------------------------------------------------
PLAN = Plan(120, 12, seed=0)


def coordinator(nodes: tuple[int, ...], recovery: px.Recovery | None = None) -> NodeCoordinator:
    devices = [f"cpu:{i}" for i in range(len(nodes))]
    timing = Timing(hang=timedelta(seconds=3))
    c = NodeCoordinator(Setup(PLAN, devices, recovery or px.Recovery(), timing, False, nodes))
    now = Now(0.0, 1000.0)
    c.start(now)
    for slot in range(len(nodes)):
        c.handle(Spawned(slot, 100 + slot), now)
    return c


def training(c: NodeCoordinator, step: int = 4) -> None:
    now = Now(1.0, 1001.0)
    for slot in range(c.world):
        c.handle(Received(slot, Ready(slot)), now)
    for slot in range(c.world):
        c.handle(Received(slot, Joined(slot, 0, 0)), now)
        c.handle(Received(slot, Progress(slot, step, "forward", 1001.0, 0)), now)


def test_a_lost_node_is_one_failure_and_the_survivors_shrink_without_its_workers() -> None:
    c = coordinator((0, 0, 1, 1))
    training(c)
    actions = c.handle(NodeLost(1, "gpu7", "no word for 10.2s"), Now(2.0, 1002.0))
    [record] = [a.failure for a in actions if isinstance(a, Record)]
    assert record.worker == 2 and record.host == "gpu7" and record.action == "shrunk"
    assert record.message.startswith("node 1 (gpu7) lost with its workers [2, 3] at step 5")
    assert record.attempt is None  # not an attempt of its step: the batch is not suspect
    [announce] = [a.announcement for a in actions if isinstance(a, Announce)]
    assert announce.members == (0, 1) and "node 1 lost" in announce.cause
    again = c.handle(NodeLost(1, "gpu7", "again"), Now(3.0, 1003.0))
    assert not [a for a in again if isinstance(a, Record | Announce)]  # once


def test_a_lost_node_stops_the_run_below_min_workers_or_before_training() -> None:
    c = coordinator((0, 1, 1), px.Recovery(min_workers=2))
    training(c)
    actions = c.handle(NodeLost(1, "h1", "its link closed"), Now(2.0, 1002.0))
    assert [a.failure.action for a in actions if isinstance(a, Record)] == ["aborted"]
    assert any(isinstance(a, SetAbort) for a in actions) and c.book.fatal
    assert "too few workers left" in " ".join(c.book.notes)

    c = coordinator((0, 1))  # still starting: no generation to go on in
    actions = c.handle(NodeLost(1, "h1", "its link closed"), Now(0.5, 1000.5))
    assert [a.failure.action for a in actions if isinstance(a, Record)] == ["aborted"]
    assert "before training began" in " ".join(c.book.notes)


# -- the token and what nodes must agree on ---------------------------------------------------
def test_the_head_writes_the_token_owner_only_and_a_node_reads_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PHALANX_TOKEN", raising=False)
    with pytest.raises(NoTokenError):
        head_token(None)
    token = head_token(str(tmp_path))
    path = tmp_path / "token"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and len(token) == 64
    assert node_token(str(tmp_path), wait=0) == token
    os.chmod(path, 0o644)
    with pytest.raises(NoTokenError, match="chmod 600"):
        node_token(str(tmp_path), wait=0)
    with pytest.raises(NoTokenError, match="is the head started"):
        node_token(str(tmp_path / "elsewhere"), wait=0)
    monkeypatch.setenv("PHALANX_TOKEN", "shared")
    assert head_token(None) == node_token(None, wait=0) == b"shared"


def test_a_leftover_token_file_does_not_widen_the_new_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A crashed head's token.tmp (mode 0644), or a link planted in its place: the new token
    is still a new file, owner-only, and nothing is written through the link."""
    monkeypatch.delenv("PHALANX_TOKEN", raising=False)
    (tmp_path / "token.tmp").write_text("old")
    os.chmod(tmp_path / "token.tmp", 0o644)
    token = head_token(str(tmp_path))
    assert stat.S_IMODE(os.stat(tmp_path / "token").st_mode) == 0o600
    assert node_token(str(tmp_path), wait=0) == token
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("")
    (tmp_path / "token.tmp").symlink_to(elsewhere)
    head_token(str(tmp_path))
    assert elsewhere.read_text() == "" and not (tmp_path / "token").is_symlink()
    assert stat.S_IMODE(os.stat(tmp_path / "token").st_mode) == 0o600


def test_nodes_that_differ_are_named_setting_by_setting() -> None:
    plan = Plan(120, 12, seed=0)
    head = {"torch": "2.13.0", "epochs": 4, "plan": plan.record()}
    assert disagreements(head, dict(head), plan) == []
    other = dict(head, epochs=5, plan=Plan(120, 12, seed=1).record())
    found = disagreements(head, other, plan)
    assert found[0] == "epochs: the head has 4, this node 5"
    assert found[1] == "plan: seed 1 on this node, 0 on the head"  # the field, not the record
    # the data: which samples differ and how, in a line, never the fingerprint's sums
    data = [torch.arange(4.0) + i for i in range(120)]
    moved = [torch.arange(4.0) + i + (0.5 if i % 2 else 0.0) for i in range(120)]
    here = Plan(120, 12, fingerprint=fingerprint(data, 120))
    there = Plan(120, 12, fingerprint=fingerprint(moved, 120))
    (line,) = disagreements({"plan": here.record()}, {"plan": there.record()}, here)
    assert line.startswith("training data: ") and "other floating-point values" in line
    assert len(line) < 600
    long = {"recovery": "Recovery(" + "x" * 2000 + ")"}
    (setting,) = disagreements(long, {"recovery": "Recovery()"}, here)
    assert len(setting) < 300


def test_a_lost_node_that_registers_again_starts_replacements_of_its_slots() -> None:
    from phalanx.strategies.ddp.coordinator.coordinator import NodeJoined

    c = coordinator((0, 1, 1))
    training(c)
    c.handle(NodeLost(1, "h1", "its link closed"), Now(2.0, 1002.0))
    assert c.admits(1) and not c.admits(0)
    actions = c.handle(NodeJoined(1, "h1b"), Now(3.0, 1003.0))
    spawned = [a for a in actions if isinstance(a, Spawn)]
    assert [a.slot for a in spawned] == [1, 2]
    assert all(a.replaces is not None and a.faults_after == 4 for a in spawned)
    assert not c.admits(1)  # back: a second registration is refused
    again = c.handle(NodeJoined(1, "h1c"), Now(4.0, 1004.0))
    assert not [a for a in again if isinstance(a, Spawn)]

    c = coordinator((0, 0, 1), px.Recovery(mode="abort"))
    training(c)
    c.handle(NodeLost(1, "h1", "its link closed"), Now(2.0, 1002.0))
    assert not c.admits(1)  # the run stopped at the fall


def test_a_lost_nodes_snapshot_is_lost_with_it() -> None:
    """Only the snapshot of a node that is lost: when the last members fall, no copy of
    the state lives (without a run_dir the run stops); one on a live node restarts the live
    nodes' slots, and the lost node's slots wait for it to register again."""
    c = coordinator((0, 1, 1))
    training(c)
    c.handle(Received(2, Snapshotted(1, 3)), Now(1.5, 1001.5))  # node 1 writes a snapshot
    c.handle(NodeLost(1, "h1", "its link closed"), Now(2.0, 1002.0))
    actions = c.handle(Exited(0, -9), Now(2.5, 1002.5))
    assert [a.failure.action for a in actions if isinstance(a, Record)] == ["aborted"]
    assert any(isinstance(a, SetAbort) for a in actions)

    c = coordinator((0, 1, 1))
    training(c)
    c.handle(Received(0, Snapshotted(0, 3)), Now(1.5, 1001.5))  # node 0's survives
    c.handle(NodeLost(1, "h1", "its link closed"), Now(2.0, 1002.0))
    actions = c.handle(Exited(0, -9), Now(2.5, 1002.5))
    assert [a.failure.action for a in actions if isinstance(a, Record)] == ["restarted"]
    assert [(a.slot, a.restart_after) for a in actions if isinstance(a, Spawn)] == [(0, 1)]
    actions = c.handle(Received(0, Ready(0)), Now(3.0, 1003.0))
    [announce] = [a.announcement for a in actions if isinstance(a, Announce)]
    assert announce.members == (0,)


def test_a_node_lost_with_the_last_members_restarts_from_a_live_snapshot() -> None:
    c = coordinator((0, 1))
    training(c)
    c.handle(Received(0, Snapshotted(0, 3)), Now(1.5, 1001.5))
    c.handle(Exited(0, -9), Now(1.8, 1001.8))  # generation 1: [1]
    actions = c.handle(NodeLost(1, "h1", "its link closed"), Now(2.0, 1002.0))
    assert [a.failure.action for a in actions if isinstance(a, Record)] == ["restarted"]
    assert [a.slot for a in actions if isinstance(a, Spawn)] == [0]


def test_workers_count_their_local_rank_on_their_own_node() -> None:
    """torchrun's variables across nodes: RANK and WORLD_SIZE over every member, LOCAL_RANK
    and LOCAL_WORLD_SIZE over this node's members (in rank order), MASTER_ADDR the head's
    store. Node 1 runs slots 2 and 3 of four."""
    from phalanx.strategies.ddp.worker.identity import torchrun_env

    def env(slot: int, members: list[int], here: tuple[int, ...]) -> tuple[str, ...]:
        e = torchrun_env(slot, members, here, "10.0.0.1", 29400)
        assert (e["MASTER_ADDR"], e["MASTER_PORT"]) == ("10.0.0.1", "29400")
        return e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"]

    node1, head = (2, 3), (0, 1)
    assert env(2, [0, 1, 2, 3], node1) == ("2", "0", "4", "2")  # cuda:0 of its node
    assert env(3, [0, 1, 2, 3], node1) == ("3", "1", "4", "2")
    assert env(1, [0, 1, 2, 3], head) == ("1", "1", "4", "2")
    # slot 0 lost and the run shrunk: ranks move down, the head has one member left
    assert env(1, [1, 2, 3], head) == ("0", "0", "3", "1")
    assert env(3, [1, 2, 3], node1) == ("2", "1", "3", "2")
    # one host: the local rank is the rank
    assert env(2, [0, 2, 3], (0, 1, 2, 3)) == ("1", "1", "3", "3")


def test_a_nodes_spawner_gives_its_workers_that_nodes_slots() -> None:
    """What a node's worker is started with: the head's store and the slots of its own node
    (from the head's answer: ``first``), which LOCAL_RANK counts."""
    import torch

    from phalanx.spec import FitConfig
    from phalanx.strategies.ddp.agent.spawner import Spawner, SpawnOrder

    class FakeAgent:
        store_at = ("10.0.0.1", 29400)
        prefix = "phalanx/r1"
        timing = DEFAULT
        tmp = "/tmp"
        signer = SimpleNamespace(token=b"t")

        def snapshot_folder(self) -> str:
            return "/dev/shm/phalanx-snap-node"

        def spawn(self, slot: int, name: str, target: object, make_args: Any) -> int:
            self.args = make_args(None, "stacks", None)
            return 1

    learner = px.Learner(torch.nn.Linear(2, 1), torch.optim.SGD, px.mse_step)
    config = FitConfig(epochs=1, batch_size=8, devices=["cpu"] * 4, strategy="ddp")
    agent = FakeAgent()
    spawner = Spawner(learner.spec, config, Plan(16, 8), (None, None, 0), agent, 2, 2)  # type: ignore[arg-type]
    spawner.spawn(SpawnOrder(slot=3))
    args = agent.args
    assert (args.slot, args.local_slots, args.here) == (3, (2, 3), (2, 3))
    assert (args.store_host, args.store_port) == ("10.0.0.1", 29400)
    assert args.store_prefix == "phalanx/r1"  # (the run's keys in a launcher's store)
    assert args.snapshot_dir == "/dev/shm/phalanx-snap-node"  # (its node agent's folder)
    one_host = Spawner(learner.spec, config, Plan(16, 8), (None, None, 0), agent, 4)  # type: ignore[arg-type]
    one_host.spawn(SpawnOrder(slot=1))
    assert agent.args.here == (0, 1, 2, 3)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_under_torchrun_the_head_uses_torchruns_agent_store_under_its_own_prefix() -> None:
    import torch.distributed as dist

    from phalanx.launch import Address, Launch
    from phalanx.strategies.ddp.nodes.hub import head_agent

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    launch = Launch("torchrun", nnodes=2, head=Address("127.0.0.1", server.port))
    env = {"TORCHELASTIC_USE_AGENT_STORE": "True"}
    agent = head_agent(launch, "127.0.0.1", b"t", "run7", env, DEFAULT)
    try:
        assert agent.client and agent.store_at == ("127.0.0.1", server.port)
        assert agent.prefix == "phalanx/run7"  # (torch joins it to each key with a /)
        agent.set_stop("test")  # lands in torchrun's store, under the run's prefix only
        # Signed (every worker reads it): written at the start, and after the stop.
        signer = Signer.for_run(b"t", "run7")
        version = bytes(server.get("phalanx/run7/control/version"))
        assert signer.open("control/version", version) == (3, "3")
        stop = bytes(server.get("phalanx/run7/control/stop"))
        assert signer.open("control/stop", stop) == (2, "test")
        assert not server.check(["control/version"])
    finally:
        agent.close()


def test_under_torchrun_without_a_shared_store_the_head_hosts_one_on_master_port() -> None:
    from phalanx.launch import Address, Launch
    from phalanx.strategies.ddp.nodes.hub import head_agent

    port = _free_port()
    launch = Launch("torchrun", nnodes=2, head=Address("127.0.0.1", port))
    agent = head_agent(launch, "127.0.0.1", b"t", "run8", {}, DEFAULT)
    try:
        assert not agent.client and agent.prefix == ""
        assert agent.store_at == ("127.0.0.1", port)  # the port torchrun set aside
    finally:
        agent.close()


def test_a_node_lost_while_a_restart_starts_leaves_the_others_to_restart() -> None:
    """Every worker fell and the restart's workers are starting when node 1 is lost: its
    slots leave the restart, which goes on with node 0's (not one more restart, nor an
    abort)."""
    c = coordinator((0, 1, 1))
    training(c)
    c.handle(Received(0, Snapshotted(0, 3)), Now(1.5, 1001.5))
    for slot in (1, 2, 0):
        actions = c.handle(Exited(slot, -9), Now(2.0, 1002.0))
    assert [a.failure.action for a in actions if isinstance(a, Record)] == ["restarted"]
    actions = c.handle(NodeLost(1, "h1", "its link closed"), Now(2.2, 1002.2))
    assert [a.failure.action for a in actions if isinstance(a, Record)] == ["shrunk"]
    assert not any(isinstance(a, Spawn | SetAbort) for a in actions)
    actions = c.handle(Received(0, Ready(0)), Now(3.0, 1003.0))
    [announce] = [a.announcement for a in actions if isinstance(a, Announce)]
    assert announce.members == (0,) and announce.timeline == announce.number
