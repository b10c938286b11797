"""When a worker snapshots the committed state, and how it keeps that off the step's path.

:class:`Snapshotter` is a loop's collaborator on the member that writes its node's
snapshots (under ddp the lowest rank on each machine). After a committed step that is due
(every ``every_steps``, or every K steps chosen by measurement: :func:`every_for`), it
starts a snapshot into its :class:`~.store.SnapshotStore`:

- at once, on the loop's thread: the skeleton (every value that is not a tensor, the loop's
  state and RNG included) and the tensors that the next step changes before its commit
  (module buffers such as BatchNorm's running statistics, which forward updates);
- in a background thread: the parameters and the optimizer's state, which only the next
  commit (the optimizer step) or a restore changes. The loop calls :meth:`fence` before
  either, so the copy always sees the committed values. On CUDA the copy runs on a stream
  of its own that waits for the commit's kernels (never run on a GPU yet).

At a regroup, when a replacement may take its state from this machine rather than from a
source on another one (``for_joins``), a snapshot is forced and written whole before the
loop goes on. A snapshot that fails (shared memory full, say) is reported once
and this member takes no more; the run goes on.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from phalanx.snapshot.config import MAX_EVERY, Snapshots
from phalanx.snapshot.copies import Copied, CopySender
from phalanx.snapshot.store import SnapshotStore, Writing


class Snapshotting(Protocol):
    """What the loop needs of a snapshot taker (see :class:`Snapshotter`)."""

    def after_commit(
        self, state: Callable[[], dict[str, Any]], step: int, regroup: bool
    ) -> None: ...

    def fence(self) -> None: ...


@dataclass(frozen=True)
class Taken:
    """A snapshot of committed step ``step`` is whole: ``nbytes`` in shared memory, ``seconds``
    it took (the loop's share, and the background copy's CPU time)."""

    step: int
    nbytes: int
    seconds: float


def every_for(cost: float, step_time: float, budget: float) -> int:
    """Steps between snapshots so that one snapshot's ``cost`` stays within ``budget`` of
    the training time: ``cost / (every * step_time) <= budget``, at least 1, at most
    :data:`MAX_EVERY`."""
    if step_time <= 0:
        return MAX_EVERY
    return max(1, min(MAX_EVERY, math.ceil(cost / (budget * step_time))))


class Snapshotter:
    """Takes snapshots of one member's committed state (see the module's docstring).

    ``stable`` gives the data pointers of the tensors only a commit or a restore changes
    (parameters, optimizer state): those are copied in the background. ``on_taken`` is
    told of each whole snapshot, ``on_error`` of the first failure (from either thread)."""

    def __init__(
        self,
        store: SnapshotStore,
        settings: Snapshots,
        stable: Callable[[], set[int]],
        on_taken: Callable[[Taken], None],
        on_error: Callable[[BaseException], None],
    ) -> None:
        self.store, self.settings = store, settings
        self.stable, self.on_taken, self.on_error = stable, on_taken, on_error
        self.tag = -1  # written into each snapshot's header (ddp: the writer's generation)
        # Force one at a regroup: a replacement on this machine would otherwise take the state
        # from a source on another machine (on the same one, the source's copy costs as much)
        self.for_joins = False
        self.every = settings.every_steps or 1
        # fsdp: every member must snapshot the same steps, so a measured cadence is only
        # proposed here (:attr:`proposed`), and the members agree on it (FsdpEngine)
        self.propose_only = False
        self.proposed: int | None = None
        self.own_folder = False  # fsdp: this member's slot folder, which no one else writes
        self.last_step: int | None = None  # of the newest snapshot started
        self.step_time: float | None = None  # a moving mean of the interval between commits
        self.cost: float | None = None  # of the last whole snapshot (seconds)
        self.failed = False
        self._commit_at: float | None = None
        self._lock: int | None = None  # the store's writer lock, held while this member writes
        self._thread: threading.Thread | None = None
        self._writing: Writing | None = None
        self._sync = 0.0
        self._copy = 0.0
        # fsdp across machines: sends each whole snapshot to another machine (see
        # phalanx.snapshot.copies); told of each copy whole, and of a failure that stops them
        self.copier: CopySender | None = None
        self.on_copied: Callable[[Copied], None] = lambda _: None
        self.on_copy_error: Callable[[BaseException], None] = lambda _: None
        self.committed = -1  # the last committed step (global count) it was told of
        # The longest a member leaving a generation waits for its copy under way (then it is
        # given up: the next generation forms within its own bound)
        self.settle_within: float | None = None

    # -- the loop's side -------------------------------------------------------------------
    def after_commit(self, state: Callable[[], dict[str, Any]], step: int, regroup: bool) -> None:
        """Committed step ``step`` (global count) is done: start a snapshot if one is due
        (``regroup`` with ``for_joins``: now, and whole before returning, see the module's
        docstring). ``state`` makes the loop's snapshot."""
        force = regroup and self.for_joins
        self.committed = step
        now = time.perf_counter()
        if self._commit_at is not None:
            interval = now - self._commit_at
            mean = self.step_time
            self.step_time = interval if mean is None else 0.8 * mean + 0.2 * interval
        self._commit_at = now
        if self.failed or not (force or self._due(step)):
            return
        self.fence()
        started = time.perf_counter()
        try:
            if not self._hold_lock():
                if not self.own_folder:  # (a machine's folder: another writer has it)
                    return
                raise RuntimeError(f"another live process holds {self.store.folder}'s lock")
            writing = self.store.begin(state(), self.tag)
            stable = set() if force else self.stable()
            writing.copy({i for i, (t, _) in enumerate(writing.tensors) if _ptr(t) not in stable})
        except Exception as exc:
            self._fail(exc)
            return
        self.last_step = step
        self._sync = time.perf_counter() - started
        if not stable or all(writing.copied):
            self._finish(writing)
            self._commit_at = time.perf_counter()  # (the next interval excludes this one)
            return
        self._writing = writing
        event = _cuda_event(writing)
        self._thread = threading.Thread(
            target=self._copy_rest, args=(writing, event), name="phalanx-snapshot", daemon=True
        )
        self._thread.start()
        self._commit_at = time.perf_counter()

    def fence(self) -> None:
        """Wait for a snapshot's background copy: called before anything changes the state
        it copies (the next optimizer step, a restore) and when the loop ends."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        thread.join()
        writing, self._writing = self._writing, None
        if writing is not None and not self.failed:
            self._done(writing, self._sync + self._copy)

    def before_vote(self) -> None:
        """Before this member votes on the next step: its snapshot of the last one whole
        (:meth:`fence`), and, when that step takes the next snapshot, its copy of the last
        one whole on another machine (see :mod:`.copies`: no member then commits a step
        whose snapshot would leave no complete set on the machines that survive one's
        loss). Tells what became of the copies (on the loop's thread)."""
        self.fence()
        copier = self.copier
        if copier is None:
            return
        # (and the generation's first copy, of the snapshot it starts from: see
        # start_copies; until it is whole the set it was restored from is the only one)
        if copier.busy and (copier.sent == 0 or self._due(self.committed + 1)):
            copier.wait()
            if self._commit_at is not None:  # (the wait is no step's time: the cadence is
                self._commit_at = time.perf_counter()  # measured on the steps alone)
        self._tell_copies()

    def start_copies(
        self, copier: CopySender, state: Callable[[], dict[str, Any]], step: int
    ) -> None:
        """A generation across machines starts: its copies go through ``copier``, the first
        of a snapshot taken now, of committed step ``step`` where the generation starts
        (whole before this member's first vote: :meth:`before_vote`). Every member does this
        at the same step, so those snapshots are a set, and once its copies are whole it
        stands on two machines, whichever buddies the new generation chose."""
        self.copier = copier
        if self.failed:
            return
        for_joins, self.for_joins = self.for_joins, True
        try:
            self.after_commit(state, step, regroup=True)
        finally:
            self.for_joins = for_joins

    def end_copies(self) -> None:
        """Leaving a generation: wait for the copy under way (the group's abort ends it
        where a member was lost), tell what became of it, and close the generation's
        connection. Where every member lives, the copy of the snapshot a regroup forced is
        then whole, and the set the next generation starts from stands on two machines."""
        self.fence()
        if self.copier is not None:
            self.copier.wait(self.settle_within)
            self._tell_copies()
            self.copier.close()
            self.copier = None

    def _tell_copies(self) -> None:
        copier = self.copier
        assert copier is not None
        done, error = copier.outcome()
        if done is not None:
            self.on_copied(done)
        if error is not None:
            self.on_copy_error(error)

    def restart_cadence(self) -> None:
        """As at the start (fsdp, a new generation: its members, new ones included, count
        from the same point, so they snapshot the same steps)."""
        self.fence()
        self.every = self.settings.every_steps or 1
        self.last_step = self.step_time = self._commit_at = self.proposed = None

    def close(self) -> None:
        self.fence()
        if self.copier is not None:  # (the run's end: a copy under way no longer matters)
            self.copier.close()
            self.copier = None
        if self._lock is not None:
            self.store.unlock(self._lock)
            self._lock = None
        self.store.close()

    # -- inside ------------------------------------------------------------------------------
    def _due(self, step: int) -> bool:
        if self.settings.every_steps is not None:
            return step % self.settings.every_steps == 0
        if self.last_step is None:
            return self.step_time is not None  # (the first once a step's time is known)
        return step - self.last_step >= self.every

    def _hold_lock(self) -> bool:
        """Whether this member holds the folder's writer lock (taken at its first snapshot
        and kept: another live process that writes there keeps this one out)."""
        if self._lock is None:
            self._lock = self.store.lock()
        return self._lock is not None

    def _copy_rest(self, writing: Writing, event: Any) -> None:
        # (its CPU time, not its wall time: while the step runs beside it, the copy waits
        # for a core, and that wait is not its cost)
        started = time.thread_time()
        try:
            if event is None:
                writing.finish()
            else:
                device, done = event
                stream = torch.cuda.Stream(device=device)
                with torch.cuda.stream(stream):
                    stream.wait_event(done)
                    writing.finish()
        except Exception as exc:
            self._fail(exc)
        self._copy = time.thread_time() - started

    def _finish(self, writing: Writing) -> None:
        try:
            writing.finish()
        except Exception as exc:
            self._fail(exc)
            return
        self._done(writing, self._sync)

    def _done(self, writing: Writing, seconds: float) -> None:
        self.cost = seconds
        if self.settings.every_steps is None and self.step_time is not None:
            # A buffer's first snapshot also made it and faulted its pages in, once (about
            # three times a later one's cost): the steps between snapshots are chosen from a
            # snapshot into a buffer in use, so the first two come one step apart.
            budget = self.settings.budget
            every = 1 if writing.first else every_for(seconds, self.step_time, budget)
            if self.copier is not None and self.copier.seconds is not None:
                # (room for the copy to another machine to end beside the steps between)
                every = max(every, min(MAX_EVERY, math.ceil(self.copier.seconds / self.step_time)))
            if self.propose_only:
                self.proposed = None if writing.first else every
            else:
                self.every = every
        header = writing.header
        self.on_taken(Taken(header.step, header.data_end + header.skeleton_bytes, seconds))
        if self.copier is not None:
            self.copier.start(self.store, header)

    def _fail(self, exc: BaseException) -> None:
        if not self.failed:
            self.failed = True
            self.on_error(exc)


def stable_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> set[int]:
    """The data pointers of the tensors only a commit or a restore changes: the model's
    parameters and the optimizer's state (module buffers are not among them: forward
    updates BatchNorm's running statistics)."""
    found = {_ptr(p) for p in model.parameters()}
    for state in optimizer.state.values():
        found.update(_ptr(v) for v in state.values() if isinstance(v, torch.Tensor))
    found.discard(-1)
    return found


def _ptr(tensor: torch.Tensor) -> int:
    return tensor.data_ptr() if tensor.numel() else -1


def _cuda_event(writing: Writing) -> tuple[torch.device, Any] | None:
    """(device, an event on its current stream after the commit) when a tensor left to copy
    is on a CUDA device (the copy's stream waits for the event); else None."""
    cuda = [t for t, _ in writing.tensors if t.is_cuda]
    if not cuda:
        return None
    device = cuda[0].device
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return device, event
