"""Q4: the vote under FSDP2. A member gets only its shard of a reduce-scattered tensor, so
the ddp 'box' trick needs a twist: a box parameter of shape [ws, L] (Shard(0): one row per
member) in the root unit; each member's box gradient is its ballot repeated in every row,
so after the SUM reduce-scatter every member's own row holds the sum of all ballots.
Ballot values are integers < 2**16 in float32 (phalanx's 16-bit pieces): sums are exact.
Measured on 2 ranks (gloo), median per-step wall over interleaved rounds:
  base   : no vote
  sync   : dist.all_reduce of 16 float64 after the backward
  async  : the same all_reduce started before the backward, waited after it
  box    : the ballot rides in the root unit's reduce-scatter (no collective of its own)
Also: the zero pass (a member whose data failed runs forward/backward on an empty batch) and
what happens when a member's forward raises after some units have all-gathered."""

import contextlib
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import data, generation_group, mlp, spawn, sum_reduction
from torch import nn
from torch.distributed.fsdp import fully_shard

L = 16  # ballot floats


class Ballot(nn.Module):
    def __init__(self, net, ws):
        super().__init__()
        self.net = net
        self.box = nn.Parameter(torch.zeros(ws, L))  # never given to the optimizer

    def forward(self, x):
        return self.net(x), self.box * 1.0  # not a view: FSDP hooks views badly


def build(mesh, ws, width, depth):
    net = mlp(width=width, depth=depth)
    model = Ballot(net, ws)
    for b in net.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)  # root unit: net.inp, net.out and the box
    sum_reduction(model)
    return model, net


def timing(rank, ws, port, width, depth, per_rank, rounds, steps):  # noqa: C901 (a study)
    store = dist.TCPStore("127.0.0.1", port, ws, rank == 0)
    mesh = generation_group(rank, ws, store, gen=0)
    pg = dist.group.WORLD
    model, net = build(mesh, ws, width, depth)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    x, y = data(per_rank * ws, seed=5)
    x, y = x[rank * per_rank : (rank + 1) * per_rank], y[rank * per_rank : (rank + 1) * per_rank]
    gen = torch.Generator().manual_seed(100 + rank)
    times = {v: [] for v in ("base", "sync", "async", "box")}
    exact = True
    n_params = sum(p.numel() for p in net.parameters())

    def step(variant):
        ballot = torch.randint(0, 2**16, (L,), generator=gen).float()
        out, boxflat = model(x)
        loss = F.cross_entropy(out, y, reduction="sum") / (per_rank * ws)
        work = vec = None
        if variant == "async":
            vec = ballot.double()
            work = dist.all_reduce(vec, group=pg, async_op=True)
        if variant == "box":
            torch.autograd.backward([loss, boxflat], [torch.ones(()), ballot.repeat(ws, 1)])
        else:
            (loss + 0 * boxflat.sum()).backward()  # box in the graph in every variant
        if variant == "sync":
            vec = ballot.double()
            dist.all_reduce(vec, group=pg)
        if variant == "async":
            work.wait()
        if variant == "box":
            vec = model.box.grad.to_local()[0].double()
        opt.step()
        opt.zero_grad()
        model.box.grad = None
        return ballot, vec

    for _ in range(3):
        step("box")  # warm-up
    for _r in range(rounds):
        for v in times:
            for _ in range(steps):
                t = time.perf_counter()
                ballot, vec = step(v)
                times[v].append(time.perf_counter() - t)
                if vec is not None:  # exactness: gather every member's ballot and compare
                    allb = [torch.zeros(L) for _ in range(ws)]
                    dist.all_gather(allb, ballot, group=pg)
                    exact &= torch.equal(vec, torch.stack(allb).double().sum(0))
    # the bare collective, back to back
    vec, bare = torch.zeros(L, dtype=torch.float64), []
    for _ in range(200):
        t = time.perf_counter()
        dist.all_reduce(vec, group=pg)
        bare.append(time.perf_counter() - t)
    return {
        "median_ms": {v: statistics.median(t) * 1e3 for v, t in times.items()},
        "bare_ms": statistics.median(bare) * 1e3,
        "exact": exact,
        "params": n_params,
    }


def zero_pass(rank, ws, port, mode):
    """Rank 1 fails; rank 0 trains normally. mode 'data': rank 1 fails before its forward
    and runs the zero pass (empty batch). mode 'mid-forward': rank 1 raises inside block 2's
    forward (units inp/block0/block1 already all-gathered), then tries the zero pass."""
    store = dist.TCPStore("127.0.0.1", port, ws, rank == 0)
    mesh = generation_group(rank, ws, store, gen=0, timeout=8.0)
    model, net = build(mesh, ws, 32, 4)
    x, y = data(8, seed=5)
    t = time.perf_counter()
    try:
        if rank == 1 and mode == "mid-forward":

            def boom(*_):
                raise RuntimeError("user error inside forward")

            h = net.blocks[2].register_forward_pre_hook(boom)
            with contextlib.suppress(RuntimeError):
                model(x[4:])
            h.remove()
        if rank == 1:  # zero pass: every unit's all-gather and reduce-scatter, no samples
            out, boxflat = model(x[:0])
            (F.cross_entropy(out, y[:0], reduction="sum") + 0 * boxflat.sum()).backward()
        else:
            out, boxflat = model(x[:4])
            (F.cross_entropy(out, y[:4], reduction="sum") + 0 * boxflat.sum()).backward()
        g = net.out.weight.grad.to_local()
        return {"ok": True, "s": time.perf_counter() - t, "grad_norm": float(g.norm())}
    except Exception as e:
        return {
            "ok": False,
            "s": time.perf_counter() - t,
            "error": f"{type(e).__name__}: {str(e).splitlines()[0][:150]}",
        }


if __name__ == "__main__":
    for width, depth, per_rank in [(32, 4, 8), (256, 4, 32)]:
        res = spawn(timing, 2, width, depth, per_rank, 5, 20)
        m, b = res[0]["median_ms"], res[0]["bare_ms"]
        print(
            f"model {res[0]['params']} params (width {width}, {depth} blocks), {per_rank} samples/rank, 2 ranks:"
        )
        for v in m:
            print(
                f"  {v:5s}: {m[v]:7.2f} ms/step (rank0)  {res[1]['median_ms'][v]:7.2f} (rank1)  "
                f"delta vs base {m[v] - m['base']:+.2f} ms"
            )
        print(
            f"  bare all_reduce(16 float64) back to back: {b:.3f} ms; ballots exact: "
            f"{all(r['exact'] for r in res)}",
            flush=True,
        )
    for mode in ("data", "mid-forward"):
        res = spawn(zero_pass, 2, mode)
        print(
            f"zero pass after a failure in {mode}:",
            [
                (f"rank{r}", v["ok"], f"{v['s']:.2f}s", v.get("error", ""))
                for r, v in enumerate(res)
            ],
        )
