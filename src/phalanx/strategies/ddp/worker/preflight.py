"""Preflight: one forward and backward of a worker's first slice on its own replica, alone,
before it joins any group: a shape bug or a model that does not fit fails here, named, before
a collective could hang on it.

It runs on the worker's real replica (the model factory runs once per process), and leaves
it as it found it: gradients cleared, buffers (BatchNorm's running statistics) and the
random generators restored, its fault injector, heartbeat and micro-batch split back. So
the training that follows computes exactly what it would have without a preflight.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Dataset, default_collate

from phalanx.failures import FailedHere
from phalanx.faults import FaultInjector
from phalanx.plan import Plan
from phalanx.spec import FitConfig
from phalanx.strategies.ddp.worker.engine import Member


def preflight(member: Member, config: FitConfig, plan: Plan, train: Dataset[Any]) -> None:
    """Raises FailedHere (phase ``preflight``) when the slice fails."""
    slot, replica = member.slot, member.replica
    first = plan.local_batch(0, 0, slot, len(config.devices))
    # Only preflight faults fire here: the others belong to the real steps.
    faults = FaultInjector([f for f in config.faults if f.phase == "preflight"], slot)
    with _alone(member, faults), _as_policy(config, member.device):
        faults.check(0, "preflight")
        result = replica.run(
            lambda: (config.collate_fn or default_collate)([train[i] for i in first]),
            first,
            len(plan.global_batch(0, 0)),
            0,
            0,
            member.trainable.micro_batches,
        )
    if result.failure is not None:
        result.failure.phase = "preflight"
        raise FailedHere(result.failure)


def _as_policy(config: FitConfig, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """fsdp with an ``mp_policy``: the unsharded model computes in the policy's dtype as
    near as autocast gets it (its units will compute in that dtype), so that a step that
    depends on it fails or passes here as it will in training."""
    dtype = getattr(config.mp_policy, "param_dtype", None)
    if dtype is None or dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


@contextlib.contextmanager
def _alone(member: Member, faults: FaultInjector) -> Iterator[None]:
    """The replica with ``faults`` and no heartbeat inside; as it was afterwards."""
    replica, model = member.replica, member.trainable.model
    kept = (replica.faults, replica.on_phase, replica.split_factor)
    buffers = [b.detach().clone() for b in model.buffers()]
    cuda = [member.device.index or 0] if member.device.type == "cuda" else []
    replica.faults, replica.on_phase = faults, None
    try:
        with torch.random.fork_rng(devices=cuda):
            yield
    finally:
        replica.faults, replica.on_phase, replica.split_factor = kept
        replica.unvoted, replica.unvoted_splittable = None, False
        with torch.no_grad():
            for buf, saved in zip(model.buffers(), buffers, strict=True):
                buf.copy_(saved)
        member.trainable.discard()
        for p in model.parameters():
            p.grad = None
