"""A node's side of several machines: :func:`run_node`, the ``fit`` of every node but the
head: the hello, the head's welcome, then an agent that starts, watches, kills and dumps the
stacks of its own workers as the head orders and sends back everything it sees. A node that
loses the head (its link closed, or silent for ``node_timeout``) has its workers save what
the run committed and ends with :class:`~phalanx.errors.HeadLost` (:mod:`.headloss`)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import time
from dataclasses import dataclass
from typing import Any

import torch

from phalanx.errors import (
    HeadLost,
    NodeFencedError,
    NodesDisagreeError,
)
from phalanx.events import Notice
from phalanx.interrupt import Interrupter
from phalanx.launch import SPARE, Launch
from phalanx.ranks import acting_as
from phalanx.run import RunEnd, RunInputs, stopped
from phalanx.runner import checkpoint_dir
from phalanx.snapshot.config import snapshots_off
from phalanx.spec import FitConfig
from phalanx.strategies.ddp.agent.agent import Agent, start_fork_server
from phalanx.strategies.ddp.agent.routing import LocalAgent
from phalanx.strategies.ddp.agent.spawner import Spawner
from phalanx.strategies.ddp.coordinator.nodeplan import Hello, Stop, TakeOver, successor
from phalanx.strategies.ddp.nodes.failover import (
    Failover,
    Standby,
    cannot_fail_over,
    head_loss_failure,
)
from phalanx.strategies.ddp.nodes.fencing import read_term
from phalanx.strategies.ddp.nodes.headloss import (
    head_lost,
    head_lost_message,
    save_on_head_loss,
)
from phalanx.strategies.ddp.nodes.shared import (
    agreement,
    check_interface,
    link_address,
    node_token,
    tell,
)
from phalanx.strategies.ddp.timing import Timing
from phalanx.strategies.ddp.wire.control import Signer
from phalanx.strategies.ddp.wire.link import Link, LinkError
from phalanx.strategies.ddp.wire.messages import (
    BadMessage,
    DumpOrder,
    End,
    Fenced,
    FinalWeights,
    Heir,
    KeepAlive,
    KillOrder,
    Message,
    Parked,
    Refused,
    SpawnOrder,
    StopAsked,
    Welcome,
    decode,
    encode,
)
from phalanx.strategies.ddp.wire.protocol import Done, Saved


# -- a node's side ------------------------------------------------------------------------
@dataclass
class HeadWord:
    """What a node knows of the head from its last words: the run's succession, the
    head's fencing term, and how the head was lost (``why``; ``silent``: by its silence)."""

    succession: tuple[Heir, ...] = ()
    term: int = 0
    why: str = ""
    silent: float | None = None  # lost by its silence: this long (None: its link closed)
    lost_at: float = 0.0  # when this node saw the loss (wall clock)

    def lost(self, why: str, silent: float | None = None) -> None:
        self.why, self.silent, self.lost_at = why, silent, time.time()

    def heard(self, message: Message) -> None:
        if isinstance(message, (KeepAlive, Welcome)) and message.succession:
            self.succession = message.succession


