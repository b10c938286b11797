"""Errors a user of phalanx can see.

Every error carries a stable code (``PX`` + three digits). ``phalanx explain CODE`` prints
what it means, when it happens, common causes and fixes (see :mod:`phalanx.catalog`).

- :class:`ConfigError` and its subclasses: something is wrong before training starts.
  Raised in the caller's process, before any worker process or thread is started.
- :class:`TrainingFailed`: a worker failed during training and the run stopped.
  Its first line names the root cause (worker, device, step, phase, original message).
- :class:`CheckpointError`: a checkpoint that cannot be used (written for another plan,
  resume=True without run_dir) or saved; :class:`CheckpointMismatchError`: the checkpoint
  does not fit this run's model or optimizer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from phalanx.failures import WorkerFailure


class PhalanxError(Exception):
    """Base of all phalanx errors. ``code`` is stable across releases."""

    code = "PX000"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return f"[{self.code}] {self.message}\n(see: phalanx explain {self.code})"


class ConfigError(PhalanxError, ValueError):
    """Something in the configuration is wrong; nothing has started yet."""

    code = "PX100"


class EmptyDatasetError(ConfigError):
    code = "PX101"


class BatchSizeError(ConfigError):
    code = "PX102"


class UnknownStrategyError(ConfigError):
    code = "PX103"


class DeviceSpecError(ConfigError):
    code = "PX104"


class EpochTooShortError(ConfigError):
    code = "PX105"


class LossNotScalarError(ConfigError):
    code = "PX106"


class NonFiniteLossError(ConfigError):
    """A loss was NaN or infinite. Raised inside a step; reported as that step's failure."""

    code = "PX107"


class TooManyBadSamples(PhalanxError):
    """More samples failed alone than ``fit(max_bad_samples=)`` allows under
    ``on_bad_sample="skip"``: the data is broken wholesale (a wrong path, a wrong decoder),
    not a few samples."""

    code = "PX207"


class WorkerAtFault(PhalanxError):
    """A member's part of a step failed on it in two attempts and passed on another member:
    the worker is at fault, not the data (``on_bad_sample="skip"``). Under ddp it is put out
    like a fallen worker; in one process (threads) the run stops naming it."""

    code = "PX208"


class WorkerTooSlow(PhalanxError):
    """A member's time per sample stayed above ``fit(slow_worker=F)`` times the median of
    its peers': it is put out like a failed worker (respawned or shrunk, as ``on_failure``
    says)."""

    code = "PX209"


class NonFiniteSampleLoss(NonFiniteLossError):
    """A loss was NaN or infinite under ``fit(on_bad_sample="skip")``: a failure of the
    step's samples like an exception (retried, then the samples found and left out), not a
    broken step contract."""


class InvalidSettingError(ConfigError):
    code = "PX108"


class StepOutputError(ConfigError):
    code = "PX109"


class NoDevicesError(ConfigError):
    code = "PX110"


class DuplicateDeviceError(ConfigError):
    code = "PX111"


class DeviceUnavailableError(ConfigError):
    code = "PX112"


class BatchSmallerThanWorkersError(ConfigError):
    code = "PX113"


class NotPicklableError(ConfigError):
    code = "PX114"


class LambdaStepError(ConfigError):
    code = "PX115"


class MissingMainGuardError(ConfigError):
    code = "PX116"


class DeviceBusyError(ConfigError):
    code = "PX117"


class RunDirInUseError(ConfigError):
    """A fresh run (``resume=False``) in a ``run_dir`` that holds an earlier run's
    checkpoints: refused, so that neither run's checkpoints are mixed up or deleted."""

    code = "PX118"


class CheckpointError(PhalanxError):
    code = "PX120"
    # A write that failed in the background: the global step of the checkpoint that could
    # not be written (the failure is named at that step, not at the later one that found it).
    step: int | None = None


class CheckpointMismatchError(CheckpointError):
    """Resume found a valid checkpoint whose model or optimizer state does not fit this run's
    model or optimizer; nothing was trained and the checkpoint is left as it was."""

    code = "PX122"


