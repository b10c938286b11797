"""Loading data: the dataset fingerprint that joins the plan record."""

from __future__ import annotations

import os
import random
import time
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

from phalanx.data import fingerprint
from phalanx.plan import same_data
from procs import started_in_test


class Augmented(Dataset[Any]):
    """Returns a randomly jittered sample (torch, numpy and random all used), as a
    torchvision transform would; index 3 raises."""

    def __init__(self, base: torch.Tensor) -> None:
        self.base = base

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> Any:
        if i == 3:
            raise OSError("unreadable file")
        noise = torch.rand(()) + float(np.random.rand()) + random.random()
        return {"x": self.base[i] + noise, "label": i % 2, "name": f"s{i}"}


def test_fingerprint_tells_equal_sized_datasets_apart_and_ignores_augmentation() -> None:
    base = torch.arange(40.0).reshape(20, 2)
    torch.manual_seed(5)
    np.random.seed(5)
    random.seed(5)
    before = (torch.rand(1), np.random.rand(), random.random())
    torch.manual_seed(5)
    np.random.seed(5)
    random.seed(5)

    first = fingerprint(Augmented(base), 20)
    assert first == fingerprint(Augmented(base.clone()), 20)  # the same data, fresh objects
    assert first != fingerprint(Augmented(base.flip(0)), 20)
    # the caller's generators are as they were
    assert (torch.rand(1), np.random.rand(), random.random()) == before

    plain = TensorDataset(torch.arange(8.0), torch.arange(8))
    assert fingerprint(plain, 8) != fingerprint(
        TensorDataset(torch.arange(8.0), -torch.arange(8)), 8
    )
    assert len(fingerprint(plain, 8).digest) == 16
    half = TensorDataset(torch.zeros(4, dtype=torch.bfloat16))  # any dtype hashes
    assert fingerprint(half, 4) != fingerprint(
        TensorDataset(torch.ones(4, dtype=torch.bfloat16)), 4
    )


def test_fingerprint_of_data_that_differs_in_the_last_bit_is_the_same_data() -> None:
    """torch.tanh of the same tensor can differ in the last bit between two processes (the
    buffer's alignment picks the vectorized or the scalar path): resume must not call that
    another dataset, and must still tell a changed value or label apart."""
    x = torch.randn(16, 5, generator=torch.Generator().manual_seed(0))
    labels = torch.arange(16) % 3
    noisy = torch.nextafter(x, torch.full_like(x, 9.0))  # every value one ulp up
    assert not torch.equal(noisy, x)
    first = fingerprint(TensorDataset(x, labels), 16)
    assert same_data(first, fingerprint(TensorDataset(noisy, labels), 16))
    moved = x.clone()
    moved[:, 0] += 1e-3  # a real change: every sample read has it
    assert not same_data(first, fingerprint(TensorDataset(moved, labels), 16))
    assert not same_data(first, fingerprint(TensorDataset(x, (labels + 1) % 3), 16))
    assert not same_data(first, fingerprint(TensorDataset(x.double(), labels), 16))


# --- collate_fn and pin_memory through fit ---------------------------------------------


