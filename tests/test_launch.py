"""Where a process stands in a job (``phalanx.launch.detect``), read from launchers'
environments: a table of environments, Slurm's node lists, and the environment a real
torchrun gives its processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from phalanx.errors import ConfigError, LaunchEnvironmentError
from phalanx.launch import (
    DEFAULT_PORT,
    SPARE,
    Address,
    Launch,
    detect,
    expand_nodelist,
    expand_tasks_per_node,
    interface_problem,
)

TORCHRUN = Path(sys.executable).with_name("torchrun")

# What torch 2.13's elastic agent set for rank 1 of `torchrun --standalone --nproc-per-node 2`
# (captured with a script that dumped os.environ; the variables it adds, minus its temp paths).
TORCHRUN_2_13_RANK_1 = {
    "GROUP_RANK": "0",
    "GROUP_WORLD_SIZE": "1",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "localhost",
    "MASTER_PORT": "35175",
    "OMP_NUM_THREADS": "1",
    "RANK": "1",
    "ROLE_NAME": "default",
    "ROLE_RANK": "1",
    "ROLE_WORLD_SIZE": "2",
    "TORCHELASTIC_MAX_RESTARTS": "0",
    "TORCHELASTIC_RESTART_COUNT": "0",
    "TORCHELASTIC_RUN_ID": "398aa043-2443-4d39-b501-6687d336b843",
    "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
    "TORCHELASTIC_USE_AGENT_STORE": "True",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    "WORLD_SIZE": "2",
}


def torchrun_env(nodes: int, node: int, per_node: int, local: int, **extra: str) -> dict[str, str]:
    return {
        "TORCHELASTIC_RUN_ID": "job7",
        "TORCHELASTIC_RESTART_COUNT": "2",
        "GROUP_WORLD_SIZE": str(nodes),
        "GROUP_RANK": str(node),
        "LOCAL_WORLD_SIZE": str(per_node),
        "LOCAL_RANK": str(local),
        "WORLD_SIZE": str(nodes * per_node),
        "RANK": str(node * per_node + local),
        "MASTER_ADDR": "n0.cluster",
        "MASTER_PORT": "29500",
        **extra,
    }


def srun_env(**values: str) -> dict[str, str]:
    base = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0"}
    return {**base, **values}


CASES: list[tuple[str, dict[str, str], Launch]] = [
    ("nothing", {}, Launch("local")),
    ("unrelated variables", {"HOME": "/root", "RANK": "3"}, Launch("local")),
    ("phalanx, one node", {"PHALANX_NNODES": "1"}, Launch("phalanx")),
    (
        "phalanx, node 2 of 4",
        {
            "PHALANX_NNODES": "4",
            "PHALANX_NODE_RANK": "2",
            "PHALANX_HEAD": "node0:29410",
            "PHALANX_RUN_ID": "exp3",
        },
        Launch("phalanx", nnodes=4, node_rank=2, head=Address("node0", 29410), job_id="exp3"),
    ),
    (
        "phalanx, a spare",
        {"PHALANX_NNODES": "2", "PHALANX_NODE_RANK": " Spare ", "PHALANX_HEAD": "node0:29410"},
        Launch("phalanx", nnodes=2, node_rank=SPARE, head=Address("node0", 29410)),
    ),
    (
        "phalanx, IPv6 head and spaces",
        {"PHALANX_NNODES": " 2 ", "PHALANX_NODE_RANK": "0", "PHALANX_HEAD": "[fe80::1]:7"},
        Launch("phalanx", nnodes=2, head=Address("fe80::1", 7)),
    ),
    (
        "phalanx beats torchrun for the node; torchrun still counts the processes",
        {"PHALANX_NNODES": "1", **torchrun_env(3, 1, 2, 1)},
        Launch(
            "phalanx",
            local_world_size=2,
            local_rank=1,
            per_node_from="torchrun",
        ),
    ),
    (
        "torchrun, captured from torch 2.13 (--standalone --nproc-per-node 2, rank 1)",
        TORCHRUN_2_13_RANK_1,
        Launch(
            "torchrun",
            head=Address("localhost", 35175),
            local_world_size=2,
            local_rank=1,
            per_node_from="torchrun",
            job_id="398aa043-2443-4d39-b501-6687d336b843",
        ),
    ),
    (
        "torchrun, node 1 of 2, one process per node, third attempt",
        torchrun_env(2, 1, 1, 0),
        Launch(
            "torchrun",
            nnodes=2,
            node_rank=1,
            head=Address("n0.cluster", 29500),
            per_node_from="torchrun",
            job_id="job7",
            restart_count=2,
        ),
    ),
    (
        "torchrun beats Slurm (torchrun under srun)",
        {**srun_env(SLURM_NNODES="2", SLURM_NODEID="1"), **torchrun_env(2, 1, 1, 0)},
        Launch(
            "torchrun",
            nnodes=2,
            node_rank=1,
            head=Address("n0.cluster", 29500),
            per_node_from="torchrun",
            job_id="job7",
            restart_count=2,
        ),
    ),
    (
        "srun, one task on each of 3 nodes, this is the second",
        srun_env(
            SLURM_NNODES="3",
            SLURM_NODEID="1",
            SLURM_JOB_NODELIST="gpu[07-09]",
            SLURM_TASKS_PER_NODE="1(x3)",
            SLURM_LOCALID="0",
        ),
        Launch(
            "slurm",
            nnodes=3,
            node_rank=1,
            head=Address("gpu07", DEFAULT_PORT),
            per_node_from="slurm",
            job_id="4242",
        ),
    ),
    (
        "srun step over 1 node of a 2-node job; PHALANX_PORT; a requeued job",
        srun_env(
            SLURM_STEPID="0",
            SLURM_NNODES="2",
            SLURM_JOB_NODELIST="a,b",
            SLURM_STEP_NUM_NODES="1",
            SLURM_STEP_NODELIST="b",
            SLURM_STEP_TASKS_PER_NODE="1",
            SLURM_TASKS_PER_NODE="4(x2)",
            PHALANX_PORT="31000",
            SLURM_RESTART_COUNT="1",
        ),
        Launch(
            "slurm",
            head=Address("b", 31000),
            per_node_from="slurm",
            job_id="4242",
            restart_count=1,
        ),
    ),
    (
        "srun, 2 tasks per node: the count of this node, from the uneven list",
        srun_env(
            SLURM_NNODES="3",
            SLURM_NODEID="2",
            SLURM_NODELIST="n[1-3]",
            SLURM_TASKS_PER_NODE="2(x2),3",
            SLURM_LOCALID="2",
        ),
        Launch(
            "slurm",
            nnodes=3,
            node_rank=2,
            head=Address("n1", DEFAULT_PORT),
            local_world_size=3,
            local_rank=2,
            per_node_from="slurm",
            job_id="4242",
        ),
    ),
    (
        "srun with only SLURM_NTASKS_PER_NODE",
        srun_env(SLURM_NNODES="1", SLURM_NODELIST="x1", SLURM_NTASKS_PER_NODE="4"),
        Launch(
            "slurm",
            head=Address("x1", DEFAULT_PORT),
            local_world_size=4,
            per_node_from="slurm",
            job_id="4242",
        ),
    ),
    (
        "a batch script (a job, no srun step) is one process on one node",
        {"SLURM_JOB_ID": "9", "SLURM_NNODES": "4", "SLURM_TASKS_PER_NODE": "8(x4)"},
        Launch("local"),
    ),
]


@pytest.mark.parametrize(("environ", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_detect(environ: dict[str, str], expected: Launch) -> None:
    assert detect(environ) == expected


BAD: list[tuple[dict[str, str], str]] = [
    ({"PHALANX_NNODES": "two"}, r"PHALANX_NNODES='two' is not a whole number"),
    ({"PHALANX_NNODES": "0"}, r"PHALANX_NNODES='0'; it must be >= 1"),
    ({"PHALANX_NNODES": "1.5"}, r"not a whole number"),
    (
        {"PHALANX_NNODES": "2", "PHALANX_NODE_RANK": "2", "PHALANX_HEAD": "h:1"},
        r"PHALANX_NODE_RANK=2 but there are PHALANX_NNODES=2: it must be 0 to 1",
    ),
    (
        {"PHALANX_NNODES": "2", "PHALANX_NODE_RANK": "-1", "PHALANX_HEAD": "h:1"},
        r"PHALANX_NODE_RANK='-1'; it must be >= 0",
    ),
    ({"PHALANX_NNODES": "2", "PHALANX_NODE_RANK": "1"}, r"PHALANX_HEAD is not set"),
    ({"PHALANX_NNODES": "1", "PHALANX_NODE_RANK": "spare"}, r"a spare stands in for a lost"),
    ({"PHALANX_NNODES": "2", "PHALANX_NODE_RANK": "spare"}, r"PHALANX_HEAD is not set"),
    ({"PHALANX_NNODES": "2", "PHALANX_HEAD": "h:1"}, r"PHALANX_NODE_RANK is not set"),
    ({"PHALANX_NNODES": "1", "PHALANX_HEAD": "node0"}, r"PHALANX_HEAD='node0' is not host:port"),
    ({"PHALANX_NNODES": "1", "PHALANX_HEAD": "node0:"}, r"is not host:port"),
    ({"PHALANX_NNODES": "1", "PHALANX_HEAD": ":29410"}, r"is not host:port"),
    ({"PHALANX_NNODES": "1", "PHALANX_HEAD": "::1:29410"}, r"is not host:port"),
    ({"PHALANX_NNODES": "1", "PHALANX_HEAD": "h:70000"}, r"port 70000 is not 1 to 65535"),
    ({"PHALANX_NODE_RANK": "0"}, r"PHALANX_NODE_RANK='0' is set but PHALANX_NNODES is not"),
    (torchrun_env(2, 2, 1, 0), r"GROUP_RANK=2 but there are GROUP_WORLD_SIZE=2"),
    (torchrun_env(1, 0, 2, 0, LOCAL_RANK="x"), r"LOCAL_RANK='x' is not a whole number"),
    (torchrun_env(1, 0, 1, 0, MASTER_PORT=""), r"MASTER_ADDR:MASTER_PORT='n0.cluster:'"),
    (srun_env(SLURM_NNODES="2", SLURM_NODEID="2", SLURM_NODELIST="a,b"), r"SLURM_NODEID=2"),
    (srun_env(SLURM_NNODES="3", SLURM_NODELIST="a[1-2]"), r"SLURM_NNODES=3 but SLURM_NODELIST"),
    (srun_env(SLURM_NNODES="1", SLURM_NODELIST="a[1-2"), r"unbalanced brackets"),
    (srun_env(SLURM_NNODES="1", SLURM_NODELIST="a", PHALANX_PORT="0"), r"PHALANX_PORT='0'"),
    (srun_env(SLURM_NNODES="1", SLURM_TASKS_PER_NODE="2(3)"), r"is not a count or count\(xN\)"),
    (
        srun_env(SLURM_NNODES="3", SLURM_NODEID="2", SLURM_STEP_TASKS_PER_NODE="1(x2)"),
        r"SLURM_NODEID=2 but SLURM_STEP_TASKS_PER_NODE='1\(x2\)' describes 2 nodes",
    ),
]


@pytest.mark.parametrize(("environ", "message"), BAD)
def test_detect_refuses_what_it_cannot_read(environ: dict[str, str], message: str) -> None:
    with pytest.raises(LaunchEnvironmentError, match=message) as info:
        detect(environ)
    assert isinstance(info.value, ConfigError) and info.value.code == "PX140"


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("login5", ["login5"]),
        ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
        (
            "node[01-03,07],gpu-a[1-2]x,login5",
            ["node01", "node02", "node03", "node07", "gpu-a1x", "gpu-a2x", "login5"],
        ),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("a,b, c", ["a", "b", "c"]),
        ("x[5]", ["x5"]),
        ("10.0.0.[1-2]", ["10.0.0.1", "10.0.0.2"]),
    ],
)
def test_expand_nodelist(text: str, hosts: list[str]) -> None:
    assert expand_nodelist(text) == hosts


@pytest.mark.parametrize("text", ["a[1-2", "a]1", "a[3-1]", "a[x]", "a[1-]", "", "a[[1]]", ","])
def test_expand_nodelist_refuses_malformed_lists(text: str) -> None:
    with pytest.raises(LaunchEnvironmentError):
        expand_nodelist(text, "SLURM_JOB_NODELIST")


def test_expand_tasks_per_node() -> None:
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("4") == [4]
    with pytest.raises(LaunchEnvironmentError):
        expand_tasks_per_node("2,,1")


def test_address_prints_back_as_it_was_given() -> None:
    assert str(Address("node0", 29410)) == "node0:29410"
    assert str(Address("::1", 5)) == "[::1]:5"


DUMP = """
import json, os, sys
with open(os.path.join(sys.argv[1], f"env-{os.environ['RANK']}.json"), "w") as fh:
    json.dump(dict(os.environ), fh)
