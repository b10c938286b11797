"""Module-level parts for the fsdp tests (worker processes unpickle them)."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.utils.data import TensorDataset


class Block(nn.Module):
    """A residual block: LayerNorm, then Linear-GELU-Linear (a transformer's MLP half)."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    """Odd sizes (7 inputs, 3 outputs): some dim-0 shards are uneven or empty."""

    def __init__(self, depth: int = 3, width: int = 32, outputs: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(7, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.out = nn.Linear(width, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def net() -> nn.Module:
    return Net()


class UnusedHeadNet(Net):
    """:class:`Net` with a head no forward calls, registered last (a unit, under
    ``shard=(nn.Linear, Block)``: the one that would carry the vote's box)."""

    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Linear(32, 5)


def unused_head_net() -> nn.Module:
    return UnusedHeadNet()


def wide_net() -> nn.Module:
    """Each block's weights 512 KiB: a snapshot's shards (of 3 members) large enough to be
    read mapped."""
    return Net(width=256)


BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
FP16 = MixedPrecisionPolicy(param_dtype=torch.float16)

adam = functools.partial(torch.optim.Adam, lr=1e-3)
sgd = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9)


def step(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def data(n: int, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 7, generator=g), torch.randint(0, 3, (n,), generator=g))


class NormNet(nn.Module):
    """With a BatchNorm1d: a batch of one row fails in training mode (the zero pass's
    template must not be one row), and its running statistics are buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(7, 32)
        self.norm = nn.BatchNorm1d(32)
        self.out = nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(nn.functional.relu(self.norm(self.inp(x))))


def norm_net() -> nn.Module:
    return NormNet()


def head() -> nn.Module:
    """One unit (the root): weight [4, 7] and bias [4] split 2/2 rows over two members."""
    return nn.Linear(7, 4)


def last_output_step(model: nn.Module, batch: Any) -> torch.Tensor:
    """Outputs 3 and 0 reach the loss: under "16-mixed" output 3's fp16 gradient (65536 x
    64 / 12 a row) overflows at the default scale, output 0's does not, so only the member
    holding rows 2-3 sees an inf (and the other one a gradient it must not step with)."""
    x, _ = batch
    out = model(x).float()
    return (out[:, 3] * 64.0 + out[:, 0]).mean()


def bf16_step(model: nn.Module, batch: Any) -> torch.Tensor:
    """:func:`step`, failing unless the model computed in bfloat16 (an ``mp_policy``'s
    units: the output layer's too)."""
    x, y = batch
    logits = model(x)
    if logits.dtype != torch.bfloat16:
        raise TypeError(f"the model computed in {logits.dtype}, not in torch.bfloat16")
    return nn.functional.cross_entropy(logits.float(), y)


def load_dcp_sharded(rank: int, port: int, folder: str, out: str) -> None:
    """Rank ``rank`` of 2 (gloo): a Net sharded with ``fully_shard`` per block and at the
    root, filled by ``dcp.load`` from ``folder``; writes its shards to ``out/rank-<r>.pt``."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        model = Net()
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        state = {"model": model.state_dict()}
        dcp.load(state, checkpoint_id=folder)
        model.load_state_dict(state["model"])
        mine = {k: v.to_local().clone() for k, v in model.state_dict().items()}
        torch.save(mine, f"{out}/rank-{rank}.pt")
    finally:
        dist.destroy_process_group()


def losing_step(model: nn.Module, batch: Any, agent: int, marker: str) -> torch.Tensor:
    """:func:`step`, but once in a run (``marker``: a file it makes), rank 1 of its group at
    its process's 12th call removes its slot's shard snapshots from the shared memory folder
    of the run's agent (the process ``agent``) and kills itself: a member lost with every
    snapshot of its shards the coordinator heard of, so the set it counts is gone."""
    import glob
    import os
    import shutil
    import signal

    import torch.distributed as dist

    global _calls
    _calls += 1
    if _calls == 12 and dist.get_rank() == 1:
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return step(model, batch)
        for folder in glob.glob(f"/dev/shm/phalanx-snap-{agent}-*/slot-1"):
            shutil.rmtree(folder)
        os.kill(os.getpid(), signal.SIGKILL)
    return step(model, batch)


_calls = 0  # (losing_step's, in this process)


class Recorded(Net):
    """:class:`Net` whose constructor appends the device it builds on to ``path``."""

    def __init__(self, path: str) -> None:
        super().__init__()
        with open(path, "a") as out:
            out.write(f"{self.inp.weight.device.type}\n")


class Cached(Net):
    """:class:`Net` with a non-persistent buffer its constructor computes (no state holds it)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.arange(4.0), persistent=False)


class Tied(Net):
    """:class:`Net` with a layer ``back`` whose weight is ``out``'s (one parameter, two
    names)."""

    def __init__(self) -> None:
        super().__init__()
        self.back = nn.Linear(32, 3, bias=False)
        self.back.weight = self.out.weight
