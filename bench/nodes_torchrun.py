"""torchrun's side of ``bench/nodes.py``: the same job on two nodes on loopback, as a plain
DDP script under two torchrun agents, one node lost mid-run.

    .venv/bin/python bench/nodes_torchrun.py [--trials 3] [--timeout 120] [--hit-at 25]
        [--scenarios killed,frozen,worker] [--stores shared,fresh] [--nnodes 1:2]
        [--pg-timeout SECONDS] [--rdzv-conf K=V,...] [--keep DIR]

The job is ``tests/multinode_script.py``'s: ``make_data(240)``, ``linear``, ``sgd``, a 40 ms
step (``slow_step``), a global batch of 24 (10 steps an epoch), seed 5, 12 epochs; each rank
computes ``split(plan.global_batch(epoch, step), world)[rank]`` of phalanx's plan, so a
world of one computes the whole global batch and the math is the same at any world size.
Rank 0 checkpoints model and optimizer every ``--every`` steps (10: once an epoch) and a
restarted worker resumes from the checkpoint.

Each node is ``python -m torch.distributed.run --nnodes 1:2 --nproc-per-node 1
--rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT --rdzv-conf is_host=1|0 --local-addr
127.0.0.1 --max-restarts 3`` in a process group of its own; node 0 hosts the rendezvous
(node 1's agent is started first and waits for its store, so that both join the
first round). Once node 0's worker has committed step ``--hit-at`` (25, in
the middle of epoch 3: at the end of epoch 2 the checkpoint has just been written and no
step would be lost, by coincidence), node 1 is hit:

- killed: SIGKILL of node 1's agent and worker (torchrun starts each worker in a session of
  its own: the bench signals every process of the node, each by its process group);
- frozen: SIGSTOP of the same processes (sockets stay open, as in a partition);
- worker: SIGKILL of node 1's worker only, its agent alive (torchrun restarts every node's
  workers).

From node 0's worker log (each committed step with its wall time; each worker's start):

- fault -> error: node 0's worker gets an error from its all-reduce (gloo: the peer closed
  the connection, or the process group's timeout, ``--pg-timeout``);
- fault -> worker up: the first worker started after the fault (node 0's, after torchrun
  has stopped the old one and rendezvoused again), at its first line (torch imported);
- fault -> next committed step: to that new worker's first committed step;
- steps lost: committed steps computed again (the last step node 0 committed before the
  restart minus the checkpoint's);
- finished: node 0's agent exits 0 with every step done, within ``--timeout`` seconds of
  the fault; else "hung" (killed then) or "failed" (its exit code);
- node 0's workers after the fault: how many torchrun started on node 0 (each trial's; more
  than one when a restart failed and torchrun restarted again);
- clean model: the final model against phalanx's run of the same job on one node with two
  devices (``bench/nodes.py``'s clean run), relative 1e-5.

``--stores`` runs torchrun as launched by default (``shared``: the workers' store is the
rendezvous' TCPStore, kept for every restart) and with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
(``fresh``: a new store for each rendezvous round), see ``bench/recovery.py``. Every process
a trial starts carries a marker in its environment; the trial ends by killing each of them
by pid (SIGCONT first), whatever happened.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PATHS = os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests"), str(ROOT / "bench")])
MARK = "PHALANX_BENCH_TRIAL"  # every process of a trial has it, with the trial's id
SAMPLES, BATCH, SEED = 240, 24, 5
NO_SHARED_STORE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def worker(out: Path, epochs: int, every: int, pg_timeout: float) -> None:
    """One rank of the plain DDP job (run by torchrun)."""
    t0 = time.time()
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from phalanx.plan import Plan, split
    from recovery_helpers import linear, make_data, sgd, slow_step

    node = os.environ["BENCH_NODE"]
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    log = open(out / f"node{node}.jsonl", "a")  # noqa: SIM115 - the process's whole life

    def note(**fields: Any) -> None:
        log.write(json.dumps({"pid": os.getpid(), **fields}) + "\n")
        log.flush()

    note(start=time.time(), spawned=t0, attempt=attempt)
    timeout = timedelta(seconds=pg_timeout) if pg_timeout > 0 else None
    dist.init_process_group("gloo", timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    note(joined=time.time(), rank=rank, world=world)
    torch.manual_seed(SEED)  # as phalanx builds the model (Trainable)
    model = DistributedDataParallel(linear())
    opt = sgd(model.parameters())
    ckpt, start = out / "ckpt.pt", 0
    if ckpt.exists():
        state = torch.load(ckpt)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
    data = make_data(SAMPLES)
    plan = Plan(SAMPLES, BATCH, seed=SEED)
    x_all, y_all = data.tensors
    for g in range(start, epochs * plan.steps):
        epoch, step = divmod(g, plan.steps)
        idx = split(plan.global_batch(epoch, step), world)[rank]
        loss = slow_step(model, (x_all[idx], y_all[idx]))
        opt.zero_grad()
        try:
            loss.backward()  # DDP's all-reduce: where a lost peer shows
        except Exception:
            note(error=time.time())
            raise
        opt.step()
        note(step=g + 1, t=time.time())
        if rank == 0 and (g + 1) % every == 0:
            state = {"model": model.module.state_dict(), "opt": opt.state_dict(), "step": g + 1}
            torch.save(state, out / "ckpt.tmp")
            os.replace(out / "ckpt.tmp", ckpt)
    if rank == 0:
        torch.save(model.module.state_dict(), out / "final.pt")
    note(done=time.time())
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _marked(trial: str) -> list[int]:
    """The pids of the live processes that carry this trial's marker."""
    want = f"{MARK}={trial}".encode()
    pids = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = Path(f"/proc/{p}/environ").read_bytes()
            stat = Path(f"/proc/{p}/stat").read_text()
        except OSError:
            continue
        if want in environ.split(b"\0") and stat.rsplit(")", 1)[1].split()[0] != "Z":
            pids.append(int(p))
    return pids


