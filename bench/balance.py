"""Balance (issue 27): one of three ddp workers slower, with and without ``balance``.

    .venv/bin/python bench/balance.py [--slower 2,4] [--steps 120] [--rounds 2]

Every member "computes" by sleeping ``--base`` seconds per sample of its share (so that three
workers on a 2-core machine do not contend for cores and the speeds are what the bench says
they are); rank 2 sleeps ``k`` times as long (``--slower``). One ddp run of ``--steps``
steps per arm and round (batch 60, a small MLP), alternating the arms round by round. Per
arm: the mean interval between committed steps once the shares settled (after the last
change of shares; with even shares after step 20), its ratio to the ideal (the global batch
at the members' total speed: ``batch * base / (2 + 1/k)``) and to even shares' (``batch/3 *
k * base``), and when the shares settled (the step of their last change, and the seconds
from the run's first step to it). Times from the runs' own ``StepEnded`` events.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

import phalanx as px
from phalanx.events import Balanced, Event, StepEnded

BATCH = 60


def net() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01)


def paced_step(model: nn.Module, batch: Any, base: float, slow_rank: int, k: float) -> torch.Tensor:
    x, y = batch
    time.sleep(base * len(x) * (k if px.rank() == slow_rank else 1.0))
    return nn.functional.mse_loss(model(x), y)


class Events:
    def __init__(self) -> None:
        self.steps: list[StepEnded] = []
        self.balanced: list[Balanced] = []

    def handle(self, event: Event) -> None:
        if isinstance(event, StepEnded):
            self.steps.append(event)
        elif isinstance(event, Balanced):
            self.balanced.append(event)

    def close(self) -> None:
        pass


def run(k: float, balance: bool, steps: int, base: float) -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(BATCH * steps, 16, generator=gen), torch.randn(BATCH * steps, 1, generator=gen)
    )
    seen = Events()
    step = functools.partial(paced_step, base=base, slow_rank=2, k=k)
    px.Learner(net, sgd, step).fit(
        data,
        batch_size=BATCH,
        strategy="ddp",
        devices="cpu:0,cpu:1,cpu:2",
        balance=balance,
        snapshots=False,
        sinks=[seen],
    )
    changes = [b for b in seen.balanced if b.changed]
    settled = changes[-1].global_step if changes else 20
    times = [e.time for e in seen.steps if e.global_step > settled]
    interval = (times[-1] - times[0]) / (len(times) - 1)
    first = seen.steps[0].time
    at = next((e.time for e in seen.steps if e.global_step == settled), first)
    shares = changes[-1].shares if changes else [1 / 3] * 3
    return {"interval": interval, "settled_step": settled, "settled_s": at - first,
            "slow_share": shares[2]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slower", default="2,4")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--base", type=float, default=1e-3)
    args = parser.parse_args()
    print(f"{'k':>3} {'arm':>8} {'step ms':>8} {'ideal ms':>8} {'/ideal':>7} {'/even':>6} "
          f"{'slow share':>10} {'settled':>16}")  # fmt: skip
    for k in [float(v) for v in args.slower.split(",")]:
        found: dict[bool, list[dict[str, float]]] = {True: [], False: []}
        for _ in range(args.rounds):
            for balance in (True, False):
                found[balance].append(run(k, balance, args.steps, args.base))
        ideal = BATCH * args.base / (2 + 1 / k)
        even = BATCH / 3 * k * args.base
        for balance in (True, False):
            rows = found[balance]
            interval = statistics.median(r["interval"] for r in rows)
            settled = statistics.median(r["settled_step"] for r in rows)
            settled_s = statistics.median(r["settled_s"] for r in rows)
            share = statistics.median(r["slow_share"] for r in rows)
            arm = "balance" if balance else "even"
            when = f"step {settled:.0f}, {settled_s:.1f} s" if balance else "-"
            ratios = f"{interval / ideal:>7.2f} {interval / even:>6.2f}"
            print(f"{k:>3g} {arm:>8} {1e3 * interval:>8.1f} {1e3 * ideal:>8.1f} "
                  f"{ratios} {share:>10.3f} {when:>16}")  # fmt: skip


if __name__ == "__main__":
    main()
