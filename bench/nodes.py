"""A node lost mid-run: killed (SIGKILL of its processes) or frozen (SIGSTOP: sockets stay
open, as a partition or a suspended host), two nodes of one CPU worker each on loopback;
and the head's node lost the same two ways, three nodes on a shared run_dir (node 1 takes
over as the head, node 2 follows it).

    .venv/bin/python bench/nodes.py [--trials 3] [--node-timeout 3] [--epochs 12] [--fsdp]

Each node is ``tests/multinode_script.py`` (the same script the multi-node tests run: a
linear model, 10 steps an epoch, a 40 ms step), ``Recovery(mode="shrink")``; node 1 is hit
once the head has finished epoch 2. From the head's record of the failure:

- fault -> named: the failure's time (the head's decision) minus the fault's;
- fault -> next committed step: the failure's time plus its ``recovery_seconds`` (to the
  first step committed after it) minus the fault's;
- steps lost: committed steps computed again (0 when the ledger is exact and the run has
  its full step count: phalanx goes on from the last step every member agreed on);
- the run ends with the model of a run that lost nothing (checked against one clean run).

``--fsdp``: under ``strategy="fsdp"``, node 1 killed and frozen, its member's shards
recovered two ways: from the copies of its shard snapshots on node 0 (the default
snapshots, ``mode="shrink"``), and, snapshots off, from the newest sharded checkpoint
(every 5 steps, a shared ``run_dir``, ``mode="respawn"``); steps lost is then the steps
computed again (``replayed_steps``), trial by trial.

For the head, the same from the new head's record (the failure that names the head's loss,
its time when node 1 saw it); steps lost: the first step the new head commits minus the one
after the step its workers kept (0: it goes on from the last committed step).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "multinode_script.py"
PATHS = os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")])


def _env(rank: int | None, port: int, node_timeout: float, nnodes: int = 2) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=PATHS, PHALANX_TEST_NODE_TIMEOUT=str(node_timeout))
    for name in ("PHALANX_NNODES", "PHALANX_NODE_RANK", "PHALANX_HEAD"):
        env.pop(name, None)
    if rank is not None:
        env.update(
            PHALANX_NNODES=str(nnodes),
            PHALANX_NODE_RANK=str(rank),
            PHALANX_HEAD=f"127.0.0.1:{port}",
            PHALANX_TOKEN="bench token",
        )
    return env


def _start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    out = open(log, "wb")  # noqa: SIM115 - closed with the process
    cmd = [sys.executable, str(SCRIPT), *args]
    return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip


def _end(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGCONT)
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _result(log: Path) -> dict[str, Any]:
    for line in log.read_text().splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[len("RESULT ") :]))
    raise RuntimeError(f"no result in {log}:\n{log.read_text()[-3000:]}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def clean_run(folder: Path, epochs: int, extra: dict[str, str] | None = None) -> list[torch.Tensor]:
    out, log = folder / "clean.pt", folder / "clean.log"
    env = dict(_env(None, 0, 10), **(extra or {}))
    proc = _start([str(out), "cpu:0,cpu:1", str(epochs), "-"], env, log)
    if proc.wait(timeout=600) != 0:
        raise RuntimeError(log.read_text()[-3000:])
    return list(torch.load(out, weights_only=True).values())


def _hit_after_epoch_two(
    procs: list[subprocess.Popen[bytes]], logs: list[Path], epochs: int, node: int, how: str
) -> float:
    """Once the head finished epoch 2, kill (SIGKILL) or freeze (SIGSTOP) ``node``'s
    processes; when."""
    deadline = time.monotonic() + 300
    while f"epoch 2/{epochs} done" not in logs[0].read_text():
        if time.monotonic() > deadline or procs[0].poll() is not None:
            raise RuntimeError(logs[0].read_text()[-3000:])
        time.sleep(0.05)
    hit = time.time()
    os.killpg(procs[node].pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
    return hit


def trial(
    folder: Path,
    how: str,
    epochs: int,
    node_timeout: float,
    name: str = "",
    extra: dict[str, str] | None = None,
    run_dir: Path | None = None,
    shrink: bool = True,
) -> dict[str, float]:
    """Two nodes of one worker; node 1 hit once the head finished epoch 2. ``name`` prefixes
    the files, ``extra`` the nodes' environment; ``run_dir``: a shared one."""
    port, tag = _free_port(), f"{name}{how}"
    logs = [folder / f"{tag}-node{r}.log" for r in (0, 1)]
    args = [str(epochs), str(run_dir) if run_dir else "-", *(["shrink"] if shrink else [])]
    env = [dict(_env(r, port, node_timeout), **(extra or {})) for r in (0, 1)]
    procs = [
        _start([str(folder / f"{tag}-node{r}.pt"), "cpu:0", *args], env[r], logs[r]) for r in (0, 1)
    ]
    try:
        hit = _hit_after_epoch_two(procs, logs, epochs, 1, how)
        if procs[0].wait(timeout=600) != 0:
            raise RuntimeError(logs[0].read_text()[-3000:])
    finally:
        for p in procs:
            _end(p)
    head = _result(logs[0])
    [failure] = head["failures"]
    full = head["steps"] == epochs * 10 and head["ledger_ok"]
    replayed = failure.get("replayed_steps") or 0  # (computed again: fsdp's sets)
    return {
        "named": failure["time"] - hit,
        "next_step": failure["time"] + (failure["recovery_seconds"] or float("nan")) - hit,
        "lost": float(replayed) if full else float("nan"),
        "same": float(_same(folder / f"{tag}-node0.pt")),
    }


