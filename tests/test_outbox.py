"""A ddp worker's messages to the supervisor (:class:`Outbox`): every message is in the pipe,
in order, when ``send`` returns; the supervisor's bell rings at once for a message it acts
on, and only every RING_COUNT events or ``Timing.ring_after`` for a committed step's event,
so the supervisor does not wake up for every step. The agent reads every pipe whenever it
wakes, so a step event that did not ring arrives at its next wake-up anyway."""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from datetime import timedelta
from typing import Any

import pytest

from ddp_helpers import say_steps_then_exit
from phalanx.events import Notice, StepEnded
from phalanx.strategies.ddp.agent.agent import Agent, SlotState
from phalanx.strategies.ddp.wire import protocol
from phalanx.strategies.ddp.wire.protocol import Outbox, Ready, Relay

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX pipes")


def step(n: int) -> Relay:
    return Relay(StepEnded(0, n - 1, n, 100, 0.5, 0.1, 4, 1.0))


def channel() -> tuple[Outbox, Any, Any]:
    """An Outbox and the read ends of its pipe and its bell."""
    reader, writer = multiprocessing.Pipe(duplex=False)
    bell, ring = multiprocessing.Pipe(duplex=False)
    os.set_blocking(bell.fileno(), False)
    return Outbox(writer, ring), reader, bell


def rings(bell: Any) -> bytes:
    try:
        return os.read(bell.fileno(), 4096)
    except BlockingIOError:
        return b""


def received(reader: Any) -> list[object]:
    got = []
    while reader.poll():
        got.append(protocol.received(reader.recv()))
    return got


def test_a_steps_event_arrives_as_it_was_sent() -> None:
    """It crosses the pipe as the tuple of its fields, not pickled as a dataclass."""
    outbox, reader, _ = channel()
    event = StepEnded(2, 6, 207, 30, 0.25, 1e-3, 64, 812.5, {"loss": 0.25, "acc": 0.5}, True)
    outbox.send(Relay(event))
    assert isinstance(reader.recv(), tuple)
    outbox.send(Relay(event))
    assert received(reader) == [Relay(event)]


def test_every_message_is_in_the_pipe_in_order_and_only_step_events_wait() -> None:
    outbox, reader, bell = channel()
    outbox.send(Ready(0))
    assert rings(bell) == protocol.URGENT
    sent = [step(n) for n in range(1, 6)]
    for message in sent:  # (well within ring_after of the Ready's ring)
        outbox.send(message)
    assert rings(bell) == b""
    hello = Relay(Notice("hello"))
    outbox.send(hello)  # any other event rings at once
    assert rings(bell) == protocol.URGENT
    assert received(reader) == [Ready(0), *sent, hello]


def test_step_events_ring_every_so_many_and_after_a_while() -> None:
    outbox, reader, bell = channel()
    outbox.send(step(1))  # the first one rings: nothing rang for long
    assert rings(bell) == protocol.LATER
    for n in range(2, 2 + protocol.RING_COUNT):  # (at once: well within ring_after)
        outbox.send(step(n))
    assert rings(bell) == protocol.LATER  # the RING_COUNT-th unrung one
    outbox.send(step(100))
    assert rings(bell) == b""
    outbox.rung_at -= outbox.ring_after  # as if that long had passed since the last ring
    outbox.send(step(101))
    assert rings(bell) == protocol.LATER
    assert len(received(reader)) == protocol.RING_COUNT + 3


@pytest.mark.timeout(60)
def test_the_agent_reads_unrung_events_and_closes_a_bell_at_eof() -> None:
    """Through a spawned process: the Outbox crosses spawn with its pipes; what the process
    said arrives in order, the step events that did not ring too; once it has exited, its
    bell (at EOF) is closed, no longer something to wake on."""
    agent = Agent()
    try:
        agent.spawn(0, "outbox-test", say_steps_then_exit, lambda outbox, *_: (outbox, 5))
        seen: list[Any] = []
        deadline = time.monotonic() + 30
        while not any(s.exited for s in seen):
            assert time.monotonic() < deadline, seen
            seen += agent.poll(timedelta(seconds=0.2))
        said = [s.message for s in seen if not s.exited]
        assert said[0] == Ready(0)
        assert [m.event.global_step for m in said[1:]] == [1, 2, 3, 4, 5]
        assert [s.code for s in seen if s.exited] == [0]
        agent.poll(timedelta(0))
        state = agent.slots[0]
        assert state.bell is not None and state.bell.closed and state.waker() is None
    finally:
        agent.close()


class Quiet:
    """A process that neither ends nor writes (its sentinel: a pipe nobody writes to)."""

    def __init__(self) -> None:
        self.sentinel_end, self.keep = multiprocessing.Pipe(duplex=False)
        self.sentinel = self.sentinel_end.fileno()
        self.exitcode = None
        self.pid = None  # (what the agent tells of it: unknown)


def test_step_events_waiting_in_one_pipe_are_handled_before_a_peers_urgent_message() -> None:
    """Slot 1, the main member, committed steps whose events did not ring; slot 0 then says
    something that follows them (a failure in the next step's vote): the agent hands out
    slot 1's step events first, though it reads slots in order otherwise."""
    agent = Agent(bind=None)
    boxes = []
    for slot in (0, 1):
        outbox, reader, bell = channel()
        os.set_blocking(bell.fileno(), True)  # (as the agent's own read end is)
        agent.slots[slot] = SlotState(Quiet(), reader, bell=bell)
        boxes.append(outbox)
    for n in (1, 2, 3):
        boxes[1].send(step(n))  # (the first rings, "later"; the others do not)
    assert [s.message.event.global_step for s in agent.poll(timedelta(seconds=5))] == [1, 2, 3]
    boxes[1].send(step(4))
    boxes[0].send(Ready(0))
    seen = [s.message for s in agent.poll(timedelta(seconds=5))]
    assert seen[0] == step(4) or seen[0].event.global_step == 4
    assert seen[1:] == [Ready(0)]
