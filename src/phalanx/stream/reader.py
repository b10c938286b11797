"""Reading a stream's samples by index, front to back: one cursor per open shard.

A member asks for the samples of its part of each step in the order of the epoch (see
:mod:`phalanx.stream.order`): within a shard that is front to back, but for the shuffle
window and the samples of other members' parts in between. A cursor reads its shard forward
and keeps the latest samples it read (enough for a shuffle window); a sample behind what it
keeps (a retry after a long time, a catch-up) opens the shard again at that sample, or up to
a shuffle window before it (those are asked for next, in shuffled order): through
``read(shard, start)`` where ``read`` takes a start, else by reading and dropping ``start``
samples (what that costs is counted: ``Reader.skipped``).

Per process: a DataLoader worker or a ddp worker gets the stream without its reader (see
``Stream.__getstate__``) and opens its own. Thread-safe (threads replicas share one).
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

from phalanx.errors import StreamChangedError, StreamReadError
from phalanx.stream.order import shard_bases

RETRIES = 3  # attempts to open or read a shard before it is named
RETRY_WAIT_S = 0.05  # the first wait between attempts, doubled each time


class Cursor:
    """One shard, read forward from ``pos``; the last ``keep`` samples read stay at hand."""

    def __init__(self, reader: Reader, shard: int) -> None:
        self.reader, self.shard = reader, shard
        self.length = reader.lengths[shard]
        self.kept: OrderedDict[int, Any] = OrderedDict()
        self.samples: Iterator[Any] | None = None
        self.pos = 0  # the offset the iterator yields next

    def get(self, offset: int) -> Any:
        if offset in self.kept:
            return self.kept[offset]
        if self.samples is None or offset < self.pos:
            # Open up to a shuffle window early: the samples asked for next come in a
            # shuffled order, up to ``window - 1`` places behind this one in the shard; read
            # on the way here they are kept, not each read again through another open (from
            # the shard's start, for a ``read`` without a start).
            self._open(max(0, offset - (self.reader.stream.window - 1)))
        while self.pos <= offset:
            self._keep(self.pos, self._next(self.pos))
        if self.pos == self.length:
            self._check_end()
        return self.kept[offset]

    def _keep(self, offset: int, sample: Any) -> None:
        self.kept[offset] = sample
        self.pos = offset + 1
        while len(self.kept) > self.reader.keep:
            self.kept.popitem(last=False)

    def _open(self, start: int) -> None:
        """(Re)open the shard so that the next sample read is ``start``."""
        self.close()
        stream = self.reader.stream
        name = stream.shards[self.shard]
        for attempt in range(RETRIES):
            try:
                if stream.seekable:
                    self.samples = iter(stream.read(name, start))
                    self.pos = start
                    return
                self.samples, self.pos = iter(stream.read(name)), 0
                break
            except FileNotFoundError as exc:
                raise self._gone(exc) from None
            except Exception as exc:
                self._failed(attempt, start, exc)
        skipped = 0
        while self.pos < start:  # (a read without a start: read and drop up to it)
            self._next(self.pos)
            self.pos += 1
            skipped += 1
        self.reader.skipped += skipped

    def _next(self, offset: int) -> Any:
        """The sample at ``offset`` (the next one), retrying a failed read by opening the
        shard again there."""
        for attempt in range(RETRIES):
            assert self.samples is not None
            try:
                return next(self.samples)
            except StopIteration:
                name = self.reader.stream.shards[self.shard]
                raise StreamChangedError(
                    f"shard {self.shard} ({name!r}) of the stream ended after {offset} "
                    f"samples, but it had {self.length} when the run planned its epochs: it "
                    "was truncated or rewritten; restore it, or give the new lengths in a new "
                    "run (another shard is another dataset)"
                ) from None
            except FileNotFoundError as exc:  # (a generator opens its file at first read)
                raise self._gone(exc) from None
            except Exception as exc:
                self._failed(attempt, offset, exc)
                self._open(offset)
        raise AssertionError("unreachable")  # (the last attempt raised)

    def _gone(self, exc: OSError) -> StreamChangedError:
        name = self.reader.stream.shards[self.shard]
        return StreamChangedError(
            f"shard {self.shard} ({name!r}) of the stream is gone ({exc}): it was there when "
            "the run planned its epochs; put it back, or start a new run (another shard list "
            "is another dataset)"
        )

    def _failed(self, attempt: int, offset: int, exc: Exception) -> None:
        """Wait before the next attempt; after the last, name the shard, offset and error."""
        if attempt + 1 >= RETRIES:
            name = self.reader.stream.shards[self.shard]
            raise StreamReadError(
                f"reading shard {self.shard} ({name!r}) of the stream failed at sample "
                f"{offset} after {RETRIES} attempts: {type(exc).__name__}: {exc}",
                shard=self.shard,
                offset=offset,
            ) from exc
        self.reader.retried += 1
        time.sleep(RETRY_WAIT_S * 2**attempt)

    def _check_end(self) -> None:
        """At the planned end, the shard must end too (a longer one was rewritten)."""
        assert self.samples is not None
        try:
            next(self.samples)
        except StopIteration:
            self.close()
            self.samples = iter(())  # (at the end: nothing more to read, kept stays)
            return
        except Exception:
            return  # (a failure past the end is not this run's business)
        name = self.reader.stream.shards[self.shard]
        raise StreamChangedError(
            f"shard {self.shard} ({name!r}) of the stream has more than the {self.length} "
            "samples it had when the run planned its epochs: it was rewritten; restore it, "
            "or start a new run"
        )

    def close(self) -> None:
        closing: Callable[[], Any] | None = getattr(self.samples, "close", None)
        if closing is not None:
            closing()
        self.samples = None


class Reader:
    """The cursors of one process: at most ``most_open`` shards open (least recently used
    closed first). ``skipped`` counts samples read only to reach a place, ``retried`` the
    failed reads tried again."""

    def __init__(self, stream: Any, keep: int, most_open: int) -> None:
        self.stream = stream
        self.lengths: list[int] = list(stream.lengths)
        self.bases = shard_bases(self.lengths)
        self.keep, self.most_open = keep, most_open
        self.cursors: OrderedDict[int, Cursor] = OrderedDict()
        self.lock = threading.Lock()
        self.skipped = self.retried = 0

    def where(self, index: int) -> tuple[int, int]:
        """(shard, offset in it) of sample ``index``."""
        if not 0 <= index < self.bases[-1] + self.lengths[-1]:
            raise IndexError(f"sample {index} is outside the stream")
        shard = bisect.bisect_right(self.bases, index) - 1
        while self.lengths[shard] == 0:  # (empty shards share their base with the next)
            shard += 1
        return shard, index - self.bases[shard]

    def get(self, index: int) -> Any:
        shard, offset = self.where(index)
        with self.lock:
            cursor = self.cursors.get(shard)
            if cursor is None:
                cursor = self.cursors[shard] = Cursor(self, shard)
                while len(self.cursors) > self.most_open:
                    _, oldest = self.cursors.popitem(last=False)
                    oldest.close()
            else:
                self.cursors.move_to_end(shard)
            return cursor.get(offset)

    def close(self) -> None:
        with self.lock:
            for cursor in self.cursors.values():
                cursor.close()
            self.cursors.clear()


AHEAD = 2  # batches a prefetching thread loads ahead of the step


def ahead(load: Callable[[list[int]], Any], batches: list[list[int]]) -> Iterator[Any]:
    """``load(b)`` for each of ``batches``, in order, computed by a background thread up to
    :data:`AHEAD` batches ahead (reading overlaps the step). A failure is raised where its
    batch is taken; dropping the iterator stops the thread."""
    import queue

    out: queue.Queue[tuple[bool, Any]] = queue.Queue(maxsize=AHEAD)
    stop = threading.Event()

    def fill() -> None:
        for batch in batches:
            try:
                item = (True, load(batch))
            except BaseException as exc:  # (raised in the consumer, at its batch)
                item = (False, exc)
            while not stop.is_set():
                try:
                    out.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if stop.is_set() or not item[0]:
                return

    thread = threading.Thread(target=fill, name="phalanx-stream-ahead", daemon=True)
    thread.start()
    try:
        for _ in batches:
            ok, value = out.get()
            if not ok:
                raise value
            yield value
    finally:
        stop.set()
