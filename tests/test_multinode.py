"""Several nodes on one machine: each node is its own ``python script.py`` process with
``PHALANX_NNODES``/``PHALANX_NODE_RANK``/``PHALANX_HEAD`` set, as on a cluster; the head
listens on 127.0.0.1. What must hold: the run trains as one job (every node returns the
model a one-node run of the same devices gives), a node killed with its workers is named
and the survivors finish without it (exact ledger), nodes that disagree are refused before
anything trains, and nobody without the run's token is heard.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from phalanx.strategies.ddp.wire.control import ENVELOPE, Signer, digest, new_run_id
from phalanx.strategies.ddp.wire.link import Frame, Link, LinkError
from phalanx.strategies.ddp.wire.protocol import (
    ABORT_KEY,
    CONTROL_KEY,
    GEN_LATEST,
    GEN_PREFIX,
    STOP_KEY,
    Announcement,
)
from procs import TESTS_DIR
from stream_helpers import write_shards

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="POSIX processes"),
    pytest.mark.slow,
]

SCRIPT = TESTS_DIR / "multinode_script.py"
SRC = TESTS_DIR.parent / "src"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def env_for(rank: int, port: int, token: str | None = "test token") -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PHALANX_TOKEN", None)
    env.update(
        PYTHONPATH=os.pathsep.join([str(SRC), str(TESTS_DIR)]),
        PHALANX_NNODES="2",
        PHALANX_NODE_RANK=str(rank),
        PHALANX_HEAD=f"127.0.0.1:{port}",
    )
    if token is not None:
        env["PHALANX_TOKEN"] = token
    return env


def start(
    args: list[str], env: dict[str, str], log: Path, launcher: Sequence[str] = ()
) -> subprocess.Popen[bytes]:
    """A node running SCRIPT (under ``launcher``, e.g. torchrun and its flags, else this
    Python): its own process group (so a test can kill it with its workers)."""
    out = open(log, "wb")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(
        [*(launcher or [sys.executable]), str(SCRIPT), *args],
        env=env,
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def finish(proc: subprocess.Popen[bytes], timeout: float = 150) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise


def finish_all(
    procs: list[subprocess.Popen[bytes]], logs: list[Path], timeout: float = 150
) -> None:
    """Every node ends with status 0 (else their logs' tails say why, a node that did not
    end in ``timeout`` too); none leaves a process behind."""
    try:
        codes = [finish(p, timeout) for p in procs]
    except subprocess.TimeoutExpired as exc:
        tails = "\n".join(f"== {log.name}\n{log.read_text()[-3000:]}" for log in logs)
        raise AssertionError(f"{exc}\n{tails}") from None
    finally:
        for p in procs:
            kill_group(p)
    assert codes == [0] * len(procs), "\n".join(log.read_text()[-2000:] for log in logs)


def wait_for(text: str, log: Path, proc: subprocess.Popen[bytes], seconds: float = 120) -> None:
    """Until ``text`` is in the node's log (it is training), while the node runs."""
    deadline = time.monotonic() + seconds
    while text not in log.read_text():
        assert time.monotonic() < deadline and proc.poll() is None, log.read_text()[-3000:]
        time.sleep(0.05)


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def result_of(log: Path) -> dict[str, Any]:
    for line in log.read_text().splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[len("RESULT ") :]))
    raise AssertionError(f"no result in {log}:\n{log.read_text()[-3000:]}")


def weights(path: Path) -> list[torch.Tensor]:
    return list(torch.load(path, weights_only=True).values())


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.allclose(x, y, rtol=1e-5, atol=1e-7) for x, y in zip(a, b, strict=True))


def saved_by_node(text: str) -> tuple[int, str]:
    """The step and file a node's PX147 says it kept: saved itself, or already in a file
    another node wrote (the head's own checkpoint of that step, when the head fell just
    after an epoch's checkpoint)."""
    found = re.search(r"step (\d+) is in (\S+) \((?:this|another) node wrote it\)", text)
    assert found is not None and "[PX147]" in text, text[-3000:]
    return int(found.group(1)), found.group(2)


def assert_resumed_clean(
    tmp_path: Path, logs: list[Path], models: list[str], saved: tuple[int, str], epochs: int
) -> None:
    """Every node resumed from ``saved`` (step, file) and ended with the full run's steps,
    an exact ledger and the model of a run that lost nothing."""
    step, path = saved
    assert f"resumed from {path} after {step} committed step(s)" in logs[0].read_text()
    results = [result_of(log) for log in logs]
    assert [r["steps"] for r in results] == [epochs * 10] * len(logs)
    assert all(r["ledger_ok"] for r in results) and not results[0]["failures"]
    clean = one_node_run(tmp_path, epochs=epochs)
    for name in models:
        assert same(weights(tmp_path / name), clean)