class CheckpointFormatError(CheckpointError):
    """A checkpoint file of the first format (a ``PHALANX-CKPT-1`` header before torch's
    bytes; never released), which this version does not read. Nothing is changed on disk."""

    code = "PX126"


class MetricError(PhalanxError):
    """A metric's ``state`` or ``compute`` raised; the message names the metric."""

    code = "PX121"


class TrainingFailed(PhalanxError):
    """The run stopped because a worker failed.

    ``root_cause`` is the first failure (never a survivor's secondary error such as
    ``Connection reset by peer``); ``failures`` holds every failure seen, in order.
    The code depends on the root cause's kind: PX200 exception, PX201 crash,
    PX202 hang, PX203 out of memory, PX204 poison batch, PX205 preflight, PX206 a step that
    keeps failing (every attempt failed, each differently).
    """

    code = "PX200"

    def __init__(
        self,
        message: str,
        root_cause: WorkerFailure,
        failures: list[WorkerFailure],
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.root_cause = root_cause
        self.failures = failures
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        return f"{self.message}\n(see: phalanx explain {self.code})"

    def __reduce__(self) -> tuple[type, tuple[str, WorkerFailure, list[WorkerFailure], str]]:
        return (type(self), (self.message, self.root_cause, self.failures, self.code))


class InvalidStepError(TrainingFailed, ConfigError):
    """The run stopped because the step function broke its contract: it returned a loss that
    is not one number (PX106), a loss that is NaN or infinite (PX107, with the step and the
    samples), or neither a tensor nor a ``StepOutput`` (PX109). The fix is in the user's code,
    so it is a :class:`ConfigError` too (``except px.ConfigError`` catches it), and it stops
    at the first attempt: a retry would compute the same. ``code`` is the inner error's."""


class TorchDistributedCallError(ConfigError):
    """User code called torch.distributed's default process group (``dist.get_rank()``,
    ``get_world_size()``, ``barrier()``), which phalanx never creates. Recorded as the
    failure of the step (or preflight) that called it; the run stops at once, since a retry
    would call it again. The fix: ``px.rank()``, ``px.world_size()``, ``px.is_main()``."""

    code = "PX124"


class ArgumentTypeError(ConfigError):
    """An argument of ``Learner`` or ``fit`` has the wrong type (``grad_clip_norm="1.0"``, a
    float ``epochs``): named, with the type expected, before anything starts."""

    code = "PX125"


class DatasetNotPicklableError(NotPicklableError):
    """Under ``strategy="ddp"`` the training or validation dataset cannot be pickled, so it
    cannot be sent to the worker processes. Raised before any process starts."""

    code = "PX119"


class MixedDeviceTypesError(ConfigError):
    """A ddp device list mixes CUDA and non-CUDA devices: the workers would pick different
    process-group backends (NCCL and gloo) and could never form one group."""

    code = "PX123"


class DataLoaderAsDatasetError(ConfigError):
    """A ``torch.utils.data.DataLoader`` was passed where fit() takes a dataset: phalanx builds
    its own loaders from the plan, so it needs the dataset and the batch size."""

    code = "PX127"


class UnsizedDatasetError(ConfigError):
    """A dataset without ``__len__`` and ``__getitem__`` (an ``IterableDataset``, a stream, a
    generator): without a length and random access there is no exactly-once plan."""

    code = "PX128"


class StreamError(ConfigError):
    """A ``px.Stream`` that cannot be planned: no shards, a ``read`` that is not a function,
    ``lengths`` that do not match the shards, a bad ``lanes`` or ``shuffle_buffer``."""

    code = "PX160"


class StreamReadError(PhalanxError):
    """A shard of a stream failed to open or read, again after retries: named with the
    shard and the sample where it failed. Raised in a worker: reported as its step's
    failure (the same samples failing again stop the run as a poison batch)."""

    code = "PX161"

    def __init__(self, message: str, shard: int | None = None, offset: int | None = None) -> None:
        super().__init__(message)
        self.shard, self.offset = shard, offset

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.message, self.shard, self.offset))


