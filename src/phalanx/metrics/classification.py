"""Classification metrics: accuracy, top-k accuracy, macro precision / recall / F1.

Every metric here reads ``StepOutput.outputs`` and ``StepOutput.targets``:

- ``outputs``: scores or logits of shape ``(N, C)`` (the predicted class is the arg-max, first
  index on ties). :class:`Accuracy`, :class:`Precision`, :class:`Recall` and :class:`F1` also
  accept shape ``(N,)`` holding predicted class ids.
- ``targets``: integer class ids of shape ``(N,)``.

Tensors may be on any device and of any dtype; they are detached and read on the CPU. States
are float64 count vectors that add across batches and across workers.
"""

from __future__ import annotations

import torch

from phalanx.errors import InvalidSettingError, StepOutputError
from phalanx.metrics.base import Metric
from phalanx.step import StepOutput

_HOW_TO_RETURN = (
    "return px.StepOutput(loss=loss, outputs=logits, targets=y) from your step function"
)


def _as_class_ids(values: torch.Tensor, what: str, metric: str) -> torch.Tensor:
    """``values`` as a 1-D int64 CPU tensor; raise StepOutputError if they are not ids."""
    values = values.detach().cpu()
    if values.ndim != 1:
        raise StepOutputError(
            f"{metric}: {what} has shape {tuple(values.shape)}; it must be 1-D (N,) class ids"
        )
    if values.is_floating_point() and not bool(torch.all(values == torch.round(values))):
        raise StepOutputError(
            f"{metric}: {what} of shape (N,) must hold integer class ids; pass scores or "
            "logits of shape (N, C) instead"
        )
    return values.to(torch.int64)


