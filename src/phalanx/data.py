"""Loading a member's slices of the plan through a torch DataLoader; a dataset's fingerprint."""

from __future__ import annotations

import contextlib
import copy
import hashlib
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset, default_collate

from phalanx import rng
from phalanx.balance import cut
from phalanx.ledger import Fingerprint, fingerprints
from phalanx.plan import DataPrint, Plan, split
from phalanx.stream import Stream
from phalanx.stream.reader import ahead


@dataclass(frozen=True)
class Loading:
    """How samples become batches: ``fit(num_workers=, collate_fn=, pin_memory=)``, passed to
    every DataLoader phalanx builds (training and validation). ``collate_fn`` None is torch's
    ``default_collate``; ``pin_memory`` pins batches only where a CUDA device can use them."""

    num_workers: int = 0
    collate_fn: Callable[[list[Any]], Any] | None = None
    pin_memory: bool = False

    def loader(self, dataset: Dataset[Any], batch_sampler: list[list[int]]) -> DataLoader[Any]:
        return DataLoader(
            dataset,
            batch_sampler=batch_sampler,
            collate_fn=self.collate_fn or default_collate,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory and torch.cuda.is_available(),
        )

    def batches(self, dataset: Dataset[Any], batch_sampler: list[list[int]]) -> Iterator[Any]:
        """The collated batches of ``batch_sampler``: what :meth:`loader` yields. A
        ``TensorDataset`` (or a ``Subset`` of one) loaded with the default collate in this
        process is indexed once per batch instead (``[t[idx] for t in tensors]``, the same
        values, dtypes and layout as ``default_collate`` of its samples), without a sample
        fetch, a stack and the DataLoader's machinery per batch."""
        if isinstance(dataset, Stream):
            return self._streamed(dataset, batch_sampler)
        tensors = self._direct(dataset)
        if tensors is None:
            return iter(self.loader(dataset, batch_sampler))
        base, mapping = tensors
        return (_index(base, mapping, batch) for batch in batch_sampler)

    def _streamed(self, stream: Stream, batch_sampler: list[list[int]]) -> Iterator[Any]:
        """A stream's batches: read ahead by a thread of this process (``num_workers=0``)
        or by one DataLoader process (more would each read the same shards: one is used)."""
        if self.num_workers:
            single = Loading(1, self.collate_fn, self.pin_memory)
            return iter(single.loader(stream, batch_sampler))
        collate = self.collate_fn or default_collate
        return ahead(lambda batch: collate([stream[i] for i in batch]), batch_sampler)

    def _direct(self, dataset: Dataset[Any]) -> tuple[tuple[torch.Tensor, ...], Any] | None:
        """The tensors and the index mapping of a dataset :meth:`batches` can index, else None."""
        if self.collate_fn is not None or self.num_workers or self.pin_memory:
            return None
        maps: list[Any] = []
        while isinstance(dataset, Subset) and type(dataset).__getitem__ is Subset.__getitem__:
            maps.append(dataset.indices)
            dataset = dataset.dataset
        if type(dataset) is not TensorDataset:  # (a subclass may override __getitem__)
            return None
        return dataset.tensors, maps  # (the outermost Subset's indices first)


def _index(tensors: tuple[torch.Tensor, ...], maps: list[Any], batch: list[int]) -> list[Any]:
    indices: Any = batch
    for mapping in maps:
        indices = [mapping[i] for i in indices]
    idx = torch.as_tensor(indices, dtype=torch.long)
    return [t[idx] for t in tensors]


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
        loading: Loading | None = None,
        shares: Sequence[float] | None = None,
    ) -> None:
        order = plan.order(epoch)
        self.plan, self.epoch, self.order, self.shares = plan, epoch, order, shares
        self.start = start_step
        self.slices = [
            cut(plan.global_batch(epoch, s, order), shares, members)[member]
            for s in range(start_step, plan.steps)
        ]
        self.global_sizes = [
            len(plan.global_batch(epoch, s, order)) for s in range(start_step, plan.steps)
        ]
        self.prints = fingerprints(self.slices)  # (the ledger's, for every step at once)
        self._dataset, self._loading = dataset, loading or Loading()
        self._loader = self._iterate(start_step)
        self._current: tuple[int, Any] | None = None

    def _iterate(self, step: int) -> Iterator[Any]:
        """Collated slices from ``step`` on (empty slices are skipped: nothing to load);
        ``_at``: the step whose slice it yields next."""
        self._at = self._loaded_from(step)
        sampler = [s for s in self.slices[step - self.start :] if s]
        return self._loading.batches(self._dataset, sampler)

    def _loaded_from(self, step: int) -> int:
        """The first step from ``step`` on with a slice to load (past the end: the end)."""
        while step - self.start < len(self.slices) and not self.slices[step - self.start]:
            step += 1
        return step

    def indices(self, step: int) -> list[int]:
        return self.slices[step - self.start]

    def direct(self, samples: list[int]) -> Any:
        """``samples`` read from the dataset here and collated (no DataLoader): an attempt
        whose part differs from the plan's, or a bisection's piece."""
        collate = self._loading.collate_fn or default_collate
        return collate([self._dataset[i] for i in samples])

    def twisted(
        self, step: int, part: int, members: int, leave_out: frozenset[int]
    ) -> tuple[list[int], int]:
        """Part ``part`` of ``members`` of the global batch of ``step``, without the samples
        in ``leave_out``, and how many samples of the global batch are kept in all."""
        batch = self.plan.global_batch(self.epoch, step, self.order)
        kept = len(batch) - sum(1 for i in batch if i in leave_out)
        mine = cut(batch, self.shares, members)[part]
        return [i for i in mine if i not in leave_out], kept

    def global_size(self, step: int) -> int:
        return self.global_sizes[step - self.start]

    def fingerprint(self, step: int) -> Fingerprint:
        """The ledger's fingerprint of :meth:`indices`."""
        return self.prints[step - self.start]

    def loader(self, step: int) -> Callable[[], Any]:
        """A thunk that returns the collated slice of ``step`` (loaded once)."""

        def load() -> Any:
            if self._current is None or self._current[0] != step:
                if step != self._at:  # (a step read directly, as a bisection's attempt is,
                    self._loader = self._iterate(step)  # left the loader behind: catch up)
                try:
                    self._current = (step, next(self._loader))
                    self._at = self._loaded_from(step + 1)
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


