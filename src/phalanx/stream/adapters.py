"""``px.Stream`` over the streamed datasets of other libraries: a Hugging Face
``datasets.IterableDataset`` (:func:`huggingface`) and WebDataset tar files
(:func:`webdataset`).

Each adapter names the shards and gives ``px.Stream`` a ``read(shard, start)``: a small
picklable object (ddp workers are separate processes and each gets a copy) that reads one
shard front to back with the library's own reader, starting at sample ``start``. The
library's own shuffling and splitting by node or worker stay off: phalanx orders the epoch
and splits it among the workers itself (see :mod:`phalanx.stream.order`).

Neither library is imported before an adapter is called (``pip install "phalanx[streams]"``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from phalanx.errors import StreamError

if TYPE_CHECKING:  # (imported when called: phalanx.stream imports this module)
    from phalanx.stream import Stream

# Steps of a Hugging Face pipeline whose order is random: phalanx orders the epoch itself,
# and a shard read again (a retry, a resume, another worker) must give the same samples.
_RANDOM_STEPS = ("BufferShuffledExamplesIterable", "RandomlyCyclingMultiSourcesExamplesIterable")


# -- Hugging Face datasets -----------------------------------------------------------------------


def huggingface(
    ds: Any,
    *,
    lengths: Sequence[int] | None = None,
    shuffle_buffer: int = 256,
    lanes: int = 8,
) -> Stream:
    """A ``px.Stream`` over a Hugging Face ``datasets.IterableDataset`` (streaming mode:
    ``load_dataset(..., streaming=True)`` or ``Dataset.to_iterable_dataset(num_shards=...)``).

    Its shards are the dataset's own (``ds.num_shards``: one per data file for most
    formats); shard ``i`` is ``ds.shard(num_shards=ds.num_shards, index=i)``, read front
    to back in the file's order. The samples are the rows the dataset yields, dicts of
    column values, formatted as ``ds`` says: with ``ds.with_format("torch")`` they hold
    tensors, which phalanx's default collate stacks. Rows of plain Python values (lists
    above all: the default collate would turn a batch of lists into a list of columns)
    want ``ds.with_format("torch")`` or ``fit(..., collate_fn=...)``.

    Starting a shard at sample ``k`` (a retry, a catch-up, a resume) is
    ``shard.skip(k)``: for an Arrow-backed dataset (Parquet, JSON, CSV, Arrow files, a
    converted ``Dataset``) the file is still read and parsed up to ``k``, but whole record
    batches are dropped as Arrow tables, never turned into rows (skipping 200,000 JSON
    lines took 0.1 s where reading them as rows took 2.7 s, and 23 s as torch tensors); for
    a generator-backed dataset each of the ``k`` rows is produced and dropped.

    ``lengths=None``: the first fit reads every shard once, row by row in the dataset's
    format, to count its rows (kept in ``run_dir`` for a resume); pass the counts (rows
    per shard, in shard order) when you know them.

    Refused (PX160): a map-style ``datasets.Dataset`` (it is indexable: pass it to
    ``fit()`` directly), a shuffled dataset (``ds.shuffle(...)``: phalanx shuffles, and
    reading a shard again must give the same rows), a dataset split by
    ``split_dataset_by_node`` (phalanx splits the epoch among the workers), a dataset with
    no known number of shards. A ``map`` with its own randomness is not seen: keep ``map``
    deterministic.
    """
    from phalanx.stream import Stream

    _check_iterable_dataset(ds)
    count = _num_shards(ds)
    return Stream(
        list(range(count)),
        HuggingFaceShard(ds),
        lengths=lengths,
        shuffle_buffer=shuffle_buffer,
        lanes=lanes,
    )


class HuggingFaceShard:
    """``read(shard, start)`` of :func:`huggingface`: the rows of shard ``shard`` of the
    dataset, front to back from row ``start`` (``.skip(start)``; see :func:`huggingface`
    for what skipping costs)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self.num_shards = _num_shards(dataset)

    def __call__(self, shard: int, start: int = 0) -> Iterator[Any]:
        part = self.dataset.shard(num_shards=self.num_shards, index=int(shard), contiguous=True)
        if start:
            part = part.skip(int(start))
        return iter(part)

    def __repr__(self) -> str:
        return f"HuggingFaceShard({self.num_shards} shards)"


