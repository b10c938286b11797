"""One live run per run_dir (``phalanx.runlock``): a second fit on a folder a live run holds
is refused (PX143) before anything there is moved or written; the lock goes with the run
however it ends, and one left by a killed run is taken over with a notice."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import phalanx as px
from phalanx.errors import CheckpointError, RunDirLockedError
from phalanx.events import Notice
from phalanx.runlock import LOCK_FILE, Holder, RunLock
from procs import child_env
from recorder import Recorder


def make_model() -> nn.Module:
    return nn.Linear(4, 3)


def failing_step(model: nn.Module, batch: Any) -> torch.Tensor:
    raise ValueError("this step always fails")


def learner(step: Any = px.cross_entropy_step) -> px.Learner:
    return px.Learner(make_model, torch.optim.SGD, step)


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(32, 4, generator=g), torch.randint(0, 3, (32,), generator=g))


def folder_state(run_dir: Path) -> dict[str, bytes]:
    """Every file under run_dir but the lock, with its bytes."""
    return {
        str(p.relative_to(run_dir)): p.read_bytes()
        for p in sorted(run_dir.rglob("*"))
        if p.is_file() and p.name != LOCK_FILE
    }


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_second_lock_is_refused_naming_the_holder_and_release_empties_it(
    tmp_path: Path,
) -> None:
    lock = RunLock.acquire(tmp_path)
    assert lock.stale is None and lock.notice() is None
    held = Holder.read((tmp_path / LOCK_FILE).read_text())
    assert held is not None and (held.pid, held.host) == (os.getpid(), socket.gethostname())
    with pytest.raises(RunDirLockedError) as info:  # another open file, in this process too
        RunLock.acquire(tmp_path)
    assert info.value.code == "PX143"
    assert f"pid {os.getpid()} on host {socket.gethostname()}" in info.value.message
    assert "another run_dir" in info.value.message
    lock.release()
    lock.release()  # a second release does nothing
    assert (tmp_path / LOCK_FILE).read_text() == ""
    with RunLock.acquire(tmp_path) as again:
        assert again.stale is None
    assert (tmp_path / LOCK_FILE).read_text() == ""


def test_a_lock_its_holder_left_behind_is_taken_over_with_a_notice(tmp_path: Path) -> None:
    pid = dead_pid()
    left = Holder(pid, socket.gethostname(), 1.0e9, "python train.py")
    (tmp_path / LOCK_FILE).write_text(left.text())
    with RunLock.acquire(tmp_path) as lock:
        assert lock.stale == left
        notice = lock.notice()
        assert notice is not None
        assert f"took over the stale lock of pid {pid}" in notice
        assert "ended without releasing it" in notice


HOLD_AND_FORK = """
import os, sys, time
from phalanx.runlock import RunLock
lock = RunLock.acquire(sys.argv[1])
child = os.fork()
if child == 0:  # keeps the inherited lock, as a DataLoader worker would
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)  # not the test's pipes: the test reads the holder's to the end
    time.sleep(120)
    os._exit(0)
print(child, flush=True)
os._exit(0)  # the holder ends without releasing; its child still holds the lock
"""


def test_a_dead_holder_whose_child_keeps_the_lock_is_named_as_such(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(HOLD_AND_FORK), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        env=child_env(),
    )
    child = int(proc.stdout.strip())
    try:
        with pytest.raises(RunDirLockedError) as info:
            RunLock.acquire(tmp_path)
        assert "has ended, but a process it started still holds the lock" in info.value.message
    finally:
        os.kill(child, signal.SIGKILL)
    deadline = time.time() + 10
    while time.time() < deadline:  # the child is not ours to reap: wait for the kernel
        try:
            with RunLock.acquire(tmp_path) as lock:
                assert lock.stale is not None
                break
        except RunDirLockedError:
            time.sleep(0.05)
    else:
        pytest.fail("the lock was not freed when the last process holding it ended")


def test_without_flock_a_live_pid_on_this_host_still_holds_the_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_flock(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_flock)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        path = tmp_path / LOCK_FILE
        path.write_text(Holder(sleeper.pid, socket.gethostname()).text())
        with pytest.raises(RunDirLockedError, match=f"pid {sleeper.pid} on host"):
            RunLock.acquire(tmp_path)
    finally:
        sleeper.kill()
        sleeper.wait()
    with RunLock.acquire(tmp_path) as lock:  # its pid has ended: taken over, said so
        assert lock.stale is not None and lock.stale.pid == sleeper.pid
        assert lock.unlocked.startswith("this file system cannot lock files")
        assert "took over the stale lock" in (lock.notice() or "")


def test_fit_releases_the_lock_when_it_returns_and_when_it_raises(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    learner().fit(dataset(), batch_size=8, run_dir=str(run_dir), sinks=[])
    assert (run_dir / LOCK_FILE).read_text() == ""
    with pytest.raises(px.TrainingFailed):
        learner(failing_step).fit(
            dataset(), epochs=2, batch_size=8, run_dir=str(run_dir), resume=True, sinks=[]
        )
    assert (run_dir / LOCK_FILE).read_text() == ""
    with pytest.raises(CheckpointError, match="batch"):  # PX120, raised while holding it
        learner().fit(dataset(), batch_size=16, run_dir=str(run_dir), resume=True, sinks=[])
    assert (run_dir / LOCK_FILE).read_text() == ""
    events = Recorder()
    learner().fit(dataset(), epochs=2, batch_size=8, run_dir=str(run_dir), resume=True,
                  sinks=[events])  # fmt: skip
    assert [n for n in events.of(Notice) if "lock" in n.text] == []  # released: not stale


# A live run: the first step waits (it writes a marker, then sleeps) until the test kills it.
LIVE_RUN = """
import sys, time, torch
from pathlib import Path
import phalanx as px
from torch import nn

