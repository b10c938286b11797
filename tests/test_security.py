"""Only this run is heard: a rogue client of the run's store cannot steer its workers.

During a real ddp run over gloo on 127.0.0.1, a rogue client connects to the run's TCPStore
and writes a forged generation announcement, a stop key, a forged abort key, a genuine
signed message replayed under another key, and a pickle whose unpickling would create a
file. The run must end as a clean run does (the same weights, an exact ledger), the file
must never exist, and each rejected value must be warned about exactly once (PX150).
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import phalanx as px
from phalanx.events import Notice, StepEnded
from phalanx.strategies.ddp.agent import agent as agent_mod
from phalanx.strategies.ddp.wire.control import (
    ENVELOPE,
    Rejection,
    SignedStore,
    Signer,
    digest,
    latest_generation,
    new_run_id,
    run_token,
)
from phalanx.strategies.ddp.wire.protocol import (
    ABORT_KEY,
    ARRIVED_PREFIX,
    CONTROL_KEY,
    GEN_LATEST,
    GEN_PREFIX,
    STOP_KEY,
    Announcement,
    Generation,
)
from phalanx.strategies.ddp.worker.worker import arrive
from procs import alive, started_by
from recorder import Recorder
from recovery_helpers import linear, make_data, sgd, slow_step

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX processes")

TWO = "cpu:0,cpu:1"
DATA = make_data(400)
# (even shares: these runs are compared bit for bit, and balance follows the machine load)
FIT: dict[str, Any] = dict(batch_size=20, epochs=5, seed=3, balance=False)  # 100 steps, 0.04 s each
STEPS = 100
TOLERANCE = 1e-5
# Planted where ``control/version`` belongs: a counter that does not verify is no proof that
# nothing moved, so every worker reads every control key each tick while it is there (a
# rogue can no longer move the counter the way the head does: it is signed).
LOOK = b"rogue: look again"
# A plausible envelope whose MAC is made up.
FORGED = json.dumps({"format": ENVELOPE, "seq": 99, "payload": "7", "mac": "ab" * 32}).encode()
GARBAGE = bytes(range(256))  # not UTF-8, not JSON, not a number


# -- the envelope, without processes ------------------------------------------------------


class DictStore:
    """The part of a TCPStore that :class:`SignedStore` uses."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    def set(self, key: str, value: str | bytes) -> None:
        self.values[key] = value.encode() if isinstance(value, str) else value

    def get(self, key: str) -> bytes:
        return self.values[key]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.values for k in keys)

    def add(self, key: str, n: int) -> int:
        value = int(self.values.get(key, b"0")) + n
        self.values[key] = str(value).encode()
        return value


def signed(token: bytes = b"token") -> tuple[SignedStore, list[tuple[str, str, str]]]:
    reports: list[tuple[str, str, str]] = []
    store = SignedStore(DictStore(), Signer(token), lambda *r: reports.append(r))
    return store, reports


def test_a_signed_value_is_read_and_anything_else_ignored_and_reported_once() -> None:
    store, reports = signed()
    store.set(STOP_KEY, "user stop", seq=1)
    assert store.get(STOP_KEY) == "user stop"
    assert store.get(ABORT_KEY) is None and reports == []  # absent: nothing to report
    raw_stop = store.store.get(STOP_KEY)

    forged = {"format": ENVELOPE, "seq": 2, "payload": "go", "mac": "0" * 64}
    cases = {
        "not an envelope": b"plain text",
        "a pickle": pickle.dumps({"payload": "x"}),
        "another run's token": Signer(b"other").seal(ABORT_KEY, "why", 3).encode(),
        "a forged MAC": json.dumps(forged).encode(),
        "a genuine message under another key": raw_stop,
    }
    for raw in cases.values():
        store.store.set(ABORT_KEY, raw)
        assert store.get(ABORT_KEY) is None
        assert store.get(ABORT_KEY) is None  # read again: not reported again
    assert [r[0] for r in reports] == [ABORT_KEY] * len(cases)
    assert [r[2] for r in reports] == [digest(raw) for raw in cases.values()]
    assert "not a signed control message" in reports[0][1]
    assert "not a signed control message" in reports[1][1]
    assert all("bad MAC" in r[1] for r in reports[2:])


