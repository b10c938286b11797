"""Per-step cost and start-up of phalanx ddp next to what a user would write instead.

    .venv/bin/python bench/steps.py [--rounds 3] [--steps 200] [--workers 2]
                                    [--sizes small,medium,large] [--skip-startup]
                                    [--skip-threads] [--arms floor,loader,phalanx,fabric]
                                    [--marginal 100,400 [--marginal-sizes medium]]
                                    [--skip-steps]

Every arm trains the same MLP on the same data (a ``TensorDataset`` of 256 features, 10
classes) with the same global batch, world size and torch threads per worker (cores /
workers), on CPU over gloo. The arms:

- ``floor``: plain DDP, each rank indexing its slice of the plan's global batch straight out
  of the tensors (no DataLoader): the least a data-parallel step can cost;
- ``floor+vote`` (not in the default arms): ``floor`` plus one all-reduce of 16 float64
  numbers after backward, what a vote of its own costs;
- ``loader``: plain DDP with ``DataLoader`` + ``DistributedSampler`` (what users write);
- ``phalanx``: ``Learner.fit(strategy="ddp")``, no sinks but the stamps, no run_dir;
- ``fabric``: Lightning Fabric (``strategy="ddp"``, launched through ``fabric.launch``), when
  ``lightning`` imports (a dev-only extra; the arm is skipped otherwise).

A run's step time is the mean interval between consecutive optimizer steps on rank 0 after
the first 10 (start-up, DDP's bucket rebuild and warm-up excluded); arms alternate round by
round and the table gives each arm's median over rounds and its ratio to ``floor`` and to
``loader``. Three model sizes give about 5 ms, 15 ms and over 100 ms a step on the
development machine (2 cores).

Memory: the peak RSS (``VmHWM``) of each worker process, from the step table's own runs: a
plain DDP rank reads its own after its last step, phalanx's are read by the bench process
(the supervisor) from ``/proc/<pid>/status`` at the last committed step; the table gives the
largest worker's, median over rounds (Linux only).

Start-up: the time from calling ``fit`` (phalanx) or ``mp.spawn`` (plain DDP, the same model
and data) to the first committed step on rank 0, and how often the model factory ran.

Threads: ``strategy="threads"`` on ``cpu:0,cpu:1`` against a plain single-process loop over
the same global batch (one process, all cores), and ``strategy="single"`` against the same.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import phalanx as px
from phalanx.events import Event, StepEnded
from phalanx.plan import Plan, split

FEATURES = 256
CLASSES = 10
WARM = 10  # steps left out of every mean: start-up, bucket rebuild, warm-up
# name -> (hidden width, hidden layers, global batch)
SIZES = {
    "small": (256, 2, 128),  # ~0.13 M params, ~5 ms a step
    "medium": (832, 3, 128),  # ~1.6 M params, ~15 ms a step (the case)
    "large": (2048, 3, 256),  # ~8.9 M params, >= 100 ms a step
}


def make_model(width: int, layers: int) -> nn.Module:
    mods: list[nn.Module] = [nn.Linear(FEATURES, width), nn.ReLU()]
    for _ in range(layers - 1):
        mods += [nn.Linear(width, width), nn.ReLU()]
    mods.append(nn.Linear(width, CLASSES))
    return nn.Sequential(*mods)


def make_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def train_step(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def dataset(samples: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(samples, FEATURES, generator=g)
    return TensorDataset(x, torch.randint(0, CLASSES, (samples,), generator=g))


# The largest worker's peak RSS (kB) of the last run of each runner (None: not readable).
LAST_PEAK: dict[str, int | None] = {"kb": None}


def peak_kb(pid: int | str = "self") -> int | None:
    """A process's peak resident set (``VmHWM``), in kB; None where /proc cannot tell."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmHWM"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def mean_interval(stamps: list[float]) -> float:
    warm = stamps[WARM:]
    return (warm[-1] - warm[0]) / (len(warm) - 1)