def head_trial(folder: Path, how: str, epochs: int, node_timeout: float) -> dict[str, float]:
    """Three nodes on a shared run_dir; the head's node hit once it finished epoch 2."""
    port, run_dir = _free_port(), folder / f"head-{how}-run"
    shutil.rmtree(run_dir, ignore_errors=True)  # (each trial a run of its own)
    logs = [folder / f"head-{how}-node{r}.log" for r in (0, 1, 2)]
    procs = []
    for r in (0, 1, 2):
        env = dict(_env(r, port, node_timeout, 3), PHALANX_TEST_STEPS="1")
        out = str(folder / f"head-{how}-node{r}.pt")
        procs.append(_start([out, "cpu:0", str(epochs), str(run_dir)], env, logs[r]))
    try:
        hit = _hit_after_epoch_two(procs, logs, epochs, 0, how)
        for p in procs[1:]:
            if p.wait(timeout=600) != 0:
                raise RuntimeError("\n".join(log.read_text()[-3000:] for log in logs[1:]))
    finally:
        for p in procs:
            _end(p)
    head = _result(logs[1])
    [failure] = [f for f in head["failures"] if ", the head, lost" in f["message"]]
    first = min(s for s, _ in head["steps_at"])
    full = head["steps"] == epochs * 10 and head["ledger_ok"]
    return {
        "named": failure["time"] - hit,
        "next_step": failure["time"] + (failure["recovery_seconds"] or float("nan")) - hit,
        "lost": float(first - (failure["step"] + 1)) if full else float("nan"),
        "same": float(
            _same(folder / f"head-{how}-node1.pt") and _same(folder / f"head-{how}-node2.pt")
        ),
    }


# fsdp (--fsdp): how node 1's member's shards are recovered when its node is lost
FSDP_ARMS = {
    # a copy of each member's shard snapshots on the other node (the default snapshots)
    "copies": ({"PHALANX_TEST_STRATEGY": "fsdp"}, "shrink", False),
    # no snapshot in memory: the newest sharded checkpoint (every 5 steps, a shared run_dir)
    "checkpoint": (
        {
            "PHALANX_TEST_STRATEGY": "fsdp",
            "PHALANX_TEST_SNAPSHOT_STEPS": "off",
            "PHALANX_TEST_CHECKPOINT_STEPS": "5",
        },
        "respawn",
        True,
    ),
}


def fsdp_main(trials: int, epochs: int, node_timeout: float) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        CLEAN[:] = clean_run(folder, epochs, {"PHALANX_TEST_STRATEGY": "fsdp"})
        rows: dict[tuple[str, str], list[dict[str, float]]] = {
            (arm, how): [] for arm in FSDP_ARMS for how in ("killed", "frozen")
        }
        for t in range(trials):
            for (arm, how), got in rows.items():
                extra, mode, shared = FSDP_ARMS[arm]
                run_dir = folder / f"fsdp-{arm}-{how}-run{t}" if shared else None
                name, shrink = f"fsdp-{arm}-", mode == "shrink"
                got.append(trial(folder, how, epochs, node_timeout, name, extra, run_dir, shrink))
                print(f"trial {t + 1} fsdp {arm} node 1 {how}: {got[-1]}", file=sys.stderr)
    print("\n| fsdp: node 1 | shards from | fault -> named | fault -> next committed step | "
          "steps replayed | clean model |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for (arm, how), got in rows.items():
        named = statistics.median(r["named"] for r in got)
        nxt = statistics.median(r["next_step"] for r in got)
        lost = ", ".join(f"{r['lost']:.0f}" for r in got)
        same = sum(int(r["same"]) for r in got)
        print(f"| {how} | {arm} | {named:.2f} s | {nxt:.2f} s | {lost} | {same}/{len(got)} |")


CLEAN: list[torch.Tensor] = []


def _same(path: Path) -> bool:
    got = list(torch.load(path, weights_only=True).values())
    return all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(got, CLEAN, strict=True))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--node-timeout", type=float, default=3.0)
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--fsdp", action="store_true", help="fsdp: node 1 lost, two ways")
    args = parser.parse_args(argv)
    print(
        f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, torch {torch.__version__}, "
        f"{os.cpu_count()} cores, node_timeout {args.node_timeout:g} s, {args.trials} trials"
    )
    if args.fsdp:
        fsdp_main(args.trials, args.epochs, args.node_timeout)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        CLEAN[:] = clean_run(folder, args.epochs)
        rows: dict[str, list[dict[str, float]]] = {
            "node 1 killed": [],
            "node 1 frozen": [],
            "head (node 0 of 3) killed": [],
            "head (node 0 of 3) frozen": [],
        }
        for t in range(args.trials):
            for name in rows:
                how = name.split()[-1]
                run = head_trial if name.startswith("head") else trial
                rows[name].append(run(folder, how, args.epochs, args.node_timeout))
                print(f"trial {t + 1} {name}: {rows[name][-1]}", file=sys.stderr, flush=True)
    print("\n| lost | fault -> named | fault -> next committed step | steps lost | "
          "clean model |")  # fmt: skip
    print("|---|---|---|---|---|")
    for name, got in rows.items():
        named = statistics.median(r["named"] for r in got)
        nxt = statistics.median(r["next_step"] for r in got)
        lost = "0" if all(r["lost"] == 0 for r in got) else "?"
        same = sum(int(r["same"]) for r in got)
        print(f"| {name} | {named:.2f} s | {nxt:.2f} s | {lost} | {same}/{len(got)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
