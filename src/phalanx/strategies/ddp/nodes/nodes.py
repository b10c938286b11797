"""Several machines: the head's view of the nodes (:class:`NodeHub`) and a node's agent
(:func:`run_node`).

Node 0's ``fit`` is the head: it hosts the store and the coordinator, and its own agent
starts its own workers. Every other node's ``fit`` connects to the head over an
authenticated :class:`~.link.Link`, says who it is (its devices, and what must agree across
nodes: torch and phalanx versions, the plan with the data's fingerprint, the configuration),
and from then on is an agent: it starts, watches, kills and dumps the stacks of its own
workers as the head orders, and sends everything its agent sees back as data. The slots
are numbered in node order (node 0's devices first), so a coordinator decides as on one
machine; a node that stops talking for ``node_timeout`` is lost with all its workers
(:class:`~.coordinator.NodeLost`). A node that loses the head (its link closed, or silent
for as long) has its workers save what the run committed and ends with
:class:`~phalanx.errors.HeadLost` (see :mod:`..worker.emergency` and :mod:`.headloss`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import socket
import stat
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from phalanx.errors import (
    HeadLost,
    HeadLostError,
    InterfaceError,
    NodeFencedError,
    NodesDisagreeError,
    NoTokenError,
)
from phalanx.events import Notice
from phalanx.interrupt import Interrupter
from phalanx.launch import SPARE, Launch, interface_problem, is_loopback
from phalanx.plan import Plan
from phalanx.ranks import acting_as
from phalanx.run import RunEnd, RunInputs, stopped
from phalanx.snapshot.config import snapshots_off
from phalanx.spec import FitConfig
from phalanx.strategies.ddp.agent.agent import Agent, start_fork_server
from phalanx.strategies.ddp.agent.routing import LocalAgent
from phalanx.strategies.ddp.agent.spawner import Spawner
from phalanx.strategies.ddp.coordinator.nodeplan import (
    Beat,
    Hello,
    Keep,
    Layout,
    NodeView,
    Park,
    Refuse,
    admit,
    disagreements,
    hear,
    layout,
    missing,
    place_spares,
)
from phalanx.strategies.ddp.nodes.headloss import head_lost_message, save_on_head_loss
from phalanx.strategies.ddp.timing import DEFAULT, Timing
from phalanx.strategies.ddp.wire.control import TOKEN_ENV, Signer, new_run_id
from phalanx.strategies.ddp.wire.link import Frame, Link, LinkError, Listener
from phalanx.strategies.ddp.wire.messages import (
    BadMessage,
    DumpOrder,
    End,
    Fenced,
    FinalWeights,
    KeepAlive,
    KillOrder,
    Message,
    Parked,
    Refused,
    SpawnOrder,
    Stacks,
    StopAsked,
    Welcome,
    decode,
    encode,
)
from phalanx.strategies.ddp.wire.protocol import Done, Saved
from phalanx.version import __version__

TOKEN_FILE = "token"  # in run_dir, owner-only: the run's token for every node


def link_address(launch: Launch) -> tuple[str, int]:
    """Where the head listens for nodes: ``PHALANX_HEAD`` (Slurm: the first node, on
    ``PHALANX_PORT``); under torchrun the port after ``MASTER_PORT`` (which torchrun's own
    store holds)."""
    assert launch.head is not None
    extra = 1 if launch.source == "torchrun" else 0
    return launch.head.host, launch.head.port + extra


def _resolve(host: str) -> str | None:
    """The first address ``host`` resolves to (IPv4 or IPv6), or None."""
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return None
    return str(found[0][4][0]) if found else None


def check_interface(launch: Launch, config: FitConfig) -> None:
    """PX146 before anything starts, where this node's collectives would bind to loopback
    while the head is on another machine (:func:`phalanx.launch.interface_problem`)."""
    host, _ = link_address(launch)
    head = _resolve(host) or host  # (unresolvable: joining names an unreachable head)
    name = socket.gethostname()
    own = _resolve(name)
    gloo = any(label.startswith("cpu") for label in config.devices)
    problem = interface_problem(head, name, own, os.environ, gloo)
    if problem is not None:
        raise InterfaceError(problem)


# -- the run's token across machines ------------------------------------------------------
def head_token(run_dir: str | None) -> bytes:
    """The head's token: ``PHALANX_TOKEN``, else a new one written to ``run_dir/token``
    (mode 0600), which the nodes read from the shared folder."""
    given = os.environ.get(TOKEN_ENV)
    if given:
        return given.encode()
    if not run_dir:
        raise NoTokenError(
            "a run over several nodes needs a token every node holds: set PHALANX_TOKEN to the "
            "same secret on every node, or give fit a run_dir on a folder every node shares "
            "(the head writes the token there, readable by its owner only)"
        )
    token = secrets.token_hex(32)
    path = os.path.join(run_dir, TOKEN_FILE)
    # A new file, made 0600 (O_EXCL: an old token.tmp, say a crashed head's with a wider
    # mode, or a link planted there, is never written through and never keeps its mode).
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path + ".tmp")
    fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(token)
    os.replace(path + ".tmp", path)
    return token.encode()


def node_token(run_dir: str | None, wait: float, poll: timedelta = DEFAULT.join_poll) -> bytes:
    """A node's token: ``PHALANX_TOKEN``, else the head's ``run_dir/token`` (waited for up
    to ``wait`` seconds, looked for every ``poll``: the head may start later); refused when
    others can read it."""
    given = os.environ.get(TOKEN_ENV)
    if given:
        return given.encode()
    if not run_dir:
        raise NoTokenError(
            "this node has no token for the run: set PHALANX_TOKEN (the same on every node), "
            "or give fit the run_dir the head writes its token to (a shared folder)"
        )
    path = os.path.join(run_dir, TOKEN_FILE)
    deadline = time.monotonic() + wait
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise NoTokenError(f"no token at {path} within {wait:g}s: is the head started?")
        time.sleep(poll.total_seconds())
    if os.stat(path).st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise NoTokenError(f"{path} is readable by others: chmod 600 it (it is the run's key)")
    with open(path) as fh:
        return fh.read().strip().encode()


# -- what must agree across nodes ----------------------------------------------------------
def agreement(config: FitConfig, plan: Plan, precision: str) -> dict[str, Any]:
    """What every node's ``fit`` must have the same of (the devices may differ)."""
    return {
        "torch": torch.__version__,
        "phalanx": __version__,
        "plan": plan.record(),
        "epochs": config.epochs,
        "max_steps": config.max_steps,
        "precision": precision,
        "recovery": repr(config.recovery),
        "hang_timeout": config.hang_timeout.total_seconds(),
        "node_timeout": config.node_timeout.total_seconds(),
        "checkpoint": repr(config.checkpoint),
        "resume": config.resume,
        "snapshots": repr(config.snapshots),
        "balance": config.balance,
        "slow_worker": config.slow_worker,
        "on_bad_sample": config.on_bad_sample,
        "max_bad_samples": config.max_bad_samples,
    }


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


