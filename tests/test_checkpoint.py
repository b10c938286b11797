"""Checkpoint package: pure policy, verified atomic I/O, and the background Checkpointer."""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import subprocess
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import TensorDataset

import phalanx as px
from phalanx.checkpoint import (
    Checkpointer,
    CheckpointInfo,
    Checkpoints,
    read_verified,
    retention,
    should_save,
    write_atomic,
)
from phalanx.checkpoint.io import OLD_MAGIC, check_weights_only, list_checkpoints, peek, to_cpu
from phalanx.errors import CheckpointError, CheckpointFormatError, InvalidSettingError
from phalanx.events import CheckpointDeleted, CheckpointSaved, CheckpointSkipped, Event


def infos(*metrics: float | None) -> list[CheckpointInfo]:
    """One checkpoint per metric, at steps 10, 20, 30, ... (oldest first)."""
    return [
        CheckpointInfo(path=f"ckpt-{(i + 1) * 10}", step=(i + 1) * 10, epoch=i, metric=m)
        for i, m in enumerate(metrics)
    ]


def deleted_steps(existing: list[CheckpointInfo], config: Checkpoints) -> list[int]:
    return [c.step for c in retention(existing, config)]


# --- config ------------------------------------------------------------------------------


def test_config_validation_names_the_fix() -> None:
    with pytest.raises(InvalidSettingError, match=r"every_steps=0.*>= 1"):
        Checkpoints(every_steps=0)
    with pytest.raises(InvalidSettingError, match=r"keep_last=0.*>= 1"):
        Checkpoints(keep_last=0)
    with pytest.raises(InvalidSettingError, match="keep_last"):
        Checkpoints(keep_last=True)
    with pytest.raises(InvalidSettingError, match="needs keep_best"):
        Checkpoints(best_mode="min")
    assert Checkpoints(every_steps=1, keep_last=1).keep_last == 1


def test_mode_is_inferred_from_the_key() -> None:
    assert Checkpoints(keep_best="valid/loss").mode() == "min"
    assert Checkpoints(keep_best="valid/top1_Error").mode() == "min"
    assert Checkpoints(keep_best="valid/accuracy").mode() == "max"
    assert Checkpoints(keep_best="valid/loss", best_mode="max").mode() == "max"


# --- policy (no I/O) ---------------------------------------------------------------------


def test_should_save() -> None:
    by_steps = Checkpoints(every_steps=3, every_epoch=False)
    assert [s for s in range(10) if should_save(s, False, by_steps)] == [3, 6, 9]
    assert not should_save(4, True, by_steps)
    by_epoch = Checkpoints()
    assert should_save(4, True, by_epoch)
    assert not should_save(3, False, by_epoch)


def test_keep_last_deletes_the_oldest() -> None:
    existing = infos(None, None, None, None)
    assert deleted_steps(existing, Checkpoints(keep_last=2)) == [10, 20]
    assert deleted_steps(existing, Checkpoints(keep_last=1)) == [10, 20, 30]
    assert deleted_steps(existing, Checkpoints(keep_last=9)) == []
    # input order does not matter: "newest" is by step
    assert deleted_steps(existing[::-1], Checkpoints(keep_last=2)) == [10, 20]


def test_keep_best_min_keeps_the_lowest_loss() -> None:
    existing = infos(0.9, 0.2, 0.5, 0.7, 0.6)
    assert deleted_steps(existing, Checkpoints(keep_last=2, keep_best="valid/loss")) == [10, 30]


def test_keep_best_max_keeps_the_highest_accuracy() -> None:
    existing = infos(0.5, 0.9, 0.2, 0.7, 0.6)
    config = Checkpoints(keep_last=2, keep_best="valid/accuracy")
    assert deleted_steps(existing, config) == [10, 30]
    # an explicit mode overrides inference
    config = Checkpoints(keep_last=2, keep_best="valid/accuracy", best_mode="min")
    assert deleted_steps(existing, config) == [10, 20]