def connect_to_head(
    launch: Launch, token: bytes, hello: Hello, timing: Timing, following: bool = False
) -> tuple[Link, Message]:
    """Connect to the head, retrying while it is not up yet (for ``timing.join``); the
    link and the head's answer. ``following``: the head is a successor, which answers
    once its own workers saved and the others came (``timing.follow``)."""
    address = link_address(launch)
    deadline = timing.follow if following else timing.join
    end = time.monotonic() + deadline.total_seconds()
    frame = encode(hello)
    handshake = timing.follow if following else timing.handshake
    while True:
        try:
            connect = timing.connect.total_seconds()
            link, answer = Link.connect(address, token, frame, connect, handshake)
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
    standby = _standby(run, launch, token, timing)
    port = standby.port if isinstance(standby, Standby) else 0
    try:
        link, answer = _join(run, launch, token, emit, timing, port)
    except BaseException:
        if isinstance(standby, Standby):
            standby.close()
        raise
    if isinstance(answer, End):  # a spare that never had to take a place
        link.close()
        if isinstance(standby, Standby):
            standby.close()
        return _node_end(run, answer, time.time() - started)
    launch = dataclasses.replace(launch, node_rank=answer.node)
    word = HeadWord(term=answer.term)
    word.heard(answer)
    labels, first = list(answer.devices), answer.first
    signer = Signer.for_run(token, answer.run)
    agent = Agent(
        bind=None, store_at=answer.store, signer=signer, prefix=answer.prefix, timing=timing
    )
    data = (run.train, run.valid, run.valid_size)
    global_config = dataclasses.replace(config, devices=labels, head_term=answer.term)
    local = len(config.devices)
    spawner = Spawner(run.spec, global_config, run.plan, data, agent, local, first)
    if config.snapshots is not None and agent.snapshot_folder() is None:
        emit(snapshots_off(agent.snapshot_error))
    link.start()
    last = first + len(config.devices) - 1
    emit(Notice(f"node {launch.node_rank}: joined; workers {first}..{last}"))
    saved: list[Saved] = []
    failover: Failover | None = None
    try:
        end = _serve(link, agent, LocalAgent(agent, spawner), interrupter, word)
        if end is None:  # the head is lost: keep what was committed, then go on or stop
            saved = save_on_head_loss(agent)
            failover = _failover(run, launch, word, saved, standby, emit, token)
    finally:
        agent.close()
        link.close()
        if isinstance(standby, Standby) and (failover is None or not failover.leads):
            standby.close()
    if failover is not None:
        raise failover
    if end is None:
        raise _head_lost(launch, config, first, saved, emit, word.why)
    if isinstance(end, Fenced):
        raise NodeFencedError(fenced_message(launch.node_rank, end))
    return _node_end(run, end, time.time() - started)


def _standby(run: RunInputs, launch: Launch, token: bytes, timing: Timing) -> Standby | str:
    """This node's own node port, from which it would lead the run were the head lost, or
    why it has none (no run_dir to resume from and fence in, a recovery policy without a
    failover, a spare, no route to the head's address yet)."""
    cannot = cannot_fail_over(run.config, launch)
    if cannot is not None:
        return cannot
    if launch.spare:
        return "this node is a spare"
    return Standby.open(link_address(launch), token, timing)


def _failover(
    run: RunInputs,
    launch: Launch,
    word: HeadWord,
    saved: list[Saved],
    standby: Standby | str,
    emit: Any,
    token: bytes,
) -> Failover | None:
    """After the head's loss: whether this node goes on (leads or follows, the run's rule:
    :func:`~..coordinator.nodeplan.successor`; a leader first rallies a majority) or stops
    (None; the reason in ``word.why``)."""
    config, me = run.config, launch.node_rank
    cannot = standby if isinstance(standby, str) else None
    if cannot is None:
        assert config.run_dir is not None
        current = read_term(config.run_dir)
        if word.term == 0 or current is None or current.term != word.term:
            # (the head's term, exactly: a folder of this machine's own could hold an older
            # run's head.json, and a successor claims the next term only after this check)
            cannot = f"{config.run_dir} is not the head's run_dir (no head.json of its term)"
    decision = successor(word.succession, me, (), cannot)
    if isinstance(decision, Stop):
        word.why = f"{word.why}; no failover: {decision.why}"
        return None
    assert isinstance(standby, Standby)
    head = word.succession[0]
    if isinstance(decision, TakeOver):
        timing = Timing.of(config)
        awaited = list(decision.expected)
        emit(
            Notice(
                f"node {me}: the head was lost ({word.why}); this node is to take over: "
                f"waiting up to {timing.takeover.total_seconds():g}s for node(s) {awaited}"
            )
        )
        came = standby.rally(decision.expected, timing.takeover, len(word.succession), me)
        if isinstance(came, str):
            word.why = f"{word.why}; no failover: {came}"
            return None
        decision = TakeOver(came)
        leader, text = me, f"this node takes over as the head, with node(s) {list(came)}"
    else:
        heir = decision.heir
        leader = heir.rank
        text = f"following node {heir.rank}, the new head, at {heir.host}:{heir.port}"
    sharded = config.strategy == "fsdp"
    failure = head_loss_failure(
        head, word.why, word.silent, saved, leader, word.lost_at, sharded=sharded
    )
    failover = Failover(decision, me, word.succession, failure, saved, standby, token)
    emit(Notice(f"node {me}: the head was lost ({word.why}); {text}", level="warning"))
    return failover


