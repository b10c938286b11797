"""The head's side of several machines: :func:`start_head` (the node port, the run's store,
waiting for every node), :class:`NodeHub` (which only carries out :mod:`..coordinator.nodeplan`'s
decisions: links, refused/parked/welcome/fenced/beat, the clock) and
:class:`RemoteAgent` (another node's workers, reached over its link).

Node 0's ``fit`` is the head: it hosts the store and the coordinator, and its own agent
starts its own workers. Every other node connects over an authenticated
:class:`~..wire.link.Link`, says who it is (its devices, and what must agree across nodes),
and from then on is an agent of the head. The slots are numbered in node order (node 0's
devices first), so a coordinator decides as on one machine; a node that stops talking for
``node_timeout`` is lost with all its workers (:class:`~..coordinator.coordinator.NodeLost`)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from phalanx.errors import (
    NodesDisagreeError,
)
from phalanx.events import Notice
from phalanx.failures import WorkerFailure
from phalanx.launch import SPARE, Launch, is_loopback
from phalanx.plan import Plan
from phalanx.run import RunInputs
from phalanx.strategies.ddp.agent.agent import Agent
from phalanx.strategies.ddp.coordinator.nodeplan import (
    Beat,
    Hello,
    Keep,
    Layout,
    Lost,
    NodeView,
    Park,
    Refuse,
    TakeOver,
    admit,
    disagreements,
    hear,
    layout,
    missing,
    outnumbered,
    place_spares,
)
from phalanx.strategies.ddp.nodes.failover import Failover, cannot_fail_over, check_quorum
from phalanx.strategies.ddp.nodes.fencing import Fence, claim
from phalanx.strategies.ddp.nodes.shared import (
    agreement,
    check_interface,
    head_token,
    link_address,
    tell,
)
from phalanx.strategies.ddp.timing import Timing
from phalanx.strategies.ddp.wire.control import Signer, new_run_id
from phalanx.strategies.ddp.wire.link import Frame, Link, LinkError, Listener
from phalanx.strategies.ddp.wire.messages import (
    BadMessage,
    DumpOrder,
    End,
    Fenced,
    Heir,
    KeepAlive,
    KillOrder,
    Message,
    Parked,
    Refused,
    SpawnOrder,
    Stacks,
    Welcome,
    decode,
)


# -- the head's side ----------------------------------------------------------------------
@dataclass
class RemoteNode:
    rank: int
    host: str
    devices: list[str]
    link: Link
    first: int = 0  # its first slot
    lost: bool = False
    last_sent: float = field(default_factory=time.monotonic)
    alive: set[int] = field(default_factory=set)  # its slots with a live process
    spare: bool = False  # a spare that took this node rank's place
    standby: int = 0  # the node port it would lead the run from (0: none)
    # The succession it holds as the head's last word, as far as the head can know: the
    # last one told before its latest frame, or one told since (see may_hold)
    told: tuple[Heir, ...] = ()
    told_since: list[tuple[Heir, ...]] = field(default_factory=list)
    believed: tuple[Heir, ...] = ()
    agent: RemoteAgent = field(init=False, repr=False, compare=False)  # (its slots' actions)

    def __post_init__(self) -> None:
        self.agent = RemoteAgent(self)

    @property
    def slots(self) -> range:
        return range(self.first, self.first + len(self.devices))

    def send(self, message: Message) -> None:
        """``message`` to the node, unless it is lost (a failed send is seen as its loss by
        :meth:`NodeHub.poll`)."""
        if self.lost:
            return
        try:
            tell(self.link, message)
            self.last_sent = time.monotonic()
        except LinkError:
            pass

    def told_succession(self, succession: tuple[Heir, ...]) -> None:
        """``succession`` was sent to it (in a welcome, a keep-alive)."""
        self.told = succession
        if succession not in self.told_since:
            self.told_since.append(succession)

    def heard(self) -> None:
        """A frame came from it: it had (most likely) read what was told before."""
        self.believed, self.told_since = self.told, []

    def may_hold(self) -> list[tuple[Heir, ...]]:
        """Each succession it may hold as the head's last word: the one it read before its
        latest frame, or one sent since (which it may have read)."""
        return [self.believed, *(s for s in self.told_since if s != self.believed)]

    def heir(self) -> Heir:
        """Its entry in the run's succession: the address the head reaches it on."""
        host = self.link.peer.rsplit(":", 1)[0].strip("[]")
        return Heir(self.rank, host, self.standby, tuple(self.devices))

    def view(self) -> NodeView:
        """What :mod:`.nodeplan`'s rules read of it (its link's last frame: now)."""
        devices, heard, sent = tuple(self.devices), self.link.last_heard, self.last_sent
        return NodeView(self.rank, devices, self.first, self.lost, self.spare, heard, sent)


