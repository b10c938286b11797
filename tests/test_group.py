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

from phalanx.failures import WorkerFailure
from phalanx.report import is_secondary
from phalanx.strategies.ddp.worker.group import ABANDONED, GenerationGroup, GroupBroken

CPU = torch.device("cpu")
TIMEOUT = timedelta(seconds=20)


def in_two_ranks(
    body: Callable[[GenerationGroup], Any], prefix: str = "g0/", abandonable: bool = False
) -> list[Any]:
    """``body(group)`` on ranks 0 and 1 at once; each one's result or exception."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    out: list[Any] = [None, None]

    def rank(r: int) -> None:
        store = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=TIMEOUT)
        try:
            out[r] = body(GenerationGroup.form(store, prefix, r, 2, CPU, TIMEOUT, abandonable))
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
        word = group.broadcast_bytes(b"from %d" % group.rank, src=1)
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
        assert word == b"from 1"
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


class FakeLoop:
    """What the hand-over reads and writes of a loop: its position and its snapshot."""

    def __init__(self, steps: int, weights: torch.Tensor) -> None:
        self.state = type("State", (), {"global_step": steps, "epoch": 0})()
        self.weights = weights
        self.restored: dict[str, Any] | None = None

    def snapshot(self) -> dict[str, Any]:
        return {"model": {"w": self.weights}, "steps": self.state.global_step}

    def restore(self, snap: dict[str, Any]) -> None:
        self.restored = snap
        self.weights, self.state.global_step = snap["model"]["w"], snap["steps"]


@pytest.mark.timeout(60)
def test_the_hand_over_moves_state_to_the_members_behind_only() -> None:
    """Three members: rank 2 is behind (a replacement). It gets the state of rank 0, the
    lowest rank at the furthest position, over a subgroup of those two; rank 1, already
    there, receives nothing."""
    from phalanx.strategies.ddp.worker.handover import hand_over

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    loops = [FakeLoop(7, torch.full((3,), 1.0)), FakeLoop(7, torch.full((3,), 1.0))]
    loops.append(FakeLoop(0, torch.zeros(3)))
    sources: list[Any] = [None] * 3

    def rank(r: int) -> None:
        store = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=TIMEOUT)
        group = GenerationGroup.form(store, "g1/", r, 3, CPU, TIMEOUT)

        def subgroup(ranks: list[int]) -> GenerationGroup:
            return GenerationGroup.form(store, "g1/hand/", ranks.index(r), len(ranks), CPU, TIMEOUT)

        try:
            sources[r] = hand_over(loops[r], group, subgroup)  # type: ignore[arg-type]
        except Exception as exc:
            sources[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sources == [0, 0, 0]
    assert loops[2].state.global_step == 7 and torch.equal(loops[2].weights, torch.ones(3))
    assert loops[0].restored is None and loops[1].restored is None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["all_reduce", "ddp backward", "barrier", "broadcast"])
def test_a_frozen_peer_is_abandoned_at_once_not_after_the_groups_timeout(where: str) -> None:
    """A peer that is frozen or cut off keeps its sockets open: gloo would wait for it until
    the group's timeout (20 s here). abandon(), called from another thread as the watch
    thread does when a newer generation leaves the peer out, ends the wait at once; the
    torch work stays in flight (busy) until the peer wakes, so the group is not destroyed
    under it; a broadcast the woken peer completes later lands in a staging copy, never in
    the tensor the survivor goes on with."""
    wake = threading.Event()
    live = torch.zeros(3)

    def body(group: GenerationGroup) -> Any:
        model = group.wrap(nn.Linear(4, 1), init_sync=False)
        if group.rank == 0:  # frozen: holds its group, joins nothing until woken
            wake.wait(30)
            if where == "ddp backward":  # (the same collective its peer started)
                model(torch.ones(2, 4)).sum().backward()
            elif where == "barrier":
                group.barrier()
            elif where == "broadcast":
                group.broadcast(torch.ones(3), src=0)
            else:
                group.all_reduce(torch.ones(1))
            return None
        threading.Timer(0.5, group.abandon).start()
        started = time.monotonic()
        try:
            if where == "all_reduce":
                group.all_reduce(torch.ones(1))
            elif where == "barrier":
                group.barrier()
            elif where == "broadcast":
                group.broadcast(live, src=0)
            else:
                model(torch.ones(2, 4)).sum().backward()
        except (GroupBroken, RuntimeError) as exc:
            waited, message, busy = time.monotonic() - started, str(exc), group.busy
        else:
            raise AssertionError("the collective returned without its frozen peer")
        with pytest.raises(GroupBroken):  # nothing new starts on an abandoned group
            group.all_reduce(torch.ones(1))
        wake.set()
        deadline = time.monotonic() + 10
        while group.busy and time.monotonic() < deadline:  # the peer serves the old work
            time.sleep(0.05)
        assert not group.busy and group.release()  # then it can be dropped
        return waited, message, busy

    _, (waited, message, busy) = in_two_ranks(body, abandonable=True)  # (across nodes)
    assert 0.4 < waited < 3.0, f"{waited:.1f}s"
    assert ABANDONED in message
    assert busy  # the abandoned work was still running inside torch
    failure = WorkerFailure(1, 1, "cpu:1", "exception", message, "backward")
    assert is_secondary(failure)  # a survivor's error, never a cause of its own
    assert live.tolist() == [0.0, 0.0, 0.0]  # (the late broadcast went to a staging copy)
