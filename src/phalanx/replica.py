"""One replica: the model on one device, and the local part of a step.

:class:`StepModule` wraps the user's model so that one ``forward`` is the user's whole step
function: under DDP, a worker whose step raised can still take part in the gradient
collective with a *zero pass* (a forward that returns ``0 * sum(params)``), so the other
ranks never wait for a gradient that will not come.

:meth:`Replica.run` computes the local slice of a global batch, in micro-batches when
``micro_batches > 1`` (gradient accumulation inside the step: same math, less memory),
scaling each micro-batch's loss by ``samples * world / global_samples`` so that the
all-reduced (averaged) gradient is exactly the mean over the global batch.
Failures are returned as values, never raised.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from phalanx.badsamples import find_bad
from phalanx.errors import NonFiniteLossError, NonFiniteSampleLoss
from phalanx.failures import WorkerFailure, from_exception
from phalanx.faults import FaultInjector
from phalanx.ledger import EMPTY, Fingerprint, fingerprint
from phalanx.metrics import Metric, pack_states, state_values, total_size
from phalanx.plan import bounds
from phalanx.precision import LossScaler
from phalanx.ranks import acting_as
from phalanx.report import is_secondary
from phalanx.step import StepOutput, as_step_output

if TYPE_CHECKING:
    from phalanx.data import LocalBatches

StepFn = Callable[[nn.Module, Any], Any]
# A ddp member's vote as the synchronised backward carries it: a leaf tensor and the
# gradient it receives (strategies/ddp/worker/ballot.py); None when a hook of the model's
# delivers it (fsdp's box carried by a unit).
Cast = tuple[torch.Tensor, torch.Tensor] | None


def backward(loss: torch.Tensor, ballot: Cast | None = None) -> None:
    """``loss.backward()``; with a ``ballot``, its leaf is a second root of the same
    backward, given the ballot's gradient as is (no scaling touches it)."""
    if ballot is None:
        loss.backward()
    else:
        torch.autograd.backward([loss, ballot[0]], [None, ballot[1]])


class ZeroPass:
    """Marker batch: the forward returns a zero loss connected to every parameter."""


ZERO_PASS = ZeroPass()


class StepModule(nn.Module):
    """``forward(batch)`` runs ``step(model, batch)`` and returns (loss, outputs, targets).

    ``autocast`` gives the context the step runs in (mixed precision; a null context by
    default); ``scaler`` (``"16-mixed"``) scales each loss before its backward."""

    def __init__(
        self,
        model: nn.Module,
        step: StepFn,
        autocast: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    ) -> None:
        super().__init__()
        self.model = model
        self.step = step
        self.autocast = autocast
        self.scaler: LossScaler | None = None

    def backward(self, loss: torch.Tensor, ballot: Cast | None = None) -> None:
        """``loss``'s backward (scaled under "16-mixed"; ``ballot``: see :func:`backward`)."""
        backward(self.scaler.scale(loss) if self.scaler is not None else loss, ballot)

    def forward(self, batch: Any) -> tuple[torch.Tensor, Any, Any]:
        if isinstance(batch, ZeroPass):
            params = [p for p in self.model.parameters() if p.requires_grad]
            zero = torch.stack([p.sum() for p in params]).sum() * 0.0
            return zero, None, None
        with self.autocast():
            out = as_step_output(self.step(self.model, batch))
        return out.loss, out.outputs, out.targets


