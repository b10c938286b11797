"""The head lost, and the run goes on without a restart: the node side of the failover.

Every node listens, from its start, on a node port of its own (:class:`Standby`), and the
head's keep-alives carry the run's succession (every live node, the head first, each with
that port). When a node loses the head (:mod:`.headloss`: its workers first keep what the
run committed, as an emergency checkpoint in the shared ``run_dir``), it reads
:func:`~..coordinator.nodeplan.successor`'s rule: the lowest live node rank leads a strict
majority of the succession, the others follow it. ``run_node`` then raises
:class:`Failover`, and the node's ``fit`` goes on (``Learner``). The leader has first
rallied the others on its node port (:meth:`Standby.rally`: a strict majority, or it stops);
it then takes the next fencing term (:mod:`.fencing`), opens the run's sinks in ``run_dir``
again (appending) and runs as the head from the newest checkpoint (``resume``), with the
head's loss as the run's first failure; each follower joins it as a node. Where the rule
says stop (no run_dir, a node alone of two, a policy without failover, no majority), the node
ends as before: ``HeadLost``."""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from phalanx.errors import HeadLost, HeadLostError
from phalanx.failures import WorkerFailure
from phalanx.launch import Address, Launch
from phalanx.spec import FitConfig
from phalanx.strategies.ddp.coordinator.nodeplan import Follow, TakeOver, majority
from phalanx.strategies.ddp.nodes.headloss import head_lost, kept_line
from phalanx.strategies.ddp.nodes.shared import tell
from phalanx.strategies.ddp.timing import Timing
from phalanx.strategies.ddp.wire.link import Frame, Link, LinkError, Listener, address_towards
from phalanx.strategies.ddp.wire.messages import BadMessage, Heir, Hello, Refused, decode
from phalanx.strategies.ddp.wire.protocol import Saved


@dataclass
class Standby:
    """A node's node port, open while it runs: the head's successor listens here."""

    listener: Listener
    host: str

    @classmethod
    def open(cls, head: tuple[str, int], token: bytes, timing: Timing) -> Standby | str:
        """The node port, or why there is none (the head's address does not resolve yet, no
        route to it: this node joins all the same, without a failover)."""
        try:
            host = address_towards(*head)
            return cls(Listener.open(host, 0, token, timing), host)
        except OSError as exc:
            return f"this node could not open a node port towards {head[0]} ({exc})"

    def rally(
        self, expected: Sequence[int], wait: timedelta, total: int, me: int
    ) -> tuple[int, ...] | str:
        """Before it takes the head's place, the node that leads waits ``wait`` for the other
        survivors' hellos (each one lost the head too, or it would not come). It goes on
        only when it and those that came are more than half of ``total`` (the succession):
        a node cut off alone from a live head never fences it. Returns the node ranks that
        came (their hellos are left for the new head to answer) or why it does not go on
        (each that came is refused and closed)."""
        came: dict[int, tuple[Link, Frame]] = {}
        end = time.monotonic() + wait.total_seconds()
        while len(came) < len(expected) and time.monotonic() < end:
            try:
                tick = self.listener.timing.join_poll.total_seconds()
                link, frame = self.listener.joined.get(
                    timeout=max(0.0, min(tick, end - time.monotonic()))
                )
            except queue.Empty:
                continue
            hello = _hello_of(frame)
            if hello is None or hello.rank not in expected or hello.rank in came:
                link.close()  # (not a survivor this node waits for: it retries or gives up)
                continue
            came[hello.rank] = (link, frame)
        if majority(1 + len(came), total):
            for pair in came.values():
                self.listener.joined.put(pair)  # (the new head's gather answers them)
            return tuple(sorted(came))
        why = (
            f"node {me} was to take over, but only {1 + len(came)} of the run's {total} nodes "
            f"reached it ({_came(sorted(came))}) within {wait.total_seconds():g}s: not more "
            "than half, so it does not go on (the head may be alive, and cut off from this node "
            "only)"
        )
        for link, _ in came.values():
            with contextlib.suppress(LinkError, OSError):
                tell(link, Refused(HeadLostError.code, why))
            link.close()
        return why

    @property
    def port(self) -> int:
        return self.listener.port

    def close(self) -> None:
        self.listener.close()


