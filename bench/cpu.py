"""CPU time and wake-ups per step of each process, phalanx ddp next to plain DDP.

    PYTHONPATH=src .venv/bin/python bench/cpu.py [--rounds 3] [--steps 400] [--size small]
                                                [--arms floor,floor+vote,phalanx] [--workers 2]

Wall-clock step times on a shared 2-core machine move by 30% between rounds; the CPU time a
process consumes over a fixed number of steps moves less: it does not count the time spent
waiting for a core. Each arm trains ``bench/steps.py``'s MLP on ``--workers`` workers (2; 1:
phalanx's own cost with no peer to wait for) for ``--steps`` steps; between step ``WARM``
and the last step, the CPU time (user + system: of every thread, and of the main thread
alone, which leaves out gloo's socket and work threads) and the context switches (voluntary:
a wait, a wake-up; involuntary: preempted) of each process are read from ``/proc`` and
divided by the steps between. The processes: each worker, and the parent: phalanx's
supervisor (the ``fit`` caller) or plain DDP's launcher (idle in ``Queue.get``). The arms:
``floor`` (plain DDP slicing its tensors, as in ``bench/steps.py``, reading the loss each
step as phalanx does), ``floor+vote`` (the floor plus one all-reduce of 20 float64 launched
before backward and waited for after it: phalanx's vote alone) and ``phalanx``
(``fit(strategy="ddp", preflight=False)``). ``wall`` is rank 0's mean step interval over the
same steps. Linux only.
"""

from __future__ import annotations

import argparse
import functools
import glob
import os
import statistics
import sys
import time
from typing import Any

import steps  # bench/steps.py, beside this file: the model, data and helpers
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from phalanx.events import Event, StepEnded
from phalanx.plan import Plan, split

WARM = 20
TICK = os.sysconf("SC_CLK_TCK")
Usage = tuple[float, float, int, int]  # see usage()


def _cpu(path: str) -> float:
    """CPU seconds (user + system) of a /proc stat file."""
    with open(path) as fh:
        stat = fh.read().rsplit(")", 1)[1].split()
    return (int(stat[11]) + int(stat[12])) / TICK  # utime, stime (fields 14, 15)


def usage(pid: int | None = None) -> tuple[float, float, int, int]:
    """(CPU seconds of every thread, of the main thread, voluntary and involuntary context
    switches of every thread)."""
    pid = pid or os.getpid()
    vol = inv = 0
    for path in glob.glob(f"/proc/{pid}/task/*/status"):
        try:
            with open(path) as fh:
                for line in fh:
                    if line.startswith("voluntary_ctxt_switches"):
                        vol += int(line.split()[1])
                    elif line.startswith("nonvoluntary_ctxt_switches"):
                        inv += int(line.split()[1])
        except OSError:
            continue
    return _cpu(f"/proc/{pid}/stat"), _cpu(f"/proc/{pid}/task/{pid}/stat"), vol, inv


def delta(a: Usage, b: Usage, n: int) -> list[float]:
    """Per step: CPU ms (all threads, main thread), voluntary and involuntary switches."""
    return [(b[0] - a[0]) * 1e3 / n, (b[1] - a[1]) * 1e3 / n, (b[2] - a[2]) / n, (b[3] - a[3]) / n]


# -- plain DDP (the floor) -------------------------------------------------------------------
def _floor(rank: int, world: int, port: int, n: int, size: str, vote: bool, out: Any) -> None:
    width, layers, batch = steps.SIZES[size]
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    torch.manual_seed(0)
    model = DistributedDataParallel(steps.make_model(width, layers))
    opt = steps.make_optimizer(model.parameters())
    data = steps.dataset(n * batch)
    plan = Plan(len(data), batch, seed=0)
    order = plan.order(0)
    x, y = data.tensors
    marks: dict[int, Usage] = {}
    t = [0.0, 0.0]
    packed = torch.zeros(20, dtype=torch.float64)
    for s in range(n):
        idx = torch.tensor(split(plan.global_batch(0, s, order), world)[rank])
        loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        work = dist.all_reduce(packed, async_op=True) if vote else None
        loss.backward()
        if work is not None:  # phalanx's vote: launched before backward, waited for after
            work.wait()
        opt.step()
        loss.item()  # (phalanx reads the loss each step too)
        if s + 1 in (WARM, n):
            marks[s + 1] = usage()
            t[s + 1 == n] = time.time()
    out.put((rank, delta(marks[WARM], marks[n], n - WARM), (t[1] - t[0]) / (n - WARM)))
    dist.destroy_process_group()


def floor_run(n: int, size: str, vote: bool = False, world: int = 2) -> dict[str, list[float]]:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_floor, args=(r, world, store.port, n, size, vote, out))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    before = usage()
    results = sorted(out.get(timeout=900) for _ in procs)
    after = usage()  # (from the spawn on: an upper bound on the launcher's share)
    for p in procs:
        p.join()
    found = {f"rank {r}": d for r, d, _ in results}
    found["parent"] = delta(before, after, n - WARM)
    found["wall"] = [results[0][2] * 1e3]
    return found


# -- phalanx ---------------------------------------------------------------------------------
class Marks:
    """In the supervisor: /proc of itself and of each worker at step WARM and the last."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.marks: dict[int, dict[str, Usage]] = {}
        self.times: dict[int, float] = {}

    def handle(self, event: Event) -> None:
        if isinstance(event, StepEnded) and event.global_step in (WARM, self.n):
            kids = sorted((c.pid for c in mp.active_children() if c.pid), key=int)
            here = {f"worker {i}": usage(pid) for i, pid in enumerate(kids)}
            here["parent"] = usage()
            self.marks[event.global_step] = here
            self.times[event.global_step] = event.time

    def close(self) -> None:
        pass

    def result(self) -> dict[str, list[float]]:
        a, b = self.marks[WARM], self.marks[self.n]
        found = {k: delta(a[k], b[k], self.n - WARM) for k in a}
        found["wall"] = [(self.times[self.n] - self.times[WARM]) * 1e3 / (self.n - WARM)]
        return found


def phalanx_run(n: int, size: str, world: int = 2) -> dict[str, list[float]]:
    marks = Marks(n)
    steps.phalanx_fit(n, size, ",".join(f"cpu:{i}" for i in range(world)), marks)
    return marks.result()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--size", default="small")
    parser.add_argument("--arms", default="floor,phalanx")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    runners = {
        "floor": floor_run,
        "floor+vote": functools.partial(floor_run, vote=True),
        "phalanx": phalanx_run,
    }
    arms = args.arms.split(",")
    got: dict[str, list[dict[str, list[float]]]] = {a: [] for a in arms}
    for r in range(args.rounds):
        for arm in arms:
            got[arm].append(runners[arm](args.steps, args.size, world=args.workers))
            print(f"round {r + 1} {arm}: {got[arm][-1]}", file=sys.stderr, flush=True)
    head = f"{args.size}, {args.workers} workers, {args.steps} steps"
    print(f"\n{head}, median of {args.rounds} rounds, per step:")
    print("| arm | process | CPU ms | main thread CPU ms | voluntary switches | involuntary |")
    print("|---|---|---|---|---|---|")
    for arm in arms:
        for proc in got[arm][0]:
            cols = zip(*(run[proc] for run in got[arm]), strict=True)
            cells = " | ".join(f"{statistics.median(c):.3f}" for c in cols)
            print(f"| {arm} | {proc} | {cells} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
