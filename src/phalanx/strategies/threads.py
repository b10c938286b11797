"""``strategy="threads"``: one process, one replica per device, one worker thread per device.

Replica ``i`` lives on ``config.devices[i]`` (``cpu:N`` labels are all the host CPU; they
still get a replica and a thread each). Every replica is built from the same seed, so they
start identical; only the main replica's (``devices[0]``) optimizer and scheduler are used.

One step:

1. :meth:`ThreadsEngine.attempt` gives member ``i`` its slice of the global batch (the plan's
   split, as under ddp) and runs :meth:`phalanx.replica.Replica.run` in device ``i``'s
   thread. Each replica scales its loss by ``local_samples / global_samples`` (``world=1``),
   so the SUM of the replicas' gradients is exactly the gradient of the global mean loss.
2. When every replica succeeded, the gradients are summed into the main replica (phase
   ``sync``: a failure there is a failed vote, retried like any other). The vote counts the
   replicas that failed and adds their metric sums.
3. :meth:`commit` clips and steps the main optimizer and scheduler, then copies the main
   parameters and buffers to every other replica. Buffers (e.g. BatchNorm running stats)
   therefore follow the main replica's slice, as DDP's ``broadcast_buffers`` does.

Hangs: each replica's last progress is the time it last entered a phase (its
:class:`~phalanx.replica.Replica` tells each phase change, every micro-batch and every
validation batch included). An attempt or a validation pass waits for its threads as long
as they make progress; a thread still busy that made none for ``hang_timeout`` is hung: its
Python stack is taken (``sys._current_frames``), the run stops with a ``hang`` failure
naming its device and phase, and the thread is abandoned (Python cannot kill a thread).
Worker threads are daemon threads, so an abandoned one never keeps the process from
exiting; a ``ThreadPoolExecutor`` would, since it joins its threads at exit.
The threads are named ``phalanx-threads-<device>`` (visible in stack dumps and profilers).

Determinism: the loop reseeds torch before every step attempt, but the CPU random generator
is one object shared by all threads. With several CPU replicas, random ops in the step
(dropout, random augmentation on tensors) draw from it in whatever order the threads run,
so they are NOT reproducible run to run (a model without randomness is). Each CUDA device
has its own generator: this engine reseeds it in the device's thread from the step's seed
and the member index, so CUDA randomness is reproducible and differs between replicas.
"""

from __future__ import annotations

import functools
import os
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait
from typing import Any, TypeVar

import numpy as np
import torch

from phalanx.badsamples import PLAIN, Twist
from phalanx.data import LocalBatches
from phalanx.devices import torch_device
from phalanx.failures import FailedHere, WorkerFailure
from phalanx.faults import FaultInjector
from phalanx.loop import Vote, pack_vote, unpack_vote, vote_values
from phalanx.ranks import acting_as
from phalanx.replica import Identity, LocalResult, Replica
from phalanx.run import RunInputs
from phalanx.strategies.base import (
    evaluate_local,
    failure_of,
    guarded_commit,
    member_vote,
    run_attempt,
)
from phalanx.trainable import Trainable

T = TypeVar("T")