# -- plain torch DDP (floor and loader) -----------------------------------------------------
CALLS = "PHALANX_BENCH_FACTORY_CALLS"


class Counted:
    """A model factory that counts its calls in a file (one line per call, any process)."""

    def __init__(self, path: str, width: int, layers: int) -> None:
        self.path, self.width, self.layers = path, width, layers

    def __call__(self) -> nn.Module:
        with open(self.path, "a") as fh:
            fh.write(f"{os.getpid()}\n")
        return make_model(self.width, self.layers)


def _plain(
    rank: int, world: int, port: int, steps: int, size: str, arm: str, out: Any, t0: float
) -> None:
    width, layers, batch = SIZES[size]
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    torch.manual_seed(0)
    model = DistributedDataParallel(make_model(width, layers))
    opt = make_optimizer(model.parameters())
    data = dataset(steps * batch)
    stamps: list[float] = []
    if arm in ("floor", "floor+vote"):
        plan = Plan(len(data), batch, seed=0)
        order = plan.order(0)
        x, y = data.tensors
        vote = torch.zeros(16, dtype=torch.float64)
        for s in range(steps):
            idx = torch.tensor(split(plan.global_batch(0, s, order), world)[rank])
            loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            if arm == "floor+vote":  # what one more small all-reduce a step costs
                vote.zero_()
                dist.all_reduce(vote)
            opt.step()
            stamps.append(time.time())
    else:
        sampler = DistributedSampler(data, world, rank, shuffle=True, seed=0)
        sampler.set_epoch(0)
        for xb, yb in DataLoader(data, batch_size=batch // world, sampler=sampler):
            loss = nn.functional.cross_entropy(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            stamps.append(time.time())
    out.put((rank, stamps, peak_kb()))
    dist.destroy_process_group()


def plain_ddp(arm: str, steps: int, world: int, size: str) -> list[float]:
    """Rank 0's step stamps (time.time()); the first is the first committed step."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    t0 = time.time()
    procs = [
        ctx.Process(target=_plain, args=(r, world, store.port, steps, size, arm, out, t0))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results = [out.get(timeout=900) for _ in procs]
    for p in procs:
        p.join()
    stamps: list[float] = next(st for rank, st, _ in results if rank == 0)
    peaks = [kb for _, _, kb in results if kb is not None]
    LAST_PEAK["kb"] = max(peaks) if peaks else None
    return [t0, *stamps]


# -- phalanx ---------------------------------------------------------------------------------
class Stamps:
    """Each committed step's time; at the run's last step, the workers' peak RSS (read then
    only, so the supervisor does no extra work during the steps that are timed)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.peak: int | None = None

    def handle(self, event: Event) -> None:
        if isinstance(event, StepEnded):
            self.times.append(event.time)
            if event.global_step == event.steps_in_epoch:  # (one epoch: the last step)
                peaks = [peak_kb(c.pid) for c in mp.active_children() if c.pid]
                self.peak = max((kb for kb in peaks if kb is not None), default=None)

    def close(self) -> None:
        pass


def phalanx_run(
    steps: int,
    world: int,
    size: str,
    strategy: str = "ddp",
    model: Callable[[], nn.Module] | None = None,
    **fit: Any,
) -> list[float]:
    width, layers, batch = SIZES[size]
    sink = Stamps()
    factory = model or functools.partial(make_model, width, layers)
    learner = px.Learner(factory, make_optimizer, train_step)
    devices = ",".join(f"cpu:{i}" for i in range(world)) if strategy != "single" else "cpu"
    t0 = time.time()
    learner.fit(
        dataset(steps * batch),
        epochs=1,
        batch_size=batch,
        strategy=strategy,
        devices=devices,
        sinks=[sink],
        shuffle=True,
        **fit,
    )
    LAST_PEAK["kb"] = sink.peak
    return [t0, *sink.times]


def phalanx_fit(steps: int, size: str, devices: str, sink: Any) -> None:
    """One epoch of ``steps`` steps of the bench's ``size`` model under phalanx ddp on
    ``devices`` (no preflight), its events to ``sink``: the other benches' phalanx arm."""
    width, layers, batch = SIZES[size]
    factory = functools.partial(make_model, width, layers)
    px.Learner(factory, make_optimizer, train_step).fit(
        dataset(steps * batch),
        epochs=1,
        batch_size=batch,
        strategy="ddp",
        devices=devices,
        sinks=[sink],
        shuffle=True,
        preflight=False,
    )


# -- Lightning Fabric --------------------------------------------------------------------------
def _fabric_main(fabric: Any, steps: int, size: str, out: str) -> None:
    width, layers, batch = SIZES[size]
    torch.manual_seed(0)
    model = make_model(width, layers)
    opt = make_optimizer(model.parameters())
    model, opt = fabric.setup(model, opt)
    data = dataset(steps * batch)
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=batch // fabric.world_size))
    stamps = []
    for xb, yb in loader:
        loss = nn.functional.cross_entropy(model(xb), yb)
        opt.zero_grad()
        fabric.backward(loss)
        opt.step()
        stamps.append(time.time())
    if fabric.global_rank == 0:
        with open(out, "w") as fh:
            fh.write("\n".join(map(str, stamps)))


def fabric_ddp(steps: int, world: int, size: str, tries: int = 3) -> list[float]:
    """Rank 0's step stamps under Fabric. Lightning's spawn launcher sometimes aborts a
    process at its start (``terminate called without an active exception``, SIGABRT): that
    run is started again, up to ``tries`` times, and said on stderr."""
    from lightning.fabric import Fabric  # type: ignore[import-not-found]

    threads = max(1, (os.cpu_count() or 1) // world)
    for attempt in range(tries):
        fabric = Fabric(accelerator="cpu", devices=world, strategy="ddp_spawn")
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "stamps")
            t0 = time.time()
            try:
                fabric.launch(functools.partial(_fabric_entry, threads, steps, size, out))
            except mp.ProcessExitedException as exc:
                print(f"fabric run {attempt + 1} of {tries} failed: {exc}", file=sys.stderr)
                continue
            with open(out) as fh:
                return [t0, *(float(line) for line in fh)]
    raise RuntimeError(f"Fabric's launcher failed {tries} times in a row")


def _fabric_entry(threads: int, steps: int, size: str, out: str, fabric: Any) -> None:
    torch.set_num_threads(threads)
    _fabric_main(fabric, steps, size, out)


def fabric_available() -> bool:
    try:
        import lightning.fabric  # type: ignore[import-not-found]  # noqa: F401
    except Exception:
        return False
    return True


# -- tables --------------------------------------------------------------------------------
def step_table(args: argparse.Namespace) -> None:
    arms = [a for a in args.arms.split(",") if a != "fabric" or fabric_available()]
    if "fabric" in args.arms and "fabric" not in arms:
        print("(lightning is not installed: no fabric column)", file=sys.stderr)
    runners: dict[str, Callable[[str], list[float]]] = {
        "floor": lambda s: plain_ddp("floor", args.steps, args.workers, s),
        "floor+vote": lambda s: plain_ddp("floor+vote", args.steps, args.workers, s),
        "loader": lambda s: plain_ddp("loader", args.steps, args.workers, s),
        "phalanx": lambda s: phalanx_run(args.steps, args.workers, s, preflight=False),
        "fabric": lambda s: fabric_ddp(args.steps, args.workers, s),
    }
    head = " | ".join(f"{a} ms/step" for a in arms)
    print(f"\n| model | params | global batch | {head} | phalanx/floor | phalanx/loader |")
    print("|---" * (5 + len(arms)) + "|")
    memory: list[str] = []
    for size in args.sizes.split(","):
        width, layers, batch = SIZES[size]
        times: dict[str, list[float]] = {a: [] for a in arms}
        peaks: dict[str, list[int]] = {a: [] for a in arms}
        for r in range(args.rounds):
            for arm in arms:
                LAST_PEAK["kb"] = None
                times[arm].append(mean_interval(runners[arm](size)[1:]))
                if LAST_PEAK["kb"] is not None:
                    peaks[arm].append(LAST_PEAK["kb"])
            line = ", ".join(f"{a} {times[a][-1] * 1e3:.2f}" for a in arms)
            print(f"{size}, round {r + 1}: {line} ms/step", file=sys.stderr)
        med = {a: statistics.median(v) for a, v in times.items()}
        params = sum(p.numel() for p in make_model(width, layers).parameters()) / 1e6
        cells = " | ".join(f"{med[a] * 1e3:.2f}" for a in arms)
        ratio = {
            b: f"{med['phalanx'] / med[b]:.3f}x" if b in med else "-" for b in ("floor", "loader")
        }
        print(
            f"| {size} | {params:.2f} M | {batch} | {cells} | {ratio['floor']} | {ratio['loader']} |",  # noqa: E501
            flush=True,
        )
        mem = {a: statistics.median(v) / 1024 for a, v in peaks.items() if v}
        if mem:
            cells = " | ".join(f"{mem[a]:.0f} MB" if a in mem else "-" for a in arms)
            over = {b: f"{mem['phalanx'] / mem[b]:.3f}x" if b in mem and "phalanx" in mem else "-"
                    for b in ("floor", "loader")}  # fmt: skip
            memory.append(f"| {size} | {cells} | {over['floor']} | {over['loader']} |")
    if memory:
        head = " | ".join(f"{a} peak RSS / worker" for a in arms)
        print(f"\n| model | {head} | phalanx/floor | phalanx/loader |")
        print("|---" * (3 + len(arms)) + "|")
        print("\n".join(memory), flush=True)


def run_arm(arm: str, steps: int, workers: int, size: str) -> list[float]:
    if arm == "phalanx":
        return phalanx_run(steps, workers, size, preflight=False)
    if arm == "fabric":
        return fabric_ddp(steps, workers, size)
    return plain_ddp(arm, steps, workers, size)


def marginal_table(args: argparse.Namespace) -> None:
    """The whole run's wall time (spawn or fit, to its return) at two lengths, all steps one
    epoch: the difference per step is what a step costs with start-up and shutdown
    cancelled, including whatever a run does per step outside the steps (the ledger check
    after the last one, the supervisor's work)."""
    lo, hi = (int(n) for n in args.marginal.split(","))
    arms = [a for a in args.arms.split(",") if a != "fabric" or fabric_available()]
    head = " | ".join(f"{a} ms/step" for a in arms)
    print(f"\n| model | marginal steps | {head} | phalanx - floor | phalanx/floor |")
    print("|---" * (5 + len(arms)) + "|")
    for size in args.marginal_sizes.split(","):
        per: dict[str, list[float]] = {a: [] for a in arms}
        for r in range(args.rounds):
            for arm in arms:
                walls = []
                for steps in (lo, hi):
                    started = time.time()
                    run_arm(arm, steps, args.workers, size)
                    walls.append(time.time() - started)
                per[arm].append((walls[1] - walls[0]) / (hi - lo))
            line = ", ".join(f"{a} {per[a][-1] * 1e3:.2f}" for a in arms)
            print(f"marginal {size}, round {r + 1}: {line} ms/step", file=sys.stderr)
        med = {a: statistics.median(v) * 1e3 for a, v in per.items()}
        cells = " | ".join(f"{med[a]:.2f}" for a in arms)
        both = {"phalanx", "floor"} <= set(med)
        gap = f"{med['phalanx'] - med['floor']:+.2f} ms" if both else "-"
        ratio = f"{med['phalanx'] / med['floor']:.3f}x" if both else "-"
        print(f"| {size} | {lo} -> {hi} | {cells} | {gap} | {ratio} |", flush=True)


def startup_table(args: argparse.Namespace) -> None:
    """fit -> first committed step, against mp.spawn + DDP; model factory calls."""
    plain, ours, calls = [], [], []
    for _ in range(args.rounds):
        s = plain_ddp("floor", 12, args.workers, "medium")
        plain.append(s[1] - s[0])
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "calls")
            width, layers, _ = SIZES["medium"]
            t = phalanx_run(12, args.workers, "medium", model=Counted(path, width, layers))
            ours.append(t[1] - t[0])
            with open(path) as fh:
                pids = fh.read().split()
            calls.append(f"{len(pids)} in {len(set(pids))} processes")
    p, o = statistics.median(plain), statistics.median(ours)
    print(
        "\n| start-up (2 workers, medium model) | mp.spawn + DDP | phalanx ddp (preflight) | difference | model factory calls |"  # noqa: E501
    )
    print("|---|---|---|---|---|")
    print(
        f"| spawn/fit -> first committed step | {p:.2f} s | {o:.2f} s | {o - p:+.2f} s | {calls[-1]} |"  # noqa: E501
    )
    # (phalanx's first fit in a process starts the fork server its workers are forked from:
    # it imports torch once; later fits in the process start their workers from it)
    rounds = ", ".join(f"{a:.2f}/{b:.2f}" for a, b in zip(plain, ours, strict=True))
    print(f"\nper round (mp.spawn / phalanx, s; phalanx's first starts its fork server): {rounds}")


