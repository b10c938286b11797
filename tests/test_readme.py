"""The README's examples run as written: the first as a user's script (ddp on two CPU
workers, in a real process), the custom step as a step of a one-device fit."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import phalanx as px
from procs import child_env

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


@pytest.mark.timeout(150)
def test_the_readme_example_trains_on_two_workers(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(python_blocks()[0])
    run = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=140,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    last = run.stdout.strip().splitlines()[-1]
    history = ast.literal_eval(last)  # the printed dict of the last epoch
    assert history["epoch"] == 2
    assert 0.0 <= history["train/accuracy"] <= 1.0 and history["train/loss"] > 0


def test_the_readme_custom_step_is_a_valid_step() -> None:
    scope: dict[str, Any] = {"torch": torch, "px": px}
    exec(python_blocks()[1], scope)
    data = torch.utils.data.TensorDataset(torch.randn(64, 20), torch.randint(0, 3, (64,)))
    model = torch.nn.Linear(20, 3)
    learner = px.Learner(model, torch.optim.SGD, scope["step"], metrics=[px.metrics.Accuracy()])
    # torch.optim.SGD's default lr is 1e-3 (torch >= 2.2), so the class itself is a factory.
    result = learner.fit(data, epochs=2, batch_size=16, sinks=[])
    assert result.steps == 8
    assert {"train/loss", "train/accuracy"} <= set(result.history[-1])


def block(marker: str) -> str:
    (found,) = [b for b in python_blocks() if marker in b]
    return found


def test_every_python_block_compiles() -> None:
    for code in python_blocks():
        compile(code, "README.md", "exec")


@pytest.mark.timeout(150)
def test_the_plain_ddp_port_trains_and_leaves_files_torch_opens(tmp_path: Path) -> None:
    script = tmp_path / "port.py"
    script.write_text(block("# coming from plain DDP: the port"))
    for _ in range(2):  # as written, it runs again (resume=True): nothing to do the 2nd time
        run = subprocess.run(
            [sys.executable, str(script)],
            capture_output=True,
            text=True,
            env=child_env(),
            timeout=70,
            cwd=tmp_path,
        )
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        run_dir = tmp_path / "runs" / "ddp-port"
        assert run.stdout.strip().endswith("runs/ddp-port/model.pt")  # result.model_path
    net = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    net.load_state_dict(torch.load(run_dir / "model.pt", weights_only=True))
    newest = sorted((run_dir / "checkpoints").glob("ckpt-*.pt"))[-1]
    checkpoint = torch.load(newest, weights_only=True)
    assert checkpoint["loop"]["epoch"] == 3 and checkpoint["loop"]["global_step"] == 3 * 32
    for key, value in net.state_dict().items():
        assert torch.equal(
            checkpoint["model"][key], value
        )  # the last checkpoint is the final model


def test_the_tracker_recipe_is_a_working_sink() -> None:
    scope: dict[str, Any] = {}
    exec(block("class TrackerSink"), scope)

    class FakeRun:
        def __init__(self) -> None:
            self.logged: list[tuple[dict[str, Any], Any]] = []
            self.finished = False

        def log(self, values: dict[str, Any], step: Any = None) -> None:
            self.logged.append((values, step))

        def finish(self) -> None:
            self.finished = True

    run = FakeRun()
    data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randint(0, 3, (32,)))
    learner = px.Learner(torch.nn.Linear(4, 3), torch.optim.SGD, px.cross_entropy_step)
    learner.fit(data, epochs=2, batch_size=8, sinks=[scope["TrackerSink"](run)])
    steps = [step for values, step in run.logged if step is not None]
    assert steps == list(range(1, 9))
    epochs = [values for values, step in run.logged if step is None]
    assert [e["epoch"] for e in epochs] == [0, 1] and "train/loss" in epochs[0]
    assert run.finished
