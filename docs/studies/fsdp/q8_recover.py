"""Q8 (recovery, end to end on one machine): shrink and respawn under FSDP2, exact.
Slots 0,1,2 train a sharded model (Adam, global batch 12 split unevenly among the members).
After every committed step each member writes ITS shard of params + Adam state, with the
dim-0 offsets, to /dev/shm (tmp file + rename). In step 5 slot 2 is killed (os._exit(9),
after its forward). The survivors' collective fails; each destroys torch's default group,
forms generation 1 (init_process_group on the store prefix g1/), builds a fresh model,
re-shards the newest complete snapshot (step 4: 3 shards -> 2) by copying dim-0 row ranges,
and computes step 5 again with the new split. After step 6 a replacement (slot 3) joins:
the members write their live shards, generation 2 forms with 3 members, everyone re-shards
2 -> 3 from those files, and training goes on to step 8. The final weights are compared with
one plain process on the full batch; the times of each phase are printed. The store lives in
the parent (as phalanx's supervisor hosts it)."""

import glob
import os
import shutil
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from common import data, free_port, generation_group, mlp, rel, shard, sum_reduction
from torch.distributed.tensor import DTensor

B, STEPS, KILL_AT, JOIN_AFTER = 12, 8, 5, 6
SHARES = {1: [12], 2: [7, 5], 3: [5, 4, 3]}


