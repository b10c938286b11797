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
from phalanx.checkpoint.checkpointer import read_index
from phalanx.launch import SPARE, Address, Launch
from phalanx.spec import FitConfig
from phalanx.strategies.ddp.nodes.headloss import head_lost_message
from phalanx.strategies.ddp.wire.protocol import Saved
from phalanx.strategies.ddp.worker.emergency import await_verdict, keep_committed, save_committed


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


def test_an_fsdp_worker_saves_nothing_its_shards_alone_are_no_checkpoint(tmp_path: Path) -> None:
    """Under fsdp a worker holds only its shards (the head's went with the head): a file of
    them would be read as a whole checkpoint; nothing is written, and the note says where a
    resume starts."""
    saved = save_committed(_loop(7, shards=True), _config(tmp_path), slot=1)
    assert saved.path is None and not saved.wrote and saved.step == 7
    assert "newest complete sharded checkpoint" in saved.note
    assert not list((tmp_path / "checkpoints").glob("*.pt"))


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
    spare = Launch("phalanx", nnodes=2, node_rank=SPARE, head=Address("10.0.0.1", 29410))
    assert "before this spare took a node's place" in head_lost_message(spare, config, -1, [])
