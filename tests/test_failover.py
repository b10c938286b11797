"""The head's failover: three nodes on one machine (each its own ``python script.py``
process and process group, as on a cluster) share a run_dir; the head's node is killed,
or frozen (and woken later), and the run goes on without a restart: the lowest surviving
node takes over as the head, the other follows it, both return the model of a run that lost
nothing with an exact ledger, the run's record names the head's loss once, and an old head
that wakes is fenced. With a second failure during the failover, or two nodes (one left, not
more than half: tests/test_multinode.py's head-loss tests), nobody takes over: the survivor
keeps the step in an emergency checkpoint and exits 75 as before."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from test_multinode import (
    alive_in_group,
    env_for,
    finish,
    free_port,
    kill_group,
    one_node_run,
    result_of,
    same,
    saved_by_node,
    start,
    weights,
)

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="POSIX processes"),
    pytest.mark.slow,
]

EPOCHS = 6  # 10 steps each, a checkpoint at each epoch's end


def nodes(
    tmp_path: Path,
    count: int,
    run_dir: Path,
    node_timeout: float | None = None,
    token: str | None = "t",
    form: str = "phalanx",
    extra_env: dict[str, str] | None = None,
) -> tuple[list[subprocess.Popen[bytes]], list[Path]]:
    """``count`` nodes of one CPU worker each on ``run_dir``; node k's log and model are
    ``node{k}.log`` and ``node{k}.pt``. ``token`` None: no PHALANX_TOKEN (the head writes
    one in run_dir, the nodes read it there). ``form``: the launch, ``phalanx``
    (PHALANX_NNODES/NODE_RANK/HEAD) or ``slurm`` (the variables srun gives each task of a
    step, one task a node; the head is the step's first node, on PHALANX_PORT)."""
    port = free_port()
    procs, logs = [], []
    for rank in range(count):
        log = tmp_path / f"node{rank}.log"
        env = env_for(rank, port, token)
        env["PHALANX_NNODES"] = str(count)
        if form == "slurm":
            for name in ("PHALANX_NNODES", "PHALANX_NODE_RANK", "PHALANX_HEAD"):
                del env[name]
            env.update(
                SLURM_JOB_ID="4242",
                SLURM_STEP_ID="0",
                SLURM_STEP_NUM_NODES=str(count),
                SLURM_NODEID=str(rank),
                SLURM_STEP_NODELIST=",".join(["127.0.0.1"] * count),
                SLURM_STEP_TASKS_PER_NODE=f"1(x{count})",
                PHALANX_PORT=str(port),
            )
        env["PHALANX_TEST_STEPS"] = "1"
        env.update(extra_env or {})
        if node_timeout is not None:
            env["PHALANX_TEST_NODE_TIMEOUT"] = str(node_timeout)
        args = [str(tmp_path / f"node{rank}.pt"), "cpu:0", str(EPOCHS), str(run_dir)]
        procs.append(start(args, env, log))
        logs.append(log)
    return procs, logs


def into_epoch_three(
    procs: list[subprocess.Popen[bytes]], logs: list[Path], run_dir: Path
) -> float:
    """Once the head has committed step 25, halfway through epoch 3 (checkpoints at steps 10
    and 20; the steps since are only in the workers' memory): the time. Read from the
    head's ``steps.csv`` (a row each step, flushed), not as a time after a log line: an
    epoch takes about half a second here, so half a second after "epoch 2 done" the head
    had reached epoch 3's checkpoint in every run, and no step was newer than it."""
    deadline = time.monotonic() + 120
    while newest_step(run_dir) < 25:
        assert time.monotonic() < deadline and procs[0].poll() is None, logs[0].read_text()[-3000:]
        time.sleep(0.01)
    return time.time()


def newest_step(run_dir: Path) -> int:
    """The newest global step in ``steps.csv`` so far (its whole rows only; 0: none yet)."""
    try:
        text = (run_dir / "steps.csv").read_text(encoding="utf-8")
    except FileNotFoundError:
        return 0
    rows = text.split("\n")[1:-1]  # (after the header; the piece after the last newline may be cut)
    return max((int(row.split(",")[0]) for row in rows if row.strip()), default=0)


def left_behind(procs: list[subprocess.Popen[bytes]], seconds: float = 10) -> list[int]:
    """The nodes (by rank) whose process group still has a process after ``seconds``: a
    node that exited, or was killed, leaves no worker behind. Call it before the tests'
    ``kill_group``, which would empty every group whatever the nodes did."""
    deadline = time.monotonic() + seconds
    while any(alive_in_group(p.pid) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [k for k, p in enumerate(procs) if alive_in_group(p.pid)]


def through(
    procs: list[subprocess.Popen[bytes]],
    fault: Callable[[], Any],
    waited: list[int],
    timeout: float = 200,
) -> tuple[Any, list[int], list[int]]:
    """``fault()``'s value, then the exit codes of the nodes ``waited`` (by rank) and the
    nodes left with a process after them (:func:`left_behind`); every node's process group
    is killed at the end, whatever happened."""
    try:
        value = fault()
        codes = [finish(procs[k], timeout) for k in waited]
        return value, codes, left_behind(procs)
    finally:
        for p in procs:
            kill_group(p)


def steps_written(run_dir: Path) -> list[int]:
    """The global step of each row of the run's ``steps.csv``, in the file's order."""
    with (run_dir / "steps.csv").open(newline="", encoding="utf-8") as f:
        return [int(row["global_step"]) for row in csv.DictReader(f)]


def assert_one_row_a_step(run_dir: Path, resumed: int) -> None:
    """The run's one ``steps.csv`` after a takeover that resumed after step ``resumed``: the
    old head's rows, then the new head's from ``resumed + 1`` to the run's end, each step
    once and in order (the new head dropped any row after ``resumed``).

    A known gap, not a rule: the old head writes a step's row when its supervisor reads
    the step's event from its own worker, up to a poll after every member committed the
    step. A head killed or frozen in between has no row for the last step(s) it
    committed, and the new head resumes after them without writing them (seen in two runs
    of six with the head killed at step 25: no row, and no event, for step 26). Once
    the code writes them, this is ``rows == list(range(1, EPOCHS * 10 + 1))``."""
    rows = steps_written(run_dir)
    old = [s for s in rows if s <= resumed]
    assert old == list(range(1, len(old) + 1)), rows
    assert rows[len(old) :] == list(range(resumed + 1, EPOCHS * 10 + 1)), rows


def events(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def head_losses(failures: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [f for f in failures if ", the head, lost with its workers" in f["message"]]


def assert_went_on_clean(tmp_path: Path, logs: list[Path], survivors: list[int]) -> list[dict]:
    """Every survivor returned the full run's steps, an exact ledger and the model of a run
    that lost nothing; their results."""
    results = [result_of(logs[k]) for k in survivors]
    assert [r["steps"] for r in results] == [EPOCHS * 10] * len(survivors)
    assert all(r["ledger_ok"] for r in results)
    clean = one_node_run(tmp_path, epochs=EPOCHS)
    for k in survivors:
        assert same(weights(tmp_path / f"node{k}.pt"), clean), f"node {k}"
    return results


@pytest.mark.timeout(400)
@pytest.mark.parametrize("form", ["phalanx", "slurm"])
def test_the_head_killed_node_1_takes_over_and_the_run_goes_on_without_a_restart(
    tmp_path: Path, form: str
) -> None:
    run_dir = tmp_path / "run"
    procs, logs = nodes(tmp_path, 3, run_dir, token=None, form=form)  # (run_dir's token)

    def kill_the_head() -> float:
        killed_at = into_epoch_three(procs, logs, run_dir)
        kill_group(procs[0])  # the head: its process, the store, its worker
        return killed_at

    killed_at, codes, stayed = through(procs, kill_the_head, [1, 2])
    texts = [log.read_text() for log in logs]
    assert codes == [0, 0], "\n".join(t[-3000:] for t in texts[1:])
    assert not stayed, f"node(s) {stayed} left processes behind"
    new_head, follower = assert_went_on_clean(tmp_path, logs, [1, 2])
    assert "this node takes over as the head, with node(s) [2]" in texts[1]
    assert "following node 1, the new head" in texts[2]
    # One failure names the head's loss, in both results, with the time to the next step.
    [lost] = head_losses(new_head["failures"])
    assert head_losses(follower["failures"]) == [lost]
    assert lost["message"].startswith("node 0 (") and "its link closed" in lost["message"]
    assert "node 1 took over as the head" in lost["message"]
    assert lost["worker"] == 0 and lost["kind"] == "crash" and lost["action"] == "shrunk"
    assert 20 < lost["step"] < 30  # the emergency checkpoint: newer than epoch 2's
    assert lost["recovery_seconds"] is not None
    # The next committed step after the kill: node_timeout (10 s) is not waited for, the link
    # closed; the workers' emergency save, a new store and new workers (forked) come first.
    next_step = min(t for s, t in new_head["steps_at"] if s > lost["step"])
    print(f"head killed -> next committed step: {next_step - killed_at:.2f}s")
    assert next_step - killed_at < 10.0
    # No committed step lost: the first step after the takeover is the one after the save.
    assert min(s for s, _ in new_head["steps_at"]) == lost["step"] + 1
    assert lost["replayed_steps"] == 0
    # One run, one record: the same run id, a second session, both heads' events appended.
    doc = json.loads((run_dir / "run.json").read_text())
    assert len(doc["sessions"]) == 2
    recorded = events(run_dir)
    assert (
        len(head_losses([e["failure"] for e in recorded if e.get("event") == "WorkerFailed"])) == 1
    )
    assert json.loads((run_dir / "head.json").read_text())["term"] == 2
    assert_one_row_a_step(run_dir, lost["step"])


@pytest.mark.timeout(400)
def test_a_frozen_head_is_replaced_after_node_timeout_and_fenced_when_it_wakes(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    procs, logs = nodes(tmp_path, 3, run_dir, node_timeout=3)
    try:
        frozen_at = into_epoch_three(procs, logs, run_dir)
        os.killpg(procs[0].pid, signal.SIGSTOP)  # the head and its worker: sockets open
        codes = [finish(p, 200) for p in procs[1:]]
        os.killpg(procs[0].pid, signal.SIGCONT)  # the old head wakes after the run ended
        old_code = finish(procs[0], 60)
        stayed = left_behind(procs)
    finally:
        for p in procs:
            kill_group(p)
    texts = [log.read_text() for log in logs]
    assert codes == [0, 0], "\n".join(t[-3000:] for t in texts[1:])
    new_head, _ = assert_went_on_clean(tmp_path, logs, [1, 2])
    [lost] = head_losses(new_head["failures"])
    assert "no word for" in lost["message"] and lost["kind"] == "hang"
    next_step = min(t for s, t in new_head["steps_at"] if s > lost["step"])
    print(f"head frozen -> next committed step: {next_step - frozen_at:.2f}s")
    assert next_step - frozen_at < 3.0 + 10.0
    # The old head woke to a newer term: it committed nothing and said why.
    assert old_code != 0 and "PX145" in texts[0] and "was replaced by node 1" in texts[0]
    assert "RESULT" not in texts[0] and not (tmp_path / "node0.pt").exists()
    assert not stayed, f"node(s) {stayed} left processes behind"
    assert_one_row_a_step(run_dir, min(s for s, _ in new_head["steps_at"]) - 1)


@pytest.mark.timeout(300)
def test_a_second_failure_during_the_failover_leaves_no_majority_and_the_survivor_saves(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    procs, logs = nodes(tmp_path, 3, run_dir, node_timeout=3)  # (node 1 waits 3 + 10 s)

    def kill_two() -> None:
        into_epoch_three(procs, logs, run_dir)
        kill_group(procs[0])
        kill_group(procs[2])  # node 2 lost too, as node 1 waits for it

    _, [code], stayed = through(procs, kill_two, [1], timeout=120)
    text = logs[1].read_text()
    assert code == 75, text[-3000:]  # EX_TEMPFAIL: the same command again, resume=True
    assert not stayed, f"node(s) {stayed} left processes behind"
    step, _ = saved_by_node(text)
    assert 20 < step < 60
    assert "only 1 of the run's 3 nodes reached it (no other node came)" in text, text[-3000:]
    assert "RESULT" not in text


@pytest.mark.timeout(400)
@pytest.mark.parametrize("snapshots", ["off", "2"])
def test_fsdp_the_head_killed_node_1_takes_over_from_the_newest_sharded_checkpoint(
    tmp_path: Path, snapshots: str
) -> None:
    """fsdp, three nodes of one worker each: the head's member held a third of the state,
    gone with it, so no node holds the whole state. Snapshots off: node 1 takes over from
    the newest sharded checkpoint in the shared run_dir (epoch 2's: the head is killed past
    step 25). Snapshots every 2 steps: each member's are copied to the next node, so the
    survivors' machines hold a complete set (the head's member's copies on node 1); each
    survivor writes what its machine holds into run_dir as the files of a sharded
    checkpoint, and node 1 takes over from that set, a few steps back, not from step 20.
    Either way the steps since are computed again, and both survivors end with the model of
    a run that lost nothing."""
    run_dir = tmp_path / "run"
    fsdp = {"PHALANX_TEST_STRATEGY": "fsdp"}
    procs, logs = nodes(
        tmp_path, 3, run_dir, extra_env={**fsdp, "PHALANX_TEST_SNAPSHOT_STEPS": snapshots}
    )

    def kill_the_head() -> None:
        into_epoch_three(procs, logs, run_dir)
        kill_group(procs[0])

    _, codes, stayed = through(procs, kill_the_head, [1, 2])
    texts = [log.read_text() for log in logs]
    assert codes == [0, 0], "\n".join(t[-3000:] for t in texts[1:])
    assert not stayed, f"node(s) {stayed} left processes behind"
    assert "this node takes over as the head, with node(s) [2]" in texts[1]
    results = [result_of(logs[k]) for k in (1, 2)]
    assert [r["steps"] for r in results] == [EPOCHS * 10] * 2
    assert all(r["ledger_ok"] for r in results)
    clean = one_node_run(tmp_path, epochs=EPOCHS, extra_env=fsdp)
    for k in (1, 2):
        assert same(weights(tmp_path / f"node{k}.pt"), clean), f"node {k}"
    [lost] = head_losses(results[0]["failures"])
    assert head_losses(results[1]["failures"]) == [lost]
    # The run went on from a checkpoint, not from step 0, and the failure says so: the
    # steps from there to the last committed one were computed again.
    assert "from the newest complete checkpoint in run_dir" in lost["message"]
    assert "under fsdp the head's shards went with it" in lost["message"]
    first = min(s for s, _ in results[0]["steps_at"])
    assert lost["step"] is not None and lost["step"] >= 25
    assert lost["replayed_steps"] == lost["step"] - (first - 1)
    kept = "the survivors first kept there the shard snapshots they held"
    if snapshots == "off":
        assert first == 21, first  # (epoch 2's checkpoint)
        assert kept not in lost["message"]
    else:
        assert kept in lost["message"]
        # (a set past epoch 2's checkpoint: snapshots every 2 steps, and up to 2 more steps
        # where the head fell while its last copy was on the way)
        assert first > 21, first
        assert lost["replayed_steps"] <= 4, lost
    assert steps_written(run_dir) == list(range(1, EPOCHS * 10 + 1))
