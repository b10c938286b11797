"""A soak of one-off faults under respawn: every run must end with the clean run's weights
and an exact ledger (a correctness result; the times it records are what recovery cost).

    .venv/bin/python bench/soak.py [--runs 80] [--faults 13] [--epochs 4] [--step-ms 100]
                                   [--modes run_dir,none] [--seed 0] [--json out.json]

Each run trains a 3-worker ddp job (a linear model, 510 samples in global batches of 25,
21 steps an epoch, ``--epochs`` epochs, each step ``--step-ms`` long) with
``Recovery(mode="respawn")`` and snapshots in shared memory (the default, chosen by
measurement); runs alternate between the ``--modes``: ``run_dir`` (checkpoints every 10
steps too) and ``none`` (no run_dir: the snapshots are all that outlives the workers). Each
run draws ``--faults`` one-off faults at random:

- every member at once: all three workers SIGKILLed in the same step (three faults), so
  the run can only go on from a snapshot (or a checkpoint);
- pairs at a worker and a step (``px.Fault``): two workers failing in the same step, in two
  different ways (SIGKILL, a hang killed after hang_timeout, a raised exception);
- singles at a worker and a step;
- at a sample (:class:`OneOffSample`): whichever worker reads that sample first (in its
  step of the first epoch) is killed, hangs or raises, once (a marker file makes it a
  one-off across processes, so the retry or the replacement reads the sample fine).

The draw keeps these in different steps, so no step meets more than its own: no step
fails four times (PX206) and no sample kills three readers (a poison batch by deaths needs
three attempts on a common sample). A run passes when it finishes every step, its weights
equal the clean run's (relative difference <= 1e-5) and its ledger says every sample was
used exactly once per epoch. For every restart (every member fell) the record has the
committed steps computed again and the time from the last member's fall to the next
committed step (the first one computed again) and to the first new step. The script prints
one line per run and a total per mode, and exits 1 if any run failed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
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
from phalanx.events import Event, StepEnded
from phalanx.plan import Plan

SAMPLES, BATCH, SEED = 510, 25, 3
STEPS_PER_EPOCH = 21
TOLERANCE = 1e-5
HANG_TIMEOUT = timedelta(seconds=3)
KINDS = ("kill", "hang", "exception")
PLAN = Plan(SAMPLES, BATCH, SEED)
STEP_SECONDS = [0.1]  # (set from --step-ms; the workers read it from their env below)


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
    time.sleep(float(os.environ.get("SOAK_STEP_SECONDS", "0.1")))  # a step's compute
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
    """``count`` one-off faults: three at once in one step (every member falls), then a
    third of the rest in same-step pairs, a third alone at a worker and a step, a third at
    samples. Faults at a worker and a step keep to distinct steps apart from the sample
    faults' steps, and away from the first steps (a start-up is not what this soaks)."""
    total = epochs * STEPS_PER_EPOCH
    rest = max(0, count - 3)
    pairs = rest // 3
    at_samples = rng.sample(range(3, STEPS_PER_EPOCH), pairs)  # epoch 0: a sample's first read
    free = [s for s in range(3, total - 3) if s not in at_samples]
    steps = rng.sample(free, 1 + rest - 2 * pairs)
    everyone, steps = steps[0], steps[1:]
    faults = [px.Fault("kill", worker=w, step=everyone) for w in range(3)]
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


class Steps:
    """When each committed step's event was stamped (a sink)."""

    def __init__(self) -> None:
        self.ended: list[StepEnded] = []

    def handle(self, event: Event) -> None:
        if isinstance(event, StepEnded):
            self.ended.append(event)

    def close(self) -> None:
        pass


def fit(
    data: Dataset[Any], epochs: int, faults: list[px.Fault], run_dir: str | None, sink: Any
) -> px.FitResult:
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
        checkpoint=px.Checkpoints(every_steps=10) if run_dir else None,
        sinks=[sink],
    )


