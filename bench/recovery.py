"""A worker killed mid-run: phalanx (shrink, respawn) against torchrun's restart of the group.

    .venv/bin/python bench/recovery.py [--workers 2] [--steps 60] [--kill-at 25] [--every 10]

The same MLP, data, global batch and world size in every run; worker 1 is killed with
SIGKILL when it reaches step ``--kill-at``. Measured in one run, side by side:

- fault -> report: from the kill to the moment the framework has noticed and decided
  (phalanx: its WorkerFailed event; torchrun: the restarted workers' first line, since it
  prints no report of its own that a program can time);
- fault -> next committed step: from the kill to the first optimizer step after it;
- longest gap (phalanx): the longest interval between two committed steps from the kill
  to the end, a replacement's join (respawn) included: what the survivors wait at worst;
- committed steps lost: steps that had been committed before the kill and were computed
  again after it (torchrun restarts from the last checkpoint, written every ``--every``
  steps; phalanx goes on from the last step all members agreed on);
- peak RSS per worker (VmHWM), phalanx ddp against plain torch DDP (torchrun's workers).

torchrun runs twice: as launched by default, and with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1,
the opt-out (named in pytorch/pytorch#135712) of the store sharing that breaks its restarts
(see NO_SHARED_STORE).
``--torchrun-logs DIR`` keeps what the agent and its workers print; ``--only phalanx`` runs
phalanx's two rows alone.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

import phalanx as px
from phalanx.events import Event, StepEnded, WorkerFailed

FEATURES, WIDTH, BATCH = 64, 512, 128


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 10))


def make_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def train_step(model: nn.Module, batch: Any) -> torch.Tensor:
    time.sleep(0.02)  # a step long enough that timings are not all start-up noise
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def dataset(steps: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    n = steps * BATCH
    return TensorDataset(torch.randn(n, FEATURES, generator=g), torch.randint(0, 10, (n,)))


class Recorder:
    """Step commit times, the failure event and the workers' peak RSS."""

    def __init__(self) -> None:
        self.steps: list[tuple[float, int]] = []
        self.failed_at: float | None = None
        self.peak_rss: dict[int, int] = {}

    def handle(self, event: Event) -> None:
        if isinstance(event, StepEnded):
            self.steps.append((time.time(), event.global_step))
            self.peak_rss.update(children_peak_rss())
        elif isinstance(event, WorkerFailed) and self.failed_at is None:
            self.failed_at = time.time()

    def close(self) -> None:
        pass


def children_peak_rss() -> dict[int, int]:
    """VmHWM (kB) of this process's child processes, by pid."""
    out: dict[int, int] = {}
    me = str(os.getpid())
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if fields.get("PPid", "").strip() == me and "VmHWM" in fields:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"resource_tracker" not in cmd:
                out[int(pid)] = int(fields["VmHWM"].split()[0])
    return out


