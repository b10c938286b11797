"""Every test leaves no process behind: a process the test process started (directly, or
through multiprocessing's fork server) that a test did not end (or reap) fails that test."""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Iterator

import pytest

from procs import started_by


def _left_behind(baseline: set[int]) -> dict[int, str]:
    return {pid: state for pid, state in started_by(os.getpid()).items() if pid not in baseline}


@pytest.fixture(autouse=True)
def no_process_left_behind() -> Iterator[None]:
    baseline = set(started_by(os.getpid()))
    yield
    deadline = time.time() + 2.0
    left = _left_behind(baseline)
    while left and time.time() < deadline:
        time.sleep(0.05)
        left = _left_behind(baseline)
    assert not left, f"child processes left behind (pid: state): {left}"
    assert multiprocessing.active_children() == []
