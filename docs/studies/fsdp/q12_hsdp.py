"""Q12: HSDP replicas as the way to keep shards recoverable, beside FSDP's shard snapshots.

Four ranks (1 thread each, gloo, 2 shared cores), one model (16 x Linear(1024), 16.8 M
parameters), Adam, the same global batch of 64, three layouts:

- ``fsdp(4)``: ``fully_shard`` on a 1-D mesh of 4 (phalanx's fsdp);
- ``hsdp(2x2)``: a 2-D mesh (replicate 2, shard 2): each replica group of 2 holds every
  shard, so each shard is held twice (the other replica group's member of the same index);
- ``fsdp(2)`` of the same 64 rows on 2 ranks (what a replica group alone does).

Per rank: the bytes of parameters and Adam state it holds (``to_local()``), the mean step
time after 3 warm steps, and, for hsdp, what its recovery costs: the lost member's state is
sent whole by its peer of the same shard index in the other replica group (a gloo
send/recv of its parameters and Adam state), with no step computed again.
"""

import statistics
import time

import torch
import torch.distributed as dist
from common import generation_group, spawn, sum_reduction
from torch import nn
from torch.distributed.fsdp import fully_shard

WIDTH, LAYERS, BATCH, STEPS, WARM = 1024, 16, 64, 12, 3


def _local_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    total = 0
    for p in model.parameters():
        total += p.to_local().nbytes if hasattr(p, "to_local") else p.nbytes
    for values in opt.state.values():
        for v in values.values():
            if isinstance(v, torch.Tensor):
                total += v.to_local().nbytes if hasattr(v, "to_local") else v.nbytes
    return total


def run(rank, ws, port, layout):
    from torch.distributed.device_mesh import init_device_mesh

    store = dist.TCPStore("127.0.0.1", port, ws, rank == 0)
    mesh = generation_group(rank, ws, store, gen=0, timeout=300)
    if layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sum_reduction(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)
    rows = BATCH // ws
    stamps = []
    for _ in range(STEPS):
        part = slice(rank * rows, (rank + 1) * rows)
        loss = ((model(x[part]) - y[part]) ** 2).mean() * (rows / BATCH)
        loss.backward()
        opt.step()
        opt.zero_grad()
        dist.barrier()
        stamps.append(time.perf_counter())
    held = _local_bytes(model, opt)
    warm = stamps[WARM:]
    out = {"held": held, "step": (warm[-1] - warm[0]) / (len(warm) - 1)}
    if layout == "hsdp":
        # Recovery: rank 0 (replica 0, shard 0) is "lost"; its peer of the same shard index
        # (rank ws // 2: replica 1, shard 0) sends its parameters and Adam state to it.
        tensors = [p.to_local() for p in model.parameters()]
        tensors += [v.to_local() for s in opt.state.values() for v in s.values() if v.dim()]
        flat = torch.cat([t.reshape(-1) for t in tensors])
        dist.barrier()
        start = time.perf_counter()
        if rank == ws // 2:
            dist.send(flat, dst=0)
        elif rank == 0:
            got = torch.empty_like(flat)
            dist.recv(got, src=ws // 2)
            out["same"] = bool(torch.equal(got, flat))
        out["handover"] = time.perf_counter() - start
        out["handover_bytes"] = flat.nbytes
    dist.destroy_process_group()
    return out


def main():
    whole = LAYERS * (WIDTH * WIDTH + WIDTH) * 4 * 3  # params + Adam's two moments, float32
    print(f"model: {LAYERS} x Linear({WIDTH}), params + Adam = {whole / 2**20:.1f} MiB")
    rows = []
    for layout, ws in (("fsdp", 4), ("hsdp", 4), ("fsdp", 2)):
        results = spawn(run, ws, layout, timeout=600)
        errors = [r for r in results if "error" in r]
        if errors:
            print(layout, ws, errors[0]["tb"])
            continue
        held = results[0]["held"]
        step = statistics.median(r["step"] for r in results)
        rows.append((layout, ws, held, step, results))
    print("| layout | ranks | per rank: params + Adam | share of the whole | step (s) |")
    print("|---|---|---|---|---|")
    for layout, ws, held, step, _ in rows:
        name = "hsdp(2x2)" if layout == "hsdp" else f"fsdp({ws})"
        print(f"| {name} | {ws} | {held / 2**20:.1f} MiB | {held / whole:.3f} | {step:.3f} |")
    for layout, _, _, _, results in rows:
        if layout == "hsdp":
            r0 = results[0]
            print(
                f"hsdp recovery: rank 0's state ({r0['handover_bytes'] / 2**20:.1f} MiB) from "
                f"its replica peer in {r0['handover']:.3f} s (equal: {r0['same']}), 0 steps "
                "computed again"
            )


if __name__ == "__main__":
    main()
