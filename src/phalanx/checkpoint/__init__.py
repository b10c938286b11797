"""Checkpoints: settings (:class:`Checkpoints`), pure policy (:func:`should_save`,
:func:`retention`), verified atomic file I/O (:func:`write_atomic`, :func:`read_verified`) and
the background :class:`Checkpointer` that ties them together; :func:`load_checkpoint` and
:func:`export_dcp` (a DCP folder of the model) for users."""

from phalanx.checkpoint.checkpointer import Checkpointer, load_checkpoint
from phalanx.checkpoint.config import Checkpoints
from phalanx.checkpoint.dcp import export_dcp
from phalanx.checkpoint.io import read_verified, write_atomic
from phalanx.checkpoint.policy import CheckpointInfo, retention, should_save

__all__ = [
    "CheckpointInfo",
    "Checkpointer",
    "Checkpoints",
    "export_dcp",
    "load_checkpoint",
    "read_verified",
    "retention",
    "should_save",
    "write_atomic",
]
