"""Fault injection: real failures at a chosen worker, step and phase (a user feature).

``Fault(kind="kill", worker=1, step=30)`` kills worker 1's process with SIGKILL when it
reaches step 30 (counted in committed optimizer steps since the run began, so step 30 is
the 31st step), or later when it was not there at step 30 (a replacement that joined
later): at a step after the one it joined at, one missed fault per step. A replacement
never replays the faults up to the step its predecessor fell at. Kinds: ``exception``
(raise :class:`InjectedFault`), ``kill`` (SIGKILL of the worker process), ``hang`` (sleep
that never returns), ``oom`` (raise ``torch.OutOfMemoryError``). ``times`` is how many
attempts of that step fail (1 is a transient fault that the retry absorbs; 2 or more make
a poison batch). Phase ``validation`` fires in the validation that follows step ``step``
(the last step of an epoch); phase ``backward`` fires in the middle of the backward pass,
as a real error there would.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch

from phalanx.errors import InvalidSettingError
from phalanx.failures import PHASES

FaultKind = Literal["exception", "kill", "hang", "oom"]
KINDS = ("exception", "kill", "hang", "oom")


class InjectedFault(RuntimeError):
    """The exception an ``exception`` fault raises."""


@dataclass(frozen=True)
class Fault:
    kind: str
    worker: int = 0
    step: int = 0
    phase: str = "forward"
    times: int = 1

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidSettingError(f"Fault kind {self.kind!r} is unknown; use one of {KINDS}")
        if self.phase not in PHASES or self.phase == "checkpoint":
            raise InvalidSettingError(
                f"Fault phase {self.phase!r} cannot be injected; use one of "
                "preflight, data, forward, backward, sync, optimizer, metrics, validation"
            )
        if self.worker < 0 or self.step < 0 or self.times < 1:
            raise InvalidSettingError("Fault needs worker >= 0, step >= 0 and times >= 1")

    @classmethod
    def parse(cls, text: str) -> Fault:
        """``KIND:WORKER@STEP[/PHASE][xTIMES]``, e.g. ``kill:1@30``, ``exception:0@5/backward``."""
        m = re.fullmatch(r"([a-z]+):(\d+)@(\d+)(?:/([a-z]+?))?(?:x(\d+))?", text.strip())
        if not m:
            raise InvalidSettingError(
                f"cannot read fault {text!r}; write KIND:WORKER@STEP, e.g. kill:1@30 "
                "(optional /PHASE and xTIMES, e.g. exception:0@5/backwardx2)"
            )
        kind, worker, step, phase, times = m.groups()
        return cls(kind, int(worker), int(step), phase or "forward", int(times or 1))


def chaos(count: int, workers: int, total_steps: int, seed: int = 0) -> list[Fault]:
    """``count`` failures for a chaos run: kinds in turn kill, hang, exception (transient),
    at seeded random workers, at steps spread over the first three quarters of the run (so
    each recovery has room to finish before the next one)."""
    import random

    if count < 1:
        return []
    rng = random.Random(seed)
    span = max(1, (total_steps * 3 // 4) // count)
    kinds = ("kill", "hang", "exception")
    return [
        Fault(kinds[i % 3], worker=rng.randrange(workers), step=i * span + rng.randrange(span))
        for i in range(count)
    ]


class FaultInjector:
    """Fires the faults meant for one worker. Holds how often each has fired (per process).

    A fault fires at its step, every attempt until ``times``. One its process missed (it
    joined after that step) fires later, but never in the step the process joined nor in a
    step where another fault fired: a replacement joining late must not fire its missed
    faults together, in the attempts of one step, where two unrelated faults would look
    like a poison batch (the same worker, or the same share and phase, failing twice)."""

    def __init__(self, faults: list[Fault], worker: int) -> None:
        self.faults = [f for f in faults if f.worker == worker]
        self.fired: dict[Fault, int] = {}
        self.first_step: int | None = None  # the step this process joined at
        self.fired_at: set[int] = set()  # steps where a fault fired

    def due(self, step: int, phase: str) -> list[Fault]:
        if self.first_step is None:
            self.first_step = step
        if not self.faults:  # (the usual case, six times a step)
            return []
        pending = [f for f in self.faults if f.phase == phase and self.fired.get(f, 0) < f.times]
        exact = [f for f in pending if f.step == step]
        if step == self.first_step or step in self.fired_at:
            return exact
        return exact + [f for f in pending if f.step < step][:1]

    def check(self, step: int, phase: str) -> None:
        for fault in self.due(step, phase):
            self.fired[fault] = self.fired.get(fault, 0) + 1
            self.fired_at.add(step)
            fire(fault)

    def inside_backward(
        self, step: int, module: torch.nn.Module
    ) -> contextlib.AbstractContextManager[None]:
        """Backward faults fire in the middle of the backward pass, as a real error there
        would: from a hook on the gradient of the module's first parameter (usually the
        first layer's, computed last, when DDP has already begun reducing the others; under
        fsdp, whose sharded parameters get no gradient of their own, from the first leaf
        module's backward), or after the backward when that gradient is never computed.
        (None due: a context that does nothing, at no cost.)"""
        if not self.due(step, "backward"):
            return contextlib.nullcontext()
        return self._hooked(step, module)

    @contextlib.contextmanager
    def _hooked(self, step: int, module: torch.nn.Module) -> Iterator[None]:
        params = [p for p in module.parameters() if p.requires_grad]
        fired: list[bool] = []

        def hook(grad: torch.Tensor | None) -> None:
            if not fired:
                fired.append(True)
                self.check(step, "backward")

        handle: Any = None
        if params and hasattr(params[0], "placements"):
            # fsdp: a sharded parameter's own gradient is never computed (its unit's unsharded
            # copy is): hook the first leaf module's backward instead (reached last)
            leaf = next(
                (m for m in module.modules() if not list(m.children()) and list(m.parameters())),
                None,
            )
            if leaf is not None:
                handle = leaf.register_full_backward_pre_hook(lambda _m, _g: hook(None))
        elif params:
            handle = params[0].register_hook(hook)
        try:
            yield
        finally:
            if handle is not None:
                handle.remove()
        if not fired:
            self.check(step, "backward")


def fire(fault: Fault) -> None:
    # As the fault was written (its step counts from 0: the lines shown say step + 1).
    where = f"fault {fault.kind}:{fault.worker}@{fault.step}/{fault.phase}"
    if fault.kind == "exception":
        raise InjectedFault(f"injected exception ({where})")
    if fault.kind == "oom":
        raise torch.OutOfMemoryError(f"injected out of memory ({where})")
    if fault.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    while fault.kind == "hang":
        time.sleep(3600)
