"""Q10 (E4): which calls after backward communicate when the parameters are FSDP2 DTensors?
phalanx's rule: once the vote says every member succeeded, the commit (optimizer.step)
must not be able to fail because of a peer, so it must run no collective.

2 processes on gloo, 3 Linear layers, fully_shard on each then the root, SUM reduction;
one forward/backward before each measured call (fresh model and optimizer per row). Every
call is counted three ways:
  seq   - the gloo backends' own collective counters (ProcessGroup._get_sequence_number_for_group,
          summed over every group): every collective, whatever path issued it (barrier too);
  kinds - torch.distributed.tensor.debug.CommDebugMode: c10d and functional-collective ops
          seen by the dispatcher, by kind;
  entry - Python entry points wrapped by this script (torch.distributed.* and
          torch.distributed._functional_collectives.*), outermost call only.
Optimizer rows count step 1 (which creates the state) and step 2 separately.
Cross-check: the peer is SIGSTOPped; the other rank runs Adam's step (should finish), then
clip_grad_norm_ (a positive control: should block in its all-reduce until gloo's timeout)."""

import contextlib
import functools
import os
import signal
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.distributed_c10d as c10d
import torch.multiprocessing as mp
from torch import nn, optim

torch.set_num_threads(1)

ENTRY: dict = {}
_DEPTH = [0]
DIST_NAMES = [
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "reduce_scatter",
    "broadcast",
    "barrier",
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "scatter_object_list",
    "all_to_all_single",
    "reduce",
    "gather",
    "scatter",
    "send",
    "recv",
    "monitored_barrier",
]
FUNCOL_NAMES = [
    "all_reduce",
    "all_reduce_coalesced",
    "all_gather_tensor",
    "all_gather_tensor_autograd",
    "all_gather_into_tensor_coalesced",
    "reduce_scatter_tensor",
    "reduce_scatter_tensor_autograd",
    "reduce_scatter_tensor_coalesced",
    "all_to_all_single",
    "all_to_all_single_autograd",
    "broadcast",
    "permute_tensor",
]


def _wrap(label, orig):
    @functools.wraps(orig)
    def wrapped(*a, **k):
        if _DEPTH[0] == 0:
            ENTRY[label] = ENTRY.get(label, 0) + 1
        _DEPTH[0] += 1
        try:
            return orig(*a, **k)
        finally:
            _DEPTH[0] -= 1

    return wrapped


def patch_entry_points():
    """Wrap the Python collectives in every namespace they are looked up from."""
    for name in DIST_NAMES:
        orig = getattr(c10d, name, None)
        if orig is not None:
            w = _wrap("dist." + name, orig)
            setattr(c10d, name, w)
            if getattr(dist, name, None) is orig:
                setattr(dist, name, w)
    for name in FUNCOL_NAMES:
        orig = getattr(funcol, name, None)
        if orig is not None:
            setattr(funcol, name, _wrap("funcol." + name, orig))


def backend_seq() -> int:
    """Sum of the collective counters of every process group this process holds."""
    total = 0
    for pg in list(c10d._world.pg_map):
        with contextlib.suppress(Exception):
            total += pg._get_sequence_number_for_group()
    return total


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_group(rank, port, pg_timeout):
    """A store with a long timeout (startup skew on 2 cores), a store barrier, then the
    default group with a short timeout, and a 1-D cpu mesh over it."""
    from torch.distributed.device_mesh import init_device_mesh

    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
    store.add("up", 1)
    deadline = time.monotonic() + 60
    while int(store.add("up", 0)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=pg_timeout)
    )
    return init_device_mesh("cpu", (2,)), store


def build(mesh):
    from torch.distributed.fsdp import FSDPModule, fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(7, 17), nn.ReLU(), nn.Linear(17, 17), nn.ReLU(), nn.Linear(17, 3)
    )
    for i in (0, 2, 4):
        fully_shard(model[i], mesh=mesh)
    fully_shard(model, mesh=mesh)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
    return model


def fwd_bwd(model, rank, seed=1):
    g = torch.Generator().manual_seed(seed + rank)
    x, y = torch.randn(6, 7, generator=g), torch.randint(0, 3, (6,), generator=g)
    torch.nn.functional.cross_entropy(model(x), y, reduction="sum").div(12).backward()


