"""Q5: state out of and into a sharded model.
A. ws=3, Adam, 4 steps (uneven batch split). Rank 0 takes the full model and optimizer state
   on CPU with get_model_state_dict / get_optimizer_state_dict(StateDictOptions(
   full_state_dict=True, cpu_offload=True)); checked against DTensor.full_tensor() and the
   plain model's keys. Each rank's local shard size as a share of every parameter. Each rank
   saves ITS shard of model + optimizer state to bytes (torch.save of local tensors), then
   trains 3 more steps (the reference ending).
B. ws=3, fresh processes: a fresh sharded model + optimizer, each rank restores its bytes
   (param.to_local().copy_, optimizer state rewrapped with DTensor.from_local), trains the
   same 3 steps: must equal A's ending bitwise.
C. re-shard: the full state of A loaded into ws=2 and ws=1 sharded models
   (set_model_state_dict / set_optimizer_state_dict, full_state_dict=True,
   broadcast_from_rank0=True), checked bitwise, then the same 3 steps, compared with one
   plain process continuing from the same full state."""

import io
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import data, generation_group, mlp, rel, shard, spawn, sum_reduction
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

B = 12
SHARES = {1: [12], 2: [7, 5], 3: [5, 4, 3]}
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
LOAD = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)


def steps(model, opt, rank, ws, first, count):
    x_all, y_all = data(B * 10, seed=7)
    lo, n = sum(SHARES[ws][:rank]), SHARES[ws][rank]
    for s in range(first, first + count):
        x, y = x_all[s * B + lo : s * B + lo + n], y_all[s * B + lo : s * B + lo + n]
        (F.cross_entropy(model(x), y, reduction="sum") / B).backward()
        opt.step()
        opt.zero_grad()


def sharded(rank, ws, port):
    store = dist.TCPStore("127.0.0.1", port, ws, rank == 0)
    mesh = generation_group(rank, ws, store, gen=0)
    model = shard(mlp(), mesh)
    sum_reduction(model)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3), mesh


def clone(tree):
    """get_*_state_dict(full, cpu_offload) on CPU hands back live tensors where it can (the
    optimizer's 'step'; everything at ws=1): copy before training on."""
    from torch.utils._pytree import tree_map_only

    return tree_map_only(torch.Tensor, lambda t: t.clone(), tree)


def aliased(tree, model, opt):
    """How many tensors of a returned state dict share memory with the live state."""
    from torch.utils._pytree import tree_leaves

    live = {local_ptr(p) for p in model.parameters()}
    live |= {local_ptr(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v)}
    return sum(1 for t in tree_leaves(tree) if torch.is_tensor(t) and t.data_ptr() in live)


def local_ptr(x):
    return (x.to_local() if isinstance(x, DTensor) else x).data_ptr()


def local(x):
    return x.to_local().clone() if isinstance(x, DTensor) else x


def part_a(rank, ws, port):
    model, opt, _mesh = sharded(rank, ws, port)
    steps(model, opt, rank, ws, 0, 4)
    t = time.perf_counter()
    full_m = get_model_state_dict(model, options=FULL)
    full_o = get_optimizer_state_dict(model, opt, options=FULL)
    t_full = time.perf_counter() - t
    alias = aliased((full_m, full_o), model, opt)
    full_m, full_o = clone(full_m), clone(full_o)
    check = {k: v.full_tensor() for k, v in model.state_dict().items()}
    same = rank != 0 or all(torch.equal(full_m[k], check[k]) for k in check)
    shares = {n: (p.to_local().numel(), p.numel()) for n, p in model.named_parameters()}
    exp_avg = {n: opt.state[p]["exp_avg"].to_local().numel() for n, p in model.named_parameters()}
    t = time.perf_counter()
    buf = io.BytesIO()
    torch.save(
        {
            "model": {k: local(v) for k, v in model.state_dict().items()},
            "optim": {
                "state": {
                    i: {k: local(v) for k, v in s.items()}
                    for i, s in opt.state_dict()["state"].items()
                }
            },
        },
        buf,
    )
    t_save = time.perf_counter() - t
    steps(model, opt, rank, ws, 4, 3)
    end = {k: v.full_tensor() for k, v in model.state_dict().items()}
    return {
        "full_m": full_m if rank == 0 else None,
        "full_o": full_o if rank == 0 else None,
        "nonzero_keys_on_other_ranks": len(full_m) if rank else None,
        "same": same,
        "keys_match_plain": list(full_m) == list(mlp().state_dict()) if rank == 0 else None,
        "shares": shares,
        "exp_avg": exp_avg,
        "bytes": buf.getvalue(),
        "end": end,
        "t_full": t_full,
        "t_save": t_save,
        "alias": alias,
    }


def part_b(rank, ws, port, blobs):
    model, opt, mesh = sharded(rank, ws, port)
    saved = torch.load(io.BytesIO(blobs[rank]))
    t = time.perf_counter()
    with torch.no_grad():
        for k, v in model.state_dict().items():
            v.to_local().copy_(saved["model"][k])
    params = list(model.parameters())
    state = {}
    for i, s in saved["optim"]["state"].items():
        p = params[i]
        state[i] = {
            k: DTensor.from_local(
                v, mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
            )
            if k != "step"
            else v
            for k, v in s.items()
        }
    sd = opt.state_dict()
    sd["state"] = state
    opt.load_state_dict(sd)
    t_restore = time.perf_counter() - t
    steps(model, opt, rank, ws, 4, 3)
    return {
        "end": {k: v.full_tensor() for k, v in model.state_dict().items()},
        "t_restore": t_restore,
    }


