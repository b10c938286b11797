"""Streamed data (``px.Stream``): the epoch's order, the reader, and fits through failures.

The shards are files written by the tests and read front to back (``stream_helpers``)."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import phalanx as px
from phalanx.balance import cut
from phalanx.errors import StreamChangedError, StreamError, StreamReadError
from phalanx.events import Notice
from phalanx.plan import Plan
from phalanx.stream.order import StreamLayout, quotas
from recorder import Recorder
from stream_helpers import (
    linear,
    mse,
    read,
    read_broken,
    read_counting,
    read_flaky,
    read_from,
    sgd,
    write_shards,
)

LENGTHS = [50, 37, 80, 13, 61, 0, 29]  # unequal, one empty: 270 samples
TOTAL = sum(LENGTHS)
FIT: dict[str, Any] = dict(epochs=2, batch_size=20, seed=5)  # (balance: off for a stream)
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return write_shards(tmp_path_factory.mktemp("shards"), LENGTHS)


def weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in model.state_dict().values()]


def rel_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max() / y.abs().max()) for x, y in zip(a, b, strict=True))


def learner() -> px.Learner:
    return px.Learner(linear, sgd, mse)


@pytest.fixture(scope="module")
def clean(shards: list[str]) -> list[torch.Tensor]:
    """One device, no failure: the model every other run must end with."""
    result = learner().fit(px.Stream(shards, read, lengths=LENGTHS, lanes=3), sinks=[], **FIT)
    assert result.ledger_ok is None or result.ledger_ok
    return weights(result.model)


# -- the order of an epoch --------------------------------------------------------------------


def layout(lanes: int = 3, window: int = 16) -> StreamLayout:
    return StreamLayout(tuple(LENGTHS), lanes, window)


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("lanes", [1, 3, 8])
def test_an_epoch_uses_every_sample_once(lanes: int, shuffle: bool) -> None:
    order = layout(lanes).order(seed=1, epoch=0, shuffle=shuffle, batch_size=20)
    assert sorted(order) == list(range(TOTAL))


def test_the_order_is_a_function_of_seed_and_epoch() -> None:
    a = layout().order(1, 0, True, 20)
    assert a == layout().order(1, 0, True, 20)
    assert a != layout().order(1, 1, True, 20)
    assert a != layout().order(2, 0, True, 20)


def test_a_sample_moves_less_than_the_window_in_its_lane() -> None:
    lay = layout(lanes=3, window=16)
    shuffled = lay.lane_orders(1, 0, shuffle=True)
    for lane, shards in enumerate(lay.lane_shards(1, 0, True)):  # (each lane's shards in order)
        bases = lay.bases()
        natural = np.concatenate([np.arange(bases[s], bases[s] + LENGTHS[s]) for s in shards])
        where = {int(v): i for i, v in enumerate(natural)}
        moves = [abs(i - where[int(v)]) for i, v in enumerate(shuffled[lane])]
        assert sorted(shuffled[lane].tolist()) == sorted(natural.tolist())
        assert max(moves) < 16
        assert moves != [0] * len(moves)  # (it does shuffle)


def test_lanes_hold_as_many_samples_as_one_another_within_a_shard() -> None:
    lay = layout(lanes=3)
    sizes = [sum(LENGTHS[s] for s in lane) for lane in lay.lane_shards(1, 0, True)]
    assert max(sizes) - min(sizes) <= max(LENGTHS)


@pytest.mark.parametrize(
    ("batch", "left", "expected"),
    [
        (20, [100, 100, 100], [7, 7, 6]),  # even, the first ones one more
        (20, [100, 2, 100], [10, 2, 8]),  # a short lane gives what it has; the rest, evenly
        (20, [0, 100, 0], [0, 20, 0]),
        (5, [1, 1, 1], [1, 1, 1]),  # fewer samples left than the batch
        (0, [3, 3], [0, 0]),
    ],
)
def test_quotas(batch: int, left: list[int], expected: list[int]) -> None:
    assert quotas(batch, left) == expected


def test_a_member_reads_its_own_lanes_not_everything() -> None:
    """Each global batch is laid out lane after lane: a member's part of it touches the
    shards of its own lanes and at most two shared ones, not every lane's."""
    lay = StreamLayout(tuple([40] * 24), lanes=8, window=8)
    plan = Plan(lay.samples, 48, seed=3, stream=lay)
    order = plan.order(0)
    lane_of = {int(i): lane for lane, seq in enumerate(lay.lane_orders(3, 0, True)) for i in seq}
    for step in range(plan.steps):
        batch = plan.global_batch(0, step, order)
        for part in cut(batch, None, 3):
            assert len({lane_of[i] for i in part}) <= 8 // 3 + 2  # (of 8)


