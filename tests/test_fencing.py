"""The head's fencing term in run_dir (``head.json``): each claim takes the next term, no two
claims take the same one (processes racing for it), and a head sees at once when a newer
term replaced it."""

from __future__ import annotations

import json
import multiprocessing
from dataclasses import replace
from pathlib import Path

import torch

from phalanx.strategies.ddp.nodes.fencing import HEAD_FILE, Fence, claim, read_term


def test_each_claim_takes_the_next_term_and_says_whose_it_is(tmp_path: Path) -> None:
    first = claim(str(tmp_path), 0, "10.0.0.1", 29410)
    assert first.term == 1 and read_term(str(tmp_path)) == first
    second = claim(str(tmp_path), 1, "10.0.0.2", 40001)
    assert second.term == 2 and read_term(str(tmp_path)) == second
    assert "node 1 (10.0.0.2:40001" in second.describe()


def _claim(folder: str, node: int, out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    out.put(claim(folder, node, "h", 1).term)


def test_processes_racing_for_a_term_each_get_their_own(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    out: multiprocessing.Queue = ctx.Queue()  # type: ignore[type-arg]
    procs = [ctx.Process(target=_claim, args=(str(tmp_path), n, out)) for n in range(6)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    terms = sorted(out.get(timeout=5) for _ in procs)
    assert terms == [1, 2, 3, 4, 5, 6]
    assert read_term(str(tmp_path)).term == 6  # type: ignore[union-attr]


def test_a_head_sees_a_newer_term_at_its_next_look(tmp_path: Path) -> None:
    mine = claim(str(tmp_path), 0, "h0", 1)
    fence = Fence(str(tmp_path), mine, every=3600.0)
    assert fence.replaced(now=True) is None
    newer = claim(str(tmp_path), 1, "h1", 2)
    assert fence.replaced() is None  # (not due yet: read at most every `every` seconds)
    assert fence.replaced(now=True) == newer  # (before an announcement: read now)


def test_an_unreadable_head_file_fences_no_one(
    tmp_path: Path,
) -> None:
    mine = claim(str(tmp_path), 0, "h0", 1)
    (tmp_path / HEAD_FILE).write_text("{not json")
    assert read_term(str(tmp_path)) is None
    assert Fence(str(tmp_path), mine, every=0.0).replaced(now=True) is None
    (tmp_path / HEAD_FILE).write_text(json.dumps({"term": "x"}))
    assert read_term(str(tmp_path)) is None


def test_a_worker_of_a_replaced_head_writes_no_checkpoint(tmp_path: Path) -> None:
    """The old head's main worker (woken after a successor took the next term) saves: the
    file is not written, the newer head's files and index are untouched, and it says why."""
    from phalanx.events import CheckpointSaved, CheckpointSkipped
    from phalanx.runner import make_checkpointer
    from phalanx.spec import FitConfig

    run_dir = str(tmp_path)
    old = claim(run_dir, 0, "h0", 1)
    seen: list[object] = []
    config = FitConfig(epochs=1, batch_size=4, devices=["cpu"], strategy="ddp", run_dir=run_dir)
    writer = make_checkpointer(replace(config, head_term=old.term), seen.append)
    assert writer is not None
    writer.save({"w": torch.ones(2)}, step=10, epoch=1, metric=None)
    writer.wait()  # (its head still leads: written)
    claim(run_dir, 1, "h1", 2)  # a successor takes over
    newer = make_checkpointer(replace(config, head_term=2), seen.append)
    assert newer is not None
    newer.save({"w": torch.zeros(2)}, step=40, epoch=4, metric=None)
    newer.close()
    index = (tmp_path / "checkpoints" / "checkpoints.json").read_text()
    writer.save({"w": torch.ones(2)}, step=30, epoch=3, metric=None)
    writer.close()
    names = sorted(p.name for p in (tmp_path / "checkpoints").glob("ckpt-*.pt"))
    assert names == ["ckpt-000000010.pt", "ckpt-000000040.pt"]
    assert (tmp_path / "checkpoints" / "checkpoints.json").read_text() == index
    skipped = [e for e in seen if isinstance(e, CheckpointSkipped)]
    assert len(skipped) == 1 and "node 1 (h1:2, pid" in skipped[0].reason
    assert [e.step for e in seen if isinstance(e, CheckpointSaved)] == [10, 40]