def measure(fn):
    from torch.distributed.tensor.debug import CommDebugMode

    ENTRY.clear()
    s0, mode, err = backend_seq(), CommDebugMode(), None
    t = time.perf_counter()
    note = ""
    try:
        with mode:
            value = fn()
        if hasattr(value, "placements"):
            note = f"returns DTensor {tuple(value.placements)}"
    except Exception as e:
        err = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:110]}"
    ms = (time.perf_counter() - t) * 1e3
    kinds = {str(k).replace("OpOverloadPacket", ""): v for k, v in mode.get_comm_counts().items()}
    return {
        "seq": backend_seq() - s0,
        "kinds": kinds,
        "entry": dict(ENTRY),
        "err": err,
        "ms": ms,
        "note": note,
    }


OPTIMIZERS = [
    ("SGD foreach=False", lambda p: optim.SGD(p, lr=0.1, foreach=False)),
    ("SGD foreach=True", lambda p: optim.SGD(p, lr=0.1, foreach=True)),
    ("SGD momentum=0.9 foreach=False", lambda p: optim.SGD(p, lr=0.1, momentum=0.9, foreach=False)),
    ("SGD momentum=0.9 foreach=True", lambda p: optim.SGD(p, lr=0.1, momentum=0.9, foreach=True)),
    (
        "SGD momentum nesterov wd",
        lambda p: optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    ),
    ("Adam foreach=False", lambda p: optim.Adam(p, lr=1e-3, foreach=False)),
    ("Adam foreach=True", lambda p: optim.Adam(p, lr=1e-3, foreach=True)),
    ("Adam fused=True", lambda p: optim.Adam(p, lr=1e-3, fused=True)),
    ("Adam amsgrad foreach=True", lambda p: optim.Adam(p, lr=1e-3, amsgrad=True, foreach=True)),
    ("AdamW foreach=False", lambda p: optim.AdamW(p, lr=1e-3, foreach=False)),
    ("AdamW foreach=True", lambda p: optim.AdamW(p, lr=1e-3, foreach=True)),
    ("AdamW fused=True", lambda p: optim.AdamW(p, lr=1e-3, fused=True)),
    ("Adagrad foreach=False", lambda p: optim.Adagrad(p, lr=0.1, foreach=False)),
    ("Adagrad foreach=True", lambda p: optim.Adagrad(p, lr=0.1, foreach=True)),
    ("RMSprop foreach=False", lambda p: optim.RMSprop(p, lr=0.01, foreach=False)),
    ("RMSprop foreach=True", lambda p: optim.RMSprop(p, lr=0.01, foreach=True)),
    ("RMSprop centered momentum", lambda p: optim.RMSprop(p, lr=0.01, centered=True, momentum=0.9)),
    ("Adamax", lambda p: optim.Adamax(p, lr=1e-3)),
    ("NAdam", lambda p: optim.NAdam(p, lr=1e-3)),
    ("RAdam", lambda p: optim.RAdam(p, lr=1e-3)),
    ("Adadelta", lambda p: optim.Adadelta(p)),
    ("ASGD", lambda p: optim.ASGD(p, lr=0.01)),
    ("Rprop", lambda p: optim.Rprop(p, lr=0.01)),
    ("Adafactor", lambda p: optim.Adafactor(p, lr=0.01)),
    ("Muon (2-D weights only)", lambda p: optim.Muon([q for q in p if q.ndim == 2], lr=0.02)),
]


def optimizer_rows(mesh, rank):
    rows = []
    for name, make in OPTIMIZERS:
        model = build(mesh)
        try:
            opt = make(list(model.parameters()))
        except Exception as e:
            rows.append((f"{name}: constructor", {"err": f"{type(e).__name__}: {e}"[:120]}))
            continue
        for step in (1, 2):
            fwd_bwd(model, rank, seed=step)
            rows.append((f"{name}: step {step}", measure(opt.step)))
            opt.zero_grad()
    return rows


