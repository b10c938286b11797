"""strategy="ddp", the worker's side: a bug in phalanx's own code is reported at once with
its traceback (not waited on as a broken group), and the model factory runs once per
worker process (preflight uses the real replica) plus once in the caller for the result.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch

import phalanx as px
from ddp_helpers import (
    BUG_STEP,
    bn_mlp,
    counting_bn_mlp,
    make_data,
    mlp_with_a_phalanx_bug_in_worker_1,
    mse_step,
    sgd,
)
from phalanx.strategies.ddp.timing import DEFAULT

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX processes and signals")

TWO = "cpu:0,cpu:1"
# 120 samples in global batches of 20: 6 steps an epoch; two workers take 10 each.
# (even shares: these runs are compared bit for bit, and balance follows the machine load)
FIT: dict[str, Any] = dict(batch_size=20, epochs=2, seed=3, balance=False)


@pytest.mark.timeout(90)
def test_a_bug_in_phalanx_is_reported_at_once_with_its_traceback(tmp_path: Path) -> None:
    """Worker 1's loop raises a KeyError outside the user's step (phalanx's per-step seed,
    monkeypatched in that process only). That is worker 1's failure, sent as soon as it
    happens, with the traceback naming the code that raised; not a broken group that
    waits ``Timing.announce_wait`` for a generation nobody will announce."""
    marker = tmp_path / "bug-raised-at"
    factory = partial(mlp_with_a_phalanx_bug_in_worker_1, str(marker))
    with pytest.raises(px.TrainingFailed) as info:
        px.Learner(factory, sgd, mse_step).fit(
            make_data(120), devices=TWO, strategy="ddp", sinks=[],
            on_failure=px.Recovery(mode="abort"), **FIT,
        )  # fmt: skip
    reported = time.time()
    raised = float(marker.read_text())
    assert reported - raised < DEFAULT.announce_wait.total_seconds() / 2, (
        f"{reported - raised:.1f}s from the bug to the report"
    )
    root = info.value.root_cause
    assert (root.worker, root.kind, root.exception_type) == (1, "exception", "KeyError")
    assert root.step == BUG_STEP
    assert root.traceback is not None
    assert "buggy_step_seed" in root.traceback and "injected bug" in root.traceback


@pytest.mark.timeout(120)
def test_the_model_factory_runs_once_per_worker_process(tmp_path: Path) -> None:
    """With preflight on: once in each worker (its replica, preflight included) and once in
    the caller (the returned model), and the result is the same as without preflight
    (preflight leaves the replica as it found it: a model with buffers)."""
    calls = tmp_path / "calls.txt"
    learner = px.Learner(partial(counting_bn_mlp, str(calls)), sgd, mse_step)
    data = make_data(120)
    with_preflight = learner.fit(data, devices=TWO, strategy="ddp", sinks=[], **FIT)
    by_process = Counter(line.split()[0] for line in calls.read_text().splitlines())
    assert by_process == {"phalanx-worker-0": 1, "phalanx-worker-1": 1, "MainProcess": 1}
    plain = px.Learner(bn_mlp, sgd, mse_step).fit(
        data, devices=TWO, strategy="ddp", sinks=[], preflight=False, **FIT
    )
    for a, b in zip(
        with_preflight.model.state_dict().values(), plain.model.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b)


def test_a_heartbeat_in_shared_memory_reads_as_the_latest_progress_once() -> None:
    """The shared-memory heartbeat: a beat written in a child process is read back as that
    (step, phase, attempt); a read with no new beat gives nothing; only the latest of several
    beats is seen (the supervisor needs the newest phase, not every one)."""
    import multiprocessing as mp

    from phalanx.strategies.ddp.wire.protocol import Heartbeat

    ctx = mp.get_context("spawn")
    beat = Heartbeat.create(ctx)
    assert beat.read(0, 1.0) is None
    child = ctx.Process(target=_beat_twice, args=(beat,))
    child.start()
    child.join(timeout=60)
    assert child.exitcode == 0
    seen = beat.read(3, 2.0)
    assert seen is not None
    assert (seen.slot, seen.step, seen.phase, seen.attempt) == (3, 41, "backward", 2)
    assert beat.read(3, 2.5) is None


def _beat_twice(beat: Any) -> None:
    beat.beat(40, "forward", 1)
    beat.beat(41, "backward", 2)
