"""A soak of one-off faults under respawn with checkpoints: every run must end with the
clean run's weights and an exact ledger (a correctness result, not a timing).

    .venv/bin/python bench/soak.py [--runs 10] [--faults 12] [--seed 0] [--json out.json]

Each run trains a 3-worker ddp job (a linear model, 510 samples in global batches of 25,
21 steps an epoch, ``--epochs`` epochs) with ``Recovery(mode="respawn")``, checkpoints every
10 steps, and ``--faults`` one-off faults drawn at random:

- at a worker and a step (``px.Fault``): a SIGKILL, a hang (killed after hang_timeout) or a
  raised exception; a third of them come in pairs: two workers failing in the same step,
  in two different ways, on purpose;
- at a sample (:class:`OneOffSample`): whichever worker reads that sample first (in its
  step of the first epoch) is killed, hangs or raises, once (a marker file makes it a
  one-off across processes, so the retry or the replacement reads the sample fine).

Independent faults that happen to strike the same samples in the same way in successive
attempts of one step are, by design, indistinguishable from a poison batch (PX204); the
draw keeps apart what it places on purpose (pairs fail in two ways, sample faults fire on a
first read only), but a replacement that joins late fires its missed fault at a later step,
so such a coincidence stays possible: a failed run's record names its error to tell.

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
    process that reads its sample first (in its step of epoch 0; marker files count the
    reads across processes, so the retry and every later epoch read it fine)."""

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
    pairs = count // 3
    at_samples = rng.sample(range(3, STEPS_PER_EPOCH), pairs)  # epoch 0: a sample's first read
    steps = rng.sample([s for s in range(3, total - 3) if s not in at_samples], count - pairs)
    faults: list[px.Fault] = []
    for n, s in enumerate(steps):
        if n < pairs:  # two workers fail in the same step, in two different ways
            a, b = rng.sample(range(3), 2)
            kind, other = rng.sample(KINDS, 2)
            faults += [px.Fault(kind, worker=a, step=s), px.Fault(other, worker=b, step=s)]
        else:
            faults.append(px.Fault(rng.choice(KINDS), worker=rng.randrange(3), step=s))
    samples = [
        SampleFault(rng.choice(KINDS), rng.choice(PLAN.global_batch(0, s)), 0) for s in at_samples
    ]
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
        "faults_drawn": len(faults) + fired,  # px.Faults planned, sample faults that fired
        "failures": len(result.failures),  # recorded by the run (a kill and a hang once each)
        "restarts": sum(f.action == "restarted" for f in result.failures),
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
    drawn = sum(r.get("faults_drawn", 0) for r in records)
    seen = sum(r.get("failures", 0) for r in records)
    passed = sum(r["ok"] for r in records)
    print(
        f"{passed}/{len(records)} runs recovered exactly: {drawn} one-off faults drawn, "
        f"{seen} failures recorded"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=2))
    return 0 if passed == len(records) else 1


if __name__ == "__main__":
    sys.exit(main())
