"""Loading data: the dataset fingerprint that joins the plan record."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from phalanx.data import fingerprint


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
    assert len(fingerprint(plain, 8)) == 16
    half = TensorDataset(torch.zeros(4, dtype=torch.bfloat16))  # any dtype hashes
    assert fingerprint(half, 4) != fingerprint(
        TensorDataset(torch.ones(4, dtype=torch.bfloat16)), 4
    )
