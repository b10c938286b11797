"""``px.rank()``, ``px.world_size()``, ``px.is_main()``: who is asking, for user code.

A plain DDP script asks torch (``dist.get_rank() == 0``) before it saves a file or prints.
phalanx never creates torch's default process group (each generation of a ddp run owns a
group of its own, see :mod:`phalanx.strategies.ddp.worker.group`), so torch's calls have nothing to
answer from; these three answer instead, wherever user code runs:

- inside training (the model factory, the step, a metric, a validation pass), on any
  strategy: this member's rank in the current generation and the generation's size (after a
  shrink, the smaller group); the main member (rank 0) is the one that writes files;
- in the script around ``fit`` (one process per node): the node's rank (0 on one machine,
  and on the head of several), and, given the devices that node passes to ``fit``, the
  job's device count: ``nodes x devices`` (every node names the same number of devices).

The member's place is held in a :class:`contextvars.ContextVar` that the strategies set
around the code they run for a member (per thread, so the threads strategy's replicas each
see their own), never in torch or in a module attribute. Outside training it is read from
the launch environment (:func:`phalanx.launch.detect`).

A call into torch's default group from user code (``dist.get_rank()``, ``barrier()``) is
named by :func:`torch_default_group_call` so the failure says what to write instead (PX124).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from contextvars import ContextVar

_MEMBER: ContextVar[tuple[int, int] | None] = ContextVar("phalanx_member", default=None)


@contextlib.contextmanager
def acting_as(rank: int, world: int) -> Iterator[None]:
    """User code run inside this block sees ``rank`` of ``world`` (the strategies' side)."""
    token = _MEMBER.set((rank, world))
    try:
        yield
    finally:
        _MEMBER.reset(token)


def rank() -> int:
    """This member's rank inside training (0 .. ``world_size() - 1``); in the script around
    ``fit``, this node's rank (0 on one machine and on the head node)."""
    member = _MEMBER.get()
    if member is not None:
        return member[0]
    from phalanx.launch import detect

    return detect(os.environ).node_rank


def world_size(devices: object = None) -> int:
    """Inside training: how many members train the current generation (``devices`` is
    ignored). In the script around ``fit``: the job's device count, the node count times
    the number of ``devices`` (what this node passes to ``fit(devices=...)``); without
    ``devices`` there, an InvalidSettingError (PX108) saying to pass them."""
    member = _MEMBER.get()
    if member is not None:
        return member[1]
    from phalanx.devices import parse_devices
    from phalanx.errors import InvalidSettingError
    from phalanx.launch import detect

    if devices is None:
        raise InvalidSettingError(
            "px.world_size() outside training needs this node's devices to count the job's: "
            'px.world_size("cuda:0,cuda:1") (what you pass to fit(devices=...)); inside the '
            "step, the model factory or a metric it takes no argument"
        )
    return detect(os.environ).nnodes * len(parse_devices(devices))  # type: ignore[arg-type]


def is_main() -> bool:
    """Whether this is the main member (rank 0: it writes the run's files) inside training,
    or the head node (node 0, one machine included) in the script around ``fit``."""
    return rank() == 0


# What torch says when its default process group does not exist (torch 2.x's text).
_NO_DEFAULT_GROUP = "default process group has not been initialized"


def torch_default_group_call(exc: BaseException) -> bool:
    """Whether ``exc`` is torch refusing a call on its default process group (which phalanx
    never creates): ``dist.get_rank()``, ``get_world_size()``, ``barrier()``, ..."""
    return isinstance(exc, ValueError | RuntimeError) and _NO_DEFAULT_GROUP in str(exc).lower()


TORCH_DEFAULT_GROUP_FIX = (
    "torch.distributed's default process group does not exist under phalanx (each generation "
    "of workers owns its own group, so a fallen worker can be replaced): in your code, use "
    "px.rank() for dist.get_rank(), px.world_size() for dist.get_world_size(), "
    "px.is_main() for `dist.get_rank() == 0` (the member that writes files); drop "
    "dist.barrier() (phalanx steps every member together) and dist.init_process_group() "
    "(phalanx forms the groups); dist.is_initialized() is False"
)
