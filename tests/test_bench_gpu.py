"""bench/gpu.py's CPU mode, as a smoke test: the table has every row, in order, and the rows
it was asked for pass on CPU (a few short runs; the GPU itself is checked only where one is
lent, by running the bench)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from procs import child_env

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench" / "gpu.py"
ROWS = [
    "demo-single",
    "demo-ddp",
    "overhead",
    "group",
    "reference",
    "vote",
    "oom-split",
    "rebuild",
    "restart",
    "snapshot",
    "handover",
    "fsdp-train",
    "fsdp-vote",
    "fsdp-rebuild",
    "fsdp-respawn",
    "fsdp-mp",
]

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX processes")


def table(out: str) -> dict[str, tuple[str, str]]:
    """Row key -> (result, notes), from the printed table."""
    rows = {}
    for line in out.splitlines():
        if line.startswith("| ") and not line.startswith("| what "):
            what, result, _, notes = (c.strip() for c in line.strip("|").split("|"))
            rows[what.split(":")[0]] = (result, notes)
    return rows


@pytest.mark.timeout(120)
def test_cpu_mode_prints_every_row_and_the_chosen_ones_pass() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH), "--device", "cpu", "--quick", "--only", "group,vote"],
        capture_output=True,
        text=True,
        timeout=110,
        env=child_env(),
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    keys = [line.split(":")[0].lstrip("| ") for line in done.stdout.splitlines()
            if line.startswith("| ") and not line.startswith("| what ")]  # fmt: skip
    assert keys == ROWS
    rows = table(done.stdout)
    for key in ("group", "reference", "vote"):  # (vote needs the reference: it ran too)
        assert rows[key][0] == "ok", rows[key]
    assert "model vs reference" in rows["vote"][1]
    assert "exception@10/forward: retried" in rows["vote"][1]
    for key in set(ROWS) - {"group", "reference", "vote"}:
        assert rows[key][0] == "skipped: not in --only"


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here")
def test_asking_for_cuda_without_it_says_so() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH), "--only", "group"],
        capture_output=True,
        text=True,
        timeout=60,
        env=child_env(),
        cwd=ROOT,
    )
    assert done.returncode == 2
    assert "CUDA is not available" in done.stderr