def restarts(result: px.FitResult, steps: list[StepEnded]) -> list[dict[str, Any]]:
    """Each fall that left no member: the steps computed again, and the seconds from it to
    the next committed step and to the first step past the one it fell at."""
    found = []
    for f in result.failures:
        if f.action != "restarted":
            continue
        after = [e for e in steps if e.time > f.time]
        new = [e for e in after if e.global_step > (f.step or 0)]  # (step f.step's commit)
        found.append(
            {
                "replayed": f.replayed_steps,
                "to_next_commit": round(after[0].time - f.time, 3) if after else None,
                "to_new_step": round(new[0].time - f.time, 3) if new else None,
            }
        )
    return found


def one_run(
    n: int, rng: random.Random, args: argparse.Namespace, clean: Any, mode: str
) -> dict[str, Any]:
    faults, samples = draw(rng, args.faults, args.epochs)
    sink = Steps()
    with tempfile.TemporaryDirectory(prefix="phalanx-soak-") as tmp:
        data = OneOffSample(samples, tmp)
        started = time.time()
        run_dir = os.path.join(tmp, "run") if mode == "run_dir" else None
        try:
            result = fit(data, args.epochs, faults, run_dir, sink)
        except px.TrainingFailed as exc:
            return {
                "run": n,
                "mode": mode,
                "ok": False,
                "error": str(exc).splitlines()[0],
                "code": exc.code,
            }
        fired = sum(1 for f in samples if (Path(tmp) / f"fired-{f.sample}").exists())
    diff = rel_diff(params(result.model), clean)
    steps_ok = result.steps == args.epochs * STEPS_PER_EPOCH
    ok = diff <= TOLERANCE and result.ledger_ok and steps_ok
    return {
        "run": n,
        "mode": mode,
        "ok": ok,
        "faults_drawn": len(faults) + fired,  # px.Faults planned, sample faults that fired
        "failures": len(result.failures),  # recorded by the run (a kill and a hang once each)
        "restarts": restarts(result, sink.ended),
        "actions": sorted({f.action or "" for f in result.failures}),
        "rel_diff": diff,
        "ledger_ok": result.ledger_ok,
        "steps": result.steps,
        "seconds": round(time.time() - started, 1),
    }


def totals(records: list[dict[str, Any]], mode: str) -> str:
    mine = [r for r in records if r["mode"] == mode]
    restarted = [x for r in mine for x in r.get("restarts", [])]
    replayed = [x["replayed"] for x in restarted if x["replayed"] is not None]
    to_next = sorted(x["to_next_commit"] for x in restarted if x["to_next_commit"] is not None)
    to_new = sorted(x["to_new_step"] for x in restarted if x["to_new_step"] is not None)

    def med(v: list[float]) -> str:
        return f"{statistics.median(v):.2f}" if v else "-"

    return (
        f"{mode}: {sum(r['ok'] for r in mine)}/{len(mine)} runs recovered exactly; "
        f"{sum(r.get('faults_drawn', 0) for r in mine)} one-off faults drawn, "
        f"{sum(r.get('failures', 0) for r in mine)} failures recorded; "
        f"{len(restarted)} restarts after every member fell, {sum(replayed)} steps computed "
        f"again (at most {max(replayed, default=0)}); last fall -> next committed step "
        f"median {med(to_next)} s, max {to_next[-1] if to_next else '-'} s; -> first new "
        f"step median {med(to_new)} s, max {to_new[-1] if to_new else '-'} s"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=80)
    parser.add_argument("--faults", type=int, default=13, help="drawn per run (pairs count 2)")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--step-ms", type=float, default=100.0)
    parser.add_argument("--modes", default="run_dir,none")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write every run's record here")
    args = parser.parse_args()
    os.environ["SOAK_STEP_SECONDS"] = str(args.step_ms / 1000)  # (read by the workers' step)
    modes = args.modes.split(",")
    clean = params(fit(make_data(SAMPLES), args.epochs, [], None, Steps()).model)
    rng = random.Random(args.seed)
    records = []
    for n in range(args.runs):
        record = one_run(n, rng, args, clean, modes[n % len(modes)])
        records.append(record)
        print(json.dumps(record), flush=True)
    for mode in modes:
        print(totals(records, mode))
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=2))
    return 0 if all(r["ok"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