def one_node_run(
    tmp_path: Path, epochs: int, extra_env: dict[str, str] | None = None
) -> list[torch.Tensor]:
    """The same job on one node with the same devices (two workers)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), str(TESTS_DIR)]))
    env.update(extra_env or {})
    for name in ("PHALANX_NNODES", "PHALANX_NODE_RANK", "PHALANX_HEAD"):
        env.pop(name, None)
    out, log = tmp_path / "one.pt", tmp_path / "one.log"
    proc = start([str(out), "cpu:0,cpu:1", str(epochs), "-"], env, log)
    assert finish(proc) == 0, log.read_text()[-3000:]
    return weights(out)


def two_nodes(
    tmp_path: Path,
    epochs: int,
    extra: tuple[str, ...] = (),
    tokens: tuple[Any, Any] = ("t", "t"),
    env_dirs: tuple[Path, Path] | None = None,
    node_timeout: float | None = None,
    run_dir: Path | None = None,
    resume: bool = False,
    name: str = "node",
    faults: str = "",
    devices: tuple[str, str] = ("cpu:0", "cpu:0"),
    extra_env: dict[str, str] | None = None,
) -> tuple[int, list[subprocess.Popen[bytes]], list[Path]]:
    """``env_dirs``: where each node's workers write torchrun's variables at each step;
    ``run_dir``: shared by both nodes; each node's log and model are ``{name}{rank}``;
    ``faults``: the run's ``px.Fault``s as text (every node passes the same)."""
    port = free_port()
    procs, logs = [], []
    for rank in (0, 1):
        log = tmp_path / f"{name}{rank}.log"
        folder = "-" if run_dir is None else str(run_dir)
        args = [str(tmp_path / f"{name}{rank}.pt"), devices[rank], str(epochs), folder, *extra]
        env = env_for(rank, port, tokens[rank])
        env.update(extra_env or {})
        if resume:
            env["PHALANX_TEST_RESUME"] = "1"
        if faults:
            env["PHALANX_TEST_FAULTS"] = faults
        if node_timeout is not None:
            env["PHALANX_TEST_NODE_TIMEOUT"] = str(node_timeout)
        if env_dirs is not None:
            env_dirs[rank].mkdir()
            env["PHALANX_TEST_ENV_DIR"] = str(env_dirs[rank])
        procs.append(start(args, env, log))
        logs.append(log)
    return port, procs, logs


def lose_node_one(tmp_path: Path, epochs: int, **options: Any) -> dict[str, Any]:
    """Two nodes (``two_nodes(**options)``); node 1 killed with its workers once the head
    finished epoch 2; the head's result once it ends alone (it must end well)."""
    _, procs, logs = two_nodes(tmp_path, epochs=epochs, **options)
    try:
        wait_for(f"epoch 2/{epochs} done", logs[0], procs[0])
        kill_group(procs[1])
        assert finish(procs[0]) == 0, logs[0].read_text()[-3000:]
    finally:
        for p in procs:
            kill_group(p)
    return result_of(logs[0])


@pytest.mark.timeout(300)
def test_two_nodes_train_as_one_job_and_every_node_returns_its_model(tmp_path: Path) -> None:
    env_dirs = (tmp_path / "env0", tmp_path / "env1")
    run_dir = tmp_path / "run"  # shared by both nodes, as on a shared file system
    port, procs, logs = two_nodes(tmp_path, epochs=4, env_dirs=env_dirs, run_dir=run_dir)
    finish_all(procs, logs)
    head, node = result_of(logs[0]), result_of(logs[1])
    assert head["steps"] == node["steps"] == 40
    # Both nodes return the final weights' file, which the head wrote in the shared run_dir.
    assert head["model_path"] == node["model_path"] == str(run_dir / "model.pt")
    assert same(weights(run_dir / "model.pt"), weights(tmp_path / "node0.pt"))
    assert head["ledger_ok"] and node["ledger_ok"] and not head["failures"]
    w_head, w_node = weights(tmp_path / "node0.pt"), weights(tmp_path / "node1.pt")
    assert same(w_head, w_node)
    assert same(w_head, one_node_run(tmp_path, epochs=4))  # as one node with two devices
    text = logs[0].read_text()
    assert "cpu:0@node1" in text and f"127.0.0.1:{port}" in text
    # Each node's one worker sees torchrun's variables as torchrun gives them on two nodes of
    # one process each: its global rank, local rank 0 of 1 on its node, the head's address.
    for rank, folder in enumerate(env_dirs):
        (seen,) = [json.loads(p.read_text()) for p in folder.glob("*.json")]
        assert seen == {
            "RANK": str(rank),
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1",
        }


