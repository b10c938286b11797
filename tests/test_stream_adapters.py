"""phalanx.stream.huggingface and phalanx.stream.webdataset: a px.Stream over a Hugging Face
IterableDataset and over WebDataset tar files, read with the real libraries.

For each: every sample exactly once across the shards, each shard in its natural order,
``read(shard, start)`` the tail of ``read(shard)``, the stream pickles, and a ddp fit over
two processes trains the same weights as a single-device fit with an exact ledger.

The step, model, optimizer and decode functions are at module level: ddp workers unpickle
them by name (tests/ is on their sys.path, as for tests/ddp_helpers.py).
"""

from __future__ import annotations

import io
import json
import pickle
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import phalanx as px
from phalanx.errors import StreamChangedError, StreamError
from phalanx.stream import huggingface, webdataset

TWO = "cpu:0,cpu:1"
FEATURES = 4
WEIGHTS = torch.tensor([0.5, -1.0, 2.0, 0.25])
# Unequal shards: lanes of unequal length and a short last batch (70 samples in batches of 12).
HF_ROWS = [23, 17, 30]
TAR_SAMPLES = [11, 25, 34]
FIT: dict[str, Any] = dict(batch_size=12, epochs=3, seed=5, balance=False, sinks=[])


def features(i: int) -> list[float]:
    gen = torch.Generator().manual_seed(1000 + i)
    return torch.randn(FEATURES, generator=gen).tolist()


def target(x: list[float]) -> float:
    return float(torch.tensor(x) @ WEIGHTS) + 0.1


def linear() -> nn.Module:
    return nn.Linear(FEATURES, 1)


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05)


def dict_step(model: nn.Module, batch: dict[str, torch.Tensor]) -> px.StepOutput:
    """A step over rows collated as a dict of columns (Hugging Face rows)."""
    x, y = batch["x"], batch["y"].unsqueeze(1)
    prediction = model(x)
    return px.StepOutput(nn.functional.mse_loss(prediction, y), prediction, y)


