"""A batch system's time-limit warning (Slurm's ``--signal=USR1@120``): the run checkpoints
at the next step boundary and exits 75, the status a batch script requeues on; the requeued
job (``SLURM_RESTART_COUNT`` > 0) resumes by itself and ends with the model of a run that was
never stopped. A failure a restart cannot fix (a poison batch) exits 1: not requeued.

Without a Slurm installation here, the test gives what Slurm gives: SIGUSR1 to every process
of the job (its process group, workers and fork server included) and the requeued job's
environment."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from procs import child_env

pytestmark = [
    pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals"),
    pytest.mark.timeout(180),
]

SAMPLES, BATCH, EPOCHS = 96, 8, 3
TOTAL_STEPS = SAMPLES // BATCH * EPOCHS

SCRIPT = f'''
"""argv: run_dir strategy out.json state.pt; env: STEP_SLEEP_S, POISON (read at import:
ddp workers import this module and run the step, never main())"""
import json
import os
import sys
import time

import torch
from torch import nn
from torch.utils.data import TensorDataset

import phalanx as px

SLEEP = float(os.environ.get("STEP_SLEEP_S", "0"))
POISON = os.environ.get("POISON") == "1"


def make_model():
    return nn.Linear(4, 2)


def make_optimizer(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def train_step(model, batch):
    time.sleep(SLEEP)
    if POISON:
        raise ValueError("a record that cannot be decoded")
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def main(argv):
    run_dir, strategy, out, state = argv
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn({SAMPLES}, 4, generator=g),
                         torch.randint(0, 2, ({SAMPLES},), generator=g))
    devices = "cpu:0,cpu:1" if strategy == "ddp" else "cpu"
    learner = px.Learner(make_model, make_optimizer, train_step)
    try:
        result = learner.fit(data, epochs={EPOCHS}, batch_size={BATCH}, run_dir=run_dir,
                             strategy=strategy, devices=devices, seed=3, balance=False)
    except SystemExit as stopped:  # px.FitPreempted: checkpointed, exits 75
        save(stopped.result, out, state, type(stopped).__name__)
        raise
    save(result, out, state, None)


def save(result, out, state, raised):
    torch.save(result.model.state_dict(), state)
    with open(out, "w") as fh:
        json.dump({{"interrupted": result.interrupted, "steps": result.steps, "raised": raised,
                    "failures": len(result.failures)}}, fh)


if __name__ == "__main__":
    main(sys.argv[1:])
'''

SLURM_REQUEUED = {  # what a requeued job's step sees (sbatch --requeue, then srun)
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_ID": "0",
    "SLURM_NNODES": "1",
    "SLURM_NODEID": "0",
    "SLURM_JOB_NODELIST": "localhost",
    "SLURM_RESTART_COUNT": "1",
}


def start(
    tmp: Path, tag: str, strategy: str, sleep: float, poison: bool = False, env: Any = None
) -> subprocess.Popen[bytes]:
    script = tmp / "train.py"
    script.write_text(SCRIPT)
    args = [str(tmp / "run"), strategy, str(tmp / f"{tag}.json"), str(tmp / f"{tag}.pt")]
    step = {"STEP_SLEEP_S": str(sleep), "POISON": "1" if poison else "0"}
    return subprocess.Popen(
        [sys.executable, str(script), *args],
        stdout=(tmp / f"{tag}.out").open("wb"), stderr=subprocess.STDOUT, cwd=tmp,
        env={**child_env(), **step, **(env or {})}, start_new_session=True,  # (its own group)
    )  # fmt: skip


def wait_for_a_step(tmp: Path, proc: subprocess.Popen[bytes], tag: str) -> None:
    events = tmp / "run" / "events.jsonl"
    deadline = time.monotonic() + 90
    while not (events.exists() and '"StepEnded"' in events.read_text()):
        assert proc.poll() is None, (tmp / f"{tag}.out").read_text()[-3000:]
        assert time.monotonic() < deadline, (tmp / f"{tag}.out").read_text()[-3000:]
        time.sleep(0.05)


def finish(proc: subprocess.Popen[bytes], timeout: float) -> int:
    try:
        return proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


@pytest.mark.parametrize("strategy", ["single", "ddp"])
def test_the_warning_checkpoints_exits_75_and_the_requeued_job_resumes(
    tmp_path: Path, strategy: str
) -> None:
    proc = start(tmp_path, "first", strategy, sleep=0.1)
    try:
        wait_for_a_step(tmp_path, proc, "first")
        os.killpg(proc.pid, signal.SIGUSR1)  # as Slurm: every process of the job step
        code = finish(proc, timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = (tmp_path / "first.out").read_text(errors="replace")
    assert code == 75, out[-3000:]
    first = json.loads((tmp_path / "first.json").read_text())
    assert first["raised"] == "FitPreempted"
    assert first["interrupted"].startswith("Training interrupted: received SIGUSR1 (the batch")
    assert first["failures"] == 0  # no worker took the signal for a fault
    saved = first["steps"]
    assert 1 <= saved < TOTAL_STEPS
    assert (tmp_path / "run" / "checkpoints" / f"ckpt-{saved:09d}.pt").is_file()

    # The requeued job: the same script (resume=False), Slurm's environment says requeued.
    second = start(tmp_path, "second", strategy, sleep=0.0, env=SLURM_REQUEUED)
    assert finish(second, timeout=90) == 0, (tmp_path / "second.out").read_text()[-3000:]
    resumed = json.loads((tmp_path / "second.json").read_text())
    assert resumed["steps"] == TOTAL_STEPS and resumed["interrupted"] is None
    said = (tmp_path / "second.out").read_text(errors="replace")
    assert "Slurm requeued this job (SLURM_RESTART_COUNT=1): resuming from" in said

    # ...and ends with the model of a run that was never stopped.
    straight = tmp_path / "straight"
    straight.mkdir()
    third = start(straight, "third", strategy, sleep=0.0)
    assert finish(third, timeout=90) == 0, (straight / "third.out").read_text()[-3000:]
    a, b = torch.load(tmp_path / "second.pt"), torch.load(straight / "third.pt")
    assert all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-7) for k in b)


def test_a_failure_a_restart_cannot_fix_exits_1_not_75(tmp_path: Path) -> None:
    proc = start(tmp_path, "poison", "single", sleep=0.0, poison=True)
    code = finish(proc, timeout=60)
    out = (tmp_path / "poison.out").read_text(errors="replace")
    assert code == 1, out[-3000:]
    assert "a record that cannot be decoded" in out


@pytest.mark.parametrize(
    ("source", "restarts", "run_dir", "resume", "resumes"),
    [
        ("slurm", 1, "runs/a", False, True),  # requeued: resumes by itself
        ("slurm", 0, "runs/a", False, False),  # the first start of the job
        ("slurm", 2, None, False, False),  # nothing to resume from
        ("slurm", 1, "runs/a", True, False),  # asked already: no notice
        ("torchrun", 1, "runs/a", False, False),  # torchrun's restarts: the script decides
        ("local", 0, "runs/a", False, False),
    ],
)
def test_who_resumes_because_slurm_requeued_the_job(
    source: str, restarts: int, run_dir: str | None, resume: bool, resumes: bool
) -> None:
    from phalanx.launch import Launch
    from phalanx.learner import _requeued

    said = _requeued(Launch(source, restart_count=restarts), run_dir, resume)  # type: ignore[arg-type]
    assert (said is not None) == resumes
    if resumes:
        assert said == (
            f"Slurm requeued this job (SLURM_RESTART_COUNT={restarts}): resuming from runs/a "
            "(as resume=True)"
        )
