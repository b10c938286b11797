"""Peak memory (RSS) per worker: phalanx ddp against plain torch DDP, side by side.

    .venv/bin/python bench/memory.py [--steps 10] [--workers 2] [--widths 2048,4096]

Both train the MLP of ``bench/overhead.py`` (hidden width 2048: 8.9 M parameters, 4096:
34.7 M; SGD with momentum) for the same steps of the same global batch over gloo on CPU.
A plain DDP worker reads its own peak RSS (``VmHWM`` in ``/proc/self/status``) after its
last step; a phalanx worker's is read by the bench process (its supervisor) from
``/proc/<pid>/status`` at every committed step. phalanx runs twice, with its default
``preflight=True`` and with ``preflight=False``, and a third time with worker 1 killed at
step 3 under the default respawn policy: the survivors form a new group, then take in the
replacement, whose state comes from rank 0 (``hand_over``: a snapshot of model, optimizer and
loop state, pickled and broadcast); the column is the largest peak of any worker, the
replacement included. Linux only.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

import phalanx as px
from phalanx.events import Event, StepEnded

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from overhead import make_model, plain_training, train_phalanx


def peak_kb(pid: int | str = "self") -> int | None:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmHWM"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _plain_worker(rank: int, world: int, port: int, steps: int, width: int, out: Any) -> None:
    threads = max(1, (os.cpu_count() or 1) // world)
    for _ in plain_training(rank, world, port, steps, threads, width):
        pass
    out.put((rank, peak_kb()))


def plain_ddp(steps: int, world: int, width: int) -> int:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_plain_worker, args=(r, world, store.port, steps, width, out))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    peaks = [out.get(timeout=600)[1] for _ in procs]
    for p in procs:
        p.join()
    return max(p or 0 for p in peaks)


class WorkerPeaks:
    """Reads the peak RSS of this process's children (the workers) at each committed step."""

    def __init__(self) -> None:
        self.peak: dict[int, int] = {}

    def handle(self, event: Event) -> None:
        if isinstance(event, StepEnded):
            for child in mp.active_children():
                kb = peak_kb(child.pid) if child.pid else None
                if kb is not None and child.pid is not None:
                    self.peak[child.pid] = max(kb, self.peak.get(child.pid, 0))

    def close(self) -> None:
        pass


def phalanx_ddp(
    steps: int, world: int, width: int, preflight: bool, faults: list[px.Fault] | None = None
) -> int:
    sink = WorkerPeaks()
    train_phalanx(steps, world, width, sink, preflight=preflight, faults=faults or [])
    return max(sink.peak.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--widths", default="2048,4096")
    args = parser.parse_args(argv)
    print(
        "| model params | torch DDP peak RSS / worker | phalanx (preflight) | ratio "
        "| phalanx (preflight=False) | ratio | phalanx, a worker replaced | ratio |"
        "\n|---|---|---|---|---|---|---|---|"
    )
    for width in (int(w) for w in args.widths.split(",")):
        plain = plain_ddp(args.steps, args.workers, width)
        with_pre = phalanx_ddp(args.steps, args.workers, width, preflight=True)
        without = phalanx_ddp(args.steps, args.workers, width, preflight=False)
        kill = [px.Fault("kill", worker=1, step=3)]
        replaced = phalanx_ddp(args.steps, args.workers, width, preflight=True, faults=kill)
        params = sum(t.numel() for t in make_model(width).parameters()) / 1e6
        print(
            f"| {params:.1f} M | {plain / 1024:.0f} MB | {with_pre / 1024:.0f} MB "
            f"| {with_pre / plain:.2f}x | {without / 1024:.0f} MB | {without / plain:.2f}x "
            f"| {replaced / 1024:.0f} MB | {replaced / plain:.2f}x |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
