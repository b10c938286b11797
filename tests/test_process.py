"""A process watched through a pidfd (strategies/ddp/process.py): a worker's lifeline to its
agent, whose parent is the fork server and so says nothing of the agent."""

from __future__ import annotations

import subprocess
import sys

from phalanx.strategies.ddp.process import Lifeline, exited, pidfd_of


def test_a_lifeline_sees_its_agent_live_then_gone() -> None:
    agent = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)  # fmt: skip
    line = Lifeline(agent.pid)
    fd = pidfd_of(agent.pid)
    assert line.alive() and fd is not None and not exited(fd)
    assert agent.stdin is not None
    agent.stdin.close()  # (the agent ends)
    agent.wait(timeout=30)
    assert not line.alive() and exited(fd)
    assert not Lifeline(agent.pid).alive()  # (gone before it was watched)


ORPHAN = """
import multiprocessing.forkserver as fs
import os, signal, sys, time
from phalanx.strategies.ddp.agent.agent import Agent, start_fork_server


def sleeper(_):
    time.sleep(120)


if __name__ == "__main__":
    start_fork_server()
    agent = Agent(bind=None)
    pid = agent.spawn(0, "w", sleeper, lambda outbox, stacks, beat: None)
    time.sleep(0.5)
    os.kill(fs._forkserver._forkserver_pid, signal.SIGKILL)  # (the fork server is killed)
    time.sleep(0.5)
    state = agent.slots[0]
    print("seen", state.alive(), state.orphan, flush=True)
    agent.kill(0)
    deadline = time.time() + 10
    while state.alive() and time.time() < deadline:
        time.sleep(0.05)
    gone = not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    print("killed", not state.alive(), gone, flush=True)
    agent.close()
"""


def test_a_worker_whose_fork_server_is_killed_is_still_watched_and_killed(tmp_path) -> None:
    """multiprocessing takes every child of a fork server that is gone for exited (code
    255) though they run on: the agent watches (and kills) a worker through its pidfd."""
    script = tmp_path / "orphan.py"
    script.write_text(ORPHAN)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "seen True True" in done.stdout  # alive, watched as an orphan
    assert "killed True True" in done.stdout, done.stdout


RESPAWN = """
import os, time
from phalanx.strategies.ddp.agent.agent import Agent, start_fork_server
from phalanx.strategies.ddp.wire.protocol import Ready


def sleeper(_):
    time.sleep(120)


def ready_then_sleep(outbox):
    outbox.send(Ready(0))
    time.sleep(120)


if __name__ == "__main__":
    start_fork_server()
    agent = Agent(bind=None)
    first = agent.spawn(0, "w", sleeper, lambda outbox, stacks, beat: None)
    old = agent.slots[0].process
    second = agent.spawn(0, "w", ready_then_sleep, lambda outbox, stacks, beat: outbox)
    old.join(timeout=10)
    print("old", old.exitcode, flush=True)
    seen, deadline = [], time.time() + 30
    while not any(s.message is not None for s in seen) and time.time() < deadline:
        seen += [s for s in agent.poll(__import__("datetime").timedelta(seconds=0.2))
                 if not s.exited or s.pid == first]
    print("seen", [(type(s.message).__name__, s.pid == second, s.exited) for s in seen
                   if s.message is None or type(s.message).__name__ == "Ready"], flush=True)
    agent.close()
"""


def test_a_spawn_in_a_slot_kills_the_process_it_replaces_and_tells_the_new_ones_words_by_pid(
    tmp_path,
) -> None:
    """A slot has one process: a spawn kills the one it replaces if it still runs (its exit
    is never reported), and what the new one says is seen with its pid (the head tells a
    replaced process's words and exit from its successor's by it)."""
    script = tmp_path / "respawn.py"
    script.write_text(RESPAWN)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "old -9" in done.stdout, done.stdout
    assert "seen [('Ready', True, False)]" in done.stdout, done.stdout
