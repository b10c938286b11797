"""Every test leaves no process behind: a child of the test process that a test started
and did not end (or reap) fails that test."""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Iterator

import pytest

from procs import children, is_resource_tracker


def _left_behind(baseline: set[int]) -> dict[int, str]:
    return {
        pid: state
        for pid, state in children(os.getpid()).items()
        if pid not in baseline and not is_resource_tracker(pid)
    }


@pytest.fixture(autouse=True)
def no_process_left_behind() -> Iterator[None]:
    baseline = set(children(os.getpid()))
    yield
    deadline = time.time() + 2.0
    left = _left_behind(baseline)
    while left and time.time() < deadline:
        time.sleep(0.05)
        left = _left_behind(baseline)
    assert not left, f"child processes left behind (pid: state): {left}"
    assert multiprocessing.active_children() == []
