"""Q2: exactness of FSDP2 against one process on the full batch, and against DDP.
Global batch B=12 per step split unevenly (ws=2: 7/5, ws=3: 5/4/3); each rank's loss is
sum-of-sample-losses / B, so the summed gradient is the global mean. Reductions: 'sum'
(divide factor 1 + force sum on every unit) and 'avg' (default AVG, loss multiplied by ws).
Optimizers: SGD(momentum) and Adam (torch defaults, lr 1e-3, as phalanx's tests), 6 steps.
DDP (gloo, same splits, loss * ws since DDP averages) is the yardstick: FSDP should be as
close to one process as DDP is. Metric as phalanx's tests: max over tensors of
max|a-b| / max|b|."""

import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import data, generation_group, mlp, rel, shard, spawn, sum_reduction

B, STEPS = 12, 6
SHARES = {1: [12], 2: [7, 5], 3: [5, 4, 3]}


def make_opt(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.Adam(params, lr=float(os.environ.get("SPIKE_ADAM_LR", "1e-3")))


def train(model, opt, rank, ws, scale, clip=0.0, accum=1, fsdp=False):
    x_all, y_all = data(B * STEPS, seed=3)
    lo, n = sum(SHARES[ws][:rank]), SHARES[ws][rank]
    norms = []
    for s in range(STEPS):
        x, y = x_all[s * B + lo : s * B + lo + n], y_all[s * B + lo : s * B + lo + n]
        parts = [(x, y)] if accum == 1 else [(x[: n // 2], y[: n // 2]), (x[n // 2 :], y[n // 2 :])]
        for i, (xm, ym) in enumerate(parts):
            if fsdp:  # accumulation: no reduce-scatter but on the last micro-batch
                model.set_requires_gradient_sync(i == len(parts) - 1)
            (F.cross_entropy(model(xm), ym, reduction="sum") / B * scale).backward()
        if clip:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        opt.step()
        opt.zero_grad()
    return norms


def worker(rank, ws, port, opt_kind, mode, clip=0.0, accum=1):
    store = dist.TCPStore("127.0.0.1", port, ws, rank == 0)
    mesh = generation_group(rank, ws, store, gen=0)
    if mode == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(mlp())
    else:
        model = shard(mlp(), mesh)
        if mode == "sum":
            sum_reduction(model)
    opt = make_opt(opt_kind, model.parameters())
    scale = 1.0 if mode == "sum" else ws
    t = time.perf_counter()
    norms = train(model, opt, rank, ws, scale, clip, accum, fsdp=mode != "ddp")
    ms = (time.perf_counter() - t) / STEPS * 1e3
    if mode == "ddp":
        full = {k.removeprefix("module."): v for k, v in model.state_dict().items()}
    else:
        full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    return {"state": full if rank == 0 else None, "norms": norms, "ms": ms}


def reference(opt_kind, clip=0.0, accum=1):
    model = mlp()
    opt = make_opt(opt_kind, model.parameters())
    norms = train(model, opt, 0, 1, 1.0, clip, accum)
    return model.state_dict(), norms


def compare(state, ref):
    diffs = {k: rel(state[k], ref[k]) for k in ref}
    k = max(diffs, key=diffs.get)
    return diffs[k], k


if __name__ == "__main__":
    worst = {}
    for opt_kind in ("sgd", "adam"):
        ref, _ = reference(opt_kind)
        init = mlp().state_dict()
        moved = max(rel(ref[k], init[k]) for k in ref if init[k].abs().max() > 0)
        print(
            f"{opt_kind}: {STEPS} steps move the weights by up to {moved:.1e} (rel; a diff "
            f"below that says the runs agree, not that nothing moved)"
        )
        for mode, sizes in [("sum", (1, 2, 3)), ("avg", (2, 3)), ("ddp", (2, 3))]:
            if opt_kind == "sgd" and mode == "avg":
                continue
            for ws in sizes:
                res = spawn(worker, ws, opt_kind, mode)
                if any("error" in r for r in res):
                    print(opt_kind, mode, ws, [r.get("error") for r in res])
                    continue
                d, k = compare(res[0]["state"], ref)
                worst[mode] = max(worst.get(mode, 0.0), d)
                name = "fsdp " + mode if mode != "ddp" else "ddp     "
                print(
                    f"  {name} ws={ws} shares={SHARES[ws]}: max rel diff vs 1 process "
                    f"{d:.2e} (worst tensor {k})",
                    flush=True,
                )
    print("WORST per mode:", {m: f"{v:.2e}" for m, v in worst.items()}, "(goal <= 1e-5)")
