"""A generation's own process group (gloo, CPU), without worker processes: two ranks in two
threads of this process, on a store of their own. Its collectives work without torch's
default group; a member that leaves makes its peer's pending collective fail at once, as
GroupBroken; a group left is never used again."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from phalanx.strategies.ddp.group import GenerationGroup, GroupBroken

CPU = torch.device("cpu")
TIMEOUT = timedelta(seconds=20)


def in_two_ranks(body: Callable[[GenerationGroup], Any], prefix: str = "g0/") -> list[Any]:
    """``body(group)`` on ranks 0 and 1 at once; each one's result or exception."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    out: list[Any] = [None, None]

    def rank(r: int) -> None:
        store = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=TIMEOUT)
        try:
            out[r] = body(GenerationGroup.form(store, prefix, r, 2, CPU, TIMEOUT))
        except Exception as exc:
            out[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    return out


@pytest.mark.timeout(60)
def test_collectives_and_ddp_over_the_generations_group() -> None:
    def body(group: GenerationGroup) -> Any:
        total = torch.tensor([float(group.rank + 1)])
        group.all_reduce(total)
        word = group.broadcast_object({"from": group.rank, "list": [1, 2]}, src=1)
        buf = torch.full((3,), float(group.rank))
        group.broadcast(buf, src=0)
        torch.manual_seed(group.rank)  # different weights: DDP's init sync makes them rank 0's
        ddp = group.wrap(nn.Linear(4, 1), init_sync=True)
        group.barrier()
        weight = next(ddp.parameters()).detach().clone()
        group.leave()
        return total.item(), word, buf.tolist(), weight

    results = in_two_ranks(body)
    assert not any(isinstance(r, Exception) for r in results), results
    for total, word, buf, _ in results:
        assert total == 3.0
        assert word == {"from": 1, "list": [1, 2]}
        assert buf == [0.0, 0.0, 0.0]
    assert torch.equal(results[0][3], results[1][3])
    assert not dist.is_initialized()  # no default group was created


@pytest.mark.timeout(60)
def test_a_peer_that_leaves_breaks_the_pending_collective_at_once() -> None:
    def body(group: GenerationGroup) -> Any:
        if group.rank == 0:
            time.sleep(0.5)
            group.leave()  # the last reference: its sockets close
            return None
        started = time.monotonic()
        with pytest.raises(GroupBroken) as info:
            group.all_reduce(torch.ones(1))
        return time.monotonic() - started, str(info.value)

    _, (waited, message) = in_two_ranks(body)
    assert waited < 5.0, f"{waited:.1f}s"  # not the group's 20 s timeout
    assert message.startswith("all_reduce:")


@pytest.mark.timeout(60)
def test_a_group_left_is_not_used_again() -> None:
    def body(group: GenerationGroup) -> Any:
        group.barrier()
        group.leave()
        with pytest.raises(GroupBroken):
            group.all_reduce(torch.ones(1))
        return True

    assert in_two_ranks(body) == [True, True]
