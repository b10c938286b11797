"""Module-level (so picklable) pieces for tests/test_recovery.py.

Spawned ddp workers unpickle the model factory, optimizer factory, step function and dataset
by module name. pytest (rootdir-relative "prepend" import mode, no ``tests/__init__.py``) puts
``tests/`` on ``sys.path`` and spawn hands the parent's ``sys.path`` to each child, so workers
import this file as ``recovery_helpers`` too. Subprocess scripts get it through
``PYTHONPATH`` (see :func:`child_env`).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

TESTS_DIR = Path(__file__).resolve().parent

STEP_SLEEP_S = 0.04  # keeps a run going long enough for a replacement to start and rejoin


def make_data(n: int, seed: int = 0) -> TensorDataset:
    """A noisy linear regression: the weights keep moving for the whole (short) run."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=gen)
    w = torch.linspace(-1.0, 1.0, 8).unsqueeze(1)
    y = x @ w + 0.3 * torch.randn(n, 1, generator=gen) + 0.5
    return TensorDataset(x, y)


def linear() -> nn.Module:
    return nn.Linear(8, 1)


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.003, momentum=0.5)


def mse_step(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def slow_step(model: nn.Module, batch: Any) -> torch.Tensor:
    """A step that takes a while, without using the CPU (two cores for three workers)."""
    time.sleep(STEP_SLEEP_S)
    return mse_step(model, batch)


# -- processes ----------------------------------------------------------------------------


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, ppid) of ``pid``, or None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # the name may contain spaces
    return fields[0], int(fields[1])


def children(pid: int) -> dict[int, str]:
    """The direct children of ``pid`` (scanning /proc), as {pid: state letter}."""
    found: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            info = proc_stat(int(entry))
            if info is not None and info[1] == pid:
                found[int(entry)] = info[0]
    return found


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def is_resource_tracker(pid: int) -> bool:
    """multiprocessing's resource tracker lives as long as the process that started it."""
    return "resource_tracker" in cmdline(pid)


def alive(pid: int) -> bool:
    info = proc_stat(pid)
    return info is not None and info[0] != "Z"


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS_DIR), env.get("PYTHONPATH", "")) if p)
    return env