@pytest.mark.timeout(300)
def test_a_killed_node_is_named_and_the_survivors_finish_without_it(tmp_path: Path) -> None:
    _, procs, logs = two_nodes(tmp_path, epochs=12, extra=("shrink",))
    try:
        wait_for("epoch 2/12 done", logs[0], procs[0])  # training, both nodes in
        killed_at = time.time()
        kill_group(procs[1])  # the node's process and its worker, as a lost machine
        assert finish(procs[0]) == 0, logs[0].read_text()[-3000:]
    finally:
        for p in procs:
            kill_group(p)
    head = result_of(logs[0])
    assert head["steps"] == 120 and head["ledger_ok"]
    [failure] = head["failures"]
    assert failure["worker"] == 1 and failure["action"] == "shrunk"
    assert failure["message"].startswith(
        f"node 1 ({socket.gethostname()}) lost with its workers [1]"
    )
    assert failure["attempt"] is None  # a node's loss is not an attempt of its step
    assert failure["time"] - killed_at < 5.0  # named within seconds, not a collective timeout
    assert "Final world size: 1 of 2" in logs[0].read_text()


@pytest.mark.timeout(300)
def test_a_stream_through_a_lost_node_loses_no_sample(tmp_path: Path) -> None:
    """Streamed data (shards on a file system both nodes see): node 1 is killed with its
    worker; the head takes its part of the stream at the right samples, every sample once per
    epoch, and ends with the model of one node that lost nothing."""
    write_shards(tmp_path / "shards", [50, 37, 80, 13, 60])  # 240 samples, 10 steps an epoch
    stream = {"PHALANX_TEST_STREAM": str(tmp_path / "shards")}
    head = lose_node_one(tmp_path, 6, extra=("shrink",), extra_env=stream)
    assert head["steps"] == 60 and head["ledger_ok"]
    [failure] = head["failures"]
    assert failure["worker"] == 1 and failure["action"] == "shrunk"
    clean = one_node_run(tmp_path, epochs=6, extra_env=stream)
    assert same(weights(tmp_path / "node0.pt"), clean)


@pytest.mark.timeout(300)
def test_every_worker_of_both_nodes_killed_at_once_goes_on_from_the_snapshots(
    tmp_path: Path,
) -> None:
    """Both nodes' workers SIGKILLed in the same step, no run_dir (the nodes' agents live):
    each node's shared memory still holds its snapshot, every slot starts again on its node
    from it, and the run ends with the model of a run that lost nothing."""
    _, procs, logs = two_nodes(tmp_path, epochs=4, faults="kill:0@15,kill:1@15")
    finish_all(procs, logs)
    head, node = result_of(logs[0]), result_of(logs[1])
    assert head["steps"] == node["steps"] == 40
    assert head["ledger_ok"] and node["ledger_ok"]
    [fall] = [f for f in head["failures"] if f["action"] == "restarted"]
    assert fall["replayed_steps"] is not None and 0 <= fall["replayed_steps"] <= 15
    assert "resumed from shared memory (snapshot of step" in logs[0].read_text()
    clean = one_node_run(tmp_path, epochs=4)
    assert same(weights(tmp_path / "node0.pt"), clean)
    assert same(weights(tmp_path / "node1.pt"), clean)


@pytest.mark.timeout(300)
def test_a_replacement_takes_the_state_from_its_nodes_snapshot_not_across_the_network(
    tmp_path: Path,
) -> None:
    """Node 1 runs workers 1 and 2; worker 2 is killed and respawned on node 1. The state's
    source after the regroup is rank 0, on node 0: worker 1, node 1's snapshot writer,
    takes a snapshot at the regroup and the replacement reads the agreed state from its own
    machine's shared memory instead of receiving it from node 0. The run ends with the
    model of a run that lost nothing."""
    _, procs, logs = two_nodes(
        tmp_path, epochs=4, faults="kill:2@12", devices=("cpu:0", "cpu:0,cpu:1")
    )
    finish_all(procs, logs)
    head = result_of(logs[0])
    assert head["steps"] == 40 and head["ledger_ok"]
    assert [(f["worker"], f["action"]) for f in head["failures"]] == [(2, "respawned")]
    text = " ".join(logs[0].read_text().split())
    assert "worker 2's replacement (after its crash at step 13) joined before step" in text
    assert "(its state from this machine's snapshot)" in text
    assert same(weights(tmp_path / "node0.pt"), one_node_run(tmp_path, epochs=4))


def torchrun_nodes(
    tmp_path: Path, run_id: str, args: list[str], flags: Sequence[str] = (), resume: bool = False
) -> tuple[list[subprocess.Popen[bytes]], list[Path]]:
    """Two torchrun agents of one process each (c10d rendezvous on loopback), each running
    SCRIPT with ``node<rank>.pt cpu:0 *args``; their logs are ``torchrun<rank>.log``."""
    torchrun = Path(sys.executable).with_name("torchrun")
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), str(TESTS_DIR)]))
    for name in ("PHALANX_NNODES", "PHALANX_NODE_RANK", "PHALANX_HEAD"):
        env.pop(name, None)
    env["PHALANX_TOKEN"] = "torchrun token"
    if resume:
        env["PHALANX_TEST_RESUME"] = "1"
    procs, logs = [], []
    for rank in (0, 1):
        logs.append(tmp_path / f"torchrun{rank}.log")
        launcher = [
            str(torchrun),
            "--nnodes", "2", "--nproc-per-node", "1", "--monitor-interval", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-id", run_id, *flags,
        ]  # fmt: skip
        procs.append(start([str(tmp_path / f"node{rank}.pt"), "cpu:0", *args], env, logs[-1],
                           launcher))  # fmt: skip
    return procs, logs


