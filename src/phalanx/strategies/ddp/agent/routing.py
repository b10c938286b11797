"""Who carries out an action on a slot: one :class:`Agents` interface for this machine's
agent (:class:`LocalAgent`) and another node's, reached over its link
(:class:`~..nodes.hub.RemoteAgent`), and the :class:`Router` that gives each slot's action to
the one that holds the slot. The supervisor calls the router and never asks where a slot
is; a node's agent carries out the head's orders with its own :class:`LocalAgent`.

An action is answered at once where it can be (a worker started here, stacks dumped here,
a lost node's stacks), else later: a node sends its :class:`~.messages.Started` and
:class:`~.messages.Stacks` over its link, and the supervisor takes them as it takes the
ones answered at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from phalanx.strategies.ddp.agent.agent import Agent
from phalanx.strategies.ddp.agent.spawner import Spawner
from phalanx.strategies.ddp.wire.messages import SpawnOrder, Stacks, Started


class Agents(Protocol):
    """Actions on worker slots."""

    def spawn(self, order: SpawnOrder) -> Started | None:
        """Start ``order.slot``'s worker; None: asked, its :class:`Started` comes later."""

    def kill(self, slot: int) -> None:
        """Kill ``slot``'s worker (nothing when none is alive)."""

    def stacks(self, slots: Sequence[int]) -> Stacks:
        """The stacks of ``slots``' workers known now; those missing were asked for, and
        come later as :class:`Stacks`."""


class LocalAgent:
    """This machine's workers: its :class:`~.agent.Agent` and :class:`~.spawner.Spawner`."""

    def __init__(self, agent: Agent, spawner: Spawner) -> None:
        self.agent, self.spawner = agent, spawner

    def spawn(self, order: SpawnOrder) -> Started:
        return Started(order.slot, self.spawner.spawn(order))

    def kill(self, slot: int) -> None:
        self.agent.kill(slot)

    def stacks(self, slots: Sequence[int]) -> Stacks:
        return Stacks({slot: self.agent.dump_stacks(slot) for slot in slots})


class Router:
    """Each slot's action to the agent that holds the slot: ``remote(slot)`` names the
    other node's agent that holds it, None when it is this machine's (``local``)."""

    def __init__(self, local: Agents, remote: Callable[[int], Agents | None] | None = None) -> None:
        self.local, self.remote = local, remote

    def of(self, slot: int) -> Agents:
        found = None if self.remote is None else self.remote(slot)
        return self.local if found is None else found

    def spawn(self, order: SpawnOrder) -> Started | None:
        return self.of(order.slot).spawn(order)

    def kill(self, slot: int) -> None:
        self.of(slot).kill(slot)

    def stacks(self, slots: Sequence[int]) -> Stacks:
        """Each agent is asked once, for all its slots among ``slots``."""
        asked: list[tuple[Agents, list[int]]] = []
        for slot in slots:
            agent = self.of(slot)
            mine = next((s for a, s in asked if a is agent), None)
            if mine is None:
                asked.append((agent, [slot]))
            else:
                mine.append(slot)
        known: dict[int, str] = {}
        for agent, mine in asked:
            known.update(agent.stacks(mine).stacks)
        return Stacks(known)
