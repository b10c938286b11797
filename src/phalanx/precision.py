"""Mixed precision: ``Learner(precision="32" | "bf16-mixed" | "16-mixed")`` (Lightning's names).

- ``"32"``: nothing changes.
- ``"bf16-mixed"``: the step function (forward and loss) runs under ``torch.autocast`` for the
  device's type with ``torch.bfloat16``; parameters, gradients and optimizer stay float32.
- ``"16-mixed"``: autocast with ``torch.float16`` and a :class:`LossScaler` (torch's
  ``torch.amp.GradScaler``): the loss is multiplied by the scale before backward, and the
  gradients are unscaled after it. A step whose gradients are not finite is *skipped*: the
  overflow travels in the step's vote, so every member skips together (the policy answers
  ``"skip"``), the scale backs off, and the step still counts (its samples are consumed, the
  ledger records it, a per-step scheduler steps) but the optimizer did not step.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

PRECISIONS = ("32", "bf16-mixed", "16-mixed")
# Other spellings taken as they are meant (Lightning 2's name for plain float32).
ALIASES = {"32-true": "32", "32": "32"}
# Names that mean something else elsewhere, refused with what each means (PX130).
MEANINGS = {
    "16": 'Lightning 1.x\'s name for "16-mixed": pass precision="16-mixed"',
    "fp16": 'float16 autocast with a loss scaler is precision="16-mixed"',
    "bf16": 'Lightning 1.x\'s name for "bf16-mixed": pass precision="bf16-mixed"',
    "16-true": "every weight in float16 (no float32 master copy): phalanx does not offer it; "
    'precision="16-mixed" keeps float32 weights',
    "bf16-true": "every weight in bfloat16: phalanx does not offer it; "
    'precision="bf16-mixed" keeps float32 weights',
    "64": "float64 training: phalanx does not offer it as a precision; build the model in "
    "float64 (model.double()) with precision='32'",
    "64-true": "float64 training: phalanx does not offer it as a precision; build the model "
    "in float64 (model.double()) with precision='32'",
}


def canonical(precision: str | int) -> str:
    """The precision's name as phalanx uses it: ``32``, ``"32"`` and ``"32-true"`` are
    ``"32"``; anything else as given (checked by :mod:`phalanx.validate`)."""
    text = str(precision).strip()
    return ALIASES.get(text, text)


def cpu_notice(name: str, devices: list[str]) -> str | None:
    """A warning for "16-mixed" on CPU devices: torch's float16 CPU kernels are much
    slower than float32 (measured 6.6x on a small GPT), so it only makes sense as a test
    of a GPU configuration."""
    if name != "16-mixed" or any(d.startswith("cuda") for d in devices):
        return None
    return (
        'precision="16-mixed" on CPU devices: torch\'s float16 CPU kernels are several times '
        'slower than float32 (6.6x measured on examples/mingpt.py); use precision="32" on '
        'CPU, or "bf16-mixed" where the CPU has bfloat16 instructions'
    )


SCALER_ARGS = ("init_scale", "growth_factor", "backoff_factor", "growth_interval")


@dataclass(frozen=True)
class Precision:
    """The run's precision and, for ``"16-mixed"``, keyword arguments of the GradScaler."""

    name: str = "32"
    scaler_args: dict[str, float] = field(default_factory=dict)

    @property
    def dtype(self) -> torch.dtype | None:
        return {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(self.name)

    def autocast(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        """The context the step function runs in (a null context for ``"32"``)."""
        dtype = self.dtype
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=dtype)

    def scaler(self, device: torch.device, optimizer: torch.optim.Optimizer) -> LossScaler | None:
        return LossScaler(device, optimizer, self.scaler_args) if self.name == "16-mixed" else None


class LossScaler:
    """torch's GradScaler over one optimizer, with the skip decided by the vote.

    Order within a step: :meth:`scale` the loss before each backward; after the synchronised
    backward (DDP has reduced the gradients; threads has summed them), :meth:`unscale`
    divides the gradients by the scale and says whether any is not finite (this member's
    part of the vote); then :meth:`step` (the vote said every member's gradients are finite)
    or :meth:`skip` (someone's were not), each of which updates the scale the same way on
    every member. :meth:`reset` forgets an unscale whose attempt was discarded.
    """

    def __init__(
        self, device: torch.device, optimizer: torch.optim.Optimizer, args: dict[str, float]
    ) -> None:
        self.optimizer = optimizer
        self.grad_scaler = torch.amp.GradScaler(device.type, **args)  # type: ignore[arg-type]
        # Created now, on this device: threads replicas share one scaler from several threads.
        self.grad_scaler.scale(torch.zeros((), device=device))
        self.unscaled = False

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.grad_scaler.scale(loss)

    def get_scale(self) -> float:
        return float(self.grad_scaler.get_scale())

    def unscale(self) -> bool:
        """Unscale the gradients in place; True when any of them is inf or NaN."""
        self.grad_scaler.unscale_(self.optimizer)
        self.unscaled = True
        return any(bool(v.item()) for v in self._found_inf().values())

    def step(self) -> None:
        """The vote found every gradient finite: step the optimizer, maybe grow the scale."""
        self.ensure_unscaled()
        self.grad_scaler.step(self.optimizer)
        self.grad_scaler.update()
        self.unscaled = False

    def skip(self) -> None:
        """Some member's gradients overflowed: no optimizer step here either, and the scale
        backs off as if this member had found the overflow itself (the vote decides)."""
        self.ensure_unscaled()
        for found in self._found_inf().values():
            found.fill_(1.0)
        self.grad_scaler.update()
        self.unscaled = False

    def reset(self) -> None:
        """The attempt was discarded (a failed vote): forget its unscale, keep the scale."""
        if self.unscaled:
            self.grad_scaler.update(new_scale=self.get_scale())
            self.unscaled = False

    def ensure_unscaled(self) -> None:
        if not self.unscaled:
            self.unscale()

    def _found_inf(self) -> dict[Any, torch.Tensor]:
        # The per-device inf flags unscale_ recorded for this optimizer (read by update()).
        return self.grad_scaler._found_inf_per_device(self.optimizer)

    def state_dict(self) -> dict[str, Any]:
        return self.grad_scaler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.grad_scaler.load_state_dict(state)


def step_scheduler_quietly(scheduler: Any, optimizer_stepped: bool) -> None:
    """``scheduler.step()``; after a skipped optimizer step, without torch's warning that the
    scheduler stepped before the optimizer (the schedule follows committed steps)."""
    if optimizer_stepped:
        scheduler.step()
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*optimizer.step")
        scheduler.step()