class _DeviceThread:
    """One daemon thread that runs the tasks of one device, in order."""

    _STOP = object()

    def __init__(self, label: str, device: torch.device) -> None:
        self.device = device
        self.tasks: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.thread = threading.Thread(
            target=self._serve, name=f"phalanx-threads-{label}", daemon=True
        )
        self.thread.start()

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        future: Future[T] = Future()
        self.tasks.put((fn, future))
        return future

    def stop(self) -> None:
        """Ask the thread to exit once its current task (if any) returns; never waits."""
        self.tasks.put(self._STOP)

    def stack(self) -> str | None:
        ident = self.thread.ident
        frame = sys._current_frames().get(ident) if ident is not None else None
        if frame is None:
            return None
        return f'Thread "{self.thread.name}":\n' + "".join(traceback.format_stack(frame))

    def _serve(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # the current device is per thread
        while True:
            item = self.tasks.get()
            if item is self._STOP:
                return
            fn, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn()
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(result)


class ThreadsEngine:
    """One replica per device in this process; the vote is reduced over the threads."""

    is_main = True
    rank = 0
    can_leave = False
    saves_shards = False

    @property
    def identity(self) -> Identity:
        """The main replica's: failures outside a step (checkpoint, metrics) happen there."""
        return self.identities[0]

    def __init__(self, run: RunInputs) -> None:
        config, spec = run.config, run.spec
        self.config, self.plan = config, run.plan
        self.train, self.valid, self.valid_size = run.train, run.valid, run.valid_size
        self.labels = list(config.devices)
        self.devices = [torch_device(label) for label in self.labels]
        self.timeout = config.hang_timeout.total_seconds()
        self.micro = spec.grad_accumulation
        self.trainables = []
        for i, device in enumerate(self.devices):
            with acting_as(i, len(self.devices)):  # (px.rank() in the model factory)
                self.trainables.append(Trainable(spec, device, config.seed))
        for other in self.trainables[1:]:
            other.share_scaler(self.main)  # one loss scale: the main replica's
        self.identities = [
            Identity(worker=i, rank=i, device=label) for i, label in enumerate(self.labels)
        ]
        self.faults = [FaultInjector(config.faults, i) for i in range(len(self.labels))]
        # The phase each replica last entered (where a hung thread was last seen), and when.
        self.phases = ["data"] * len(self.labels)
        self.progress = [time.monotonic()] * len(self.labels)
        self.replicas = [
            Replica(
                t.module,
                device,
                who,
                spec.summed_metrics(),
                faults,
                on_phase=functools.partial(self._entered, who.worker),
                members=len(self.labels),
            )
            for t, device, who, faults in zip(
                self.trainables, self.devices, self.identities, self.faults, strict=True
            )
        ]
        for replica in self.replicas:
            replica.nan_is_data = config.on_bad_sample == "skip"
        self.batches: list[LocalBatches] = []
        self.shares: list[float] | None = None  # each replica's (None: even; balance)
        self.epoch = 0
        self.step = 0
        self.threads = [
            _DeviceThread(label, device)
            for label, device in zip(self.labels, self.devices, strict=True)
        ]

    @property
    def main(self) -> Trainable:
        return self.trainables[0]

    def _entered(self, worker: int, step: int, phase: str) -> None:
        """Replica ``worker`` entered ``phase``: its progress (read by :meth:`_gather`)."""
        self.phases[worker] = phase
        self.progress[worker] = time.monotonic()

    # -- steps --------------------------------------------------------------------------
    def begin_epoch(self, epoch: int, start_step: int) -> None:
        self.epoch = epoch
        n = len(self.replicas)
        loading = self.config.loading()
        self.batches = [
            LocalBatches(self.train, self.plan, epoch, start_step, i, n, loading, self.shares)
            for i in range(n)
        ]

    def reshare(self, shares: list[float], epoch: int, start_step: int) -> None:
        """Each replica's share of each global batch from ``start_step`` on (balance)."""
        self.shares = shares
        self.begin_epoch(epoch, start_step)

    def attempt(
        self,
        epoch: int,
        step: int,
        global_step: int,
        stop: Callable[[], bool],
        twist: Twist = PLAIN,
    ) -> Vote:
        assert self.batches, "begin_epoch was not called"
        self.step = global_step
        seed = torch.initial_seed()  # the loop's seed for this step attempt
        at = (step, global_step, epoch)
        tasks = [self._task(i, at, seed, twist) for i in range(len(self.replicas))]
        results = self._gather(tasks, global_step, epoch)
        votes = [self._vote_of(i, outcome, step, global_step) for i, outcome in enumerate(results)]
        overflow = False
        if not any(v.failed for v in votes):
            try:
                self._reduce_grads()
                overflow = self.main.overflowed()  # of the summed gradients
            except Exception as exc:
                failure = self._failure(exc, 0, "sync", global_step, epoch, None)
                zeros = [0.0] * len(votes[0].sums)
                votes.append(member_vote(LocalResult(zeros, failure), False))
        total = np.stack([pack_vote(v) for v in votes]).sum(axis=0)
        vote = unpack_vote(total, [f for v in votes for f in v.failures])
        vote.stop, vote.overflow = stop(), int(overflow)
        vote.read_rows([vote_values(v) for v in votes[: len(self.replicas)]])
        return vote

    def _vote_of(
        self, i: int, outcome: LocalResult | BaseException, step: int, global_step: int
    ) -> Vote:
        """Replica ``i``'s vote; an exception out of ``Replica.run`` itself (its zero pass)
        is a failed vote in the phase the replica was in."""
        if not isinstance(outcome, BaseException):
            return member_vote(outcome, False)
        samples = self.batches[i].indices(step)
        failure = self._failure(outcome, i, self.phases[i], global_step, self.epoch, samples)
        return member_vote(LocalResult([0.0] * self.replicas[i].size, failure), False)

    def _task(
        self, i: int, at: tuple[int, int, int], seed: int, twist: Twist
    ) -> Callable[[], LocalResult]:
        batches, replica = self.batches[i], self.replicas[i]
        device = self.devices[i]
        step, global_step, epoch = at
        member = (i, len(self.replicas))

        def run() -> LocalResult:
            self._entered(i, global_step, "data")
            if device.type == "cuda":
                torch.cuda.manual_seed(_member_seed(seed, i))
            result = run_attempt(replica, batches, at, self.micro, twist, member)
            if result.failure is None:
                self._entered(i, global_step, "sync")
                try:
                    self.faults[i].check(global_step, "sync")
                except Exception as exc:
                    failure = self._failure(
                        exc, i, "sync", global_step, epoch, batches.indices(step)
                    )
                    return LocalResult([0.0] * len(result.sums), failure)
            return result

        return run

    def _gather(
        self, tasks: Sequence[Callable[[], T]], step: int | None, epoch: int
    ) -> list[T | BaseException]:
        """Run task ``i`` in device ``i``'s thread; wait for all of them while they make
        progress. Raises FailedHere (kind ``hang``) when a thread still busy has made no
        progress (entered no phase) for ``hang_timeout``."""
        started = time.monotonic()
        self.progress = [started] * len(tasks)
        futures = [worker.submit(task) for worker, task in zip(self.threads, tasks, strict=True)]
        while True:
            busy = [i for i, f in enumerate(futures) if not f.done()]
            if not busy:
                break
            now = time.monotonic()
            hung = [i for i in busy if now - self.progress[i] >= self.timeout]
            if hung:
                raise FailedHere(self._hang(hung, step, epoch, now))
            # Until all are done, or until the first busy one would be hung if it made no
            # progress meanwhile (then looked at again).
            deadline = min(self.progress[i] for i in busy) + self.timeout
            wait([futures[i] for i in busy], timeout=max(0.0, deadline - now) + 0.01)
        out: list[T | BaseException] = []
        for f in futures:
            exc = f.exception()
            out.append(exc if exc is not None else f.result())
        return out

    def _hang(self, hung: list[int], step: int | None, epoch: int, now: float) -> WorkerFailure:
        i = hung[0]
        message = (
            f"its thread made no progress for {now - self.progress[i]:.1f}s in phase "
            f"{self.phases[i]} (hang_timeout={self.timeout:g}s); the thread was abandoned"
        )
        if len(hung) > 1:
            message += f" (also hung: {', '.join(self.labels[j] for j in hung[1:])})"
        who = self.identities[i]
        return WorkerFailure(
            worker=who.worker,
            rank=who.rank,
            device=who.device,
            kind="hang",
            message=message,
            phase=self.phases[i],
            step=step,
            epoch=epoch,
            pid=os.getpid(),
            stacks=self.threads[i].stack(),
        )

    def _failure(
        self,
        exc: BaseException,
        i: int,
        phase: str,
        step: int | None,
        epoch: int,
        samples: list[int] | None,
    ) -> WorkerFailure:
        return failure_of(exc, self.identities[i], phase, step, epoch, samples)

    @torch.no_grad()
    def _reduce_grads(self) -> None:
        """Add every other replica's gradients into the main replica's (on its device)."""
        main = list(self.main.model.parameters())
        for other in self.trainables[1:]:
            for p, q in zip(main, other.model.parameters(), strict=True):
                if q.grad is None:
                    continue
                g = q.grad.to(p.device)
                if p.grad is None:
                    p.grad = g.clone() if g is q.grad else g
                else:
                    p.grad.add_(g)

    def commit(self, skip: bool = False) -> None:
        guarded_commit(self.main, self.faults[0], self.identities[0], self.step, self.epoch, skip)
        for i in range(1, len(self.trainables)):
            try:
                self.faults[i].check(self.step, "optimizer")
            except Exception as exc:
                raise FailedHere(
                    self._failure(exc, i, "optimizer", self.step, self.epoch, None)
                ) from exc
        self._broadcast()

    @torch.no_grad()
    def _broadcast(self) -> None:
        """Copy the main replica's parameters and buffers to every other replica; clear their
        gradients."""
        source = self.main.model
        for other in self.trainables[1:]:
            for p, q in zip(source.parameters(), other.model.parameters(), strict=True):
                q.copy_(p)
                q.grad = None
            for b, c in zip(source.buffers(), other.model.buffers(), strict=True):
                c.copy_(b)

    def end_epoch(self) -> None:
        self.main.end_epoch()

    def discard(self) -> None:
        self.main.discard()
        for t in self.trainables:
            for p in t.model.parameters():
                p.grad = None

    # -- validation ---------------------------------------------------------------------
    def evaluate(self) -> torch.Tensor:
        n = len(self.replicas)
        self.phases = ["validation"] * n

        def part(i: int) -> Callable[[], torch.Tensor]:
            return lambda: evaluate_local(
                self.replicas[i],
                self.valid,
                self.valid_size,
                self.config.batch_size,
                i,
                n,
                self.epoch,
                self.config.loading(),
            )

        results = self._gather([part(i) for i in range(n)], None, self.epoch)
        sums = torch.zeros(self.replicas[0].size, dtype=torch.float64)
        for i, outcome in enumerate(results):
            if isinstance(outcome, FailedHere):
                raise outcome
            if isinstance(outcome, BaseException):
                raise FailedHere(
                    self._failure(outcome, i, "validation", None, self.epoch, None)
                ) from outcome
            sums += outcome
        return sums

    # -- state ----------------------------------------------------------------------------
    def lr(self) -> float:
        return self.main.lr()

    def state_dict(self) -> dict[str, Any]:
        return self.main.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.main.load_state_dict(state)
        self._broadcast()

    def final_model(self) -> torch.nn.Module:
        return self.main.model.to("cpu")

    def close(self) -> None:
        """Stop the device threads without waiting (a hung one is abandoned)."""
        for worker in self.threads:
            worker.stop()


def _member_seed(seed: int, member: int) -> int:
    return int(np.random.SeedSequence([seed, member]).generate_state(1)[0])
