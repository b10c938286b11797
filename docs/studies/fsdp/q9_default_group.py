"""Q9 (PLAN.md E1): destroy torch's DEFAULT gloo group while one of its collectives is still
in flight with a peer that is frozen (SIGSTOP, sockets open) or dead (SIGKILL), then form the
next generation's default group right away.
3 spawned processes; rank 2 is the victim. Generation 0 = init_process_group on the prefix
c<case>/g0/ of a TCPStore hosted by this (parent) process, world size 3, gloo timeout
GLOO_TIMEOUT s; one warm-up all_reduce. Then ranks 0 and 1 start an all_reduce that rank 2
never joins, either
  thread: a plain (synchronous) dist.all_reduce in a helper thread (a worker blocked in it), or
  async : dist.all_reduce(..., async_op=True), and the survivor never waits on its Work;
the parent then SIGSTOPs or SIGKILLs rank 2 and, 0.2 s later, the survivors call
dist.destroy_process_group() (timed), init_process_group on c<case>/g1/ with ranks 0,1 and
world size 2 (timed), an all_reduce, and an FSDP2 fully_shard forward/backward of common.mlp.
Variants: keep = hold a Python reference to the old group (dist.group.WORLD) across the destroy
and drop it only once its in-flight work has ended; sub = the in-flight collective is on a
non-default group (dist.new_group), destroyed with destroy_process_group(sub).
Also recorded: OS threads of the survivor before/after, what became of the abandoned
collective, whether each group object outlives its destroy (weakref; then gc.collect()), and
how the survivor's process exits (normal Python shutdown; faulthandler prints a crash), with
kill-thread repeated EXIT_REPEATS more times for that. Each case has a hard timeout; every
child is killed at the end. About 80 s on 2 cores."""

import faulthandler
import gc
import json
import os
import signal
import sys
import threading
import time
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from common import data, mlp, shard, sum_reduction

GLOO_TIMEOUT = 5.0  # s, generation 0's collective timeout
CASE_LIMIT = 35.0  # s, hard limit of one case (then every child is killed)
EXIT_REPEATS = 6  # extra kill-thread runs, for how often a survivor's exit aborts
CASES = [  # (name, signal, how the collective is in flight, variant)
    ("stop-thread", "STOP", "thread", ""),
    ("stop-async", "STOP", "async", ""),
    ("kill-thread", "KILL", "thread", ""),
    ("kill-async", "KILL", "async", ""),
    ("stop-async-keep", "STOP", "async", "keep"),
    ("stop-thread-keep", "STOP", "thread", "keep"),
    ("stop-async-sub", "STOP", "async", "sub"),
]


def os_threads() -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("Threads:")).split()[1])


def short(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][-90:]}"


class InFlight:
    """One all_reduce of the old group that rank 2 never joins; how it ends is recorded."""

    def __init__(self, how: str, group=None):
        self.t0, self.ended, self.outcome = time.monotonic(), None, "pending"
        self.tensor = torch.ones(4)
        self.work, self.thread = None, None
        if how == "async":
            self.work = dist.all_reduce(self.tensor, async_op=True, group=group)
        else:
            self.thread = threading.Thread(target=self._run, args=(group,), daemon=True)
            self.thread.start()

    def _run(self, group):
        try:
            dist.all_reduce(self.tensor, group=group)
            self.outcome = f"returned {self.tensor.tolist()}"
        except BaseException as e:
            self.outcome = short(e)
        self.ended = time.monotonic()

    def done(self) -> bool:
        if self.thread is not None:
            return not self.thread.is_alive()
        return self.work.is_completed()  # (never wait()ed: only polled)

    def report(self) -> str:
        if self.thread is not None:
            at = f" at +{self.ended - self.t0:.2f}s" if self.ended else ""
            return f"thread: {self.outcome}{at}" if self.done() else "thread: still blocked"
        return f"async Work.is_completed()={self.work.is_completed()}"