def part_c(rank, ws, port, full_m, full_o):
    model, opt, _mesh = sharded(rank, ws, port)
    if rank != 0:
        full_m, full_o = {}, {}
    t = time.perf_counter()
    set_model_state_dict(model, full_m, options=LOAD)
    set_optimizer_state_dict(model, opt, full_o, options=LOAD)
    t_load = time.perf_counter() - t
    back_m = get_model_state_dict(model, options=FULL)
    back_o = get_optimizer_state_dict(model, opt, options=FULL)
    alias = aliased((back_m, back_o), model, opt)
    back_m, back_o = clone(back_m), clone(back_o)
    steps(model, opt, rank, ws, 4, 3)
    return {
        "end": {k: v.full_tensor() for k, v in model.state_dict().items()},
        "back_m": back_m if rank == 0 else None,
        "back_o": back_o if rank == 0 else None,
        "t_load": t_load,
        "alias": alias,
    }


def flat_opt(o):
    return {(k, n): v for k, s in o["state"].items() for n, v in s.items()}


if __name__ == "__main__":
    a = spawn(part_a, 3)
    print(
        "A. ws=3: full state on rank 0 equals full_tensor():",
        a[0]["same"],
        "| keys equal the plain model's:",
        a[0]["keys_match_plain"],
        "| entries on ranks 1,2 with cpu_offload:",
        [r["nonzero_keys_on_other_ranks"] for r in a[1:]],
        f"| get full model+optim: {a[0]['t_full'] * 1e3:.1f} ms"
        f"| tensors aliasing live state: {a[0]['alias']}",
    )
    print(
        "   optimizer full state keys (first):",
        list(a[0]["full_o"]["state"])[:2],
        "param_groups params:",
        a[0]["full_o"]["param_groups"][0]["params"][:2],
    )
    for name in ["inp.weight", "inp.bias", "blocks.0.up.weight", "out.weight", "out.bias"]:
        print(
            f"   {name:20s} local numel per rank {[r['shares'][name][0] for r in a]} of "
            f"{a[0]['shares'][name][1]}; Adam exp_avg local {[r['exp_avg'][name] for r in a]}"
        )
    tot = [sum(n for n, _ in r["shares"].values()) for r in a]
    print(
        f"   all params: per-rank local {tot} of {sum(t for _, t in a[0]['shares'].values())} "
        f"= {[round(t / sum(tot), 3) for t in tot]}; shard bytes per rank {[len(r['bytes']) for r in a]}, "
        f"torch.save {max(r['t_save'] for r in a) * 1e3:.1f} ms"
    )
    b = spawn(part_b, 3, [r["bytes"] for r in a])
    d = max(rel(b[0]["end"][k], a[0]["end"][k]) for k in a[0]["end"])
    eq = all(torch.equal(b[0]["end"][k], a[0]["end"][k]) for k in a[0]["end"])
    print(
        f"B. ws=3 restored from per-rank bytes, 3 more steps: bitwise equal to the uninterrupted "
        f"run: {eq} (max rel {d:.1e}); restore {max(r['t_restore'] for r in b) * 1e3:.1f} ms"
    )
    # plain process continuing from the full state
    plain = mlp()
    popt = torch.optim.Adam(plain.parameters(), lr=1e-3)
    set_model_state_dict(plain, clone(a[0]["full_m"]))
    # a copy: Optimizer.load_state_dict keeps the given 'step' tensors (no copy) and Adam
    # then increments them in place, which would change a[0]["full_o"] under us
    given = clone(a[0]["full_o"])
    set_optimizer_state_dict(plain, popt, given)
    kept = sum(
        popt.state[p]["step"] is given["state"][n]["step"] for n, p in plain.named_parameters()
    )
    steps(plain, popt, 0, 1, 4, 3)
    ref = plain.state_dict()
    d3 = max(rel(a[0]["end"][k], ref[k]) for k in ref)
    print(
        f"   (ws=3 uninterrupted vs one plain process from the same full state: {d3:.1e}; "
        f"the plain optimizer kept {kept} of the given 'step' tensors themselves)"
    )
    for ws in (2, 1):
        c = spawn(part_c, ws, a[0]["full_m"], a[0]["full_o"])
        bm = all(torch.equal(c[0]["back_m"][k], a[0]["full_m"][k]) for k in a[0]["full_m"])
        fo, bo = flat_opt(a[0]["full_o"]), flat_opt(c[0]["back_o"])
        bo_eq = fo.keys() == bo.keys() and all(torch.equal(fo[k], bo[k]) for k in fo)
        d = max(rel(c[0]["end"][k], ref[k]) for k in ref)
        print(
            f"C. 3 -> {ws}: loaded model bitwise equal {bm}, optimizer state bitwise equal {bo_eq}; "
            f"3 more steps vs one plain process: max rel {d:.1e}; load "
            f"{max(r['t_load'] for r in c) * 1e3:.1f} ms; full state dict tensors aliasing live state "
            f"at ws={ws}: {c[0]['alias']}"
        )