def _read_hello(frame: Frame) -> tuple[Hello, list[str]]:
    """A node's hello, or one of rank -1 and why it could not be read."""
    try:
        hello = decode(frame)
    except BadMessage as exc:
        return Hello(-1), [str(exc)]
    if not isinstance(hello, Hello):  # (Link.accept takes only a hello)
        return Hello(-1), [f"a {frame.kind!r} frame where a hello is due"]
    return hello, []


class RemoteAgent:
    """A node's workers, as the head reaches them (the :class:`~.routing.Agents` of its
    slots): orders over its link, answered later by the node (``spawned``, ``stacks``)."""

    def __init__(self, node: RemoteNode) -> None:
        self.node = node

    def spawn(self, order: SpawnOrder) -> None:
        self.node.alive.add(order.slot)
        self.node.send(order)

    def kill(self, slot: int) -> None:
        self.node.send(KillOrder(slot))

    def stacks(self, slots: Sequence[int]) -> Stacks:
        if self.node.lost:
            return Stacks({slot: "(its node was lost)" for slot in slots})
        self.node.send(DumpOrder(tuple(slots)))
        return Stacks()


class NodeHub:
    """The head's links to the other nodes. What to do with each hello, spare and silence
    is decided by :mod:`.nodeplan`'s rules; the hub sends, closes, starts and keeps time."""

    def __init__(self, listener: Listener, nnodes: int, timing: Timing) -> None:
        self.listener, self.nnodes, self.timing = listener, nnodes, timing
        self.nodes: dict[int, RemoteNode] = {}
        self.spares: list[RemoteNode] = []  # parked: each takes the place of a lost node
        self.notes: list[tuple[str, str]] = []  # (level, text) for the head's sinks
        self.rejected: list[tuple[str, str]] = []
        self.check: dict[str, Any] = {}
        self.plan: Plan | None = None
        self.store: tuple[str, int] | None = None
        self.labels: list[str] = []
        self.run_id = ""  # the nodes sign with Signer.for_run(token, run_id), as the head
        self.prefix = ""  # of the run's keys in the store (see Agent.prefix)
        self.own = Heir(0, "?", 0)  # the head's own entry in the succession
        # A lost node that may be on the side of a partition that takes over: the head
        # stands down (see outnumbered); None while it may go on
        self.outvoted: RemoteNode | None = None
        self.replaceable = False  # whether a node may take over were the head lost
        self.term = 0  # the head's fencing term (0: none; see fencing)

    def succession(self) -> tuple[Heir, ...]:
        """The run's succession as the head knows it now: itself, then every live node in
        rank order (spares are not in it)."""
        live = [node.heir() for rank, node in sorted(self.nodes.items()) if not node.lost]
        return (self.own, *live)

    def outnumbered(self, node: RemoteNode) -> bool:
        """Whether ``node``, just lost, may be on the side of a partition that takes over,
        by any succession it may hold (:func:`~..coordinator.nodeplan.outnumbered`)."""
        live = {self.own.rank, *(n.rank for n in self.nodes.values() if not n.lost)}
        return any(outnumbered(s, live) for s in node.may_hold())

    def gather(
        self,
        check: dict[str, Any],
        plan: Plan,
        own: list[str],
        deadline: timedelta,
        expected: Sequence[int] | None = None,
    ) -> Layout:
        """Wait for every other node's hello; refuse one that disagrees (the head fails
        too: PX144). Returns the slots in node order (each node's first slot set).
        ``expected``: a successor's wait for the survivors' node ranks, which goes on at
        ``deadline`` with those that came."""
        self.check, self.plan = check, plan
        end = time.monotonic() + deadline.total_seconds()
        while missing(self.nnodes, self.nodes, expected):
            self._rejected()
            left = end - time.monotonic()
            if left <= 0 and expected is not None:
                break
            if left <= 0:
                raise NodesDisagreeError(
                    f"nodes {missing(self.nnodes, self.nodes)} did not join within "
                    f"{deadline.total_seconds():g}s: start the same script on every node with "
                    "PHALANX_HEAD naming this head"
                )
            try:
                tick = self.timing.join_poll.total_seconds()
                link, hello = self.listener.joined.get(timeout=min(left, tick))
            except Exception:
                continue
            self._hello(link, hello, expected=expected)
        slots = layout(own, {rank: node.devices for rank, node in self.nodes.items()})
        for rank, first in slots.first.items():
            self.nodes[rank].first = first
        return slots

    def _hello(
        self,
        link: Link,
        frame: Frame,
        admits: Callable[[int], bool] | None = None,
        expected: Sequence[int] | None = None,
    ) -> tuple[RemoteNode, str] | None:
        """A hello, at start-up (``admits`` None) or during the run, as
        :func:`~.nodeplan.admit` decides: a spare parked (or refused: a warning note); a
        node taken, or refused (told why, PX144) with the head failing too at start-up.
        During the run, returns the node taken back (welcomed) or refused, with why (empty
        for one taken back). A hello this version cannot read is a node of rank -1 that
        says nothing, refused with why."""
        assert self.plan is not None
        hello, unread = _read_hello(frame)
        problems = unread + disagreements(self.check, hello.check, self.plan)
        if expected is not None and not hello.spare and hello.rank not in expected:
            problems.append(f"node {hello.rank} is not a survivor this head waits for")
        views = {rank: node.view() for rank, node in self.nodes.items()}
        decision = admit(hello, problems, views, self.nnodes, admits)
        node = RemoteNode(hello.rank, hello.host, list(hello.devices), link)
        node.standby = hello.standby
        if isinstance(decision, Refuse):
            with contextlib.suppress(LinkError):
                tell(link, Refused(NodesDisagreeError.code, decision.message))
            link.close()
            if hello.spare:
                note = f"refused a spare on {hello.host}: {decision.message}"
                self.notes.append(("warning", note))
                return None
            if admits is None and expected is None:
                raise NodesDisagreeError(f"node {hello.rank} ({hello.host}): {decision.message}")
            if admits is None:
                self.notes.append(("warning", f"refused node {hello.rank}: {decision.message}"))
                return None
            return node, decision.message
        if isinstance(decision, Park):  # kept (its link beats both ways) until a node is lost
            with contextlib.suppress(LinkError):
                tell(link, Parked())
                link.start()
                self.spares.append(dataclasses.replace(node, rank=SPARE, spare=True))
                note = f"a spare on {hello.host} waits to take a lost node's place"
                self.notes.append(("info", note))
            return None
        node.first = decision.first
        self.nodes[decision.rank] = node
        if admits is None:
            return None  # (welcomed with the others once all joined)
        self._welcome(node)
        return node, ""

    def welcome(
        self, labels: list[str], store: tuple[str, int], run_id: str, prefix: str = ""
    ) -> None:
        self.labels, self.store, self.run_id, self.prefix = labels, store, run_id, prefix
        for node in self.nodes.values():
            self._welcome(node)

    def _welcome(self, node: RemoteNode) -> None:
        assert self.store is not None
        labels, store = tuple(self.labels), self.store
        welcome = Welcome(
            node.rank,
            labels,
            node.first,
            store,
            self.prefix,
            self.run_id,
            self.term,
            self.succession(),
        )
        with contextlib.suppress(LinkError):  # (gone since its hello: poll sees its loss)
            tell(node.link, welcome)
            node.told_succession(welcome.succession)
        node.link.start()

    def rejoined(self, admits: Callable[[int], bool]) -> list[tuple[RemoteNode, str]]:
        """Nodes that registered again during the run (a lost node's rank, the same devices,
        agreeing), welcomed back, and parked spares placed in lost nodes' ranks: to be
        started as replacements. Any other registration is refused, with why (the second
        item; empty for a node let back in); a spare is parked."""
        found: list[tuple[RemoteNode, str]] = []
        while not self.listener.joined.empty():
            link, hello = self.listener.joined.get()
            seen = self._hello(link, hello, admits)
            if seen is not None:
                found.append(seen)
        return found + self._place_spares(admits)

    def _place_spares(self, admits: Callable[[int], bool]) -> list[tuple[RemoteNode, str]]:
        """Each parked spare that :func:`~.nodeplan.place_spares` places takes its lost
        node's rank and slots, welcomed as that node would be when it rejoins."""
        spares = list(self.spares)
        views = {rank: node.view() for rank, node in self.nodes.items()}
        placed: list[tuple[RemoteNode, str]] = []
        for place in place_spares([s.view() for s in spares], views, admits):
            spare = spares[place.spare]
            node = RemoteNode(
                place.rank, spare.host, spare.devices, spare.link, place.first, spare=True
            )
            self.spares.remove(spare)
            self.nodes[place.rank] = node
            self._welcome(node)
            placed.append((node, ""))
        return placed

    def node_of(self, slot: int) -> RemoteNode | None:
        for node in self.nodes.values():
            if slot in node.slots:
                return node
        return None

    def agent_of(self, slot: int) -> RemoteAgent | None:
        """The agent of the node that holds ``slot`` (None: none does, it is the head's)."""
        node = self.node_of(slot)
        return None if node is None else node.agent

    def poll(self) -> tuple[list[tuple[RemoteNode, Frame]], list[tuple[RemoteNode, str]]]:
        """Frames from every live node, and the nodes lost since the last poll (why).
        Parked spares are heard the same way; one that is lost is dropped (a warning)."""
        frames: list[tuple[RemoteNode, Frame]] = []
        lost: list[tuple[RemoteNode, str]] = []
        now = time.monotonic()
        for spare in list(self.spares):
            gone = self._listen(spare, now, [])
            if gone is not None:
                if gone.silent is not None:
                    with contextlib.suppress(LinkError, OSError):
                        tell(spare.link, Fenced(gone.silent, gone.limit))
                spare.lost = True
                spare.link.close()
                self.spares.remove(spare)
                self.notes.append(("warning", f"the spare on {spare.host} is gone: dropped"))
        silent: list[tuple[RemoteNode, Lost]] = []
        for node in self.nodes.values():
            if node.lost:
                continue  # (its link is closed)
            verdict = self._listen(node, now, frames)
            if verdict is not None:
                node.lost = True
                silent.append((node, verdict))
        # The head stands down when a lost node may be on the side that takes over; else a
        # node lost for its silence is told so (a frozen node reads it when it wakes: out).
        if self.replaceable and self.outvoted is None:
            self.outvoted = next((node for node, _ in silent if self.outnumbered(node)), None)
        for node, verdict in silent:
            if verdict.silent is not None and self.outvoted is None:
                with contextlib.suppress(LinkError, OSError):
                    tell(node.link, Fenced(verdict.silent, verdict.limit))
            node.link.close()
            node.alive.clear()
            lost.append((node, verdict.why))
        self._rejected()
        return frames, lost

    def _listen(
        self, node: RemoteNode, now: float, frames: list[tuple[RemoteNode, Frame]]
    ) -> Lost | None:
        """``node``'s frames (added to ``frames``) and whether it is lost now (None: it is
        not), as :func:`~.nodeplan.hear` decides; a live one gets its keep-alive."""
        closed = None
        for item in node.link.drain():
            if isinstance(item, LinkError):
                closed = str(item)
                break
            frames.append((node, item))
            node.heard()
        verdict = hear(node.view(), now, self.timing, closed)
        if isinstance(verdict, Beat):
            succession = self.succession()
            node.send(KeepAlive(succession))
            node.told_succession(succession)
        if isinstance(verdict, (Beat, Keep)):
            return None
        return verdict

    def _rejected(self) -> None:
        while not self.listener.rejected.empty():
            self.rejected.append(self.listener.rejected.get())
        while not self.listener.troubles.empty():
            why = self.listener.troubles.get()
            note = f"head: the node port failed to accept a connection ({why}); it listens on"
            self.notes.append(("warning", note))

    def all_exited(self) -> bool:
        return all(node.lost or not node.alive for node in self.nodes.values())

    def close(self) -> None:
        for node in [*self.nodes.values(), *self.spares]:
            node.link.close()
        self.listener.close()