def decode_xy(sample: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """A WebDataset sample's raw bytes to (x, y) tensors."""
    x = np.load(io.BytesIO(sample["x.npy"]))
    return torch.from_numpy(x), torch.tensor([float(sample["y.txt"])])


def sample_id(sample: dict[str, Any]) -> int:
    return int(sample["id.cls"])


class CountingDecode:
    """A decode that counts the samples it decoded (in this process)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, sample: dict[str, Any]) -> int:
        self.calls += 1
        return sample_id(sample)


def weights(model: nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in model.state_dict().values()]


def rel_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max() / y.abs().max()) for x, y in zip(a, b, strict=True))


def read_all(stream: px.Stream, shard: int, start: int = 0) -> list[Any]:
    name = stream.shards[shard]
    return list(stream.read(name, start) if start else stream.read(name))


def check_ddp_matches_single(stream: px.Stream, step: Any) -> None:
    learner = px.Learner(linear, sgd, step)
    single = learner.fit(stream, devices="cpu", strategy="single", **FIT)
    ddp = learner.fit(pickle.loads(pickle.dumps(stream)), devices=TWO, strategy="ddp", **FIT)
    samples = sum(stream.lengths)
    steps = FIT["epochs"] * -(-samples // FIT["batch_size"])
    assert single.steps == ddp.steps == steps
    assert single.ledger_ok is True and ddp.ledger_ok is True, ddp.ledger_problems
    assert ddp.failures == []
    assert rel_diff(weights(ddp.model), weights(single.model)) <= 1e-5
    torch.manual_seed(FIT["seed"])
    assert rel_diff(weights(linear()), weights(single.model)) > 1e-2  # training moved them
    first, last = single.history[0]["train/loss"], single.history[-1]["train/loss"]
    assert last < first


# -- Hugging Face datasets -------------------------------------------------------------------


@pytest.fixture
def hf_files(tmp_path: Path) -> list[str]:
    """One JSON-lines file per shard; row ids count on across the files."""
    pytest.importorskip("datasets")
    paths, row = [], 0
    for part, count in enumerate(HF_ROWS):
        path = tmp_path / f"part-{part}.jsonl"
        with path.open("w") as out:
            for _ in range(count):
                x = features(row)
                out.write(json.dumps({"id": row, "x": x, "y": target(x)}) + "\n")
                row += 1
        paths.append(str(path))
    return paths


def hf_dataset(files: list[str]) -> Any:
    import datasets

    ds = datasets.load_dataset("json", data_files=files, streaming=True, split="train")
    return ds.with_format("torch")


def test_huggingface_reads_each_row_once_in_file_order(hf_files: list[str]) -> None:
    stream = huggingface(hf_dataset(hf_files), shuffle_buffer=8)
    assert stream.shards == [0, 1, 2] and stream.seekable
    stream.learn_lengths()
    assert stream.lengths == HF_ROWS
    base = 0
    for shard, count in enumerate(HF_ROWS):
        rows = read_all(stream, shard)
        assert [int(r["id"]) for r in rows] == list(range(base, base + count))
        assert torch.allclose(rows[0]["x"], torch.tensor(features(base)))
        assert rows[0]["x"].dtype == torch.float32
        again = read_all(stream, shard)  # (read again: the same rows, the same order)
        assert [int(r["id"]) for r in again] == [int(r["id"]) for r in rows]
        for start in (1, count // 2, count - 1, count):
            tail = [int(r["id"]) for r in read_all(stream, shard, start)]
            assert tail == [int(r["id"]) for r in rows[start:]]
        base += count
    copy = pickle.loads(pickle.dumps(stream))
    assert [int(r["id"]) for r in read_all(copy, 2, 5)] == list(range(45, 70))
    assert [int(stream[i]["id"]) for i in (0, 22, 23, 69)] == [0, 22, 23, 69]


def test_huggingface_refuses_what_it_cannot_stream(hf_files: list[str]) -> None:
    import datasets

    table = datasets.Dataset.from_dict({"x": [[1.0], [2.0]], "y": [1.0, 2.0]})
    with pytest.raises(StreamError, match="pass it to fit\\(\\) directly") as caught:
        huggingface(table)
    assert caught.value.code == "PX160"
    with pytest.raises(StreamError, match=r"before \.shuffle"):
        huggingface(hf_dataset(hf_files).shuffle(seed=1, buffer_size=4))
    with pytest.raises(StreamError, match="one split"):
        huggingface(datasets.IterableDatasetDict({"train": hf_dataset(hf_files)}))
    with pytest.raises(StreamError, match=r"takes a datasets\.IterableDataset"):
        huggingface([{"x": 1}])
    from datasets.distributed import split_dataset_by_node

    with pytest.raises(StreamError, match="split_dataset_by_node"):
        huggingface(split_dataset_by_node(hf_dataset(hf_files), rank=0, world_size=2))
    # (a converted map-style dataset streams: its shards are slices of the table)
    converted = huggingface(table.to_iterable_dataset(num_shards=2))
    assert converted.shards == [0, 1]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_huggingface_ddp_fit_matches_single(hf_files: list[str]) -> None:
    check_ddp_matches_single(huggingface(hf_dataset(hf_files), shuffle_buffer=8), dict_step)


# -- WebDataset ------------------------------------------------------------------------------


@pytest.fixture
def tars(tmp_path: Path) -> list[str]:
    """Three tar files of unequal sample counts; sample ids count on across the files."""
    wds = pytest.importorskip("webdataset")
    paths, sample = [], 0
    for part, count in enumerate(TAR_SAMPLES):
        path = tmp_path / f"train-{part:03d}.tar"
        with wds.TarWriter(str(path)) as sink:
            for i in range(count):
                x = np.asarray(features(sample), dtype=np.float32)
                sink.write(
                    {
                        "__key__": f"{i:06d}",
                        "x.npy": x,
                        "y.txt": repr(target(x.tolist())),
                        "id.cls": sample,
                    }
                )
                sample += 1
        paths.append(str(path))
    return paths


def test_webdataset_reads_each_sample_once_in_tar_order(tars: list[str]) -> None:
    stream = webdataset(tars)  # (no decode: the raw dicts)
    assert stream.shards == tars and stream.seekable
    stream.learn_lengths()
    assert stream.lengths == TAR_SAMPLES
    base = 0
    for shard, count in enumerate(TAR_SAMPLES):
        samples = read_all(stream, shard)
        assert [sample_id(s) for s in samples] == list(range(base, base + count))
        assert [s["__key__"] for s in samples] == [f"{i:06d}" for i in range(count)]
        assert set(samples[0]) == {"__key__", "__url__", "x.npy", "y.txt", "id.cls"}
        assert samples[0]["__url__"] == tars[shard]
        for start in range(count + 1):
            assert read_all(stream, shard, start) == samples[start:]
        base += count
    copy = pickle.loads(pickle.dumps(webdataset(tars, decode=sample_id)))
    assert read_all(copy, 1, 20) == list(range(31, 36))


def test_webdataset_skips_without_decoding(tars: list[str]) -> None:
    decode = CountingDecode()
    stream = webdataset(tars, decode=decode)
    assert read_all(stream, 2, 30) == list(range(66, 70))
    assert decode.calls == 4  # (the 30 samples before were passed over)
    decoded = read_all(webdataset(tars, decode=decode_xy), 0)
    x, y = decoded[3]
    assert x.dtype == torch.float32 and torch.allclose(x, torch.tensor(features(3)))
    assert float(y) == pytest.approx(target(x.tolist()))


def test_webdataset_names_and_errors(tars: list[str], tmp_path: Path) -> None:
    pattern = str(tmp_path / "train-{000..002}.tar")
    assert webdataset(pattern).shards == tars  # (WebDataset's brace notation)
    assert webdataset(Path(tars[0])).shards == [tars[0]]
    with pytest.raises(StreamError, match="decode"):
        webdataset(tars, decode="torch")  # type: ignore[arg-type]
    with pytest.raises(StreamError, match="empty"):
        webdataset([])
    gone = webdataset([*tars, str(tmp_path / "missing.tar")], lengths=[*TAR_SAMPLES, 3])
    with pytest.raises(StreamChangedError, match=r"missing\.tar"):
        gone[sum(TAR_SAMPLES)]
    samples = gone.read(tars[0], 2)  # (closed before its first sample: the file is closed)
    samples.close()  # type: ignore[attr-defined]
    assert samples.stream.closed  # type: ignore[attr-defined]


def test_webdataset_missing_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "webdataset", None)  # (any import of it now fails)
    with pytest.raises(StreamError, match=r"pip install \"phalanx\[streams\]\"") as caught:
        webdataset(["a.tar"])
    assert caught.value.code == "PX160"
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert re.search(r"^streams = \[", pyproject, flags=re.M)  # (the extra it names exists)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_webdataset_ddp_fit_matches_single(tars: list[str]) -> None:
    check_ddp_matches_single(webdataset(tars, decode=decode_xy, shuffle_buffer=8), px.mse_step)


def test_adapters_do_not_import_their_libraries() -> None:
    """``import phalanx`` stays light: the libraries are imported when an adapter is called."""
    import subprocess

    code = "import sys, phalanx; print(*(m in sys.modules for m in ('datasets', 'webdataset')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