def make_model():
    return nn.Linear(4, 3)

def slow_step(model, batch):
    Path(sys.argv[2]).write_text("in a step")
    time.sleep(120)
    return px.cross_entropy_step(model, batch)

if __name__ == "__main__":
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(32, 4, generator=g), torch.randint(0, 3, (32,), generator=g))
    px.Learner(make_model, torch.optim.SGD, slow_step).fit(
        data, epochs=4, batch_size=8, run_dir=sys.argv[1], resume=True, sinks=[])
"""


def _wait_for(path: Path, proc: subprocess.Popen[str], seconds: float = 60) -> None:
    deadline = time.time() + seconds
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() < deadline, f"{path} did not appear"
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_second_fit_beside_a_live_run_is_refused_and_touches_nothing(tmp_path: Path) -> None:
    run_dir, marker = tmp_path / "run", tmp_path / "in-step"
    first = learner().fit(dataset(), epochs=2, batch_size=8, run_dir=str(run_dir), sinks=[])
    script = tmp_path / "live.py"
    script.write_text(textwrap.dedent(LIVE_RUN))
    live = subprocess.Popen(
        [sys.executable, str(script), str(run_dir), str(marker)],
        env=child_env(),
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for(marker, live)  # the live run holds run_dir and is inside a step
        before = folder_state(run_dir)
        assert any(name.startswith("checkpoints/ckpt-") for name in before)
        for resume in (False, True):
            events = Recorder()
            with pytest.raises(RunDirLockedError) as info:
                learner().fit(dataset(), epochs=4, batch_size=8, run_dir=str(run_dir),
                              resume=resume, sinks=[events])  # fmt: skip
            message = info.value.message
            assert info.value.code == "PX143"
            assert f"pid {live.pid} on host {socket.gethostname()}" in message
            assert "live.py" in message  # the holder's command line
            assert events.events == []
            assert folder_state(run_dir) == before  # nothing moved, written or deleted
            assert not (run_dir / "earlier").exists()
    finally:
        live.send_signal(signal.SIGKILL)
        live.communicate(timeout=30)
    # The killed run's lock is taken over, with a notice; the run resumes from the
    # checkpoints the first run wrote.
    events = Recorder()
    resumed = learner().fit(dataset(), epochs=4, batch_size=8, run_dir=str(run_dir),
                            resume=True, sinks=[events])  # fmt: skip
    assert resumed.steps == 2 * first.steps
    (notice,) = [n for n in events.of(Notice) if "lock" in n.text]
    assert f"took over the stale lock of pid {live.pid}" in notice.text
    assert notice.level == "warning"
    assert json.loads((run_dir / "run.json").read_text())["run_id"]


def test_the_demo_does_not_move_a_live_runs_files_aside(tmp_path: Path) -> None:
    from phalanx.demo import start_over

    run_dir = tmp_path / "run"
    learner().fit(dataset(), batch_size=8, run_dir=str(run_dir), sinks=[])
    before = folder_state(run_dir)
    with RunLock.acquire(run_dir), pytest.raises(RunDirLockedError):
        start_over(str(run_dir))
    assert folder_state(run_dir) == before and not (run_dir / "earlier").exists()
    start_over(str(run_dir))  # no live run: the last run's files move aside
    assert (run_dir / "earlier").is_dir() and not (run_dir / "run.json").exists()
