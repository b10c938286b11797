"""Slurm's time-limit warning across nodes: ``--signal=USR1@120`` signals every task of the
job step, one a node. Each node's ``fit`` takes it as a stop; the head checkpoints at the
next step boundary in the shared run_dir, every node exits 75 (the status a batch script
requeues on), and the requeued job (``SLURM_RESTART_COUNT=1``, the same command) resumes by
itself on every node and ends with the model of a run that was never stopped.

Without a Slurm installation here, the test gives what Slurm gives: the step's environment
on each node (tests/test_failover.py's ``form="slurm"``) and SIGUSR1 to each node's process
group."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from test_failover import EPOCHS, into_epoch_three, nodes, through
from test_multinode import (
    one_node_run,
    result_of,
    same,
    weights,
)

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="POSIX processes"),
    pytest.mark.slow,
]


@pytest.mark.timeout(400)
def test_the_warning_stops_every_node_with_75_and_the_requeued_job_resumes_exactly(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    procs, logs = nodes(tmp_path, 2, run_dir, form="slurm")

    def warn() -> None:
        into_epoch_three(procs, logs, run_dir)
        for p in procs:
            os.killpg(p.pid, signal.SIGUSR1)  # (as Slurm: every task of the step)

    _, codes, stayed = through(procs, warn, [0, 1], timeout=120)
    texts = [log.read_text() for log in logs]
    assert codes == [75, 75], "\n".join(t[-3000:] for t in texts)
    assert all("RESULT" not in t for t in texts) and not stayed
    saved = sorted(run_dir.glob("checkpoints/ckpt-*.pt"))
    assert saved, "no checkpoint in the shared run_dir"

    first = [log.with_suffix(".first.log") for log in logs]
    for log, keep in zip(logs, first, strict=True):
        log.rename(keep)
    again, logs = nodes(tmp_path, 2, run_dir, form="slurm", extra_env={"SLURM_RESTART_COUNT": "1"})
    _, codes, left = through(again, lambda: None, [0, 1])
    texts = [log.read_text() for log in logs]
    assert codes == [0, 0], "\n".join(t[-3000:] for t in texts)
    assert not left, f"the requeued job's nodes {left} left processes behind"
    assert "Slurm requeued this job (SLURM_RESTART_COUNT=1): resuming from" in texts[0]
    results = [result_of(log) for log in logs]
    assert [r["steps"] for r in results] == [EPOCHS * 10] * 2
    assert all(r["ledger_ok"] for r in results)
    # (the requeued job trained only the steps after the warning's checkpoint)
    assert min(s for s, _ in results[0]["steps_at"]) > 20
    clean = one_node_run(tmp_path, epochs=EPOCHS)
    for k in (0, 1):
        assert same(weights(tmp_path / f"node{k}.pt"), clean), f"node {k}"
