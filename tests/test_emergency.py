"""The head lost (``strategies/ddp/worker/emergency.py``, ``nodes/headloss.py``): what a worker
keeps and what the node says. The process tests (a head killed or frozen, then resumed) are in
test_multinode."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from phalanx.checkpoint import Checkpoints, load_checkpoint
from phalanx.checkpoint.checkpointer import META_KEY, read_index, shard_record
from phalanx.checkpoint.io import list_checkpoints, shard_name, write_shard
from phalanx.launch import SPARE, Address, Launch
from phalanx.snapshot import SnapshotStore
from phalanx.snapshot.shards import Written, rows, tag
from phalanx.spec import FitConfig
from phalanx.strategies.ddp.nodes.headloss import head_lost_message
from phalanx.strategies.ddp.wire.protocol import Saved
from phalanx.strategies.ddp.worker.emergency import (
    _write_snapshot,
    await_verdict,
    keep_committed,
    save_committed,
)


def _loop(step: int, value: float = 1.0, shards: bool = False) -> Any:
    """What save_committed reads of a TrainLoop: its state, engine and snapshot."""
    state = SimpleNamespace(global_step=step, epoch=step // 10)
    return SimpleNamespace(
        state=state,
        engine=SimpleNamespace(saves_shards=shards),
        snapshot=lambda: {"model": {"w": torch.full((2,), value)}, "loop": {"step": step}},
        close_checkpointer=lambda: None,
    )


def _config(run_dir: Path | None, keep_last: int = 2) -> FitConfig:
    return FitConfig(
        epochs=1,
        batch_size=8,
        devices=["cpu"],
        strategy="ddp",
        run_dir=None if run_dir is None else str(run_dir),
        checkpoint=Checkpoints(keep_last=keep_last),
    )


def test_the_first_worker_writes_its_step_and_the_others_skip_a_step_already_there(
    tmp_path: Path,
) -> None:
    config = _config(tmp_path)
    first = save_committed(_loop(7), config, slot=1)
    folder = tmp_path / "checkpoints"
    assert first == Saved(1, 7, str(folder / "ckpt-000000007.pt"), wrote=True)
    assert load_checkpoint(first.path or "")["model"]["w"].tolist() == [1.0, 1.0]
    assert "ckpt-000000007.pt" in read_index(str(folder))  # with its checksum
    same = save_committed(_loop(7, value=2.0), config, slot=2)  # a peer of the same step
    older = save_committed(_loop(5, value=3.0), config, slot=3)  # one a step behind
    assert same == Saved(2, 7, first.path, wrote=False)
    assert older == Saved(3, 7, first.path, wrote=False)  # the newer step is what is kept
    assert load_checkpoint(first.path or "")["model"]["w"].tolist() == [1.0, 1.0]
    newer = save_committed(_loop(9), config, slot=4)  # a peer that committed one more
    assert newer.wrote and newer.step == 9
    names = sorted(p.name for p in folder.glob("ckpt-*.pt"))
    assert names == ["ckpt-000000007.pt", "ckpt-000000009.pt"]  # keep_last=2 as always


def test_without_a_run_dir_nothing_is_saved_and_the_note_says_why() -> None:
    saved = save_committed(_loop(4), _config(None), slot=0)
    assert saved.path is None and not saved.wrote and "no run_dir" in saved.note
    assert keep_committed(None, _config(None), 3) == Saved(3, 0, note="nothing had trained yet")


def test_an_fsdp_worker_without_shard_snapshots_saves_nothing(tmp_path: Path) -> None:
    """Under fsdp a worker holds only its shards (the head's went with the head): a file of
    them alone is no checkpoint. Without snapshots (or none past the newest checkpoint)
    nothing is written, and the note says where a resume starts."""
    saved = save_committed(_loop(7, shards=True), _config(tmp_path), slot=1)
    assert saved.path is None and not saved.wrote and saved.step == 7
    assert "newest complete sharded checkpoint" in saved.note
    assert not list((tmp_path / "checkpoints").glob("*.pt"))
    empty = tmp_path / "shm"
    empty.mkdir()
    saved = save_committed(_loop(7, shards=True), _config(tmp_path), 1, str(empty))
    assert "no shard snapshot" in saved.note
    assert not list((tmp_path / "checkpoints").glob("*.pt"))


ROWS = 7  # (3 members: 3, 3 and 1 rows)


def _whole(step: int) -> dict[str, Any]:
    """The whole state of a run at ``step`` (as one device holds it)."""
    torch.manual_seed(step)
    return {
        "model": {"w": torch.randn(ROWS, 4), "scale": torch.tensor(2.0 + step)},
        "optimizer": {
            "state": {0: {"exp_avg": torch.randn(ROWS, 4), "step": torch.tensor(float(step))}},
            "param_groups": [{"lr": 0.1, "params": [0]}],
        },
        "loop": {"global_step": step, "epoch": step // 10},
        "rng": {"torch": torch.arange(3, dtype=torch.uint8)},
    }


def _member(step: int, rank: int, world: int = 3) -> dict[str, Any]:
    """Member ``rank``'s snapshot of :func:`_whole` (its rows of the sharded entries)."""
    full = _whole(step)
    a, b = rows(ROWS, world, rank)
    opt = full["optimizer"]["state"][0]
    return {
        **full,
        "model": {**full["model"], "w": full["model"]["w"][a:b].clone()},
        "optimizer": {
            **full["optimizer"],
            "state": {0: {**opt, "exp_avg": opt["exp_avg"][a:b].clone()}},
        },
        "shards": {"model": ["w"], "optimizer": {"0": ["exp_avg"]}},
    }


def _keep(folder: Path, place: str, step: int, rank: int, generation: int = 2) -> None:
    store = SnapshotStore(str(folder / place))
    (folder / place).mkdir(parents=True, exist_ok=True)
    store.begin(_member(step, rank), tag(generation, 3, rank)).finish()
    store.close()


def test_fsdp_survivors_keep_their_machines_shard_snapshots_as_a_sharded_checkpoint(
    tmp_path: Path,
) -> None:
    """fsdp(3), one member a machine, the head's (rank 0) lost: machine 1 holds rank 1's
    snapshots and the copies of rank 0's, machine 2 rank 2's and the copies of rank 1's.
    Each survivor writes what its machine holds past the newest checkpoint (step 20) as the
    files of a sharded checkpoint: together they make every rank's file of step 24, read
    back as the whole state of step 24, and a takeover goes on from there (not from 20).
    Step 26's rank 0 copy was not whole when the head fell (and took the buffer of 22's):
    neither is a checkpoint."""
    config = _config(tmp_path)
    one, two = tmp_path / "one", tmp_path / "two"
    for step in (22, 24):
        _keep(one, "slot-1", step, rank=1)
        _keep(one, "copy-0", step, rank=0)
        _keep(two, "slot-2", step, rank=2)
        _keep(two, "copy-1", step, rank=1)
    _keep(one, "slot-4", 18, rank=1, generation=1)  # (older than the checkpoint: left)
    partial = SnapshotStore(str(one / "copy-0"))
    partial.begin(_member(26, 0), tag(2, 3, 0))  # (never finished: not whole)
    partial.close()
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    for rank in range(3):  # the run's own checkpoint of step 20
        state = {**_member(20, rank), META_KEY: shard_record(20, 2, rank, 3)}
        write_shard(str(folder / shard_name(20, rank, 3)), state)
    assert [s for _, s in list_checkpoints(folder)] == [20]

    first = save_committed(_loop(27, shards=True), config, 1, str(one))
    assert [s for _, s in list_checkpoints(folder)] == [20]  # (rank 2's files not yet)
    rank_1 = folder / shard_name(24, 1, 3)  # (machine 2 holds its copy: not written again)
    stamp = os.stat(rank_1).st_mtime_ns
    second = save_committed(_loop(27, shards=True), config, 2, str(two))
    assert os.stat(rank_1).st_mtime_ns == stamp
    # (step 22 lacks rank 0: the copy of 26 under way took the buffer that held it)
    assert [s for _, s in list_checkpoints(folder)] == [20, 24]
    assert (folder / shard_name(22, 1, 3)).exists() and (folder / shard_name(22, 2, 3)).exists()
    assert first.path is None and first.step == 27 and "step(s) 22, 24" in first.note
    assert "step(s) 22, 24" in second.note
    assert "computed again" in second.note
    assert not (folder / shard_name(18, 1, 3)).exists()
    assert not (folder / shard_name(26, 0, 3)).exists()
    read = load_checkpoint(str(folder / shard_name(24, 0, 3)))
    expected = _whole(24)
    assert torch.equal(read["model"]["w"], expected["model"]["w"])
    assert torch.equal(read["model"]["scale"], expected["model"]["scale"])
    got = read["optimizer"]["state"][0]
    assert torch.equal(got["exp_avg"], expected["optimizer"]["state"][0]["exp_avg"])
    assert read["loop"] == {"global_step": 24, "epoch": 2}
    # A later try finds step 24 a checkpoint: nothing of it or before it is written again.
    again = save_committed(_loop(27, shards=True), config, 3, str(one))
    assert "newest complete sharded checkpoint" in again.note and not again.kept_files


def test_a_snapshot_rewritten_after_it_was_seen_is_not_written(tmp_path: Path) -> None:
    """Between the scan of a machine's snapshots and the read of one, a copy under way may
    begin in its buffer: the header seen is gone, and no file is written (a file once there
    is whole)."""
    _keep(tmp_path, "copy-0", 22, rank=0)
    store = SnapshotStore(str(tmp_path / "copy-0"))
    [seen] = [h for h in store.headers().values() if h.whole]
    _keep(tmp_path, "copy-0", 24, rank=0)  # (the other buffer)
    _keep(tmp_path, "copy-0", 26, rank=0)  # (the one seen: rewritten)
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    written = Written.of(seen.tag, seen.step, seen.epoch)
    assert written is not None and written.step == 22
    assert not _write_snapshot(store, seen, written, str(folder))
    assert not list(folder.iterdir())
    store.close()


def test_a_save_that_fails_is_reported_not_raised(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    saved = keep_committed(_loop(4), _config(blocker), slot=1)
    assert saved.path is None and "the save failed" in saved.note


def test_the_verdict_waits_for_the_agent_while_the_store_does_not_answer() -> None:
    said = {"lost": False, "probes": 0}

    def probe() -> None:
        said["probes"] += 1
        if said["probes"] == 3:
            said["lost"] = True  # the agent's order comes while the store is silent
        raise OSError("connection refused")

    assert await_verdict(lambda: said["lost"], probe, timedelta(seconds=5))
    assert not await_verdict(lambda: False, lambda: None, timedelta(seconds=5))  # it answers
    assert not await_verdict(lambda: False, probe, timedelta(seconds=0.2))  # no word in time


def test_the_nodes_message_names_the_step_the_file_and_how_to_go_on() -> None:
    launch = Launch("phalanx", nnodes=2, node_rank=1, head=Address("10.0.0.1", 29410))
    config = _config(Path("/shared/run"))
    path = os.path.join("/shared/run/checkpoints", "ckpt-000000032.pt")
    saved = [Saved(1, 32, path, wrote=True), Saved(2, 32, path)]
    text = head_lost_message(launch, config, 1, saved)
    assert text.startswith("node 1: the head at 10.0.0.1:29410 was lost")
    assert f"step 32 is in {path} (this node wrote it)" in text and "resume=True" in text
    other = head_lost_message(launch, config, 1, [Saved(1, 40, path + ".x")])
    assert "(another node wrote it)" in other
    none = head_lost_message(launch, config, 1, [Saved(1, 3, note="no run_dir: nothing")])
    assert "nothing was saved (no run_dir: nothing)" in none
    kept = Saved(1, 33, note="this node kept its shard snapshots of step(s) 30", kept_files=True)
    shards = head_lost_message(launch, config, 1, [kept])
    assert "nothing was saved" not in shards and "of step(s) 30" in shards
    assert "resume=True" in shards
    spare = Launch("phalanx", nnodes=2, node_rank=SPARE, head=Address("10.0.0.1", 29410))
    assert "before this spare took a node's place" in head_lost_message(spare, config, -1, [])
