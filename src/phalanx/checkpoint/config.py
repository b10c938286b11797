"""What to checkpoint and what to keep: the user-facing settings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from phalanx.errors import InvalidSettingError


@dataclass
class Checkpoints:
    """Checkpoint settings.

    - ``every_steps``: save every N committed optimizer steps (global step count); None: never
      by steps.
    - ``every_epoch``: save at epoch ends, after validation (so the epoch's metrics are
      known); False: never at epoch ends.
    - ``every_epochs``: with ``every_epoch``, save at the end of every N-th epoch only
      (epochs N, 2N, ... counted from 1); None is every epoch.
    - ``keep_last``: how many of the newest checkpoints (by step) to keep.
    - ``keep_best``: a history key such as ``"valid/loss"``; the best checkpoint by that metric
      is kept as well, even when it is older than the newest ``keep_last``.
    - ``best_mode``: ``"min"`` or ``"max"``; None infers it from ``keep_best`` (see
      :meth:`mode`).

    Invalid values raise :class:`~phalanx.errors.InvalidSettingError` on construction.
    """

    every_steps: int | None = None
    every_epoch: bool = True
    every_epochs: int | None = None
    keep_last: int = 2
    keep_best: str | None = None
    best_mode: Literal["min", "max"] | None = None

    def __post_init__(self) -> None:
        if self.every_steps is not None and (not _is_int(self.every_steps) or self.every_steps < 1):
            raise InvalidSettingError(
                f"Checkpoints(every_steps={self.every_steps!r}): use a whole number >= 1, "
                "or None to save only at epoch ends."
            )
        if self.every_epochs is not None and (
            not _is_int(self.every_epochs) or self.every_epochs < 1
        ):
            raise InvalidSettingError(
                f"Checkpoints(every_epochs={self.every_epochs!r}): use a whole number >= 1, "
                "or None to save at every epoch end."
            )
        if self.every_epochs is not None and not self.every_epoch:
            raise InvalidSettingError(
                f"Checkpoints(every_epoch=False, every_epochs={self.every_epochs}) contradict "
                "each other: drop every_epoch=False to save every N epochs, or drop "
                "every_epochs to never save at epoch ends."
            )
        if not _is_int(self.keep_last) or self.keep_last < 1:
            raise InvalidSettingError(
                f"Checkpoints(keep_last={self.keep_last!r}): use a whole number >= 1 "
                "(the newest checkpoint is always kept so training can resume)."
            )
        if self.keep_best is not None and (
            not isinstance(self.keep_best, str) or not self.keep_best
        ):
            raise InvalidSettingError(
                f"Checkpoints(keep_best={self.keep_best!r}): use a history key such as "
                "'valid/loss', or None."
            )
        if self.best_mode not in (None, "min", "max"):
            raise InvalidSettingError(
                f"Checkpoints(best_mode={self.best_mode!r}): use 'min', 'max', or None to "
                "infer it from the key's name."
            )
        if self.best_mode is not None and self.keep_best is None:
            raise InvalidSettingError(
                f"Checkpoints(best_mode={self.best_mode!r}) needs keep_best: set keep_best to "
                "a history key such as 'valid/loss', or drop best_mode."
            )

    def mode(self) -> str:
        """``best_mode`` if set; else ``"min"`` when the ``keep_best`` key's name contains
        "loss" or "error" (case-insensitive), else ``"max"``."""
        if self.best_mode is not None:
            return self.best_mode
        name = (self.keep_best or "").lower()
        return "min" if ("loss" in name or "error" in name) else "max"


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