class Notes(dict):
    """The child's results, also written to the store as they come (a hung case shows how far
    it got)."""

    def __init__(self, store, key):
        super().__init__()
        self.store, self.key = store, key

    def __setitem__(self, k, v):
        super().__setitem__(k, v)
        self.store.set(self.key, json.dumps(self))


def fsdp_step(ws: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (ws,))
    model = shard(mlp(width=16, depth=2), mesh)
    sum_reduction(model)
    x, y = data(8, seed=3)
    r = dist.get_rank()
    loss = F.cross_entropy(model(x[r * 4 : r * 4 + 4]), y[r * 4 : r * 4 + 4], reduction="sum") / 8
    loss.backward()
    g = model.inp.weight.grad
    return f"loss {loss.item():.4f}, grad {tuple(g.to_local().shape)} of {tuple(g.shape)}"


def child(rank: int, port: int, case: str, sig: str, how: str, variant: str):
    torch.set_num_threads(1)
    faulthandler.enable()  # (a crash prints every thread's Python stack)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    out = Notes(store, f"{case}/progress{rank}")
    t = time.monotonic()
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(f"{case}/g0/", store),
        rank=rank,
        world_size=3,
        timeout=timedelta(seconds=GLOO_TIMEOUT),
    )
    # (new_group's own timeout is 30 min unless given: it does not inherit the default group's)
    sub = (
        dist.new_group([0, 1, 2], timeout=timedelta(seconds=GLOO_TIMEOUT))
        if variant == "sub"
        else None
    )
    w = torch.ones(1)
    dist.all_reduce(w, group=sub)
    out["g0"] = f"form+warm-up {time.monotonic() - t:.2f}s (sum {w.item():.0f})"
    if rank == 2:  # the victim: waits to be stopped or killed
        store.set(f"{case}/victim_ready", "1")
        time.sleep(120)
        os._exit(3)
    store.wait([f"{case}/victim_ready"])
    flight = InFlight(how, group=sub)
    store.set(f"{case}/inflight{rank}", "1")
    store.wait([f"{case}/signalled"])
    time.sleep(0.2)
    out["in flight at destroy"] = not flight.done()
    out["threads before"] = os_threads()
    g0 = weakref.ref(dist.group.WORLD)
    old = dist.group.WORLD if variant == "keep" else None  # (public attribute)
    try:
        if sub is not None:
            t = time.monotonic()
            dist.destroy_process_group(sub)
            out["destroy(sub)"] = f"{time.monotonic() - t:.3f}s"
            sub = None  # (the last reference of this process)
            out["after dropping sub"] = f"+{time.monotonic() - t:.3f}s"
        t = time.monotonic()
        dist.destroy_process_group()
        out["destroy"] = f"{time.monotonic() - t:.3f}s"
    except BaseException as e:
        out["destroy"] = f"{time.monotonic() - t:.3f}s, raised {short(e)}"
    out["since collective start"] = f"{time.monotonic() - flight.t0:.2f}s"
    out["threads after destroy"] = os_threads()
    out["old collective after destroy"] = flight.report()
    out["g0 object after destroy"] = "alive" if g0() else "freed"
    try:
        t = time.monotonic()
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore(f"{case}/g1/", store),
            rank=rank,
            world_size=2,
            timeout=timedelta(seconds=10),
        )
        out["g1 init"] = f"{time.monotonic() - t:.3f}s"
        g1 = weakref.ref(dist.group.WORLD)
        v = torch.tensor([rank + 1.0])
        dist.all_reduce(v)
        out["g1 all_reduce"] = f"{v.item():.0f} (expect 3)"
        t = time.monotonic()
        out["g1 fsdp fwd/bwd"] = f"{fsdp_step(2)} in {time.monotonic() - t:.2f}s"
        dist.destroy_process_group()
        alive = "alive" if g1() else "freed"
        gc.collect()
        out["g1 object after its destroy"] = (
            f"{alive}, after gc.collect() {'alive' if g1() else 'freed'}"
        )
    except BaseException as e:
        out["g1 error"] = short(e)
    # what became of the abandoned collective once the old timeout has passed
    deadline = flight.t0 + GLOO_TIMEOUT + 3
    while not flight.done() and time.monotonic() < deadline:
        time.sleep(0.1)
    out["old collective later"] = f"{flight.report()} (+{time.monotonic() - flight.t0:.1f}s)"
    out["threads later"] = os_threads()
    out["g0 object later"] = "alive" if g0() else "freed"
    if old is not None:
        t = time.monotonic()
        old = None  # drop the kept group now that its work has ended
        out["drop kept group"] = f"{time.monotonic() - t:.3f}s, threads {os_threads()}"
    store.set(f"{case}/result{rank}", json.dumps(out))
    # return: the process exits through Python's normal shutdown (timed by the parent)