@dataclass
class Nodes:
    """The head's side of a run over several nodes, set up before its supervisor."""

    hub: NodeHub
    agent: Agent  # the head's own: hosts the store on the head's address
    labels: list[str]  # every slot's device, node 0's first
    shown: list[str]  # the same, with the node of each remote one (for reports)
    slot_nodes: tuple[int, ...]
    fence: Fence | None = None  # the head's term, while it leads (a shared run_dir)
    # failures decided before this head started: the lost head's, named by its successor
    inherited: list[WorkerFailure] = field(default_factory=list)


def start_head(run: RunInputs, launch: Launch, emit: Any, timing: Timing) -> Nodes:
    """Listen on ``PHALANX_HEAD``'s address, host the store there, and wait for every node
    to join and agree; every node is then told the slots and where the store is. With a
    shared run_dir the head takes a fencing term first (:mod:`.fencing`). A successor
    (``run.failover``: the head was lost and this node leads) listens on the node port it
    had open, takes the next term, waits ``timing.takeover`` for the other survivors and
    goes on with those that came while they are more than half of the run's succession."""
    config = run.config
    failover: Failover | None = run.failover
    check_interface(launch, config)
    # (a new head keeps the run's token: the nodes hold it, and run_dir/token stays)
    token = head_token(config.run_dir) if failover is None else failover.token
    run_id = new_run_id()  # this run's signing key is made from the token and it
    host, port = link_address(launch)
    if failover is not None and failover.standby is not None:
        listener = failover.standby.listener
    else:
        listener = Listener.open(host, port, token, timing)
    hub: NodeHub | None = None
    try:
        term = None
        if config.run_dir:
            term = claim(
                config.run_dir,
                launch.node_rank if failover is None else failover.me,
                host,
                listener.port,
            )
        env = os.environ if failover is None else {}  # (a successor's store: any free port)
        agent = head_agent(launch, host, token, run_id, env, timing)
        hub = NodeHub(listener, launch.nnodes, timing)
        hub.term = 0 if term is None else term.term
        awaited = None if failover is None else failover.awaited()
        emit(waiting_notice(launch.nnodes, f"{host}:{listener.port}", agent, awaited))
        if is_loopback(host):
            emit(Notice(f"head: {host} is loopback: only nodes on this machine reach it"))
        precision = str(getattr(run.spec, "precision", "32"))
        check = agreement(config, run.plan, precision)
        expected = None
        wait = timing.join
        if failover is not None:
            assert isinstance(failover.decision, TakeOver)
            expected, wait = failover.decision.expected, timing.takeover
        slots = hub.gather(check, run.plan, list(config.devices), wait, expected)
        if failover is not None:
            check_quorum(failover, sorted(hub.nodes), emit)
    except BaseException:
        if hub is not None:
            hub.close()  # (the links of the nodes that came, and the listener)
        listener.close()
        raise
    assert agent.store_at is not None
    labels = list(slots.labels)
    me = launch.node_rank if failover is None else failover.me
    hub.own = Heir(me, host, 0, tuple(config.devices))
    hub.welcome(labels, agent.store_at, run_id, agent.prefix)
    for level, text in hub.notes:
        emit(Notice(text, level))
    hub.notes.clear()
    for address, why in hub.rejected:
        emit(rejected_link(address, why))
    hub.rejected.clear()
    fence = (
        None
        if term is None
        else Fence(config.run_dir or "", term, timing.fence_every.total_seconds())
    )
    inherited = [] if failover is None else [failover.failure]
    hub.replaceable = cannot_fail_over(config, launch) is None  # (else it never stands down)
    return Nodes(hub, agent, labels, list(slots.shown), slots.slot_nodes, fence, inherited)