def test_best_among_last_keeps_only_keep_last() -> None:
    existing = infos(0.9, 0.8, 0.1, 0.3)
    assert deleted_steps(existing, Checkpoints(keep_last=2, keep_best="valid/loss")) == [10, 20]


def test_nan_and_none_metrics_are_never_best() -> None:
    existing = infos(math.nan, None, 0.8, math.inf, 0.5, 0.6)
    config = Checkpoints(keep_last=1, keep_best="valid/loss")
    assert deleted_steps(existing, config) == [10, 20, 30, 40]  # keeps 50 (best) and 60 (last)
    config = Checkpoints(keep_last=1, keep_best="valid/accuracy")
    assert deleted_steps(existing, config) == [10, 20, 40, 50]  # keeps 30 (best), 60
    only_nan = infos(math.nan, None, math.nan)
    assert deleted_steps(only_nan, Checkpoints(keep_last=1, keep_best="valid/loss")) == [10, 20]


def test_ties_go_to_the_older_checkpoint() -> None:
    existing = infos(0.5, 0.3, 0.3, 0.9, 0.8)
    assert deleted_steps(existing, Checkpoints(keep_last=1, keep_best="valid/loss")) == [
        10,
        30,
        40,
    ]


metric_values = st.one_of(st.none(), st.just(math.nan), st.floats(-5, 5))


@given(st.lists(metric_values, max_size=12), st.integers(1, 5), st.booleans())
def test_retention_properties(metrics: list[float | None], keep_last: int, best: bool) -> None:
    existing = infos(*metrics)
    config = Checkpoints(keep_last=keep_last, keep_best="valid/loss" if best else None)
    doomed = {c.path for c in retention(existing, config)}
    kept = [c for c in existing if c.path not in doomed]
    newest = sorted(existing, key=lambda c: c.step)[-keep_last:]
    assert all(c in kept for c in newest)
    assert len(kept) <= keep_last + (1 if best else 0)
    scored = [c.metric for c in existing if c.metric is not None and math.isfinite(c.metric)]
    if best and scored:
        assert min(scored) in [c.metric for c in kept]


# --- file format -------------------------------------------------------------------------


def training_state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "epoch": 3,
        "history": [{"valid/loss": 0.5}],
        "rng": torch.get_rng_state(),
    }


def assert_same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


def test_atomic_round_trip_with_tensors_and_optimizer_state(tmp_path: Any) -> None:
    state = training_state()
    path = tmp_path / "ckpt-000000001.pt"
    digest = write_atomic(path, state)
    data = path.read_bytes()
    assert (digest.size, digest.sha256) == (len(data), hashlib.sha256(data).hexdigest())
    assert_same(state, read_verified(path, digest))
    assert_same(state, torch.load(path, weights_only=True))  # plain torch opens it
    assert os.listdir(tmp_path) == ["ckpt-000000001.pt"]  # no temp file left behind
    # the optimizer state loads back into a fresh optimizer
    loaded = read_verified(path)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    opt.load_state_dict(loaded["optimizer"])
    assert opt.state_dict()["state"][0]["step"] == torch.tensor(1.0)


def test_truncated_flipped_and_foreign_files_are_rejected(tmp_path: Any) -> None:
    path = tmp_path / "ckpt-000000001.pt"
    digest = write_atomic(path, training_state())
    data = path.read_bytes()

    path.write_bytes(data[:-10])
    with pytest.raises(CheckpointError, match=f"truncated: expected {len(data)} bytes"):
        read_verified(path, digest)
    with pytest.raises(CheckpointError, match="does not load"):
        read_verified(path)  # without the index's digest, torch itself notices

    flipped = bytearray(data)
    flipped[-20] ^= 0x01
    path.write_bytes(bytes(flipped))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        read_verified(path, digest)

    path.write_bytes(b"GIF89a some image")
    with pytest.raises(CheckpointError, match="not a phalanx checkpoint"):
        read_verified(path)

    path.write_bytes(data[:3])
    with pytest.raises(CheckpointError, match="truncated"):
        read_verified(path)


