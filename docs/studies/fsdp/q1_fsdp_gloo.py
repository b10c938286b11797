"""Q1: does FSDP2 (fully_shard on a 1-D cpu DeviceMesh over gloo) train in this torch?
Which collectives does it call, with which reduce op, and do they work on gloo?
Reductions: default (AVG); set_gradient_divide_factor(1.0) on every unit (PREMUL_SUM);
divide factor 1.0 + set_force_sum_reduction_for_comms(True) on every unit (SUM); the same
two setters on the root only. Meshes: init_process_group(init_method=tcp) +
init_device_mesh; init_process_group(store=PrefixStore("g<n>/")) (phalanx's per-generation
store); and phalanx's current bare ProcessGroup (no default group) -> DeviceMesh.from_group."""

import collections
import time

import torch
import torch.distributed as dist
from common import (
    bare_group,
    data,
    default_group,
    generation_group,
    mlp,
    shard,
    spawn,
    sum_reduction,
)

CALLS = collections.Counter()


def trace():
    for name in [
        "all_gather_single",
        "all_gather_into_tensor",
        "reduce_scatter_tensor",
        "reduce_scatter_single",
        "all_reduce",
        "broadcast",
        "all_gather",
        "barrier",
    ]:
        if not hasattr(dist, name):
            continue
        orig = getattr(dist, name)

        def wrapped(*a, _orig=orig, _name=name, **k):
            op = k.get("op")
            CALLS[_name + (f"[{str(op).split('.')[-1]}]" if op is not None else "")] += 1
            return _orig(*a, **k)

        setattr(dist, name, wrapped)


def run(rank, ws, port, how, variant):
    if how == "tcp":
        mesh = default_group(rank, ws, port)
    elif how == "store":
        store = dist.TCPStore("127.0.0.1", port, ws, rank == 0)
        mesh = generation_group(rank, ws, store, gen=0)
    else:
        from torch.distributed.device_mesh import DeviceMesh

        pg, store = bare_group(rank, ws, port)
        try:
            mesh = DeviceMesh.from_group(pg, "cpu")
        except Exception as e:
            first = f"DeviceMesh.from_group(bare group): {type(e).__name__}: {str(e)[:100]}"
            import torch.distributed.distributed_c10d as c10d

            pg._set_group_name("g0")  # register it in c10d's world (private) and retry
            c10d._register_pg_in_world(pg, "gloo", store, "g0", "gloo", {i: i for i in range(ws)})
            try:
                DeviceMesh.from_group(pg, "cpu")
                return {"error": first + "; after _register_pg_in_world: works"}
            except Exception as e2:
                return {
                    "error": first
                    + f"\n        after _register_pg_in_world: {type(e2).__name__}: {str(e2)[:100]}"
                }
    trace()
    model = shard(mlp(), mesh)
    if variant in ("sum", "premul"):
        sum_reduction(model) if variant == "sum" else [
            m.set_gradient_divide_factor(1.0)
            for m in model.modules()
            if hasattr(m, "set_gradient_divide_factor")
        ]
    if variant == "sum-root-only":
        model.set_gradient_divide_factor(1.0)
        model.set_force_sum_reduction_for_comms(True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = data(12)
    lo, hi = rank * 12 // ws, (rank + 1) * 12 // ws
    losses = []
    try:
        t = time.perf_counter()
        for _ in range(3):
            loss = torch.nn.functional.cross_entropy(model(x[lo:hi]), y[lo:hi])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(round(loss.item(), 5))
        ms = (time.perf_counter() - t) / 3 * 1e3
    except Exception as e:
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    p = next(model.parameters())
    return {
        "losses": losses,
        "calls": dict(CALLS),
        "ms": ms,
        "placements": str(p.placements),
        "local_shape": tuple(p.to_local().shape),
        "global_shape": tuple(p.shape),
        "grad_type": type(p.grad).__name__ if p.grad is not None else None,
    }


if __name__ == "__main__":
    print("torch", torch.__version__)
    for how, variant in [
        ("tcp", "avg"),
        ("tcp", "premul"),
        ("tcp", "sum-root-only"),
        ("tcp", "sum"),
        ("store", "sum"),
        ("bare", "sum"),
    ]:
        res = spawn(run, 2, how, variant)
        r0 = res[0]
        print(f"\n== mesh={how} reduction={variant}")
        for r, v in enumerate(res):
            if "error" in v:
                print(f"  rank{r} ERROR {v['error']}")
            else:
                print(
                    f"  rank{r} losses={v['losses']} param local={v['local_shape']} of "
                    f"{v['global_shape']} {v['placements']} ({v['ms']:.1f} ms/step)"
                )
        if "calls" in r0:
            print("  collectives on rank0 in 3 steps:", r0["calls"])