class StreamChangedError(PhalanxError):
    """A shard of a stream is gone, or holds more or fewer samples than when the run
    planned its epochs (at its start, or in the checkpoint it resumed): the plan no longer
    describes the data, so the run stops rather than use other samples."""

    code = "PX162"


class PrecisionError(ConfigError):
    """``precision=`` is not one of "32", "bf16-mixed", "16-mixed", the device cannot run it
    (bf16 on a GPU without bf16 support), or ``grad_scaler=`` is given without "16-mixed" or
    names an argument ``torch.amp.GradScaler`` does not take."""

    code = "PX130"


class OptimizerInstanceError(ConfigError):
    """An optimizer (or scheduler) object was passed where phalanx needs a factory: each
    replica builds its own optimizer over its own model's parameters."""

    code = "PX131"


class LaunchEnvironmentError(ConfigError):
    """A launcher's environment variable cannot be read (``PHALANX_*``, torchrun's, Slurm's):
    not a whole number, a node rank not below the node count, a head without a port, a node
    list that does not expand. See :mod:`phalanx.launch`."""

    code = "PX140"


class ProcessesPerNodeError(ConfigError):
    """The launcher started several processes on this node (``torchrun --nproc-per-node 2``,
    ``srun --ntasks-per-node 2``): each would train a full copy of the job. phalanx starts
    one worker per device itself, so it needs one process per node."""

    code = "PX141"


class MultiNodeUnavailableError(ConfigError):
    """The launch names several nodes, with a strategy that trains on one node only."""

    code = "PX142"


class RunDirLockedError(ConfigError):
    """Another live run holds this ``run_dir`` (its lock file ``phalanx.lock``); nothing in
    the folder was moved or written."""

    code = "PX143"


class NodesDisagreeError(ConfigError):
    """The nodes of a run disagree on what they train (versions, plan and data, settings),
    or not every node joined the head in time."""

    code = "PX144"


class InterfaceError(ConfigError):
    """Across machines, this node's collectives would bind to loopback (its host name
    resolves to 127.x or not at all, and no ``GLOO_SOCKET_IFNAME`` names an interface)."""

    code = "PX146"


class NodeFencedError(PhalanxError):
    """This node was cut off (frozen, partitioned) long enough for the head to go on
    without it; on waking it stopped its workers, which committed nothing."""

    code = "PX145"


class HeadLostError(PhalanxError):
    """Across machines, the head (node 0) was lost: this node's workers kept what the run
    had committed in an emergency checkpoint (see :class:`HeadLost`)."""

    code = "PX147"


EXIT_HEAD_LOST = 75  # EX_TEMPFAIL: the job may be run again (resume=True) and go on


class HeadLost(SystemExit):
    """How ``fit`` ends on a node whose head was lost: a ``SystemExit`` with status 75
    (``EX_TEMPFAIL``) unless caught, so ``torchrun --max-restarts`` or a Slurm requeue runs
    the same command again, which goes on from the newest checkpoint with ``resume=True``.
    ``error`` is the :class:`HeadLostError` (its message says what was saved and where; the
    node's sinks printed it), ``step`` and ``checkpoint`` the newest step kept and its file
    (None when nothing could be saved)."""

    def __init__(self, error: HeadLostError, step: int | None, checkpoint: str | None) -> None:
        super().__init__(EXIT_HEAD_LOST)
        self.error, self.step, self.checkpoint = error, step, checkpoint

    def __str__(self) -> str:
        return str(self.error)


class NoTokenError(ConfigError):
    """A run over several nodes has no token every node holds (PHALANX_TOKEN, or the
    head's ``run_dir/token``), or the token file can be read by others."""

    code = "PX151"


def all_error_classes() -> list[type[PhalanxError]]:
    """Every error class defined here, base first (used by the catalog's consistency test)."""
    found: list[type[PhalanxError]] = []
    pending: list[type[PhalanxError]] = [PhalanxError]
    while pending:
        cls = pending.pop(0)
        if cls not in found:  # (InvalidStepError has two bases here)
            found.append(cls)
            pending.extend(cls.__subclasses__())
    return found
