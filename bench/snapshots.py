"""Snapshots of the committed state in shared memory (issue 23): what they cost a step, what
they give back when every worker falls, and a replacement's join from one.

    .venv/bin/python bench/snapshots.py [--parts cost,everyone,join] [--rounds 6]
                                        [--trials 3] [--join-width 4096]

- ``cost``: the step-time bench's ``medium`` model (1.6 M parameters, ~15 ms a step on the
  development machine, 2 workers, one epoch of ``--steps``), alternating round by round
  between snapshots as by default (how often chosen by measurement) and ``snapshots=False``;
  per arm the median over rounds of the mean step interval (after the first 10 steps) and
  of the whole run's wall time (``fit`` called to ``fit`` returned), their ratios, and what
  the run's end said of the snapshots (how many, how often, their time and size).
- ``everyone``: every worker SIGKILLed in the same step (``px.Fault("kill")`` on every slot)
  of ``tests/multinode_script.py`` (a linear model, 40 ms steps, no run_dir): three workers
  on one host, and two loopback nodes (two workers and one); from the head's record: the
  committed steps computed again, the time from the last fall to the next committed step
  (the first computed again) and to the first new step, and whether the model equals the
  clean run's.
- ``join``: a worker killed at step 5 of 30 under respawn, three workers on one host, the
  ``bench/overhead.py`` MLP of hidden width ``--join-width`` (4096: 34.7 M parameters, SGD
  with momentum), alternating trials with snapshots (the replacement reads the state from
  this machine's shared memory) and without (a peer sends it over the new group); the time
  from the kill to the replacement's join (its ``Joined``: state in hand) and the members'
  longest gap between committed steps after the kill (what the busy peers pay).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import phalanx as px
from phalanx.events import Notice, StepEnded, WorkerState

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import overhead
import steps as step_bench
from gpu import Recorder
from nodes import _free_port, _result

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "multinode_script.py"
PATHS = os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")])
COST = re.compile(
    r"snapshots in shared memory: (\d+) taken, about every (\d+) step\(s\).*, "
    r"([\d.]+) ms each, ([\d.]+) MB each"
)


class Events(Recorder):
    def steps(self) -> list[StepEnded]:
        return [e for e in self.events if isinstance(e, StepEnded)]

    def notices(self) -> list[str]:
        return [e.text for e in self.events if isinstance(e, Notice)]


# -- cost ---------------------------------------------------------------------------------------
def cost_run(snapshots: bool, steps: int, workers: int) -> dict[str, Any]:
    width, layers, batch = step_bench.SIZES["medium"]
    sink = Events()
    learner = px.Learner(
        functools.partial(step_bench.make_model, width, layers),
        step_bench.make_optimizer,
        step_bench.train_step,
    )
    started = time.time()
    learner.fit(
        step_bench.dataset(steps * batch),
        epochs=1,
        batch_size=batch,
        strategy="ddp",
        devices=",".join(f"cpu:{i}" for i in range(workers)),
        sinks=[sink],
        preflight=False,
        snapshots=snapshots,
    )
    wall = time.time() - started
    stamps = [e.time for e in sink.steps()]
    found = [m for t in sink.notices() if (m := COST.search(t))]
    said = found[0].groups() if found else None
    return {"step": step_bench.mean_interval(stamps), "wall": wall, "said": said}


def cost(args: argparse.Namespace) -> None:
    arms = {"snapshots": True, "off": False}
    got: dict[str, list[dict[str, Any]]] = {a: [] for a in arms}
    for r in range(args.rounds):
        order = list(arms) if r % 2 == 0 else list(reversed(arms))
        for arm in order:
            got[arm].append(cost_run(arms[arm], args.steps, args.workers))
        line = ", ".join(
            f"{a} {got[a][-1]['step'] * 1e3:.2f} ms/step {got[a][-1]['wall']:.2f} s" for a in arms
        )
        print(f"cost, round {r + 1}: {line}", file=sys.stderr, flush=True)
    step = {a: statistics.median(x["step"] for x in got[a]) for a in arms}
    wall = {a: statistics.median(x["wall"] for x in got[a]) for a in arms}
    said = [x["said"] for x in got["snapshots"] if x["said"]]
    print(
        f"\n| arm (medium, {args.workers} workers, {args.steps} steps, {args.rounds} rounds) "
        "| ms/step | whole run | snapshots taken | every | ms each | MB each |"
    )
    print("|---|---|---|---|---|---|---|")
    for arm in arms:
        cells = "| - | - | - | - |"
        if arm == "snapshots" and said:
            n = statistics.median(int(s[0]) for s in said)
            every = statistics.median(int(s[1]) for s in said)
            ms = statistics.median(float(s[2]) for s in said)
            mb = said[0][3]
            cells = f"| {n:.0f} | {every:.0f} steps | {ms:.1f} | {mb} |"
        print(f"| {arm} | {step[arm] * 1e3:.2f} | {wall[arm]:.2f} s {cells}")
    print(
        f"\nsnapshots/off: step {step['snapshots'] / step['off']:.4f}x, "
        f"whole run {wall['snapshots'] / wall['off']:.4f}x"
    )
    pairs = [a["wall"] / b["wall"] for a, b in zip(got["snapshots"], got["off"], strict=True)]
    print(f"whole-run ratio per round: {', '.join(f'{p:.3f}' for p in pairs)}")


# -- every worker at once -------------------------------------------------------------------
def _script(out: Path, devices: str, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    fh = open(log, "wb")  # noqa: SIM115 - closed with the process
    cmd = [sys.executable, str(SCRIPT), str(out), devices, "6", "-"]
    return subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT)


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=PATHS, PHALANX_TEST_STEPS="1")
    for name in ("PHALANX_NNODES", "PHALANX_NODE_RANK", "PHALANX_HEAD", "PHALANX_TEST_FAULTS"):
        env.pop(name, None)
    env.update(extra)
    return env


def everyone_trial(folder: Path, nodes: int, at: int, clean: list[torch.Tensor]) -> dict[str, Any]:
    faults = ",".join(f"kill:{w}@{at}" for w in range(3))
    logs = [folder / f"n{nodes}-{r}.log" for r in range(nodes)]
    if nodes == 1:
        procs = [
            _script(
                folder / "n1.pt",
                "cpu:0,cpu:1,cpu:2",
                _env({"PHALANX_TEST_FAULTS": faults}),
                logs[0],
            )
        ]
    else:
        port = _free_port()
        procs = []
        for rank, devices in enumerate(("cpu:0,cpu:1", "cpu:0")):
            env = _env(
                {
                    "PHALANX_TEST_FAULTS": faults,
                    "PHALANX_NNODES": "2",
                    "PHALANX_NODE_RANK": str(rank),
                    "PHALANX_HEAD": f"127.0.0.1:{port}",
                    "PHALANX_TOKEN": "bench token",
                }
            )
            procs.append(_script(folder / f"n2-{rank}.pt", devices, env, logs[rank]))
    for p, log in zip(procs, logs, strict=True):
        if p.wait(timeout=600) != 0:
            raise RuntimeError(log.read_text()[-3000:])
    head = _result(logs[0])
    [fall] = [f for f in head["failures"] if f["action"] == "restarted"]
    stamps = head["steps_at"]  # [global_step, time] of every committed step's event
    after = [(g, t) for g, t in stamps if t > fall["time"]]
    new = [(g, t) for g, t in after if g > fall["step"]]
    model = folder / ("n1.pt" if nodes == 1 else "n2-0.pt")
    got = list(torch.load(model, weights_only=True).values())
    same = all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(got, clean, strict=True))
    intervals = [b - a for (_, a), (_, b) in itertools.pairwise(stamps)]
    return {
        "replayed": fall["replayed_steps"],
        "to_next": after[0][1] - fall["time"],
        "to_new": new[0][1] - fall["time"],
        "step": statistics.median(intervals),
        "ok": same and head["ledger_ok"] and head["steps"] == 60,
    }


def everyone(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="phalanx-bench-snap-") as tmp:
        folder = Path(tmp)
        clean_log = folder / "clean.log"
        proc = _script(folder / "clean.pt", "cpu:0,cpu:1,cpu:2", _env({}), clean_log)
        if proc.wait(timeout=600) != 0:
            raise RuntimeError(clean_log.read_text()[-3000:])
        clean = list(torch.load(folder / "clean.pt", weights_only=True).values())
        print(
            "\n| every worker killed at once (3 workers, 40 ms steps) | trials | exact | steps "
            "computed again | last fall -> next committed step | -> first new step | "
            "minus the steps computed again |"
        )
        print("|---|---|---|---|---|---|---|")
        for nodes, name in ((1, "one host"), (2, "two loopback nodes (2 + 1 workers)")):
            rows = []
            for t in range(args.trials):
                row = everyone_trial(folder, nodes, 17 + 5 * t, clean)
                rows.append(row)
                print(f"everyone, {name}, trial {t + 1}: {row}", file=sys.stderr, flush=True)
            overhead_s = [r["to_new"] - r["replayed"] * r["step"] for r in rows]
            print(
                f"| {name} | {len(rows)} | {sum(r['ok'] for r in rows)}/{len(rows)} | "
                f"{', '.join(str(r['replayed']) for r in rows)} | "
                f"{_seconds(r['to_next'] for r in rows)} | "
                f"{_seconds(r['to_new'] for r in rows)} | {_seconds(overhead_s)} |",
                flush=True,
            )


def _seconds(values: Any) -> str:
    return ", ".join(f"{v:.2f}" for v in values) + " s"


# -- a replacement's join -------------------------------------------------------------------
def join_trial(snapshots: bool, width: int) -> dict[str, Any]:
    sink = Events()
    steps = 30
    kill_at = 5
    model = functools.partial(overhead.make_model, width)
    px.Learner(model, overhead.make_optimizer, overhead.train_step).fit(
        overhead.dataset(),
        epochs=1,
        batch_size=overhead.SAMPLES // steps,
        strategy="ddp",
        devices="cpu:0,cpu:1,cpu:2",
        faults=[px.Fault("kill", worker=1, step=kill_at)],
        on_failure=px.Recovery(mode="respawn"),
        preflight=False,
        snapshots=snapshots,
        sinks=[sink],
    )  # fmt: skip
    fell = next(e.time for e in sink.events if isinstance(e, WorkerState) and e.state == "fallen")
    joined = [
        e.time
        for e in sink.events
        if isinstance(e, WorkerState) and e.worker == 1 and e.state == "training" and e.time > fell
    ]
    stamps = [e.time for e in sink.steps() if e.time > fell]
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    local = any("its state from this machine's snapshot" in t for t in sink.notices())
    return {
        "join": joined[0] - fell if joined else float("nan"),
        "gap": max(gaps),
        "local": local,
    }


def join(args: argparse.Namespace) -> None:
    arms = {"from the snapshot": True, "from a live peer": False}
    got: dict[str, list[dict[str, Any]]] = {a: [] for a in arms}
    for t in range(args.trials):
        for arm in arms if t % 2 == 0 else reversed(list(arms)):
            got[arm].append(join_trial(arms[arm], args.join_width))
            print(f"join, {arm}, trial {t + 1}: {got[arm][-1]}", file=sys.stderr, flush=True)
    params = sum(p.numel() for p in overhead.make_model(args.join_width).parameters()) / 1e6
    print(
        f"\n| a replacement's join ({params:.1f} M parameters, 3 workers, one host) | trials | "
        "took the state locally | kill -> replacement training (median) | members' longest "
        "gap between steps (median) |"
    )
    print("|---|---|---|---|---|")
    for arm, rows in got.items():
        print(
            f"| {arm} | {len(rows)} | {sum(r['local'] for r in rows)}/{len(rows)} | "
            f"{statistics.median(r['join'] for r in rows):.2f} s | "
            f"{statistics.median(r['gap'] for r in rows):.2f} s |",
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="cost,everyone,join")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--join-width", type=int, default=4096)
    args = parser.parse_args(argv)
    parts = {"cost": cost, "everyone": everyone, "join": join}
    for part in args.parts.split(","):
        parts[part](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
