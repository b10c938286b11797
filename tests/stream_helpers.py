"""Shards written by a test and read front to back: fixed-size records of 8 float32
features and one float32 target (``y = x @ W``), one file per shard."""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

FEATURES = 8
RECORD = struct.Struct(f"<{FEATURES + 1}f")  # 36 bytes: x then y
WEIGHTS = torch.linspace(-1.0, 1.0, FEATURES)


def write_shards(folder: Path, lengths: list[int], seed: int = 0) -> list[str]:
    """One file per shard, ``lengths[i]`` records each; returns their paths (the shards)."""
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    paths = []
    for i, n in enumerate(lengths):
        x = torch.randn(n, FEATURES, generator=g)
        y = x @ WEIGHTS + 0.1 * torch.randn(n, generator=g)
        path = folder / f"part-{i:03d}.bin"
        with path.open("wb") as f:
            for row, target in zip(x.tolist(), y.tolist(), strict=True):
                f.write(RECORD.pack(*row, target))
        paths.append(str(path))
    return paths


def _sample(raw: bytes) -> tuple[torch.Tensor, torch.Tensor]:
    values = RECORD.unpack(raw)
    return torch.tensor(values[:FEATURES]), torch.tensor(values[FEATURES:])


def read(shard: str) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Front to back, one record at a time (no way to start in the middle)."""
    with open(shard, "rb") as f:
        while raw := f.read(RECORD.size):
            if len(raw) < RECORD.size:
                return  # (a record cut in half: the shard ends there)
            yield _sample(raw)


def read_from(shard: str, start: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """From record ``start`` on: fixed-size records can be sought."""
    with open(shard, "rb") as f:
        f.seek(start * RECORD.size)
        while raw := f.read(RECORD.size):
            if len(raw) < RECORD.size:
                return
            yield _sample(raw)


def read_counting(shard: str) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``read``, appending one line per opening to ``<shard>.opened`` (who read what)."""
    with open(shard + ".opened", "a") as log:
        log.write(f"{os.getpid()}\n")
    yield from read(shard)


def read_broken(shard: str) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``read``, except that a shard named ``*broken*`` raises on open, every time."""
    if "broken" in shard:
        raise OSError(f"cannot open {shard}: bad gateway (simulated)")
    yield from read(shard)


def read_flaky(shard: str) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``read``, except that the first opening of each shard (per marker file) fails."""
    marker = Path(shard + ".failed-once")
    if not marker.exists():
        marker.write_text("x")
        raise ConnectionError(f"connection reset while opening {shard} (simulated)")
    yield from read(shard)


def linear() -> nn.Module:
    return nn.Linear(FEATURES, 1)


def sgd(params: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.5)  # type: ignore[arg-type]


def mse(model: nn.Module, batch: object) -> torch.Tensor:
    x, y = batch  # type: ignore[misc]
    return nn.functional.mse_loss(model(x), y)
