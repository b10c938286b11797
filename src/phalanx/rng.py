"""The RNG states a checkpoint carries (torch, numpy, Python's ``random``), as values that
``torch.load(weights_only=True)`` opens: tensors, numbers, strings and tuples only."""

from __future__ import annotations

import functools
import random
from typing import Any

import numpy as np
import torch


def capture() -> dict[str, Any]:
    """The current states of torch's CPU generator, numpy's global one and ``random``."""
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    return {
        "torch": torch.get_rng_state(),
        "numpy": {
            "bit_generator": str(name),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "python": random.getstate(),
    }


def restore(state: dict[str, Any]) -> None:
    """Set the three generators back to what :func:`capture` returned."""
    torch.set_rng_state(state["torch"])
    saved = state["numpy"]
    keys = np.asarray(saved["keys"].numpy(), dtype=np.uint32)
    np.random.set_state(
        (saved["bit_generator"], keys, saved["pos"], saved["has_gauss"], saved["cached_gaussian"])
    )
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


def reseed(seed: int) -> None:
    """``torch.manual_seed(seed)`` without the cost it has at every call in a process where
    CUDA is available but not initialised (a CPU worker on a CUDA build): it queues the CUDA
    seeding for later with the caller's formatted stack, 0.3 to 0.5 ms a step. Here the CPU
    generator is seeded, and CUDA's once CUDA is initialised (a CUDA replica's is, from its
    first step; a process that initialises it later gets it seeded at the next call); other
    accelerators (mps, xpu) through ``torch.manual_seed`` itself."""
    if _cuda_available() or not _other_accelerator():
        torch.default_generator.manual_seed(seed)
        if torch.cuda.is_initialized():
            torch.cuda.manual_seed_all(seed)
    else:
        torch.manual_seed(seed)


@functools.cache
def _cuda_available() -> bool:
    """Whether this process sees a CUDA device (asked once: the answer does not change)."""
    return torch.cuda.is_available()


@functools.cache
def _other_accelerator() -> bool:
    mps = getattr(torch.backends, "mps", None)
    xpu = getattr(torch, "xpu", None)
    return bool(
        (mps is not None and mps.is_available()) or (xpu is not None and xpu.is_available())
    )
