"""Module-level (so picklable) pieces for tests/test_ddp.py.

Spawned ddp workers unpickle the model factory, optimizer factory, step function and datasets
by module name. pytest (rootdir-relative "prepend" import mode, no ``tests/__init__.py``) puts
``tests/`` on ``sys.path``, and spawn hands the parent's ``sys.path`` to each child, so
workers import this file as ``ddp_helpers`` too. Subprocess scripts get it through
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


def make_data(n: int, seed: int = 0) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=gen)
    y = (x[:, :3].sum(dim=1, keepdim=True) - x[:, 3:4] * x[:, 4:5]).tanh()
    return TensorDataset(x, y)


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def mse_step(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def slow_step(model: nn.Module, batch: Any) -> torch.Tensor:
    """A step that takes a while: keeps a run going long enough to kill its supervisor."""
    time.sleep(0.2)
    return mse_step(model, batch)


SLOW_SETUP_S = 3.0


def slow_mlp() -> nn.Module:
    """A model factory that takes a few seconds (downloading weights, building a big model)."""
    time.sleep(SLOW_SETUP_S)
    return mlp()


# -- processes ----------------------------------------------------------------------------


def children(pid: int) -> dict[int, str]:
    """The direct children of ``pid`` (scanning /proc: psutil is not a dependency), as
    {pid: state letter}; a zombie ("Z") has exited but was not reaped."""
    found: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        info = proc_stat(int(entry))
        if info is not None and info[1] == pid:
            found[int(entry)] = info[0]
    return found


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, ppid) of ``pid``, or None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # the name may contain spaces
    return fields[0], int(fields[1])


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def is_resource_tracker(pid: int) -> bool:
    """multiprocessing's resource tracker: started once per process by the first spawn and
    kept for the process's lifetime by design (not a leaked worker)."""
    return "resource_tracker" in cmdline(pid)


def alive(pid: int) -> bool:
    info = proc_stat(pid)
    return info is not None and info[0] != "Z"


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS_DIR), env.get("PYTHONPATH", "")) if p)
    return env