@pytest.mark.timeout(300)
def test_torchrun_with_two_nodes_of_one_process_trains_one_job(tmp_path: Path) -> None:
    """``torchrun --nnodes 2 --nproc-per-node 1`` with c10d rendezvous, as on a cluster (two
    agents, here on loopback): phalanx reads torchrun's environment (the node's rank from
    GROUP_RANK, the head from MASTER_ADDR) and the two nodes train one job, each returning
    the model of the same job on one node with two devices."""
    procs, logs = torchrun_nodes(tmp_path, "px-two-nodes", ["4", "-"])
    finish_all(procs, logs)
    results = [result_of(log) for log in logs]
    assert [r["steps"] for r in results] == [40, 40] and all(r["ledger_ok"] for r in results)
    text = "".join(log.read_text() for log in logs)
    assert "joined; workers 1..1" in text and "Final world size: 2 of 2" in text
    assert "(torchrun's))" in logs[0].read_text()  # the run's keys live in torchrun's store
    models = [weights(tmp_path / f"node{rank}.pt") for rank in (0, 1)]
    assert same(models[0], models[1])
    assert same(models[0], one_node_run(tmp_path, epochs=4))


@pytest.mark.timeout(400)
def test_under_torchrun_max_restarts_a_lost_head_costs_no_committed_step(tmp_path: Path) -> None:
    """The head's process is killed under ``torchrun --max-restarts 1`` (its agent lives):
    the other node saves its last committed step (PX147; torchrun's restart may stop it with
    SIGTERM before it exits 75), torchrun restarts both nodes, and the script (always
    ``resume=True``) goes on from that step (the head says it resumed from node 1's file):
    the run ends with the model of a run that lost nothing and an exact ledger. No failover:
    one node of two left is not more than half."""
    run_dir = tmp_path / "run"
    procs, logs = torchrun_nodes(
        tmp_path, "px-head-lost", ["6", str(run_dir)], ["--max-restarts", "1"], resume=True
    )
    try:
        wait_for("epoch 2/6 done", logs[0], procs[0])
        time.sleep(0.5)
        head = children_running(procs[0].pid, SCRIPT.name)  # torchrun's worker: the head
        assert len(head) == 1, head
        os.kill(head[0], signal.SIGKILL)  # (its workers follow it out)
    finally:
        finish_all(procs, logs, timeout=300)
    saved = saved_by_node(logs[1].read_text())
    assert_resumed_clean(tmp_path, logs, ["node0.pt", "node1.pt"], saved, 6)


@pytest.mark.timeout(400)
def test_a_spare_takes_the_lost_nodes_place_and_a_second_spare_waits_to_the_end(
    tmp_path: Path,
) -> None:
    """Two spares (``PHALANX_NODE_RANK=spare``) wait at the head from the start. Node 1 is
    killed: the first spare takes its place (its worker joins at a step boundary with the
    agreed state), the second stays parked; every process ends with the model of a run
    that lost nothing."""
    port, procs, logs = two_nodes(tmp_path, epochs=20)
    spares = [tmp_path / "spare0.log", tmp_path / "spare1.log"]
    for i, log in enumerate(spares):
        env = env_for(1, port, "t")
        env["PHALANX_NODE_RANK"] = "spare"
        procs.append(start([str(tmp_path / f"spare{i}.pt"), "cpu:0", "20", "-"], env, log))
    try:
        wait_for("epoch 2/20 done", logs[0], procs[0])
        kill_group(procs[1])
        codes = [finish(p) for p in (procs[0], procs[2], procs[3])]
    finally:
        for p in procs:
            kill_group(p)
    text = logs[0].read_text()
    assert codes == [0, 0, 0], text[-3000:]
    assert text.count("waits to take a lost node's place") == 2
    assert "takes node 1's place: workers [1] start and join at a step boundary" in text
    assert "Final world size: 2 of 2" in text
    head = result_of(logs[0])
    assert head["steps"] == 200 and head["ledger_ok"]
    assert [f["action"] for f in head["failures"]] == ["shrunk"]
    placed = [log for log in spares if "spare: takes node 1's place" in log.read_text()]
    assert len(placed) == 1, [log.read_text()[-1500:] for log in spares]
    clean = one_node_run(tmp_path, epochs=20)
    for i, log in enumerate(spares):
        assert result_of(log)["steps"] == 200  # the parked one returns the run's result too
        assert same(weights(tmp_path / f"spare{i}.pt"), clean)
    assert same(weights(tmp_path / "node0.pt"), clean)


