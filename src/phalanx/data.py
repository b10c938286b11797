"""Loading a member's slices of the plan through a torch DataLoader."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils.data import DataLoader, Dataset, default_collate

from phalanx.plan import Plan, split


class LocalBatches:
    """This member's slice of every global batch of one epoch, from ``start_step`` on.

    A DataLoader with a batch sampler yields the collated slices in step order; the slice of
    the current step is kept, so a retried step reloads nothing.
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        plan: Plan,
        epoch: int,
        start_step: int,
        member: int,
        members: int,
        num_workers: int = 0,
        collate: Callable[[list[Any]], Any] = default_collate,
    ) -> None:
        order = plan.order(epoch)
        self.start = start_step
        self.slices = [
            split(plan.global_batch(epoch, s, order), members)[member]
            for s in range(start_step, plan.steps)
        ]
        self.global_sizes = [
            len(plan.global_batch(epoch, s, order)) for s in range(start_step, plan.steps)
        ]
        sampler = [s for s in self.slices if s]
        self._loader = iter(
            DataLoader(dataset, batch_sampler=sampler, collate_fn=collate, num_workers=num_workers)
        )
        self._current: tuple[int, Any] | None = None

    def indices(self, step: int) -> list[int]:
        return self.slices[step - self.start]

    def global_size(self, step: int) -> int:
        return self.global_sizes[step - self.start]

    def loader(self, step: int) -> Callable[[], Any]:
        """A thunk that returns the collated slice of ``step`` (loaded once)."""

        def load() -> Any:
            if self._current is None or self._current[0] != step:
                self._current = (step, next(self._loader))
            return self._current[1]

        return load


def validation_batches(samples: int, batch_size: int, member: int, members: int) -> list[list[int]]:
    """This member's part of each validation batch (in order, no shuffle)."""
    batches = [list(range(s, min(s + batch_size, samples))) for s in range(0, samples, batch_size)]
    return [split(b, members)[member] for b in batches]
