"""What the vote costs a DDP step, three ways interleaved in the same two processes.

    PYTHONPATH=src .venv/bin/python bench/vote.py [--size small] [--blocks 12] [--steps 150]

Each of 2 gloo workers holds three copies of ``bench/steps.py``'s MLP, each under its own
DDP, and trains them in turn, ``--steps`` steps a block, ``--blocks`` blocks each, so that
the machine's moods fall on all three alike: ``plain`` (DDP alone), ``all-reduce`` (plus
one all-reduce of the packed vote, started before the backward and waited for after it:
how phalanx voted before) and ``ballot`` (the vote carried by DDP's own gradient all-reduce,
:class:`phalanx.strategies.ddp.worker.ballot.Ballot`: how it votes now). Printed: medians over the
blocks of the wall time per step on rank 0, and its CPU time (all threads, main thread).
"""

from __future__ import annotations

import argparse
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

from phalanx.replica import StepModule, backward
from phalanx.strategies.ddp.worker.ballot import Ballot

WAYS = ("plain", "all-reduce", "ballot")
VOTE = 20  # float64 values in a packed vote (6 counts, 4 of the fingerprint, metric sums)


def _loss(model: nn.Module, batch: Any) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def _worker(rank: int, port: int, args: argparse.Namespace, out: Any) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    width, layers, batch = steps.SIZES[args.size]
    modules, ddps, opts = {}, {}, {}
    for way in WAYS:
        torch.manual_seed(0)
        modules[way] = StepModule(steps.make_model(width, layers), _loss)
        cpu = torch.device("cpu")
        wrapped = Ballot(modules[way], rank, 2, VOTE, cpu) if way == "ballot" else None
        ddps[way] = DistributedDataParallel(wrapped or modules[way])
        opts[way] = steps.make_optimizer(modules[way].model.parameters())
    x, y = steps.dataset(64 * batch).tensors
    local = batch // 2

    def step(way: str, i: int) -> None:
        at = (i % 64) * batch + rank * local
        loss, _, _ = ddps[way]((x[at : at + local], y[at : at + local]))
        packed = torch.full((VOTE,), float(loss.detach()), dtype=torch.float64)
        if way == "all-reduce":
            work = dist.all_reduce(packed, async_op=True)
            loss.backward()
            work.wait()
            packed.tolist()
        elif way == "ballot":
            box = ddps[way].module
            backward(loss, box.cast(packed.tolist()))  # (a list, as the engine casts)
            box.count()
        else:
            loss.backward()
        opts[way].step()
        opts[way].zero_grad(set_to_none=True)

    got: dict[str, list[tuple[float, float, float]]] = {w: [] for w in WAYS}
    for way in WAYS:  # warm-up (DDP rebuilds its buckets after the first step)
        for i in range(20):
            step(way, i)
    for _ in range(args.blocks):
        for way in WAYS:
            dist.barrier()
            cpu, main, wall = time.process_time(), time.thread_time(), time.perf_counter()
            for i in range(args.steps):
                step(way, i)
            n = args.steps / 1e3
            got[way].append(
                (
                    (time.perf_counter() - wall) / n,
                    (time.process_time() - cpu) / n,
                    (time.thread_time() - main) / n,
                )
            )
    if rank == 0:
        out.put(got)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="small")
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--steps", type=int, default=150)
    args = parser.parse_args(argv)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, store.port, args, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    got = out.get(timeout=1800)
    for p in procs:
        p.join()
    print(f"{args.size}, 2 workers, {args.blocks} blocks of {args.steps} steps, medians, rank 0:")
    print("| vote | wall ms/step | CPU ms/step | main thread CPU ms/step |")
    print("|---|---|---|---|")
    for way in WAYS:
        cols = list(zip(*got[way], strict=True))
        print(f"| {way} | " + " | ".join(f"{statistics.median(c):.3f}" for c in cols) + " |")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
