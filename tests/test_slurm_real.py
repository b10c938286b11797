"""Under a real Slurm (slurmctld + slurmd, with ``JobRequeue``): the batch script of
docs/multinode.md (``#SBATCH --requeue``, ``--signal=USR1@N``, ``srun python train.py``, then
``scontrol requeue`` on exit status 75). The job's warning (SIGUSR1 to every process of its
steps) checkpoints the run and exits 75; Slurm requeues the job; the requeued run
(``SLURM_RESTART_COUNT=1``, the same script with ``resume=False``) resumes from the run_dir
and ends with the model of a run that was never stopped. A configuration error exits 1 and
is not requeued.

The warning is sent with ``scancel --signal=USR1`` (the processes ``--signal=USR1@N`` reaches:
the job's steps, not the batch shell), not by waiting for a time limit: Slurm sends that one up
to 60 s early and only to the minute. The requeued job is held about two minutes by Slurm
(its ``BeginTime``); ``scontrol update StartTime=now`` lets it start at once.

Skipped unless ``sbatch`` and ``sinfo`` exist and ``sinfo`` reports an idle node (CI has no
Slurm). Every job it submits is cancelled and gone before a test ends."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

SRC = Path(__file__).resolve().parent.parent / "src"
TOOLS = ("sbatch", "sinfo", "squeue", "scontrol", "scancel", "srun")
SAMPLES, BATCH, EPOCHS = 96, 8, 5
TOTAL_STEPS = SAMPLES // BATCH * EPOCHS
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}


def _slurm_idle() -> bool:
    if sys.platform == "win32" or not all(shutil.which(t) for t in TOOLS):
        return False
    try:
        states = subprocess.run(
            ["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=10
        ).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return False
    return "idle" in states


pytestmark = [
    pytest.mark.skipif(not _slurm_idle(), reason="needs a running Slurm with an idle node"),
    pytest.mark.slow,
    pytest.mark.timeout(420),
]

SCRIPT = f'''
"""argv: run_dir strategy out_dir [batch_size]; env STEP_SLEEP_S (the first attempt only).
Writes out_dir/attempt<SLURM_RESTART_COUNT>.json and .pt."""
import json
import os
import sys
import time

import torch
from torch import nn
from torch.utils.data import TensorDataset

import phalanx as px

RESTART = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
SLEEP = float(os.environ.get("STEP_SLEEP_S", "0")) if RESTART == 0 else 0.0


def make_model():
    return nn.Linear(4, 2)


def make_optimizer(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def train_step(model, batch):
    time.sleep(SLEEP)
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def main(argv):
    run_dir, strategy, out_dir = argv[:3]
    batch = int(argv[3]) if len(argv) > 3 else {BATCH}
    print(f"attempt SLURM_RESTART_COUNT={{RESTART}}", flush=True)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn({SAMPLES}, 4, generator=g),
                         torch.randint(0, 2, ({SAMPLES},), generator=g))
    devices = "cpu:0,cpu:1" if strategy == "ddp" else "cpu"
    learner = px.Learner(make_model, make_optimizer, train_step)
    try:
        result = learner.fit(data, epochs={EPOCHS}, batch_size=batch, run_dir=run_dir,
                             strategy=strategy, devices=devices, seed=3, balance=False)
    except SystemExit as stopped:  # px.FitPreempted: checkpointed, exits 75
        save(stopped.result, out_dir, type(stopped).__name__)
        raise
    save(result, out_dir, None)


def save(result, out_dir, raised):
    torch.save(result.model.state_dict(), os.path.join(out_dir, f"attempt{{RESTART}}.pt"))
    with open(os.path.join(out_dir, f"attempt{{RESTART}}.json"), "w") as fh:
        json.dump({{"interrupted": result.interrupted, "steps": result.steps,
                    "raised": raised}}, fh)


if __name__ == "__main__":
    main(sys.argv[1:])
'''

# docs/multinode.md's batch script, plus a line per attempt (restart count, srun's status).
BATCH_SCRIPT = """#!/bin/bash
#SBATCH --requeue
#SBATCH --signal=USR1@120
export PHALANX_PORT={port}
srun {python} train.py "$@"
status=$?
echo "${{SLURM_RESTART_COUNT:-0}} $status" >> attempts.txt
if [ $status -eq 75 ] && [ "${{SLURM_RESTART_COUNT:-0}}" -lt 20 ]; then
    scontrol requeue "$SLURM_JOB_ID"