class Sentences(Dataset[Any]):
    """Sequences of different lengths: torch's default_collate cannot stack them."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(3)
        self.items = [
            (torch.randn(int(torch.randint(1, 6, (), generator=g)), 4, generator=g), i % 3)
            for i in range(n)
        ]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.items[i]


def pad_collate(samples: list[tuple[torch.Tensor, int]]) -> dict[str, torch.Tensor]:
    """Pads the sequences to the longest one and returns a dict batch."""
    longest = max(len(x) for x, _ in samples)
    padded = torch.zeros(len(samples), longest, 4)
    mask = torch.zeros(len(samples), longest)
    for row, (x, _) in enumerate(samples):
        padded[row, : len(x)] = x
        mask[row, : len(x)] = 1.0
    labels = torch.tensor([y for _, y in samples])
    return {"x": padded, "mask": mask, "y": labels}


def mean_pool_model() -> torch.nn.Module:
    return torch.nn.Linear(4, 3)


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def pooled_step(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    mask = batch["mask"].unsqueeze(-1)
    pooled = (batch["x"] * mask).sum(1) / mask.sum(1)
    return torch.nn.functional.cross_entropy(model(pooled), batch["y"])


def fit_sentences(**kwargs: Any) -> Any:
    import phalanx as px

    learner = px.Learner(mean_pool_model, sgd, pooled_step)
    return learner.fit(
        Sentences(48),
        Sentences(10),
        epochs=2,
        batch_size=8,
        collate_fn=pad_collate,
        sinks=[],
        **kwargs,
    )


@pytest.mark.timeout(180)
def test_a_custom_collate_fn_is_used_for_training_and_validation_in_single_and_ddp() -> None:
    import phalanx as px

    with pytest.raises(px.TrainingFailed, match="stack expects each tensor to be equal size"):
        px.Learner(mean_pool_model, sgd, pooled_step).fit(
            Sentences(48), epochs=1, batch_size=8, sinks=[]
        )
    single = fit_sentences(pin_memory=True)
    assert single.steps == 12 and single.ledger_ok
    assert "valid/loss" in single.history[-1]
    ddp = fit_sentences(strategy="ddp", devices="cpu:0,cpu:1", pin_memory=True)
    assert ddp.steps == 12 and ddp.ledger_ok
    assert ddp.history[-1]["valid/loss"] == pytest.approx(single.history[-1]["valid/loss"], 1e-5)
    for a, b in zip(single.model.parameters(), ddp.model.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-5)


def test_pin_memory_reaches_every_dataloader_where_cuda_can_use_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """fit(pin_memory=True) is passed to the training and validation DataLoaders when CUDA
    is there to use pinned batches, and is left off on a CPU-only machine (torch would
    warn). Recorded from the DataLoader calls; the real one pins nothing here (no GPU)."""
    import phalanx.data

    asked: list[bool] = []
    real = phalanx.data.DataLoader

    def recording(*args: Any, pin_memory: bool = False, **kwargs: Any) -> Any:
        asked.append(pin_memory)
        return real(*args, pin_memory=False, **kwargs)

    monkeypatch.setattr(phalanx.data, "DataLoader", recording)
    fit_sentences(pin_memory=True)  # 2 epochs: 2 training and 2 validation loaders at least
    assert len(asked) >= 4 and not any(asked)  # no CUDA: not pinned
    asked.clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    fit_sentences(pin_memory=True)
    assert len(asked) >= 4 and all(asked)
    asked.clear()
    fit_sentences()
    assert asked and not any(asked)  # only when asked for


def test_fingerprint_of_random_splits() -> None:
    """minGPT's case: an unseeded random_split gives another training set of the same size
    on each run; a seeded one gives the same."""
    full = TensorDataset(torch.arange(100.0).reshape(50, 2))

    def split(seed: int) -> Any:
        return torch.utils.data.random_split(full, [40, 10], torch.Generator().manual_seed(seed))[0]

    assert fingerprint(split(1), 40) == fingerprint(split(1), 40)
    assert fingerprint(split(1), 40) != fingerprint(split(2), 40)


class LazyFile(Dataset[Any]):
    """Opens its file on first access, as PX119's fix advises: picklable until then."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fh: Any = None

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> torch.Tensor:
        self.fh = self.fh or open(self.path, "rb")  # noqa: SIM115 (kept open on purpose)
        self.fh.seek(i)
        return torch.tensor(list(self.fh.read(1)))


def test_fingerprint_leaves_a_lazily_opening_dataset_picklable(tmp_path: Any) -> None:
    import pickle

    path = tmp_path / "data.bin"
    path.write_bytes(bytes(range(10)))
    data = LazyFile(str(path))
    first = fingerprint(data, 10)
    assert data.fh is None  # the copy opened it, not the dataset ddp will send
    pickle.dumps(data)
    path.write_bytes(bytes(range(10, 20)))
    assert fingerprint(LazyFile(str(path)), 10) != first


@pytest.mark.timeout(180)
def test_num_workers_load_in_subprocesses_under_ddp_too() -> None:
    """DataLoader worker processes inside each ddp worker (which must not be daemonic for
    that): the same steps and weights as a single-process run without them."""
    single = fit_sentences()
    ddp = fit_sentences(strategy="ddp", devices="cpu:0,cpu:1", num_workers=2)
    assert ddp.steps == 12 and ddp.ledger_ok
    for a, b in zip(single.model.parameters(), ddp.model.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-5)
    # Nothing is left: the DataLoader workers end with their ddp worker (forked by it: they
    # once were started by a fork server of their own, and both outlived the run for good).
    test = os.environ["PYTEST_CURRENT_TEST"].rsplit(" ", 1)[0]
    deadline = time.monotonic() + 20
    while started_in_test(test) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert started_in_test(test) == []
