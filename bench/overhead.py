"""phalanx ddp against plain torch DDP, side by side, and the time from a fault to its report.

    .venv/bin/python bench/overhead.py [--rounds 3] [--steps 30] [--workers 2]
                                       [--widths 2048,4096]

Step time: both run the same MLP on the same data with the same global batch and world
size over gloo on CPU, interleaved round by round; each round's step time is the median
interval between consecutive steps on rank 0 (startup and the first steps excluded). The
table reports the median over rounds and the ratio phalanx / DDP, one row per hidden width
(2048: 8.9 M parameters; 4096: 34.7 M, where compute dominates more).

Fault to report: for each fault kind a run is started with the fault at step 8; the time
is measured from the last step committed before the fault (an upper bound on the time from
the fault itself) to the moment ``fit`` raised ``TrainingFailed``.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

import phalanx as px
from phalanx.events import Event, StepEnded
from phalanx.plan import Plan, split

WIDTH = 2048
FEATURES = 256
SAMPLES = 8192
BATCH = 256


def make_model(width: int = WIDTH) -> nn.Module:
    return nn.Sequential(
        nn.Linear(FEATURES, width),
        nn.ReLU(),
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, 10),
    )


def make_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def train_step(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    return TensorDataset(x, torch.randint(0, 10, (SAMPLES,), generator=g))


# -- plain torch DDP ---------------------------------------------------------------------
def plain_training(
    rank: int, world: int, port: int, steps: int, threads: int, width: int
) -> Iterator[None]:
    """Plain DDP training of rank ``rank``: yields after each optimizer step."""
    torch.set_num_threads(threads)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    torch.manual_seed(0)
    model = DistributedDataParallel(make_model(width))
    opt = make_optimizer(model.parameters())
    data = dataset()
    plan = Plan(len(data), BATCH, seed=0)
    order = plan.order(0)
    slices = [split(plan.global_batch(0, s, order), world)[rank] for s in range(steps)]
    for x, y in DataLoader(data, batch_sampler=slices):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        yield
    dist.destroy_process_group()


def _plain_worker(
    rank: int, world: int, port: int, steps: int, threads: int, out: Any, width: int
) -> None:
    stamps = []
    for _ in plain_training(rank, world, port, steps, threads, width):
        stamps.append(time.perf_counter())
    if rank == 0:
        out.put(stamps)


def plain_ddp(steps: int, world: int, width: int = WIDTH) -> float:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    threads = max(1, (os.cpu_count() or 1) // world)
    procs = [
        ctx.Process(target=_plain_worker, args=(r, world, store.port, steps, threads, out, width))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    stamps = out.get(timeout=600)
    for p in procs:
        p.join()
    return _median_interval(stamps)


# -- phalanx ddp -------------------------------------------------------------------------
class Stamps:
    def __init__(self) -> None:
        self.times: list[float] = []
        self.last_step_time = 0.0

    def handle(self, event: Event) -> None:
        if isinstance(event, StepEnded):
            self.times.append(event.time)
            self.last_step_time = time.time()

    def close(self) -> None:
        pass


def train_phalanx(
    steps: int, world: int, width: int, sink: Any, preflight: bool = False, **fit: Any
) -> None:
    """phalanx ddp on the same model and data as plain DDP: exactly ``steps`` steps (one
    epoch over a dataset cut to ``steps * BATCH`` samples)."""
    learner = px.Learner(functools.partial(make_model, width), make_optimizer, train_step)
    subset = torch.utils.data.Subset(dataset(), range(steps * BATCH))
    learner.fit(
        subset,
        epochs=1,
        batch_size=BATCH,
        strategy="ddp",
        devices=",".join(f"cpu:{i}" for i in range(world)),
        sinks=[sink],
        preflight=preflight,
        shuffle=True,
        **fit,
    )


def phalanx_ddp(steps: int, world: int, width: int = WIDTH) -> float:
    sink = Stamps()
    train_phalanx(steps, world, width, sink)
    return _median_interval(sink.times)


def _median_interval(stamps: list[float]) -> float:
    warm = stamps[3:]  # the first steps include bucket rebuilds and warm-up
    return statistics.median(b - a for a, b in itertools.pairwise(warm))


def fault_to_report(kind: str, world: int) -> float:
    sink = Stamps()
    learner = px.Learner(make_small, make_optimizer_small, small_step)
    data = TensorDataset(torch.randn(2048, 16), torch.randint(0, 2, (2048,)))
    times = 99 if kind == "oom" else 2  # an OOM that splitting cannot absorb
    fault = px.Fault(kind, worker=world - 1, step=8, times=times)
    with tempfile.TemporaryDirectory() as run_dir:
        try:
            learner.fit(
                data,
                epochs=1,
                batch_size=64,
                strategy="ddp",
                run_dir=run_dir,
                devices=",".join(f"cpu:{i}" for i in range(world)),
                sinks=[sink],
                faults=[fault],
                on_failure=px.Recovery(mode="abort"),  # the report is what is timed here
                hang_timeout=timedelta(seconds=3),
            )
        except px.TrainingFailed:
            return time.time() - sink.last_step_time
    raise RuntimeError(f"the {kind} fault did not stop the run")


def make_small() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))


def make_optimizer_small(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def small_step(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--widths", default="2048,4096", help="hidden widths, one row each")
    parser.add_argument("--skip-faults", action="store_true")
    args = parser.parse_args(argv)
    rows = []
    for width in (int(w) for w in args.widths.split(",")):
        plain, ours = [], []
        for r in range(args.rounds):
            plain.append(plain_ddp(args.steps, args.workers, width))
            ours.append(phalanx_ddp(args.steps, args.workers, width))
            print(
                f"width {width}, round {r + 1}: DDP {plain[-1] * 1e3:.1f} ms/step, "
                f"phalanx {ours[-1] * 1e3:.1f} ms/step",
                file=sys.stderr,
            )
        p, o = statistics.median(plain), statistics.median(ours)
        params = sum(t.numel() for t in make_model(width).parameters()) / 1e6
        rows.append(
            f"| {args.workers} | {params:.1f} M | {BATCH} | {p * 1e3:.1f} | {o * 1e3:.1f} "
            f"| {o / p:.3f}x |"
        )
    print(
        "\n| workers | model params | global batch | torch DDP ms/step | phalanx ms/step "
        "| ratio |\n|---|---|---|---|---|---|"
    )
    print("\n".join(rows))
    if not args.skip_faults:
        print("\n| fault (last rank, step 8) | last committed step -> TrainingFailed |\n|---|---|")
        for kind in ("exception", "kill", "oom", "hang"):
            print(f"| {kind} | {fault_to_report(kind, args.workers):.2f} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
