"""One replica's trainable state: model, optimizer, scheduler, and the commit of a step."""

from __future__ import annotations

from typing import Any

import torch

from phalanx.replica import StepModule
from phalanx.spec import TrainSpec


class Trainable:
    """Builds the model on ``device`` and the optimizer and scheduler over its parameters.

    ``commit()`` is the step's last phase: clip gradients, step the optimizer and the
    scheduler, clear gradients. ``discard()`` clears gradients of a failed attempt.
    """

    def __init__(self, spec: TrainSpec, device: torch.device, seed: int) -> None:
        torch.manual_seed(seed)  # the same initial weights on every replica
        self.model = spec.build_model().to(device)
        self.module = StepModule(self.model, spec.step)
        self.optimizer = spec.optimizer(self.model.parameters())
        self.scheduler = spec.lr_scheduler(self.optimizer) if spec.lr_scheduler else None
        self.clip = spec.grad_clip_norm
        self.micro_batches = spec.grad_accumulation
        self.model.train()

    def commit(self) -> None:
        if self.clip is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def discard(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
