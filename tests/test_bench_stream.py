"""bench/stream.py --quick, as a smoke test: it runs, prints its three tables with every
row, and leaves no process behind. No timing is checked (the bench's numbers are read by a
person); the counts that are not times are: a stream that seeks never reads to drop."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from procs import child_env, started_in_test

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench" / "stream.py"

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX processes")


def rows(out: str, first_cell: str) -> list[list[str]]:
    """The rows of the table whose header starts with ``first_cell``, as cells."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_cell} |"))
    found = []
    for line in lines[start + 2 :]:
        if not line.startswith("| "):
            break
        found.append([c.strip() for c in line.strip().strip("|").split("|")])
    return found


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quick_prints_every_table() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH), "--quick"],
        capture_output=True,
        text=True,
        timeout=290,
        env=child_env(),
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr

    throughput = rows(done.stdout, "num_workers")
    assert [r[0] for r in throughput] == ["0", "1"]
    assert all(r[3].endswith("x") for r in throughput)  # phalanx/plain

    recovery = rows(done.stdout, "data")
    assert len(recovery) == 6
    assert {r[1] for r in recovery} == {"shrink", "respawn"}
    for r in recovery:
        assert r[2].endswith(" s") and r[3].endswith(" s"), r  # recovery times were reported
        assert r[5] in ("shrunk", "respawned"), r
        assert r[7] == "True", r  # every sample once
        if "start" in r[0]:
            assert r[4] == "0", r

    resume = rows(done.stdout, "position")
    assert [r[0] for r in resume] == ["0% (fresh run)", "10%", "50%", "90%"]
    assert all(r[5] == "0" for r in resume)  # seeking reads nothing to drop
    assert int(resume[-1][3]) > 0  # reading without a start drops samples to reach 90%

    test = os.environ["PYTEST_CURRENT_TEST"].rsplit(" ", 1)[0]
    deadline = time.monotonic() + 20
    while started_in_test(test) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert started_in_test(test) == []
