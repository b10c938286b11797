"""bench/copies.py as a smoke test: on a small model its table has a row per member count,
each copy of the snapshot's size (the numbers themselves are the bench's to report)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from procs import child_env

BENCH = Path(__file__).resolve().parent.parent / "bench" / "copies.py"


@pytest.mark.timeout(120)
def test_the_copies_bench_runs_and_reports_each_member_count() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH), "--rounds", "1", "--params", "400000"],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and "MiB" in line]
    assert [row.split("|")[1].strip() for row in rows] == ["2", "4"]
    # (a member's shard of 400,000 parameters and Adam's two moments, in float32)
    assert rows[0].split("|")[2].strip() == "2 MiB" and rows[1].split("|")[2].strip() == "1 MiB"