def test_a_replay_of_an_older_message_under_the_same_key_is_refused() -> None:
    store, reports = signed()
    store.set(STOP_KEY, "first", seq=1)
    old = store.store.get(STOP_KEY)
    store.set(STOP_KEY, "second", seq=2)
    assert store.get(STOP_KEY) == "second"
    store.store.set(STOP_KEY, old)
    assert store.get(STOP_KEY) is None
    assert len(reports) == 1 and "replay of an older message" in reports[0][1]


def test_generations_are_learned_from_verified_announcements_only() -> None:
    store, reports = signed()
    sig = store.signer
    for n in range(2):
        doc = Announcement(n, (0, 1)).to_json()
        store.store.set(f"{GEN_PREFIX}{n}", sig.seal(f"{GEN_PREFIX}{n}", doc, n + 1))
        store.store.add(GEN_LATEST, 1 if n else 0)
    assert latest_generation(store, -1) == 1
    # A rogue moves the counter and plants gen/2 (a replay of gen/1) and gen/7.
    store.store.set(f"{GEN_PREFIX}2", store.store.get(f"{GEN_PREFIX}1"))
    store.store.set(f"{GEN_PREFIX}7", b"{}")
    store.store.add(GEN_LATEST, 6)
    assert latest_generation(store, 1) == 1
    assert sorted(r[0] for r in reports) == [f"{GEN_PREFIX}2", f"{GEN_PREFIX}7"]


