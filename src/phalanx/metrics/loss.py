"""The loss as a metric: the sample-weighted mean of the step's loss."""

from __future__ import annotations

import torch

from phalanx.metrics.base import Metric
from phalanx.step import StepOutput


class Loss(Metric):
    """Mean loss per sample.

    ``StepOutput.loss`` is the mean over the local batch of ``samples`` samples.
    State: ``[loss * samples, samples]``; ``compute`` returns their ratio, NaN when no sample
    was counted.
    """

    name = "loss"
    higher_is_better = False

    def size(self) -> int:
        return 2

    def state(self, output: StepOutput, samples: int) -> torch.Tensor:
        loss = output.loss.item()  # (a Python float: float64, the value exactly)
        return torch.tensor([loss * samples, float(samples)], dtype=torch.float64)

    def compute(self, state: torch.Tensor) -> float:
        count = float(state[1])
        return float(state[0]) / count if count > 0 else float("nan")
