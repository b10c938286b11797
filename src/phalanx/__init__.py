"""phalanx: data-parallel PyTorch training that names every failure and keeps going."""

from phalanx import faults, metrics
from phalanx.checkpoint import Checkpoints, export_dcp, load_checkpoint
from phalanx.early_stopping import EarlyStopping
from phalanx.errors import (
    ConfigError,
    HeadLost,
    InvalidStepError,
    PhalanxError,
    TrainingFailed,
)
from phalanx.failures import WorkerFailure
from phalanx.faults import Fault
from phalanx.interrupt import FitPreempted, FitTerminated
from phalanx.learner import FitResult, Learner
from phalanx.policy import Recovery
from phalanx.ranks import is_main, rank, world_size
from phalanx.runinfo import start_over
from phalanx.snapshot import Snapshots
from phalanx.step import StepOutput, cross_entropy_step, mse_step
from phalanx.stream import Stream
from phalanx.version import __version__

__all__ = [
    "Checkpoints",
    "ConfigError",
    "EarlyStopping",
    "Fault",
    "FitPreempted",
    "FitResult",
    "FitTerminated",
    "HeadLost",
    "InvalidStepError",
    "Learner",
    "PhalanxError",
    "Recovery",
    "Snapshots",
    "StepOutput",
    "Stream",
    "TrainingFailed",
    "WorkerFailure",
    "__version__",
    "cross_entropy_step",
    "export_dcp",
    "faults",
    "is_main",
    "load_checkpoint",
    "metrics",
    "mse_step",
    "rank",
    "start_over",
    "world_size",
]