"""


def _torchrun_envs(tmp_path: Path, nproc: int) -> list[dict[str, Any]]:
    script = tmp_path / "dump.py"
    script.write_text(textwrap.dedent(DUMP))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PHALANX_", "SLURM_"))}
    subprocess.run(
        [str(TORCHRUN), "--standalone", "--nproc-per-node", str(nproc), str(script), str(tmp_path)],
        check=True,
        capture_output=True,
        timeout=90,
        env=env,
    )
    return [json.loads((tmp_path / f"env-{r}.json").read_text()) for r in range(nproc)]


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_a_real_torchrun_environment(tmp_path: Path, nproc: int) -> None:
    envs = _torchrun_envs(tmp_path, nproc)
    launches = [detect(env) for env in envs]
    for rank, launch in enumerate(launches):
        assert launch.source == "torchrun" and launch.per_node_from == "torchrun"
        assert (launch.nnodes, launch.node_rank) == (1, 0)
        assert (launch.local_world_size, launch.local_rank) == (nproc, rank)
        assert launch.head is not None and launch.head.port == int(envs[rank]["MASTER_PORT"])
        assert launch.job_id == envs[rank]["TORCHELASTIC_RUN_ID"] != ""
    assert len({launch.head for launch in launches}) == 1


@pytest.mark.parametrize(
    ("head", "own", "env", "gloo", "refused"),
    [
        ("10.0.0.1", "127.0.1.1", {}, True, True),  # /etc/hosts maps the name to loopback
        ("10.0.0.1", None, {}, True, True),  # the name does not resolve
        ("10.0.0.1", "127.0.1.1", {"GLOO_SOCKET_IFNAME": "eth0"}, True, False),
        ("10.0.0.1", "10.0.0.2", {}, True, False),  # the name reaches the network
        ("10.0.0.1", "127.0.1.1", {}, False, False),  # CUDA devices: NCCL picks its own
        ("127.0.0.1", "127.0.0.1", {}, True, False),  # every node on this machine
        ("::1", None, {}, True, False),
        ("10.0.0.1", "10.0.0.2", {"GLOO_SOCKET_IFNAME": "lo"}, True, True),  # named: loopback
        ("10.0.0.1", "10.0.0.2", {"NCCL_SOCKET_IFNAME": "=lo"}, False, True),
        ("10.0.0.1", "10.0.0.2", {"NCCL_SOCKET_IFNAME": "lo,lo0"}, False, True),
        ("10.0.0.1", "10.0.0.2", {"NCCL_SOCKET_IFNAME": "^lo,docker"}, False, False),
        ("10.0.0.1", "127.0.1.1", {"NCCL_SOCKET_IFNAME": "ib,eth"}, False, False),
        ("10.0.0.1", "10.0.0.2", {"GLOO_SOCKET_IFNAME": "lo"}, False, False),  # (NCCL's run)
        ("127.0.0.1", "127.0.0.1", {"NCCL_SOCKET_IFNAME": "lo"}, False, False),
    ],
)
def test_an_interface_that_the_other_nodes_cannot_reach_is_named(
    head: str, own: str | None, env: dict[str, str], gloo: bool, refused: bool
) -> None:
    problem = interface_problem(head, "node7", own, env, gloo)
    assert (problem is not None) == refused
    if problem is not None:
        variable = "GLOO_SOCKET_IFNAME" if gloo else "NCCL_SOCKET_IFNAME"
        assert "node7" in problem and variable in problem and head in problem
