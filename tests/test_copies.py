"""Copies of fsdp members' shard snapshots on another machine (phalanx.snapshot.copies):
the buddy each member sends to, the authenticated transport into the other machine's
snapshot store, the two buffers there, and the gate before a vote. In-process, over
loopback sockets; the multi-node runs that lose a node are in test_multinode.py."""

from __future__ import annotations

import socket
import tempfile
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import phalanx as px
from phalanx.snapshot import SnapshotStore, Snapshotter
from phalanx.snapshot.copies import (
    MAGIC,
    MAX_PROVING,
    Copied,
    CopyListener,
    CopySender,
    Endpoint,
    buddies,
    copy_folder,
)
from phalanx.snapshot.shards import ShardSet, Written, newest_set, tag
from phalanx.snapshot.store import Header

KEY = b"k" * 32
TIMEOUT = 20.0


def state(step: int, rows: int = 300) -> dict[str, Any]:
    torch.manual_seed(step)
    return {
        "model": {"w": torch.randn(rows, 70), "b": torch.arange(5.0)},
        "optimizer": {"state": {0: {"exp_avg": torch.randn(rows, 70)}}, "param_groups": []},
        "loop": {"global_step": step, "epoch": 1, "ledger": [[0.0, 1.0]]},
    }


def written(store: SnapshotStore, step: int, tag: int = 7) -> Header:
    writing = store.begin(state(step), tag)
    writing.finish()
    return writing.header


@pytest.fixture
def ends(tmp_path: Path) -> Any:
    """A member's own store (the sender's machine) and a listener (the buddy's machine)."""
    own = SnapshotStore(str(tmp_path / "own"))
    (tmp_path / "own").mkdir()
    (tmp_path / "there").mkdir()
    listener = CopyListener(str(tmp_path / "there"), KEY, "127.0.0.1", TIMEOUT, TIMEOUT)
    listener.begin(3)
    yield own, listener, tmp_path / "there"
    listener.close()
    own.close()


def sender(listener: CopyListener, key: bytes = KEY, start: int = 0, slot: int = 5) -> CopySender:
    return CopySender(listener.endpoint, key, 3, slot, start, TIMEOUT)


@pytest.mark.parametrize(
    ("places", "expected"),
    [
        (["a", "b"], [1, 0]),
        (["a", "a", "b", "b"], [2, 2, 0, 0]),
        (["a", "a", "b"], [2, 2, 0]),
        (["a", "b", "a", "b"], [1, 2, 3, 0]),
        (["a", "a"], [None, None]),  # (one machine: no copy would survive its loss)
        (["a"], [None]),
    ],
)
def test_each_member_copies_to_the_next_member_on_another_machine(
    places: list[str], expected: list[int | None]
) -> None:
    assert buddies(places) == expected


def test_a_copy_arrives_whole_and_reads_back_as_the_original(ends: Any) -> None:
    own, listener, there = ends
    header = written(own, 12)
    out = sender(listener)
    out.start(own, header)
    out.wait()
    done, error = out.outcome()
    assert error is None and isinstance(done, Copied) and done.step == 12
    assert done.nbytes == header.data_end + header.skeleton_bytes
    copy = SnapshotStore(copy_folder(str(there), 5))
    snap, mine = copy.read(), own.read()
    assert snap is not None and mine is not None
    assert (snap.step, snap.epoch, snap.tag) == (12, 1, 7)
    for key in ("w", "b"):
        assert torch.equal(snap.state["model"][key], mine.state["model"][key])
    assert torch.equal(
        snap.state["optimizer"]["state"][0]["exp_avg"],
        mine.state["optimizer"]["state"][0]["exp_avg"],
    )
    assert out.outcome() == (None, None)  # (each told once)
    out.close()