def other_rows(mesh, rank):
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    from torch.nn.utils import (
        clip_grad_norm_,
        clip_grad_value_,
        clip_grads_with_norm_,
        get_total_norm,
    )

    rows = []
    model = build(mesh)
    params = list(model.parameters())
    opt = optim.Adam(params, lr=1e-3)
    sched = optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    fwd_bwd(model, rank)

    def grads():
        return [p.grad for p in params]

    box = {}
    steps = [
        ("clip_grad_norm_(max_norm=0.5)", lambda: clip_grad_norm_(params, 0.5)),
        (
            "clip_grad_norm_(0.5, foreach=False)",
            lambda: clip_grad_norm_(params, 0.5, foreach=False),
        ),
        ("clip_grad_norm_(1e9) (no clipping needed)", lambda: clip_grad_norm_(params, 1e9)),
        ("  split: get_total_norm(grads)", lambda: box.setdefault("n", get_total_norm(grads()))),
        (
            "  split: clip_grads_with_norm_(that DTensor norm)",
            lambda: clip_grads_with_norm_(params, 0.5, box["n"]),
        ),
        ("  split: norm.full_tensor()", lambda: box.setdefault("full", box["n"].full_tensor())),
        (
            "  split: clip_grads_with_norm_(plain-tensor norm)",
            lambda: clip_grads_with_norm_(params, 0.5, box["full"]),
        ),
        ("clip_grad_value_(0.01)", lambda: clip_grad_value_(params, 0.01)),
        ("optimizer.step() (Adam, default)", opt.step),
        ("lr_scheduler.step() (StepLR)", sched.step),
        ("optimizer.zero_grad() (set_to_none=True)", opt.zero_grad),
        ("model.state_dict()", model.state_dict),
        ("optimizer.state_dict()", opt.state_dict),
        ("get_model_state_dict(model) (sharded)", lambda: get_model_state_dict(model)),
        (
            "get_optimizer_state_dict(model, opt) (sharded)",
            lambda: get_optimizer_state_dict(model, opt),
        ),
        (
            "get_model_state_dict(full_state_dict=True) (contrast)",
            lambda: get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)),
        ),
    ]
    for name, fn in steps:
        rows.append((name, measure(fn)))
    fwd_bwd(model, rank, seed=3)
    rows.append(
        (
            "optimizer.zero_grad(set_to_none=False)",
            measure(lambda: opt.zero_grad(set_to_none=False)),
        )
    )
    sched2 = optim.lr_scheduler.ReduceLROnPlateau(opt)
    rows.append(("ReduceLROnPlateau.step(1.0)", measure(lambda: sched2.step(1.0))))
    return rows


def count_worker(rank, port, q):
    try:
        mesh, _ = join_group(rank, port, pg_timeout=20)
        assert mesh.get_group() is c10d._get_default_group()
        patch_entry_points()
        rows = optimizer_rows(mesh, rank) + other_rows(mesh, rank)
        q.put((rank, rows))
    except BaseException as e:
        q.put((rank, {"error": f"{type(e).__name__}: {e}", "tb": traceback.format_exc()}))
    finally:
        q.close()
        q.join_thread()  # flush the queue's feeder thread before the hard exit
        os._exit(0)  # no destroy_process_group: nothing may hang on the way out


def run_pair(target, timeout, orchestrate=None):
    """Start 2 ranks of target(rank, port, q, *extra); collect what they put in q; always
    end both (SIGCONT first, in case one is stopped, then kill)."""
    ctx = mp.get_context("spawn")
    q, events = ctx.Queue(), [ctx.Event() for _ in range(3)]
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, port, q, events), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    out, deadline = {}, time.monotonic() + timeout
    try:
        if orchestrate is not None:
            return orchestrate(procs, q, events, deadline)
        while len(out) < 2 and time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                r, val = q.get(timeout=0.5)
                out[r] = val
            if len(out) < 2 and any(p.exitcode not in (None, 0) for p in procs):
                break
        return out
    finally:
        for p in procs:
            if p.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGCONT)
        events[2].set()
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


def _count_target(rank, port, q, events):
    count_worker(rank, port, q)


def fmt(d):
    return ", ".join(f"{k} x{v}" for k, v in sorted(d.items())) or "-"


def report_counts():
    out = run_pair(_count_target, timeout=120)
    if len(out) < 2 or any(isinstance(v, dict) for v in out.values()):
        print(
            "count run failed:", {r: (v if isinstance(v, dict) else "ok") for r, v in out.items()}
        )
        return
    r0, r1 = out[0], out[1]
    print("seq = collectives counted by the gloo backend (every path); kinds = CommDebugMode;")
    print("entry = wrapped Python functions (DTensor issues some ops below Python: trust seq)")
    print("rank 1's counts are shown only where they differ from rank 0's\n")
    print(f"{'operation':58s} {'seq':>3s}  {'CommDebugMode kinds':44s} Python entry points")
    for (name, a), (_, b) in zip(r0, r1, strict=True):
        if a.get("err") and "seq" not in a:
            print(f"{name:58s} ERROR {a['err']}")
            continue
        same = (
            ""
            if (a["seq"], a["kinds"]) == (b["seq"], b["kinds"])
            else f"  (rank 1: seq {b['seq']}, {fmt(b['kinds'])})"
        )
        err = f"  ERROR {a['err']}" if a["err"] else ""
        note = f"  [{a['note']}]" if a["note"] else ""
        print(f"{name:58s} {a['seq']:3d}  {fmt(a['kinds']):44s} {fmt(a['entry'])}{note}{same}{err}")


