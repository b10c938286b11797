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
