"""The metric contract.

A :class:`Metric` is stateless: ``state(output, samples)`` turns one batch into a fixed-size
vector of sums, states add up (over batches, and over workers in one all-reduce), and
``compute(state)`` turns the total into a number. Keeping the running state out of the metric
is what lets every worker's metrics travel in the step's single vote all-reduce.

A :class:`LoopMetric` is read from the loop itself (learning rate, throughput), not summed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from phalanx.step import StepOutput


class Metric(ABC):
    """``name`` is the key in history (``train/<name>``, ``valid/<name>``)."""

    name: str = "metric"
    higher_is_better: bool = True

    @abstractmethod
    def size(self) -> int:
        """Length of the state vector; fixed before any batch is seen."""

    @abstractmethod
    def state(self, output: StepOutput, samples: int) -> torch.Tensor:
        """Sums for one batch: a 1-D float64 CPU tensor of length ``size()``."""

    @abstractmethod
    def compute(self, state: torch.Tensor) -> float:
        """The metric's value from summed states (NaN when nothing was counted)."""


@dataclass
class LoopStats:
    lr: float
    samples_per_s: float


class LoopMetric(ABC):
    """A value read from the loop at each step, not summed over batches."""

    name: str = "loop"

    @abstractmethod
    def read(self, stats: LoopStats) -> float: ...