def test_the_token_comes_from_the_environment_or_is_random(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PHALANX_TOKEN", "shared secret")
    assert run_token() == b"shared secret"
    monkeypatch.delenv("PHALANX_TOKEN")
    first, second = run_token(), run_token()
    assert len(first) == 32 and first != second
    with pytest.raises(Rejection):
        Signer(first).open("k", Signer(second).seal("k", "x", 1).encode())


def test_a_message_of_an_earlier_run_with_the_same_token_is_refused() -> None:
    """A fixed PHALANX_TOKEN signs every run: each run's key is made from it and a fresh run
    id, so a value recorded in one run is a bad MAC in the next, even at a new key."""
    token = b"the same PHALANX_TOKEN"
    earlier, now = Signer.for_run(token, new_run_id()), Signer.for_run(token, new_run_id())
    assert earlier.token != now.token and token not in (earlier.token, now.token)
    reports: list[tuple[str, str, str]] = []
    store = SignedStore(DictStore(), now, lambda *r: reports.append(r))
    store.store.set(ABORT_KEY, earlier.seal(ABORT_KEY, "the earlier run's abort", 1))
    assert store.get(ABORT_KEY) is None
    assert len(reports) == 1 and "bad MAC" in reports[0][1]
    store.set(ABORT_KEY, "this run's abort", seq=1)
    assert store.get(ABORT_KEY) == "this run's abort"
    assert Signer.for_run(token, "r").token == Signer.for_run(token, "r").token  # every node


def test_a_bad_arrival_is_named_and_the_generation_forms_with_the_genuine_one() -> None:
    """``arrived/g<n>/<rank>`` is read only while a generation forms (so it is tested here,
    on a real store, with the workers' own :func:`arrive`, not timed into a run): a bad value
    where a peer's arrival belongs is named once each and is no arrival; the peer's own
    arrival, when it comes, is."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    reports: list[tuple[str, str, str]] = []
    signer = Signer(b"token")

    def member() -> SignedStore:
        client = dist.TCPStore("127.0.0.1", server.port, is_master=False)
        return SignedStore(client, signer, lambda *r: reports.append(r))

    gen, watcher = Generation(0, [0, 1]), SimpleNamespace(latest=0)
    key = f"{ARRIVED_PREFIX}g0/1"  # rank 1's, read by rank 0
    other = Signer(b"other").seal(key, "1", 0).encode()
    outcome: list[BaseException | None] = []

    def rank(n: int) -> None:
        try:
            arrive(member(), gen, n, watcher, timedelta(seconds=20))  # type: ignore[arg-type]
            outcome.append(None)
        except BaseException as exc:  # (asserted below)
            outcome.append(exc)

    first = threading.Thread(target=rank, args=(0,))
    first.start()
    written = [b"not a number", FORGED, GARBAGE, other]
    for raw in written:
        server.set(key, raw)
        deadline = time.monotonic() + 10
        while not any(r[2] == digest(raw) for r in reports):
            assert time.monotonic() < deadline, f"no report of {raw[:20]!r}"
            time.sleep(0.01)
    assert first.is_alive() and outcome == []  # none of them is an arrival
    second = threading.Thread(target=rank, args=(1,))
    second.start()
    first.join(10)
    second.join(10)
    assert outcome == [None, None]  # the generation formed
    assert [(r[0], r[2]) for r in reports] == [(key, digest(raw)) for raw in written]


def test_the_heads_writes_never_read_what_a_rogue_left_in_the_counters() -> None:
    """The head writes the counters with ``set`` (the store's ``add`` of a value that is not
    a number fails and closes the head's client: the head died on its next write), and the
    workers read them back as before."""
    agent = agent_mod.Agent()
    try:
        assert agent.store is not None and agent.store_at is not None
        rogue = dist.TCPStore("127.0.0.1", agent.store_at[1], is_master=False)
        for raw in (b"not a number", GARBAGE):
            rogue.set(CONTROL_KEY, raw)
            rogue.set(GEN_LATEST, raw)
            # (read back on the rogue's connection: its writes are in the store before the
            # head's; a set is not answered, so under load they could land after them)
            assert rogue.get(GEN_LATEST) == raw
            agent.announce(Announcement(0, (0, 1)))
            agent.set_stop("a user's stop")
            agent.set_abort("decided")
            # (and the head's read back on its own connection: its sets, unanswered, are in
            # the store before the rogue's next ones; under load they landed after them)
            assert agent.store.get(GEN_LATEST) == b"0"
        reports: list[tuple[str, str, str]] = []
        client = dist.TCPStore("127.0.0.1", agent.store_at[1], is_master=False)
        worker = SignedStore(client, agent.signer, lambda *r: reports.append(r))
        assert worker.get(CONTROL_KEY) == str(agent.seq)
        assert latest_generation(worker, -1) == 0 and worker.hint(GEN_LATEST) == 0
        assert (worker.get(STOP_KEY), worker.get(ABORT_KEY)) == ("a user's stop", "decided")
        assert reports == []
    finally:
        agent.close()


def test_a_counter_that_is_not_a_number_is_a_hint_ignored_and_named_once() -> None:
    store, reports = signed()
    store.store.set(GEN_LATEST, b"not a number")
    assert store.hint(GEN_LATEST) is None and store.hint(GEN_LATEST) is None
    assert latest_generation(store, -1) == -1
    assert [(r[0], r[2]) for r in reports] == [(GEN_LATEST, digest(b"not a number"))]
    assert "not a number" in reports[0][1]
    # A signed value that its reader cannot parse (only a bug of the head's could write it)
    # is named too, never raised into the watch thread.
    store.set(f"{GEN_PREFIX}0", "[1, 2", seq=1)
    assert store.read(f"{GEN_PREFIX}0", lambda t: Announcement.from_json(0, t)) is None
    assert len(reports) == 2 and "does not parse" in reports[1][1]


# -- a rogue client during a real run -----------------------------------------------------


class Planted:
    """Unpickling this creates a file: the payload a rogue plants where a message belongs."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (open, (self.path, "w"))


def params(model: nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in model.state_dict().values()]


def rel_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max() / y.abs().max()) for x, y in zip(a, b, strict=True))


