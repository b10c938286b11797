"""Snapshots in shared memory (phalanx.snapshot): the double-buffered store and the member
that writes it after committed steps. In-process, no worker: the writer's loss is a write
left half-way, which the store must never hand out."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import phalanx as px
from phalanx.errors import InvalidSettingError
from phalanx.snapshot import (
    SnapshotStore,
    Snapshotter,
    Taken,
    every_for,
    folder_for,
    stable_tensors,
    sweep,
)
from phalanx.snapshot.config import MAX_EVERY, settings_of


def trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.Linear(5, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(2):
        model(torch.randn(8, 6)).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def state_of(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    """What a loop's snapshot holds, with odd leaves: bf16, bool, 0-dim and empty tensors,
    RNG state, tuples and int keys."""
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "loop": {"global_step": step, "epoch": 1, "ledger": [[0.0, 1.0, 2.5]]},
        "extra": {
            "bf16": torch.arange(5, dtype=torch.bfloat16),
            "mask": torch.tensor([True, False, True]),
            "scalar": torch.tensor(3.5),
            "empty": torch.zeros(0, 4),
            "pair": (1, "a"),
        },
        "rng": {"torch": torch.get_rng_state()},
    }


def same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            same(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            same(x, y)
    else:
        assert a == b


def test_a_snapshot_comes_back_equal_and_loads_into_a_fresh_model(tmp_path: Path) -> None:
    model, opt = trained()
    store = SnapshotStore(str(tmp_path))
    written = store.begin(state_of(model, opt, 7)).finish()
    snap = SnapshotStore(str(tmp_path)).read()  # (another reader: as a restarted worker)
    assert snap is not None and (snap.step, snap.epoch, snap.nbytes) == (7, 1, written)
    same(state_of(model, opt, 7), snap.state)
    fresh, fresh_opt = nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.Linear(5, 2)), None
    fresh.load_state_dict(snap.state["model"])
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.01)
    fresh_opt.load_state_dict(snap.state["optimizer"])
    torch.set_rng_state(snap.state["rng"]["torch"])  # (a tensor that owns its storage)
    store.close()


def test_a_mapped_read_views_the_large_tensors_and_tells_when_their_buffer_is_rewritten(
    tmp_path: Path,
) -> None:
    """fsdp's restore reads every old rank's snapshot mapped and cuts its rows out: a large
    tensor is a view of the buffer (a write to it stays private), a small one (an RNG
    state) a copy of its own; once a writer begins on that buffer again, the snapshot is no
    longer ``unchanged``."""
    model, opt = trained()
    big = torch.randn(1 << 15)  # (128 KiB: mapped)
    state = {**state_of(model, opt, 1), "big": big}
    store = SnapshotStore(str(tmp_path))
    store.begin(state).finish()
    reader = SnapshotStore(str(tmp_path))
    snap = reader.read(mapped=True)
    assert snap is not None and snap.source is not None
    same(state, snap.state)
    snap.state["big"][0] = 1e9  # (copy-on-write: the buffer keeps the snapshot)
    torch.set_rng_state(snap.state["rng"]["torch"])  # (small: a tensor of its own)
    again = SnapshotStore(str(tmp_path)).read()
    assert again is not None and torch.equal(again.state["big"], big)
    store.begin({**state_of(model, opt, 2), "big": big}).finish()  # (into the other buffer)
    assert reader.unchanged(snap)
    store.begin({**state_of(model, opt, 3), "big": big}).finish()  # (into step 1's)
    assert not reader.unchanged(snap)
    copied = SnapshotStore(str(tmp_path)).read()
    assert copied is not None and copied.source is None and reader.unchanged(copied)
    store.close()


def test_writes_alternate_and_a_write_left_half_way_never_hides_the_last_whole_one(
    tmp_path: Path,
) -> None:
    model, opt = trained()
    store = SnapshotStore(str(tmp_path))
    store.begin(state_of(model, opt, 1)).finish()
    store.begin(state_of(model, opt, 2)).finish()
    assert sorted(h.step for h in store.headers().values()) == [1, 2]
    half = store.begin(state_of(model, opt, 3))  # the writer dies before finish()
    half.copy()
    newest = store.newest()
    assert newest is not None and newest.step == 2
    snap = SnapshotStore(str(tmp_path)).read()
    assert snap is not None and snap.step == 2  # step 1's buffer was being overwritten
    store.begin(state_of(model, opt, 4)).finish()  # a new writer: into the spoiled buffer
    assert sorted(h.step for h in store.headers().values() if h.whole) == [2, 4]
    store.close()


def test_a_buffer_rewritten_while_it_is_read_is_not_handed_out(tmp_path: Path) -> None:
    model, opt = trained()
    store = SnapshotStore(str(tmp_path))
    store.begin(state_of(model, opt, 1)).finish()
    reader = SnapshotStore(str(tmp_path))
    [(name, header)] = reader.headers().items()
    store.begin(state_of(model, opt, 2)).finish()
    store.begin(state_of(model, opt, 3)).finish()  # step 1's buffer, rewritten
    assert reader._read(name, header) is None
    store.close()


def test_one_writer_at_a_time_and_a_dead_writers_lock_is_free(tmp_path: Path) -> None:
    store = SnapshotStore(str(tmp_path))
    held = store.lock()
    assert held is not None
    assert SnapshotStore(str(tmp_path)).lock() is None
    script = "import sys; from phalanx.snapshot import SnapshotStore; "
    script += "print(SnapshotStore(sys.argv[1]).lock() is None)"
    other = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True)
    assert other.stdout.strip() == b"True", other.stderr
    store.unlock(held)
    other = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True)
    assert other.stdout.strip() == b"False", other.stderr


def test_folders_of_agents_that_are_gone_are_swept_by_their_owner_lock(tmp_path: Path) -> None:
    """A folder whose agent is gone (its owner lock free) is removed by the next agent; a
    live agent's is not, whatever its pid says (containers sharing /dev/shm do not see each
    other's processes)."""
    script = "import sys; from phalanx.snapshot import folder_for; "
    script += "print(folder_for('gone', sys.argv[1])[0])"
    made = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True)
    gone = Path(made.stdout.decode().strip())
    assert gone.is_dir(), made.stderr
    other = tmp_path / "someone-elses"
    other.mkdir()
    assert sweep(str(tmp_path)) == [gone.name]
    assert not gone.exists() and other.exists()
    mine, owner = folder_for("mine", str(tmp_path))
    assert sweep(str(tmp_path)) == [] and Path(mine).exists()
    os.close(owner)  # (the agent's end: its folder is free to sweep now)
    assert sweep(str(tmp_path)) == [Path(mine).name]


