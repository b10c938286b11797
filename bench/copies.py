"""What a copy of an fsdp member's shard snapshot on another machine costs (issue 24;
``phalanx/snapshot/copies.py``): the copy itself, in one process over loopback.

    PYTHONPATH=src .venv/bin/python bench/copies.py [--rounds 3]

A member's snapshot of the 50.4 M-parameter model of ``bench/fsdp.py`` (float32
parameters and Adam's two moments: 576.6 MiB of the whole state, so 288 MiB per member at 2
workers and 144 MiB at 4) is written into a snapshot store, then sent by a
:class:`CopySender` to a :class:`CopyListener` writing another store, as between two
machines (here both ends share the 2 cores and the loopback device: a real network adds its
own bandwidth limit, the copy's CPU cost is less on each machine). Reported: the copy's wall
time (median over rounds; the first into a fresh buffer faults its pages in), its rate, and
the memory it takes on the receiving machine (two buffers of the snapshot's size per member
whose copies it keeps).

How much of a step it costs depends on the snapshot cadence: the copy runs beside the steps
between two snapshots, and a member waits for it only before the vote that takes the next
one (so a copy longer than that many steps stalls; the measured cadence makes room for it).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

from phalanx.snapshot import SnapshotStore
from phalanx.snapshot.copies import CopyListener, CopySender

SHM = "/dev/shm" if os.path.isdir("/dev/shm") else None  # (where snapshots live)
PARAMS = 48 * (1024 * 1024 + 1024)  # bench/fsdp.py's BIG model (48 x Linear(1024))


def member_state(params: int, step: int) -> dict[str, object]:
    """A member's snapshot: its shard of the parameters and of Adam's two moments."""
    return {
        "model": {"w": torch.randn(params)},
        "optimizer": {
            "state": {0: {"exp_avg": torch.randn(params), "exp_avg_sq": torch.rand(params)}},
            "param_groups": [],
        },
        "loop": {"global_step": step, "epoch": 0},
    }


def trial(workers: int, rounds: int, params: int = PARAMS) -> tuple[int, list[float]]:
    key = os.urandom(32)
    with (
        tempfile.TemporaryDirectory(dir=SHM) as here,
        tempfile.TemporaryDirectory(dir=SHM) as there,
    ):
        own = SnapshotStore(here)
        listener = CopyListener(there, key, "127.0.0.1", 120.0, 10.0)
        listener.begin(0)
        sender = CopySender(listener.endpoint, key, 0, 0, 0, 120.0)
        state = member_state(params // workers, 0)
        times, nbytes = [], 0
        for r in range(rounds + 1):  # (the first into fresh buffers on both ends)
            state["loop"] = {"global_step": r, "epoch": 0}
            writing = own.begin(state, 0)
            writing.finish()
            started = time.perf_counter()
            sender.start(own, writing.header)
            sender.wait()
            done, error = sender.outcome()
            assert error is None and done is not None, error
            times.append(time.perf_counter() - started)
            nbytes = done.nbytes
        sender.close()
        listener.close()
        own.close()
    return nbytes, times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--params", type=int, default=PARAMS, help="the model's parameters")
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, loopback, {args.rounds} rounds")
    print("\n| members | snapshot per member | copy (s, median) | first copy (s) | rate | "
          "memory on the receiving machine |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for workers in (2, 4):
        nbytes, times = trial(workers, args.rounds, args.params)
        median = statistics.median(times[1:])
        mib = nbytes / 2**20
        print(
            f"| {workers} | {mib:.0f} MiB | {median:.2f} | {times[0]:.2f} | "
            f"{mib / 1024 / median:.2f} GiB/s | {2 * mib:.0f} MiB per member it keeps |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
