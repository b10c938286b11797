"""Module-level (so picklable) pieces for tests/test_recovery.py.

Spawned ddp workers unpickle the model factory, optimizer factory, step function and dataset
by module name. pytest (rootdir-relative "prepend" import mode, no ``tests/__init__.py``) puts
``tests/`` on ``sys.path`` and spawn hands the parent's ``sys.path`` to each child, so workers
import this file as ``recovery_helpers`` too. Subprocess scripts get it through
``PYTHONPATH`` (see :func:`procs.child_env`).
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

STEP_SLEEP_S = 0.04  # keeps a run going long enough for a replacement to start and rejoin


TORCHRUN_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR")


def env_recording_slow_step(folder: str, model: nn.Module, batch: Any) -> torch.Tensor:
    """:func:`slow_step` that first writes what torchrun's variables say in this worker to
    ``<folder>/<pid>.json`` (the latest step's)."""
    seen = {k: os.environ.get(k) for k in TORCHRUN_KEYS}
    with open(os.path.join(folder, f"{os.getpid()}.json"), "w") as fh:
        json.dump(seen, fh)
    return slow_step(model, batch)


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


class _RaiseInBackward(torch.autograd.Function):
    """The identity on the loss, whose backward raises (once: ``marker`` is created then)."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, marker: str) -> torch.Tensor:
        ctx.marker = marker
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        if not os.path.exists(ctx.marker):
            open(ctx.marker, "w").close()
            raise RuntimeError("raised in backward before any gradient")
        return grad, None


def raise_in_backward_once(
    sample: torch.Tensor, marker: str, model: nn.Module, batch: Any
) -> torch.Tensor:
    """A step whose backward raises at its very first node (before any parameter's gradient,
    so before DDP reduces anything) when its batch holds the input row ``sample``, once."""
    x, _ = batch
    loss = mse_step(model, batch)
    if bool((x == sample).all(dim=1).any()):
        return _RaiseInBackward.apply(loss, marker)  # type: ignore[no-any-return]
    return loss


def slow_step(model: nn.Module, batch: Any) -> torch.Tensor:
    """A step that takes a while, without using the CPU (two cores for three workers)."""
    time.sleep(STEP_SLEEP_S)
    return mse_step(model, batch)


class DeadlySample(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """``make_data(n)``, except that reading sample ``bad`` in a worker process kills that
    process (``how="kill"``: SIGKILL, as a segfaulting decoder or the OOM killer would) or
    hangs it (``how="hang"``), or raises the same error each time (``how="raise"``: a bad
    sample). In the process that built it (the test), it reads normally."""

    def __init__(self, n: int, bad: int, how: str = "kill") -> None:
        self.data = make_data(n)
        self.bad, self.how = bad, how
        self.owner = os.getpid()

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if i == self.bad and os.getpid() != self.owner:
            if self.how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if self.how == "raise":
                raise ValueError(f"sample {i} is corrupt")
            while True:
                time.sleep(1)
        return self.data[i]


class OneOffKills(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """``make_data(n)``, except that the first read of each sample in ``kills`` (in any
    worker process) SIGKILLs the reader: a one-off fault (a marker file in ``markers``
    makes it once per run across processes), so whoever reads it again reads it fine."""

    def __init__(self, n: int, kills: list[int], markers: str) -> None:
        self.data = make_data(n)
        self.kills, self.markers = set(kills), markers
        self.owner = os.getpid()

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if i in self.kills and os.getpid() != self.owner:
            try:
                os.close(os.open(os.path.join(self.markers, f"fired-{i}"), os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                return self.data[i]
            os.kill(os.getpid(), signal.SIGKILL)
        return self.data[i]


def linear_except_in_a_replacement() -> nn.Module:
    """The model factory fails in a replacement process (the device that just lost a
    worker is in a bad state, say): a replacement that cannot even build its model."""
    import multiprocessing

    if multiprocessing.current_process().name.endswith("-replacement"):
        raise RuntimeError("CUDA error: an illegal memory access was encountered (simulated)")
    return linear()


def linear_slow_in_a_replacement() -> nn.Module:
    """The model factory takes a second in a replacement process (a cold device, say)."""
    import multiprocessing

    if multiprocessing.current_process().name.endswith("-replacement"):
        time.sleep(1.0)
    return linear()


def nan_loss_on_rank_1_at_step_3(model: nn.Module, batch: Any) -> torch.Tensor:
    """The MSE step, except that the loss is NaN in worker 1 (rank 1 of the first
    generation) at the fourth optimizer step. Calls are counted per replica; the first one
    is the worker's preflight, on the same replica."""
    import multiprocessing

    loss = mse_step(model, batch)
    calls = getattr(model, "phalanx_calls", 0)
    model.phalanx_calls = calls + 1
    worker_1 = multiprocessing.current_process().name.startswith("phalanx-worker-1")
    return loss * float("nan") if worker_1 and calls == 1 + 3 else loss


class SecondReadFails(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """``make_data(n)``, except that the second time any worker process reads sample ``bad``
    it raises a one-off ``RuntimeError`` (a flaky read: every other read of it succeeds).
    The reads are counted across processes with marker files in ``markers``: the first
    reader (the worker that holds the sample in the step's first attempt) reads it fine,
    whoever reads it next (another worker, in the retry's new split) fails once."""

    def __init__(self, n: int, bad: int, markers: str) -> None:
        self.data = make_data(n)
        self.bad, self.markers = bad, markers
        self.owner = os.getpid()

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if i == self.bad and os.getpid() != self.owner:
            for name in ("first-read", "second-read"):
                try:
                    os.close(os.open(os.path.join(self.markers, name), os.O_CREAT | os.O_EXCL))
                except FileExistsError:
                    continue
                if name == "second-read":
                    raise RuntimeError(f"flaky read of sample {i} (a one-off)")
                break
        return self.data[i]