# -- the reader -----------------------------------------------------------------------------


def test_a_stream_reads_the_samples_of_its_shards(shards: list[str]) -> None:
    stream = px.Stream(shards, read, lengths=LENGTHS)
    first = list(read(shards[0]))
    assert len(stream) == TOTAL
    x, y = stream[3]
    assert torch.equal(x, first[3][0]) and torch.equal(y, first[3][1])
    last = list(read(shards[-1]))[-1]
    assert torch.equal(stream[TOTAL - 1][0], last[0])


def test_reaching_back_reads_the_shard_again_unless_it_can_start_there(
    shards: list[str],
) -> None:
    far = 2 * 1 + 256 + 10  # (past what a cursor keeps: shuffle_buffer 1 keeps 258)
    paths = write_shards(Path(shards[0]).parent / "long", [far + 5])
    expected = list(read(paths[0]))
    for stream_read, skipped in ((read, far), (read_from, 0)):
        stream = px.Stream(paths, stream_read, lengths=[far + 5], shuffle_buffer=1)
        assert stream.seekable == (stream_read is read_from)
        assert torch.equal(stream[far][0], expected[far][0])
        stream[0]  # behind what is kept: opened again (at 0: nothing to skip)
        assert torch.equal(stream[far][0], expected[far][0])  # opened again at far
        assert stream.reader().skipped == skipped, stream_read


def test_a_shard_shorter_than_planned_is_named(tmp_path: Path) -> None:
    paths = write_shards(tmp_path, [10, 10])
    stream = px.Stream(paths, read, lengths=[10, 12])
    with pytest.raises(StreamChangedError, match=r"shard 1 .*part-001.bin.* ended after 10 sam"):
        stream[21]  # (sample 11 of shard 1)


def test_a_shard_longer_than_planned_is_named(tmp_path: Path) -> None:
    paths = write_shards(tmp_path, [10, 10])
    stream = px.Stream(paths, read, lengths=[8, 10])
    with pytest.raises(StreamChangedError, match=r"shard 0 .* more than the 8 samples") as err:
        stream[7]
    assert err.value.code == "PX162"


def test_a_shard_gone_is_named(tmp_path: Path) -> None:
    paths = write_shards(tmp_path, [10, 10])
    Path(paths[1]).unlink()
    stream = px.Stream(paths, read, lengths=[10, 10])
    with pytest.raises(StreamChangedError, match=r"shard 1 .* is gone"):
        stream[12]


def test_a_shard_that_fails_to_open_is_retried_then_named(tmp_path: Path) -> None:
    paths = write_shards(tmp_path, [10, 10])
    broken = str(Path(paths[1]).with_name("broken.bin"))
    Path(paths[1]).rename(broken)
    stream = px.Stream([paths[0], broken], read_broken, lengths=[10, 10])
    assert torch.equal(stream[3][0], list(read(paths[0]))[3][0])
    with pytest.raises(StreamReadError) as err:
        stream[12]
    assert err.value.code == "PX161"
    assert (err.value.shard, err.value.offset) == (1, 0)  # (it never opened)
    text = str(err.value)
    assert "shard 1 ('" in text and "broken.bin" in text and "at sample 0 after 3 attempts" in text
    assert "OSError: cannot open" in text and "bad gateway" in text
    assert stream.reader().retried == 2


def test_a_flaky_open_is_retried_and_goes_on(tmp_path: Path) -> None:
    paths = write_shards(tmp_path, [10])
    stream = px.Stream(paths, read_flaky, lengths=[10])
    assert torch.equal(stream[4][0], list(read(paths[0]))[4][0])
    assert stream.reader().retried == 1


@pytest.mark.parametrize(
    ("args", "kwargs", "says"),
    [
        (("data/*.tar", read), {}, r"takes a list of shard names, got str"),
        (([], read), {}, r"is empty"),
        ((["a"], "read"), {}, r"read=\.\.\.\) must be a function"),
        ((["a", "b"], read), {"lengths": [1]}, r"has 1 values for 2 shards"),
        ((["a"], read), {"lengths": [-1]}, r"must be counts"),
        ((["a"], read), {"lengths": [0]}, r"adds up to 0 samples"),
        ((["a"], read), {"lanes": 0}, r"lanes=\.\.\.\) must be an int >= 1"),
        ((["a"], read), {"shuffle_buffer": 1.5}, r"shuffle_buffer=\.\.\.\) must be an int"),
    ],
)
def test_a_stream_that_cannot_be_planned_is_refused(
    args: tuple[Any, ...], kwargs: dict[str, Any], says: str
) -> None:
    with pytest.raises(StreamError, match=says) as err:
        px.Stream(*args, **kwargs)
    assert err.value.code == "PX160"


