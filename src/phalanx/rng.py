"""The RNG states a checkpoint carries (torch, numpy, Python's ``random``), as values that
``torch.load(weights_only=True)`` opens: tensors, numbers, strings and tuples only."""

from __future__ import annotations

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
