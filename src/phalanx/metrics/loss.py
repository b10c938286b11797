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
        return torch.tensor(self.state_of(loss, samples), dtype=torch.float64)

    def compute(self, state: torch.Tensor) -> float:
        return self.value_of(state.tolist())

    # The same two as plain floats: what a step's bookkeeping uses (no tensor).
    @staticmethod
    def state_of(loss: float, samples: int) -> list[float]:
        return [loss * samples, float(samples)]

    @staticmethod
    def value_of(state: list[float]) -> float:
        total, count = state
        return total / count if count > 0 else float("nan")