# -- fits -------------------------------------------------------------------------------------


class Notices(Recorder):
    @property
    def texts(self) -> list[str]:
        return [n.text for n in self.of(Notice)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("strategy", "devices", "num_workers"),
    [("ddp", "cpu:0,cpu:1,cpu:2", 0), ("ddp", "cpu:0,cpu:1", 1), ("threads", "cpu:0,cpu:1", 0)],
)
def test_several_workers_train_the_same_model_as_one_device(
    shards: list[str],
    clean: list[torch.Tensor],
    tmp_path: Path,
    strategy: str,
    devices: str,
    num_workers: int,
) -> None:
    """Lengths learned (counted once, said in a notice, kept in run_dir), read ahead by a
    thread or one DataLoader process per worker: the weights of one device, every sample
    once per epoch."""
    notices = Notices()
    stream = px.Stream(shards, read, lanes=3)
    result = learner().fit(
        stream, strategy=strategy, devices=devices, num_workers=num_workers,
        run_dir=str(tmp_path / "run"), sinks=[notices], **FIT,
    )  # fmt: skip
    assert rel_diff(weights(result.model), clean) <= TOLERANCE
    assert result.ledger_ok is True
    assert result.steps == 2 * -(-TOTAL // 20)
    said = [t for t in notices.texts if "to count their samples" in t]
    assert len(said) == 1 and f"({TOTAL} samples" in said[0]
    kept = json.loads((tmp_path / "run" / "stream_lengths.json").read_text())
    assert kept["lengths"] == LENGTHS
    # balance left to its default: off for a stream (a moving share reads other lanes too)
    assert json.loads((tmp_path / "run" / "run.json").read_text())["config"]["balance"] is False


@pytest.mark.timeout(180)
def test_a_resume_on_another_number_of_workers_ends_with_the_same_model(
    shards: list[str], clean: list[torch.Tensor], tmp_path: Path
) -> None:
    """Stopped mid-epoch on one device, resumed under ddp(2): the epoch's order does not
    depend on who reads it, and the kept lengths are used (no shard counted again)."""
    run_dir = str(tmp_path / "run")
    first = learner().fit(
        px.Stream(shards, read_counting, lanes=3), run_dir=run_dir, max_steps=17,
        sinks=[], **FIT,
    )  # fmt: skip
    assert first.steps == 17  # (mid-epoch 1: 14 steps an epoch)
    for path in shards:
        Path(path + ".opened").unlink(missing_ok=True)
    notices = Notices()
    second = learner().fit(
        px.Stream(shards, read_counting, lanes=3), run_dir=run_dir, resume=True,
        strategy="ddp", devices="cpu:0,cpu:1", sinks=[notices], **FIT,
    )  # fmt: skip
    assert rel_diff(weights(second.model), clean) <= TOLERANCE
    assert second.ledger_ok is True
    assert not [t for t in notices.texts if "to count their samples" in t]


@pytest.mark.timeout(120)
def test_a_resume_with_another_shard_list_is_refused(shards: list[str], tmp_path: Path) -> None:
    run_dir = str(tmp_path / "run")
    learner().fit(
        px.Stream(shards, read, lengths=LENGTHS, lanes=3), run_dir=run_dir, max_steps=3,
        sinks=[], **FIT,
    )  # fmt: skip
    with pytest.raises(px.PhalanxError, match=r"stream") as err:
        learner().fit(
            px.Stream(shards[:-1], read, lengths=LENGTHS[:-1], lanes=3), run_dir=run_dir,
            resume=True, sinks=[], **FIT,
        )  # fmt: skip
    assert err.value.code == "PX120"


FAULTS = [
    ("kill", "shrink"),
    ("kill", "respawn"),
    ("exception", "shrink"),
    ("hang", "shrink"),
    ("hang", "respawn"),
]


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("kind", "mode"), FAULTS)
def test_a_worker_lost_mid_stream_loses_no_sample(
    shards: list[str], clean: list[torch.Tensor], tmp_path: Path, kind: str, mode: str
) -> None:
    """A worker killed, raising or hung at step 9 (epoch 0) under ddp(3): the survivors or a
    replacement take its part of the stream at the right sample; every sample once per
    epoch; the clean model."""
    fault = px.Fault(kind, worker=1, step=9)
    recovery = px.Recovery(mode=mode, max_restarts=2)
    result = learner().fit(
        px.Stream(shards, read, lengths=LENGTHS, lanes=3), strategy="ddp",
        devices="cpu:0,cpu:1,cpu:2", faults=[fault], on_failure=recovery,
        hang_timeout=timedelta(seconds=3), run_dir=str(tmp_path / "run"), sinks=[], **FIT,
    )  # fmt: skip
    assert [(f.worker, f.step) for f in result.failures] == [(1, 9)]
    # (an exception is retried first: the same samples read again, by the same worker)
    expected = "retried" if kind == "exception" else {"shrink": "shrunk"}.get(mode, "respawned")
    assert result.failures[0].action == expected
    if kind != "exception":  # the survivors or the replacement reached their samples quickly
        seconds = result.failures[0].recovery_seconds
        assert seconds is not None and seconds < 5.0
    assert result.ledger_ok is True and result.ledger_problems == []
    assert rel_diff(weights(result.model), clean) <= TOLERANCE


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("kind", "mode"), [("kill", "shrink"), ("kill", "respawn")])
def test_under_fsdp_a_member_lost_mid_stream_loses_no_sample(
    shards: list[str], clean: list[torch.Tensor], kind: str, mode: str
) -> None:
    """fsdp(3): worker 1 killed in the 10th step. The new generation starts from the set of
    shard snapshots of step 8, whose loop state holds each lane's place in the stream, and
    computes step 9 again reading the same samples: every sample once per epoch, the
    clean model."""
    fault = px.Fault(kind, worker=1, step=9)
    result = learner().fit(
        px.Stream(shards, read, lengths=LENGTHS, lanes=3), strategy="fsdp",
        devices="cpu:0,cpu:1,cpu:2", faults=[fault], on_failure=px.Recovery(mode=mode),
        snapshots=px.Snapshots(every_steps=4), sinks=[], **FIT,
    )  # fmt: skip
    [failure] = result.failures
    assert (failure.worker, failure.step) == (1, 9)
    assert failure.action == {"shrink": "shrunk"}.get(mode, "respawned")
    assert failure.replayed_steps == 1  # (from the set of step 8: the 9th read again)
    assert result.ledger_ok is True and result.ledger_problems == []
    assert rel_diff(weights(result.model), clean) <= TOLERANCE


