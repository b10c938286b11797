"""The head's rules about the other nodes as tables, one row a case: a hello at start-up
and during the run, parked spares placed in lost nodes' ranks, a node's silence, and the
slots in node order. No link, thread or clock: the time is a number in the row."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import pytest

from phalanx.launch import SPARE
from phalanx.plan import Plan
from phalanx.strategies.ddp.coordinator.nodeplan import (
    Admit,
    Beat,
    Decision,
    Follow,
    Heir,
    Hello,
    Keep,
    Layout,
    Lost,
    NodeView,
    Park,
    Place,
    Refuse,
    Stop,
    TakeOver,
    admit,
    disagreements,
    fenced,
    hear,
    layout,
    majority,
    missing,
    outnumbered,
    place_spares,
    successor,
)
from phalanx.strategies.ddp.timing import Timing

PLAN = Plan(120, 12, seed=0)
HEAD = {"torch": "2.13.0", "epochs": 4, "plan": PLAN.record()}  # the head's agreement
NNODES = 3
ONE = ("cpu:0",)
TWO = ("cpu:0", "cpu:1")
EPOCHS = "epochs: the head has 4, this node 5"


def hello(rank: int, devices: tuple[str, ...] = ONE, spare: bool = False, **check: Any) -> Hello:
    """A node's hello that agrees with the head, but for ``check``'s settings."""
    return Hello(rank, f"h{rank}", devices, spare, dict(HEAD, **check))


def refuse(*problems: str) -> Refuse:
    return Refuse(problems)


def takes(*ranks: int) -> Callable[[int], bool]:
    """The coordinator's ``admits``: it takes these lost nodes' ranks back now."""
    return frozenset(ranks).__contains__


def decide(
    seen: Hello,
    nodes: Mapping[int, NodeView],
    takes_back: Callable[[int], bool] | None = None,
) -> Decision:
    """The hub's call: the node's disagreements with the head, then the rule."""
    return admit(seen, disagreements(HEAD, seen.check, PLAN), nodes, NNODES, takes_back)


# -- at start-up -----------------------------------------------------------------------------
AT_START = [
    # (the hello, the node ranks already taken, the decision)
    pytest.param(hello(1), [], Admit(1), id="a good node"),
    pytest.param(hello(2, TWO), [1], Admit(2), id="the next free rank"),
    pytest.param(hello(0), [], refuse("node rank 0 is not a free node rank of 3"), id="rank 0"),
    pytest.param(hello(3), [], refuse("node rank 3 is not a free node rank of 3"), id="rank 3"),
    pytest.param(hello(-1), [], refuse("node rank -1 is not a free node rank of 3"), id="none"),
    pytest.param(hello(1), [1], refuse("node rank 1 is not a free node rank of 3"), id="taken"),
    pytest.param(hello(1, epochs=5), [], refuse(EPOCHS), id="disagrees"),
    pytest.param(
        hello(2, epochs=5),
        [2],
        refuse(EPOCHS, "node rank 2 is not a free node rank of 3"),
        id="disagrees and taken: both named",
    ),
    pytest.param(
        hello(1, plan=Plan(120, 12, seed=1).record()),
        [],
        refuse("plan: seed 1 on this node, 0 on the head"),
        id="another plan",
    ),
    pytest.param(hello(SPARE, spare=True), [1, 2], Park(), id="a spare is parked"),
    pytest.param(hello(SPARE, spare=True, epochs=5), [], refuse(EPOCHS), id="a spare disagrees"),
]


@pytest.mark.parametrize(("seen", "taken", "decision"), AT_START)
def test_a_hello_at_start_up_takes_a_free_node_rank_and_agrees(
    seen: Hello, taken: list[int], decision: Decision
) -> None:
    nodes = {rank: NodeView(rank, ONE, first=rank) for rank in taken}
    assert decide(seen, nodes) == decision


def test_a_refusal_says_every_problem_in_one_line() -> None:
    refused = decide(hello(2, epochs=5), {2: NodeView(2, ONE)})
    assert isinstance(refused, Refuse)
    assert refused.message == (
        "nodes disagree: epochs: the head has 4, this node 5; "
        "node rank 2 is not a free node rank of 3"
    )


# -- during the run: a node registers again ---------------------------------------------------
RUNNING = {  # node 1 (one device, slot 1) is lost; node 2 (two, slots 2-3) lives
    1: NodeView(1, ONE, first=1, lost=True),
    2: NodeView(2, TWO, first=2),
}
NOT_BACK = "node rank {} is not a lost node this run takes back"
REJOIN = [
    # (the hello, the lost ranks the coordinator takes back now, the decision)
    pytest.param(hello(1), takes(1), Admit(1, first=1), id="a lost node's rank, same devices"),
    pytest.param(hello(2, TWO), takes(1, 2), refuse(NOT_BACK.format(2)), id="not lost"),
    pytest.param(hello(5), takes(1, 5), refuse(NOT_BACK.format(5)), id="no such node"),
    pytest.param(hello(0), takes(0, 1), refuse(NOT_BACK.format(0)), id="the head's rank"),
    pytest.param(
        hello(1, TWO),
        takes(1),
        refuse("devices ['cpu:0', 'cpu:1']: node 1 had ['cpu:0']"),
        id="other devices",
    ),
    pytest.param(hello(1), takes(), refuse(NOT_BACK.format(1)), id="the coordinator says no"),
    pytest.param(hello(1, epochs=5), takes(1), refuse(EPOCHS), id="disagrees"),
    pytest.param(
        hello(1, TWO, epochs=5),
        takes(1),
        refuse(EPOCHS, "devices ['cpu:0', 'cpu:1']: node 1 had ['cpu:0']"),
        id="disagrees, other devices",
    ),
    pytest.param(hello(SPARE, spare=True), takes(1), Park(), id="a spare is parked"),
]


@pytest.mark.parametrize(("seen", "takes_back", "decision"), REJOIN)
def test_a_node_that_registers_again_takes_back_a_lost_nodes_rank_and_slots(
    seen: Hello, takes_back: Callable[[int], bool], decision: Decision
) -> None:
    assert decide(seen, RUNNING, takes_back) == decision


# -- parked spares ---------------------------------------------------------------------------
def spare(devices: tuple[str, ...] = ONE, lost: bool = False) -> NodeView:
    return NodeView(SPARE, devices, lost=lost, spare=True)


LIVE = NodeView(1, ONE, first=1)
LOST1 = NodeView(1, ONE, first=1, lost=True)
LOST2 = NodeView(2, ONE, first=2, lost=True)
PLACE = [
    # (the parked spares, the nodes, the ranks the coordinator takes back, the places)
    pytest.param([spare()], {1: LOST1}, takes(1), [Place(0, 1, 1)], id="placed"),
    pytest.param([], {1: LOST1}, takes(1), [], id="none parked"),
    pytest.param([spare(), spare()], {1: LOST1}, takes(1), [Place(0, 1, 1)], id="second waits"),
    pytest.param([spare()], {1: LIVE}, takes(1), [], id="no node lost"),
    pytest.param([spare(TWO)], {1: LOST1}, takes(1), [], id="other devices"),
    pytest.param([spare()], {1: LOST1}, takes(), [], id="the coordinator says no"),
    pytest.param(
        [spare(TWO), spare()], {1: LOST1}, takes(1), [Place(1, 1, 1)], id="the one that fits"
    ),
    pytest.param(
        [spare(), spare()],
        {2: LOST2, 1: LOST1},
        takes(1, 2),
        [Place(0, 1, 1), Place(1, 2, 2)],
        id="two lost: the lowest rank first",
    ),
    pytest.param(
        [spare()], {1: LOST1, 2: LOST2}, takes(2), [Place(0, 2, 2)], id="the rank taken back"
    ),
    pytest.param([spare(lost=True), spare()], {1: LOST1}, takes(1), [Place(1, 1, 1)], id="lost"),
]


@pytest.mark.parametrize(("spares", "nodes", "takes_back", "places"), PLACE)
def test_a_parked_spare_takes_the_place_of_a_lost_node_with_its_devices(
    spares: list[NodeView],
    nodes: dict[int, NodeView],
    takes_back: Callable[[int], bool],
    places: list[Place],
) -> None:
    assert place_spares(spares, nodes, takes_back) == places


# -- silence ---------------------------------------------------------------------------------
TIMING = Timing(node=timedelta(seconds=10), beat_every=timedelta(seconds=1))
NOW = 100.0
SILENCE = [
    # (the node, what its link said when it closed (None: open), the verdict at NOW)
    pytest.param(NodeView(1, ONE, heard=98.0, sent=99.5), None, Keep(), id="heard and sent"),
    pytest.param(NodeView(1, ONE, heard=98.0, sent=98.5), None, Beat(), id="a beat is due"),
    pytest.param(NodeView(1, ONE, heard=90.0, sent=NOW), None, Keep(), id="at node_timeout"),
    pytest.param(
        NodeView(1, ONE, heard=87.5, sent=NOW),
        None,
        Lost("no word for 12.5s (node_timeout 10s)", 12.5, 10.0),
        id="silent past node_timeout",
    ),
    pytest.param(
        NodeView(1, ONE, heard=87.5, sent=80.0),
        None,
        Lost("no word for 12.5s (node_timeout 10s)", 12.5, 10.0),
        id="silent and owed a beat: lost",
    ),
    pytest.param(
        NodeView(1, ONE, heard=99.0, sent=99.0),
        "peer closed",
        Lost("its link closed (peer closed)"),
        id="its link closed",
    ),
    pytest.param(NodeView(1, ONE, lost=True, heard=50.0), None, Keep(), id="lost: not again"),
    pytest.param(NodeView(1, ONE, lost=True), "closed", Keep(), id="lost, closed: not again"),
    pytest.param(
        NodeView(SPARE, ONE, spare=True, heard=80.0, sent=NOW),
        None,
        Lost("no word for 20.0s (node_timeout 10s)", 20.0, 10.0),
        id="a parked spare alike",
    ),
]


@pytest.mark.parametrize(("node", "closed", "verdict"), SILENCE)
def test_a_node_silent_past_node_timeout_or_whose_link_closed_is_lost_once(
    node: NodeView, closed: str | None, verdict: Keep | Beat | Lost
) -> None:
    assert hear(node, NOW, TIMING, closed) == verdict


# -- start-up: who is awaited, and the slots ---------------------------------------------------
MISSING = [
    (3, [], None, [1, 2]),
    (3, [2], None, [1]),
    (3, [1, 2], None, []),
    (1, [], None, []),  # one node: nobody to wait for
    # a successor (node 1 of 4) waits for the survivors only
    (4, [], (2, 3), [2, 3]),
    (4, [3], (2, 3), [2]),
    (4, [2, 3], (2, 3), []),
]


@pytest.mark.parametrize(("nnodes", "joined", "expected", "awaited"), MISSING)
def test_start_up_waits_for_every_other_node_rank(
    nnodes: int, joined: list[int], expected: tuple[int, ...] | None, awaited: list[int]
) -> None:
    assert missing(nnodes, joined, expected) == awaited


def heirs(*ranks: int, listening: bool = True) -> tuple[Heir, ...]:
    """A succession of these node ranks, the head (the first) with no node port."""
    return tuple(
        Heir(r, f"h{r}", 0 if i == 0 or not listening else 40000 + r, ONE)
        for i, r in enumerate(ranks)
    )


SUCCESSION: list[Any] = [
    # (the head's last succession, this node, also lost, why none may lead, what it does)
    pytest.param(heirs(0, 1, 2), 1, (), None, TakeOver((2,)), id="lowest survivor leads"),
    pytest.param(heirs(0, 1, 2), 2, (), None, Follow(heirs(0, 1, 2)[1]), id="the next follows"),
    pytest.param(heirs(0, 1, 2, 3, 4), 2, (1,), None, TakeOver((3, 4)), id="3 of 5: leads"),
    pytest.param(heirs(0, 1, 2, 3), 3, (), None, Follow(heirs(0, 1, 2, 3)[1]), id="3 of 4"),
    # a later head (node 1 led since the first failover) lost: node 2 leads node 3
    pytest.param(heirs(1, 2, 3), 2, (), None, TakeOver((3,)), id="a second head lost"),
    pytest.param(heirs(0, 1), 1, (), None, "2 nodes are left", id="alone of two: stops"),
    pytest.param(heirs(0, 1, 2, 3), 1, (2,), None, "2 of the run's 4", id="half: stops"),
    pytest.param(heirs(0, 1, 2), 1, (), "no run_dir", "no run_dir", id="cannot"),
    pytest.param(heirs(0, 1, 2), 5, (), None, "not in the run's succession", id="a newcomer"),
    pytest.param(
        heirs(0, 1, 2, listening=False), 1, (), None, "no surviving node listens", id="no port"
    ),
    pytest.param((), 1, (), None, "no surviving node listens", id="never heard one"),
    # a spare placed in node 1's rank has no node port: node 2 leads, node 3 follows
    pytest.param(
        (*heirs(0), Heir(1, "s", 0, ONE), *heirs(0, 2, 3, 4)[1:]),
        3,
        (),
        None,
        Follow(heirs(0, 2)[1]),
        id="a spare does not lead",
    ),
]


@pytest.mark.parametrize(("succession", "me", "lost", "cannot", "does"), SUCCESSION)
def test_the_lowest_surviving_node_leads_a_strict_majority_and_the_others_follow(
    succession: tuple[Heir, ...],
    me: int,
    lost: tuple[int, ...],
    cannot: str | None,
    does: Any,
) -> None:
    decision = successor(succession, me, lost, cannot)
    if isinstance(does, str):
        assert isinstance(decision, Stop) and does in decision.why, decision
    else:
        assert decision == does


MAJORITY = [
    # (nodes that may go on, the leader included; the head's last succession; they go on)
    (2, 3, True),
    (1, 3, False),
    (1, 2, False),  # a node alone of two: the head keeps the tie
    (2, 4, False),  # half of four: a partition could hold the other half and the head
    (3, 4, True),
    (3, 5, True),
    (1, 1, True),
]


@pytest.mark.parametrize(("present", "total", "goes_on"), MAJORITY)
def test_a_node_goes_on_without_the_head_only_with_more_than_half(
    present: int, total: int, goes_on: bool
) -> None:
    assert majority(present, total) is goes_on


SPARE_IN_1 = (*heirs(0), Heir(1, "s", 0, ONE), *heirs(0, 2, 3, 4)[1:])  # (no node port)
OUTNUMBERED: list[Any] = [
    # (the succession a lost node may hold, the nodes the head still hears, it stands down)
    pytest.param(heirs(0, 1, 2), {0}, True, id="cut off alone from two: they take over"),
    pytest.param(heirs(0, 1, 2), {0, 2}, False, id="one of three lost: it cannot"),
    pytest.param(heirs(0, 1, 2), {0, 1}, False, id="the other one lost"),
    pytest.param(heirs(0, 1), {0}, False, id="the other of two: the head keeps the tie"),
    pytest.param(heirs(0, 1, 2, 3), {0, 3}, False, id="half of four: the head's tie"),
    pytest.param(heirs(0, 1, 2, 3, 4), {0, 2}, True, id="1, 3, 4 of five lost: they may"),
    # their leader (node 1) is with the head: the others cannot rally, the head goes on
    pytest.param(heirs(0, 1, 2, 3, 4), {0, 1}, False, id="their leader is here"),
    pytest.param(heirs(0, 1, 2, listening=False), {0}, False, id="none can lead"),
    pytest.param(SPARE_IN_1, {0, 1}, True, id="a spare cannot lead: 2, 3 and 4 may"),
    pytest.param(SPARE_IN_1, {0, 3}, False, id="a spare lost too: two listen, of five"),
    pytest.param((), {0}, False, id="never told one"),
    # a successor head (node 1) with node 2 and 3: node 2 leads the others
    pytest.param(heirs(1, 2, 3), {1}, True, id="a successor cut off"),
]


@pytest.mark.parametrize(("succession", "live", "stands_down"), OUTNUMBERED)
def test_the_head_stands_down_when_the_nodes_it_lost_may_take_over(
    succession: tuple[Heir, ...], live: set[int], stands_down: bool
) -> None:
    assert outnumbered(succession, live) is stands_down
    if stands_down:  # (the other side's leader, with those it lost, would take over)
        heirs_lost = [h for h in succession[1:] if h.port > 0 and h.rank not in live]
        leader = heirs_lost[0].rank
        others = [h.rank for h in succession if h.rank != leader]
        gone = [r for r in others if r in live]
        assert isinstance(successor(succession, leader, gone), TakeOver)


FENCED = [
    # (this head's term, the term in run_dir, replaced)
    (1, 1, False),
    (1, 2, True),
    (3, 2, False),  # (an older file: a successor's failed write never lowers a term)
    (1, None, False),  # no file, or none readable: nothing says another head leads
    (0, 5, False),  # a head without a term (no run_dir) is never fenced
]


@pytest.mark.parametrize(("mine", "current", "replaced"), FENCED)
def test_a_head_is_fenced_only_by_a_newer_term(
    mine: int, current: int | None, replaced: bool
) -> None:
    assert fenced(mine, current) is replaced


LAYOUT = [
    pytest.param(["cpu:0"], {}, Layout(ONE, ONE, (0,), {}), id="the head alone"),
    pytest.param(
        ["cuda:0", "cuda:1"],
        {2: ["cpu:0"], 1: list(TWO)},
        Layout(
            ("cuda:0", "cuda:1", "cpu:0", "cpu:1", "cpu:0"),
            ("cuda:0", "cuda:1", "cpu:0@node1", "cpu:1@node1", "cpu:0@node2"),
            (0, 0, 1, 1, 2),
            {1: 2, 2: 4},
        ),
        id="in node order",
    ),
]


@pytest.mark.parametrize(("own", "nodes", "slots"), LAYOUT)
def test_the_slots_are_numbered_in_node_order(
    own: list[str], nodes: dict[int, list[str]], slots: Layout
) -> None:
    assert layout(own, nodes) == slots


def test_the_rules_import_no_mechanism() -> None:
    """Pure: no socket, thread, clock or log (the time is an argument; see NodeHub)."""
    import ast
    import inspect

    import phalanx.strategies.ddp.coordinator.nodeplan as nodeplan

    tree = ast.parse(inspect.getsource(nodeplan))
    imported = {
        alias.name for n in ast.walk(tree) if isinstance(n, ast.Import) for alias in n.names
    }
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    mechanism = {"socket", "threading", "time", "logging", "queue", "select", "os"}
    assert not {name.split(".")[0] for name in imported} & mechanism, imported
    assert "phalanx.strategies.ddp.wire.link" not in imported


def test_two_long_settings_that_differ_late_are_shown_where_they_differ() -> None:
    from phalanx.checkpoint import Checkpoints
    from phalanx.plan import Plan
    from phalanx.strategies.ddp.coordinator.nodeplan import disagreements

    plan = Plan(120, 12, seed=0)
    mine = Checkpoints(keep_best="val/accuracy", best_mode="max")
    theirs = Checkpoints(keep_best="val/accuracy", best_mode="min")
    assert len(repr(mine)) > 120  # (long enough to have been cut before the difference)
    (line,) = disagreements({"checkpoint": repr(mine)}, {"checkpoint": repr(theirs)}, plan)
    head, node = line.split(", this node ")
    assert "best_mode='max'" in head and "best_mode='min'" in node, line
    assert head.split("the head has ")[1] != node
    assert len(line) < 300
