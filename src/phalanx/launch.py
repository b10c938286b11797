"""Where this process stands in a job: how many nodes, which one this is, where the head is,
and how many processes the launcher started on this node.

:func:`detect` reads a launcher's environment (a pure function of the mapping it is given;
``fit`` passes ``os.environ``). The node's place comes from the first of these that is
present:

1. ``phalanx``: ``PHALANX_NNODES`` (required once any ``PHALANX_*`` below is set),
   ``PHALANX_NODE_RANK`` (default 0 on one node), ``PHALANX_HEAD=host:port`` (required on
   several nodes). Set by ``phalanx run`` or by hand.
2. ``torchrun`` (``TORCHELASTIC_RUN_ID`` set, as torch's elastic agent sets it for every
   process it starts): ``GROUP_WORLD_SIZE`` nodes, ``GROUP_RANK`` this node (with one process
   per node, torchrun's agents are the nodes), the head ``MASTER_ADDR:MASTER_PORT``.
3. ``slurm`` (``SLURM_JOB_ID`` and a step id, ``SLURM_STEP_ID`` or ``SLURM_STEPID``: a process
   that ``srun`` started; a batch script that runs ``python`` itself is one process on one
   node, ``local``): the step's node count and node list (``SLURM_STEP_NUM_NODES``,
   ``SLURM_STEP_NODELIST``; else the job's ``SLURM_NNODES``/``SLURM_JOB_NUM_NODES`` and
   ``SLURM_JOB_NODELIST``/``SLURM_NODELIST``), this node ``SLURM_NODEID``, the head the first
   host of the node list (expanded here: ``node[01-03,07],gpu-a[1-2]x,login5``) on port
   ``PHALANX_PORT`` (default :data:`DEFAULT_PORT`).
4. ``local``: none of these; one node, no head.

How many processes the launcher started on this node (``local_world_size``) is read from the
launcher that started this process, whichever names the node: torchrun's
``LOCAL_WORLD_SIZE``, else Slurm's tasks on this node (``SLURM_STEP_TASKS_PER_NODE``, else
``SLURM_TASKS_PER_NODE``, e.g. ``2(x3),1``, else ``SLURM_NTASKS_PER_NODE``), else 1. So
``PHALANX_*`` variables cannot make one process of several that torchrun or srun started.

A value that cannot be read (not a whole number, a node rank not below the node count, a head
without a port) raises :class:`~phalanx.errors.LaunchEnvironmentError` (PX140) naming the
variable and the fix. What ``fit`` accepts is decided in :mod:`phalanx.validate`.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from phalanx.errors import LaunchEnvironmentError

Source = Literal["phalanx", "torchrun", "slurm", "local"]
DEFAULT_PORT = 29410  # the head's port under Slurm unless PHALANX_PORT says otherwise
PHALANX_VARS = ("PHALANX_NNODES", "PHALANX_NODE_RANK", "PHALANX_HEAD")
SPARE = -1  # the node rank of a spare: PHALANX_NODE_RANK=spare


@dataclass(frozen=True)
class Address:
    """``host:port`` (an IPv6 host in brackets: ``[::1]:29410``)."""

    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


@dataclass(frozen=True)
class Launch:
    """This process's place in a job, as :func:`detect` read it.

    ``source`` says which environment named the node (``nnodes``, ``node_rank``, ``head``);
    ``local_world_size`` is how many processes ``per_node_from`` (``"torchrun"``,
    ``"slurm"``, or ``""`` when nothing says so: one) started on this node, of which this one
    is ``local_rank``. ``job_id`` is ``PHALANX_RUN_ID``, torchrun's run id or Slurm's job id
    (empty when none is given), ``restart_count``
    torchrun's ``TORCHELASTIC_RESTART_COUNT`` or Slurm's ``SLURM_RESTART_COUNT``.
    """

    source: Source
    nnodes: int = 1
    node_rank: int = 0
    head: Address | None = None
    local_world_size: int = 1
    local_rank: int = 0
    per_node_from: str = ""
    job_id: str = ""
    restart_count: int = 0

    @property
    def spare(self) -> bool:
        """A spare node (``PHALANX_NODE_RANK=spare``): it waits at the head and takes the
        place of whichever node is lost first (see :data:`SPARE`)."""
        return self.node_rank == SPARE

    @property
    def remote(self) -> bool:
        """A node of a run over several nodes other than the head (a spare included)."""
        return self.nnodes > 1 and self.node_rank != 0


def detect(environ: Mapping[str, str]) -> Launch:
    """This process's :class:`Launch` from ``environ`` (see the module docstring for the
    order); raises LaunchEnvironmentError (PX140) for a value it cannot read."""
    local_world_size, local_rank, per_node_from = _per_node(environ)
    node = _from_phalanx(environ) or _from_torchrun(environ) or _from_slurm(environ)
    source, nnodes, node_rank, head, job_id, restarts = node or ("local", 1, 0, None, "", 0)
    return Launch(
        source=source,
        nnodes=nnodes,
        node_rank=node_rank,
        head=head,
        local_world_size=local_world_size,
        local_rank=local_rank,
        per_node_from=per_node_from,
        job_id=job_id,
        restart_count=restarts,
    )


_Node = tuple[Source, int, int, Address | None, str, int]


def _from_phalanx(env: Mapping[str, str]) -> _Node | None:
    if not any(name in env for name in PHALANX_VARS):
        return None
    if "PHALANX_NNODES" not in env:
        given = ", ".join(f"{n}={env[n]!r}" for n in PHALANX_VARS if n in env)
        raise LaunchEnvironmentError(
            f"{given} is set but PHALANX_NNODES is not: set PHALANX_NNODES (the number of "
            "nodes, 1 on one machine) too, or unset the PHALANX_* variables"
        )
    nnodes = _count(env, "PHALANX_NNODES", "the number of nodes")
    spare = env.get("PHALANX_NODE_RANK", "").strip().lower() == "spare"
    node_rank = SPARE if spare else _index(env, "PHALANX_NODE_RANK", nnodes, "PHALANX_NNODES", 0)
    if spare and nnodes < 2:
        raise LaunchEnvironmentError(
            f"PHALANX_NODE_RANK=spare with PHALANX_NNODES={nnodes}: a spare stands in for a "
            "lost node of a run over several nodes; set PHALANX_NNODES to the job's node count"
        )
    head = parse_address(env["PHALANX_HEAD"], "PHALANX_HEAD") if "PHALANX_HEAD" in env else None
    if nnodes > 1 and "PHALANX_NODE_RANK" not in env:
        raise LaunchEnvironmentError(
            f"PHALANX_NNODES={nnodes} but PHALANX_NODE_RANK is not set: set it to this node's "
            f"number, 0 (the head) to {nnodes - 1}, on each node"
        )
    if nnodes > 1 and head is None:
        raise LaunchEnvironmentError(
            f"PHALANX_NNODES={nnodes} but PHALANX_HEAD is not set: set PHALANX_HEAD=host:port "
            "to node 0's address and a free port, the same on every node"
        )
    return "phalanx", nnodes, node_rank, head, env.get("PHALANX_RUN_ID", ""), 0


def _from_torchrun(env: Mapping[str, str]) -> _Node | None:
    if "TORCHELASTIC_RUN_ID" not in env:
        return None
    nnodes = _count(env, "GROUP_WORLD_SIZE", "torchrun's number of nodes", default=1)
    rank_name = "GROUP_RANK" if "GROUP_RANK" in env else "NODE_RANK"
    node_rank = _index(env, rank_name, nnodes, "GROUP_WORLD_SIZE", default=0)
    head = None
    if "MASTER_ADDR" in env or "MASTER_PORT" in env:
        addr, port = env.get("MASTER_ADDR", ""), env.get("MASTER_PORT", "")
        head = parse_address(f"{addr}:{port}", "MASTER_ADDR:MASTER_PORT")
    restarts = _count(env, "TORCHELASTIC_RESTART_COUNT", "a count", default=0, least=0)
    return "torchrun", nnodes, node_rank, head, env["TORCHELASTIC_RUN_ID"], restarts


def _is_srun(env: Mapping[str, str]) -> bool:
    return "SLURM_JOB_ID" in env and ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env)


def _slurm_nodes(env: Mapping[str, str]) -> tuple[str, list[str]]:
    """(the variable that named them, the hosts of the step, else of the job)."""
    for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        if name in env:
            return name, expand_nodelist(env[name], name)
    return "", []


def _from_slurm(env: Mapping[str, str]) -> _Node | None:
    if not _is_srun(env):
        return None
    count_names = ["SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"]
    count_name = next((n for n in count_names if n in env), "SLURM_NNODES")
    list_name, hosts = _slurm_nodes(env)
    nnodes = _count(env, count_name, "Slurm's number of nodes", default=len(hosts) or 1)
    if hosts and len(hosts) != nnodes:
        raise LaunchEnvironmentError(
            f"{count_name}={nnodes} but {list_name} names {len(hosts)} hosts "
            f"({', '.join(hosts[:4])}{', ...' if len(hosts) > 4 else ''}): run the script "
            "through srun, which sets both for its step"
        )
    node_rank = _index(env, "SLURM_NODEID", nnodes, count_name, default=0)
    port = _count(env, "PHALANX_PORT", "a port", default=DEFAULT_PORT)
    head = Address(hosts[0], _port(port, "PHALANX_PORT")) if hosts else None
    restarts = _count(env, "SLURM_RESTART_COUNT", "a count", default=0, least=0)
    return "slurm", nnodes, node_rank, head, env["SLURM_JOB_ID"], restarts


def _per_node(env: Mapping[str, str]) -> tuple[int, int, str]:
    """(processes the launcher started on this node, this one's index among them, which
    launcher): torchrun's, else srun's, else one."""
    if "TORCHELASTIC_RUN_ID" in env:
        size = _count(env, "LOCAL_WORLD_SIZE", "torchrun's processes per node", default=1)
        return size, _index(env, "LOCAL_RANK", size, "LOCAL_WORLD_SIZE", default=0), "torchrun"
    if not _is_srun(env):
        return 1, 0, ""
    size = _slurm_tasks_here(env)
    return size, _index(env, "SLURM_LOCALID", size, "this node's tasks", default=0), "slurm"


def _slurm_tasks_here(env: Mapping[str, str]) -> int:
    node = _count(env, "SLURM_NODEID", "a node number", default=0, least=0)
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        if name in env:
            counts = expand_tasks_per_node(env[name], name)
            if node >= len(counts):
                raise LaunchEnvironmentError(
                    f"SLURM_NODEID={node} but {name}={env[name]!r} describes {len(counts)} "
                    "nodes: run the script through srun, which sets both for its step"
                )
            return counts[node]
    return _count(env, "SLURM_NTASKS_PER_NODE", "Slurm's tasks per node", default=1)


def _count(
    env: Mapping[str, str], name: str, what: str, *, default: int | None = None, least: int = 1
) -> int:
    """``env[name]`` as a whole number >= ``least`` (``default`` when unset)."""
    text = env.get(name)
    if text is None:
        if default is None:
            raise LaunchEnvironmentError(f"{name} is not set ({what})")
        return default
    try:
        value = int(text.strip())
    except ValueError:
        raise LaunchEnvironmentError(
            f"{name}={text!r} is not a whole number ({what}); set it to one, e.g. {name}=1, "
            "or unset it"
        ) from None
    if value < least:
        raise LaunchEnvironmentError(f"{name}={text!r}; it must be >= {least} ({what})")
    return value


def _index(env: Mapping[str, str], name: str, count: int, count_name: str, default: int) -> int:
    value = _count(env, name, "a number from 0", default=default, least=0)
    if value >= count:
        raise LaunchEnvironmentError(
            f"{name}={value} but there are {count_name}={count}: it must be 0 to {count - 1} "
            f"(numbered from 0); fix {name} or {count_name} so that every node has its own "
            "number below the count"
        )
    return value


def _port(value: int, name: str) -> int:
    if not 1 <= value <= 65535:
        raise LaunchEnvironmentError(f"{name}: port {value} is not 1 to 65535; pick a free port")
    return value


def parse_address(text: str, name: str) -> Address:
    """``host:port`` or ``[v6-host]:port`` -> :class:`Address`; PX140 naming ``name`` when
    the host or the port is missing, or the port is not a number from 1 to 65535."""
    example = f"{name}=node0:{DEFAULT_PORT}"
    match = re.fullmatch(r"\[([^\]]+)\]:(\d+)|([^:\[\]]+):(\d+)", text.strip())
    if match is None:
        raise LaunchEnvironmentError(
            f"{name}={text!r} is not host:port; give the head's host and a port, e.g. {example}"
            " (an IPv6 host in brackets: [::1]:29410)"
        )
    host = match.group(1) or match.group(3)
    port = int(match.group(2) or match.group(4))
    return Address(host, _port(port, name))


_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


def expand_nodelist(text: str, name: str = "SLURM_JOB_NODELIST") -> list[str]:
    """Slurm's compact host list, expanded in order: ``node[01-03,07],login5`` ->
    ``node01 node02 node03 node07 login5``. A bracket keeps the width of its zero-padded
    numbers, may sit inside a name (``gpu-a[1-2]x`` -> ``gpu-a1x gpu-a2x``), and several
    brackets in one name multiply (``r[1-2]n[1-2]`` -> ``r1n1 r1n2 r2n1 r2n2``)."""
    hosts: list[str] = []
    for item in _split_top(text, name):
        hosts.extend(_expand_host(item, text, name))
    if not hosts:
        raise LaunchEnvironmentError(f"{name}={text!r} names no host")
    return hosts


def _split_top(text: str, name: str) -> list[str]:
    """``text`` cut at the commas outside brackets."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        if depth not in (0, 1):
            break
        if char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise LaunchEnvironmentError(f"{name}={text!r} has unbalanced brackets")
    items.append(text[start:])
    return [item.strip() for item in items if item.strip()]