FINGERPRINT_SAMPLES = 8  # samples read to fingerprint a dataset
_FINGERPRINT_SEED = 20261203  # which samples: fixed, so every run reads the same ones


def fingerprint(dataset: Dataset[Any], size: int) -> DataPrint:
    """The fingerprint of ``dataset`` (``size`` samples long), read from a few samples: the
    same indices every time (a fixed seed), read under fixed RNG seeds so that random
    augmentations give the same result. It joins the plan record, so that resume tells two
    datasets of the same size apart (another ``random_split``, another file). A sample that
    raises counts as its exception's type: reading the dataset fails later, in a step, where
    failures are handled."""
    # A shallow copy reads the samples: a dataset that opens its file on first access (as
    # it should, to pickle for ddp workers) keeps that handle on the copy, not on itself.
    with contextlib.suppress(Exception):  # (an object copy refuses: read the original)
        dataset = copy.copy(dataset)
    count = min(FINGERPRINT_SAMPLES, size)
    if isinstance(dataset, Stream):  # (the first sample of a few shards: no shard read far)
        picks = np.asarray(dataset.probe_indices(count))
    else:
        picks = np.random.default_rng(_FINGERPRINT_SEED).choice(size, count, replace=False)
    digest = hashlib.sha256()
    sums: list[float] = []
    probes: list[tuple[int, str, int]] = []
    state = rng.capture()
    try:
        for index in sorted(int(i) for i in picks):
            torch.default_generator.manual_seed(index)  # (CPU only: the caller's CUDA untouched)
            np.random.seed(index)
            random.seed(index)
            digest.update(f"[{index}]".encode())
            try:
                sample = dataset[index]
            except Exception as exc:
                sample = f"raised {type(exc).__name__}"
            _feed(digest, sums, sample)
            alone, own = hashlib.sha256(), list[float]()  # (this sample's own: which differs)
            _feed(alone, own, sample)
            probes.append((index, alone.hexdigest()[:8], len(own)))
    finally:
        rng.restore(state)
    return DataPrint(digest.hexdigest()[:16], tuple(sums), tuple(probes))


def _float_sums(values: np.ndarray) -> list[float]:
    flat = values.astype(np.float64).reshape(-1)
    weights = 1.0 + np.arange(flat.size, dtype=np.float64) / max(flat.size, 1)
    return [float(flat.sum()), float(np.abs(flat).sum()), float((flat * weights).sum())]


def _feed(digest: Any, sums: list[float], value: Any) -> None:
    """Hash a sample: tensors and arrays by dtype and shape, then their bytes (integers,
    booleans) or three sums (floating point, complex as two floats); containers
    recursively; numbers and strings by value (floats as sums); anything else by its
    type's name."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        digest.update(f"T{value.dtype}{tuple(value.shape)}".encode())
        if value.is_floating_point() or value.is_complex():
            flat = value.to(torch.complex128 if value.is_complex() else torch.float64)
            sums.extend(_float_sums(torch.view_as_real(flat).numpy() if value.is_complex()
                                    else flat.numpy()))  # fmt: skip
        else:
            flat = value.contiguous().reshape(-1)
            digest.update(flat.view(torch.uint8).numpy().tobytes())
    elif isinstance(value, np.ndarray) and value.dtype != object:
        digest.update(f"A{value.dtype}{value.shape}".encode())
        if np.issubdtype(value.dtype, np.inexact):
            real = value.view(value.real.dtype) if np.iscomplexobj(value) else value
            sums.extend(_float_sums(np.asarray(real)))
        else:
            digest.update(np.ascontiguousarray(value).tobytes())
    elif isinstance(value, dict):
        for key in sorted(value, key=repr):
            digest.update(f"K{key!r}".encode())
            _feed(digest, sums, value[key])
    elif isinstance(value, (list, tuple)):
        digest.update(f"L{len(value)}".encode())
        for item in value:
            _feed(digest, sums, item)
    elif isinstance(value, (float, np.floating)):
        digest.update(b"F")
        sums.extend(_float_sums(np.asarray([value])))
    elif isinstance(value, (bool, int, complex, str, bytes, np.generic)) or value is None:
        digest.update(f"V{value!r}".encode())
    elif hasattr(value, "__array__"):  # a PIL image, say
        _feed(digest, sums, np.asarray(value))
    else:
        digest.update(f"O{type(value).__qualname__}".encode())
