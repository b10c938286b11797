"""The head's rules about the other nodes, pure: no link, thread, clock or log.

What a node said (its hello, :class:`Hello`) and what the head knows of each node
(:class:`NodeView`: its rank, devices, first slot, whether it is lost or a spare, when it
was last heard from and sent to) go in with the time (a monotonic reading, an argument);
a decision comes out: a hello is admitted (:class:`Admit`), parked as a spare
(:class:`Park`) or refused with why (:class:`Refuse`, PX144) by :func:`admit`, at start-up
and during the run alike; :func:`place_spares` puts parked spares in lost nodes' ranks
(:class:`Place`); :func:`hear` says whether a node is lost (:class:`Lost`: its link closed,
or silent for ``node_timeout``), owed a keep-alive (:class:`Beat`) or fine (:class:`Keep`);
:func:`missing` and :func:`layout` are the start-up's wait and the slots' numbering in node
order. :class:`~..nodes.hub.NodeHub` reads these and only does what they say (send, close,
start, time), as the supervisor does with :mod:`.coordinator`'s actions.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from phalanx.plan import Plan, plan_difference
from phalanx.strategies.ddp.timing import Timing
from phalanx.strategies.ddp.wire.messages import Heir, Hello


# -- what goes in -------------------------------------------------------------------------
@dataclass(frozen=True)
class NodeView:
    """What the head knows of one node (or parked spare) when it decides."""

    rank: int
    devices: tuple[str, ...]
    first: int = 0  # its first slot
    lost: bool = False
    spare: bool = False  # a spare (parked, or in a lost node's rank)
    heard: float = 0.0  # when its last frame came (monotonic seconds)
    sent: float = 0.0  # when the head last sent it a frame


# -- what comes out -----------------------------------------------------------------------
@dataclass(frozen=True)
class Admit:
    """Take the node in node rank ``rank``; ``first``: its first slot when it takes a lost
    node's rank back (at start-up the slots are laid out once all joined, see
    :func:`layout`)."""

    rank: int
    first: int = 0


@dataclass(frozen=True)
class Park:
    """Keep the spare (its link beating) until a node is lost."""


@dataclass(frozen=True)
class Refuse:
    """Refuse the node (PX144), with why."""

    problems: tuple[str, ...]

    @property
    def message(self) -> str:
        return "nodes disagree: " + "; ".join(self.problems)


@dataclass(frozen=True)
class Place:
    """The parked spare ``spare`` (its index among the spares) takes node ``rank``'s place,
    with its slots from ``first``."""

    spare: int
    rank: int
    first: int


@dataclass(frozen=True)
class Keep:
    """Nothing to do: heard from within ``node_timeout`` and sent to lately (or lost
    already: a node is lost once)."""


@dataclass(frozen=True)
class Beat:
    """Heard from, but nothing sent to it for ``beat_every``: a keep-alive is due."""


@dataclass(frozen=True)
class Lost:
    """The node is lost, with why; ``silent`` (and ``limit``): it was silent that long,
    and is told so (``fenced``, which a frozen node reads when it wakes); None: its link
    closed."""

    why: str
    silent: float | None = None
    limit: float = 0.0


Decision = Admit | Park | Refuse


# -- the rules ----------------------------------------------------------------------------
def admit(
    hello: Hello,
    problems: Sequence[str],
    nodes: Mapping[int, NodeView],
    nnodes: int,
    takes_back: Callable[[int], bool] | None = None,
) -> Decision:
    """What the head does with a hello. ``problems``: how the node's agreement differs
    from the head's (:func:`disagreements`); ``nodes``: the other nodes the head holds, by
    rank; ``takes_back``: during the run, whether the coordinator lets a lost node's rank
    back in now (None: at start-up).

    A spare is parked when it agrees. At start-up a node takes a free node rank
    (``0 < rank < nnodes``, none holds it yet). During the run a node takes back only the
    rank of a lost node that the coordinator takes back, with the same devices (its
    slots). Anything else is refused, every problem named."""
    found = list(problems)
    if hello.spare:
        return Refuse(tuple(found)) if found else Park()
    rank, first = hello.rank, 0
    if takes_back is None:
        if not 0 < rank < nnodes or rank in nodes:
            found.append(f"node rank {rank} is not a free node rank of {nnodes}")
    else:
        old = nodes.get(rank)
        if old is None or not old.lost or not takes_back(rank):
            found.append(f"node rank {rank} is not a lost node this run takes back")
        elif hello.devices != old.devices:
            found.append(f"devices {list(hello.devices)}: node {rank} had {list(old.devices)}")
        else:
            first = old.first
    return Refuse(tuple(found)) if found else Admit(rank, first)


def place_spares(
    spares: Sequence[NodeView], nodes: Mapping[int, NodeView], takes_back: Callable[[int], bool]
) -> list[Place]:
    """Each parked spare (in the order they came) takes the place of a lost node with the
    same devices that the run takes back, the lowest node rank first, as that node would
    rejoin; a rank is taken once, and a spare with no such node waits."""
    placed: list[Place] = []
    taken: set[int] = set()
    for index, spare in enumerate(spares):
        if spare.lost:
            continue
        for rank in sorted(nodes):
            old = nodes[rank]
            fits = old.lost and rank not in taken and old.devices == spare.devices
            if fits and takes_back(rank):
                placed.append(Place(index, rank, old.first))
                taken.add(rank)
                break
    return placed


def hear(
    node: NodeView, now: float, timing: Timing, closed: str | None = None
) -> Keep | Beat | Lost:
    """A node (or parked spare) at ``now``: lost when its link closed (``closed``: how) or
    it was silent for longer than ``timing.node``; else owed a keep-alive when the head
    sent it nothing for ``timing.beat_every``. A node already lost is not lost again."""
    if node.lost:
        return Keep()
    if closed is not None:
        return Lost(f"its link closed ({closed})")
    silent, limit = now - node.heard, timing.node.total_seconds()
    if silent > limit:
        return Lost(f"no word for {silent:.1f}s (node_timeout {limit:g}s)", silent, limit)
    if now - node.sent > timing.beat_every.total_seconds():
        return Beat()
    return Keep()


def missing(
    nnodes: int, joined: Sequence[int] | Mapping[int, Any], expected: Sequence[int] | None = None
) -> list[int]:
    """The node ranks that have not joined yet (start-up waits until none): of
    ``expected`` (a successor's survivors) when given, else of every node but the head."""
    awaited = set(range(1, nnodes)) if expected is None else set(expected)
    return sorted(awaited - set(joined))


@dataclass(frozen=True)
class Layout:
    """The run's slots in node order: node 0's (the head's) first, then each node's."""

    labels: tuple[str, ...]  # every slot's device
    shown: tuple[str, ...]  # the same, with the node of each remote one (for reports)
    slot_nodes: tuple[int, ...]  # every slot's node rank
    first: Mapping[int, int]  # each other node's first slot


def layout(own: Sequence[str], nodes: Mapping[int, Sequence[str]]) -> Layout:
    """The slots of the head (``own``: its devices) and of ``nodes`` (each one's devices,
    by node rank), numbered in node order."""
    labels, shown, slot_nodes = list(own), list(own), [0] * len(own)
    first: dict[int, int] = {}
    for rank in sorted(nodes):
        first[rank] = len(labels)
        labels += nodes[rank]
        shown += [f"{d}@node{rank}" for d in nodes[rank]]
        slot_nodes += [rank] * len(nodes[rank])
    return Layout(tuple(labels), tuple(shown), tuple(slot_nodes), first)


# -- the head's loss ------------------------------------------------------------------------
@dataclass(frozen=True)
class TakeOver:
    """This node leads the run from here: it waits for ``expected`` (the other survivors'
    node ranks) to reach it, and goes on with those that came."""

    expected: tuple[int, ...]


@dataclass(frozen=True)
class Follow:
    """This node joins ``heir``, the run's new head."""

    heir: Heir


@dataclass(frozen=True)
class Stop:
    """No failover: this node keeps what was committed and stops (today's emergency
    checkpoint), with why."""

    why: str


def majority(present: int, total: int) -> bool:
    """Whether ``present`` nodes (the one that leads included) may go on without the head:
    more than half of the ``total`` in the head's last succession (the head keeps a tie)."""
    return 2 * present > total


def outnumbered(succession: Sequence[Heir], live: Collection[int]) -> bool:
    """Whether the head, hearing the nodes ``live`` (node ranks, itself included), must
    stand down, where the nodes it lost may hold ``succession`` (the head first) as its last
    word: they may take over (:func:`successor`) only when the leader it names (its lowest
    node rank with a node port) is among them and those of them with a node port are more
    than half of it; then the head stands down first, so that of the two sides of a
    partition at most one goes on (a tie stays with the head)."""
    heirs = [h for h in succession[1:] if h.port > 0]
    if not heirs or heirs[0].rank in live:
        return False
    return majority(sum(1 for h in heirs if h.rank not in live), len(succession))


def successor(
    succession: Sequence[Heir], me: int, lost: Sequence[int] = (), cannot: str | None = None
) -> TakeOver | Follow | Stop:
    """What node ``me`` does when the head (and the nodes in ``lost``) are gone, from the
    head's last succession (every live node then, the head first). The lowest live node
    rank that listens for nodes leads; the others follow it. It leads only a strict majority
    of the succession (itself and those expected to reach it): of two halves of a
    partition at most one goes on, and the head keeps a tie (a node alone of two stops).
    ``cannot``: why no node of this run may lead (no run_dir shared with the head to resume
    from and fence in, a recovery policy without failover), or None."""
    if cannot is not None:
        return Stop(cannot)
    gone = set(lost) | ({succession[0].rank} if succession else set())
    live = [h for h in succession if h.rank not in gone and h.port > 0]  # (those that can go on)
    if not live:
        return Stop("no surviving node listens for nodes")
    if me not in {h.rank for h in live}:
        return Stop("this node is not in the run's succession (it joined after the last word)")
    if not majority(len(live), len(succession)):
        return Stop(
            f"{len(live)} of the run's {len(succession)} nodes are left, not more than half: "
            "the head may be alive on the other side of a partition, and at most one side "
            "may go on"
        )
    leader = live[0]
    if leader.rank == me:
        return TakeOver(tuple(h.rank for h in live if h.rank != me))
    return Follow(leader)


def fenced(mine: int, current: int | None) -> bool:
    """Whether a head of fencing term ``mine`` was replaced: a newer term is in run_dir's
    ``head.json`` (None: no term there, or none readable; 0: the head keeps no term)."""
    return mine > 0 and current is not None and current > mine


# -- what must agree across nodes ----------------------------------------------------------
def disagreements(head: Mapping[str, Any], node: Mapping[str, Any], plan: Plan) -> list[str]:
    """What a node's agreement (:func:`~..nodes.shared.agreement`) has otherwise than the head's,
    each in a short line: a setting's two values, the plan's fields that differ, which
    samples of the data differ and how (never a whole record)."""
    found = []
    for key, mine in head.items():
        theirs = node.get(key)
        if key == "plan":
            if not plan.matches(theirs):
                found.append(_plan_disagreement(theirs, plan))
        elif theirs != mine:
            ours, yours = _apart(_text(mine), _text(theirs))
            found.append(f"{key}: the head has {ours}, this node {yours}")
    return found


def _apart(mine: str, theirs: str, limit: int = 120) -> tuple[str, str]:
    """Two long values cut alike where they start to differ (a setting's repr: from the
    field that differs), so that what is shown of the two is never the same text."""
    if len(mine) <= limit and len(theirs) <= limit:
        return mine, theirs
    same = 0
    while same < min(len(mine), len(theirs)) and mine[same] == theirs[same]:
        same += 1
    start = max(mine.rfind(", ", 0, same) + 2, mine.rfind("(", 0, same) + 1, 0)
    if same - start > limit // 2:  # (a long field: keep some of it before the difference)
        start = same - limit // 4
    lead = "..." if start else ""
    return lead + _cut(mine[start:], limit), lead + _cut(theirs[start:], limit)


def _plan_disagreement(theirs: Any, plan: Plan) -> str:
    if not isinstance(theirs, dict):
        return f"plan: this node sent none this version reads ({_short(theirs)})"
    fields, data = plan_difference(theirs, plan)
    fields = [f.replace(" -> ", " on this node, ") + " on the head" for f in fields]
    parts = [f"plan: {', '.join(fields)}"] if fields else []
    if data is not None:
        parts.append(f"training data: {data}")
    return "; ".join(parts)


def _text(value: Any) -> str:
    """A setting as shown: a repr, but a string that already is one (a setting's repr in
    the agreement) as it is."""
    return value if isinstance(value, str) and value.endswith(")") else repr(value)


def _short(value: Any, limit: int = 120) -> str:
    return _cut(repr(value), limit)


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