fi
exit $status
"""


class Jobs:
    """The jobs a test submitted: each is cancelled, and waited for until Slurm has no
    process of it, when the test ends."""

    def __init__(self) -> None:
        self.ids: list[str] = []

    def submit(self, folder: Path, tag: str, args: list[str], sleep: float = 0.0) -> str:
        (folder / "train.py").write_text(SCRIPT)
        port = 29410 + len(self.ids) + os.getpid() % 500 * 4
        script = BATCH_SCRIPT.format(port=port, python=sys.executable)
        (folder / "job.sh").write_text(script)
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(p for p in (str(SRC), os.environ.get("PYTHONPATH")) if p),
            "STEP_SLEEP_S": str(sleep),
            "OMP_NUM_THREADS": "1",
        }
        command = ["sbatch", "--parsable", "--time=10", "--nodes=1", "--ntasks=1"]
        command += ["--open-mode=append", f"--output={folder / 'job.log'}", f"--job-name=px-{tag}"]
        done = subprocess.run(
            [*command, "job.sh", *args], cwd=folder, env=env, capture_output=True,
            text=True, timeout=30, check=True,
        )  # fmt: skip
        job = done.stdout.strip().split(";")[0]
        self.ids.append(job)
        return job

    def close(self) -> None:
        for job in self.ids:
            subprocess.run(["scancel", job], capture_output=True, timeout=30)
        deadline = time.monotonic() + 60
        while self.ids and time.monotonic() < deadline:
            listed = subprocess.run(
                ["squeue", "-h", "-o", "%i", "-j", ",".join(self.ids)],
                capture_output=True, text=True, timeout=30,
            ).stdout.split()  # fmt: skip
            if not set(listed) & set(self.ids):
                return
            time.sleep(0.5)


@pytest.fixture
def jobs() -> Iterator[Jobs]:
    submitted = Jobs()
    try:
        yield submitted
    finally:
        submitted.close()


def job_info(job: str) -> dict[str, str]:
    """``scontrol show job``'s fields (JobState, Restarts, ExitCode, ...); {} once purged."""
    done = subprocess.run(
        ["scontrol", "-o", "show", "job", job], capture_output=True, text=True, timeout=30
    )
    return dict(re.findall(r"(\w+)=(\S*)", done.stdout)) if done.returncode == 0 else {}


def attempts(folder: Path) -> list[tuple[int, int]]:
    """What the batch script wrote after each srun: (SLURM_RESTART_COUNT, status)."""
    path = folder / "attempts.txt"
    lines = path.read_text().split("\n") if path.exists() else []
    return [(int(a), int(b)) for a, b in (line.split() for line in lines if line.strip())]


def wait_for(what: str, folder: Path, test: object, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not test():
        if time.monotonic() > deadline:
            log = folder / "job.log"
            said = log.read_text(errors="replace")[-3000:] if log.exists() else "(no log)"
            pytest.fail(f"waited {timeout:.0f}s for {what}; attempts {attempts(folder)}\n{said}")
        time.sleep(0.25)


def wait_until_final(job: str, folder: Path, timeout: float) -> dict[str, str]:
    found: dict[str, str] = {}

    def final() -> bool:
        found.update(job_info(job))
        return found.get("JobState") in FINAL_STATES

    wait_for(f"job {job} to end", folder, final, timeout)
    return found


@pytest.mark.parametrize("strategy", ["single", "ddp"])
def test_slurm_requeues_the_warned_job_and_it_resumes_exactly(
    tmp_path: Path, jobs: Jobs, strategy: str
) -> None:
    first, straight = tmp_path / "job", tmp_path / "straight"
    first.mkdir()
    straight.mkdir()
    job = jobs.submit(first, "warned", ["run", strategy, "."], sleep=0.3)
    plain = jobs.submit(straight, "straight", ["run", strategy, "."])

    # The first attempt: after a committed step, the warning to the job's steps.
    events = first / "run" / "events.jsonl"
    wait_for(
        "a committed step", first, lambda: events.exists() and '"StepEnded"' in events.read_text(),
        timeout=120,
    )  # fmt: skip
    subprocess.run(["scancel", "--signal=USR1", job], check=True, timeout=30)
    wait_for("the first attempt to end", first, lambda: attempts(first), timeout=90)
    assert attempts(first) == [(0, 75)]
    stopped = json.loads((first / "attempt0.json").read_text())
    assert stopped["raised"] == "FitPreempted"
    assert stopped["interrupted"].startswith("Training interrupted: received SIGUSR1 (the batch")
    saved = stopped["steps"]
    assert 1 <= saved < TOTAL_STEPS
    assert (first / "run" / "checkpoints" / f"ckpt-{saved:09d}.pt").is_file()

    # Slurm requeued it (held ~2 minutes by its BeginTime: start it now).
    def requeued() -> bool:
        info = job_info(job)
        return info.get("Restarts") == "1" and info.get("JobState") in ("PENDING", "RUNNING")

    wait_for("Slurm to requeue the job", first, requeued, timeout=60)
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], timeout=30)
    info = wait_until_final(job, first, timeout=150)
    log = (first / "job.log").read_text(errors="replace")
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", (info, log[-3000:])
    assert attempts(first) == [(0, 75), (1, 0)]
    assert "attempt SLURM_RESTART_COUNT=1" in log
    assert "Slurm requeued this job (SLURM_RESTART_COUNT=1): resuming from run" in log
    assert f"after {saved} committed step(s)" in log, log[-3000:]
    resumed = json.loads((first / "attempt1.json").read_text())
    assert resumed == {"interrupted": None, "steps": TOTAL_STEPS, "raised": None}

    # ...with the model of the same job never stopped.
    info = wait_until_final(plain, straight, timeout=120)
    assert info["JobState"] == "COMPLETED" and attempts(straight) == [(0, 0)], info
    a, b = torch.load(first / "attempt1.pt"), torch.load(straight / "attempt0.pt")
    assert a.keys() == b.keys()
    assert all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-7) for k in b)


def test_a_configuration_error_exits_1_and_is_not_requeued(tmp_path: Path, jobs: Jobs) -> None:
    job = jobs.submit(tmp_path, "bad-batch", ["run", "single", ".", "0"])
    info = wait_until_final(job, tmp_path, timeout=120)
    log = (tmp_path / "job.log").read_text(errors="replace")
    assert info["JobState"] == "FAILED", (info, log[-3000:])
    assert info["Restarts"] == "0" and info["ExitCode"] == "1:0", info
    assert attempts(tmp_path) == [(0, 1)]
    assert "batch_size=0" in log
