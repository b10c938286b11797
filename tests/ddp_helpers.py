"""Module-level (so picklable) pieces for tests/test_ddp.py.

Spawned ddp workers unpickle the model factory, optimizer factory, step function and datasets
by module name. pytest (rootdir-relative "prepend" import mode, no ``tests/__init__.py``) puts
``tests/`` on ``sys.path``, and spawn hands the parent's ``sys.path`` to each child, so
workers import this file as ``ddp_helpers`` too. Subprocess scripts get it through
``PYTHONPATH`` (see :func:`procs.child_env`).
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

from phalanx.events import Event, StepEnded
from phalanx.strategies.ddp.worker import worker


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


def exit_on_sample(sample: torch.Tensor, code: int, model: nn.Module, batch: Any) -> torch.Tensor:
    """A step whose process exits with ``code`` (``os._exit``: no exception, no signal, as a
    native library calling ``exit()`` would) when its batch holds the input row ``sample``:
    bound with functools.partial to a sample of one worker's share at one step, it ends
    that worker there and nowhere else."""
    x, _ = batch
    if bool((x == sample).all(dim=1).any()):
        os._exit(code)
    return mse_step(model, batch)


def slow_step(model: nn.Module, batch: Any) -> torch.Tensor:
    """A step that takes a while: keeps a run going long enough to kill its supervisor."""
    time.sleep(0.2)
    return mse_step(model, batch)


SLOW_SETUP_S = 3.0


def slow_mlp() -> nn.Module:
    """A model factory that takes a few seconds (downloading weights, building a big model)."""
    time.sleep(SLOW_SETUP_S)
    return mlp()


class FlakyData(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """A dataset whose sample ``bad`` raises the first ``failures`` times it is read, and
    which records every index it served (per process)."""

    def __init__(self, n: int, bad: int, failures: int = 1) -> None:
        self.data = make_data(n)
        self.bad, self.failures = bad, failures
        self.served: list[int] = []

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if i == self.bad and self.failures > 0:
            self.failures -= 1
            raise OSError(f"transient read error on sample {i}")
        self.served.append(i)
        return self.data[i]


def bn_mlp() -> nn.Module:
    """An MLP with a BatchNorm layer: a model with buffers."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))


def sgd_decaying(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05)


def decay(optimizer: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda_step)


def lambda_step(step: int) -> float:
    return 1.0 / (1.0 + step)


def sgd_unsavable(params: Any) -> torch.optim.Optimizer:
    """An optimizer whose state cannot be pickled: every checkpoint write fails."""
    optimizer = sgd(params)
    optimizer.param_groups[0]["callback"] = _local_callback()
    return optimizer


def _local_callback() -> Any:
    def callback() -> None:  # a nested function: pickle cannot save it
        return None

    return callback


def wrong_shape_step(model: nn.Module, batch: Any) -> torch.Tensor:
    """A shape bug: the model takes 8 features, the step feeds it 9."""
    x, y = batch
    x = torch.cat([x, x[:, :1]], dim=1)
    return nn.functional.mse_loss(model(x), y)


def model_needing_a_missing_package() -> nn.Module:
    """A model factory that imports what the worker's environment lacks."""
    import phalanx_no_such_package  # type: ignore[import-not-found]  # noqa: F401

    return mlp()


def flagged_data(n: int, flagged: int) -> TensorDataset:
    """``make_data(n)`` with a third column that marks sample ``flagged``."""
    x, y = make_data(n).tensors
    flag = torch.zeros(n, dtype=torch.bool)
    flag[flagged] = True
    return TensorDataset(x, y, flag)


def exit_on_flag_step(model: nn.Module, batch: Any) -> torch.Tensor:
    """Calls ``sys.exit(0)`` in worker 1 when its share holds the flagged sample (see
    :func:`flagged_data`): SystemExit passes every ``except Exception``."""
    x, y, flag = batch
    if flag.any() and multiprocessing.current_process().name.startswith("phalanx-worker-1"):
        sys.exit(0)
    return nn.functional.mse_loss(model(x), y)


def segfault_on_flag_step(model: nn.Module, batch: Any) -> torch.Tensor:
    """Reads address 0 (SIGSEGV: a crash in native code, as a broken extension's) in worker 1
    when its share holds the flagged sample (see :func:`flagged_data`)."""
    import ctypes

    x, y, flag = batch
    if flag.any() and multiprocessing.current_process().name.startswith("phalanx-worker-1"):
        ctypes.string_at(0)
    return nn.functional.mse_loss(model(x), y)


def mlp_exiting_in_worker_1() -> nn.Module:
    """A model factory that calls ``sys.exit(0)`` in worker 1's process (outside any step)."""
    if multiprocessing.current_process().name.startswith("phalanx-worker-1"):
        sys.exit(0)
    return mlp()


def dump_stacks_twice_target(stack_file: str, ready: str, switch: str, moved: str) -> None:
    """A process that listens for stack dumps as a ddp worker does (``ready`` says it
    does), waits in :func:`waiting_before_the_switch` until ``switch`` exists, then in
    :func:`waiting_after_the_switch` (``moved`` says it got there) until it is killed."""
    worker.listen_for_stack_dumps(stack_file)
    with open(ready, "w"):
        pass
    waiting_before_the_switch(switch)
    with open(moved, "w"):
        pass
    waiting_after_the_switch()


def waiting_before_the_switch(switch: str) -> None:
    while not os.path.exists(switch):
        time.sleep(0.01)


def waiting_after_the_switch() -> None:
    while True:
        time.sleep(0.01)


