"""The head lost, on a node's agent: tell the workers to keep what the run committed (each
writes its emergency checkpoint, :mod:`..worker.emergency`), wait for them, and say what was
kept and how to go on."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

from phalanx.errors import HeadLost, HeadLostError
from phalanx.events import Notice
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
    return f"{lead}{kept_line(saved)}"


def best_kept(saved: list[Saved]) -> Saved | None:
    """The newest step a worker of this node kept (in a file), or None."""
    kept = [s for s in saved if s.path]
    return max(kept, key=lambda s: s.step) if kept else None


def kept_line(saved: list[Saved]) -> str:
    """What this node's workers kept of the run and how to go on, to end a PX147 message."""
    best = best_kept(saved)
    if best is not None:
        wrote = any(s.wrote for s in saved if s.path)
        who = "this node wrote it" if wrote else "another node wrote it"
        return (
            f" and kept what the run had committed: step {best.step} is in {best.path} "
            f"({who}). Start the same command on every node with resume=True to go on from "
            "there."
        )
    why = "; ".join(sorted({s.note for s in saved if s.note})) or "no worker answered"
    if any(s.kept_files for s in saved):  # (fsdp: shard snapshots kept as checkpoint files)
        return f"; {why}. Start the same command on every node with resume=True to go on."
    return f"; nothing was saved ({why}). Start again from the newest checkpoint, if any."


def head_lost(message: str, saved: list[Saved], emit: Any) -> HeadLost:
    """The node's end when the head was lost and no failover goes on: ``message`` (PX147)
    told to its sinks, raised by the caller as HeadLost (exit 75) with the step kept."""
    error = HeadLostError(message)
    emit(Notice(str(error), level="error"))
    best = best_kept(saved)
    return HeadLost(error, None if best is None else best.step, None if best is None else best.path)