def _node_of(pid: int) -> str | None:
    with contextlib.suppress(OSError):
        for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
            if item.startswith(b"BENCH_NODE="):
                return item.split(b"=", 1)[1].decode()
    return None


def _signal_groups(pids: list[int], sig: int) -> None:
    """``sig`` to each process group of ``pids`` (never this bench's own)."""
    groups = []
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            pgid = os.getpgid(pid)
            if pgid != os.getpgrp() and pgid not in groups:
                groups.append(pgid)
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, sig)


def _clean_up(trial: str, agents: list[subprocess.Popen[bytes]]) -> int:
    """Kill every process of the trial, each by pid; the count left after 10 s (0)."""
    deadline = time.monotonic() + 10
    while True:
        left = _marked(trial)
        for pid in left:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
        for agent in agents:
            with contextlib.suppress(subprocess.TimeoutExpired):
                agent.wait(timeout=0.5)
        if not left or time.monotonic() > deadline:
            return len(_marked(trial))
        time.sleep(0.1)


def _agent(
    node: int, port: int, args: argparse.Namespace, out: Path, env: dict[str, str]
) -> subprocess.Popen[bytes]:
    conf = ",".join(filter(None, [f"is_host={int(node == 0)}", args.rdzv_conf]))
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", args.nnodes, "--nproc-per-node", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
        "--rdzv-id", "bench-nodes", "--rdzv-conf", conf, "--local-addr", "127.0.0.1",
        "--max-restarts", "3",
        __file__, "worker", str(out), str(args.epochs), str(args.every), str(args.pg_timeout),
    ]  # fmt: skip
    console = open(out / f"agent{node}.log", "wb")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(
        cmd,
        env={**env, "BENCH_NODE": str(node)},
        stdout=console,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _both_at(records: list[dict[str, Any]], step: int) -> bool:
    """Whether node 0's worker has committed ``step`` in a group of both nodes (with a short
    ``last_call_timeout`` the first round may close before node 1 has joined: torchrun then
    restarts node 0's worker when node 1 arrives)."""
    pairs = {r["pid"] for r in records if r.get("world") == 2}
    return any(r["pid"] in pairs and r.get("step", 0) >= step for r in records)


def trial(how: str, store: str, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    out = Path(tempfile.mkdtemp(prefix=f"{how}-{store}-", dir=folder))
    trial_id = uuid.uuid4().hex
    env = dict(os.environ, PYTHONPATH=PATHS, GLOO_SOCKET_IFNAME="lo", LOGLEVEL="INFO")
    env[MARK] = trial_id
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    if store == "fresh":
        env.update(NO_SHARED_STORE)
    port = _free_port()
    agents: list[subprocess.Popen[bytes]] = []
    total = args.epochs * SAMPLES // BATCH
    hit = float("nan")
    code: int | str = "not started"
    try:
        # node 1 first: its agent waits for node 0's store, so that both join the first
        # round (with a short last_call_timeout, a round may close on node 0 alone)
        agents.append(_agent(1, port, args, out, env))
        agents.insert(0, _agent(0, port, args, out, env))
        deadline = time.monotonic() + 300
        while not _both_at(_records(out / "node0.jsonl"), args.hit_at):
            if time.monotonic() > deadline or any(a.poll() is not None for a in agents):
                code = "failed before the fault (torchrun's start)"
                break
            time.sleep(0.02)
        else:
            node1 = [p for p in _marked(trial_id) if _node_of(p) == "1"]
            hit = time.time()
            if how == "worker":
                _signal_groups([p for p in node1 if p != agents[1].pid], signal.SIGKILL)
            else:
                _signal_groups(node1, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
            try:
                code = agents[0].wait(timeout=args.timeout)
                if how == "worker" and code == 0:
                    code = agents[1].wait(timeout=max(1.0, hit + args.timeout - time.time()))
            except subprocess.TimeoutExpired:
                code = f"hung (killed {args.timeout:.0f} s after the fault)"
    finally:
        left = _clean_up(trial_id, agents)
    result = _measure(out, hit, total)
    result.update(code=code, left_behind=left, folder=str(out))
    result["outcome"] = _outcome(code, out, result["finished"])
    if args.keep:
        keep = Path(args.keep) / out.name
        keep.mkdir(parents=True, exist_ok=True)
        for f in out.glob("*.log"):
            (keep / f.name).write_bytes(f.read_bytes())
        for f in out.glob("*.jsonl"):
            (keep / f.name).write_bytes(f.read_bytes())
    return result


def _measure(out: Path, hit: float, total: int) -> dict[str, Any]:
    records = _records(out / "node0.jsonl")
    new = {r["pid"]: r["start"] for r in records if "start" in r and r["start"] > hit}
    before = [r["step"] for r in records if "step" in r and r["pid"] not in new]
    after = [r for r in records if "step" in r and r["pid"] in new]
    errors = [r["error"] for r in records if "error" in r and r["error"] > hit]
    error = min(errors) - hit if errors else float("nan")
    up = min(new.values()) - hit if new else float("nan")
    nxt = after[0]["t"] - hit if after else float("nan")
    lost = max(before) - (after[0]["step"] - 1) if after and before else float("nan")
    finished = any(r.get("step") == total for r in records)
    worlds = [r["world"] for r in records if "world" in r]
    same = float("nan")
    if (out / "final.pt").exists() and CLEAN:
        import torch

        got = list(torch.load(out / "final.pt", weights_only=True).values())
        same = float(
            all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(got, CLEAN, strict=True))
        )
    return {
        "error": error,
        "up": up,
        "next_step": nxt,
        "lost": lost,
        "finished": finished,
        "same": same,
        "worlds": worlds,
        "restarts": len(new),
    }


def _outcome(code: int | str, out: Path, finished: bool) -> str:
    if code == 0 and finished:
        return "finished"
    if isinstance(code, str):
        return code
    text = (out / "agent0.log").read_text(errors="replace")
    if "connectFullMesh failed" in text:
        return "failed: restarted Gloo rendezvous, connection refused"
    if "RendezvousTimeoutError" in text or "RendezvousClosedError" in text:
        return "failed: rendezvous"
    return f"failed: exit code {code}"


CLEAN: list[Any] = []


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:
        worker(Path(argv[1]), int(argv[2]), int(argv[3]), float(argv[4]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds after the fault")
    parser.add_argument("--hit-at", type=int, default=25, help="node 0's committed step")
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--every", type=int, default=10, help="checkpoint interval (steps)")
    parser.add_argument("--scenarios", default="killed,frozen,worker")
    parser.add_argument("--stores", default="shared,fresh")
    parser.add_argument("--nnodes", default="1:2")
    parser.add_argument(
        "--pg-timeout", type=float, default=0, help="init_process_group timeout (0: torch's)"
    )
    parser.add_argument(
        "--rdzv-conf", default="", help="more --rdzv-conf, e.g. last_call_timeout=1"
    )
    parser.add_argument("--keep", help="keep each trial's agent and worker logs in this folder")
    parser.add_argument("--no-clean", action="store_true", help="skip the clean model check")
    args = parser.parse_args(argv)
    import torch

    print(
        f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, torch {torch.__version__}, "
        f"{os.cpu_count()} cores, --nnodes {args.nnodes}, pg timeout "
        f"{args.pg_timeout:g} s (0: torch's), rdzv conf '{args.rdzv_conf}', hit at step "
        f"{args.hit_at}, checkpoint every {args.every}, {args.trials} trials"
    )
    runs = [(h, s) for h in args.scenarios.split(",") for s in args.stores.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        if not args.no_clean:
            from nodes import clean_run

            CLEAN[:] = clean_run(folder, args.epochs)
        results: dict[tuple[str, str], list[dict[str, Any]]] = {r: [] for r in runs}
        for t in range(args.trials):  # interleaved: the machine's load hits all alike
            for how, store in runs:
                got = trial(how, store, args, folder)
                results[how, store].append(got)
                print(f"trial {t + 1} {how} {store}: {got}", file=sys.stderr, flush=True)
    print(
        "\n| node 1 | store | finished | fault -> error | fault -> worker up | "
        "fault -> next committed step | steps lost | clean model | node 0's workers after the "
        "fault |\n|---|---|---|---|---|---|---|---|---|"
    )
    for (how, store), trials in results.items():
        ok = [r for r in trials if r["outcome"] == "finished"]
        other = Counter(r["outcome"] for r in trials if r not in ok)
        note = "; ".join(f"{n} {why}" for why, n in sorted(other.items()))
        same = [r["same"] for r in ok if r["same"] == r["same"]]
        clean = f"{int(sum(same))}/{len(same)}" if same else "-"
        error, up = _cell(trials, "error", "{:.2f} s"), _cell(trials, "up", "{:.2f} s")
        nxt = _cell(trials, "next_step", "{:.2f} s")
        lost = _cell(trials, "lost", "{:g}")
        print(
            f"| {how} | {store} | {len(ok)}/{len(trials)}{f' ({note})' if note else ''}"
            f" | {error} | {up} | {nxt} | {lost} | {clean}"
            f" | {', '.join(str(r['restarts']) for r in trials)} |"
        )
    left = sum(r["left_behind"] for trials in results.values() for r in trials)
    print(f"\nprocesses left behind after the trials: {left}")
    return 0


def _cell(rows: list[dict[str, Any]], key: str, fmt: str) -> str:
    values = [r[key] for r in rows if r[key] == r[key]]  # NaN != NaN
    return fmt.format(statistics.median(values)) if values else "-"


if __name__ == "__main__":
    sys.exit(main())
