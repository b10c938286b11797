"""Streamed data: ``px.Stream(shards, read)``, a dataset read front to back, shard by shard.

phalanx plans a stream as it plans an indexed dataset (step ``s`` of epoch ``e`` always
uses the same samples, each exactly once, whoever computes them): a sample's index is its
place in the stream (shard after shard, in the order of the list), the epoch's order comes
from :mod:`phalanx.stream.order` (seeded shard order, lanes, a bounded shuffle window), and
each process reads the samples of its part through :mod:`phalanx.stream.reader`.

:func:`huggingface` and :func:`webdataset` (:mod:`phalanx.stream.adapters`) make a stream of
a Hugging Face ``IterableDataset`` or of WebDataset tar files.
"""

from __future__ import annotations

import inspect
import json
import os
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

from phalanx.errors import StreamError, StreamReadError
from phalanx.stream.adapters import huggingface, webdataset
from phalanx.stream.order import StreamLayout, names_digest, shard_bases
from phalanx.stream.reader import RETRIES, Reader

LENGTHS_FILE = "stream_lengths.json"  # in run_dir: lengths learned once, kept for a resume
LEARN_THREADS = 8  # shards counted at once when lengths are learned


class Stream(Dataset[Any]):
    """A dataset of ``shards`` (picklable names: paths, URLs, anything ``read`` takes),
    each read front to back by ``read(shard)``, a module-level function that yields its
    samples (whatever the default collate or ``collate_fn`` takes).

    ``read(shard, start)``, when ``read`` takes a second argument, starts at sample
    ``start`` of the shard (a format with an index, fixed-size records, row groups):
    phalanx then never reads a shard from its start to find a place. Without it, reaching
    sample ``k`` of a shard reads and drops ``k`` samples.

    ``lengths`` (samples per shard) lets phalanx plan the epochs at once; without it, the
    first fit reads every shard once to count its samples (in threads, before any worker
    starts) and keeps the counts in ``run_dir/stream_lengths.json`` for a resume.

    ``shuffle_buffer``: samples shuffle within blocks of this many in their lane (a bounded
    shuffle, not a full permutation; the shard order is shuffled each epoch too).
    ``lanes``: how many shards are read side by side; each global batch takes an even
    share from every lane. Both are part of the plan: change them and it is another run.
    The order of an epoch depends on ``(seed, epoch)``, the shard list, the lengths,
    ``lanes`` and ``shuffle_buffer`` only: never on the number of workers or nodes.
    """

    def __init__(
        self,
        shards: Sequence[Any],
        read: Callable[..., Iterable[Any]],
        *,
        lengths: Sequence[int] | None = None,
        shuffle_buffer: int = 256,
        lanes: int = 8,
    ) -> None:
        if isinstance(shards, (str, bytes)) or not isinstance(shards, Sequence):
            raise StreamError(
                f"px.Stream(shards=...) takes a list of shard names, got "
                f"{type(shards).__qualname__}; e.g. px.Stream(sorted(glob('data/*.tar')), read)"
            )
        if not shards:
            raise StreamError("px.Stream(shards=...) is empty: give at least one shard")
        if not callable(read):
            raise StreamError(
                f"px.Stream(read=...) must be a function of a shard name that yields its "
                f"samples, got {type(read).__qualname__}"
            )
        for name, value in (("shuffle_buffer", shuffle_buffer), ("lanes", lanes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise StreamError(f"px.Stream({name}=...) must be an int >= 1, got {value!r}")
        self.shards = list(shards)
        self.read = read
        self.window, self.lanes = shuffle_buffer, lanes
        self.seekable = _takes_start(read)
        self._lengths: list[int] | None = None
        if lengths is not None:
            self._lengths = _checked_lengths(lengths, len(self.shards))
        self._reader: Reader | None = None
        self._reader_pid = 0

    # -- lengths ---------------------------------------------------------------------------

    @property
    def lengths(self) -> list[int]:
        if self._lengths is None:
            raise StreamError(
                "the stream's lengths are not known yet: fit() learns them (or pass "
                "px.Stream(..., lengths=[samples per shard]))"
            )
        return self._lengths

    def learn_lengths(self, run_dir: str | None = None, reuse: bool = False) -> str | None:
        """Count each shard's samples by reading it once, unless given or (``reuse``: a
        resume) kept in ``run_dir`` by the run it resumes; keep them there. Returns what
        was done, in words, or None when nothing was read."""
        if self._lengths is not None:
            return None
        kept = _kept_lengths(run_dir, self.shards) if reuse else None
        if kept is not None:
            self._lengths = kept
            return None
        began = time.perf_counter()
        with ThreadPoolExecutor(min(LEARN_THREADS, len(self.shards))) as pool:
            counts = list(pool.map(self._count, range(len(self.shards))))
        seconds = time.perf_counter() - began
        self._lengths = counts
        where = ""
        if run_dir:
            _keep_lengths(run_dir, self.shards, counts)
            where = f", kept in run_dir/{LENGTHS_FILE} for a resume"
        return (
            f"read the {len(self.shards)} shards of the stream once to count their samples "
            f"({sum(counts)} samples, {seconds:.1f} s{where}); pass px.Stream(..., "
            "lengths=[...]) to plan without reading"
        )

    def _count(self, shard: int) -> int:
        name = self.shards[shard]
        last: Exception | None = None
        for _ in range(RETRIES):
            try:
                return sum(1 for _ in self.read(name))
            except Exception as exc:  # (retried: a flaky store; then named)
                last = exc
        raise StreamReadError(
            f"counting the samples of shard {shard} ({name!r}) of the stream failed after "
            f"{RETRIES} attempts: {type(last).__name__}: {last}",
            shard=shard,
            offset=None,
        )

    # -- the plan --------------------------------------------------------------------------

    def layout(self) -> StreamLayout:
        return StreamLayout(tuple(self.lengths), self.lanes, self.window, names_digest(self.shards))

    def probe_indices(self, count: int) -> list[int]:
        """Samples to fingerprint the stream by, cheap to read: the first of ``count``
        shards spread over the list (none read past its start)."""
        lengths = self.lengths
        bases = shard_bases(lengths)
        filled = [s for s, n in enumerate(lengths) if n]
        if len(filled) <= count:
            picks = filled
        else:
            picks = [filled[round(i * (len(filled) - 1) / (count - 1))] for i in range(count)]
        return [bases[s] for s in picks]

    # -- the dataset -----------------------------------------------------------------------

    def __len__(self) -> int:
        return sum(self.lengths)

    def __getitem__(self, index: int) -> Any:
        return self.reader().get(int(index))

    def reader(self) -> Reader:
        """This process's reader (a forked child opens its own)."""
        if self._reader is None or self._reader_pid != os.getpid():
            keep = 2 * self.window + 256
            self._reader = Reader(self, keep=keep, most_open=2 * self.lanes + 2)
            self._reader_pid = os.getpid()
        return self._reader

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_reader"], state["_reader_pid"] = None, 0  # (open shards stay here)
        return state

    def __repr__(self) -> str:
        read = getattr(self.read, "__qualname__", self.read)
        return (
            f"Stream({len(self.shards)} shards, read={read}, lanes={self.lanes}, "
            f"shuffle_buffer={self.window})"
        )


def _takes_start(read: Callable[..., Any]) -> bool:
    """Whether ``read`` takes a second positional argument (the sample to start at)."""
    try:
        params = list(inspect.signature(read).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = [
        p
        for p in params
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
    ]
    return len(positional) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in positional)


def _checked_lengths(lengths: Sequence[int], shards: int) -> list[int]:
    values = list(lengths)
    if len(values) != shards:
        raise StreamError(
            f"px.Stream(lengths=...) has {len(values)} values for {shards} shards: give one "
            "sample count per shard, in the order of the shards (or none, to have them counted)"
        )
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, int) or v < 0]
    if bad:
        raise StreamError(f"px.Stream(lengths=...) must be counts (ints >= 0), got {bad[0]!r}")
    if not sum(values):
        raise StreamError("px.Stream(lengths=...) adds up to 0 samples: the stream is empty")
    return [int(v) for v in values]


def _kept_lengths(run_dir: str | None, shards: list[Any]) -> list[int] | None:
    """The lengths a previous fit kept in ``run_dir`` for this shard list, if any."""
    if not run_dir:
        return None
    path = Path(run_dir) / LENGTHS_FILE
    try:
        kept = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(kept, dict) or kept.get("shards") != names_digest(shards):
        return None
    lengths = kept.get("lengths")
    if not isinstance(lengths, list) or len(lengths) != len(shards):
        return None
    return [int(n) for n in lengths]


def _keep_lengths(run_dir: str, shards: list[Any], lengths: list[int]) -> None:
    path = Path(run_dir) / LENGTHS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"shards": names_digest(shards), "lengths": lengths}))
    os.replace(tmp, path)


__all__ = ["Stream", "StreamLayout", "huggingface", "webdataset"]
