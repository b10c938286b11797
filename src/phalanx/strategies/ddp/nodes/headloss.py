"""The head lost, on a node's agent: tell the workers to keep what the run committed (each
writes its emergency checkpoint, :mod:`..worker.emergency`), wait for them, and say what was
kept and how to go on."""

from __future__ import annotations

import time
from datetime import timedelta

from phalanx.launch import Launch
from phalanx.spec import FitConfig
from phalanx.strategies.ddp.agent.agent import Agent
from phalanx.strategies.ddp.wire.protocol import ORDER_SAVE, Saved


def save_on_head_loss(agent: Agent) -> list[Saved]:
    """A node's agent: tell each of its workers to save and exit, and wait (at most
    ``save_wait`` of its timing) until they have; what each said it saved."""
    for state in agent.slots.values():
        if state.heartbeat is not None:
            state.heartbeat.tell(ORDER_SAVE)
    saved: list[Saved] = []
    deadline = time.monotonic() + agent.timing.save_wait.total_seconds()
    while True:
        done = agent.all_exited() or time.monotonic() > deadline
        seen = agent.poll(timedelta() if done else agent.timing.poll)
        saved += [s.message for s in seen if isinstance(s.message, Saved)]
        if done:
            return saved


def head_lost_message(
    launch: Launch, config: FitConfig, first: int, saved: list[Saved], why: str = ""
) -> str:
    """The node's word on the head's loss: what was kept, where, and how to go on (``why``:
    how the head was lost, and why no node took over from it)."""
    limit = config.node_timeout.total_seconds()
    how = why or f"its link closed, or no word for {limit:g}s"
    if launch.spare:
        return (
            f"spare: the head at {launch.head} was lost before this spare took a node's "
            f"place (its link closed, or no word for {limit:g}s); nothing to save here"
        )
    lead = (
        f"node {launch.node_rank}: the head at {launch.head} was lost ({how}); no generation "
        f"can form without it, so this node's workers{f' (from {first})' if first >= 0 else ''} "
        "stopped"
    )
    kept = [s for s in saved if s.path]
    if kept:
        best = max(kept, key=lambda s: s.step)
        who = "this node wrote it" if any(s.wrote for s in kept) else "another node wrote it"
        return (
            f"{lead} and kept what the run had committed: step {best.step} is in "
            f"{best.path} ({who}). Start the same command on every node with resume=True "
            "to go on from there."
        )
    why = "; ".join(sorted({s.note for s in saved if s.note})) or "no worker answered"
    return f"{lead}; nothing was saved ({why}). Start again from the newest checkpoint, if any."