@pytest.mark.timeout(300)
def test_a_spare_that_disagrees_is_refused_and_one_that_dies_is_dropped(tmp_path: Path) -> None:
    """Spares never stop the run: one started with other settings (epochs) is refused with
    PX144 and a warning, one killed while parked is dropped with a warning; the two nodes
    train to the end with the clean model."""
    port, procs, logs = two_nodes(tmp_path, epochs=8)
    odd, doomed = tmp_path / "odd.log", tmp_path / "doomed.log"
    env = dict(env_for(1, port, "t"), PHALANX_NODE_RANK="spare")
    procs.append(start([str(tmp_path / "odd.pt"), "cpu:0", "9", "-"], env, odd))
    procs.append(start([str(tmp_path / "doomed.pt"), "cpu:0", "8", "-"], env, doomed))
    try:
        wait_for("spare: waiting at the head", doomed, procs[3])
        kill_group(procs[3])  # a parked spare's machine goes away
        codes = [finish(procs[0]), finish(procs[1]), finish(procs[2])]
    finally:
        for p in procs:
            kill_group(p)
    text = logs[0].read_text()
    assert codes == [0, 0, 1], text[-3000:] + odd.read_text()[-2000:]
    assert "refused a spare on" in text and "epochs: the head has 8, this node 9" in text
    assert "[PX144]" in odd.read_text()
    assert "is gone: dropped" in text
    head = result_of(logs[0])
    assert head["steps"] == 80 and head["ledger_ok"] and not head["failures"]
    assert same(weights(tmp_path / "node0.pt"), one_node_run(tmp_path, epochs=8))