def test_peek_reads_one_key_verified_without_loading_the_tensors(tmp_path: Any) -> None:
    path = tmp_path / "ckpt-000000001.pt"
    digest = write_atomic(path, {"plan": {"samples": 10}, "model": {"w": torch.ones(1000)}})
    assert peek(path, "plan", digest) == {"samples": 10}
    assert peek(path, "missing") is None
    data = bytearray(path.read_bytes())
    data[-30] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        peek(path, "plan", digest)
    path.write_bytes(bytes(data[:100]))
    with pytest.raises(CheckpointError, match="truncated: expected"):
        peek(path, "plan", digest)
    with pytest.raises(CheckpointError, match="does not load"):
        peek(path, "plan")


def test_a_first_format_file_is_refused_with_its_own_code(tmp_path: Any) -> None:
    path = tmp_path / "ckpt-000000004.pt"
    path.write_bytes(OLD_MAGIC + b"ab" * 32 + b" 10\n" + b"0123456789")
    with pytest.raises(CheckpointFormatError, match="earlier phalanx build") as caught:
        read_verified(path)
    assert caught.value.code == "PX126"
    with pytest.raises(CheckpointFormatError):  # resume says so, never skips to older files
        Checkpointer(tmp_path, Checkpoints(), Recorder()).load_latest()
    assert path.exists()


def test_state_torch_cannot_open_with_weights_only_is_named(tmp_path: Any) -> None:
    import numpy as np

    check_weights_only({"a": [1, (2.0, "x")], "t": torch.ones(1), "n": None})
    with pytest.raises(CheckpointError, match=r"checkpoint\['scheduler'\]\['f'\] is a .*ndarray"):
        write_atomic(tmp_path / "x.pt", {"scheduler": {"f": np.zeros(2)}})
    assert not os.listdir(tmp_path)
    # numpy scalars (a metric's value) are turned into Python numbers by the snapshot
    snap = to_cpu({"history": [{"valid/loss": np.float32(0.5), "n": np.int64(3)}]})
    assert type(snap["history"][0]["valid/loss"]) is float and type(snap["history"][0]["n"]) is int
    check_weights_only(snap)


def test_every_torch_scheduler_and_optimizer_state_opens_with_weights_only(tmp_path: Any) -> None:
    """What the check lets through, torch opens (and the reverse): MultiStepLR keeps its
    milestones in a collections.Counter, which weights_only loads and the scheduler needs."""
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.Adam(model.parameters())
    schedulers = torch.optim.lr_scheduler
    state = {
        "multistep": schedulers.MultiStepLR(optimizer, [2, 3]).state_dict(),
        "onecycle": schedulers.OneCycleLR(optimizer, max_lr=0.1, total_steps=10).state_dict(),
        "plateau": schedulers.ReduceLROnPlateau(optimizer).state_dict(),
        "optimizer": optimizer.state_dict(),
        "shape": torch.Size([2, 3]),
        "tags": {"a", "b"},
    }
    path = tmp_path / "ckpt-000000001.pt"
    write_atomic(path, state)
    loaded = torch.load(path, weights_only=True)
    restored = schedulers.MultiStepLR(torch.optim.SGD(model.parameters(), lr=1.0), [9])
    restored.load_state_dict(loaded["multistep"])
    for _ in range(3):
        restored.optimizer.step()
        restored.step()
    assert restored.get_last_lr() == [pytest.approx(0.01)]  # decayed at 2 and 3


def test_failed_write_leaves_the_old_file(tmp_path: Any) -> None:
    path = tmp_path / "ckpt-000000001.pt"
    write_atomic(path, {"x": 1})
    with pytest.raises(CheckpointError, match="function"):
        write_atomic(path, {"x": 2, "f": lambda: 0})
    assert read_verified(path) == {"x": 1}
    assert os.listdir(tmp_path) == ["ckpt-000000001.pt"]


def test_list_checkpoints_ignores_temp_and_other_files(tmp_path: Any) -> None:
    for name in ["ckpt-000000020.pt", "ckpt-000000003.pt", ".ckpt-000000021.pt.abc.tmp"]:
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "checkpoints.json").write_text("{}")
    (tmp_path / "ckpt-12.pt").write_bytes(b"")
    found = list_checkpoints(tmp_path)
    assert [(os.path.basename(p), s) for p, s in found] == [
        ("ckpt-000000003.pt", 3),
        ("ckpt-000000020.pt", 20),
    ]
    assert list_checkpoints(tmp_path / "missing") == []