def _check_iterable_dataset(ds: Any) -> None:
    try:
        import datasets
    except ImportError:
        raise StreamError(
            f"phalanx.stream.huggingface(ds) takes a datasets.IterableDataset, got "
            f"{type(ds).__qualname__} (and the datasets package is not installed: "
            'pip install "phalanx[streams]")'
        ) from None
    if isinstance(ds, datasets.Dataset):
        raise StreamError(
            "phalanx.stream.huggingface(ds) takes a streamed datasets.IterableDataset, got a "
            "map-style datasets.Dataset: it is indexable, so pass it to fit() directly "
            '(ds.with_format("torch") gives tensors), or stream it with '
            "phalanx.stream.huggingface(ds.to_iterable_dataset(num_shards=...))"
        )
    if isinstance(ds, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        raise StreamError(
            f"phalanx.stream.huggingface(ds) takes one split, got a {type(ds).__qualname__} "
            f"of {sorted(ds)}: pass ds['train'] (or load_dataset(..., split='train'))"
        )
    if not isinstance(ds, datasets.IterableDataset):
        raise StreamError(
            f"phalanx.stream.huggingface(ds) takes a datasets.IterableDataset, got "
            f"{type(ds).__qualname__}: e.g. load_dataset(..., streaming=True, split='train')"
        )
    if getattr(ds, "_distributed", None) is not None:
        raise StreamError(
            "phalanx.stream.huggingface(ds) got a dataset split by split_dataset_by_node: "
            "phalanx splits each epoch among the workers itself; pass the whole dataset"
        )
    random = sorted({step for step in _pipeline(ds) if step in _RANDOM_STEPS})
    if random:
        raise StreamError(
            f"phalanx.stream.huggingface(ds) got a dataset with its own random order "
            f"({', '.join(random)}: ds.shuffle(...) or interleave_datasets with "
            "probabilities): phalanx shuffles each epoch itself (px.Stream's shuffle_buffer "
            "and shard order), and a shard read again must give the same rows; pass the "
            "dataset before .shuffle()"
        )


def _pipeline(ds: Any) -> Iterator[str]:
    """The class names of the steps of a Hugging Face dataset's pipeline (its examples
    iterables, nested through ``ex_iterable`` / ``ex_iterables``)."""
    todo = [getattr(ds, "_ex_iterable", None)]
    seen: set[int] = set()
    while todo:
        step = todo.pop()
        if step is None or id(step) in seen:
            continue
        seen.add(id(step))
        yield type(step).__name__
        todo.append(getattr(step, "ex_iterable", None))
        todo.extend(getattr(step, "ex_iterables", None) or [])


def _num_shards(ds: Any) -> int:
    count = getattr(ds, "num_shards", None)
    if count is None:
        count = getattr(ds, "n_shards", None)
    if not isinstance(count, int) or count < 1:
        raise StreamError(
            f"phalanx.stream.huggingface(ds): the dataset's number of shards is {count!r}; "
            "a streamed dataset needs at least one (one per data file)"
        )
    return count


# -- WebDataset ---------------------------------------------------------------------------------


def webdataset(
    urls: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    *,
    decode: Callable[[dict[str, Any]], Any] | None = None,
    lengths: Sequence[int] | None = None,
    shuffle_buffer: int = 256,
    lanes: int = 8,
) -> Stream:
    """A ``px.Stream`` over WebDataset tar files: one shard per tar, ``urls`` a list of
    paths or URLs as WebDataset opens them (``gopen``: local paths, ``file:``, ``pipe:``,
    ``http(s):`` through curl, ...), or one string that WebDataset's brace notation
    expands (``"data/train-{000000..000099}.tar"``), in that order.

    A sample is the files of one key grouped as WebDataset groups them: a dict
    ``{"__key__": "000042", "__url__": url, "cls": b"3", "png": b"..."}`` of raw bytes by
    extension. ``decode`` (a picklable callable: a module-level function, or e.g.
    ``webdataset.Decoder([webdataset.imagehandler("torchrgb")])``) turns each sample into
    what the step takes; None keeps the raw dict. WebDataset's own shuffling and its split
    by node and worker are not used: phalanx orders and splits the epoch.

    Starting a tar at sample ``k`` reads the tar from its start but passes over the files
    of the first ``k`` samples without loading their bytes into memory or decoding them
    (the archive is still read through, and decompressed if it is compressed).
    ``lengths=None``: the first fit reads and decodes every sample once to count them (kept
    in ``run_dir`` for a resume); pass the counts when you know them.
    """
    from phalanx.stream import Stream

    _import_webdataset()
    if isinstance(urls, (str, os.PathLike)):
        import braceexpand  # (a dependency of webdataset)

        names = list(braceexpand.braceexpand(os.fspath(urls)))
    elif isinstance(urls, Sequence):
        names = [os.fspath(url) for url in urls]
    else:
        raise StreamError(
            f"phalanx.stream.webdataset(urls=...) takes a list of tar files (or one "
            f"brace-notation string), got {type(urls).__qualname__}"
        )
    if decode is not None and not callable(decode):
        raise StreamError(
            f"phalanx.stream.webdataset(decode=...) must be a function of a sample dict (or "
            f"None for the raw bytes), got {type(decode).__qualname__}"
        )
    return Stream(
        names,
        WebDatasetShard(decode),
        lengths=lengths,
        shuffle_buffer=shuffle_buffer,
        lanes=lanes,
    )


class WebDatasetShard:
    """``read(url, start)`` of :func:`webdataset`: the samples of one tar file, front to
    back from sample ``start`` (the files of the samples before it are passed over, not
    loaded), each passed through ``decode`` when given."""

    def __init__(self, decode: Callable[[dict[str, Any]], Any] | None = None) -> None:
        self.decode = decode

    def __call__(self, url: str, start: int = 0) -> Iterator[Any]:
        wds = _import_webdataset()
        stream = wds.gopen(url)  # (opened here: a missing file is raised at once)
        return _TarSamples(self._samples(url, stream, int(start)), stream)

    def _samples(self, url: str, stream: Any, start: int) -> Iterator[Any]:
        from webdataset import tariterators

        try:
            skip = _After(start) if start else None
            source = [{"url": url, "stream": stream}]
            files = tariterators.tar_file_expander(source, select_files=skip)
            for sample in tariterators.group_by_keys(files):
                yield sample if self.decode is None else self.decode(sample)
        finally:
            stream.close()

    def __repr__(self) -> str:
        decode = getattr(self.decode, "__qualname__", self.decode)
        return f"WebDatasetShard(decode={decode})"


class _TarSamples(Iterator[Any]):
    """The samples of one open tar; ``close()`` closes the file even before the first
    sample was read (a generator not yet started would leave it to the garbage collector)."""

    def __init__(self, samples: Iterator[Any], stream: Any) -> None:
        self.samples, self.stream = samples, stream

    def __next__(self) -> Any:
        return next(self.samples)

    def close(self) -> None:
        close: Callable[[], Any] | None = getattr(self.samples, "close", None)
        if close is not None:
            close()
        self.stream.close()


class _After:
    """``select_files`` of WebDataset's tar reader that passes over the files of the first
    ``count`` samples (the tar reader then never loads their bytes). Samples are counted as
    ``group_by_keys`` groups them: a new one wherever the key (the file name up to its
    first dot) changes."""

    def __init__(self, count: int) -> None:
        from webdataset.tariterators import base_plus_ext

        self.count, self.split = count, base_plus_ext
        self.key: str | None = None
        self.seen = 0  # samples begun so far

    def __call__(self, fname: str) -> bool:
        if self.seen > self.count:
            return True
        prefix, _ = self.split(fname)
        if prefix is None:
            return False  # (no extension: group_by_keys drops it too)
        if prefix != self.key:
            self.key = prefix
            self.seen += 1
        return self.seen > self.count


def _import_webdataset() -> Any:
    try:
        import webdataset as wds
    except ImportError:
        raise StreamError(
            'phalanx.stream.webdataset needs the webdataset package: pip install "phalanx[streams]"'
        ) from None
    return wds


__all__ = ["HuggingFaceShard", "WebDatasetShard", "huggingface", "webdataset"]
