"""Module-level (picklable) pieces for tests/test_precision.py and tests/test_optimizers.py:
ddp workers import them by module name (see ddp_helpers)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from phalanx.events import StepEnded
from recorder import Recorder

# A loss scale so large that fp16 gradients overflow: 2**36 and 2**24 overflow (gradients of
# this model times the scale pass fp16's 65504), 2**12 is far from it (near 2**16 a whole
# batch may overflow where two half-batches, each scaled by its share, do not).
OVERFLOWING = {"init_scale": 2.0**36, "backoff_factor": 2.0**-12}
SKIPS = 2  # steps skipped with OVERFLOWING


def mlp() -> nn.Module:
    torch.manual_seed(11)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def halve_each(optimizer: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


def mse_step(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def decay_groups(model: nn.Module) -> torch.optim.Optimizer:
    """minGPT's rule: weights of Linear layers decay; biases, LayerNorm and Embedding weights
    do not. The factory gets the model (its first parameter is named ``model``)."""
    decay, no_decay = set(), set()
    for module_name, module in model.named_modules():
        for name, _ in module.named_parameters(recurse=False):
            full = f"{module_name}.{name}" if module_name else name
            if name.endswith("weight") and isinstance(module, nn.Linear):
                decay.add(full)
            else:
                no_decay.add(full)
    params = dict(model.named_parameters())
    groups = [
        {"params": [params[n] for n in sorted(decay)], "weight_decay": 0.1},
        {"params": [params[n] for n in sorted(no_decay)], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=0.01, betas=(0.9, 0.95))


def norm_mlp() -> nn.Module:
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 1))


class Collect(Recorder):
    """Every event, and which steps skipped the optimizer."""

    def skipped(self) -> list[bool]:
        return [e.skipped for e in self.events if isinstance(e, StepEnded)]
