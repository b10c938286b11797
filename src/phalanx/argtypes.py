"""The types of ``Learner``'s and ``fit``'s plain arguments, checked before anything else.

A value of the wrong type (``grad_clip_norm="1.0"`` read from a config file, ``epochs=2.5``)
would otherwise reach a comparison deep inside and fail there with a bare ``TypeError``.
:func:`check` raises :class:`~phalanx.errors.ArgumentTypeError` (PX125) instead, naming the
argument, what it takes and, for a number written as text, the number to pass. Factories
(model, optimizer, scheduler, step) and datasets have checks of their own, with their own
codes (PX114, PX127, PX128, PX131), as do device labels (PX102-PX112) and ``collate_fn``
(PX108: not callable). Every argument of ``fit`` and ``Learner`` is in one of the two
(``tests/test_argtypes.py`` checks the signatures against :func:`fit_kinds`,
:func:`learner_kinds` and :data:`CHECKED_ELSEWHERE`).
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from phalanx.errors import ArgumentTypeError


@dataclass(frozen=True)
class Kind:
    """What an argument takes: ``says`` in words, ``accepts`` the test."""

    says: str
    accepts: Callable[[Any], bool]
    number: bool = False  # a string holding a number gets "pass NAME=<number>"
    fix: Callable[[Any], str | None] | None = None  # the value to pass instead, when known


def _whole(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _flag(value: Any) -> bool:
    kind = type(value)
    return isinstance(value, bool) or (kind.__module__ == "numpy" and kind.__name__ in _NP_BOOL)


_NP_BOOL = ("bool", "bool_")  # numpy's bool scalar (named bool_ before numpy 2)


def _classes(value: Any) -> bool:
    """A class, or a non-empty tuple or list of classes (fit's ``shard=``)."""
    if isinstance(value, type):
        return True
    listed = isinstance(value, tuple | list) and bool(value)
    return listed and all(isinstance(v, type) for v in value)


def _mp_policy(value: Any) -> bool:
    """None, or FSDP2's mixed precision policy (imported only when one is given)."""
    if value is None:
        return True
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return isinstance(value, MixedPrecisionPolicy)


def _optional(kind: Kind) -> Kind:
    return Kind(f"{kind.says} or None", lambda v: v is None or kind.accepts(v), kind.number)


def _instance(cls: type, says: str) -> Kind:
    return Kind(says, lambda v: isinstance(v, cls))


def _listing(item: type, says: str) -> Kind:
    def accepts(value: Any) -> bool:
        is_sequence = isinstance(value, Sequence) and not isinstance(value, str | bytes)
        return is_sequence and all(isinstance(v, item) for v in value)

    return Kind(says, accepts)


WHOLE = Kind("a whole number (int)", _whole, number=True)
NUMBER = Kind("a number (int or float)", _real, number=True)
FLAG = Kind("True or False", _flag)
TEXT = _instance(str, "a string")
SECONDS = Kind(
    "a datetime.timedelta or a number of seconds",
    lambda v: isinstance(v, timedelta) or _real(v),
    number=True,
)
PATH = Kind(
    "a path (str or os.PathLike) or None", lambda v: v is None or isinstance(v, str | os.PathLike)
)
SINKS = Kind(
    "a list of sinks (objects with handle(event) and close()) or None",
    lambda v: (
        v is None
        or (
            isinstance(v, Sequence)
            and not isinstance(v, str | bytes)
            and all(callable(getattr(s, "handle", None)) for s in v)
        )
    ),
)


def _device_labels(value: Any) -> bool:
    import torch

    one = (str, torch.device)
    if isinstance(value, one):
        return True
    is_sequence = isinstance(value, Sequence) and not isinstance(value, bytes)
    return is_sequence and all(isinstance(v, one) for v in value)


def _device_count(value: Any) -> str | None:
    """Lightning's ``devices=2``: the labels phalanx takes for two devices."""
    if not _whole(value) or value < 1:
        return None
    cpus = ",".join(f"cpu:{i}" for i in range(min(int(value), 4)))
    gpus = ",".join(f"cuda:{i}" for i in range(min(int(value), 4)))
    more = ",..." if value > 4 else ""
    return f"'{gpus}{more}' (GPUs) or '{cpus}{more}' (CPU workers), or 'auto' for every GPU"


DEVICES = Kind(
    "a string of device labels such as 'cuda:0,cuda:1', 'cpu:0,cpu:1' or 'auto', a "
    "torch.device, or a list of them",
    _device_labels,
    fix=_device_count,
)


def _metric(value: Any) -> bool:
    from phalanx.metrics import LoopMetric, Metric

    return isinstance(value, Metric | LoopMetric)


def learner_kinds() -> dict[str, Kind]:
    return {
        "grad_accumulation": WHOLE,
        "grad_clip_norm": _optional(NUMBER),
        "precision": Kind(
            "a string such as '32' or 'bf16-mixed' (or 32)",
            lambda v: isinstance(v, str) or _whole(v),
        ),
        "grad_scaler": Kind(
            "a dict of GradScaler keyword arguments or None",
            lambda v: v is None or isinstance(v, Mapping),
        ),
        "lr_scheduler_interval": TEXT,
        "metrics": Kind(
            "a list of metrics (px.metrics.Loss(), px.metrics.Accuracy(), ...)",
            lambda v: (
                isinstance(v, Sequence)
                and not isinstance(v, str | bytes)
                and all(_metric(m) for m in v)
            ),
            fix=lambda v: f"[{type(v).__name__}()]" if _metric(v) else None,
        ),
    }


def fit_kinds() -> dict[str, Kind]:
    from phalanx.checkpoint import Checkpoints
    from phalanx.early_stopping import EarlyStopping
    from phalanx.faults import Fault
    from phalanx.policy import Recovery
    from phalanx.snapshot import Snapshots

    return {
        "epochs": WHOLE,
        "batch_size": WHOLE,
        "strategy": TEXT,
        "devices": DEVICES,
        "seed": WHOLE,
        "run_dir": PATH,
        "checkpoint": _optional(_instance(Checkpoints, "a px.Checkpoints")),
        "early_stopping": _optional(_instance(EarlyStopping, "a px.EarlyStopping")),
        "resume": FLAG,
        "drop_last": FLAG,
        "shuffle": FLAG,
        "faults": _listing(Fault, "a list of px.Fault (px.Fault.parse('kill:1@5'))"),
        "preflight": FLAG,
        "hang_timeout": SECONDS,
        "node_timeout": SECONDS,
        "num_workers": WHOLE,
        "pin_memory": FLAG,
        "max_steps": _optional(WHOLE),
        "val_every_steps": _optional(WHOLE),
        "balance": _optional(FLAG),
        "slow_worker": _optional(NUMBER),
        "on_bad_sample": TEXT,
        "max_bad_samples": WHOLE,
        "min_free_memory": _optional(WHOLE),
        "on_failure": _optional(_instance(Recovery, "a px.Recovery")),
        "snapshots": Kind(
            "True, False or a px.Snapshots", lambda v: _flag(v) or isinstance(v, Snapshots)
        ),
        "shard": Kind(
            "None, module classes (a class or a tuple of them) or a function of a module",
            lambda v: v is None or callable(v) or _classes(v),
        ),
        "gather": FLAG,
        "mp_policy": Kind(
            "None or a torch.distributed.fsdp.MixedPrecisionPolicy", lambda v: _mp_policy(v)
        ),
        "sinks": SINKS,
        "loggers": Kind(
            "a list of sinks (objects with handle(event) and close())",
            lambda v: v is not None and SINKS.accepts(v),
        ),
    }


# Arguments whose checks live elsewhere, with the code they raise.
CHECKED_ELSEWHERE = {
    "Learner": {
        "model": "PX114",
        "optimizer": "PX114",
        "step": "PX114",
        "lr_scheduler": "PX131",
    },
    "fit": {"train": "PX127/PX128", "valid": "PX127/PX128", "collate_fn": "PX108"},
}


def check(kinds: Mapping[str, Kind], values: Mapping[str, Any], where: str) -> None:
    """ArgumentTypeError (PX125) for the first of ``values`` whose type its kind refuses."""
    for name, kind in kinds.items():
        if name not in values:
            continue
        value = values[name]
        if kind.accepts(value):
            continue
        hint = _as_number(value) if kind.number else None
        fix = f"; pass {name}={hint}" if hint is not None and kind.accepts(_number(hint)) else ""
        instead = kind.fix(value) if kind.fix is not None else None
        fix = f"; pass {name}={instead}" if instead is not None else fix
        raise ArgumentTypeError(
            f"{where}'s {name} must be {kind.says}, got {value!r} (a {type(value).__name__}){fix}"
        )


def _as_number(value: Any) -> str | None:
    """The number a string holds, as it would be written in code ("1.0" -> "1.0")."""
    if not isinstance(value, str):
        return None
    text = value.strip()
    for parse in (int, float):
        try:
            return repr(parse(text))
        except ValueError:
            continue
    return None


def _number(text: str) -> int | float:
    return int(text) if text.lstrip("-").isdigit() else float(text)
