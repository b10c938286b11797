"""What the head and every node share across machines: the node port's address, the check
that gloo will not bind to loopback (PX146), the run's token (PX151) and what must agree
across nodes (:func:`agreement`, PX144)."""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import stat
import time
from datetime import timedelta
from typing import Any

import torch

from phalanx.errors import (
    InterfaceError,
    NoTokenError,
)
from phalanx.launch import Launch, interface_problem
from phalanx.plan import Plan
from phalanx.spec import FitConfig
from phalanx.strategies.ddp.timing import DEFAULT
from phalanx.strategies.ddp.wire.control import TOKEN_ENV
from phalanx.strategies.ddp.wire.link import Link
from phalanx.strategies.ddp.wire.messages import Message, encode
from phalanx.version import __version__

TOKEN_FILE = "token"  # in run_dir, owner-only: the run's token for every node


def link_address(launch: Launch) -> tuple[str, int]:
    """Where the head listens for nodes: ``PHALANX_HEAD`` (Slurm: the first node, on
    ``PHALANX_PORT``); under torchrun the port after ``MASTER_PORT`` (which torchrun's own
    store holds)."""
    assert launch.head is not None
    extra = 1 if launch.source == "torchrun" else 0
    return launch.head.host, launch.head.port + extra


def _resolve(host: str) -> str | None:
    """The first address ``host`` resolves to (IPv4 or IPv6), or None."""
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return None
    return str(found[0][4][0]) if found else None


def check_interface(launch: Launch, config: FitConfig) -> None:
    """PX146 before anything starts, where this node's collectives would bind to loopback
    while the head is on another machine (:func:`phalanx.launch.interface_problem`)."""
    host, _ = link_address(launch)
    head = _resolve(host) or host  # (unresolvable: joining names an unreachable head)
    name = socket.gethostname()
    own = _resolve(name)
    gloo = any(label.startswith("cpu") for label in config.devices)
    problem = interface_problem(head, name, own, os.environ, gloo)
    if problem is not None:
        raise InterfaceError(problem)


# -- the run's token across machines ------------------------------------------------------
def head_token(run_dir: str | None) -> bytes:
    """The head's token: ``PHALANX_TOKEN``, else a new one written to ``run_dir/token``
    (mode 0600), which the nodes read from the shared folder."""
    given = os.environ.get(TOKEN_ENV)
    if given:
        return given.encode()
    if not run_dir:
        raise NoTokenError(
            "a run over several nodes needs a token every node holds: set PHALANX_TOKEN to the "
            "same secret on every node, or give fit a run_dir on a folder every node shares "
            "(the head writes the token there, readable by its owner only)"
        )
    token = secrets.token_hex(32)
    path = os.path.join(run_dir, TOKEN_FILE)
    # A new file, made 0600 (O_EXCL: an old token.tmp, say a crashed head's with a wider
    # mode, or a link planted there, is never written through and never keeps its mode).
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path + ".tmp")
    fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(token)
    os.replace(path + ".tmp", path)
    return token.encode()


def node_token(run_dir: str | None, wait: float, poll: timedelta = DEFAULT.join_poll) -> bytes:
    """A node's token: ``PHALANX_TOKEN``, else the head's ``run_dir/token`` (waited for up
    to ``wait`` seconds, looked for every ``poll``: the head may start later); refused when
    others can read it."""
    given = os.environ.get(TOKEN_ENV)
    if given:
        return given.encode()
    if not run_dir:
        raise NoTokenError(
            "this node has no token for the run: set PHALANX_TOKEN (the same on every node), "
            "or give fit the run_dir the head writes its token to (a shared folder)"
        )
    path = os.path.join(run_dir, TOKEN_FILE)
    deadline = time.monotonic() + wait
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise NoTokenError(f"no token at {path} within {wait:g}s: is the head started?")
        time.sleep(poll.total_seconds())
    if os.stat(path).st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise NoTokenError(f"{path} is readable by others: chmod 600 it (it is the run's key)")
    with open(path) as fh:
        return fh.read().strip().encode()


# -- what must agree across nodes ----------------------------------------------------------
def agreement(config: FitConfig, plan: Plan, precision: str) -> dict[str, Any]:
    """What every node's ``fit`` must have the same of (the devices may differ)."""
    return {
        "torch": torch.__version__,
        "phalanx": __version__,
        "plan": plan.record(),
        "epochs": config.epochs,
        "max_steps": config.max_steps,
        "precision": precision,
        "recovery": repr(config.recovery),
        "hang_timeout": config.hang_timeout.total_seconds(),
        "node_timeout": config.node_timeout.total_seconds(),
        "checkpoint": repr(config.checkpoint),
        "resume": config.resume,
        "snapshots": repr(config.snapshots),
        "balance": config.balance,
        "slow_worker": config.slow_worker,
        "on_bad_sample": config.on_bad_sample,
        "max_bad_samples": config.max_bad_samples,
        "strategy": config.strategy,
        "gather": config.gather,
        "mp_policy": repr(config.mp_policy),
    }


def tell(link: Link, message: Message) -> None:
    """Send ``message`` over ``link`` (as :func:`~.messages.encode` writes it)."""
    link.send_frame(encode(message))
