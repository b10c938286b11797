"""Two nodes as two network namespaces joined by a veth pair (10.77.x.1 and 10.77.x.2), so
the head's address is not loopback and each node's gloo uses its own interface
(``GLOO_SOCKET_IFNAME``). Needs root and ``ip``; the namespaces are made and torn down here.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from phalanx.launch import is_loopback
from procs import TESTS_DIR
from test_failover import newest_step
from test_multinode import (
    SCRIPT,
    SRC,
    finish,
    finish_all,
    kill_group,
    one_node_run,
    result_of,
    same,
    wait_for,
    weights,
)

pytestmark = [
    pytest.mark.skipif(
        sys.platform != "linux" or os.geteuid() != 0 or shutil.which("ip") is None,
        reason="network namespaces need root and ip",
    ),
    pytest.mark.slow,
]


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture
def namespaces() -> Iterator[list[tuple[str, str, str]]]:
    """[(namespace, interface, address)] for node 0 and node 1."""
    tag = f"{os.getpid() % 200 + 20}"
    nodes = [(f"pxt{tag}n{i}", f"pxv{tag}n{i}", f"10.77.{tag}.{i + 1}") for i in (0, 1)]
    try:
        for ns, _, _ in nodes:
            ip("netns", "add", ns)
        ip("link", "add", nodes[0][1], "type", "veth", "peer", "name", nodes[1][1])
        for ns, dev, addr in nodes:
            ip("link", "set", dev, "netns", ns)
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            ip("-n", ns, "link", "set", dev, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        yield nodes
    finally:
        for ns, _, _ in nodes:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.fixture
def three_hosts() -> Iterator[list[tuple[str, str, str]]]:
    """[(namespace, interface, address)] for nodes 0, 1 and 2, each joined by a veth pair
    to a bridge in a namespace of its own (a switch): a node's link can be cut alone."""
    tag = f"{os.getpid() % 200 + 20}"
    switch = f"pxt{tag}sw"
    nodes = [(f"pxt{tag}h{i}", f"pxv{tag}h{i}", f"10.78.{tag}.{i + 1}") for i in (0, 1, 2)]
    made = [switch]
    try:
        ip("netns", "add", switch)
        ip("-n", switch, "link", "add", "br0", "type", "bridge")
        ip("-n", switch, "link", "set", "br0", "up")
        for i, (ns, dev, addr) in enumerate(nodes):
            ip("netns", "add", ns)
            made.append(ns)
            port = f"pxp{tag}h{i}"
            ip("link", "add", dev, "type", "veth", "peer", "name", port)
            ip("link", "set", dev, "netns", ns)
            ip("link", "set", port, "netns", switch)
            ip("-n", switch, "link", "set", port, "master", "br0")
            ip("-n", switch, "link", "set", port, "up")
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            ip("-n", ns, "link", "set", dev, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        yield nodes
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def start_in(
    node: tuple[str, str, str],
    rank: int,
    head: str,
    args: list[str],
    log: Path,
    ifname: bool = True,
    node_timeout: float | None = None,
    nnodes: int = 2,
    extra_env: dict[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    ns, dev, _ = node
    env = dict(os.environ, **(extra_env or {}))
    env.pop("GLOO_SOCKET_IFNAME", None)
    env.update(
        PYTHONPATH=os.pathsep.join([str(SRC), str(TESTS_DIR)]),
        PHALANX_NNODES=str(nnodes),
        PHALANX_NODE_RANK=str(rank),
        PHALANX_HEAD=head,
        PHALANX_TOKEN="netns token",
    )
    if ifname:
        env["GLOO_SOCKET_IFNAME"] = dev
    if node_timeout is not None:
        env["PHALANX_TEST_NODE_TIMEOUT"] = str(node_timeout)
    out = open(log, "wb")  # noqa: SIM115 - closed with the process
    cmd = ["ip", "netns", "exec", ns, sys.executable, str(SCRIPT), *args]
    return subprocess.Popen(
        cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
    )


@pytest.mark.timeout(300)
def test_two_nodes_in_two_namespaces_train_as_one_job(
    tmp_path: Path, namespaces: list[tuple[str, str, str]]
) -> None:
    head = f"{namespaces[0][2]}:29610"
    logs = [tmp_path / "n0.log", tmp_path / "n1.log"]
    procs = [
        start_in(namespaces[r], r, head, [str(tmp_path / f"n{r}.pt"), "cpu:0", "3", "-"], logs[r])
        for r in (0, 1)
    ]
    finish_all(procs, logs)
    assert result_of(logs[0])["steps"] == result_of(logs[1])["steps"] == 30
    assert result_of(logs[1])["ledger_ok"]
    assert same(weights(tmp_path / "n0.pt"), weights(tmp_path / "n1.pt"))
    assert f"waiting for 1 node(s) at {head}" in logs[0].read_text()


@pytest.mark.timeout(300)
def test_a_cut_link_is_named_on_both_sides_and_the_head_goes_on(
    tmp_path: Path, namespaces: list[tuple[str, str, str]]
) -> None:
    """The node's interface goes down mid-run (a silent partition: no packet, no reset).
    The node names the head lost (PX147, exit status 75) and stops its workers within
    node_timeout and a few seconds; the head names the node lost after node_timeout, its
    worker abandons the collective it was blocked in with the cut-off peer, and the run
    goes on without the node to its end with an exact ledger."""
    head = f"{namespaces[0][2]}:29611"
    logs = [tmp_path / "n0.log", tmp_path / "n1.log"]
    args = ["cpu:0", "60", "-", "shrink"]
    procs = [
        start_in(namespaces[r], r, head, [str(tmp_path / f"n{r}.pt"), *args], logs[r])
        for r in (0, 1)
    ]
    try:
        wait_for("epoch 2/60 done", logs[0], procs[0])
        ip("-n", namespaces[1][0], "link", "set", namespaces[1][1], "down")
        cut = time.monotonic()
        node_code = finish(procs[1], timeout=60)
        node_took = time.monotonic() - cut
        head_code = finish(procs[0], timeout=120)
        head_took = time.monotonic() - cut
    finally:
        for p in procs:
            kill_group(p)
    node_text, head_text = logs[1].read_text(), logs[0].read_text()
    assert node_code == 75 and "[PX147]" in node_text and "the head at" in node_text
    assert "nothing was saved (no run_dir" in node_text  # (this run has none)
    assert node_took < 10 + 8, node_took  # node_timeout, then its workers are stopped
    assert "node 1 (" in head_text and "no word for 1" in head_text  # after node_timeout
    assert head_code == 0 and head_took < 100, head_text[-3000:]
    result = result_of(logs[0])
    assert result["steps"] == 600 and result["ledger_ok"]
    [failure] = result["failures"]
    assert failure["action"] == "shrunk" and failure["recovery_seconds"] < 5.0


def host_one_dies(
    tmp_path: Path,
    namespaces: list[tuple[str, str, str]],
    head: str,
    extra_env: dict[str, str] | None = None,
) -> tuple[float, str]:
    """Two nodes of one worker, 12 epochs, shrink, node_timeout 3 s; once the head finished
    epoch 2, node 1's host dies: its link down, its processes killed, its namespace
    deleted. When it died, and the head's log once it ended (it must end well)."""
    logs = [tmp_path / "n0.log", tmp_path / "n1.log"]
    args = ["cpu:0", "12", "-", "shrink"]
    procs = [
        start_in(
            namespaces[r], r, head, [str(tmp_path / f"n{r}.pt"), *args], logs[r], node_timeout=3,
            extra_env=extra_env,
        )
        for r in (0, 1)
    ]  # fmt: skip
    try:
        wait_for("epoch 2/12 done", logs[0], procs[0])
        ip("-n", namespaces[1][0], "link", "set", namespaces[1][1], "down")
        died = time.time()
        kill_group(procs[1])
        subprocess.run(["ip", "netns", "del", namespaces[1][0]], check=True)
        head_code = finish(procs[0], timeout=120)
    finally:
        for p in procs:
            kill_group(p)
    head_text = logs[0].read_text()
    assert head_code == 0, head_text[-3000:]
    return died, head_text


@pytest.mark.timeout(300)
def test_a_non_head_host_that_dies_is_named_and_the_run_ends_as_if_nothing_was_lost(
    tmp_path: Path, namespaces: list[tuple[str, str, str]]
) -> None:
    """Node 1's host dies: its interface goes down, then its processes are killed (their
    sockets close with no packet leaving) and its namespace is deleted. The head hears
    nothing more, names the node lost after node_timeout (3 s here) by its silence, goes
    on without it, and ends with the model of a run that lost nothing."""
    head = f"{namespaces[0][2]}:29612"
    died, _ = host_one_dies(tmp_path, namespaces, head)
    result = result_of(tmp_path / "n0.log")
    assert result["steps"] == 120 and result["ledger_ok"]
    [failure] = result["failures"]
    assert failure["action"] == "shrunk" and "no word for" in failure["message"]
    assert failure["message"].startswith("node 1 (")
    assert 2.0 <= failure["time"] - died < 3.0 + 3.0  # node_timeout after its last word
    assert failure["recovery_seconds"] < 5.0
    assert same(weights(tmp_path / "n0.pt"), one_node_run(tmp_path, epochs=12))


@pytest.mark.timeout(300)
def test_fsdp_a_host_that_dies_leaves_the_copies_of_its_shards_on_the_other(
    tmp_path: Path, namespaces: list[tuple[str, str, str]]
) -> None:
    """fsdp, one worker a host, no run_dir: node 1's host dies (its link down, its processes
    killed, its namespace deleted). Its member's shard snapshots were copied to node 0 over
    the hosts' own addresses, so node 0's member goes on alone from the newest set (its own
    snapshot and the copy, cut to a world of one) and ends with the model of a run that
    lost nothing. A copy to the dead host under way is ended by the group's abort."""
    head = f"{namespaces[0][2]}:29613"
    env = {"PHALANX_TEST_STRATEGY": "fsdp", "PHALANX_TEST_SNAPSHOT_STEPS": "2"}
    _, head_text = host_one_dies(tmp_path, namespaces, head, env)
    result = result_of(tmp_path / "n0.log")
    assert result["steps"] == 120 and result["ledger_ok"]
    [failure] = result["failures"]
    assert failure["action"] == "shrunk" and failure["message"].startswith("node 1 (")
    assert 0 <= failure["replayed_steps"] <= 4  # (snapshots every 2 steps)
    assert "copied to another node" in head_text
    clean = one_node_run(tmp_path, epochs=12, extra_env={"PHALANX_TEST_STRATEGY": "fsdp"})
    assert same(weights(tmp_path / "n0.pt"), clean)


@pytest.mark.timeout(120)
def test_a_host_name_on_loopback_is_refused_on_every_node_before_anything_trains(
    tmp_path: Path, namespaces: list[tuple[str, str, str]]
) -> None:
    """This machine's name resolves to 127.0.0.1 (its /etc/hosts), as on many images: without
    GLOO_SOCKET_IFNAME, gloo would bind each node's collectives to loopback and the nodes
    would wait on each other until their timeout. Every node refuses with PX146, naming the
    fix, before the head listens or the node joins."""
    if not is_loopback(socket.gethostbyname(socket.gethostname())):
        pytest.skip("this host's name does not resolve to loopback here")
    head = f"{namespaces[0][2]}:29612"
    logs = [tmp_path / "n0.log", tmp_path / "n1.log"]
    args = ["cpu:0", "2", "-"]
    started = time.monotonic()
    procs = [
        start_in(namespaces[r], r, head, [str(tmp_path / f"n{r}.pt"), *args], logs[r], False)
        for r in (0, 1)
    ]
    try:
        codes = [finish(p, timeout=60) for p in procs]
    finally:
        for p in procs:
            kill_group(p)
    took = time.monotonic() - started
    for log in logs:
        text = log.read_text()
        assert "PX146" in text and "GLOO_SOCKET_IFNAME" in text, text[-2000:]
        assert "RESULT" not in text and "waiting for 1 node" not in text
    assert codes == [1, 1] and took < 30, took


def start_three(
    hosts: list[tuple[str, str, str]],
    port: int,
    tmp_path: Path,
    args: list[str],
    extra_env: dict[str, str] | None = None,
) -> tuple[list[subprocess.Popen[bytes]], list[Path]]:
    """The three hosts' nodes (``node_timeout`` 3 s), the head on host 0 at ``port``; node
    k's log and model are ``n{k}.log`` and ``n{k}.pt``."""
    head = f"{hosts[0][2]}:{port}"
    logs = [tmp_path / f"n{r}.log" for r in (0, 1, 2)]
    procs = [
        start_in(
            hosts[r], r, head, [str(tmp_path / f"n{r}.pt"), *args], logs[r], True, 3, 3, extra_env
        )
        for r in (0, 1, 2)
    ]
    return procs, logs


def newest_step_at_least(run_dir: Path, step: int, head: subprocess.Popen[bytes]) -> None:
    """Until the head's ``steps.csv`` (a row each committed step, flushed) reaches ``step``."""
    deadline = time.monotonic() + 120
    while newest_step(run_dir) < step:
        assert time.monotonic() < deadline and head.poll() is None
        time.sleep(0.01)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_the_heads_link_cut_the_two_other_nodes_take_over_and_the_head_is_fenced(
    tmp_path: Path, three_hosts: list[tuple[str, str, str]], strategy: str
) -> None:
    """Three hosts on a switch, a shared run_dir; the head's link goes down mid-run (a
    partition: it and its worker live on, alone). Nodes 1 and 2 (two of three) name the head
    lost after node_timeout, node 1 takes over, node 2 follows it, and both end with the model
    of a run that lost nothing and an exact ledger. The head, on its side, loses both nodes,
    which may be the side that takes over (two of three, their leader among them): it stands
    down at once, its worker keeping the committed step, then finds node 1's term in
    head.json and ends with PX145 (exit 1); PX147 (exit 75) only were no term to come in the
    takeover's time. It writes no result. No namespace is left (the fixture). Under fsdp
    (snapshots every 2 steps) the same, from the shard snapshots nodes 1 and 2 hold (their
    own, and node 1's copies of the head's member's): the head, standing down, writes none
    of its own (they would land in run_dir while the other side resumes from it)."""
    run_dir = tmp_path / "run"
    env = {"PHALANX_TEST_STRATEGY": strategy, "PHALANX_TEST_SNAPSHOT_STEPS": "2"}
    env = env if strategy == "fsdp" else {}
    args = ["cpu:0", "12", str(run_dir)]
    procs, logs = start_three(three_hosts, 29613, tmp_path, args, env)
    try:
        wait_for("epoch 2/12 done", logs[0], procs[0])
        if strategy == "fsdp":  # (past the next snapshots, mid-epoch: none is a checkpoint's)
            newest_step_at_least(run_dir, 25, procs[0])
        ip("-n", three_hosts[0][0], "link", "set", three_hosts[0][1], "down")
        codes = [finish(p, timeout=200) for p in procs[1:]]
        head_code = finish(procs[0], timeout=60)
    finally:
        for p in procs:
            kill_group(p)
    texts = [log.read_text() for log in logs]
    assert codes == [0, 0], "\n".join(t[-3000:] for t in texts[1:])
    assert "this node takes over as the head, with node(s) [2]" in texts[1]
    assert f"following node 1, the new head, at {three_hosts[1][2]}:" in texts[2]
    results = [result_of(logs[r]) for r in (1, 2)]
    assert [r["steps"] for r in results] == [120, 120] and all(r["ledger_ok"] for r in results)
    lost = [f for f in results[0]["failures"] if ", the head, lost" in f["message"]]
    assert len(lost) == 1 and "no word for" in lost[0]["message"]
    clean = one_node_run(tmp_path, epochs=12, extra_env=env)
    assert same(weights(tmp_path / "n1.pt"), clean) and same(weights(tmp_path / "n2.pt"), clean)
    stood_down = "so that at most one side goes on" in texts[0] and "[PX147]" in texts[0]
    fenced = "PX145" in texts[0] and "was replaced by node 1" in texts[0]
    assert (head_code, stood_down) == (75, True) or (head_code != 0 and fenced), texts[0][-3000:]
    assert "RESULT" not in texts[0]
    if strategy == "fsdp":
        assert "the survivors first kept there the shard snapshots" in lost[0]["message"]
        assert lost[0]["replayed_steps"] <= 4, lost[0]  # (snapshots every 2 steps)
        assert "a head that stands down keeps nothing" in texts[0] or fenced, texts[0][-3000:]


@pytest.mark.timeout(400)
def test_a_node_cut_off_alone_does_not_take_over_and_the_run_goes_on_under_its_head(
    tmp_path: Path, three_hosts: list[tuple[str, str, str]]
) -> None:
    """Three hosts, node 1's link cut: node 1 loses the head, and by the succession it would
    lead; but node 2 still hears the head and never comes, so node 1 (one of three) does not
    take over: it saves and exits 75, claiming no term. The head names node 1 lost and ends
    the run with node 2, the model of a run that lost nothing, and still term 1."""
    run_dir = tmp_path / "run"
    args = ["cpu:0", "12", str(run_dir), "shrink"]
    procs, logs = start_three(three_hosts, 29614, tmp_path, args)
    try:
        wait_for("epoch 2/12 done", logs[0], procs[0])
        ip("-n", three_hosts[1][0], "link", "set", three_hosts[1][1], "down")
        node1_code = finish(procs[1], timeout=120)
        codes = [finish(procs[r], timeout=200) for r in (0, 2)]
    finally:
        for p in procs:
            kill_group(p)
    texts = [log.read_text() for log in logs]
    assert node1_code == 75, texts[1][-3000:]
    assert "only 1 of the run's 3 nodes reached it (no other node came)" in texts[1]
    assert "cut off from this node only" in texts[1] and "[PX147]" in texts[1]
    assert codes == [0, 0], "\n".join(texts[r][-3000:] for r in (0, 2))
    results = [result_of(logs[r]) for r in (0, 2)]
    assert [r["steps"] for r in results] == [120, 120] and all(r["ledger_ok"] for r in results)
    [failure] = results[0]["failures"]
    assert failure["message"].startswith("node 1 (") and failure["action"] == "shrunk"
    assert json.loads((run_dir / "head.json").read_text())["term"] == 1
    assert same(weights(tmp_path / "n0.pt"), one_node_run(tmp_path, epochs=12))