def test_to_cpu_is_a_deep_snapshot() -> None:
    weights = torch.ones(3)
    state = {"w": weights, "nested": [(weights, 2)], "od": OrderedDict(a=weights), "n": 5}
    snapshot = to_cpu(state)
    weights.add_(1)
    assert torch.equal(snapshot["w"], torch.ones(3))
    assert torch.equal(snapshot["nested"][0][0], torch.ones(3))
    assert isinstance(snapshot["od"], OrderedDict) and torch.equal(
        snapshot["od"]["a"], torch.ones(3)
    )
    assert snapshot["n"] == 5


# --- checkpointer ------------------------------------------------------------------------


class Recorder:
    def __init__(self) -> None:
        self.events: list[Event] = []

    def __call__(self, event: Event) -> None:
        self.events.append(event)

    def of(self, kind: type) -> list[Any]:
        return [e for e in self.events if isinstance(e, kind)]


def names(directory: Any) -> list[str]:
    return [os.path.basename(p) for p, _ in list_checkpoints(directory)]


def test_background_saves_in_order_and_retention_deletes(tmp_path: Any) -> None:
    rec = Recorder()
    config = Checkpoints(keep_last=2, keep_best="valid/loss")
    losses = [0.9, 0.3, 0.5, 0.4, 0.6]
    with Checkpointer(tmp_path, config, rec) as ckpt:
        for step, loss in enumerate(losses, start=1):
            ckpt.save({"w": torch.full((2,), float(step))}, step=step, epoch=step, metric=loss)
        ckpt.wait()
        assert [e.step for e in rec.of(CheckpointSaved)] == [1, 2, 3, 4, 5]
        deleted = [os.path.basename(e.path) for e in rec.of(CheckpointDeleted)]
        assert deleted == ["ckpt-000000001.pt", "ckpt-000000003.pt"]
        # step 2 is the best loss; 4 and 5 are the newest two
        assert names(tmp_path) == ["ckpt-000000002.pt", "ckpt-000000004.pt", "ckpt-000000005.pt"]
        loaded = ckpt.load_latest()
    assert loaded is not None
    state, info = loaded
    assert torch.equal(state["w"], torch.full((2,), 5.0))
    assert (info.step, info.epoch, info.metric) == (5, 5, 0.6)
    index = json.loads((tmp_path / "checkpoints.json").read_text())["checkpoints"]
    assert sorted(index) == names(tmp_path)
    assert index["ckpt-000000002.pt"]["metric"] == 0.3
    # the checksum and length live in the index; the file is torch's own, with its record
    data = (tmp_path / "ckpt-000000004.pt").read_bytes()
    assert index["ckpt-000000004.pt"]["sha256"] == hashlib.sha256(data).hexdigest()
    assert index["ckpt-000000004.pt"]["bytes"] == len(data)
    plain = torch.load(tmp_path / "ckpt-000000004.pt", weights_only=True)
    assert plain["phalanx"] == {"format": 2, "step": 4, "epoch": 4, "metric": 0.4}
    assert torch.equal(plain["w"], torch.full((2,), 4.0))

    # the best survives a restart thanks to the index
    rec2 = Recorder()
    with Checkpointer(tmp_path, config, rec2) as ckpt:
        ckpt.save({"w": torch.zeros(2)}, step=6, epoch=6, metric=0.7)
        ckpt.save({"w": torch.zeros(2)}, step=7, epoch=7, metric=0.8)
    assert names(tmp_path) == ["ckpt-000000002.pt", "ckpt-000000006.pt", "ckpt-000000007.pt"]
    assert [os.path.basename(e.path) for e in rec2.of(CheckpointDeleted)] == [
        "ckpt-000000004.pt",
        "ckpt-000000005.pt",
    ]