def phalanx_run(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    rec = Recorder()
    learner = px.Learner(make_model, make_optimizer, train_step)
    fault = px.Fault("kill", worker=1, step=args.kill_at)
    devices = ",".join(f"cpu:{i}" for i in range(args.workers))
    result = learner.fit(
        dataset(args.steps),
        epochs=1,
        batch_size=BATCH,
        strategy="ddp",
        devices=devices,
        faults=[fault],
        sinks=[rec],
        on_failure=px.Recovery(mode=mode),
        hang_timeout=timedelta(seconds=10),
        preflight=False,
    )
    before = [t for t, s in rec.steps if s <= args.kill_at]
    after = [(t, s) for t, s in rec.steps if s > args.kill_at]
    fault_time = before[-1] if before else rec.steps[0][0]  # upper bound: last commit before
    committed = [s for _, s in rec.steps]
    return {
        "fault_to_report": (rec.failed_at or fault_time) - fault_time,
        "fault_to_step": after[0][0] - fault_time if after else float("nan"),
        "longest_gap": max(
            (b - a for a, b in itertools.pairwise([fault_time, *(t for t, _ in after)])),
            default=float("nan"),
        ),
        "steps_lost": len(committed) - len(set(committed)),
        "ledger_ok": result.ledger_ok,
        "peak_rss_mb": max(rec.peak_rss.values()) / 1024 if rec.peak_rss else float("nan"),
    }


TORCHRUN_SCRIPT = textwrap.dedent(
    """
    import json, os, signal, sys, time
    import torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    sys.path.insert(0, {bench_dir!r})
    from recovery import BATCH, dataset, make_model, make_optimizer, train_step
    from phalanx.plan import Plan, split

    steps, kill_at, every, out = {steps}, {kill_at}, {every}, {out!r}
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    log = open(os.path.join(out, f"rank{{rank}}.log"), "a")
    log.write(json.dumps({{"start": time.time(), "attempt": attempt}}) + "\\n"); log.flush()
    torch.manual_seed(0)
    model = DistributedDataParallel(make_model())
    opt = make_optimizer(model.parameters())
    ckpt, start = os.path.join(out, "ckpt.pt"), 0
    if os.path.exists(ckpt):
        state = torch.load(ckpt)
        model.module.load_state_dict(state["model"]); opt.load_state_dict(state["opt"])
        start = state["step"]
    data = dataset(steps)
    plan = Plan(len(data), BATCH, seed=0)
    for step in range(start, steps):
        if rank == 1 and step == kill_at and attempt == 0:
            log.write(json.dumps({{"fault": time.time()}}) + "\\n"); log.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        idx = split(plan.global_batch(0, step), world)[rank]
        x, y = torch.stack([data[i][0] for i in idx]), torch.stack([data[i][1] for i in idx])
        loss = train_step(model, (x, y))
        opt.zero_grad(); loss.backward(); opt.step()
        log.write(json.dumps({{"step": step + 1, "t": time.time()}}) + "\\n"); log.flush()
        if rank == 0 and (step + 1) % every == 0:
            torch.save({{"model": model.module.state_dict(), "opt": opt.state_dict(),
                         "step": step + 1}}, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
    with open(f"/proc/{{os.getpid()}}/status") as fh:
        hwm = [l for l in fh if l.startswith("VmHWM")][0].split()[1]
    log.write(json.dumps({{"peak_rss_kb": int(hwm)}}) + "\\n"); log.flush()
    dist.destroy_process_group()
    """
)


# torchrun's c10d rendezvous (what --standalone uses) hands its own TCPStore to the workers,
# and (torch 2.13) keeps that one store for every restart of the group: the restarted
# workers' Gloo rendezvous keys (default_pg/0//cpu//0/<rank>, each rank's listening address)
# are the same names the dead group wrote, so a restarted rank can read its peer's old
# address before the peer has written its new one and connect to a port nobody listens on.
# pytorch/pytorch#135712 reports it (with NCCL) and names the opt-out, which gives each
# rendezvous round a fresh store hosted by the new rank 0.
NO_SHARED_STORE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def torchrun_run(
    args: argparse.Namespace, kill: bool = True, env_extra: dict[str, str] | None = None
) -> dict[str, Any]:
    """One torchrun trial: recovered, failed (exit code) or hung (killed after a bound)."""
    with tempfile.TemporaryDirectory() as out:
        script = Path(out) / "train.py"
        script.write_text(
            TORCHRUN_SCRIPT.format(
                bench_dir=str(Path(__file__).parent),
                steps=args.steps,
                kill_at=args.kill_at if kill else -1,
                every=args.every,
                out=out,
            )
        )
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={args.workers}",
            "--max-restarts=1",
            str(script),
        ]
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent), **(env_extra or {})}
        console = Path(out, "console.log")  # the agent's and the workers' stdout and stderr
        with console.open("w") as fh:
            proc = subprocess.Popen(
                cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                code: int | str = proc.wait(timeout=args.torchrun_timeout)
            except subprocess.TimeoutExpired:
                # torchrun starts each worker in a session of its own: kill them by pid
                for pid in [proc.pid, *descendants(proc.pid)]:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                proc.wait()
                code = f"hung (killed after {args.torchrun_timeout:.0f} s)"
        text = console.read_text(errors="replace")
        if args.torchrun_logs:
            keep = Path(args.torchrun_logs)
            keep.mkdir(parents=True, exist_ok=True)
            n = len(list(keep.glob("torchrun-*.log")))
            (keep / f"torchrun-{n + 1}.log").write_text(text)
        records = _read_log(Path(out, "rank0.log"))
        rank1 = _read_log(Path(out, "rank1.log"))
    fault = next((r["fault"] for r in rank1 if "fault" in r), float("nan"))
    restart = next((r["start"] for r in records if r.get("attempt") == 1), float("nan"))
    after = [r for r in records if "step" in r and r["t"] > restart]
    before = [r["step"] for r in records if "step" in r and r["t"] <= restart]
    lost = (max(before) - (after[0]["step"] - 1)) if after and before else float("nan")
    rss = [r["peak_rss_kb"] for r in records + rank1 if "peak_rss_kb" in r]
    finished = any(r.get("step") == args.steps for r in records)
    return {
        "outcome": "recovered" if code == 0 else _why(code, text, finished),
        "fault_to_report": restart - fault,
        "fault_to_step": after[0]["t"] - fault if after else float("nan"),
        "steps_lost": lost,
        "ledger_ok": None,
        "peak_rss_mb": max(rss) / 1024 if rss else float("nan"),
    }


def descendants(pid: int) -> list[int]:
    """The pids of a process's children, their children and so on."""
    parent: dict[int, int] = {}
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{p}/stat").read_text()
        except OSError:
            continue
        parent[int(p)] = int(stat.rsplit(")", 1)[1].split()[1])
    out, todo = [], [pid]
    while todo:
        here = todo.pop()
        kids = [c for c, pp in parent.items() if pp == here]
        out += kids
        todo += kids
    return out


def _why(code: int | str, console: str, finished: bool) -> str:
    """A short name for a torchrun trial that did not end with exit code 0."""
    if isinstance(code, str):
        why = code
    elif "connectFullMesh failed" in console:
        why = "failed: restarted Gloo rendezvous, connection refused"
    elif "terminate called" in console:
        why = "failed: a worker aborted (SIGABRT)"
    else:
        why = f"failed: exit code {code}"
    return why + (", after the last step" if finished else "")


def _read_log(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--kill-at", type=int, default=25)
    parser.add_argument("--every", type=int, default=10, help="torchrun checkpoint interval")
    parser.add_argument("--trials", type=int, default=3, help="trials of each run")
    parser.add_argument("--torchrun-timeout", type=float, default=120.0)
    parser.add_argument(
        "--torchrun-logs", help="keep each torchrun run's console output in this folder"
    )
    parser.add_argument("--only", help="run only the rows whose name starts with this")
    args = parser.parse_args(argv)
    runs = {
        "phalanx shrink": lambda: phalanx_run("shrink", args),
        "phalanx respawn": lambda: phalanx_run("respawn", args),
        f"torchrun --max-restarts 1, checkpoint every {args.every}": lambda: torchrun_run(args),
        f"torchrun --max-restarts 1, checkpoint every {args.every}, "
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1": lambda: torchrun_run(
            args, env_extra=NO_SHARED_STORE
        ),
        "plain DDP under torchrun, no fault (memory baseline)": lambda: torchrun_run(args, False),
    }
    runs = {k: v for k, v in runs.items() if k.startswith(args.only or "")}
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in runs}
    for trial in range(args.trials):  # interleaved: the machine's load hits all alike
        for name, run in runs.items():
            results[name].append(run())
            print(f"trial {trial + 1} {name}: {results[name][-1]}", file=sys.stderr)
    print(
        f"\n{args.workers} workers, worker 1 killed at step {args.kill_at} of {args.steps}, "
        f"{args.trials} trials each (medians over the trials that recovered)\n"
    )
    print(
        "| run | recovered | fault -> report | fault -> next committed step | longest gap | "
        "committed steps lost | exactly once | peak RSS / worker |\n"
        "|---|---|---|---|---|---|---|---|"
    )
    for name, trials in results.items():
        ok = [r for r in trials if r.get("outcome", "recovered") == "recovered"]
        other = Counter(r["outcome"] for r in trials if r not in ok)
        note = "; ".join(f"{n} {why}" for why, n in sorted(other.items()))
        note = f" ({note})" if note else ""
        print(
            f"| {name} | {len(ok)}/{len(trials)}{note}"
            f" | {_cell(ok, 'fault_to_report', '{:.2f} s')}"
            f" | {_cell(ok, 'fault_to_step', '{:.2f} s')}"
            f" | {_cell(ok, 'longest_gap', '{:.2f} s')}"
            f" | {_cell(ok, 'steps_lost', '{:g}')} | {_all(ok, 'ledger_ok')}"
            f" | {_cell(trials, 'peak_rss_mb', '{:.0f} MB')} |"
        )
    return 0


def _median(rows: list[dict[str, Any]], key: str) -> float:
    found = [r.get(key, float("nan")) for r in rows]  # (torchrun's rows have no gap)
    values = [v for v in found if v == v]  # NaN != NaN
    return statistics.median(values) if values else float("nan")


def _cell(rows: list[dict[str, Any]], key: str, fmt: str) -> str:
    value = _median(rows, key)
    return "-" if value != value else fmt.format(value)


def _all(rows: list[dict[str, Any]], key: str) -> str:
    values = {r[key] for r in rows}
    return "n/a" if values <= {None} else str(all(values))


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.exit(main())
