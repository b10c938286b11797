"""The node that is to take over from a lost head, before it claims anything: its node port
(none, with why, when the head's address does not resolve) and its rally (it goes on only
when more than half of the run's succession reached it; else every node that came is told
why and let go, and nothing in run_dir is touched)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

import phalanx as px
from phalanx.launch import Launch
from phalanx.spec import FitConfig
from phalanx.strategies.ddp.nodes.failover import Standby, cannot_fail_over
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
        threads = [hello_from(standby.port, 7, answers)]
        deadline = time.monotonic() + 10  # (the stranger's hello queued first: the rally
        while standby.listener.joined.qsize() < 1 and time.monotonic() < deadline:
            time.sleep(0.01)  # reads it before node 2's, which ends the rally)
        threads.append(hello_from(standby.port, 2, answers))
        came = standby.rally((2,), timedelta(seconds=10), total=3, me=1)
        threads[0].join(10)  # (the stranger: let go during the rally)
        assert isinstance(answers[7], Exception)
    finally:
        standby.close()
    threads[1].join(10)
    assert came == (2,)


def test_a_stop_asked_for_while_the_head_is_lost_ends_the_node_with_the_step_it_kept() -> None:
    """SIGTERM (or Ctrl-C, or Slurm's warning) arrives while the node loses the head: it
    does not start again under a new head; it ends as a node without a failover does, with
    the step its workers kept (PX147, exit 75), and lets its node port go."""
    import phalanx as px
    from phalanx.errors import HeadLost
    from phalanx.failures import WorkerFailure
    from phalanx.strategies.ddp.coordinator.nodeplan import Follow
    from phalanx.strategies.ddp.nodes.failover import Failover
    from phalanx.strategies.ddp.wire.messages import Heir
    from phalanx.strategies.ddp.wire.protocol import Saved

    class Port:
        closed = False

        def close(self) -> None:
            self.closed = True

    port = Port()
    succession = (Heir(0, "h0", 0, ("cpu:0",)), Heir(1, "h1", 1, ("cpu:0",)))
    failover = Failover(
        Follow(succession[1]),
        2,
        succession,
        WorkerFailure(worker=0, rank=0, device="cpu:0@node0", kind="crash", message="lost"),
        [Saved(2, 30, "/shared/run/checkpoints/ckpt-000000030.pt", wrote=True)],
        port,  # type: ignore[arg-type]
    )
    learner = px.Learner(lambda: torch.nn.Linear(2, 1), torch.optim.SGD, lambda m, b: b)
    said: list[Any] = []

    class Sink:
        def handle(self, event: Any) -> None:
            said.append(event)

        def close(self) -> None:
            pass

    def lost_while_stopping(run: Any, sinks: Any) -> Any:
        learner.interrupter.stop("SIGTERM")
        raise failover

    learner._node_once = lost_while_stopping  # type: ignore[method-assign]
    learner._take_over = lambda *a: pytest.fail("took over")  # type: ignore[method-assign]
    with pytest.raises(HeadLost) as info:
        learner._run_node(None, [Sink()])  # type: ignore[arg-type]
    assert info.value.code == 75 and info.value.step == 30
    assert info.value.checkpoint == "/shared/run/checkpoints/ckpt-000000030.pt"
    text = str(info.value.error)
    assert "a stop was asked for (SIGTERM)" in text and "step 30 is in /shared/run" in text
    assert any("[PX147]" in getattr(e, "text", "") and e.level == "error" for e in said)
    assert port.closed


@pytest.mark.parametrize(
    ("source", "run_dir", "recovery", "says"),
    [
        ("phalanx", "RUN", px.Recovery(), None),
        ("slurm", "RUN", px.Recovery(), None),
        ("torchrun", "RUN", px.Recovery(), "torchrun's own restart (--max-restarts)"),
        ("phalanx", None, px.Recovery(), "needs a run_dir every node shares"),
        ("phalanx", "RUN", px.Recovery(head_failover=False), "head_failover=False"),
        ("phalanx", "RUN", px.Recovery(mode="abort"), 'mode="abort"'),
    ],
)
def test_which_runs_may_fail_over(
    source: str, run_dir: str | None, recovery: px.Recovery, says: str | None
) -> None:
    config = FitConfig(1, 8, ["cpu:0"], "ddp", run_dir=run_dir, recovery=recovery)
    launch = Launch(source, nnodes=3, node_rank=1)  # type: ignore[arg-type]
    why = cannot_fail_over(config, launch)
    assert why is None if says is None else (why is not None and says in why)
