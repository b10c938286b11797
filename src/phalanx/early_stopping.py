"""Early stopping on an epoch metric: patience, minimum improvement, warm-up epochs."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from phalanx.errors import InvalidSettingError


@dataclass
class EarlyStopping:
    """Stop when ``metric`` (a history key such as ``valid/loss``) has not improved by more
    than ``min_delta`` for ``patience`` epochs. Epochs before ``warmup`` are not judged.
    ``mode`` None infers "min" for keys containing "loss" or "error", else "max"."""

    metric: str = "valid/loss"
    patience: int = 3
    min_delta: float = 0.0
    warmup: int = 0
    mode: Literal["min", "max"] | None = None
    best: float | None = field(default=None, init=False)
    bad_epochs: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        wrong = [
            f"{name}={value!r}"
            for name, value, ok in (
                ("patience", self.patience, self.patience >= 1),
                ("min_delta", self.min_delta, self.min_delta >= 0),
                ("warmup", self.warmup, self.warmup >= 0),
            )
            if not ok
        ]
        if wrong:
            raise InvalidSettingError(
                f"EarlyStopping({', '.join(wrong)}): it needs patience >= 1, min_delta >= 0 "
                "and warmup >= 0"
            )

    def direction(self) -> str:
        if self.mode is not None:
            return self.mode
        name = self.metric.lower()
        return "min" if ("loss" in name or "error" in name) else "max"

    def update(self, epoch: int, metrics: dict[str, float]) -> str | None:
        """Judge one epoch; return the reason to stop, or None to go on."""
        if self.metric not in metrics:
            known = ", ".join(sorted(metrics))
            raise InvalidSettingError(
                f"EarlyStopping metric {self.metric!r} is not in the epoch results ({known}); "
                "pass one of those (add valid= to fit() for valid/ metrics)"
            )
        value = metrics[self.metric]
        if epoch < self.warmup or math.isnan(value):
            return None
        sign = 1.0 if self.direction() == "min" else -1.0
        if self.best is None or sign * (self.best - value) > self.min_delta:
            self.best, self.bad_epochs = value, 0
            return None
        self.bad_epochs += 1
        if self.bad_epochs >= self.patience:
            return (
                f"early stopping: {self.metric} did not improve for {self.patience} epochs "
                f"(best {self.best:.6g})"
            )
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "bad_epochs": self.bad_epochs}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best = state["best"]
        self.bad_epochs = state["bad_epochs"]