def children_running(parent: int, name: str) -> list[int]:
    """The pids of ``parent``'s children whose command line mentions ``name`` (from /proc:
    no procps needed)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # (the name in parentheses may hold spaces)
        if ppid == parent and name in cmdline:
            found.append(int(entry.name))
    return found


def alive_in_group(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.timeout(300)
def test_a_frozen_node_is_given_up_the_others_go_on_and_it_stops_when_it_wakes(
    tmp_path: Path,
) -> None:
    """A node whose processes are all stopped (SIGSTOP: a silent partition, sockets open):
    the head names it after node_timeout (3 s here) and the survivors abandon the
    collectives they share with it at once (gloo would wait for the group's timeout), go on
    without it and end with a clean run's model and an exact ledger. Woken up, the node
    reads that it was given up, stops its workers and exits with PX145, committing
    nothing."""
    clean = one_node_run(tmp_path, epochs=12)
    _, procs, logs = two_nodes(tmp_path, epochs=12, extra=("shrink",), node_timeout=3)
    try:
        wait_for("epoch 2/12 done", logs[0], procs[0])  # training, both nodes in
        frozen_at = time.time()
        os.killpg(procs[1].pid, signal.SIGSTOP)  # the node and its worker, all silent
        assert finish(procs[0]) == 0, logs[0].read_text()[-3000:]
        os.killpg(procs[1].pid, signal.SIGCONT)
        node_code = finish(procs[1], timeout=60)
        deadline = time.monotonic() + 10
        while alive_in_group(procs[1].pid) and time.monotonic() < deadline:
            time.sleep(0.1)  # (its workers, stopped by the node on its way out)
        left_behind = alive_in_group(procs[1].pid)
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGCONT)
            kill_group(p)
    head = result_of(logs[0])
    assert head["steps"] == 120 and head["ledger_ok"]
    [failure] = head["failures"]
    assert failure["worker"] == 1 and failure["action"] == "shrunk"
    assert failure["message"].startswith(f"node 1 ({socket.gethostname()}) lost with")
    assert "no word for" in failure["message"] and "node_timeout 3s" in failure["message"]
    assert failure["attempt"] is None
    named_after = failure["time"] - frozen_at
    # node_timeout after the node's last word, which came at most a keep-alive (1 s) earlier
    assert 3.0 - 1.0 <= named_after < 3.0 + 2.0, named_after
    # The survivors' next committed step: their wait on the frozen peer was abandoned, not
    # left to the group's timeout (2 x hang_timeout + 30 s = 50 s here).
    assert failure["recovery_seconds"] is not None and failure["recovery_seconds"] < 5.0
    assert same(weights(tmp_path / "node0.pt"), clean)  # the model of a run that lost nothing
    node_text = logs[1].read_text()
    assert node_code != 0 and "PX145" in node_text and "cut off from the run" in node_text
    assert "RESULT" not in node_text and not (tmp_path / "node1.pt").exists()
    assert not left_behind, "the woken node left processes behind"


def lose_the_head(
    tmp_path: Path, run_dir: Path, epochs: int, lose: Callable[[Any], None], **options: Any
) -> tuple[int, float, str]:
    """Two nodes on ``run_dir``; once epoch 2 is done (checkpoints at steps 10 and 20) and
    half a second into epoch 3, ``lose(head process)``: node 1's exit code, the seconds it
    took to decide, and its output."""
    _, procs, logs = two_nodes(tmp_path, epochs=epochs, run_dir=run_dir, **options)
    try:
        wait_for(f"epoch 2/{epochs} done", logs[0], procs[0])
        time.sleep(0.5)  # into epoch 3: steps committed after the newest checkpoint
        lost_at = time.time()
        lose(procs[0])
        code = finish(procs[1], 90)
        decided = time.time() - lost_at
    finally:
        for p in procs:
            kill_group(p)
    return code, decided, logs[1].read_text()


@pytest.mark.timeout(400)
def test_the_head_lost_a_node_saves_what_was_committed_and_a_resume_loses_nothing(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    # the head killed: its process, the store, its worker
    code, decided, text = lose_the_head(tmp_path, run_dir, 6, kill_group)
    assert code == 75, text[-3000:]  # EX_TEMPFAIL: run the same command again
    assert "the head at 127.0.0.1:" in text and "resume=True" in text
    # (two nodes: no failover, node 1 alone is not more than half; tests/test_failover.py)
    assert "no failover: 1 of the run's 2 nodes are left, not more than half" in text
    # One clear line: no torch C++ log lines or stacks from the workers' failing store calls.
    assert not [line for line in text.splitlines() if line.startswith(("[W", "[E", "frame #"))]
    step, path = saved_by_node(text)
    assert 20 < step < 60  # newer than the newest regular checkpoint: nothing lost
    assert decided < 15.0  # at once (the link closed), not after a store or group timeout
    saved = torch.load(path, weights_only=True)  # a file plain torch opens
    assert saved["phalanx"]["step"] == step and saved["loop"]["global_step"] == step
    assert "RESULT" not in text
    # The same command on both nodes with resume=True goes on from the saved step.
    _, procs, logs = two_nodes(tmp_path, epochs=6, run_dir=run_dir, resume=True, name="again")
    finish_all(procs, logs)
    assert_resumed_clean(tmp_path, logs, ["again0.pt", "again1.pt"], (step, path), 6)


@pytest.mark.timeout(300)
def test_a_frozen_head_is_lost_after_node_timeout_and_the_node_saves_its_step(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    # the head frozen: its sockets stay open
    code, decided, text = lose_the_head(
        tmp_path, run_dir, 12, lambda p: os.killpg(p.pid, signal.SIGSTOP), node_timeout=3
    )
    assert code == 75, text[-3000:]
    step, path = saved_by_node(text)
    assert 20 < step < 120
    # node_timeout (3 s) after the head's last word; the worker's wait on the frozen head's
    # worker was abandoned, not left to the group's timeout (50 s here)
    assert 2.0 <= decided < 15.0, decided
    assert torch.load(path, weights_only=True)["phalanx"]["step"] == step


@pytest.mark.timeout(200)
def test_nodes_that_disagree_are_refused_before_anything_trains(tmp_path: Path) -> None:
    port = free_port()
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    head = start([str(tmp_path / "a.pt"), "cpu:0", "4", "-"], env_for(0, port), logs[0])
    node = start([str(tmp_path / "b.pt"), "cpu:0", "5", "-"], env_for(1, port), logs[1])
    try:
        codes = [finish(head), finish(node)]
    finally:
        kill_group(head)
        kill_group(node)
    assert codes == [1, 1]
    for log in logs:
        text = log.read_text()
        assert "[PX144]" in text and "epochs: the head has 4, this node 5" in text, text[-2000:]
        assert "RESULT" not in text and "starting 2 worker" not in text


class Planted:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (open, (self.path, "w"))


@pytest.mark.timeout(300)
def test_a_rogue_client_changes_nothing_in_a_two_node_run(tmp_path: Path) -> None:
    """It connects to the head's node port without the token, and to the head's store: a
    forged announcement, stop and abort, a replayed signed message (of this run, under another
    key; of an earlier run with the same PHALANX_TOKEN), a planted pickle."""
    planted = tmp_path / "planted"
    port, procs, logs = two_nodes(tmp_path, epochs=8)
    refused = 0
    written: list[tuple[str, bytes, bool]] = []
    try:
        deadline = time.monotonic() + 120
        while "epoch 2/8 done" not in logs[0].read_text():
            assert time.monotonic() < deadline and procs[0].poll() is None, logs[0].read_text()
            time.sleep(0.1)
        text = logs[0].read_text()
        store_port = int(text.split("(store at 127.0.0.1:")[1].split(")")[0])
        hello = Frame("hello", {"node": 1, "host": "rogue", "devices": ["cpu:0"], "check": {}})
        try:  # the wrong token: the head answers nothing it would act on
            Link.connect(("127.0.0.1", port), b"not the token", hello, timeout=5.0)
        except (LinkError, OSError):
            refused += 1
        rogue = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=_td(10))
        genuine = bytes(rogue.get(f"{GEN_PREFIX}0"))  # the run's own first announcement
        fake = Announcement(1, (0,), cause="rogue").to_json()
        forged = json.dumps({"format": ENVELOPE, "seq": 99, "payload": fake, "mac": "ab" * 32})
        earlier = Signer.for_run(b"t", new_run_id())  # what a run before, same token, wrote
        written += [
            # A counter that does not verify: the workers read every key each tick from now
            # (the head writes it with set: it never reads back what a rogue left there).
            (CONTROL_KEY, b"rogue: look again", False),
            (f"{GEN_PREFIX}1", forged.encode(), True),  # a fake generation
            (STOP_KEY, b"rogue says stop", False),  # unsigned
            (ABORT_KEY, b'{"format": "px-signed/1", "seq": 5, "payload": "x", "mac": ""}', False),
            (ABORT_KEY, genuine, False),  # a genuine signed message under another key
            (ABORT_KEY, earlier.seal(ABORT_KEY, "an earlier run's abort", 1).encode(), False),
            (f"{GEN_PREFIX}1", pickle.dumps(Planted(str(planted))), False),
        ]
        for key, raw, bump in written:
            rogue.set(key, raw)
            if bump:
                rogue.add(GEN_LATEST, 1)
            deadline = time.monotonic() + 20
            while digest(raw) not in logs[0].read_text():
                assert time.monotonic() < deadline and procs[0].poll() is None, f"no word of {key}"
                time.sleep(0.05)
        codes = [finish(p) for p in procs]
    finally:
        for p in procs:
            kill_group(p)
    assert codes == [0, 0], "\n".join(log.read_text()[-2000:] for log in logs)
    assert refused == 1
    assert not planted.exists()
    head, node = result_of(logs[0]), result_of(logs[1])
    assert head["steps"] == node["steps"] == 80 and head["ledger_ok"] and not head["failures"]
    assert same(weights(tmp_path / "node0.pt"), weights(tmp_path / "node1.pt"))
    assert same(weights(tmp_path / "node0.pt"), one_node_run(tmp_path, epochs=8))
    warnings = [line for line in logs[0].read_text().splitlines() if "PX150" in line]
    for key, raw, _ in written:  # each rejected value once, however many workers read it
        assert sum(digest(raw) in line and repr(key) in line for line in warnings) == 1, key
    assert sum("refused a connection" in line for line in warnings) == 1, warnings
    assert len(warnings) == len(written) + 1, warnings  # and nothing else


def _td(seconds: float) -> Any:
    from datetime import timedelta

    return timedelta(seconds=seconds)


@pytest.mark.timeout(300)
def test_a_lost_node_that_registers_again_rejoins_and_the_model_is_the_clean_one(
    tmp_path: Path,
) -> None:
    port, procs, logs = two_nodes(tmp_path, epochs=30)
    try:
        deadline = time.monotonic() + 120
        while "epoch 2/30 done" not in logs[0].read_text():
            assert time.monotonic() < deadline and procs[0].poll() is None, logs[0].read_text()
            time.sleep(0.1)
        kill_group(procs[1])
        while "node 1 lost: shrunk" not in logs[0].read_text():
            assert time.monotonic() < deadline, logs[0].read_text()[-3000:]
            time.sleep(0.1)
        again = tmp_path / "again.log"
        args = [str(tmp_path / "again.pt"), "cpu:0", "30", "-"]
        procs.append(start(args, env_for(1, port, "t"), again))
        codes = [finish(procs[0]), finish(procs[2])]
    finally:
        for p in procs:
            kill_group(p)
    text = logs[0].read_text()
    assert codes == [0, 0], text[-3000:] + again.read_text()[-2000:]
    head, node = result_of(logs[0]), result_of(again)
    assert head["steps"] == node["steps"] == 300 and head["ledger_ok"] and node["ledger_ok"]
    assert [f["action"] for f in head["failures"]] == ["shrunk"]
    assert "node 1 (" in text and "registered again: workers [1]" in text
    assert "worker 1's replacement" in text and "joined before step" in text
    assert "Final world size: 2 of 2" in text
    w_head, w_node = weights(tmp_path / "node0.pt"), weights(tmp_path / "again.pt")
    assert same(w_head, w_node)
    assert same(w_head, one_node_run(tmp_path, epochs=30))  # as if no node was lost


# -- fsdp across nodes ----------------------------------------------------------------------

FSDP = {"PHALANX_TEST_STRATEGY": "fsdp"}


@pytest.mark.timeout(300)
def test_fsdp_over_two_nodes_a_killed_worker_is_respawned_from_shards_and_copies(
    tmp_path: Path,
) -> None:
    """fsdp, one worker a node: node 1's worker is killed. Its shard snapshot is in node 1's
    shared memory, and a copy of it on node 0 (each member copies its snapshots to a member
    on another node), so the worker is respawned: the new generation takes the newest set
    of shard snapshots, computes the steps since again, and ends with the model of one node
    that lost nothing."""
    every_step = {**FSDP, "PHALANX_TEST_SNAPSHOT_STEPS": "1"}
    _, procs, logs = two_nodes(tmp_path, epochs=4, faults="kill:1@15", extra_env=every_step)
    finish_all(procs, logs)
    head, node = result_of(logs[0]), result_of(logs[1])
    assert head["steps"] == node["steps"] == 40
    assert head["ledger_ok"] and node["ledger_ok"]
    [fall] = head["failures"]
    assert (fall["worker"], fall["kind"], fall["action"]) == (1, "crash", "respawned")
    assert fall["replayed_steps"] in (0, 1)  # (a set of the step before, not step 0)
    assert "copied to another node" in logs[0].read_text()
    clean = one_node_run(tmp_path, epochs=4, extra_env=FSDP)
    assert same(weights(tmp_path / "node0.pt"), clean)
    assert same(weights(tmp_path / "node1.pt"), clean)


@pytest.mark.timeout(300)
def test_fsdp_a_lost_node_goes_on_from_the_copies_of_its_shard_snapshots(
    tmp_path: Path,
) -> None:
    """fsdp over two nodes, no run_dir, no checkpoint: node 1 is killed with its worker and
    its shared memory. A copy of its member's shard snapshots is on node 0, so node 0's
    member goes on alone from the newest set (its own snapshot and node 1's copy, cut to a
    world of one), computes the steps since again, and ends with the model of a run that
    lost nothing."""
    head = lose_node_one(tmp_path, 6, extra_env={**FSDP, "PHALANX_TEST_SNAPSHOT_STEPS": "2"})
    assert head["steps"] == 60 and head["ledger_ok"]
    [failure] = head["failures"]
    assert failure["worker"] == 1 and failure["action"] == "shrunk"
    # (the set of the snapshot before; two steps apart, plus the one the copy may lag)
    assert failure["replayed_steps"] is not None and 0 <= failure["replayed_steps"] <= 4
    assert same(weights(tmp_path / "node0.pt"), one_node_run(tmp_path, epochs=6, extra_env=FSDP))


@pytest.mark.timeout(300)
def test_fsdp_a_lost_node_restarts_the_others_from_the_newest_sharded_checkpoint(
    tmp_path: Path,
) -> None:
    """fsdp over two nodes sharing run_dir, a sharded checkpoint every 5 steps, snapshots
    off: node 1 is killed with its worker, and no copy of its shards is left in memory:
    node 0's slot starts again from the newest checkpoint (every rank's file in the shared
    run_dir, cut to a world of one) and ends with the model of a run that lost nothing."""
    run_dir = tmp_path / "run"
    env = {**FSDP, "PHALANX_TEST_CHECKPOINT_STEPS": "5", "PHALANX_TEST_SNAPSHOT_STEPS": "off"}
    head = lose_node_one(tmp_path, 6, run_dir=run_dir, extra_env=env)
    assert head["steps"] == 60 and head["ledger_ok"]
    [failure] = head["failures"]
    assert (failure["worker"], failure["action"]) == (1, "restarted")
    # (at most two checkpoint intervals: the newest set may lack node 1's file, when the
    # node was killed before writing its shard of it)
    assert failure["replayed_steps"] is not None and 0 <= failure["replayed_steps"] < 10
    assert same(weights(tmp_path / "node0.pt"), one_node_run(tmp_path, epochs=6, extra_env=FSDP))


@pytest.mark.timeout(300)
def test_fsdp_gather_false_over_two_nodes_ends_in_a_shared_sharded_checkpoint(
    tmp_path: Path,
) -> None:
    """fsdp over two nodes sharing run_dir with gather=False: nobody gathers the model; each
    member writes its shards of the last checkpoint there, and both nodes' results name it
    (each node's script reads it whole): the model of one node."""
    run_dir = tmp_path / "run"
    env = {**FSDP, "PHALANX_TEST_GATHER": "0"}
    _, procs, logs = two_nodes(tmp_path, epochs=2, run_dir=run_dir, extra_env=env)
    finish_all(procs, logs)
    head, node = result_of(logs[0]), result_of(logs[1])
    assert head["steps"] == node["steps"] == 20 and head["ledger_ok"]
    final = str(run_dir / "checkpoints" / "ckpt-000000020.rank-0-of-2.pt")
    assert head["model_path"] == node["model_path"] == final
    assert not (run_dir / "model.pt").exists()
    clean = one_node_run(tmp_path, epochs=2, extra_env=FSDP)
    assert same(weights(tmp_path / "node0.pt"), clean)
    assert same(weights(tmp_path / "node1.pt"), clean)