def run_case(ctx, store, port, case, sig, how, variant):
    procs = [
        ctx.Process(target=child, args=(r, port, case, sig, how, variant), daemon=True)
        for r in range(3)
    ]
    for p in procs:
        p.start()
    t_start = time.monotonic()
    lines, codes = [], []
    try:
        store.wait([f"{case}/inflight0", f"{case}/inflight1"], timedelta(seconds=CASE_LIMIT))
        time.sleep(0.2)
        os.kill(procs[2].pid, getattr(signal, f"SIG{sig}"))
        store.set(f"{case}/signalled", "1")
        keys = [f"{case}/result0", f"{case}/result1"]
        remaining = CASE_LIMIT - (time.monotonic() - t_start)
        store.wait(keys, timedelta(seconds=max(remaining, 1)))
        t_results = time.monotonic()
        for r in (0, 1):
            out = json.loads(store.get(keys[r]))
            lines.append(f"  rank{r}: " + "; ".join(f"{k} {v}" for k, v in out.items()))
        for r in (0, 1):
            procs[r].join(timeout=max(1.0, CASE_LIMIT - (time.monotonic() - t_start)))
            alive = procs[r].is_alive()
            codes.append("hung" if alive else procs[r].exitcode)
            lines.append(
                f"  rank{r} process: "
                + (
                    "STILL ALIVE at the case limit (exit hangs)"
                    if alive
                    else f"exit code {procs[r].exitcode}, exited {time.monotonic() - t_results:.2f}s after its results"
                )
            )
    except Exception as e:
        lines.append(f"  CASE FAILED after {time.monotonic() - t_start:.1f}s: {short(e)}")
        for r in (0, 1):
            if store.check([f"{case}/progress{r}"]):
                lines.append(
                    f"  rank{r} got as far as: {store.get(f'{case}/progress{r}').decode()}"
                )
    finally:
        for p in procs:  # SIGKILL also ends a stopped process
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
    return lines, codes


def main():
    print(f"torch {torch.__version__}; gloo timeout of generation 0: {GLOO_TIMEOUT:g}s")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    t_all = time.monotonic()
    only = sys.argv[1:]  # (optional: case names to run, e.g. for repeating one)
    for i, (case, sig, how, variant) in enumerate(
        c for name in only or [None] for c in CASES if name in (None, c[0])
    ):
        case = f"{case}#{i}" if only else case
        t = time.monotonic()
        print(f"\n== {case}: SIG{sig}, in flight via {how}{', ' + variant if variant else ''}")
        for line in run_case(ctx, store, store.port, case, sig, how, variant)[0]:
            print(line)
        print(f"  (case {time.monotonic() - t:.1f}s)", flush=True)
    if not only:  # the survivors' exit is not always clean in kill-thread: repeat it
        t, codes = time.monotonic(), []
        for i in range(EXIT_REPEATS):
            codes += run_case(ctx, store, store.port, f"kill-thread-r{i}", "KILL", "thread", "")[1]
        print(
            f"\n== kill-thread again x{EXIT_REPEATS}: survivors' exit codes {codes} ({time.monotonic() - t:.1f}s)"
        )
    print(f"\ntotal {time.monotonic() - t_all:.1f}s")


if __name__ == "__main__":
    main()