def plain_single(steps: int, size: str) -> list[float]:
    width, layers, batch = SIZES[size]
    torch.manual_seed(0)
    model = make_model(width, layers)
    opt = make_optimizer(model.parameters())
    data = dataset(steps * batch)
    stamps = []
    for xb, yb in DataLoader(data, batch_size=batch, shuffle=True):
        loss = nn.functional.cross_entropy(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
        stamps.append(time.time())
    return stamps


def threads_table(args: argparse.Namespace) -> None:
    """threads (one replica per device, one process) and single against a plain loop."""
    print(
        "\n| model | plain loop ms/step | single ms/step | threads (2 x cpu) ms/step | single/plain | threads/plain |"  # noqa: E501
    )
    print("|---|---|---|---|---|---|")
    for size in args.sizes.split(","):
        plain, single, threads = [], [], []
        for _ in range(args.rounds):
            plain.append(mean_interval(plain_single(args.steps, size)))
            single.append(mean_interval(phalanx_run(args.steps, 1, size, "single")[1:]))
            threads.append(mean_interval(phalanx_run(args.steps, 2, size, "threads")[1:]))
        p, s, t = (statistics.median(v) for v in (plain, single, threads))
        print(
            f"| {size} | {p * 1e3:.2f} | {s * 1e3:.2f} | {t * 1e3:.2f} | {s / p:.3f}x | {t / p:.3f}x |",  # noqa: E501
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--sizes", default="small,medium,large")
    parser.add_argument("--arms", default="floor,loader,phalanx,fabric")
    parser.add_argument("--skip-steps", action="store_true")
    parser.add_argument("--skip-startup", action="store_true")
    parser.add_argument("--skip-threads", action="store_true")
    parser.add_argument(
        "--marginal", default="", help="LO,HI: the whole run's wall time at LO and HI steps"
    )
    parser.add_argument("--marginal-sizes", default="medium")
    args = parser.parse_args(argv)
    print(
        f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, torch {torch.__version__}, "
        f"{os.cpu_count()} cores, {args.workers} workers, {args.steps} steps, {args.rounds} rounds"
    )
    if args.marginal:
        marginal_table(args)
    if not args.skip_steps:
        step_table(args)
    if not args.skip_startup:
        startup_table(args)
    if not args.skip_threads:
        threads_table(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
