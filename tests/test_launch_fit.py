"""fit under a launcher: one process on one node trains as it does without one; several
processes per node (PX141) or several nodes (PX142) are refused on every process before
anything starts, with how to launch instead. In-process with a launcher's variables, and as
processes under a real torchrun and under ``phalanx run``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import phalanx as px
from phalanx.errors import (
    LaunchEnvironmentError,
    MultiNodeUnavailableError,
    ProcessesPerNodeError,
)
from procs import child_env
from recorder import Recorder
from test_launch import srun_env, torchrun_env

TORCHRUN = Path(sys.executable).with_name("torchrun")
LAUNCH_PREFIXES = ("PHALANX_", "SLURM_", "TORCHELASTIC_")


def make_model() -> nn.Module:
    return nn.Linear(4, 3)


def learner() -> px.Learner:
    return px.Learner(make_model, torch.optim.SGD, px.cross_entropy_step)


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(32, 4, generator=g), torch.randint(0, 3, (32,), generator=g))


def set_env(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    for name in list(os.environ):
        if name.startswith(LAUNCH_PREFIXES):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


COPIES = [
    ("torchrun --nproc-per-node 2", torchrun_env(1, 0, 2, 1), "torchrun --nproc-per-node 1"),
    (
        "srun --ntasks-per-node 2",
        srun_env(SLURM_NNODES="1", SLURM_NODELIST="n1", SLURM_TASKS_PER_NODE="2"),
        "srun --ntasks-per-node 1",
    ),
    (
        "PHALANX_* cannot make one process of torchrun's two",
        {"PHALANX_NNODES": "1", **torchrun_env(1, 0, 2, 0)},
        "torchrun --nproc-per-node 1",
    ),
]


@pytest.mark.parametrize(("env", "fix"), [c[1:] for c in COPIES], ids=[c[0] for c in COPIES])
def test_several_processes_per_node_are_refused_before_anything(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, env: dict[str, str], fix: str
) -> None:
    set_env(monkeypatch, env)
    events = Recorder()
    run_dir = tmp_path / "run"
    with pytest.raises(ProcessesPerNodeError) as info:
        learner().fit(dataset(), batch_size=8, run_dir=str(run_dir), sinks=[events])
    message = info.value.message
    assert info.value.code == "PX141"
    assert fix in message and "devices=" in message and "one worker per device" in message
    assert "full copy" in message
    assert not run_dir.exists() and events.events == []


NODES = [
    ("phalanx run", {"PHALANX_NNODES": "2", "PHALANX_NODE_RANK": "1", "PHALANX_HEAD": "h:1"}),
    ("torchrun --nnodes 2 --nproc-per-node 1", torchrun_env(2, 0, 1, 0)),
    (
        "srun --nodes 2 --ntasks-per-node 1",
        srun_env(SLURM_NNODES="2", SLURM_NODEID="1", SLURM_NODELIST="n[1-2]"),
    ),
]


@pytest.mark.parametrize("env", [c[1] for c in NODES], ids=[c[0] for c in NODES])
def test_several_nodes_are_refused_for_a_strategy_that_trains_on_one_node(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, env: dict[str, str]
) -> None:
    set_env(monkeypatch, env)
    run_dir = tmp_path / "run"
    with pytest.raises(MultiNodeUnavailableError) as info:
        learner().fit(dataset(), batch_size=8, run_dir=str(run_dir), sinks=[])
    assert info.value.code == "PX142"
    assert "of 2" in info.value.message
    assert "trains on one node only" in info.value.message
    assert "several nodes train with strategy='ddp'" in info.value.message
    assert not run_dir.exists()


def test_an_unreadable_launch_environment_is_named(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    set_env(monkeypatch, {"PHALANX_NNODES": "1", "PHALANX_HEAD": "node0"})
    with pytest.raises(LaunchEnvironmentError, match="PHALANX_HEAD='node0' is not host:port"):
        learner().fit(dataset(), batch_size=8, run_dir=str(tmp_path / "run"), sinks=[])
    assert not (tmp_path / "run").exists()


ONE_NODE = [
    ("phalanx", {"PHALANX_NNODES": "1"}),
    ("torchrun --nproc-per-node 1", torchrun_env(1, 0, 1, 0)),
    ("srun one task", srun_env(SLURM_NNODES="1", SLURM_NODELIST="n1", SLURM_TASKS_PER_NODE="1")),
]


@pytest.mark.parametrize("env", [c[1] for c in ONE_NODE], ids=[c[0] for c in ONE_NODE])
def test_one_process_on_one_node_trains_as_without_a_launcher(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str]
) -> None:
    set_env(monkeypatch, {})
    plain = learner().fit(dataset(), batch_size=8, epochs=2, sinks=[])
    set_env(monkeypatch, env)
    launched = learner().fit(dataset(), batch_size=8, epochs=2, sinks=[])
    assert launched.steps == plain.steps == 8
    for a, b in zip(plain.model.parameters(), launched.model.parameters(), strict=True):
        assert torch.equal(a, b)


# The README's first script, with a run_dir (argv[1]) and the strategy (argv[2]).
SCRIPT = """
import functools, sys, torch
import phalanx as px