@pytest.mark.timeout(120)
def test_a_shard_that_never_opens_stops_the_run_naming_it(
    shards: list[str], tmp_path: Path
) -> None:
    folder = tmp_path / "data"
    paths = write_shards(folder, [30, 30, 30])
    broken = folder / "broken.bin"
    Path(paths[1]).rename(broken)
    paths[1] = str(broken)
    with pytest.raises(px.TrainingFailed) as err:
        learner().fit(
            px.Stream(paths, read_broken, lengths=[30, 30, 30], lanes=3), strategy="ddp",
            devices="cpu:0,cpu:1", sinks=[], **FIT,
        )  # fmt: skip
    text = str(err.value)
    assert "PX161" in text and "broken.bin" in text and "after 3 attempts" in text


@pytest.mark.timeout(120)
def test_a_shard_truncated_mid_way_stops_the_run_naming_it(tmp_path: Path) -> None:
    folder = tmp_path / "data"
    paths = write_shards(folder, [30, 30, 30])
    data = Path(paths[2]).read_bytes()
    Path(paths[2]).write_bytes(data[: len(data) // 2 + 7])  # 15 records and a piece
    with pytest.raises(px.TrainingFailed) as err:
        learner().fit(
            px.Stream(paths, read, lengths=[30, 30, 30], lanes=3), strategy="ddp",
            devices="cpu:0,cpu:1", sinks=[], **FIT,
        )  # fmt: skip
    text = str(err.value)
    assert "PX162" in text and "part-002.bin" in text and "ended after 15 samples" in text


def test_a_stream_validates_as_the_same_samples_indexed(tmp_path: Path) -> None:
    """``valid=`` a stream: the validation loss of the same samples as a TensorDataset."""
    train = write_shards(tmp_path / "train", [30, 20])
    valid = write_shards(tmp_path / "valid", [25, 12], seed=1)
    samples = [s for path in valid for s in read(path)]
    indexed = torch.utils.data.TensorDataset(
        torch.stack([x for x, _ in samples]), torch.stack([y for _, y in samples])
    )
    fit = dict(epochs=2, batch_size=10, seed=1, sinks=[])
    streamed = learner().fit(px.Stream(train, read), valid=px.Stream(valid, read), **fit)
    plain = learner().fit(px.Stream(train, read), valid=indexed, **fit)
    got = [h["valid/loss"] for h in streamed.history]
    assert got == pytest.approx([h["valid/loss"] for h in plain.history], rel=1e-6)
