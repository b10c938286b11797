"""The node that is to take over from a lost head, before it claims anything: its node port
(none, with why, when the head's address does not resolve) and its rally (it goes on only
when more than half of the run's succession reached it; else every node that came is told
why and let go, and nothing in run_dir is touched)."""

from __future__ import annotations

import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

from phalanx.strategies.ddp.nodes.failover import Standby
from phalanx.strategies.ddp.nodes.fencing import HEAD_FILE
from phalanx.strategies.ddp.timing import Timing
from phalanx.strategies.ddp.wire.link import Link
from phalanx.strategies.ddp.wire.messages import Hello, Refused, decode, encode

TOKEN = b"the run's token"
TIMING = Timing()


def hello_from(port: int, rank: int, answers: dict[int, Any]) -> threading.Thread:
    """Node ``rank`` says hello at the standby port (in a thread: it waits for the answer)."""

    def run() -> None:
        try:
            link, answer = Link.connect(
                ("127.0.0.1", port), TOKEN, encode(Hello(rank, "h", ("cpu:0",))), 5.0,
                timedelta(seconds=10),
            )  # fmt: skip
            answers[rank] = decode(answer)
            link.close()
        except Exception as exc:  # (its link closed without an answer)
            answers[rank] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_head_whose_address_does_not_resolve_leaves_the_node_without_a_port() -> None:
    found = Standby.open(("no-such-head.invalid", 29410), TOKEN, TIMING)
    assert isinstance(found, str) and "could not open a node port" in found


def test_the_survivors_that_came_are_kept_for_the_new_head_to_answer(tmp_path: Path) -> None:
    standby = Standby.open(("127.0.0.1", 1), TOKEN, TIMING)
    assert isinstance(standby, Standby)
    answers: dict[int, Any] = {}
    try:
        threads = [hello_from(standby.port, r, answers) for r in (2, 3)]
        came = standby.rally((2, 3), timedelta(seconds=10), total=4, me=1)
        assert came == (2, 3)  # three of four: more than half
        pairs = [standby.listener.joined.get(timeout=1) for _ in (2, 3)]  # (links held)
        kept = [decode(frame) for _, frame in pairs]
        assert sorted(h.rank for h in kept if isinstance(h, Hello)) == [2, 3]
        assert not answers  # (not answered yet: the new head welcomes them)
        for pair in pairs:
            standby.listener.joined.put(pair)
    finally:
        standby.close()  # (their links close: each follower sees it at once)
    for thread in threads:
        thread.join(10)
    assert set(answers) == {2, 3} and all(isinstance(a, Exception) for a in answers.values())


def test_a_node_cut_off_alone_does_not_take_over_and_tells_those_that_came(
    tmp_path: Path,
) -> None:
    """Node 1 of 5 lost the head, but only node 2 reached it (the head lives on, with the
    others): two of five is not more than half. Node 2 is told why; nothing is claimed."""
    standby = Standby.open(("127.0.0.1", 1), TOKEN, TIMING)
    assert isinstance(standby, Standby)
    answers: dict[int, Any] = {}
    try:
        thread = hello_from(standby.port, 2, answers)
        why = standby.rally((2, 3, 4), timedelta(seconds=1.5), total=5, me=1)
        thread.join(10)
    finally:
        standby.close()
    assert isinstance(why, str) and "only 2 of the run's 5 nodes reached it" in why
    assert "node(s) [2] came" in why and "cut off from this node only" in why
    assert isinstance(answers[2], Refused) and answers[2].message == why
    assert not (tmp_path / HEAD_FILE).exists()


def test_a_hello_from_a_node_not_awaited_is_let_go(tmp_path: Path) -> None:
    standby = Standby.open(("127.0.0.1", 1), TOKEN, TIMING)
    assert isinstance(standby, Standby)
    answers: dict[int, Any] = {}
    try:
        threads = [hello_from(standby.port, rank, answers) for rank in (7, 2)]
        came = standby.rally((2,), timedelta(seconds=10), total=3, me=1)
        threads[0].join(10)  # (the stranger: let go during the rally)
        assert isinstance(answers[7], Exception)
    finally:
        standby.close()
    threads[1].join(10)
    assert came == (2,)