def rows(d0, ws, r):
    """FSDP2's dim-0 chunk of rank r (torch.chunk: ceil-sized pieces, the last ones short)."""
    c = -(-d0 // ws)
    return min(r * c, d0), min((r + 1) * c, d0)


def snapshot(model, opt, step, rank, ws, folder):
    named = dict(model.named_parameters())
    out = {"step": step, "ws": ws, "rank": rank, "params": {}, "optim": {}}
    for n, p in named.items():
        lo, hi = rows(p.shape[0], ws, rank)
        assert p.to_local().shape[0] == hi - lo, (n, p.to_local().shape, lo, hi)
        out["params"][n] = (lo, p.to_local().clone())
        st = opt.state[p]
        out["optim"][n] = {
            k: (v.to_local().clone() if isinstance(v, DTensor) else v.clone())
            for k, v in st.items()
        }
    tmp = f"{folder}/tmp-{rank}.part"  # (torch.save refuses a name that starts with a dot)
    torch.save(out, tmp)
    os.replace(tmp, f"{folder}/snap-s{step}-r{rank}-of{ws}.pt")


def newest_complete(folder):
    by = {}
    for f in glob.glob(f"{folder}/snap-*.pt"):
        s, r, ws = os.path.basename(f)[6:-3].replace("r", "").replace("of", "").split("-")
        by.setdefault((int(s), int(ws)), set()).add(int(r))
    done = [k for k, rs in by.items() if len(rs) == k[1]]
    return max(done) if done else None


def restore(model, opt, folder, step, old_ws, rank, ws, mesh):
    """Re-shard old_ws shards of `step` into this member's shard of a ws-member mesh: for each
    parameter, copy the dim-0 rows [lo, hi) this member owns from the old shards that hold them."""
    old = [torch.load(f"{folder}/snap-s{step}-r{r}-of{old_ws}.pt") for r in range(old_ws)]
    named = dict(model.named_parameters())
    state = {}

    def gather(n, get):
        p = named[n]
        lo, hi = rows(p.shape[0], ws, rank)
        pieces = []
        for o in old:
            olo, _ = o["params"][n]
            t = get(o)
            a, b = max(lo, olo), min(hi, olo + t.shape[0])
            if a < b:
                pieces.append(t[a - olo : b - olo])
        return torch.cat(pieces) if pieces else torch.empty(0, *p.shape[1:])

    with torch.no_grad():
        for i, (n, p) in enumerate(named.items()):
            p.to_local().copy_(gather(n, lambda o, n=n: o["params"][n][1]))
            st = {}
            for k in old[0]["optim"][n]:
                if k == "step":
                    st[k] = old[0]["optim"][n][k].clone()
                else:
                    st[k] = DTensor.from_local(
                        gather(n, lambda o, n=n, k=k: o["optim"][n][k]),
                        mesh,
                        p.placements,
                        run_check=False,
                        shape=p.shape,
                        stride=p.stride(),
                    )
            state[i] = st
    sd = opt.state_dict()
    sd["state"] = state
    opt.load_state_dict(sd)


def train_step(model, opt, step, rank, ws, die=False):
    x_all, y_all = data(B * STEPS, seed=11)
    lo, n = sum(SHARES[ws][:rank]), SHARES[ws][rank]
    x, y = x_all[step * B + lo : step * B + lo + n], y_all[step * B + lo : step * B + lo + n]
    loss = F.cross_entropy(model(x), y, reduction="sum") / B
    if die:
        return True
    loss.backward()
    opt.step()
    opt.zero_grad()
    return False


def worker(slot, port, folder, q):
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    log = {}
    if slot == 3:  # the replacement: waits to be let in
        store.wait(["gen2"], timedelta(seconds=60))
        gens = [(2, [0, 1, 3])]
    else:
        gens = [(0, [0, 1, 2]), (1, [0, 1]), (2, [0, 1, 3])]
    step = 0  # next step to compute
    for gen, members in gens:
        if slot not in members:
            break
        rank, ws = members.index(slot), len(members)
        t = time.time()
        mesh = generation_group(rank, ws, store, gen, timeout=20)
        log[f"g{gen} form s"] = time.time() - t
        model = shard(mlp(), mesh)
        sum_reduction(model)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        if gen > 0:
            t = time.time()
            s, old_ws = newest_complete(folder)
            restore(model, opt, folder, s, old_ws, rank, ws, mesh)
            log[f"g{gen} restore s"] = time.time() - t
            log[f"g{gen} restored step"] = s
            step = s + 1
        try:
            while step < STEPS:
                die = gen == 0 and slot == 2 and step == KILL_AT
                if die:
                    store.set("killed_at", repr(time.time()))
                    train_step(model, opt, step, rank, ws, die=True)
                    os._exit(9)
                train_step(model, opt, step, rank, ws)
                if gen == 1 and "g1 first commit" not in log:
                    log["g1 first commit"] = time.time()
                snapshot(model, opt, step, rank, ws, folder)
                step += 1
                if gen == 1 and step == JOIN_AFTER + 1:  # let the replacement in
                    dist.barrier()
                    if rank == 0:
                        store.set("gen2", "1")
                    break
        except Exception as e:
            log[f"g{gen} error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:110]}"
            log["detected"] = time.time()
        t = time.time()
        dist.destroy_process_group()
        log[f"g{gen} destroy s"] = time.time() - t
    q.put((slot, log))


def reference():
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for s in range(STEPS):
        train_step(model, opt, s, 0, 1)
    return model.state_dict()


def final_weights(folder):
    """The full weights of the last committed step, from its shard files (no process group)."""
    s, ws = newest_complete(folder)
    shards = [torch.load(f"{folder}/snap-s{s}-r{r}-of{ws}.pt") for r in range(ws)]
    return s, ws, {n: torch.cat([sh["params"][n][1] for sh in shards]) for n in shards[0]["params"]}


if __name__ == "__main__":
    folder = tempfile.mkdtemp(prefix="spike-fsdp-snap-", dir="/dev/shm")
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(s, port, folder, q)) for s in range(4)]
    try:
        for p in procs:
            p.start()
        logs = {}
        deadline = time.time() + 100
        while (
            len(logs) < 3
            and time.time() < deadline
            and not any(p.exitcode not in (None, 0, 9, -9) for p in procs)
        ):
            try:
                s, log = q.get(timeout=1)
                logs[s] = log
            except Exception:
                pass
        for p in procs:
            p.join(timeout=10)
        print("exit codes by slot:", [p.exitcode for p in procs])
        killed = float(store.get("killed_at"))
        for s in sorted(logs):
            lg = logs[s]
            parts = []
            for k, v in lg.items():
                if k in ("detected", "g1 first commit"):
                    parts.append(f"{k} +{v - killed:.2f}s after the kill")
                elif isinstance(v, float):
                    parts.append(f"{k} {v:.3f}")
                else:
                    parts.append(f"{k}: {v}")
            print(f"slot {s}: " + "; ".join(parts))
        s, ws, w = final_weights(folder)
        ref = reference()
        print(
            f"final: step {s} on {ws} members; max rel diff vs one plain process "
            f"{max(rel(w[k], ref[k]) for k in ref):.2e} (goal <= 1e-5)"
        )
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        shutil.rmtree(folder, ignore_errors=True)
