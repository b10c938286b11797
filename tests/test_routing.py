"""Who carries out an action on a slot: the router gives each action to the agent that
holds the slot (this machine's or a node's), asks each agent once for the stacks of its
slots, and a lost node's slots answer for themselves. Fakes stand for the agents; a node's
agent is the real one over a fake link."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest

from phalanx.strategies.ddp.agent.routing import Router
from phalanx.strategies.ddp.nodes.hub import NodeHub, RemoteNode
from phalanx.strategies.ddp.nodes.node import _order
from phalanx.strategies.ddp.timing import DEFAULT
from phalanx.strategies.ddp.wire.link import Frame
from phalanx.strategies.ddp.wire.messages import (
    DumpOrder,
    Heir,
    KillOrder,
    Message,
    SpawnOrder,
    Stacks,
    Started,
    decode,
)


class FakeAgents:
    """An agent that records what it was asked; ``later``: it answers nothing at once (as
    a node does)."""

    def __init__(self, name: str, later: bool = False) -> None:
        self.name, self.later = name, later
        self.calls: list[tuple[str, Any]] = []

    def spawn(self, order: SpawnOrder) -> Started | None:
        self.calls.append(("spawn", order.slot))
        return None if self.later else Started(order.slot, 100 + order.slot)

    def kill(self, slot: int) -> None:
        self.calls.append(("kill", slot))

    def stacks(self, slots: Sequence[int]) -> Stacks:
        self.calls.append(("stacks", list(slots)))
        return Stacks() if self.later else Stacks({s: f"{self.name} {s}" for s in slots})


def router() -> tuple[Router, FakeAgents, FakeAgents, FakeAgents]:
    """Slots 0 and 1 on this machine, 2 and 3 on node a, 4 on node b."""
    local, a, b = FakeAgents("local"), FakeAgents("a", later=True), FakeAgents("b", later=True)
    nodes = {2: a, 3: a, 4: b}
    return Router(local, nodes.get), local, a, b


ROUTES = [
    # (the action, the slot, who carries it out, the answer at once)
    ("spawn", 1, "local", Started(1, 101)),
    ("spawn", 3, "a", None),
    ("spawn", 4, "b", None),
    ("kill", 0, "local", None),
    ("kill", 2, "a", None),
    ("kill", 4, "b", None),
]


@pytest.mark.parametrize(("action", "slot", "who", "answer"), ROUTES)
def test_each_action_goes_to_the_agent_of_its_slot_only(
    action: str, slot: int, who: str, answer: Started | None
) -> None:
    route, *agents = router()
    if action == "spawn":
        assert route.spawn(SpawnOrder(slot)) == answer
    else:
        route.kill(slot)
    for agent in agents:
        assert agent.calls == ([(action, slot)] if agent.name == who else [])


def test_each_agent_is_asked_once_for_the_stacks_of_its_slots() -> None:
    route, local, a, b = router()
    got = route.stacks([3, 0, 4, 2, 1])
    assert got == Stacks({0: "local 0", 1: "local 1"})  # (the nodes answer later)
    assert local.calls == [("stacks", [0, 1])]
    assert a.calls == [("stacks", [3, 2])]
    assert b.calls == [("stacks", [4])]


def test_without_nodes_every_slot_is_this_machines() -> None:
    local = FakeAgents("local")
    route = Router(local)
    assert route.spawn(SpawnOrder(5)) == Started(5, 105)
    assert route.stacks([5, 6]) == Stacks({5: "local 5", 6: "local 6"})
    assert local.calls == [("spawn", 5), ("stacks", [5, 6])]


# -- a node's agent, as the head reaches it --------------------------------------------------
class FakeLink:
    def __init__(self) -> None:
        self.sent: list[Message] = []

    def send_frame(self, frame: Frame) -> None:
        self.sent.append(decode(frame))


def hub_with_nodes(lost: bool = False) -> tuple[NodeHub, RemoteNode, RemoteNode]:
    """The head's slots 0 and 1; node 1 holds 2 and 3, node 2 holds 4 (``lost``: node 1
    is)."""
    hub = NodeHub(SimpleNamespace(), 3, DEFAULT)  # type: ignore[arg-type]
    one = RemoteNode(1, "h1", ["cpu:0", "cpu:1"], FakeLink(), first=2, lost=lost)  # type: ignore[arg-type]
    two = RemoteNode(2, "h2", ["cpu:0"], FakeLink(), first=4)  # type: ignore[arg-type]
    hub.nodes = {1: one, 2: two}
    return hub, one, two


def sent(node: RemoteNode) -> list[Message]:
    return node.link.sent  # type: ignore[attr-defined, no-any-return]


def test_the_head_routes_a_nodes_slots_to_its_link_and_keeps_its_own() -> None:
    hub, one, two = hub_with_nodes()
    local = FakeAgents("local")
    route = Router(local, hub.agent_of)
    assert route.spawn(SpawnOrder(3, replacement=True)) is None  # (its answer comes later)
    route.kill(4)
    assert route.stacks([0, 2, 3, 4]) == Stacks({0: "local 0"})
    assert route.spawn(SpawnOrder(1)) == Started(1, 101)
    assert sent(one) == [SpawnOrder(3, replacement=True), DumpOrder((2, 3))]
    assert sent(two) == [KillOrder(4), DumpOrder((4,))]
    assert local.calls == [("stacks", [0]), ("spawn", 1)]
    assert one.alive == {3}  # (a node's worker counts as alive once ordered)


def test_a_lost_nodes_slots_answer_for_their_stacks_and_it_is_sent_nothing() -> None:
    hub, one, two = hub_with_nodes(lost=True)
    route = Router(FakeAgents("local"), hub.agent_of)
    got = route.stacks([2, 3, 4])
    assert got == Stacks({2: "(its node was lost)", 3: "(its node was lost)"})
    route.kill(2)
    route.spawn(SpawnOrder(3))
    assert sent(one) == [] and sent(two) == [DumpOrder((4,))]


def test_a_node_that_takes_a_lost_nodes_place_gets_its_slots_actions() -> None:
    hub, one, _ = hub_with_nodes(lost=True)
    route = Router(FakeAgents("local"), hub.agent_of)
    back = RemoteNode(1, "h1b", ["cpu:0", "cpu:1"], FakeLink(), first=2)  # type: ignore[arg-type]
    hub.nodes[1] = back
    route.kill(3)
    assert sent(one) == [] and sent(back) == [KillOrder(3)]


# -- a node's agent, carrying out the head's orders ------------------------------------------
@pytest.mark.parametrize(
    ("order", "calls", "answer"),
    [
        (SpawnOrder(2), [("spawn", 2)], [Started(2, 102)]),
        (KillOrder(3), [("kill", 3)], []),
        (DumpOrder((2, 3)), [("stacks", [2, 3])], [Stacks({2: "node 2", 3: "node 3"})]),
    ],
    ids=["spawn", "kill", "dump"],
)
def test_a_node_carries_out_an_order_with_its_own_agent_and_answers(
    order: Message, calls: list[tuple[str, Any]], answer: list[Message]
) -> None:
    local, link = FakeAgents("node"), FakeLink()
    _order(order, link, local)  # type: ignore[arg-type]
    assert local.calls == calls and link.sent == answer


# -- what a lost node may hold as the head's last word ---------------------------------------
def three(hub: NodeHub, *ranks: int) -> tuple[Heir, ...]:
    """A succession of the head and these node ranks (each with a node port)."""
    return (hub.own, *(Heir(r, f"h{r}", 40000 + r, ("cpu:0",)) for r in ranks))


def test_a_partition_makes_the_head_stand_down_and_deaths_far_apart_do_not() -> None:
    """Three nodes. A partition: both nodes last read the succession of three; the head
    then tells node 2 the succession without node 1, which node 2, cut off, never reads: by
    what it may hold, node 2 (with node 1, its leader) may take over, so the head stands
    down. Deaths far apart: node 2 answered after reading the succession of two (it leads
    alone of two, not more than half), so at its loss the head goes on."""
    hub, one, two = hub_with_nodes()
    for node in (one, two):
        node.told_succession(three(hub, 1, 2))
        node.heard()
    one.lost = True
    assert not hub.outnumbered(one)  # (the head and node 2: two of three)
    two.told_succession(three(hub, 2))  # (sent after node 2's last word: perhaps never read)
    two.lost = True
    assert two.may_hold() == [three(hub, 1, 2), three(hub, 2)] and hub.outnumbered(two)

    hub, one, two = hub_with_nodes()
    for node in (one, two):
        node.told_succession(three(hub, 1, 2))
        node.heard()
    one.lost = True
    two.told_succession(three(hub, 2))
    two.heard()  # (it answered after that keep-alive)
    two.lost = True
    assert two.may_hold() == [three(hub, 2)] and not hub.outnumbered(two)