def warnings_about(rec: Recorder) -> list[str]:
    return [e.text for e in rec.of(Notice) if e.text.startswith("PX150")]


Messages = list[tuple[str, bytes, bool]]  # (key, value, move gen/latest after writing it)


class Rogue(Recorder):
    """A sink (it runs in the supervisor: this process) that, at step 5, starts a rogue
    client of the run's store and writes each of ``messages(client, seen)`` (``seen``: what
    the store held when it was made, see :func:`attacked`), waiting for that value's
    warning before the next (each write under a key replaces the one before)."""

    def __init__(self, seen: dict[str, Any], messages: Callable[..., Messages]) -> None:
        super().__init__()
        self.seen, self.messages = seen, messages
        self.written: list[tuple[str, bytes]] = []
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.done_at_step: int | None = None

    def handle(self, event: Any) -> None:
        super().handle(event)
        if isinstance(event, StepEnded) and event.global_step == 5 and self.thread is None:
            self.thread = threading.Thread(target=self._attack, daemon=True)
            self.thread.start()

    def _attack(self) -> None:
        try:
            store = dist.TCPStore("127.0.0.1", self.seen["port"], is_master=False)
            for key, raw, bump_generation in self.messages(store, self.seen):
                store.set(key, raw)
                if bump_generation:
                    store.add(GEN_LATEST, 1)
                self.written.append((key, raw))
                deadline = time.monotonic() + 20
                while not any(digest(raw) in text for text in warnings_about(self)):
                    assert time.monotonic() < deadline, f"no warning for {key}"
                    time.sleep(0.02)
            self.done_at_step = len(self.of(StepEnded))
        except BaseException as exc:  # (reported by the test)
            self.error = exc


def fit(sinks: list[Any], run_dir: Path) -> px.FitResult:
    return px.Learner(linear, sgd, slow_step).fit(
        DATA, devices=TWO, strategy="ddp", sinks=sinks, run_dir=str(run_dir), **FIT
    )


def assert_exact(result: px.FitResult, rec: Recorder) -> None:
    assert (result.steps, result.failures) == (STEPS, [])
    assert [e.global_step for e in rec.of(StepEnded)] == list(range(1, STEPS + 1))
    assert result.ledger_ok is True and result.ledger_problems == []


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> px.FitResult:
    """The run no one attacks, once for every test here."""
    rec = Recorder()
    result = fit([rec], tmp_path_factory.mktemp("clean"))
    assert_exact(result, rec)
    assert warnings_about(rec) == []  # a run alone warns about nothing
    return result


def attacked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, messages: Callable[..., Messages]
) -> tuple[px.FitResult, Rogue]:
    """A run with a :class:`Rogue` writing ``messages``; checks that it wrote them all
    during the run, each warned about, and that it changed nothing: every step, an exact
    ledger, no worker left."""
    seen: dict[str, Any] = {}  # the run's store port, as a test can find it, and what the
    opened = agent_mod.Agent.__post_init__  # store held then (a genuine early counter)

    def record_port(self: agent_mod.Agent) -> None:
        opened(self)
        assert self.store is not None
        seen["port"] = self.store_at[1] if self.store_at else None
        early = self.store.check([CONTROL_KEY])
        seen["early version"] = bytes(self.store.get(CONTROL_KEY)) if early else b""

    monkeypatch.setattr(agent_mod.Agent, "__post_init__", record_port)
    rogue = Rogue(seen, messages)
    result = fit([rogue], tmp_path / "attacked")
    assert rogue.thread is not None
    rogue.thread.join(timeout=5)
    assert rogue.error is None, repr(rogue.error)
    assert rogue.done_at_step is not None and rogue.done_at_step < STEPS  # during the run
    assert_exact(result, rogue)

    deadline = time.monotonic() + 10  # no worker left behind
    while True:
        left = [p for p in started_by(os.getpid()) if alive(p)]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert left == []
    return result, rogue