if __name__ == "__main__":  # required: ddp starts its workers with spawn
    data = torch.utils.data.TensorDataset(torch.randn(256, 20), torch.randint(0, 3, (256,)))
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3))
    adam = functools.partial(torch.optim.Adam, lr=1e-3)
    learner = px.Learner(model, adam, px.cross_entropy_step, metrics=[px.metrics.Accuracy()])
    result = learner.fit(data, epochs=2, batch_size=64, strategy=sys.argv[2],
                         devices="cpu:0,cpu:1" if sys.argv[2] == "ddp" else "cpu",
                         run_dir=sys.argv[1])
    print("steps", result.steps)
"""


def _script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(SCRIPT))
    return path


def _env() -> dict[str, str]:
    return {k: v for k, v in child_env().items() if not k.startswith(LAUNCH_PREFIXES)}


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, env=_env())


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_torchrun_with_two_processes_per_node_trains_no_copies(tmp_path: Path) -> None:
    run_dir, logs = tmp_path / "run", tmp_path / "logs"
    # torchrun looks at its processes every --monitor-interval seconds and ends the others
    # once one failed; 10 s lets each process reach its own refusal (about 2 s after start).
    proc = _run(
        [str(TORCHRUN), "--standalone", "--nproc-per-node", "2", "--monitor-interval", "10",
         "--log-dir", str(logs), "--redirects", "3", str(_script(tmp_path)), str(run_dir), "ddp"]
    )  # fmt: skip
    assert proc.returncode != 0
    # torchrun's summary: both ranks failed, each with exit code 1.
    failed = re.findall(r"rank\s*: (\d) \(local_rank: \d\)\s*exitcode\s*: 1 ", proc.stderr)
    assert sorted(failed) == ["0", "1"], proc.stderr[-3000:]
    for rank in (0, 1):
        (stderr,) = logs.glob(f"*/attempt_0/{rank}/stderr.log")
        text = stderr.read_text()
        assert "[PX141]" in text and f"LOCAL_RANK={rank}" in text
        assert "torchrun --nproc-per-node 1" in text and "devices=" in text
        assert "steps" not in (stderr.parent / "stdout.log").read_text()
    assert not run_dir.exists()  # no checkpoint, no run.json: nothing was touched


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_torchrun_with_one_process_per_node_trains_one_job(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = _run(
        [str(TORCHRUN), "--standalone", "--nproc-per-node", "1", str(_script(tmp_path)),
         str(run_dir), "ddp"]
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "steps 8" in proc.stdout
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("ckpt-*.pt")) == [
        "ckpt-000000004.pt",
        "ckpt-000000008.pt",
    ]


def _phalanx(*argv: str) -> list[str]:
    return [sys.executable, "-m", "phalanx", *argv]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_phalanx_run_several_nodes_with_single_is_refused_one_node_trains(tmp_path: Path) -> None:
    script, run_dir = _script(tmp_path), tmp_path / "run"
    head = ("--head", "127.0.0.1:29410")
    proc = _run(_phalanx("run", "--nnodes", "2", "--node-rank", "1", *head, str(script),
                         str(run_dir), "single"))  # fmt: skip
    assert proc.returncode == 1
    assert "[PX142]" in proc.stderr and "node 1 of 2 (PHALANX_NNODES)" in proc.stderr
    assert not run_dir.exists()
    proc = _run(_phalanx("run", "--nnodes", "1", str(script), str(run_dir), "single"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "steps 8" in proc.stdout and (run_dir / "model.pt").is_file()