def tell(link: Link, message: Message) -> None:
    """Send ``message`` over ``link`` (as :func:`~.messages.encode` writes it)."""
    link.send_frame(encode(message))


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

    def gather(
        self, check: dict[str, Any], plan: Plan, own: list[str], deadline: timedelta
    ) -> Layout:
        """Wait for every other node's hello; refuse one that disagrees (the head fails
        too: PX144). Returns the slots in node order (each node's first slot set)."""
        self.check, self.plan = check, plan
        end = time.monotonic() + deadline.total_seconds()
        while missing(self.nnodes, self.nodes):
            self._rejected()
            left = end - time.monotonic()
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
            self._hello(link, hello)
        slots = layout(own, {rank: node.devices for rank, node in self.nodes.items()})
        for rank, first in slots.first.items():
            self.nodes[rank].first = first
        return slots

    def _hello(
        self, link: Link, frame: Frame, admits: Callable[[int], bool] | None = None
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
        views = {rank: node.view() for rank, node in self.nodes.items()}
        decision = admit(hello, problems, views, self.nnodes, admits)
        node = RemoteNode(hello.rank, hello.host, list(hello.devices), link)
        if isinstance(decision, Refuse):
            with contextlib.suppress(LinkError):
                tell(link, Refused(NodesDisagreeError.code, decision.message))
            link.close()
            if hello.spare:
                note = f"refused a spare on {hello.host}: {decision.message}"
                self.notes.append(("warning", note))
                return None
            if admits is None:
                raise NodesDisagreeError(f"node {hello.rank} ({hello.host}): {decision.message}")
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
        tell(node.link, Welcome(node.rank, labels, node.first, store, self.prefix, self.run_id))
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
            if self._listen(spare, now, []) is not None:
                self.spares.remove(spare)
                self.notes.append(("warning", f"the spare on {spare.host} is gone: dropped"))
        for node in self.nodes.values():
            if node.lost:
                continue  # (its link is closed)
            why = self._listen(node, now, frames)
            if why is not None:
                lost.append((node, why))
        self._rejected()
        return frames, lost

    def _listen(
        self, node: RemoteNode, now: float, frames: list[tuple[RemoteNode, Frame]]
    ) -> str | None:
        """``node``'s frames (added to ``frames``) and why it is lost now (None: it is not),
        as :func:`~.nodeplan.hear` decides: a node lost for its silence is told so
        (``fenced``); a live one gets its keep-alive."""
        closed = None
        for item in node.link.drain():
            if isinstance(item, LinkError):
                closed = str(item)
                break
            frames.append((node, item))
        verdict = hear(node.view(), now, self.timing, closed)
        if isinstance(verdict, Beat):
            node.send(KeepAlive())
        if isinstance(verdict, (Beat, Keep)):
            return None
        if verdict.silent is not None:  # (a frozen node reads this when it wakes: it is out)
            with contextlib.suppress(LinkError, OSError):
                tell(node.link, Fenced(verdict.silent, verdict.limit))
        node.lost = True
        node.link.close()
        node.alive.clear()
        return verdict.why

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


def start_head(run: RunInputs, launch: Launch, emit: Any, timing: Timing) -> Nodes:
    """Listen on ``PHALANX_HEAD``'s address, host the store there, and wait for every node
    to join and agree; every node is then told the slots and where the store is."""

    config = run.config
    check_interface(launch, config)
    token = head_token(config.run_dir)
    run_id = new_run_id()  # this run's signing key is made from the token and it
    host, port = link_address(launch)
    listener = Listener.open(host, port, token, timing)
    try:
        agent = head_agent(launch, host, token, run_id, os.environ, timing)
        hub = NodeHub(listener, launch.nnodes, timing)
        emit(waiting_notice(launch.nnodes, f"{host}:{listener.port}", agent))
        if is_loopback(host):
            emit(Notice(f"head: {host} is loopback: only nodes on this machine reach it"))
        precision = str(getattr(run.spec, "precision", "32"))
        check = agreement(config, run.plan, precision)
        slots = hub.gather(check, run.plan, list(config.devices), timing.join)
    except BaseException:
        listener.close()
        raise
    assert agent.store_at is not None
    labels = list(slots.labels)
    hub.welcome(labels, agent.store_at, run_id, agent.prefix)
    for address, why in hub.rejected:
        emit(rejected_link(address, why))
    hub.rejected.clear()
    return Nodes(hub, agent, labels, list(slots.shown), slots.slot_nodes)


def waiting_notice(nnodes: int, address: str, agent: Agent) -> Notice:
    assert agent.store_at is not None
    store = f"{agent.store_at[0]}:{agent.store_at[1]}" + (" (torchrun's)" if agent.client else "")
    return Notice(f"head: waiting for {nnodes - 1} node(s) at {address} (store at {store})")


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


# -- a node's side ------------------------------------------------------------------------
def connect_to_head(
    launch: Launch, token: bytes, hello: Hello, timing: Timing
) -> tuple[Link, Message]:
    """Connect to the head, retrying while it is not up yet (for ``timing.join``); the
    link and the head's answer."""
    address = link_address(launch)
    deadline = timing.join
    end = time.monotonic() + deadline.total_seconds()
    frame = encode(hello)
    while True:
        try:
            connect = timing.connect.total_seconds()
            link, answer = Link.connect(address, token, frame, connect, timing.handshake)
            break
        except (OSError, LinkError) as exc:
            if time.monotonic() > end:
                raise NodesDisagreeError(
                    f"could not join the head at {launch.head} within "
                    f"{deadline.total_seconds():g}s: {exc}"
                ) from None
            time.sleep(timing.connect_retry.total_seconds())
    try:
        return link, decode(answer)
    except BadMessage:
        link.close()
        raise


def run_node(run: RunInputs, launch: Launch, emit: Any, interrupter: Interrupter) -> RunEnd:
    """A node's agent for one run: join the head, start and watch this node's workers as it
    orders, and return the run's end as the head tells it (the model with it)."""
    started = time.time()
    config = run.config
    timing = Timing.of(config)  # (this node's every duration: the same config as the head's)
    check_interface(launch, config)
    start_fork_server()  # (before joining: a worker's start never holds up the node's loop)
    token = node_token(config.run_dir, timing.join.total_seconds(), timing.join_poll)
    link, answer = _join(run, launch, token, emit, timing)
    if isinstance(answer, End):  # a spare that never had to take a place
        link.close()
        return _node_end(run, answer, time.time() - started)
    launch = dataclasses.replace(launch, node_rank=answer.node)
    labels, first = list(answer.devices), answer.first
    signer = Signer.for_run(token, answer.run)
    agent = Agent(
        bind=None, store_at=answer.store, signer=signer, prefix=answer.prefix, timing=timing
    )
    data = (run.train, run.valid, run.valid_size)
    global_config = _with_devices(config, labels)
    local = len(config.devices)
    spawner = Spawner(run.spec, global_config, run.plan, data, agent, local, first)
    if config.snapshots is not None and agent.snapshot_folder() is None:
        emit(snapshots_off(agent.snapshot_error))
    link.start()
    last = first + len(config.devices) - 1
    emit(Notice(f"node {launch.node_rank}: joined; workers {first}..{last}"))
    saved: list[Saved] = []
    try:
        end = _serve(link, agent, LocalAgent(agent, spawner), interrupter)
        if end is None:  # the head is lost: keep what was committed
            saved = save_on_head_loss(agent)
    finally:
        agent.close()
        link.close()
    if end is None:
        raise _head_lost(launch, config, first, saved, emit)
    if isinstance(end, Fenced):
        raise NodeFencedError(fenced_message(launch.node_rank, end))
    return _node_end(run, end, time.time() - started)


def _join(
    run: RunInputs, launch: Launch, token: bytes, emit: Any, timing: Timing
) -> tuple[Link, Welcome | End]:
    """Register with the head (who this node is, what must agree); its answer, or raise
    NodesDisagreeError when it refused this node."""
    precision = str(getattr(run.spec, "precision", "32"))
    hello = Hello(
        rank=launch.node_rank,
        host=socket.gethostname(),
        devices=tuple(run.config.devices),
        spare=launch.spare,
        check=agreement(run.config, run.plan, precision),
    )
    who = "spare" if launch.spare else f"node {launch.node_rank}"
    emit(Notice(f"{who}: joining the head at {launch.head}"))
    link, answer = connect_to_head(launch, token, hello, timing)
    if isinstance(answer, Refused):
        link.close()
        raise NodesDisagreeError(answer.message)
    if isinstance(answer, Parked):
        emit(Notice("spare: waiting at the head to take the place of a node that is lost"))
        placed = _parked(link, timing)
        if placed is None:
            link.close()
            raise _head_lost(launch, run.config, SPARE, [], emit)
        if isinstance(placed, Welcome):
            emit(Notice(f"spare: takes node {placed.node}'s place"))
        answer = placed
    if not isinstance(answer, (Welcome, End)):
        link.close()
        raise BadMessage(encode(answer).kind, "kind", "not an answer to a hello")
    return link, answer


def _parked(link: Link, timing: Timing) -> Welcome | End | None:
    """A spare, until the head places it (``welcome``) or the run ends (``end``); None when
    the head is lost (the link closed, or no word for ``timing.node``)."""
    limit, beat = timing.node.total_seconds(), timing.beat_every.total_seconds()
    tick = timing.link_poll.total_seconds()
    link.start()
    last_sent = time.monotonic()
    while True:
        item = link.next(tick)  # (one at a time: the orders after a welcome are the node's)
        if isinstance(item, LinkError):
            return None
        message = None if item is None else decode(item)
        if isinstance(message, (Welcome, End)):
            return message
        if time.monotonic() - link.last_heard > limit:
            return None
        if time.monotonic() - last_sent > beat:
            with contextlib.suppress(LinkError):
                tell(link, KeepAlive())
            last_sent = time.monotonic()


def fenced_message(node: int, fenced: Fenced) -> str:
    silent, limit = fenced.silent, fenced.limit
    return (
        f"node {node} was cut off from the run: the head heard nothing from it for "
        f"{silent:.1f}s (node_timeout {limit:g}s) and went on without it, so its workers "
        "were stopped and nothing they computed since was committed. Start this node again "
        "to rejoin the run (the head takes it back at a step boundary), or leave it out."
    )


def _head_lost(
    launch: Launch, config: FitConfig, first: int, saved: list[Saved], emit: Any
) -> HeadLost:
    """The node's end when the head was lost: told to its sinks, raised as HeadLost."""
    error = HeadLostError(head_lost_message(launch, config, first, saved))
    emit(Notice(str(error), level="error"))
    kept = [s for s in saved if s.path]
    if not kept:
        return HeadLost(error, None, None)
    best = max(kept, key=lambda s: s.step)
    return HeadLost(error, best.step, best.path)


def _node_end(run: RunInputs, end: End, seconds: float) -> RunEnd:
    """The run's end as the head told it: the same model and record as on the head, or
    raise the same report."""
    failures, fates = list(end.failures), list(end.fates)
    if not end.ok:
        raise stopped(failures, end.poison, _no_dir(run.config), end.notes, fates)
    return RunEnd(
        model=_load_model(run, end.weights),
        history=list(end.history),
        steps=end.steps,
        epochs=end.epochs,
        interrupted=end.interrupted,
        ledger=[list(row) for row in end.ledger],
        failures=failures,
        seconds=seconds,
        fates=fates,
        model_path=_shared(run.config.run_dir, end.model_path),
        quarantine=dict(end.quarantine),
    )


def _shared(run_dir: str | None, path: object) -> str | None:
    """The head's final weights file, where this node sees it: its own run_dir is the
    same folder (a shared file system) and the file is there."""
    if not run_dir or not isinstance(path, str):
        return None
    mine = os.path.join(os.path.abspath(run_dir), os.path.basename(path))
    same = os.path.exists(mine) and os.path.exists(path) and os.path.samefile(mine, path)
    return mine if same else None


def _serve(
    link: Link, agent: Agent, local: LocalAgent, interrupter: Interrupter
) -> End | Fenced | None:
    """Until the head says the run ended (its ``end`` frame) or went on without this node
    (``fenced``), or is lost: no word for the agent's ``timing.node``, or the link closed
    (None). Its orders are carried out by ``local`` (this node's agent)."""
    timing = agent.timing
    limit, beat = timing.node.total_seconds(), timing.beat_every.total_seconds()
    stop_sent = False
    last_sent = time.monotonic()
    try:
        while True:
            if _forward(agent, link):
                last_sent = time.monotonic()
            for item in link.drain():
                if isinstance(item, LinkError):
                    return _last_word(link, timing)
                message = decode(item)
                if isinstance(message, (End, Fenced)):
                    return message
                _order(message, link, local)
            if time.monotonic() - link.last_heard > limit:
                return _last_word(link, timing)
            if not stop_sent and interrupter.should_stop():
                stop_sent = True
                tell(link, StopAsked(interrupter.reason or "stop requested"))
            if time.monotonic() - last_sent > beat:
                tell(link, KeepAlive())
                last_sent = time.monotonic()
    except LinkError:
        return _last_word(link, timing)


def _forward(agent: Agent, link: Link) -> bool:
    """What this node's workers said (and their exits) to the head; whether anything went."""
    sent = False
    for seen in agent.poll(agent.timing.poll):
        if isinstance(seen.message, Done) and seen.message.weights_path:
            with open(seen.message.weights_path, "rb") as fh:
                tell(link, FinalWeights(seen.slot, fh.read()))
        tell(link, seen)
        sent = True
    return sent


def _last_word(link: Link, timing: Timing) -> End | Fenced | None:
    """The head's last frame that says how this node's part ended, if it came before the
    link was lost (within ``timing.last_word``): ``end`` (the run ended: a send raced the
    head's close) or ``fenced`` (a node that was frozen reads it on waking; its reader may
    need a moment), else None."""
    deadline = time.monotonic() + timing.last_word.total_seconds()
    while time.monotonic() < deadline:
        for item in link.drain():
            if isinstance(item, LinkError):
                continue
            with contextlib.suppress(BadMessage):  # (the head is lost all the same)
                message = decode(item)
                if isinstance(message, (End, Fenced)):
                    return message
        time.sleep(timing.link_poll.total_seconds())
    return None


def _order(message: Message, link: Link, local: LocalAgent) -> None:
    """The head's order, carried out by this node's agent; its answer sent back."""
    answer: Message | None = None
    if isinstance(message, SpawnOrder):
        answer = local.spawn(message)
    elif isinstance(message, KillOrder):
        local.kill(message.slot)
    elif isinstance(message, DumpOrder):
        answer = local.stacks(message.slots)
    if answer is not None:
        tell(link, answer)


def _with_devices(config: FitConfig, labels: list[str]) -> FitConfig:
    import dataclasses

    return dataclasses.replace(config, devices=labels)


def _no_dir(config: FitConfig) -> FitConfig:
    """A node writes nothing in run_dir: the head's sinks and reports do."""
    import dataclasses

    return dataclasses.replace(config, run_dir=None)


def _load_model(run: RunInputs, payload: bytes) -> torch.nn.Module:
    import io

    with acting_as(0, len(run.config.devices)):  # (as the main member sees it)
        model = run.spec.build_model()
    state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    model.load_state_dict(state)
    return model