@pytest.mark.parametrize(
    ("cost", "step_time", "budget", "every"),
    [
        (0.001, 0.015, 0.005, 14),  # 1 ms at 15 ms steps within half a percent: every 14
        (0.0001, 0.1, 0.005, 1),  # cheap: every step
        (5.0, 0.1, 0.005, MAX_EVERY),  # dear: never fewer than one in MAX_EVERY steps
        (0.01, 0.0, 0.005, MAX_EVERY),  # no step time known yet
    ],
)
def test_the_measured_cost_sets_how_often(
    cost: float, step_time: float, budget: float, every: int
) -> None:
    assert every_for(cost, step_time, budget) == every


def test_settings_are_checked_where_they_are_made() -> None:
    assert settings_of(True) == px.Snapshots() and settings_of(False) is None
    for bad in ({"every_steps": 0}, {"every_steps": 1.5}, {"budget": 0}, {"budget": 2}):
        with pytest.raises(InvalidSettingError):
            px.Snapshots(**bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidSettingError, match=r"px\.Snapshots"):
        settings_of("often")


class Clock:
    def __init__(self) -> None:
        self.taken: list[Taken] = []
        self.errors: list[BaseException] = []


def snapshotter(
    folder: str, model: nn.Module, opt: torch.optim.Optimizer, every: int | None
) -> tuple[Snapshotter, Clock]:
    seen = Clock()
    taker = Snapshotter(
        SnapshotStore(folder),
        px.Snapshots(every_steps=every),
        lambda: stable_tensors(model, opt),
        seen.taken.append,
        seen.errors.append,
    )
    return taker, seen


def test_the_background_copy_holds_the_committed_values(tmp_path: Path) -> None:
    """Parameters and optimizer state are copied in the background and fenced before the
    next optimizer step; a buffer that the next forward changes is copied at once."""
    model, opt = trained()
    taker, seen = snapshotter(str(tmp_path), model, opt, every=2)
    committed = {k: v.clone() for k, v in model.state_dict().items()}
    taker.after_commit(lambda: state_of(model, opt, 2), 2, regroup=False)
    model(torch.randn(8, 6))  # the next step's forward: BatchNorm's running stats move
    taker.fence()  # (the loop's fence before the next optimizer step)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    snap = SnapshotStore(str(tmp_path)).read()
    assert snap is not None and snap.step == 2 and [t.step for t in seen.taken] == [2]
    same(committed, dict(snap.state["model"]))
    taker.after_commit(lambda: state_of(model, opt, 3), 3, regroup=False)  # not due
    taker.after_commit(lambda: state_of(model, opt, 4), 4, regroup=True)  # not for joins
    taker.for_joins = True
    taker.after_commit(lambda: state_of(model, opt, 5), 5, regroup=True)  # forced: whole now
    assert [t.step for t in seen.taken] == [2, 4, 5] and not seen.errors
    taker.close()


def test_chosen_by_measurement_the_first_comes_after_one_steps_time_is_known(
    tmp_path: Path,
) -> None:
    model, opt = trained()
    taker, seen = snapshotter(str(tmp_path), model, opt, every=None)
    for step in range(1, 4):
        taker.after_commit(lambda s=step: state_of(model, opt, s), step, regroup=False)
        taker.fence()
    assert [t.step for t in seen.taken][:1] == [2]  # step 1 only started the clock
    assert taker.cost is not None and taker.cost > 0 and taker.every >= 1
    taker.close()


def test_a_failed_snapshot_is_told_once_and_the_member_takes_no_more(tmp_path: Path) -> None:
    model, opt = trained()
    taker, seen = snapshotter(str(tmp_path / "gone"), model, opt, every=1)  # no such folder
    for step in (1, 2, 3):
        taker.after_commit(lambda: state_of(model, opt, 1), step, regroup=False)
    assert len(seen.errors) == 1 and not seen.taken and taker.failed
    taker.close()
