"""Q6: the cost of keeping shards recoverable, on a ~50M-parameter stack of Linear layers
(48 x Linear(1024, 1024), FSDP units of 4 layers), Adam, 16 samples per rank, 1 thread a
rank. Per rank: local shard sizes of parameters and Adam state, RSS, the time of one
training step; the time to copy the rank's shard of params + Adam state (i) into a flat
buffer in /dev/shm (what phalanx's snapshot store does: first write faults pages in, later
ones are copies), (ii) torch.save to BytesIO, (iii) to a peer over gloo (send/recv in a
ring: rank r keeps rank r-1's shard), and (iv) the same ring transfer running on a second
gloo group in a thread while the next step trains (the step's slowdown)."""

import io
import os
import resource
import statistics
import threading
import time

import torch
import torch.distributed as dist
from common import generation_group, spawn, sum_reduction
from torch import nn
from torch.distributed.fsdp import fully_shard

WIDTH, LAYERS, PER_UNIT, BATCH = 1024, 48, 4, 16


def rss_mb():
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024


def run(rank, ws, port):
    store = dist.TCPStore("127.0.0.1", port, ws, rank == 0)
    mesh = generation_group(rank, ws, store, gen=0, timeout=100)
    rss0 = rss_mb()
    torch.manual_seed(0)
    model = nn.Sequential(
        *[
            nn.Sequential(
                *[m for _ in range(PER_UNIT) for m in (nn.Linear(WIDTH, WIDTH), nn.ReLU())]
            )
            for _ in range(LAYERS // PER_UNIT)
        ]
    )
    total = sum(p.numel() for p in model.parameters())
    for unit in model:
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sum_reduction(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(BATCH, WIDTH, generator=g)

    def step():
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # creates Adam state
    times = []
    for _ in range(3):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    tensors = [p.to_local() for p in model.parameters()]
    tensors += [
        opt.state[p][k].to_local() for p in model.parameters() for k in ("exp_avg", "exp_avg_sq")
    ]
    p_local = sum(p.to_local().numel() for p in model.parameters())
    n = sum(t.numel() for t in tensors)
    out = {
        "total": total,
        "p_local": p_local,
        "state_local": n,
        "step_s": statistics.median(times),
        "rss_mb": rss_mb(),
        "rss0_mb": rss0,
        "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)  # give freed heap back: what RSS keeps for real
    out["rss_trim_mb"] = rss_mb()
    # (i) flat copy into /dev/shm
    path = f"/dev/shm/spike-fsdp-{os.getpid()}"
    try:
        flat = torch.from_file(path, shared=True, size=n, dtype=torch.float32)
        copies = []
        for _ in range(3):
            t = time.perf_counter()
            at = 0
            for s in tensors:
                flat[at : at + s.numel()].copy_(s.reshape(-1))
                at += s.numel()
            copies.append(time.perf_counter() - t)
        out["shm_first_s"], out["shm_next_s"] = copies[0], min(copies[1:])
        del flat
    finally:
        os.unlink(path)
    # (ii) torch.save of the local shards
    t = time.perf_counter()
    buf = io.BytesIO()
    torch.save(tensors, buf)
    out["save_s"], out["save_bytes"] = time.perf_counter() - t, buf.tell()
    del buf
    if ws == 1:
        return out
    # (iii) ring transfer to a peer: flat buffer out, the previous rank's in (twice: the
    # first one also connects gloo's pairs)
    send = torch.cat([s.reshape(-1) for s in tensors])
    recv = torch.empty_like(send)
    for _ in range(2):
        dist.barrier()
        t = time.perf_counter()
        ops = [
            dist.P2POp(dist.isend, send, (rank + 1) % ws),
            dist.P2POp(dist.irecv, recv, (rank - 1) % ws),
        ]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        out["ring_s"] = time.perf_counter() - t
    # (iv) the same transfer in a thread on a second group while a step runs
    side = dist.new_group(backend="gloo")
    dist.barrier()

    def transfer():
        ops = [
            dist.P2POp(dist.isend, send, (rank + 1) % ws, group=side),
            dist.P2POp(dist.irecv, recv, (rank - 1) % ws, group=side),
        ]
        for w in dist.batch_isend_irecv(ops):
            w.wait()

    transfer()  # connect the side group's pairs
    dist.barrier()
    th = threading.Thread(target=transfer)
    t = time.perf_counter()
    th.start()
    step()
    out["step_during_transfer_s"] = time.perf_counter() - t
    th.join()
    out["step_plus_transfer_s"] = time.perf_counter() - t
    t = time.perf_counter()
    step()
    out["step_after_s"] = time.perf_counter() - t
    return out


if __name__ == "__main__":
    for ws in (1, 2):
        res = spawn(run, ws, timeout=110)
        r = res[0]
        if "error" in r:
            print(ws, r["tb"][-1500:])
            continue
        gb = 4 / 2**30
        print(
            f"ws={ws}: model {r['total'] / 1e6:.1f} M params; per rank: params {[x['p_local'] for x in res]} "
            f"({r['p_local'] / r['total']:.3f} of the whole), params+Adam {r['state_local'] * gb:.3f} GiB, "
            f"RSS {[round(x['rss_mb']) for x in res]} MB (peak {[round(x['maxrss_mb']) for x in res]}; "
            f"{[round(x['rss0_mb']) for x in res]} before the model was built; "
            f"{[round(x['rss_trim_mb']) for x in res]} after malloc_trim)"
        )
        print(
            f"   step (fwd+bwd+Adam, {BATCH} samples/rank): {[round(x['step_s'] * 1e3) for x in res]} ms"
        )
        print(
            f"   shard -> /dev/shm flat copy: first {[round(x['shm_first_s'] * 1e3) for x in res]} ms, "
            f"later {[round(x['shm_next_s'] * 1e3) for x in res]} ms; torch.save to BytesIO "
            f"{[round(x['save_s'] * 1e3) for x in res]} ms ({r['save_bytes'] / 2**20:.0f} MiB)"
        )
        if ws > 1:
            print(
                f"   shard -> peer over gloo (ring send/recv): {[round(x['ring_s'] * 1e3) for x in res]} ms; "
                f"a step while that transfer runs in a thread on a 2nd group: "
                f"{[round(x['step_during_transfer_s'] * 1e3) for x in res]} ms "
                f"(step + transfer done {[round(x['step_plus_transfer_s'] * 1e3) for x in res]} ms; "
                f"next step alone {[round(x['step_after_s'] * 1e3) for x in res]} ms)",
                flush=True,
            )