def test_snapshot_is_taken_at_save_time(tmp_path: Any) -> None:
    weights = torch.zeros(1000)
    with Checkpointer(tmp_path, Checkpoints(keep_last=5), Recorder()) as ckpt:
        for step in range(1, 4):
            ckpt.save({"w": weights}, step=step, epoch=0, metric=None)
            weights.add_(1)  # in-place update right after save()
    for path, step in list_checkpoints(tmp_path):
        assert torch.equal(read_verified(path)["w"], torch.full((1000,), step - 1.0))


def test_truncated_newest_is_skipped_and_older_loaded(tmp_path: Any) -> None:
    with Checkpointer(tmp_path, Checkpoints(keep_last=3), Recorder()) as ckpt:
        ckpt.save({"w": torch.tensor([1.0])}, step=10, epoch=0, metric=None)
        ckpt.save({"w": torch.tensor([2.0])}, step=20, epoch=1, metric=None)
    newest = tmp_path / "ckpt-000000020.pt"
    newest.write_bytes(newest.read_bytes()[:-7])

    rec = Recorder()
    with Checkpointer(tmp_path, Checkpoints(keep_last=3), rec) as ckpt:
        loaded = ckpt.load_latest()
    assert loaded is not None
    state, info = loaded
    assert torch.equal(state["w"], torch.tensor([1.0]))
    assert (os.path.basename(info.path), info.step, info.epoch) == ("ckpt-000000010.pt", 10, 0)
    skipped = rec.of(CheckpointSkipped)
    assert [s.path for s in skipped] == [str(newest)]
    assert "truncated: expected" in skipped[0].reason
    assert newest.exists()  # loading never deletes


def test_without_the_index_a_complete_file_loads_and_a_truncated_one_is_skipped(
    tmp_path: Any,
) -> None:
    with Checkpointer(tmp_path, Checkpoints(keep_last=3), Recorder()) as ckpt:
        ckpt.save({"w": torch.tensor([1.0])}, step=10, epoch=0, metric=None)
        ckpt.save({"w": torch.tensor([2.0])}, step=20, epoch=1, metric=None)
        ckpt.save({"w": torch.tensor([3.0])}, step=30, epoch=2, metric=None)
    # a death between a file's rename and the index's write: the index misses the newest
    (tmp_path / "checkpoints.json").unlink()
    newest = tmp_path / "ckpt-000000030.pt"
    newest.write_bytes(newest.read_bytes()[:-7])
    rec = Recorder()
    with Checkpointer(tmp_path, Checkpoints(keep_last=3), rec) as ckpt:
        loaded = ckpt.load_latest()
    assert loaded is not None and loaded[1].step == 20
    assert torch.equal(loaded[0]["w"], torch.tensor([2.0])) and "phalanx" not in loaded[0]
    assert [s.path for s in rec.of(CheckpointSkipped)] == [str(newest)]
    assert "does not load" in rec.of(CheckpointSkipped)[0].reason


def test_load_latest_with_no_checkpoints(tmp_path: Any) -> None:
    rec = Recorder()
    with Checkpointer(tmp_path / "fresh", Checkpoints(), rec) as ckpt:
        assert ckpt.load_latest() is None
    assert rec.events == []


def test_failing_write_raises_on_wait_and_keeps_the_last_good(tmp_path: Any) -> None:
    rec = Recorder()
    ckpt = Checkpointer(tmp_path, Checkpoints(keep_last=1), rec)
    ckpt.save({"w": torch.tensor([1.0])}, step=1, epoch=0, metric=None)
    ckpt.wait()
    ckpt.save({"w": torch.tensor([2.0]), "f": lambda: 0}, step=2, epoch=0, metric=None)
    with pytest.raises(CheckpointError, match="step 2 was not saved") as caught:
        ckpt.wait()
    assert caught.value.__cause__ is not None
    assert "builtins.function" in repr(caught.value.__cause__)
    assert sorted(os.listdir(tmp_path)) == ["checkpoints.json", "ckpt-000000001.pt"]
    assert [e.step for e in rec.of(CheckpointSaved)] == [1]
    assert rec.of(CheckpointDeleted) == []
    loaded = ckpt.load_latest()
    assert loaded is not None and torch.equal(loaded[0]["w"], torch.tensor([1.0]))
    # the error was reported once; later saves work again
    ckpt.save({"w": torch.tensor([3.0])}, step=3, epoch=1, metric=None)
    ckpt.close()
    assert names(tmp_path) == ["ckpt-000000003.pt"]
    with pytest.raises(CheckpointError, match="after close"):
        ckpt.save({}, step=4, epoch=1, metric=None)