def test_copies_alternate_buffers_and_a_copy_cut_half_way_hides_nothing(ends: Any) -> None:
    """The buddy keeps two buffers as any store: a sender lost in the middle of a copy
    leaves the last whole copy readable."""
    own, listener, there = ends
    out = sender(listener)
    for step in (2, 4, 6):
        out.start(own, written(own, step))
        out.wait()
        assert out.outcome()[1] is None
    copy = SnapshotStore(copy_folder(str(there), 5))
    assert sorted(h.step for h in copy.headers().values() if h.whole) == [4, 6]
    out.close()
    # A second connection (its sender authenticated) that dies after half of a copy
    header = written(own, 8)
    cut = sender(listener, start=6)
    sock = cut._connect()
    found = own.payload(header)
    assert found is not None
    sock.sendall(header.pack())
    sock.sendall(found[1][: len(found[1]) // 2])
    found[1].release()
    for _ in range(200):  # (until the receiver began it: step 4's buffer is being written)
        if sorted(h.step for h in copy.headers().values() if h.whole) == [6]:
            break
        threading.Event().wait(0.05)
    sock.close()  # (the sender dies half-way: the receiver gives the copy up)
    for _ in range(200):  # (until the receiver's thread has let the folder go)
        if (fd := copy.lock()) is not None:
            SnapshotStore.unlock(fd)
            break
        threading.Event().wait(0.05)
    snap = copy.read()
    assert snap is not None and snap.step == 6
    assert sorted(h.step for h in copy.headers().values() if h.whole) == [6]


def test_a_new_generations_copies_forget_steps_past_its_start(ends: Any) -> None:
    """A sender of a generation that started from step 4 (a set restored after a loss):
    the copies of steps past it, of the run that fell, are forgotten before its first copy,
    so that copy goes into the buffer they held and the copy of step 4 stays."""
    own, listener, there = ends
    out = sender(listener)
    for step in (4, 6):
        out.start(own, written(own, step))
        out.wait()
    out.close()
    again = sender(listener, start=4)
    again.start(own, written(own, 5))
    again.wait()
    assert again.outcome()[1] is None
    copy = SnapshotStore(copy_folder(str(there), 5))
    assert sorted(h.step for h in copy.headers().values() if h.whole) == [4, 5]
    again.close()


def test_a_sender_without_the_runs_key_writes_nothing(ends: Any) -> None:
    own, listener, there = ends
    out = sender(listener, key=b"x" * 32)
    out.start(own, written(own, 3))
    out.wait()
    done, error = out.outcome()
    assert done is None and isinstance(error, ConnectionError)
    for _ in range(50):  # (time for a receiver that took it to make its folder)
        threading.Event().wait(0.02)
    assert not Path(copy_folder(str(there), 5)).exists()
    out.start(own, written(own, 4))  # (stopped: no copy after a failure)
    assert not out.busy and out.outcome() == (None, None)


def test_a_receiver_without_the_runs_key_gets_no_byte(tmp_path: Path) -> None:
    """A rogue that listens where the buddy said it would, and answers the sender's claim
    with a proof it cannot make: the sender sends nothing more."""
    own = SnapshotStore(str(tmp_path))
    header = written(own, 3)
    server = socket.create_server(("127.0.0.1", 0))
    after: list[bytes] = []

    def rogue() -> None:
        conn, _ = server.accept()
        with conn:
            conn.sendall(MAGIC + b"n" * 16)
            conn.recv(4096)  # (the claim)
            conn.sendall(b"p" * 32)  # (not a proof of the key)
            conn.settimeout(TIMEOUT)
            while chunk := conn.recv(1 << 16):
                after.append(chunk)

    thread = threading.Thread(target=rogue)
    thread.start()
    to = Endpoint("127.0.0.1", server.getsockname()[1], "rogue")
    out = CopySender(to, KEY, 3, 5, 0, TIMEOUT)
    out.start(own, header)
    out.wait()
    thread.join()
    done, error = out.outcome()
    assert done is None and isinstance(error, ConnectionError) and "key" in str(error)
    assert after == []
    server.close()
    own.close()


@pytest.mark.timeout(120)
def test_abort_frees_a_member_waiting_for_its_copy(tmp_path: Path) -> None:
    """A buddy that never answers (here: its folder's lock held by another writer, which
    it would wait for ten minutes): the group's abort ends the copy, so a member waiting
    for it before its vote is freed (this test's own timeout is far shorter)."""
    own = SnapshotStore(str(tmp_path / "own"))
    (tmp_path / "own").mkdir()
    folder = Path(copy_folder(str(tmp_path / "there"), 5))
    folder.mkdir(parents=True)
    listener = CopyListener(str(tmp_path / "there"), KEY, "127.0.0.1", 600.0, TIMEOUT)
    held = SnapshotStore(str(folder)).lock()
    assert held is not None
    out = sender(listener)
    out.start(own, written(own, 3))
    assert out.busy
    threading.Timer(0.5, out.abort).start()
    out.wait()
    assert not out.busy and out.outcome() == (None, None)  # (aborted: not a failure)
    SnapshotStore.unlock(held)
    listener.close()


@pytest.mark.timeout(120)
def test_abort_frees_a_sender_whose_buddy_never_answers_the_connection(tmp_path: Path) -> None:
    """A buddy whose kernel takes the connection but whose process never says hello (a
    frozen machine): the abort ends the wait in the handshake too."""
    own = SnapshotStore(str(tmp_path))
    server = socket.create_server(("127.0.0.1", 0))  # (listens, never accepts)
    to = Endpoint("127.0.0.1", server.getsockname()[1], "frozen")
    out = CopySender(to, KEY, 3, 5, 0, 600.0)
    out.start(own, written(own, 3))
    threading.Timer(0.5, out.abort).start()
    out.wait()
    assert not out.busy and out.outcome() == (None, None)
    server.close()
    own.close()


class FakeCopier:
    """Records the gate's waits; busy until waited on."""

    def __init__(self) -> None:
        self.busy = False
        self.waited = 0
        self.seconds = None
        self.started: list[int] = []
        self.sent = 1  # (past the generation's first copy)

    def start(self, store: SnapshotStore, header: Header) -> None:
        self.started.append(header.step)
        self.busy = True

    def wait(self) -> None:
        self.waited += 1
        self.busy = False

    def outcome(self) -> tuple[Any, Any]:
        return None, None

    def close(self) -> None:
        self.busy = False


def test_a_member_waits_for_its_copy_only_before_the_vote_that_takes_the_next(
    tmp_path: Path,
) -> None:
    """Every 3 steps: the copy of step 3's snapshot may run beside steps 4 and 5; the vote
    on step 6 (whose commit takes the next snapshot) waits for it."""
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    taken: list[Any] = []
    taker = Snapshotter(
        SnapshotStore(str(tmp_path)), px.Snapshots(every_steps=3), set, taken.append, taken.append
    )
    fake = FakeCopier()
    taker.copier = fake  # type: ignore[assignment]
    waits = []
    for step in range(1, 10):
        taker.before_vote()  # (the vote on `step`)
        waits.append(fake.waited)
        loop = {"global_step": step, "epoch": 0}
        snap = {"model": model.state_dict(), "optimizer": opt.state_dict(), "loop": loop}
        taker.after_commit(lambda s=snap: s, step, regroup=False)
    assert fake.started == [3, 6, 9] and [t.step for t in taken] == [3, 6, 9]
    # (the waits before the votes on steps 1..9: one before 6, one before 9)
    assert waits == [0, 0, 0, 0, 0, 1, 1, 1, 2]
    taker.close()


def test_the_copy_address_is_on_the_interface_that_reaches_the_head() -> None:
    from phalanx.strategies.ddp.wire.link import address_towards

    assert address_towards("127.0.0.1", 9) == "127.0.0.1"
    with socket.create_server((address_towards("127.0.0.1", 9), 0)) as server:
        assert server.getsockname()[1] > 0


def test_a_generations_first_copy_is_waited_for_before_its_first_vote(tmp_path: Path) -> None:
    """A generation across machines starts with a snapshot of its first step, copied at
    once: the first vote waits for that copy (the set it started from may be the only
    one until then)."""
    taken: list[Any] = []
    taker = Snapshotter(
        SnapshotStore(str(tmp_path)), px.Snapshots(every_steps=3), set, taken.append, taken.append
    )
    taker.tag = 5
    fake = FakeCopier()
    fake.sent = 0
    snap = {"model": {"w": torch.ones(3)}, "optimizer": {}, "loop": {"global_step": 7}}
    taker.start_copies(fake, lambda: snap, 7)  # type: ignore[arg-type]
    assert fake.started == [7] and [t.step for t in taken] == [7] and not taker.for_joins
    taker.before_vote()  # (the vote on step 8: not a snapshot's, but the first copy's)
    assert fake.waited == 1
    taker.close()


def test_a_copy_that_fails_is_told_once_and_the_members_own_snapshots_go_on(
    tmp_path: Path,
) -> None:
    """The buddy's listener does not hold the run's key (another run's, or a rogue's): the
    generation's first copy fails at the handshake. The member hears of it once, on its
    own thread before its next vote (the worker then tells the coordinator its copies
    failed, and warns), starts no copy after it, and goes on taking its own snapshots."""
    (tmp_path / "own").mkdir()
    (tmp_path / "there").mkdir()
    listener = CopyListener(str(tmp_path / "there"), b"x" * 32, "127.0.0.1", TIMEOUT, TIMEOUT)
    listener.begin(3)
    taken: list[Any] = []
    taker = Snapshotter(
        SnapshotStore(str(tmp_path / "own")), px.Snapshots(every_steps=1), set, taken.append,
        taken.append,
    )  # fmt: skip
    copied: list[Any] = []
    errors: list[BaseException] = []
    taker.on_copied, taker.on_copy_error = copied.append, errors.append
    copier = CopySender(listener.endpoint, KEY, 3, 5, 0, TIMEOUT)
    taker.start_copies(copier, lambda: state(0, rows=10), 0)
    for step in range(1, 5):
        taker.before_vote()  # (the vote on `step`: the first waits for the first copy)
        assert not copier.busy  # (no copy after the failure)
        taker.after_commit(lambda s=step: state(s, rows=10), step, regroup=False)
    taker.end_copies()
    assert [t.step for t in taken] == [0, 1, 2, 3, 4] and copied == []
    assert copier.step == 0  # (the only copy started: of the generation's first snapshot)
    [error] = errors
    assert isinstance(error, ConnectionError)  # (the receiver shut it: the claim's MAC)
    assert not list((tmp_path / "there").glob("copy-*/*"))  # (not a byte reached it)
    taker.close()
    listener.close()


# -- a set on the machines that survive, through a generation's change ----------------------
class Machines:
    """Two machines, each a snapshot folder with a copy listener; one member on each
    (slot 0 on m0, slot 1 on m1), each sending its copies to the other machine."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.folders = {m: root / m for m in ("m0", "m1")}
        self.listeners = {}
        for m, folder in self.folders.items():
            (folder / f"slot-{m[1]}").mkdir(parents=True)
            self.listeners[m] = CopyListener(str(folder), KEY, "127.0.0.1", TIMEOUT, TIMEOUT)
        self.takers: dict[int, Snapshotter] = {}
        self.sender: type[CopySender] = CopySender

    def generation(self, number: int, start: int, state: Any) -> None:
        """Both members in ``number`` (shard tags of a world of 2), from committed step
        ``start``: a taker each (kept across generations, as a worker keeps its own),
        copies to the other machine."""
        for slot in (0, 1):
            if slot not in self.takers:
                store = SnapshotStore(str(self.folders[f"m{slot}"] / f"slot-{slot}"))
                every = px.Snapshots(every_steps=4)
                self.takers[slot] = Snapshotter(store, every, set, lambda _: None, print)
                self.takers[slot].own_folder = self.takers[slot].for_joins = True
            taker = self.takers[slot]
            taker.tag = tag(number, 2, slot)
            taker.restart_cadence()
            other = self.listeners[f"m{1 - slot}"]
            other.begin(number)
            copier = self.sender(other.endpoint, KEY, number, slot, start, TIMEOUT)
            taker.start_copies(copier, lambda s=slot: state(start, s), start)

    def sets_left(self) -> list[ShardSet | None]:
        """The newest complete set on the machine that is left, for each one lost."""
        left = []
        for lost in self.folders:
            found = [
                w
                for m, folder in self.folders.items()
                if m != lost
                for place in [*folder.glob("slot-*"), *folder.glob("copy-*")]
                for h in SnapshotStore(str(place)).headers().values()
                if h.whole and (w := Written.of(h.tag, h.step, h.epoch)) is not None
            ]
            left.append(newest_set(found))
        return left

    def close(self) -> None:
        for taker in self.takers.values():
            taker.close()
        for listener in self.listeners.values():
            listener.close()


def shard_state(step: int, slot: int) -> dict[str, Any]:
    torch.manual_seed(step * 2 + slot)
    return {"model": {"w": torch.randn(20_000, 8)}, "loop": {"global_step": step, "epoch": 0}}


def test_a_set_survives_either_machines_loss_through_a_regroup(tmp_path: Path) -> None:
    """Snapshots every 4 steps, copied to the other machine; a regroup at step 9 forces a
    snapshot, the members leave (settling their copies), the next generation restores the
    newest set and forgets the rest in its own folders, then trains on. After each commit,
    and at each point of the change, the machine left after either one's loss holds a
    complete set."""
    machines = Machines(tmp_path)
    regrouped = threading.Event()

    class Slow(CopySender):
        """The copies of the snapshot the regroup forces are still on the way when the
        members leave (they go once the leaving began)."""

        def _send(self, store: SnapshotStore, header: Header) -> None:
            if header.step == 9:
                regrouped.wait()
            super()._send(store, header)

    machines.sender = Slow
    machines.generation(0, 0, shard_state)
    seen: list[list[ShardSet | None]] = []
    for step in range(1, 10):
        for taker in machines.takers.values():
            taker.before_vote()
        for taker in machines.takers.values():
            taker.after_commit(lambda s=step, t=taker: shard_state(s, t.tag & 1), step, step == 9)
        seen.append(machines.sets_left())
    threading.Timer(0.2, regrouped.set).start()
    for taker in machines.takers.values():  # (leave_group)
        taker.end_copies()
        assert taker.copier is None  # (the generation's connection closed)
    seen.append(machines.sets_left())
    chosen = newest_set(
        w
        for slot, taker in machines.takers.items()
        for h in taker.store.headers().values()
        if h.whole and (w := Written.of(h.tag, h.step, h.epoch)) is not None
    )
    assert chosen is not None and (chosen.generation, chosen.step) == (0, 9)
    for slot, taker in machines.takers.items():  # (restore_from_set's forget)
        wanted = tag(0, 2, slot)
        taker.store.forget(lambda h, t=wanted: not (h.tag == t and h.step == 9))
    seen.append(machines.sets_left())
    machines.generation(1, 9, shard_state)  # (its first copies under way: not waited for)
    seen.append(machines.sets_left())
    for step in range(10, 18):
        for taker in machines.takers.values():
            taker.before_vote()
        for taker in machines.takers.values():
            taker.after_commit(lambda s=step, t=taker: shard_state(s, t.tag & 1), step, False)
        seen.append(machines.sets_left())
    machines.close()
    # (the first copies are whole before the vote on step 2: from then on, always a set)
    assert all(left[0] is not None and left[1] is not None for left in seen[1:]), seen
    assert seen[-1][0] is not None and seen[-1][0].generation == 1


def test_a_copy_that_outlasts_the_wait_is_given_up_as_a_failure(tmp_path: Path) -> None:
    """A member leaving a generation waits for its copy a bounded time (the next
    generation forms within its own bound): then the copy is aborted and counted as
    failed, so the coordinator no longer counts on this member's copies."""
    own = SnapshotStore(str(tmp_path / "own"))
    (tmp_path / "own").mkdir()
    folder = Path(copy_folder(str(tmp_path / "there"), 5))
    folder.mkdir(parents=True)
    listener = CopyListener(str(tmp_path / "there"), KEY, "127.0.0.1", 600.0, TIMEOUT)
    held = SnapshotStore(str(folder)).lock()  # (the buddy cannot write: it never answers)
    out = sender(listener)
    out.start(own, written(own, 3))
    out.wait(0.3)
    done, error = out.outcome()
    assert done is None and isinstance(error, TimeoutError)
    assert held is not None
    SnapshotStore.unlock(held)
    listener.close()


def test_a_connection_that_trickles_its_claim_is_shut_by_the_deadline() -> None:
    """The handshake has one deadline in all: a peer sending a byte at a time (each well
    within the deadline of the one before) gains no time: it is shut before its claim is
    whole."""
    with tempfile.TemporaryDirectory() as there:
        listener = CopyListener(there, KEY, "127.0.0.1", TIMEOUT, 1.0)
        with socket.create_connection((listener.endpoint.host, listener.endpoint.port)) as conn:
            conn.recv(64)  # (the hello)
            sent, shut = 0, False
            while sent < 200 and not shut:
                try:
                    conn.sendall(b"x")
                    sent += 1
                    threading.Event().wait(0.05)
                    shut = conn.recv(1, socket.MSG_DONTWAIT) == b""
                except BlockingIOError:
                    continue  # (open, nothing to read)
                except OSError:
                    shut = True
        listener.close()
    assert shut and sent < 88  # (a claim is 88 bytes: it was shut before it was whole)


def test_unproven_connections_cannot_keep_a_member_out(tmp_path: Path) -> None:
    """More idle connections than may prove themselves at once: the oldest are shut at
    once (they cannot pile up threads until their deadline), and a member's copy still
    goes through."""
    own = SnapshotStore(str(tmp_path / "own"))
    (tmp_path / "own").mkdir()
    listener = CopyListener(str(tmp_path / "there"), KEY, "127.0.0.1", TIMEOUT, 600.0)
    at = (listener.endpoint.host, listener.endpoint.port)
    idle = [socket.create_connection(at) for _ in range(MAX_PROVING + 4)]
    for _ in range(100):  # (until the listener has taken them all)
        if len(listener._proving) >= MAX_PROVING:
            break
        threading.Event().wait(0.02)
    out = sender(listener)
    out.start(own, written(own, 3))
    out.wait()
    done, error = out.outcome()
    assert error is None and done is not None and done.step == 3
    shut = 0
    for conn in idle:
        conn.settimeout(0.3)  # (an evicted one is closed already; the others wait 600 s)
        try:
            conn.recv(64)  # (the hello)
            shut += conn.recv(1) == b""
        except TimeoutError:
            pass
        except OSError:
            shut += 1
        conn.close()
    assert shut == 5  # (4 over the limit, and one more for the member's connection)
    out.close()
    listener.close()
    own.close()


def test_a_rebuilds_abort_lets_the_copy_end_a_lost_members_ends_it() -> None:
    """The watcher aborts a group for a rebuild by the same members (no slot lost) and for
    lost members (their slots): the group tells its hooks which, and a copy ends only when
    its buddy may be among them (the worker's hook); after a rebuild's abort, the leaving
    member waits for its copy."""
    from phalanx.strategies.ddp.worker.fsdp_group import FsdpGroup, Sockets
    from phalanx.strategies.ddp.worker.group import Waits

    ended: list[str] = []
    group = FsdpGroup.__new__(FsdpGroup)
    group.waits, group.pg, group.device = Waits(), None, torch.device("cpu")
    group.sockets, group.store_port = Sockets(), 0
    group.also_abort = [lambda lost: ended.append(lost)]
    group.abort(lost=set())
    group.abort(lost={3})
    group.abort()
    assert ended == [set(), {3}, None]
    to = Endpoint("127.0.0.1", 9, "m1")
    copies = {lost: CopySender(to, KEY, 0, 0, 0, TIMEOUT) for lost in ("none", "other", "it")}
    for lost, found in (("none", set()), ("other", {3}), ("it", {3, 4})):
        copies[lost].holder = 4
        copies[lost].abort_for(found)
    assert [c._closed for c in copies.values()] == [False, False, True]