@dataclass
class Failover(Exception):
    """The head was lost and this node goes on (``run_node`` raises it, the node's ``fit``
    catches it): ``decision`` says whether it leads (``TakeOver``, with its ``standby``
    port) or follows. ``failure`` names the head's loss for the run's record; ``saved``
    is what this node's workers kept."""

    decision: TakeOver | Follow
    me: int
    succession: tuple[Heir, ...]
    failure: WorkerFailure
    saved: list[Saved] = field(default_factory=list)
    standby: Standby | None = None
    token: bytes = field(default=b"", repr=False)  # the run's: a new head keeps it

    def __str__(self) -> str:
        return self.failure.message

    @property
    def leads(self) -> bool:
        return isinstance(self.decision, TakeOver)

    def launch(self, launch: Launch) -> Launch:
        """This node's place in the run from here: the new head (node rank 0 at its own
        port; it hosts the store) or a node of it."""
        if isinstance(self.decision, TakeOver):
            assert self.standby is not None
            head = Address(self.standby.host, self.standby.port)
            return dataclasses.replace(launch, source="phalanx", node_rank=0, head=head)
        heir = self.decision.heir
        return dataclasses.replace(launch, source="phalanx", head=Address(heir.host, heir.port))

    def awaited(self) -> tuple[int, ...]:
        """The node ranks a leader waits for (none for a follower)."""
        return self.decision.expected if isinstance(self.decision, TakeOver) else ()

    def release(self) -> None:
        if self.standby is not None:
            with contextlib.suppress(OSError):
                self.standby.close()


def cannot_fail_over(config: FitConfig, launch: Launch) -> str | None:
    """Why no node of this run may take over from a lost head, or None."""
    if launch.source == "torchrun":
        return (
            "under torchrun, torchrun's own restart (--max-restarts) goes on after the head's "
            "loss, and a failover would be undone by it"
        )
    if not config.run_dir:
        return "the head's failover needs a run_dir every node shares, and this run has none"
    if not config.recovery.head_failover:
        return "the recovery policy turns the head's failover off (head_failover=False)"
    if config.recovery.mode == "abort":
        return 'the recovery policy is mode="abort"'
    return None


def head_loss_failure(
    head: Heir,
    why: str,
    silent: float | None,
    saved: list[Saved],
    leader: int,
    at: float,
    sharded: bool = False,
) -> WorkerFailure:
    """The one failure that names the head's loss in the run that goes on (node ``leader``
    took over): its node, host and workers, the last committed step kept; ``at``: when this
    node saw the loss (wall clock), ``silent``: how long the head had been silent then (a
    frozen or cut-off head: its cost counts from its last word), None: its link closed.
    ``sharded``: under fsdp (no survivor holds the whole state)."""
    kept = [s.step for s in saved if s.path]
    known = kept or [s.step for s in saved if s.step > 0]  # (0: nothing had trained)
    step = max(known) if known else None
    workers = list(range(len(head.devices))) or [0]
    shown = "?" if step is None else step + 1
    if kept:
        went_on = "from its last committed step without a restart"
    else:
        why_not = "under fsdp the head's shards went with it" if sharded else "no survivor kept it"
        if any(s.kept_files for s in saved):
            why_not += ", and the survivors first kept there the shard snapshots they held"
        went_on = (
            "from the newest complete checkpoint in run_dir, computing the steps after it "
            f"again (no survivor held the whole state: {why_not})"
        )
    message = (
        f"node {head.rank} ({head.host}), the head, lost with its workers {workers} at step "
        f"{shown}: {why}; node {leader} took over as the head and the run went on {went_on}"
    )
    return WorkerFailure(
        worker=workers[0],
        rank=0,
        device=(head.devices[0] if head.devices else "?") + f"@node{head.rank}",
        kind="crash" if silent is None else "hang",
        message=message,
        phase="sync",
        step=step,
        host=head.host,
        time=at,
        action="shrunk",
        last_progress=None if silent is None else at - silent,
    )


def _hello_of(frame: Frame) -> Hello | None:
    try:
        hello = decode(frame)
    except BadMessage:
        return None
    return hello if isinstance(hello, Hello) else None


def _came(came: list[int]) -> str:
    return f"node(s) {came} came" if came else "no other node came"


def check_quorum(failover: Failover, came: Sequence[int], emit: Any) -> None:
    """The new head, once the survivors it waited for are in: it goes on only while it and
    those that came are more than half of the run's succession; else it stops as a node
    that lost the head without a failover does (raises ``HeadLost``: exit 75, resume=True)."""
    total, present = len(failover.succession), 1 + len(came)
    if majority(present, total):
        return
    why = (
        f"this node was to take over, but only {present} of the run's {total} nodes reached "
        f"it ({_came(list(came))}): not more than half, so it does not go on"
    )
    raise head_lost_after(failover, why, emit)


def head_lost_after(failover: Failover, why: str, emit: Any) -> HeadLost:
    """A node that was to go on after the head's loss stops instead (``why``): it keeps the
    step its workers saved, as a node without a failover does (PX147, exit 75)."""
    message = f"node {failover.me}: the head was lost; {why}{kept_line(failover.saved)}"
    return head_lost(message, failover.saved, emit)