def _read(
    output: StepOutput, metric: str, num_classes: int | None, scores_only: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(outputs, targets)`` on the CPU, validated.

    ``outputs`` is float64 ``(N, C)`` scores when ``scores_only``, else int64 ``(N,)``
    predictions (the arg-max of ``(N, C)`` scores, or the given ids). ``targets`` is int64 ``(N,)``.
    """
    if output.outputs is None or output.targets is None:
        missing = "outputs" if output.outputs is None else "targets"
        raise StepOutputError(f"{metric} needs the step's {missing}: {_HOW_TO_RETURN}")
    targets = _as_class_ids(output.targets, "targets", metric)
    raw = output.outputs.detach().cpu()
    if raw.ndim == 2:
        classes: int | None = raw.shape[1]
        if num_classes is not None and classes != num_classes:
            raise StepOutputError(
                f"{metric}: outputs have {classes} columns but num_classes={num_classes}; "
                "pass the model's number of classes"
            )
        outputs = raw.to(torch.float64) if scores_only else raw.argmax(dim=1)
    elif raw.ndim == 1 and not scores_only:
        classes = num_classes
        outputs = _as_class_ids(raw, "outputs", metric)
    else:
        shape = "(N, C)" if scores_only else "(N, C) or (N,)"
        raise StepOutputError(
            f"{metric}: outputs have shape {tuple(raw.shape)}; they must have shape {shape}"
        )
    if outputs.shape[0] != targets.shape[0]:
        raise StepOutputError(
            f"{metric}: {outputs.shape[0]} outputs but {targets.shape[0]} targets; "
            "return one output row per target"
        )
    for name, ids in (("targets", targets), ("predicted class ids", outputs)):
        if ids.dtype != torch.int64 or ids.numel() == 0:
            continue
        if int(ids.min()) < 0 or (classes is not None and int(ids.max()) >= classes):
            raise StepOutputError(
                f"{metric}: {name} must lie in [0, {classes}); got values in "
                f"[{int(ids.min())}, {int(ids.max())}]"
            )
    return outputs, targets


def _ratio(num: torch.Tensor, den: torch.Tensor) -> float:
    return float(num / den) if float(den) > 0 else float("nan")


class Accuracy(Metric):
    """Fraction of samples whose predicted class equals the target.

    State: ``[correct, count]``. ``compute`` returns ``correct / count``, NaN when count is 0.
    """

    name = "accuracy"
    higher_is_better = True

    def size(self) -> int:
        return 2

    def state(self, output: StepOutput, samples: int) -> torch.Tensor:
        preds, targets = _read(output, self.name, None, scores_only=False)
        correct = int((preds == targets).sum())
        return torch.tensor([correct, targets.numel()], dtype=torch.float64)

    def compute(self, state: torch.Tensor) -> float:
        return _ratio(state[0], state[1])


class TopKAccuracy(Metric):
    """Fraction of samples whose target is among the ``k`` highest-scoring classes.

    Needs ``(N, C)`` scores. A sample counts as correct when fewer than ``k`` classes score
    strictly higher than its target (ties go to the target, so the result is deterministic);
    a NaN target score never counts. With ``k >= C`` every sample is correct (as in sklearn's
    ``top_k_accuracy_score``). State: ``[correct, count]``; NaN when count is 0.
    """

    higher_is_better = True

    def __init__(self, k: int = 5) -> None:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise InvalidSettingError(f"TopKAccuracy(k={k!r}): k must be an integer >= 1")
        self.k = k
        self.name = f"top{k}_accuracy"

    def size(self) -> int:
        return 2

    def state(self, output: StepOutput, samples: int) -> torch.Tensor:
        scores, targets = _read(output, self.name, None, scores_only=True)
        target_score = scores.gather(1, targets.unsqueeze(1))
        higher = (scores > target_score).sum(dim=1)
        correct = int(((higher < self.k) & ~target_score.squeeze(1).isnan()).sum())
        return torch.tensor([correct, targets.numel()], dtype=torch.float64)

    def compute(self, state: torch.Tensor) -> float:
        return _ratio(state[0], state[1])


class _MacroMetric(Metric):
    """Macro average of a per-class score over ``num_classes`` classes.

    State (length ``3 * num_classes``): ``[tp_0..tp_{C-1}, fp_0..fp_{C-1}, fn_0..fn_{C-1}]``.
    As in torchmetrics (``average="macro"``) and sklearn (``average="macro"``,
    ``zero_division=0``): a class that never occurs, neither as a target nor as a prediction
    (tp + fp + fn == 0), is left out of the average; a class whose own denominator is zero
    scores 0. ``compute`` returns NaN when no class occurred at all (empty state).
    """

    higher_is_better = True

    def __init__(self, num_classes: int) -> None:
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
            raise InvalidSettingError(
                f"{type(self).__name__}(num_classes={num_classes!r}): num_classes must be an "
                "integer >= 2, the number of classes the model predicts"
            )
        self.num_classes = num_classes

    def size(self) -> int:
        return 3 * self.num_classes

    def state(self, output: StepOutput, samples: int) -> torch.Tensor:
        preds, targets = _read(output, self.name, self.num_classes, scores_only=False)
        c = self.num_classes
        tp = torch.bincount(targets[preds == targets], minlength=c)
        fp = torch.bincount(preds, minlength=c) - tp
        fn = torch.bincount(targets, minlength=c) - tp
        return torch.cat([tp, fp, fn]).to(torch.float64)

    def compute(self, state: torch.Tensor) -> float:
        tp, fp, fn = state.to(torch.float64).reshape(3, self.num_classes)
        present = (tp + fp + fn) > 0
        if not bool(present.any()):
            return float("nan")
        num, den = self._fraction(tp, fp, fn)
        per_class = torch.where(den > 0, num / den.clamp(min=1e-300), torch.zeros_like(num))
        return float(per_class[present].mean())

    def _fraction(
        self, tp: torch.Tensor, fp: torch.Tensor, fn: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-class numerator and denominator of the score."""
        raise NotImplementedError


class Precision(_MacroMetric):
    """Macro-averaged precision, ``tp / (tp + fp)`` per class. See :class:`_MacroMetric`."""

    name = "precision"

    def _fraction(
        self, tp: torch.Tensor, fp: torch.Tensor, fn: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return tp, tp + fp


class Recall(_MacroMetric):
    """Macro-averaged recall, ``tp / (tp + fn)`` per class. See :class:`_MacroMetric`."""

    name = "recall"

    def _fraction(
        self, tp: torch.Tensor, fp: torch.Tensor, fn: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return tp, tp + fn


class F1(_MacroMetric):
    """Macro-averaged F1, ``2 tp / (2 tp + fp + fn)`` per class, then averaged (not the F1
    of macro precision and recall). See :class:`_MacroMetric`."""

    name = "f1"

    def _fraction(
        self, tp: torch.Tensor, fp: torch.Tensor, fn: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return 2 * tp, 2 * tp + fp + fn
