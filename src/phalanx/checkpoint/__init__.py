"""Checkpoints: settings (:class:`Checkpoints`), pure policy (:func:`should_save`,
:func:`retention`), verified atomic file I/O (:func:`write_atomic`, :func:`read_verified`) and
the background :class:`Checkpointer` that ties them together; :func:`load_checkpoint` for
users."""

from phalanx.checkpoint.checkpointer import Checkpointer, load_checkpoint
from phalanx.checkpoint.config import Checkpoints
from phalanx.checkpoint.io import read_verified, write_atomic
from phalanx.checkpoint.policy import CheckpointInfo, retention, should_save

__all__ = [
    "CheckpointInfo",
    "Checkpointer",
    "Checkpoints",
    "load_checkpoint",
    "read_verified",
    "retention",
    "should_save",
    "write_atomic",
]
