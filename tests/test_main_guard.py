"""The ddp strategy names a script that lacks its ``if __name__ == "__main__":`` guard
before any worker process is spawned."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

BODY = """
import torch, phalanx as px
from torch import nn
from torch.utils.data import TensorDataset

def make_model():
    return nn.Linear(4, 2)

def make_opt(p):
    return torch.optim.SGD(p, lr=0.1)

def step(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)

def train():
    data = TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
    result = px.Learner(make_model, make_opt, step).fit(
        data, batch_size=8, strategy="ddp", devices="cpu:0,cpu:1", sinks=[])
    print("steps", result.steps)
"""


def _run(tmp_path: Path, tail: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(BODY) + tail)
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=90)


@pytest.mark.timeout(120)
def test_unguarded_script_is_named_before_launch(tmp_path: Path) -> None:
    proc = _run(tmp_path, "\ntrain()\n")
    assert proc.returncode != 0
    assert "PX116" in proc.stderr
    assert 'if __name__ == "__main__":' in proc.stderr
    assert "script.py" in proc.stderr
    # Raised before launch: no worker ever re-imported the script (that would print
    # multiprocessing's bootstrapping error).
    assert "bootstrapping phase" not in proc.stderr


@pytest.mark.timeout(120)
def test_unguarded_script_that_uses_dunder_name_is_named_too(tmp_path: Path) -> None:
    """``logging.getLogger(__name__)`` mentions __name__ but guards nothing."""
    proc = _run(tmp_path, "\nimport logging\nlog = logging.getLogger(__name__)\ntrain()\n")
    assert proc.returncode != 0
    assert "PX116" in proc.stderr
    assert "bootstrapping phase" not in proc.stderr


@pytest.mark.timeout(120)
def test_guarded_script_trains(tmp_path: Path) -> None:
    proc = _run(tmp_path, '\nif __name__ == "__main__":\n    train()\n')
    assert proc.returncode == 0, proc.stderr
    assert "steps 4" in proc.stdout
