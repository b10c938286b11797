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


def _run(tmp_path: Path, tail: str, strategy: str = "ddp") -> subprocess.CompletedProcess[str]:
    script = tmp_path / "script.py"
    body = textwrap.dedent(BODY).replace('strategy="ddp"', f'strategy="{strategy}"')
    script.write_text(body + tail)
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=90)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_unguarded_script_is_named_before_launch(tmp_path: Path, strategy: str) -> None:
    proc = _run(tmp_path, "\ntrain()\n", strategy)
    assert proc.returncode != 0
    assert "PX116" in proc.stderr
    assert f'calls fit(strategy="{strategy}")' in proc.stderr
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


CLASSES = """
import time
import torch, phalanx as px
from torch import nn
from torch.utils.data import Dataset

def make_opt(p):
    return torch.optim.SGD(p, lr=0.1)

def step(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)

{top}

if __name__ == "__main__":
{guarded}
    started = time.monotonic()
    try:
        result = px.Learner({model}, make_opt, step).fit(
            Data(), batch_size=8, strategy="ddp", devices="cpu:0,cpu:1", sinks=[])
        print("steps", result.steps)
    except px.ConfigError as exc:
        print("refused", exc.code, round(time.monotonic() - started, 2))
        print(exc)
"""

DATA_CLASS = """class Data(Dataset):
    def __len__(self):
        return 32
    def __getitem__(self, i):
        return torch.full((4,), float(i)), i % 2
"""
MODEL_CLASS = """class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)
    def forward(self, x):
        return self.fc(x)
"""


def _indent(text: str) -> str:
    return textwrap.indent(text, "    ")


def _classes(
    tmp_path: Path, top: str, guarded: str, model: str
) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "port.py"
    script.write_text(CLASSES.format(top=top, guarded=guarded or "    pass", model=model))
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=90)


@pytest.mark.timeout(120)
def test_dataset_class_under_the_guard_is_refused_before_any_worker(tmp_path: Path) -> None:
    proc = _classes(tmp_path, MODEL_CLASS, _indent(DATA_CLASS), "Net")
    assert proc.returncode == 0, proc.stderr
    assert "refused PX119" in proc.stdout
    assert "the class Data" in proc.stdout and "port.py" in proc.stdout
    assert 'under `if __name__ == "__main__":`' in proc.stdout
    assert "without a report" not in proc.stdout + proc.stderr  # no worker died for it
    assert "Traceback" not in proc.stderr


@pytest.mark.timeout(120)
def test_model_class_under_the_guard_is_refused_before_any_worker(tmp_path: Path) -> None:
    proc = _classes(tmp_path, DATA_CLASS, _indent(MODEL_CLASS), "Net")
    assert proc.returncode == 0, proc.stderr
    assert "refused PX114" in proc.stdout
    assert "the class Net" in proc.stdout
    assert "Traceback" not in proc.stderr


@pytest.mark.timeout(120)
def test_classes_at_top_level_train(tmp_path: Path) -> None:
    """No false alarm: classes above the guard, and one in a top-level try/else block."""
    top = (
        DATA_CLASS
        + "\ntry:\n    import numpy\nexcept ImportError:\n    pass\nelse:\n"
        + _indent(MODEL_CLASS)
    )
    proc = _classes(tmp_path, top, "", "Net")
    assert proc.returncode == 0, proc.stderr
    assert "steps 4" in proc.stdout, proc.stdout


@pytest.mark.timeout(120)
def test_class_from_a_session_without_a_file_is_refused() -> None:
    """``python -c`` (as a notebook): nothing for the workers to re-import."""
    code = CLASSES.format(top=DATA_CLASS + MODEL_CLASS, guarded="    pass", model="Net")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr
    assert "refused PX114" in proc.stdout  # the model comes first
    assert "the class Net" in proc.stdout
    assert "no file the workers could import" in proc.stdout
    assert "in a .py module" in proc.stdout
