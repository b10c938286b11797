"""Q7: torch.distributed.checkpoint (DCP) of a sharded model + Adam state.
A. ws=2 (small model, 4 steps): dcp.save of {model, optim} (get_model_state_dict /
   get_optimizer_state_dict, sharded: each rank writes its shard), then 3 more steps (the
   reference ending). Also dcp.async_save on a second gloo group while training goes on.
B. load into ws=3 (fresh model, dcp.load, set_*_state_dict), 3 more steps: equal to A's?
C. load into ONE plain process with no process group (dcp.load on plain state dicts), and
   dcp_to_torch_save -> one torch.save file (px.load_checkpoint's path).
D. bad input: a truncated shard file, a missing shard file, another model's checkpoint.
E. time: the 50M-parameter stack of q6: dcp.save from 2 ranks, load into one process."""

import os
import shutil
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from common import mlp, rel, spawn
from q5_state import clone, sharded, steps
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard

if "SPIKE_DCP_ROOT" not in os.environ:  # made once, by the parent; spawned children inherit it
    os.environ["SPIKE_DCP_ROOT"] = tempfile.mkdtemp(prefix="spike-dcp-")
ROOT = os.environ["SPIKE_DCP_ROOT"]


def files(path):
    return sorted((f, os.path.getsize(os.path.join(path, f))) for f in os.listdir(path))


def part_a(rank, ws, port):
    model, opt, _mesh = sharded(rank, ws, port)
    steps(model, opt, rank, ws, 0, 4)
    t = time.perf_counter()
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.save(state, checkpoint_id=f"{ROOT}/a")
    t_save = time.perf_counter() - t
    saved = full_state(model, opt)
    # async: staged copy, written by a thread, planned on a group of its own
    side = dist.new_group(backend="gloo")
    t = time.perf_counter()
    fut = dcp.async_save(state, checkpoint_id=f"{ROOT}/async", process_group=side)
    t_async_call = time.perf_counter() - t
    steps(model, opt, rank, ws, 4, 3)  # training goes on meanwhile
    err = None
    try:
        fut.result(timeout=60)
    except Exception as e:
        err = f"{type(e).__name__}: {str(e)[:150]}"
    return {
        "end": {k: v.full_tensor() for k, v in model.state_dict().items()},
        "saved": saved,
        "t_save": t_save,
        "t_async_call": t_async_call,
        "async_err": err,
    }


def part_b(rank, ws, port, ckpt):
    model, opt, _mesh = sharded(rank, ws, port)
    t = time.perf_counter()
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=ckpt)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    t_load = time.perf_counter() - t
    loaded = full_state(model, opt)
    steps(model, opt, rank, ws, 4, 3)
    return {
        "end": {k: v.full_tensor() for k, v in model.state_dict().items()},
        "t_load": t_load,
        "loaded": loaded,
    }


