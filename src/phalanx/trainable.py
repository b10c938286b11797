"""One replica's trainable state: model, optimizer, scheduler, and the commit of a step."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from phalanx.precision import LossScaler, step_scheduler_quietly
from phalanx.replica import StepModule
from phalanx.spec import TrainSpec


class Trainable:
    """Builds the model on ``device`` (or takes ``model``; ``wrap``, given the step module,
    runs before the optimizer is built), the optimizer (see ``TrainSpec.build_optimizer``),
    the scheduler, and under ``"16-mixed"`` precision the loss scaler.

    ``commit()`` is the step's last phase: clip gradients, step the optimizer (unless the
    vote said skip: a gradient overflow under ``"16-mixed"``) and a per-step scheduler, clear
    gradients. ``end_epoch()`` steps a per-epoch scheduler. ``discard()`` clears gradients
    of a failed attempt.
    """

    def __init__(
        self,
        spec: TrainSpec,
        device: torch.device,
        seed: int,
        model: nn.Module | None = None,
        wrap: Callable[[StepModule], None] | None = None,
        empty: bool = False,
    ) -> None:
        """``empty``: ``model`` was built on the meta device, for a state loaded into it
        next (fsdp: see :meth:`phalanx.spec.TrainSpec.build_empty`)."""
        torch.manual_seed(seed)  # the same initial weights on every replica
        model = spec.build_model() if model is None else model
        self.model = model if empty else model.to(device)
        self.module = StepModule(
            self.model, spec.step, functools.partial(spec.precision.autocast, device)
        )
        if wrap is not None:  # (fsdp: shards the model before the optimizer sees it)
            wrap(self.module)
        if empty:  # (fsdp: each member's shards only, NaN until a state is loaded into them)
            self.model.to_empty(device=device)
            with torch.no_grad():
                for tensor in [*self.model.parameters(), *self.model.buffers()]:
                    if tensor.is_floating_point():
                        tensor.fill_(float("nan"))
        self.optimizer = spec.build_optimizer(self.model)
        self.scheduler = spec.lr_scheduler(self.optimizer) if spec.lr_scheduler else None
        self.scheduler_per_epoch = spec.lr_scheduler_interval == "epoch"
        self.scaler: LossScaler | None = spec.precision.scaler(device, self.optimizer)
        self.module.scaler = self.scaler
        self.clip = spec.grad_clip_norm
        self.micro_batches = spec.grad_accumulation
        self.model.train()

    def share_scaler(self, main: Trainable) -> None:
        """Scale losses with ``main``'s scaler (threads: only the main replica steps)."""
        self.scaler = self.module.scaler = main.scaler

    def overflowed(self) -> bool:
        """After the synchronised backward: unscale the gradients (16-mixed); True when one
        is not finite. This member's part of the vote; always False without a scaler."""
        return self.scaler.unscale() if self.scaler is not None else False

    def commit(self, skip: bool = False) -> None:
        if not skip and self.clip is not None:
            self.clip_gradients(self.clip)
        if self.scaler is None:
            self.optimizer.step()
        elif skip:
            self.scaler.skip()
        else:
            self.scaler.step()
        if self.scheduler is not None and not self.scheduler_per_epoch:
            step_scheduler_quietly(self.scheduler, optimizer_stepped=not skip)
        self.optimizer.zero_grad(set_to_none=True)

    def clip_gradients(self, clip: float) -> None:
        """Scale the gradients so that their global norm is at most ``clip``."""
        if self.scaler is not None:
            self.scaler.ensure_unscaled()  # (the vote's check has unscaled them)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)

    def end_epoch(self) -> None:
        if self.scheduler is not None and self.scheduler_per_epoch:
            self.scheduler.step()

    def discard(self) -> None:
        if self.scaler is not None:
            self.scaler.reset()
        self.optimizer.zero_grad(set_to_none=True)

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler else None,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None and state.get("scaler") is not None:
            self.scaler.load_state_dict(state["scaler"])
