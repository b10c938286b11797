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
