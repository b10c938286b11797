"""Loading a member's slices of the plan through a torch DataLoader."""

from __future__ import annotations

from collections.abc import Callable, Iterator
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
        self._dataset, self._collate, self._num_workers = dataset, collate, num_workers
        self._loader = self._iterate(start_step)
        self._current: tuple[int, Any] | None = None

    def _iterate(self, step: int) -> Iterator[Any]:
        """Collated slices from ``step`` on (empty slices are skipped: nothing to load)."""
        sampler = [s for s in self.slices[step - self.start :] if s]
        loader = DataLoader(
            self._dataset,
            batch_sampler=sampler,
            collate_fn=self._collate,
            num_workers=self._num_workers,
        )
        return iter(loader)

    def indices(self, step: int) -> list[int]:
        return self.slices[step - self.start]

    def global_size(self, step: int) -> int:
        return self.global_sizes[step - self.start]

    def loader(self, step: int) -> Callable[[], Any]:
        """A thunk that returns the collated slice of ``step`` (loaded once)."""

        def load() -> Any:
            if self._current is None or self._current[0] != step:
                try:
                    self._current = (step, next(self._loader))
                except Exception:
                    # The failed slice was consumed: start again at this step, so that a
                    # retry loads the same samples, not the next step's.
                    self._loader = self._iterate(step)
                    raise
            return self._current[1]

        return load


def validation_batches(samples: int, batch_size: int, member: int, members: int) -> list[list[int]]:
    """This member's part of each validation batch (in order, no shuffle)."""
    batches = [list(range(s, min(s + batch_size, samples))) for s in range(0, samples, batch_size)]
    return [split(b, members)[member] for b in batches]
