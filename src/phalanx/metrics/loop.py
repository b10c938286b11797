"""Values read from the training loop at each step rather than summed over batches."""

from __future__ import annotations

from phalanx.metrics.base import LoopMetric, LoopStats


class LearningRate(LoopMetric):
    """The optimizer's current learning rate (first parameter group)."""

    name = "lr"

    def read(self, stats: LoopStats) -> float:
        return float(stats.lr)


class SamplesPerSecond(LoopMetric):
    """Training throughput in samples per second, over all workers."""

    name = "samples_per_s"

    def read(self, stats: LoopStats) -> float:
        return float(stats.samples_per_s)
