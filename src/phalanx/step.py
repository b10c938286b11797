"""The step contract: what the user's step function returns, and how phalanx reads it.

``step(model, batch)`` returns the mean loss over the local batch (a scalar tensor), or a
:class:`StepOutput` with ``outputs`` and ``targets`` too, which classification metrics need.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from phalanx.errors import LossNotScalarError, StepOutputError


@dataclass
class StepOutput:
    """What a step produced. ``loss`` is the mean over the local batch."""

    loss: torch.Tensor
    outputs: torch.Tensor | None = None
    targets: torch.Tensor | None = None


def as_step_output(value: object) -> StepOutput:
    """Normalise a step function's return value; raise a ConfigError naming the fix."""
    out = value if isinstance(value, StepOutput) else None
    if out is None and isinstance(value, torch.Tensor):
        out = StepOutput(loss=value)
    if out is None:
        raise StepOutputError(
            f"the step function returned {type(value).__name__}; it must return a scalar loss "
            "tensor or px.StepOutput(loss=..., outputs=..., targets=...)"
        )
    if not isinstance(out.loss, torch.Tensor) or out.loss.numel() != 1:
        shape = tuple(out.loss.shape) if isinstance(out.loss, torch.Tensor) else type(out.loss)
        raise LossNotScalarError(
            f"the step function's loss has shape {shape}; it must be a scalar, the mean over "
            "the local batch: reduce it with loss.mean() (or use reduction='mean')"
        )
    return out


# -- ready-made steps for a batch of (inputs, targets) ------------------------------------
# Module-level functions, so strategy="ddp" can send them to its worker processes.


def cross_entropy_step(
    model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]
) -> StepOutput:
    """Classification: ``model(x)`` gives logits, the loss is their cross-entropy with the
    integer labels ``y``; the logits and labels go to the metrics (Accuracy, F1, ...)."""
    x, y = batch
    logits = model(x)
    return StepOutput(torch.nn.functional.cross_entropy(logits, y), logits, y)


def mse_step(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> StepOutput:
    """Regression: the mean squared error between ``model(x)`` and ``y``."""
    x, y = batch
    prediction = model(x)
    return StepOutput(torch.nn.functional.mse_loss(prediction, y), prediction, y)