def assert_same_model(result: px.FitResult, clean: px.FitResult) -> None:
    diff = rel_diff(params(result.model), params(clean.model))
    assert diff <= TOLERANCE, f"the model differs from the clean run by {diff:.2e}"


def assert_each_named_once(rogue: Rogue) -> list[str]:
    """Every value written is warned about exactly once, naming its key; nothing else is."""
    warned = warnings_about(rogue)
    for key, raw in rogue.written:
        assert sum(digest(raw) in text and repr(key) in text for text in warned) == 1, key
    assert len(warned) == len(set(rogue.written)), warned
    return warned


@pytest.mark.timeout(240)
def test_a_rogue_client_of_the_store_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clean: px.FitResult
) -> None:
    planted = tmp_path / "planted-by-a-pickle"

    def messages(store: dist.TCPStore, seen: dict[str, Any]) -> Messages:
        genuine = bytes(store.get(f"{GEN_PREFIX}0"))  # the run's own first announcement
        fake = Announcement(1, (0,), cause="rogue").to_json()
        forged = json.dumps({"format": ENVELOPE, "seq": 99, "payload": fake, "mac": "ab" * 32})
        return [
            (CONTROL_KEY, LOOK, False),  # so the workers read every key from now on
            (f"{GEN_PREFIX}1", forged.encode(), True),  # a fake generation
            (STOP_KEY, b"rogue says stop", False),  # the old, unsigned format
            (
                ABORT_KEY,
                b'{"format": "px-signed/1", "seq": 5, "payload": "x", "mac": ""}',
                False,
            ),
            (ABORT_KEY, genuine, False),  # a genuine signed message under another key
            (f"{GEN_PREFIX}1", pickle.dumps(Planted(str(planted))), False),
        ]

    result, rogue = attacked(tmp_path, monkeypatch, messages)
    assert len(rogue.written) == 6
    assert_same_model(result, clean)
    assert not planted.exists()
    assert_each_named_once(rogue)
    assert [g for g in rogue.of(Notice) if "rogue" in g.text] == []  # no generation formed


def bad_values(key: str) -> Callable[..., Messages]:
    """What a rogue writes under ``key``: a value that is not a number, a forged envelope,
    bytes that are neither; the counter first moved by :data:`LOOK` (except when it is
    ``key``: then its own values do that), and for ``control/version`` also a replay of the
    head's own earlier counter (older than the one the workers accepted since)."""

    def messages(store: dist.TCPStore, seen: dict[str, Any]) -> Messages:
        values = [b"not a number", FORGED, GARBAGE]
        if key == CONTROL_KEY:
            return [(key, raw, False) for raw in [*values, seen["early version"]]]
        return [(CONTROL_KEY, LOOK, False), *[(key, raw, False) for raw in values]]

    return messages


@pytest.mark.timeout(120)
@pytest.mark.parametrize("key", [CONTROL_KEY, GEN_LATEST, STOP_KEY, ABORT_KEY, f"{GEN_PREFIX}1"])
def test_a_bad_value_under_any_key_a_worker_reads_is_named_and_the_run_goes_on(
    key: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clean: px.FitResult
) -> None:
    """The values a worker reads from the store, each written bad during a real run (the
    store has no authentication: anyone who reaches its port can): the run ends as a clean
    one does, and a PX150 warning names the key for each value."""
    result, rogue = attacked(tmp_path, monkeypatch, bad_values(key))
    assert_same_model(result, clean)
    warned = assert_each_named_once(rogue)
    assert sum(repr(key) in text for text in warned) >= 3
    if key == CONTROL_KEY:
        replayed = [t for t in warned if digest(rogue.seen["early version"]) in t]
        assert len(replayed) == 1 and "replay of an older message" in replayed[0]