class StepTimes:
    """A sink keeping when each committed step ended (the event's own time, set in rank 0)."""

    def __init__(self) -> None:
        self.ended: dict[int, float] = {}

    def handle(self, event: Event) -> None:
        if isinstance(event, StepEnded):
            self.ended[event.global_step] = event.time

    def close(self) -> None:
        pass


BUG_STEP = 2


def mlp_with_a_phalanx_bug_in_worker_1(marker: str) -> nn.Module:
    """A model factory that, in worker 1's process only, breaks phalanx's own loop: from
    step ``BUG_STEP`` on, the loop's per-step seed raises (as a bug in phalanx's code
    outside the user's step would), after writing when it first did to ``marker``."""
    if multiprocessing.current_process().name.startswith("phalanx-worker-1"):
        import phalanx.loop

        original = phalanx.loop.step_seed

        def buggy_step_seed(seed: int, global_step: int, rank: int) -> int:
            if global_step >= BUG_STEP:
                if not os.path.exists(marker):
                    with open(marker, "w") as fh:
                        fh.write(repr(time.time()))
                raise KeyError("an injected bug in phalanx's loop")
            return original(seed, global_step, rank)

        phalanx.loop.step_seed = buggy_step_seed
    return mlp()


def counting_bn_mlp(calls: str) -> nn.Module:
    """:func:`bn_mlp` that appends its process's name and pid to ``calls`` at each call."""
    with open(calls, "a") as fh:
        fh.write(f"{multiprocessing.current_process().name} {os.getpid()}\n")
    return bn_mlp()


def say_steps_then_exit(args: tuple[Any, int]) -> None:
    """An agent's process (``args``: its Outbox and a count): Ready, then that many step
    events at once (within one ring interval: they ring once at most), then it lingers a
    moment and exits."""
    from phalanx.events import StepEnded
    from phalanx.strategies.ddp.wire.protocol import Ready, Relay

    outbox, n = args
    outbox.send(Ready(0))
    for step in range(1, n + 1):
        outbox.send(Relay(StepEnded(0, step - 1, step, n, 0.5, 0.1, 4, 1.0)))
    time.sleep(0.5)
    outbox.close()


def ranks_step(model: nn.Module, batch: Any, folder: str) -> torch.Tensor:
    """mse, after writing what px.rank()/px.world_size()/px.is_main() say in this member."""
    import phalanx as px

    with open(os.path.join(folder, f"step-{os.getpid()}-{threading_id()}.txt"), "a") as fh:
        fh.write(f"{px.rank()} {px.world_size()} {int(px.is_main())}\n")
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def threading_id() -> int:
    import threading

    return threading.get_ident()


def ranks_model(folder: str) -> nn.Module:
    """mlp(), after writing what px.rank()/px.world_size() say in the model factory."""
    import phalanx as px

    with open(os.path.join(folder, f"model-{os.getpid()}-{threading_id()}.txt"), "a") as fh:
        fh.write(f"{px.rank()} {px.world_size()}\n")
    return mlp()


def torch_rank_step(model: nn.Module, batch: Any) -> torch.Tensor:
    """A ported DDP script's step: asks torch for its rank."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        pass
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def slow_rank_step(model: nn.Module, batch: Any, rank: int, per_sample: float) -> torch.Tensor:
    """mse; the member at ``rank`` sleeps ``per_sample`` seconds per sample first (a slower
    device, as the balance bench injects it)."""
    import phalanx as px

    x, y = batch
    if px.rank() == rank:
        time.sleep(per_sample * len(x))
    return nn.functional.mse_loss(model(x), y)


class BadSamples(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """``make_data(n)`` with each sample's index: ``(x, y, index)``. Reading a sample in
    ``raise_at`` raises (a corrupt record); a sample in ``nan_at`` has NaN features (its loss
    is NaN)."""

    def __init__(
        self,
        n: int,
        raise_at: tuple[int, ...] = (),
        nan_at: tuple[int, ...] = (),
        say_index: bool = True,
    ):
        self.data = make_data(n)
        self.raise_at, self.nan_at = set(raise_at), set(nan_at)
        self.say_index = say_index  # False: the error does not name the record

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        if i in self.raise_at:
            raise ValueError(f"corrupt record {i}" if self.say_index else "corrupt record")
        x, y = self.data[i]
        if i in self.nan_at:
            x = torch.full_like(x, float("nan"))
        return x, y, i


def indexed_step(model: nn.Module, batch: Any, drop: tuple[int, ...] = ()) -> torch.Tensor:
    """mse over the batch's rows, without the samples in ``drop`` (the reference of a run
    that leaves them out)."""
    x, y, index = batch
    if drop:
        keep = ~torch.isin(index, torch.tensor(drop))
        x, y = x[keep], y[keep]
    return nn.functional.mse_loss(model(x), y)


_CALLS = [0]  # (this process's calls of broken_worker_step)


def broken_worker_step(model: nn.Module, batch: Any, folder: str) -> torch.Tensor:
    """``indexed_step``; the first process that runs as rank 1 claims ``folder/broken`` and
    raises on every step from its third call on (preflight and two steps pass): a worker at
    fault, not the data. Its replacement (another process) is healthy."""
    import phalanx as px

    _CALLS[0] += 1
    marker = os.path.join(folder, "broken")
    if px.rank() == 1 and not os.path.exists(marker):
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            os.write(fd, str(os.getpid()).encode())
            os.close(fd)
        except FileExistsError:
            pass
    claimed = ""
    if os.path.exists(marker):
        with open(marker) as fh:
            claimed = fh.read()
    if _CALLS[0] > 3 and claimed == str(os.getpid()):
        raise RuntimeError("this worker's device is broken")
    return indexed_step(model, batch)