def to_device(batch: Any, device: torch.device) -> Any:
    """Move tensors nested in tuples (named tuples too), lists and dicts to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch if batch.device == device else batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, tuple | list):
        return _rebuild(batch, [to_device(v, device) for v in batch])
    return batch


def slice_batch(batch: Any, start: int, end: int) -> Any:
    """Rows ``start:end`` of a collated batch (tensors and lists sliced on their first axis).

    A list of tensors, lists, dicts or named tuples is a structure (``default_collate``
    turns a sample's tuple into a list); any other list holds one entry per row."""
    if isinstance(batch, torch.Tensor) or (
        isinstance(batch, list)
        and batch
        and not isinstance(batch[0], torch.Tensor | list | dict)
        and not _is_namedtuple(batch[0])
    ):
        return batch[start:end]
    if isinstance(batch, dict):
        return {k: slice_batch(v, start, end) for k, v in batch.items()}
    if isinstance(batch, tuple | list):
        return _rebuild(batch, [slice_batch(v, start, end) for v in batch])
    return batch


def _is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(value, "_fields")


def _rebuild(batch: tuple[Any, ...] | list[Any], values: list[Any]) -> Any:
    """A tuple or list of the same type as ``batch`` holding ``values`` (a named tuple's
    constructor takes its fields as arguments, other sequences one iterable)."""
    if _is_namedtuple(batch):
        return type(batch)(*values)
    return type(batch)(values)


@dataclass
class Identity:
    """Who this replica is, for failure reports."""

    worker: int
    rank: int
    device: str


@dataclass
class LocalResult:
    sums: list[float]  # packed metric states (loss first), float64
    failure: WorkerFailure | None = None
    splittable: bool = False  # out of memory, and the share can be cut smaller: try again
    ledger: Fingerprint = EMPTY  # of the samples computed
    # Seconds per sample of this member's own work in the step, up to its vote (before the
    # synchronised backward: no wait for a peer counts); 0 when unknown (phalanx.balance).
    pace: float = 0.0
    # Samples of this member's part found bad by bisection (phalanx.badsamples) and their
    # errors (the local failure carries them); empty unless the attempt bisects.
    bad: dict[int, str] = field(default_factory=dict)
    # The failure is a collective that a fallen peer broke: no other collective may follow
    # on that group (a live peer may still wait in the broken one, and a message of another
    # size there aborts its process), so the ddp engine leaves without voting.
    broken: bool = False
    # The failure came after this member's vote had left saying "ok" (in or after the
    # synchronised backward): no zero pass can mend it and no vote carries it, so the ddp
    # engine leaves the group (its peers' backward then fails: nobody commits the step).
    after_vote: bool = False

    def vote_head(self) -> list[float]:
        """This member's part of the vote beside the metric sums."""
        return [float(self.failure is not None), float(self.splittable), *self.ledger]


class VoteLaunch(Protocol):
    """What a ddp member does right before its synchronised backward (the real one or the
    zero pass): ``check`` (phase ``sync``: an injected fault there fails the attempt, before
    any vote left) and ``launch`` its vote on ``result``: a second root for the backward,
    whose gradient carries the vote through the backward's own all-reduce (the engine
    counts it after the backward)."""

    def check(self) -> None: ...

    def launch(self, result: LocalResult) -> Cast: ...


class Replica:
    """The model of one worker, its step function, its metrics and its fault injector.

    ``forward`` is what runs a step: the :class:`StepModule` itself, or the DDP module
    wrapping it. ``no_sync`` is DDP's ``no_sync`` (a null context without DDP).
    """

    def __init__(
        self,
        module: StepModule,
        device: torch.device,
        identity: Identity,
        metrics: list[Metric],
        faults: FaultInjector,
        forward: nn.Module | None = None,
        world: int = 1,
        on_phase: Callable[[int, str], None] | None = None,
        members: int | None = None,
    ) -> None:
        self.module = module
        self.device = device
        self.identity = identity
        self.metrics = metrics
        self.faults = faults
        self.forward = forward if forward is not None else module
        self.world = world
        # How many members share each step, as px.world_size() tells user code (the threads
        # strategy sums its replicas' gradients itself: its world above stays 1).
        self.members = world if members is None else members
        self.size = total_size(metrics)
        self.on_phase = on_phase
        self.step = 0  # the step last run (named by validation heartbeats)
        # Raised after an out-of-memory error: this replica cuts its share into this many
        # times more micro-batches from then on (the global batch and the math stay the same).
        self.split_factor = 1
        self._began = 0.0  # when the step in progress began (its pace counts from here)
        # fit(on_bad_sample="skip"): a non-finite loss is a failure of the step's samples
        self.nan_is_data = False
        # Set for one attempt that bisects (phalanx.badsamples): loads given samples,
        # collated; a failed part is then searched for the samples that fail alone.
        self.bisect: Callable[[list[int]], Any] | None = None
        # This attempt's failure until a vote has carried it (the engine clears it then). A
        # peer falling in the same step breaks the collective first; the ddp worker then
        # reports this failure itself instead of losing it.
        self.unvoted: WorkerFailure | None = None
        self.unvoted_splittable = False  # it was an out-of-memory error, and the share is
        # now cut smaller (split_factor doubled): trying again is a split, not a retry
        # fsdp: ``forward`` gathers and scatters shards in every pass, so every member runs
        # the same number of passes in each attempt (a member with fewer samples than
        # micro-batches pads with zero passes, and one split is never its own); a failure
        # after the first pass began breaks the group (no zero pass can line it up again)
        self.sharded = False

    def no_sync(self) -> contextlib.AbstractContextManager[Any]:
        ns = getattr(self.forward, "no_sync", None)
        return ns() if ns is not None else contextlib.nullcontext()

    def run(
        self,
        batch: Callable[[], Any] | None,
        samples: list[int],
        global_samples: int,
        step: int,
        epoch: int,
        micro_batches: int = 1,
        vote: VoteLaunch | None = None,
        ledger: Fingerprint | None = None,
    ) -> LocalResult:
        """Forward, metric states and backward over the local ``samples`` (``batch()``
        loads them, collated; ``ledger``: their fingerprint, if known).

        Every call performs exactly one synchronised backward (the last micro-batch, or a
        zero pass when the slice is empty or something raised before it), so DDP's
        collectives match across ranks whatever happens here. With ``vote`` (ddp), the
        member's vote is launched right before that backward, on what it knows then (so
        every metric state is computed before the backward it belongs to), and travels in
        that backward's gradient all-reduce: every member casts exactly one vote per call,
        and no collective of its own.
        """
        # (the fingerprint once: the vote carries the very result this call returns)
        ledger = fingerprint(samples) if ledger is None else ledger
        done = LocalResult([0.0] * self.size, ledger=ledger)
        self._began = time.perf_counter()
        self.step = step
        self.unvoted, self.unvoted_splittable = None, False
        tracker = _PhaseTracker(step, self.on_phase)
        try:
            with acting_as(self.identity.rank, self.members):  # (px.rank() in user code)
                with tracker.enter("data"):
                    self.faults.check(step, "data")
                    data = None
                    if batch is not None and samples:
                        data = to_device(batch(), self.device)
                if data is not None:
                    micro = min(len(samples), micro_batches * self.split_factor)
                    pad = micro_batches - micro if self.sharded else 0
                    self._micro_steps(
                        data, samples, global_samples, step, done, tracker, micro, vote, pad
                    )
        except (Exception, SystemExit) as exc:  # sys.exit() in a step fails that step
            failure = from_exception(
                exc,
                worker=self.identity.worker,
                rank=self.identity.rank,
                device=self.identity.device,
                phase=tracker.phase,
                step=step,
                epoch=epoch,
                sample_indices=list(samples),
                pid=os.getpid(),
            )
            splittable = self._split_after(failure, len(samples), micro_batches)
            if self.bisect is not None and failure.kind == "exception" and samples:
                done.bad = find_bad(samples, functools.partial(self._fails, self.bisect))
                failure.bad_samples = [[i, e] for i, e in sorted(done.bad.items())]
            self.unvoted, self.unvoted_splittable = failure, splittable
            # A broken collective (DDP's gradient all-reduce, or the bucket rebuild in its
            # second forward) is not followed by the zero pass's collectives.
            broken = self.forward is not self.module and is_secondary(failure)
            broken = broken or (self.sharded and tracker.phase not in ("", "data"))
            result = LocalResult([0.0] * self.size, failure, splittable, broken=broken)
            result.bad = done.bad
            if tracker.launched:  # the vote said "ok": only leaving the group can undo it
                result.after_vote = not broken
            elif not tracker.synced and not broken:
                self.zero_pass(result, vote, micro_batches if self.sharded else 1)
            return result
        if not tracker.synced:  # (nothing to compute: no samples)
            try:
                self.zero_pass(done, vote, micro_batches if self.sharded else 1)
            except (Exception, SystemExit) as exc:  # (fsdp's runs a template sample)
                if not self.sharded:
                    raise
                failure = from_exception(
                    exc, worker=self.identity.worker, rank=self.identity.rank,
                    device=self.identity.device, phase="forward", step=step, epoch=epoch,
                    pid=os.getpid(),
                )  # fmt: skip
                self.unvoted = failure
                return LocalResult([0.0] * self.size, failure, broken=True)
        elif vote is None and samples:  # (in-process: no peer to wait for in the backward)
            done.pace = (time.perf_counter() - self._began) / len(samples)
        return done

    def run_step(
        self,
        batches: LocalBatches,
        step: int,
        global_step: int,
        epoch: int,
        micro_batches: int = 1,
        vote: VoteLaunch | None = None,
    ) -> LocalResult:
        """:meth:`run` on this replica's slice of the epoch's ``step`` in ``batches``."""
        return self.run(
            batches.loader(step),
            batches.indices(step),
            batches.global_size(step),
            global_step,
            epoch,
            micro_batches,
            vote,
            batches.fingerprint(step),
        )

    def _split_after(self, failure: WorkerFailure, local: int, micro_batches: int) -> bool:
        """After an out-of-memory error, double the split if micro-batches can still shrink."""
        if failure.kind != "oom" or micro_batches * self.split_factor >= local or self.sharded:
            return False
        self.split_factor *= 2
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return True

    def _micro_steps(
        self,
        data: Any,
        samples: list[int],
        global_samples: int,
        step: int,
        result: LocalResult,
        tracker: _PhaseTracker,
        micro_batches: int,
        vote: VoteLaunch | None = None,
        pad: int = 0,
    ) -> None:
        """Forward, metric states (summed into ``result.sums``) and backward of each
        micro-batch; all but the last under ``no_sync``. Before the last backward, ``vote``
        (ddp) checks phase ``sync`` and launches this member's vote on ``result``
        (``tracker.launched``); ``tracker.synced`` is set as
        soon as the last backward has run, so nothing after it causes a second synchronised
        backward. ``pad`` zero passes go first, unsynchronised (fsdp: as many passes as the
        members with the most micro-batches)."""
        for _ in range(pad):
            with self.no_sync(), tracker.enter("forward"):
                loss, _, _ = self.forward(ZERO_PASS)
                backward(loss)
        pieces = bounds(len(samples), micro_batches)
        for j, (a, b) in enumerate(pieces):
            last = j == len(pieces) - 1
            whole = (a, b) == (0, len(samples))  # (one micro-batch: the batch as loaded)
            with self.no_sync() if not last else contextlib.nullcontext():
                with tracker.enter("forward"):
                    self.faults.check(step, "forward")
                    loss, outputs, targets = self.forward(
                        data if whole else slice_batch(data, a, b)
                    )
                    value = loss.item()
                    if not math.isfinite(value):
                        error = NonFiniteSampleLoss if self.nan_is_data else NonFiniteLossError
                        raise error(
                            f"the loss is {value} at step {step + 1} on samples "
                            f"{_short(samples[a:b])}; lower the learning rate, clip "
                            "gradients (grad_clip_norm=) or check these samples"
                        )
                with tracker.enter("metrics"):
                    self.faults.check(step, "metrics")
                    output = StepOutput(loss.detach(), outputs, targets)
                    states = state_values(self.metrics, output, b - a, loss=value)
                    result.sums = [x + y for x, y in zip(result.sums, states, strict=True)]
                ballot = None
                if last and vote is not None:
                    with tracker.enter("sync"):
                        vote.check()
                        result.pace = (time.perf_counter() - self._began) / len(samples)
                        ballot = vote.launch(result)
                        tracker.launched = True
                share = (b - a) * self.world / global_samples  # (1.0 for even shares)
                with tracker.enter("backward"), self.faults.inside_backward(step, self.module):
                    self.module.backward(loss if share == 1.0 else loss * share, ballot)
                    tracker.synced = last

    def _fails(self, load: Callable[[list[int]], Any], part: list[int]) -> str | None:
        """Whether ``part`` alone fails (read, forward, a finite loss): its error or None.
        No gradient, no collective; buffers (BatchNorm's statistics) and the random
        generators are as they were afterwards, so the training that follows is unchanged."""
        buffers = [b.detach().clone() for b in self.module.buffers()]
        cuda = [self.device.index or 0] if self.device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=cuda), torch.no_grad():
                loss, _, _ = self.module(to_device(load(part), self.device))
                value = loss.item()
            if not math.isfinite(value):
                return f"NonFiniteSampleLoss: the loss is {value}"
            return None
        except (Exception, SystemExit) as exc:  # (sys.exit() in the step fails the part)
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            return f"{type(exc).__name__}: {first}"
        finally:
            with torch.no_grad():
                for buf, saved in zip(self.module.buffers(), buffers, strict=True):
                    buf.copy_(saved)

    def zero_pass(
        self, result: LocalResult | None = None, vote: VoteLaunch | None = None, passes: int = 1
    ) -> None:
        """A backward of zero gradients through ``forward`` (keeps DDP's collectives
        matched); ``vote`` launches ``result`` as this member's vote right before it.
        ``passes``: that many, all but the last unsynchronised (fsdp's micro-batches)."""
        for _ in range(passes - 1):
            with self.no_sync():
                loss, _, _ = self.forward(ZERO_PASS)
                backward(loss)
        loss, _, _ = self.forward(ZERO_PASS)
        backward(loss, vote.launch(result) if vote is not None and result is not None else None)

    @torch.no_grad()
    def evaluate(self, batch: Any, samples: int) -> torch.Tensor:
        """Metric sums of one validation batch (no gradients, no collectives)."""
        if self.on_phase is not None:
            self.on_phase(self.step, "validation")  # a heartbeat: long validations are not hangs
        run = self.forward if self.sharded else self.module  # (fsdp: the root gathers shards)
        with acting_as(self.identity.rank, self.members):
            loss, outputs, targets = run(to_device(batch, self.device))
        return pack_states(self.metrics, StepOutput(loss, outputs, targets), samples)


def _short(items: list[int], limit: int = 16) -> str:
    text = ", ".join(str(i) for i in items[:limit])
    return f"[{text}{', ...' if len(items) > limit else ''}]"


class _PhaseTracker:
    """Remembers the phase a step is in, so a failure names it; tells ``on_phase`` (the
    ddp worker's heartbeat) each time the phase changes."""

    def __init__(self, step: int, on_phase: Callable[[int, str], None] | None) -> None:
        self.phase = ""
        self.synced = False  # the synchronised (last) backward of this attempt has run
        self.launched = False  # this member's vote has left (ddp), saying "ok"
        self.step = step
        self.on_phase = on_phase

    def enter(self, phase: str) -> _PhaseTracker:
        """``with tracker.enter(phase):`` around the code of ``phase`` (a plain context
        manager: nothing happens on leaving it, an exception goes through)."""
        if self.on_phase is not None and phase != self.phase:
            self.on_phase(self.step, phase)
        self.phase = phase
        return self

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
