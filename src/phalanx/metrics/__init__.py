"""Metrics, and helpers that carry every metric's state in one flat float64 vector.

A step takes each batch's states as floats (:func:`state_values`, the values of
:func:`pack_states`' vector), adds them (over batches and, in the step's vote, over
workers), then :func:`compute_all` turns the total into values. The layout of the flat
vector is each metric's state in list order; its length is :func:`total_size`.
"""

from __future__ import annotations

from typing import NoReturn

import torch

from phalanx.errors import InvalidSettingError, MetricError, PhalanxError
from phalanx.metrics.base import LoopMetric, LoopStats, Metric
from phalanx.metrics.classification import F1, Accuracy, Precision, Recall, TopKAccuracy
from phalanx.metrics.loop import LearningRate, SamplesPerSecond
from phalanx.metrics.loss import Loss
from phalanx.step import StepOutput

__all__ = [
    "F1",
    "Accuracy",
    "LearningRate",
    "LoopMetric",
    "LoopStats",
    "Loss",
    "Metric",
    "Precision",
    "Recall",
    "SamplesPerSecond",
    "TopKAccuracy",
    "compute_all",
    "pack_states",
    "total_size",
]


def total_size(metrics: list[Metric]) -> int:
    """Length of the flat state vector for ``metrics``."""
    return sum(m.size() for m in metrics)


def pack_states(metrics: list[Metric], output: StepOutput, samples: int) -> torch.Tensor:
    """Concatenate each metric's state for one batch: 1-D float64 CPU, ``total_size`` long.

    Raises InvalidSettingError if a metric returns a state whose length is not its ``size()``.
    """
    return torch.tensor(state_values(metrics, output, samples), dtype=torch.float64)


def state_values(
    metrics: list[Metric], output: StepOutput, samples: int, loss: float | None = None
) -> list[float]:
    """:func:`pack_states` as Python floats (float64, exactly), what a step sums and votes
    with. ``loss``: the step's loss as a float, when the caller has read it already: the
    built-in :class:`Loss` metric's state is then made from it (the same values), with no
    tensor at all."""
    values: list[float] = []
    for m in metrics:
        if loss is not None and type(m) is Loss:
            values += Loss.state_of(loss, samples)  # (what Loss.state returns)
            continue
        try:
            s = m.state(output, samples)
        except Exception as exc:
            _raise_named(m, "state", exc, output)
        if s.ndim != 1 or s.numel() != m.size():
            raise InvalidSettingError(
                f"metric {m.name!r} returned a state of shape {tuple(s.shape)}; its state() "
                f"must return a 1-D tensor of length size()={m.size()}"
            )
        values += map(float, s.tolist())  # (float64 holds every state dtype's values)
    return values


def compute_all(metrics: list[Metric], state: torch.Tensor | list[float]) -> dict[str, float]:
    """Map each metric's ``name`` to its value, reading its slice of the summed ``state``
    (a tensor, or its values as floats). A metric's ``compute`` gets its slice as a new
    float64 CPU tensor (never a view of ``state``).

    Raises InvalidSettingError if two metrics share a name or ``state`` has the wrong length.
    """
    names = [m.name for m in metrics]
    if len(set(names)) != len(names):
        duplicates = sorted({n for n in names if names.count(n) > 1})
        raise InvalidSettingError(
            f"several metrics are named {duplicates}; give each metric a distinct name"
        )
    flat = state if isinstance(state, list) else state.tolist()
    if (isinstance(state, torch.Tensor) and state.ndim != 1) or len(flat) != total_size(metrics):
        shape = tuple(state.shape) if isinstance(state, torch.Tensor) else (len(flat),)
        raise InvalidSettingError(
            f"the metric state has shape {shape} but the metrics need "
            f"{total_size(metrics)} values; pass the sum of pack_states() vectors"
        )
    values: dict[str, float] = {}
    start = 0
    for m in metrics:
        part = flat[start : start + m.size()]
        start += m.size()
        if type(m) is Loss:  # (Loss.compute, without a tensor)
            values[m.name] = Loss.value_of(part)
            continue
        try:
            values[m.name] = m.compute(torch.tensor(part, dtype=torch.float64))
        except Exception as exc:
            _raise_named(m, "compute", exc)
    return values


def _raise_named(
    metric: Metric, method: str, exc: Exception, output: StepOutput | None = None
) -> NoReturn:
    """Raise ``exc``, an exception in a metric's method, as a MetricError that names the
    metric and what to check (for ``state``, what the step returned, ``output``); a phalanx
    error or an out-of-memory error as itself. (Called in the ``except`` block: a plain
    ``try`` costs nothing per step where a context manager did.)"""
    if isinstance(exc, PhalanxError | torch.OutOfMemoryError):
        raise exc
    if method == "state":
        hint = (
            f"check {metric.name!r} against the step's outputs and targets "
            f"({_shapes(output)}); a metric that needs them requires the step to return "
            "px.StepOutput(loss=..., outputs=..., targets=...)"
        )
    else:
        hint = (
            f"check {metric.name!r}'s compute() against the summed state its state() "
            "builds from the step's outputs and targets (e.g. an epoch with no samples)"
        )
    raise MetricError(
        f"metric {metric.name!r} ({type(metric).__name__}.{method}) raised "
        f"{type(exc).__name__}: {exc}; {hint}"
    ) from exc


def _shapes(output: StepOutput | None) -> str:
    """``outputs (8, 10), targets (8,)``; None for what the step did not return."""
    if output is None:
        return "not known"
    parts = []
    for name in ("outputs", "targets"):
        value = getattr(output, name)
        if isinstance(value, torch.Tensor):
            parts.append(f"{name} {tuple(value.shape)}")
        else:
            parts.append(f"{name} {'None' if value is None else type(value).__name__}")
    return ", ".join(parts)
