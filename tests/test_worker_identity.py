"""ddp workers tell themselves apart: torchrun's environment variables in each worker (set
again when a regroup changes its rank), and a process title naming rank and device."""

from __future__ import annotations

import functools
import json
import multiprocessing
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import phalanx as px
from ddp_helpers import make_data, mlp, mse_step, sgd
from phalanx.events import StepEnded

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc"),
    pytest.mark.slow,
]

KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
try:  # the optional extra: the title goes to the command line (ps aux), else to comm (ps -e)
    import setproctitle  # noqa: F401

    TITLE_FILE = "cmdline"
except ImportError:
    TITLE_FILE = "comm"


def title(pid: int | str) -> str:
    """What ps shows for ``pid``: its command line with setproctitle, else its comm."""
    raw = Path(f"/proc/{pid}/{TITLE_FILE}").read_bytes()
    return raw.replace(b"\0", b" ").decode().strip()


def expected(rank: int, world: int, device: str) -> str:
    if TITLE_FILE == "comm":
        return f"px r{rank} {device}"
    return f"phalanx worker rank {rank}/{world} {device}"


def recording_step(folder: str, model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """What this worker's environment says at each step, appended to <folder>/<pid>.jsonl."""
    seen = {k: os.environ.get(k) for k in KEYS}
    seen["title"] = title("self")
    with open(os.path.join(folder, f"{os.getpid()}.jsonl"), "a") as fh:
        fh.write(json.dumps(seen) + "\n")
    return mse_step(model, batch)


class LookAtWorkers:
    """A sink (it runs in the supervisor) that reads each live worker's /proc entry from
    outside, as ps does, once step 2 has ended."""

    def __init__(self) -> None:
        self.names: dict[int, str] = {}

    def handle(self, event: Any) -> None:
        if isinstance(event, StepEnded) and event.global_step == 2:
            for child in multiprocessing.active_children():
                if child.name.startswith("phalanx-worker"):
                    self.names[child.pid] = title(child.pid)

    def close(self) -> None:
        pass


def records(folder: Path) -> dict[int, list[dict[str, str]]]:
    return {
        int(p.stem): [json.loads(line) for line in p.read_text().splitlines()]
        for p in folder.glob("*.jsonl")
    }


def test_workers_see_torchrun_variables_and_ps_shows_rank_and_device(tmp_path: Path) -> None:
    look = LookAtWorkers()
    step = functools.partial(recording_step, str(tmp_path))
    px.Learner(mlp, sgd, step).fit(
        make_data(64), epochs=1, batch_size=16, strategy="ddp", devices="cpu:0,cpu:1",
        sinks=[look],
    )  # fmt: skip
    shown = sorted(look.names.values())
    assert len(shown) == 2
    assert shown[0].startswith(expected(0, 2, "cpu:0"))
    assert shown[1].startswith(expected(1, 2, "cpu:1"))
    seen = records(tmp_path)
    assert set(seen) == set(look.names)  # the same two processes
    for pid, lines in seen.items():
        rank = "0" if look.names[pid].startswith(expected(0, 2, "cpu:0")) else "1"
        for line in lines:
            assert line["RANK"] == line["LOCAL_RANK"] == rank
            assert line["WORLD_SIZE"] == line["LOCAL_WORLD_SIZE"] == "2"
            assert line["MASTER_ADDR"] == "127.0.0.1" and int(line["MASTER_PORT"] or 0) > 0
            assert line["title"].startswith(expected(int(rank), 2, f"cpu:{rank}"))
    assert "RANK" not in os.environ  # the caller's environment is left alone


def test_a_shrink_that_moves_a_worker_to_rank_0_updates_its_environment(tmp_path: Path) -> None:
    step = functools.partial(recording_step, str(tmp_path))
    result = px.Learner(mlp, sgd, step).fit(
        make_data(64), epochs=2, batch_size=16, strategy="ddp", devices="cpu:0,cpu:1",
        faults=[px.Fault("kill", worker=0, step=3)], on_failure=px.Recovery(mode="shrink"),
        sinks=[],
    )  # fmt: skip
    assert result.steps == 8 and [f.kind for f in result.failures] == ["crash"]
    (survivor,) = [lines for lines in records(tmp_path).values() if "cpu:1" in lines[-1]["title"]]
    assert (survivor[0]["RANK"], survivor[0]["WORLD_SIZE"]) == ("1", "2")
    assert (survivor[-1]["RANK"], survivor[-1]["WORLD_SIZE"]) == ("0", "1")
    assert survivor[-1]["title"].startswith(expected(0, 1, "cpu:1"))
