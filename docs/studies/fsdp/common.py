"""Shared helpers for the FSDP2 spike: process groups, meshes, models, spawning."""

from __future__ import annotations

import contextlib
import io
import os
import socket
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

torch.set_num_threads(1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_group(rank: int, ws: int, port: int):
    """The usual way: init_process_group + init_device_mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=ws,
        timeout=timedelta(seconds=60),
    )
    return init_device_mesh("cpu", (ws,))


def bare_group(rank: int, ws: int, port: int, prefix: str = "g0/"):
    """phalanx's way: no default group; a ProcessGroup built on a PrefixStore from its gloo
    backend (as phalanx.strategies.ddp.group.GenerationGroup.form does), then a DeviceMesh
    from it. Returns (mesh, pg, store)."""
    store = dist.TCPStore("127.0.0.1", port, ws, rank == 0, timeout=timedelta(seconds=60))
    scoped = dist.PrefixStore(prefix, store)
    gloo = dist.ProcessGroupGloo(dist.PrefixStore("cpu/", scoped), rank, ws, timedelta(seconds=60))
    pg = dist.ProcessGroup(scoped, rank, ws)
    pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
    return pg, store


def generation_group(rank: int, ws: int, store, gen: int, timeout: float = 30.0):
    """What phalanx could do per generation: torch's default group made with
    init_process_group on the generation's own store prefix (public API), and a 1-D cpu
    mesh over it. DeviceMesh needs the default group (it calls get_rank()), so the bare
    group above cannot back a mesh. Call dist.destroy_process_group() to leave."""
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(f"g{gen}/", store),
        rank=rank,
        world_size=ws,
        timeout=timedelta(seconds=timeout),
    )
    return init_device_mesh("cpu", (ws,))


def sum_reduction(model: nn.Module) -> None:
    """Make every FSDP unit's reduce-scatter a plain SUM (no division): both setters are
    per unit (not recursive), and set_gradient_divide_factor alone gives PREMUL_SUM, which
    gloo refuses."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)


def mlp(width: int = 32, depth: int = 4, seed: int = 0) -> nn.Module:
    """A small transformer-ish stack: blocks of LayerNorm + Linear-GELU-Linear residual."""
    torch.manual_seed(seed)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(width)
            self.up = nn.Linear(width, 2 * width)
            self.down = nn.Linear(2 * width, width)

        def forward(self, x):
            return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(7, width)  # odd sizes: uneven dim-0 shards
            self.blocks = nn.ModuleList(Block() for _ in range(depth))
            self.out = nn.Linear(width, 3)

        def forward(self, x):
            h = self.inp(x)
            for b in self.blocks:
                h = b(h)
            return self.out(h)

    return Net().double() if os.environ.get("SPIKE_F64") else Net()


def shard(model: nn.Module, mesh, **kw):
    from torch.distributed.fsdp import fully_shard

    for b in model.blocks:
        fully_shard(b, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


def data(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 7, generator=g)
    y = torch.randint(0, 3, (n,), generator=g)
    return x, y


def splits(n: int, ws: int, shares=None):
    """Uneven contiguous split of n samples among ws ranks."""
    if shares is None:
        base = [n // ws + (1 if i < n % ws else 0) for i in range(ws)]
        # make it deliberately uneven: move one sample from the last to the first
        if ws > 1 and base[-1] > 1:
            base[0] += 1
            base[-1] -= 1
        shares = base
    out, at = [], 0
    for s in shares:
        out.append((at, at + s))
        at += s
    assert at == n
    return out


def spawn(fn, ws: int, *args, timeout: float = 100.0):
    """Run fn(rank, ws, port, *args) in ws processes; return what each put in its queue."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    # args as bytes: a tensor handed to a spawned process through torch.multiprocessing is
    # moved into shared memory and SHARED with the child (an optimizer there that keeps a
    # given 'step' tensor would increment the parent's copy)
    buf = io.BytesIO()
    torch.save(args, buf)
    procs = [
        ctx.Process(target=_wrap, args=(fn, r, ws, port, q, buf.getvalue())) for r in range(ws)
    ]
    for p in procs:
        p.start()
    results, deadline = {}, time.monotonic() + timeout
    try:
        while len(results) < ws and time.monotonic() < deadline:
            try:
                r, val = q.get(timeout=0.5)
                results[r] = (
                    torch.load(io.BytesIO(val), weights_only=False)
                    if isinstance(val, bytes)
                    else val
                )
            except Exception:
                if any(p.exitcode not in (None, 0) for p in procs) and q.empty():
                    time.sleep(0.5)
                    if q.empty():
                        break
    finally:
        for p in procs:
            p.join(timeout=5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    if len(results) < ws:
        raise RuntimeError(
            f"only {sorted(results)} of {ws} ranks reported; exits {[p.exitcode for p in procs]}"
        )
    return [results[r] for r in range(ws)]


def _wrap(fn, rank, ws, port, q, args):
    torch.set_num_threads(1)
    try:
        args = torch.load(io.BytesIO(args), weights_only=False)
        out = fn(rank, ws, port, *args)
        buf = io.BytesIO()  # tensors through an mp.Queue need the sender alive: send bytes
        torch.save(out, buf)
        q.put((rank, buf.getvalue()))
    except BaseException as e:
        q.put((rank, {"error": f"{type(e).__name__}: {e}", "tb": traceback.format_exc()}))
    finally:
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