def test_error_is_raised_by_next_save_and_by_close(tmp_path: Any) -> None:
    ckpt = Checkpointer(tmp_path, Checkpoints(), Recorder())
    ckpt.save({"f": lambda: 0}, step=1, epoch=0, metric=None)
    ckpt._queue.join()  # let the background write fail
    with pytest.raises(CheckpointError, match="step 1"):
        ckpt.save({"w": 1}, step=2, epoch=0, metric=None)
    ckpt.save({"f": lambda: 0}, step=3, epoch=0, metric=None)
    with pytest.raises(CheckpointError, match="step 3"):
        ckpt.close()
    assert not ckpt._thread.is_alive()
    assert list_checkpoints(tmp_path) == []


def test_saving_a_step_again_never_leaves_its_old_checksum_listed(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A death between a re-saved file's rename and the index's write: the new file must not
    be judged against the old file's checksum (it would be skipped as damaged)."""
    from phalanx.checkpoint import checkpointer

    with Checkpointer(tmp_path, Checkpoints(), Recorder()) as ckpt:
        ckpt.save({"w": torch.tensor([1.0])}, step=4, epoch=0, metric=None)
    written = checkpointer.write_atomic

    def write_then_die(path: Any, payload: Any) -> Any:
        written(path, payload)
        raise KeyboardInterrupt("killed before the index was written")

    monkeypatch.setattr(checkpointer, "write_atomic", write_then_die)
    ckpt = Checkpointer(tmp_path, Checkpoints(), Recorder())
    ckpt.save({"w": torch.tensor([2.0])}, step=4, epoch=1, metric=None)
    with pytest.raises(CheckpointError):
        ckpt.close()
    monkeypatch.undo()
    rec = Recorder()
    with Checkpointer(tmp_path, Checkpoints(), rec) as ckpt:
        loaded = ckpt.load_latest()
    assert loaded is not None and torch.equal(loaded[0]["w"], torch.tensor([2.0]))
    assert rec.of(CheckpointSkipped) == []


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 64 KiB file system (tmpfs): room for one checkpoint of the model below, not
    for two (a write goes to a temporary file beside the previous checkpoint)."""
    folder = tmp_path / "tiny"
    folder.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(folder)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip("needs root to mount a small tmpfs")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


@pytest.mark.timeout(60)
def test_a_full_disk_names_the_checkpoint_that_was_not_written(tiny_disk: Path) -> None:
    data = TensorDataset(torch.randn(400, 64), torch.randn(400, 64))
    sgd = functools.partial(torch.optim.SGD, lr=0.01, momentum=0.9)
    learner = px.Learner(functools.partial(nn.Linear, 64, 64), sgd, px.mse_step)
    run_dir = tiny_disk / "run"
    with pytest.raises(px.TrainingFailed) as caught:
        learner.fit(
            data,
            batch_size=10,
            run_dir=str(run_dir),
            checkpoint=px.Checkpoints(every_steps=5, keep_last=1),
            sinks=[],
        )
    err = caught.value
    # Step 10's checkpoint failed in the background; the error surfaced later (at step
    # 15's save), but the report names step 10, the one that was not written.
    assert err.root_cause.phase == "checkpoint"
    assert err.root_cause.step == 9  # (0-based: "step 10")
    first = str(err).splitlines()[0]
    assert "failed at step 10 (checkpoint)" in first
    assert "checkpoint for step 10 was not saved" in first and "No space left" in first
    # The last good checkpoint is intact and loads.
    state = px.load_checkpoint(str(run_dir))
    assert state["loop"]["global_step"] == 5