def _expand_host(item: str, text: str, name: str) -> list[str]:
    head, bracket, rest = item.partition("[")
    if not bracket:
        if "]" in item:
            raise LaunchEnvironmentError(f"{name}={text!r} has unbalanced brackets")
        return [item]
    body, closed, tail = rest.partition("]")
    if not closed:
        raise LaunchEnvironmentError(f"{name}={text!r} has unbalanced brackets")
    numbers = [n for part in body.split(",") for n in _expand_range(part.strip(), text, name)]
    return [head + n + t for n in numbers for t in _expand_host(tail, text, name)]


def _expand_range(part: str, text: str, name: str) -> list[str]:
    match = _RANGE.fullmatch(part)
    if match is None:
        raise LaunchEnvironmentError(
            f"{name}={text!r}: {part!r} in brackets is not a number or a range like 01-04"
        )
    low, high = match.group(1), match.group(2) or match.group(1)
    if int(high) < int(low):
        raise LaunchEnvironmentError(f"{name}={text!r}: the range {part!r} goes backwards")
    width = len(low) if low.startswith("0") else 0
    return [str(n).zfill(width) for n in range(int(low), int(high) + 1)]


def expand_tasks_per_node(text: str, name: str = "SLURM_TASKS_PER_NODE") -> list[int]:
    """Slurm's tasks per node, one count per node: ``2(x3),1`` -> ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for part in text.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise LaunchEnvironmentError(
                f"{name}={text!r}: {part!r} is not a count or count(xN), as in 2(x3),1"
            )
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


# -- the address the other nodes will see ------------------------------------------------------
def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address, or ``localhost``) is this machine's loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def interface_problem(
    head: str, hostname: str, own: str | None, env: Mapping[str, str], gloo: bool
) -> str | None:
    """Why the other nodes could not reach this one's collectives, or None. ``head``: the
    head's address as resolved here; ``own``: what this host's name (``hostname``)
    resolves to (None: it does not); ``gloo``: CPU devices (else CUDA: NCCL). An interface
    variable (``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``) that selects only loopback is
    named. gloo, without ``GLOO_SOCKET_IFNAME``, binds to the address of the host's name and
    falls back to loopback where that is loopback or unresolvable: the other nodes would be
    given 127.0.0.1 for this node and never connect (NCCL leaves loopback out by itself). A
    head on loopback means every node is on this machine: nothing to check."""
    if is_loopback(head):
        return None
    variable = "GLOO_SOCKET_IFNAME" if gloo else "NCCL_SOCKET_IFNAME"
    value = env.get(variable, "")
    fix = (
        f"Set {variable} to the network interface the nodes share (the one that reaches "
        f"the head at {head}; `ip route get {head}` names it), on every node"
    )
    if value and _only_loopback(value):
        return (
            f"{variable}={value} on this host ({hostname}) selects loopback only, which "
            f"the other nodes cannot reach: they would wait until their timeout. {fix}"
        )
    if not gloo or value or (own is not None and not is_loopback(own)):
        return None
    what = f"resolves to {own}, a loopback address" if own else "does not resolve"
    return (
        f"this host's name ({hostname}) {what}: gloo would bind this node's collectives to "
        "loopback, which the other nodes cannot reach, and they would wait until their "
        f"timeout. {fix}"
    )


def _only_loopback(value: str) -> bool:
    """Whether an interface list (``eth0,ib``; ``^`` excludes, ``=`` is an exact name, as
    NCCL reads it) selects only loopback interfaces (``lo``, ``lo0``)."""
    chosen = [p.strip().lstrip("=") for p in value.split(",") if p.strip()]
    chosen = [p for p in chosen if not p.startswith("^")]
    return bool(chosen) and all(p.startswith("lo") for p in chosen)