def waiting_notice(
    nnodes: int, address: str, agent: Agent, awaited: Sequence[int] | None = None
) -> Notice:
    assert agent.store_at is not None
    store = f"{agent.store_at[0]}:{agent.store_at[1]}" + (" (torchrun's)" if agent.client else "")
    who = f"{nnodes - 1} node(s)" if awaited is None else f"node(s) {list(awaited)}"
    return Notice(f"head: waiting for {who} at {address} (store at {store})")


def head_agent(
    launch: Launch, host: str, token: bytes, run_id: str, env: Mapping[str, str], timing: Timing
) -> Agent:
    """The head's agent and the run's store. Under torchrun the store is torchrun's own:
    its agent's store at ``MASTER_ADDR:MASTER_PORT`` when torchrun shares it with its
    workers (``TORCHELASTIC_USE_AGENT_STORE``; the run's keys under ``phalanx/<run id>/``),
    else one this process hosts on ``MASTER_PORT`` (the port torchrun set aside for the
    workers' store). Otherwise the head hosts it on ``PHALANX_STORE_PORT`` (any free port
    when unset)."""
    signer = Signer.for_run(token, run_id)
    if launch.source == "torchrun" and launch.head is not None:
        if env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
            at = (launch.head.host, launch.head.port)
            prefix = f"phalanx/{run_id}"
            return Agent(
                bind=None, store_at=at, prefix=prefix, client=True, signer=signer, timing=timing
            )
        return Agent(bind=(host, launch.head.port), signer=signer, timing=timing)
    bind = (host, int(env.get("PHALANX_STORE_PORT", "0")))
    return Agent(bind=bind, signer=signer, timing=timing)


def rejected_link(address: str, why: str) -> Any:
    """The head's one warning for a connection it refused (PX150)."""

    return Notice(
        f"PX150: refused a connection from {address} that did not prove this run's token "
        f"({why}). The run goes on. See `phalanx explain PX150`.",
        level="warning",
    )


def tell_end(hub: NodeHub, end: End) -> None:
    """Every live node learns how the run ended (with the final weights when it finished)."""
    for node in [*hub.nodes.values(), *hub.spares]:  # (a spare still parked returns it too)
        node.send(end)