def full_state(model, opt):
    """Every tensor of model + optimizer state, gathered whole, keyed by name (a copy)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    o = StateDictOptions(full_state_dict=True, cpu_offload=True)
    m, s = get_model_state_dict(model, options=o), get_optimizer_state_dict(model, opt, options=o)
    flat = {("model", k): v for k, v in m.items()}
    flat.update({(n, k): v for n, st in s.get("state", {}).items() for k, v in st.items()})
    return clone(flat)


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def plain_from(ckpt, model=None):
    model = model or mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=ckpt)  # no process group: runs without one
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    return model, opt


def big_save(rank, ws, port):
    from common import generation_group

    store = dist.TCPStore("127.0.0.1", port, ws, rank == 0)
    mesh = generation_group(rank, ws, store, gen=0, timeout=100)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(48)])
    for m in model:
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    model(torch.randn(4, 1024)).square().mean().backward()
    opt.step()
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dist.barrier()
    t = time.perf_counter()
    dcp.save(state, checkpoint_id=f"{ROOT}/big")
    return {"t": time.perf_counter() - t}


if __name__ == "__main__":
    try:
        a = spawn(part_a, 2)
        print(
            f"A. ws=2 dcp.save {max(r['t_save'] for r in a) * 1e3:.0f} ms, files {files(ROOT + '/a')}"
        )
        print(
            f"   async_save on a 2nd group: call returned in {max(r['t_async_call'] for r in a) * 1e3:.0f} ms, "
            f"errors {[r['async_err'] for r in a]}; files {[f for f, _ in files(ROOT + '/async')]}"
        )
        ref = a[0]["end"]
        for ckpt in ("a", "async"):
            b = spawn(part_b, 3, f"{ROOT}/{ckpt}")
            eq = all(torch.equal(b[0]["end"][k], ref[k]) for k in ref)
            d = max(rel(b[0]["end"][k], ref[k]) for k in ref)
            print(
                f"B. '{ckpt}' (ws=2) loaded into ws=3 ({max(r['t_load'] for r in b) * 1e3:.0f} ms): model+Adam "
                f"state bitwise equal to what was saved: {same(b[0]['loaded'], a[0]['saved'])}; 3 more steps "
                f"on ws=3 vs ws=2 uninterrupted: max rel {d:.1e}"
            )
        t = time.perf_counter()
        model, opt = plain_from(f"{ROOT}/a")
        t_plain = time.perf_counter() - t
        mine = {("model", k): v for k, v in model.state_dict().items()}
        mine.update(
            {
                (n, k): v
                for n, st in get_optimizer_state_dict(model, opt)["state"].items()
                for k, v in st.items()
            }
        )
        print(
            f"C. one plain process: state bitwise equal to what was saved: {same(clone(mine), a[0]['saved'])}"
        )
        steps(model, opt, 0, 1, 4, 3)
        d = max(rel(model.state_dict()[k], ref[k]) for k in ref)
        print(
            f"C. loaded into one plain process without a process group ({t_plain * 1e3:.0f} ms), 3 more steps: "
            f"max rel vs ws=2 {d:.1e}"
        )
        dcp_to_torch_save(f"{ROOT}/a", f"{ROOT}/full.pt")
        full = torch.load(f"{ROOT}/full.pt")
        print(
            f"   dcp_to_torch_save: keys {list(full)}, model keys equal plain's: "
            f"{list(full['model']) == list(mlp().state_dict())}"
        )

        # D. bad input
        def attempt(what, ckpt, model=None):
            try:
                plain_from(ckpt, model)
                print(f"D. {what}: loaded WITHOUT error")
            except BaseException as e:  # CheckpointException is a BaseException
                msg = " ".join(str(e).split())
                if "Traceback" in msg:  # keep the inner error's last line
                    msg = msg.split("(RANK 0)")[-1].strip()[-300:]
                print(f"D. {what}: {type(e).__name__}: {msg[:260]}")

        bad = shutil.copytree(f"{ROOT}/a", f"{ROOT}/trunc")
        shard = [f for f, _ in files(bad) if f.endswith(".distcp")][1]
        with open(os.path.join(bad, shard), "r+b") as f:
            f.truncate(os.path.getsize(os.path.join(bad, shard)) // 2)
        attempt(f"truncated {shard}", bad)
        miss = shutil.copytree(f"{ROOT}/a", f"{ROOT}/missing")
        os.remove(os.path.join(miss, shard))
        attempt(f"missing {shard}", miss)
        attempt("another model (width 48)", f"{ROOT}/a", mlp(width=48))
        # E. time at 50M parameters
        e = spawn(big_save, 2, timeout=110)
        size = sum(s for _, s in files(ROOT + "/big"))
        t = time.perf_counter()
        sd = {"model": nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(48)]).state_dict()}
        dcp.load(sd, checkpoint_id=f"{ROOT}/big")
        print(
            f"E. 50.4M params + Adam, ws=2: dcp.save {max(r['t'] for r in e):.2f} s ({size / 2**20:.0f} MiB on "
            f"{ROOT.split('/')[1]}), model-only load into one process {time.perf_counter() - t:.2f} s"
        )
    finally:
        shutil.rmtree(ROOT, ignore_errors=True)
