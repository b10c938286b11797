"""Q11 (PLAN.md E3): abort a gloo group without gloo's help, by shutting this process's own
TCP connections of the group (never its listener), and form the next group at once.
2 spawned processes, FSDP2 over torch's default group (one per generation).
A: rank 1 raises inside forward (its peer waits in an all-gather), then shuts its sockets.
B: rank 1 is silent (sleeps, as a frozen peer); rank 0's other thread shuts rank 0's own
   sockets after 1 s while its main thread waits in a collective.
After each, both destroy the default group and form the next generation's, then train a step."""

from __future__ import annotations

import os
import socket
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

torch.set_num_threads(1)


def sockets() -> dict[int, str]:
    found = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:"):
            found[int(fd)] = link
    return found


def shut(mine: dict[int, str]) -> int:
    done = 0
    for fd, link in mine.items():
        try:
            if os.readlink(f"/proc/self/fd/{fd}") != link:
                continue
        except OSError:
            continue
        sock = socket.socket(fileno=os.dup(fd))
        try:
            sock.getpeername()  # (a listener has no peer: shutting it aborts gloo's process)
            sock.shutdown(socket.SHUT_RDWR)
            done += 1
        except OSError:
            pass
        sock.close()
    return done


def generation(n: int, rank: int, store: dist.Store) -> tuple[nn.Module, dict[int, str]]:
    before = sockets()
    dist.init_process_group(
        "gloo", store=dist.PrefixStore(f"g{n}/", store), rank=rank, world_size=2,
        timeout=timedelta(seconds=20),
    )  # fmt: skip
    mesh = init_device_mesh("cpu", (2,))
    mine = {fd: link for fd, link in sockets().items() if before.get(fd) != link}
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, mine


def boom(_module: nn.Module, _args: object) -> None:
    raise KeyError("boom")


def run(rank: int, port: int) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=30))
    x = torch.randn(8, 64)
    model, mine = generation(0, rank, store)
    model(x).sum().backward()
    print(f"rank {rank}: generation 0 opened {len(mine)} sockets (listener + pairs)", flush=True)
    if rank == 1:  # A
        model[2].register_forward_pre_hook(boom, prepend=True)
        try:
            model(x).sum().backward()
        except KeyError:
            print(f"A rank 1: raised in forward; shut {shut(mine)} connection(s)", flush=True)
    else:
        started = time.monotonic()
        try:
            model(x).sum().backward()
        except RuntimeError as exc:
            print(
                f"A rank 0: its all-gather failed after {time.monotonic() - started:.2f} s ({str(exc)[:60]}...)",
                flush=True,
            )
    del model
    dist.destroy_process_group()
    started = time.monotonic()
    model, mine = generation(1, rank, store)
    model(x).sum().backward()
    print(
        f"rank {rank}: generation 1 formed and stepped in {time.monotonic() - started:.2f} s",
        flush=True,
    )
    if rank == 1:  # B
        time.sleep(4)
        try:
            model(x).sum().backward()
        except RuntimeError:
            print("B rank 1: woke, its collective failed (its peer shut the group)", flush=True)
        shut(mine)
    else:
        threading.Timer(1.0, shut, args=(mine,)).start()
        started = time.monotonic()
        try:
            model(x).sum().backward()
        except RuntimeError:
            print(
                f"B rank 0: its collective failed {time.monotonic() - started:.2f} s after it began (shut at 1.0 s)",
                flush=True,
            )
    del model
    dist.destroy_process_group()
    model, _ = generation(2, rank, store)
    model(x).sum().backward()
    print(f"rank {rank}: generation 2 formed and stepped", flush=True)
    os._exit(0)


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    mp.spawn(run, args=(free,), nprocs=2)