# ---- cross-check: SIGSTOP the peer -------------------------------------------------------


def run_bounded(fn, first_look, last_look):
    """Run fn in a thread; after first_look s note whether it is done and, if not, where it
    waits; then wait up to last_look more seconds for it to end (gloo's timeout)."""
    box = {}

    def body():
        t = time.perf_counter()
        try:
            fn()
            box["ok"] = True
        except Exception as e:
            box["err"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:150]}"
        box["s"] = time.perf_counter() - t

    th = threading.Thread(target=body, daemon=True)
    th.start()
    th.join(first_look)
    res = {"done_within_first_look": not th.is_alive()}
    if th.is_alive():
        frames = traceback.extract_stack(sys._current_frames()[th.ident])
        res["waiting_in"] = " > ".join(f"{f.name}" for f in frames[-4:])
        th.join(last_look)
    res.update(box)
    return res


def cross_worker(rank, port, q, events):
    try:
        mesh, _ = join_group(rank, port, pg_timeout=6)
        model = build(mesh)
        params = list(model.parameters())
        opt = optim.Adam(params, lr=1e-3)
        fwd_bwd(model, rank)
        dist.barrier()
        q.put((rank, {"ready": os.getpid()}))
        if rank == 1:
            events[2].wait(120)
            return
        events[0].wait(120)
        before = [p.to_local().clone() for p in params]
        res = run_bounded(opt.step, 3, 0)
        res["params_changed"] = any(
            not torch.equal(b, p.to_local()) for b, p in zip(before, params, strict=True)
        )
        q.put((rank, {"adam": res}))
        events[1].wait(120)
        q.put(
            (
                rank,
                {"clip": run_bounded(lambda: torch.nn.utils.clip_grad_norm_(params, 0.5), 3, 10)},
            )
        )
    except BaseException as e:
        q.put((rank, {"error": f"{type(e).__name__}: {e}", "tb": traceback.format_exc()}))
    finally:
        q.close()
        q.join_thread()  # flush the queue's feeder thread before the hard exit
        os._exit(0)


def proc_state(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "?"


def orchestrate(procs, q, events, deadline):
    got = {}
    while len(got) < 2 and time.monotonic() < deadline:
        r, val = q.get(timeout=max(0.1, deadline - time.monotonic()))
        if "error" in val:
            return {"error": val}
        got[r] = val
    os.kill(procs[1].pid, signal.SIGSTOP)
    time.sleep(0.3)
    res = {"peer_state": proc_state(procs[1].pid)}
    events[0].set()
    res.update(q.get(timeout=30)[1])
    events[1].set()
    res.update(q.get(timeout=30)[1])
    return res


def report_crosscheck():
    res = run_pair(cross_worker, timeout=90, orchestrate=orchestrate)
    print(f"peer (rank 1) state after SIGSTOP: {res.get('peer_state')} (T = stopped)")
    if "error" in res:
        print("cross-check failed:", res["error"])
        return
    a, c = res["adam"], res["clip"]
    print(
        f"rank 0 Adam optimizer.step() with the peer stopped: finished {a.get('ok', False)} in "
        f"{a.get('s', float('nan')) * 1e3:.1f} ms, params changed {a['params_changed']}"
    )
    print(
        f"rank 0 clip_grad_norm_ with the peer stopped (control): finished within 3 s "
        f"{c['done_within_first_look']}; waiting in {c.get('waiting_in')}; "
        f"ended after {c.get('s', float('nan')):.1f} s with {c.get('err') or 'no error'}"
    )


if __name__ == "__main__":
    t0 = time.perf_counter()
    print("torch", torch.__version__, "| 2 ranks, gloo, 3 x Linear, fully_shard each + root, SUM")
    report_counts()
    print()
    report_crosscheck()
    print(f"total {time.perf_counter() - t0:.0f} s")
