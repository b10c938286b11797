"""A soak of one-off faults under respawn with checkpoints: every run must end with the
clean run's weights and an exact ledger (a correctness result, not a timing).

    .venv/bin/python bench/soak.py [--runs 10] [--faults 12] [--seed 0] [--json out.json]

Each run trains a 3-worker ddp job (a linear model, 510 samples in global batches of 25,
21 steps an epoch, ``--epochs`` epochs) with ``Recovery(mode="respawn")``, checkpoints every
10 steps, and ``--faults`` one-off faults drawn at random:

- at a worker and a step (``px.Fault``): a SIGKILL, a hang (killed after hang_timeout) or a
  raised exception; a third of them come in pairs on two workers in the same step, on
  purpose;
- at a sample (:class:`OneOffSample`): whichever worker reads that sample first in a given
  epoch is killed, hangs or raises, once (a marker file makes it a one-off across
  processes, so the retry or the replacement reads the sample fine).

A run passes when it finishes every step, its weights equal the clean run's (relative
difference <= 1e-5) and its ledger says every sample was used exactly once per epoch.
The script prints one line per run and a total, and exits 1 if any run failed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

import phalanx as px
from phalanx.plan import Plan

SAMPLES, BATCH, SEED = 510, 25, 3
STEPS_PER_EPOCH = 21
TOLERANCE = 1e-5
HANG_TIMEOUT = timedelta(seconds=3)
KINDS = ("kill", "hang", "exception")
PLAN = Plan(SAMPLES, BATCH, SEED)


def make_data(n: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=gen)
    w = torch.linspace(-1.0, 1.0, 8).unsqueeze(1)
    return TensorDataset(x, x @ w + 0.3 * torch.randn(n, 1, generator=gen) + 0.5)


def linear() -> nn.Module:
    return nn.Linear(8, 1)


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.003, momentum=0.5)


def step(model: nn.Module, batch: Any) -> torch.Tensor:
    time.sleep(0.02)  # long enough for replacements to start and rejoin mid-run
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


@dataclass(frozen=True)
class SampleFault:
    kind: str
    sample: int
    epoch: int


class OneOffSample(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """``make_data``, except that each :class:`SampleFault` fires once, in the worker
    process that reads its sample for the first time in its epoch (reads are counted per
    sample across processes: its ``epoch + 1``-th read, retries and preflight aside)."""

    def __init__(self, faults: list[SampleFault], markers: str) -> None:
        self.data = make_data(SAMPLES)
        self.faults = {f.sample: f for f in faults}
        self.markers = markers
        self.owner = os.getpid()

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        fault = self.faults.get(i)
        if fault is not None and os.getpid() != self.owner and self._first_read(fault):
            if fault.kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if fault.kind == "hang":
                while True:
                    time.sleep(1)
            raise RuntimeError(f"one-off failure reading sample {i}")
        return self.data[i]

    def _first_read(self, fault: SampleFault) -> bool:
        """Whether this read is the one the fault fires on (once per run)."""
        reads = Path(self.markers) / f"reads-{fault.sample}"
        with open(reads, "a") as fh:  # one byte per read, appended atomically
            fh.write(".")
        count = reads.stat().st_size
        if count <= fault.epoch:  # an earlier epoch's read
            return False
        try:
            os.close(os.open(Path(self.markers) / f"fired-{fault.sample}", os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return False
        return True


def draw(rng: random.Random, count: int, epochs: int) -> tuple[list[px.Fault], list[SampleFault]]:
    """``count`` one-off faults: a third in same-step pairs, a third alone at a worker and a
    step, a third at samples. Worker-and-step faults keep to distinct steps apart from the
    pairs, and away from the first steps (a start-up is not what this soaks)."""
    total = epochs * STEPS_PER_EPOCH
    steps = rng.sample(range(3, total - 3), count)
    faults: list[px.Fault] = []
    samples: list[SampleFault] = []
    pairs = count // 3
    for n, s in enumerate(steps):
        kind = rng.choice(KINDS)
        if n < pairs:  # two workers fail in the same step
            a, b = rng.sample(range(3), 2)
            faults += [px.Fault(kind, worker=a, step=s), px.Fault(rng.choice(KINDS), b, s)]
        elif n < count - pairs:
            faults.append(px.Fault(kind, worker=rng.randrange(3), step=s))
        else:  # a sample of step s's global batch, in its epoch
            epoch = s // STEPS_PER_EPOCH
            batch = PLAN.global_batch(epoch, s % STEPS_PER_EPOCH)
            samples.append(SampleFault(kind, rng.choice(batch), epoch))
    return faults, samples


def params(model: nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in model.state_dict().values()]


def rel_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max() / y.abs().max()) for x, y in zip(a, b, strict=True))


def fit(data: Dataset[Any], epochs: int, faults: list[px.Fault], run_dir: str) -> px.FitResult:
    return px.Learner(linear, sgd, step).fit(
        data,
        devices="cpu:0,cpu:1,cpu:2",
        strategy="ddp",
        batch_size=BATCH,
        epochs=epochs,
        seed=SEED,
        faults=faults,
        on_failure=px.Recovery(mode="respawn", max_restarts=1000, hang_timeout=HANG_TIMEOUT),
        run_dir=run_dir,
        checkpoint=px.Checkpoints(every_steps=10),
        sinks=[],
    )


def one_run(n: int, rng: random.Random, args: argparse.Namespace, clean: Any) -> dict[str, Any]:
    faults, samples = draw(rng, args.faults, args.epochs)
    with tempfile.TemporaryDirectory(prefix="phalanx-soak-") as tmp:
        data = OneOffSample(samples, tmp)
        started = time.time()
        try:
            result = fit(data, args.epochs, faults, os.path.join(tmp, "run"))
        except px.TrainingFailed as exc:
            return {"run": n, "ok": False, "error": str(exc).splitlines()[0], "code": exc.code}
        fired = sum(1 for f in samples if (Path(tmp) / f"fired-{f.sample}").exists())
    diff = rel_diff(params(result.model), clean)
    steps_ok = result.steps == args.epochs * STEPS_PER_EPOCH
    ok = diff <= TOLERANCE and result.ledger_ok and steps_ok
    return {
        "run": n,
        "ok": ok,
        "faults_injected": len(faults) + fired,
        "failures": len(result.failures),
        "actions": sorted({f.action or "" for f in result.failures}),
        "rel_diff": diff,
        "ledger_ok": result.ledger_ok,
        "steps": result.steps,
        "seconds": round(time.time() - started, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--faults", type=int, default=12, help="drawn per run (pairs count 2)")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write every run's record here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="phalanx-soak-clean-") as tmp:
        clean = params(fit(make_data(SAMPLES), args.epochs, [], os.path.join(tmp, "run")).model)
    rng = random.Random(args.seed)
    records = []
    for n in range(args.runs):
        record = one_run(n, rng, args, clean)
        records.append(record)
        print(json.dumps(record), flush=True)
    injected = sum(r.get("faults_injected", 0) for r in records)
    passed = sum(r["ok"] for r in records)
    print(f"{passed}/{len(records)} runs recovered exactly, {injected} one-off faults injected")
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=2))
    return 0 if passed == len(records) else 1


if __name__ == "__main__":
    sys.exit(main())