def _join(
    run: RunInputs,
    launch: Launch,
    token: bytes,
    emit: Any,
    timing: Timing,
    standby: int = 0,
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
        standby=standby,
    )
    who = "spare" if launch.spare else f"node {launch.node_rank}"
    emit(Notice(f"{who}: joining the head at {launch.head}"))
    following = run.failover is not None
    try:
        link, answer = connect_to_head(launch, token, hello, timing, following)
    except NodesDisagreeError as exc:
        if not following:
            raise
        saved = list(run.failover.saved)
        why = f"and the new head did not take this node in ({exc})"
        raise _head_lost(launch, run.config, -1, saved, emit, why) from None
    if isinstance(answer, Refused):
        link.close()
        if following:  # (a survivor that came late, or disagrees with the new head)
            why = f"and the new head refused this node ({answer.message})"
            raise _head_lost(launch, run.config, -1, list(run.failover.saved), emit, why)
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
    launch: Launch, config: FitConfig, first: int, saved: list[Saved], emit: Any, why: str = ""
) -> HeadLost:
    """The node's end when the head was lost: told to its sinks, raised as HeadLost."""
    return head_lost(head_lost_message(launch, config, first, saved, why), saved, emit)


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
        model_path=shared_path(run.config.run_dir, end.model_path),
        quarantine=dict(end.quarantine),
    )


def shared_path(run_dir: str | None, path: object) -> str | None:
    """The head's final weights file (``model.pt``, or fsdp's last sharded checkpoint under
    ``gather=False``), where this node sees it: its own run_dir is the same folder (a shared
    file system) and the file is there."""
    if not run_dir or not isinstance(path, str):
        return None
    top = os.path.abspath(run_dir)
    for folder in (top, checkpoint_dir(top)):
        mine = os.path.join(folder, os.path.basename(path))
        if os.path.exists(mine) and os.path.exists(path) and os.path.samefile(mine, path):
            return mine
    return None


def _serve(
    link: Link, agent: Agent, local: LocalAgent, interrupter: Interrupter, word: HeadWord
) -> End | Fenced | None:
    """Until the head says the run ended (its ``end`` frame) or went on without this node
    (``fenced``), or is lost: no word for the agent's ``timing.node``, or the link closed
    (None; how, in ``word``). Its orders are carried out by ``local`` (this node's agent);
    its keep-alives' succession is kept in ``word``."""
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
                    word.lost(_closed(item))
                    return _last_word(link, timing)
                message = decode(item)
                if isinstance(message, (End, Fenced)):
                    return message
                word.heard(message)
                _order(message, link, local)
            silent = time.monotonic() - link.last_heard
            if silent > limit:
                word.lost(f"no word for {silent:.1f}s (node_timeout {limit:g}s)", silent)
                return _last_word(link, timing)
            if not stop_sent and interrupter.should_stop():
                stop_sent = True
                tell(link, StopAsked(interrupter.reason or "stop requested"))
            if time.monotonic() - last_sent > beat:
                tell(link, KeepAlive())
                last_sent = time.monotonic()
    except LinkError as exc:
        word.lost(_closed(exc))
        return _last_word(link, timing)


def _closed(error: LinkError) -> str:
    text = str(error)
    return "its link closed" if text == "the link is closed" else f"its link closed ({text})"


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


def _no_dir(config: FitConfig) -> FitConfig:
    """A node writes nothing in run_dir: the head's sinks and reports do."""
    import dataclasses

    return dataclasses.replace(config, run_dir=None)


def _load_model(run: RunInputs, payload: bytes) -> torch.nn.Module | None:
    """The head's final weights (none: fsdp's gather=False, end.model_path has them)."""
    import io

    if not payload:
        return None
    with acting_as(0, len(run.config.devices)):  # (as the main member sees it)
        model = run.spec.build_model()
    state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    model.load_state_dict(state)
    return model
