"""Metrics against scikit-learn, and the property that states add across batches and workers."""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.metrics import (
    accuracy_score,
    f1_score,
    precision_score,
    recall_score,
    top_k_accuracy_score,
)

from phalanx.errors import InvalidSettingError, StepOutputError
from phalanx.metrics import (
    F1,
    Accuracy,
    LearningRate,
    LoopStats,
    Loss,
    Metric,
    Precision,
    Recall,
    SamplesPerSecond,
    TopKAccuracy,
    compute_all,
    pack_states,
    state_values,
    total_size,
)
from phalanx.step import StepOutput

C = 6


def make_data(
    seed: int, n: int, c: int = C, absent: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits (n, c) that lean towards the targets (so scores are neither 0 nor 1).

    With ``absent``, that class is never a target nor predicted.
    """
    gen = torch.Generator().manual_seed(seed)
    high = c - 1 if absent is not None else c
    targets = torch.randint(0, high, (n,), generator=gen)
    if absent is not None:
        targets[targets >= absent] += 1
    logits = torch.randn(n, c, generator=gen)
    logits[torch.arange(n), targets] += 1.0
    if absent is not None:
        logits[:, absent] = -100.0
    return logits, targets


def out(logits: torch.Tensor, targets: torch.Tensor) -> StepOutput:
    return StepOutput(loss=torch.tensor(0.5), outputs=logits, targets=targets)


def all_metrics() -> list[Metric]:
    return [Loss(), Accuracy(), TopKAccuracy(3), Precision(C), Recall(C), F1(C)]


def sklearn_values(logits: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    y, p = targets.numpy(), logits.argmax(1).numpy()
    return {
        "accuracy": accuracy_score(y, p),
        "top3_accuracy": top_k_accuracy_score(y, logits.numpy(), k=3, labels=np.arange(C)),
        "precision": precision_score(y, p, average="macro", zero_division=0),
        "recall": recall_score(y, p, average="macro", zero_division=0),
        "f1": f1_score(y, p, average="macro", zero_division=0),
    }


def classification_metrics() -> list[Metric]:
    return [Accuracy(), TopKAccuracy(3), Precision(C), Recall(C), F1(C)]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("absent", [None, 0, 3])
def test_one_batch_matches_sklearn(seed: int, absent: int | None) -> None:
    logits, targets = make_data(seed, 200, absent=absent)
    for m in classification_metrics():
        value = m.compute(m.state(out(logits, targets), len(targets)))
        assert value == pytest.approx(sklearn_values(logits, targets)[m.name], abs=1e-12), m.name
        assert 0.0 < value < 1.0


def test_class_only_predicted_or_only_targeted_matches_sklearn() -> None:
    # class 0 is only ever a target (never predicted), class 3 only ever predicted:
    # both count in the macro average, with a zero precision / recall respectively.
    targets = torch.tensor([0, 0, 1, 1, 2, 2, 1])
    preds = torch.tensor([1, 1, 1, 3, 2, 2, 3])
    logits = torch.nn.functional.one_hot(preds, 4).float()
    o = out(logits, targets)
    y, p = targets.numpy(), preds.numpy()
    for metric, ref in [
        (Precision(4), precision_score(y, p, average="macro", zero_division=0)),
        (Recall(4), recall_score(y, p, average="macro", zero_division=0)),
        (F1(4), f1_score(y, p, average="macro", zero_division=0)),
    ]:
        assert metric.compute(metric.state(o, 7)) == pytest.approx(ref, abs=1e-12)
    # by hand: precision per class [0, 1/3, 1, 0] -> 1/3; recall [0, 1/3, 1, 0] -> 1/3
    assert Precision(4).compute(Precision(4).state(o, 7)) == pytest.approx(1 / 3)
    # a class in range but never seen (class 4 of 5) is left out of the average
    assert Recall(5).compute(
        Recall(5).state(out(torch.nn.functional.one_hot(preds, 5).float(), targets), 7)
    ) == pytest.approx(1 / 3)


def test_macro_state_layout_is_tp_fp_fn_per_class() -> None:
    targets = torch.tensor([0, 0, 1, 2])
    preds = torch.tensor([0, 1, 1, 1])
    s = Precision(3).state(out(preds, targets), 4)
    assert s.tolist() == [1, 1, 0, 0, 2, 0, 1, 0, 1]  # tp | fp | fn
    assert Precision(3).size() == F1(3).size() == Recall(3).size() == 9


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    n=st.integers(1, 120),
    cuts=st.lists(st.floats(0.0, 1.0), max_size=6),
)
def test_batch_states_sum_to_the_whole(seed: int, n: int, cuts: list[float]) -> None:
    logits, targets = make_data(seed, n)
    bounds = sorted({0, n, *(int(c * n) for c in cuts)})
    metrics = all_metrics()
    whole = pack_states(metrics, out(logits, targets), n)
    summed = torch.zeros(total_size(metrics), dtype=torch.float64)
    for a, b in itertools.pairwise(bounds):
        summed += pack_states(metrics, out(logits[a:b], targets[a:b]), b - a)
    # counts are exact integers; the loss term is a float sum
    assert torch.allclose(summed, whole, rtol=1e-12, atol=1e-12)
    got = compute_all(metrics, summed)
    ref = sklearn_values(logits, targets)
    for name, value in ref.items():
        assert got[name] == pytest.approx(value, abs=1e-12), name
    assert got["loss"] == pytest.approx(0.5)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_worker_states_sum_to_the_whole(world: int) -> None:
    logits, targets = make_data(7, 301)
    metrics = all_metrics()
    whole = pack_states(metrics, out(logits, targets), 301)
    # each "worker" sees a disjoint strided shard, in two batches each
    total = torch.zeros_like(whole)
    for rank in range(world):
        lg, tg = logits[rank::world], targets[rank::world]
        half = len(tg) // 2
        total += pack_states(metrics, out(lg[:half], tg[:half]), half)
        total += pack_states(metrics, out(lg[half:], tg[half:]), len(tg) - half)
    assert torch.allclose(total, whole, rtol=1e-12, atol=1e-12)
    assert compute_all(metrics, total) == pytest.approx(compute_all(metrics, whole))


def test_empty_state_gives_nan() -> None:
    metrics = all_metrics()
    values = compute_all(metrics, torch.zeros(total_size(metrics), dtype=torch.float64))
    assert set(values) == {"loss", "accuracy", "top3_accuracy", "precision", "recall", "f1"}
    assert all(math.isnan(v) for v in values.values())
    # an empty batch contributes a zero state
    empty = pack_states(metrics[1:], out(torch.zeros(0, C), torch.zeros(0, dtype=torch.long)), 0)
    assert empty.shape == (total_size(metrics[1:]),)
    assert bool((empty == 0).all())


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_top_k_matches_numpy_and_sklearn(k: int) -> None:
    logits, targets = make_data(11, 250)
    scores, y = logits.numpy(), targets.numpy()
    top = np.argsort(-scores, axis=1)[:, :k]
    direct = float(np.mean([y[i] in top[i] for i in range(len(y))]))
    m = TopKAccuracy(k)
    value = m.compute(m.state(out(logits, targets), 250))
    assert value == pytest.approx(direct, abs=1e-12)
    assert value == pytest.approx(
        top_k_accuracy_score(y, scores, k=k, labels=np.arange(C)), abs=1e-12
    )
    assert m.name == f"top{k}_accuracy"
    if k == 1:
        assert value == pytest.approx(Accuracy().compute(Accuracy().state(out(logits, targets), 0)))


def test_top_k_edge_cases() -> None:
    assert TopKAccuracy().name == "top5_accuracy" and TopKAccuracy().k == 5
    logits, targets = make_data(3, 40, c=4)
    # k >= C: every target is in the top k (as sklearn)
    assert TopKAccuracy(4).compute(TopKAccuracy(4).state(out(logits, targets), 40)) == 1.0
    assert TopKAccuracy(9).compute(TopKAccuracy(9).state(out(logits, targets), 40)) == 1.0
    # ties go to the target: all-equal scores count as correct even for k=1
    tied = TopKAccuracy(1).state(out(torch.zeros(5, 4), torch.tensor([0, 1, 2, 3, 3])), 5)
    assert tied.tolist() == [5.0, 5.0]
    # a NaN score for the target never counts
    nan_scores = torch.zeros(2, 3)
    nan_scores[0, 1] = float("nan")
    assert TopKAccuracy(1).state(out(nan_scores, torch.tensor([1, 1])), 2).tolist() == [1, 2]


def test_accuracy_accepts_predicted_ids() -> None:
    targets = torch.tensor([0, 1, 2, 2, 1])
    preds = torch.tensor([0, 2, 2, 2, 0])
    assert Accuracy().state(out(preds, targets), 5).tolist() == [3.0, 5.0]
    assert Accuracy().compute(Accuracy().state(out(preds.float(), targets), 5)) == 0.6
    assert F1(3).compute(F1(3).state(out(preds, targets), 5)) == pytest.approx(
        f1_score(targets.numpy(), preds.numpy(), average="macro", zero_division=0)
    )
    with pytest.raises(StepOutputError, match="integer class ids"):
        Accuracy().state(out(torch.tensor([0.3, 1.2, 0.0, 0.0, 0.0]), targets), 5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_any_dtype_with_grad_gives_float64_cpu(dtype: torch.dtype) -> None:
    logits, targets = make_data(5, 64)
    o = out(logits.to(dtype).requires_grad_(True), targets.to(torch.int32))
    for m in [*classification_metrics(), Loss()]:
        s = m.state(o, 64)
        assert s.dtype == torch.float64 and s.device.type == "cpu" and s.shape == (m.size(),)
        assert not s.requires_grad
    acc = Accuracy().compute(Accuracy().state(o, 64))
    assert acc == pytest.approx(Accuracy().compute(Accuracy().state(out(logits, targets), 64)))


@pytest.mark.parametrize("metric", classification_metrics(), ids=lambda m: m.name)
@pytest.mark.parametrize("missing", ["outputs", "targets"])
def test_missing_outputs_or_targets_names_the_fix(metric: Metric, missing: str) -> None:
    logits, targets = make_data(0, 8)
    o = StepOutput(
        loss=torch.tensor(1.0),
        outputs=None if missing == "outputs" else logits,
        targets=None if missing == "targets" else targets,
    )
    with pytest.raises(StepOutputError) as info:
        metric.state(o, 8)
    text = str(info.value)
    assert missing in text and metric.name in text
    assert "px.StepOutput(loss=loss, outputs=logits, targets=y)" in text


@pytest.mark.parametrize(
    "make",
    [
        lambda: TopKAccuracy(0),
        lambda: TopKAccuracy(-2),
        lambda: TopKAccuracy(2.5),  # type: ignore[arg-type]
        lambda: Precision(1),
        lambda: Recall(0),
        lambda: F1(True),
    ],
)
def test_bad_arguments_raise_invalid_setting(make: object) -> None:
    with pytest.raises(InvalidSettingError, match=r">= [12]") as info:
        make()  # type: ignore[operator]
    assert info.value.code == "PX108"


def test_bad_shapes_and_ranges_raise_step_output_error() -> None:
    logits, targets = make_data(0, 10)
    with pytest.raises(StepOutputError, match="num_classes=4"):
        Precision(4).state(out(logits, targets), 10)
    with pytest.raises(StepOutputError, match=r"must lie in \[0, 6\)"):
        Recall(C).state(out(logits, targets + 6), 10)
    with pytest.raises(StepOutputError, match="9 targets"):
        Accuracy().state(out(logits, targets[:9]), 10)
    with pytest.raises(StepOutputError, match=r"\(N, C\)"):
        TopKAccuracy(2).state(out(logits.argmax(1), targets), 10)
    with pytest.raises(StepOutputError, match="1-D"):
        Accuracy().state(out(logits, targets[:, None]), 10)


def test_loss_is_sample_weighted_mean() -> None:
    m = Loss()
    assert m.name == "loss" and m.higher_is_better is False and m.size() == 2
    losses, sizes = [0.25, 1.0, 3.0], [10, 30, 1]
    states = [
        m.state(StepOutput(loss=torch.tensor(v)), n) for v, n in zip(losses, sizes, strict=True)
    ]
    assert states[0].tolist() == [2.5, 10.0]
    total = torch.stack(states).sum(0)
    assert m.compute(total) == pytest.approx(np.average(losses, weights=sizes))
    assert math.isnan(m.compute(torch.zeros(2, dtype=torch.float64)))


def test_names_and_directions() -> None:
    names = {m.name: m.higher_is_better for m in all_metrics()}
    assert names == {
        "loss": False,
        "accuracy": True,
        "top3_accuracy": True,
        "precision": True,
        "recall": True,
        "f1": True,
    }


def test_loop_metrics_read_stats() -> None:
    stats = LoopStats(lr=0.01, samples_per_s=1234.5)
    assert (LearningRate().name, LearningRate().read(stats)) == ("lr", 0.01)
    assert (SamplesPerSecond().name, SamplesPerSecond().read(stats)) == ("samples_per_s", 1234.5)


class _Epochs:
    """A sink that keeps the epoch events (their wall time) and the steps' metrics."""

    def __init__(self) -> None:
        self.epochs: list[Any] = []
        self.steps: list[Any] = []

    def handle(self, event: Any) -> None:
        from phalanx.events import EpochEnded, StepEnded

        if isinstance(event, EpochEnded):
            self.epochs.append(event)
        elif isinstance(event, StepEnded):
            self.steps.append(event)

    def close(self) -> None:
        pass


def test_loop_metrics_reach_the_history_per_epoch() -> None:
    """``SamplesPerSecond`` gives each epoch's throughput in ``history`` (samples over the
    epoch's wall time) and each step's in its event; ``LearningRate`` the scheduled rate."""
    import functools

    import phalanx as px

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(96, 4, generator=g), torch.randn(96, 1))
    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    halve = functools.partial(torch.optim.lr_scheduler.StepLR, step_size=3, gamma=0.5)
    sink = _Epochs()
    result = px.Learner(
        torch.nn.Linear(4, 1),
        sgd,
        px.mse_step,
        metrics=[LearningRate(), SamplesPerSecond()],
        lr_scheduler=halve,
    ).fit(data, epochs=2, batch_size=32, sinks=[sink])
    for row, event in zip(result.history, sink.epochs, strict=True):
        assert row["train/samples_per_s"] > 0
        # the epoch's 96 samples over (at most) the epoch's wall time
        assert row["train/samples_per_s"] >= 96 / event.seconds * 0.99
    assert [row["train/lr"] for row in result.history] == [0.05, 0.025]
    assert all(s.metrics["samples_per_s"] > 0 and "lr" in s.metrics for s in sink.steps)
    plain = px.Learner(torch.nn.Linear(4, 1), sgd, px.mse_step).fit(
        data, epochs=1, batch_size=32, sinks=[]
    )
    assert "train/samples_per_s" not in plain.history[0]


def test_helpers_layout_and_errors() -> None:
    logits, targets = make_data(4, 50)
    metrics = all_metrics()
    packed = pack_states(metrics, out(logits, targets), 50)
    assert total_size(metrics) == 2 + 2 + 2 + 3 * 3 * C == packed.numel()
    start = 0
    for m in metrics:  # each metric's own state, in list order
        assert torch.equal(packed[start : start + m.size()], m.state(out(logits, targets), 50))
        start += m.size()
    assert total_size([]) == 0 and compute_all([], pack_states([], out(logits, targets), 50)) == {}
    with pytest.raises(InvalidSettingError, match="distinct name"):
        compute_all([Accuracy(), Accuracy()], torch.zeros(4, dtype=torch.float64))
    with pytest.raises(InvalidSettingError, match="pack_states"):
        compute_all(metrics, packed[:-1])

    class Broken(Loss):
        name = "broken"

        def size(self) -> int:
            return 3

    with pytest.raises(InvalidSettingError, match="broken"):
        pack_states([Broken()], out(logits, targets), 50)


class _Broken(Accuracy):
    name = "broken"

    def compute(self, state: torch.Tensor) -> float:
        return state[0].item() / 0.0  # a ZeroDivisionError from Python, not a torch inf

    def state(self, output: StepOutput, samples: int) -> torch.Tensor:
        if output.outputs is None:
            raise KeyError("outputs")
        return super().state(output, samples)


class _ThirdClass(Accuracy):
    name = "third"

    def state(self, output: StepOutput, samples: int) -> torch.Tensor:
        assert output.outputs is not None
        return output.outputs[:, 2].sum().view(1).double()  # IndexError for 2 classes


def test_a_metric_that_raises_is_named_with_its_method_and_the_original_error() -> None:
    from phalanx.errors import MetricError

    metrics = [_Broken(), Accuracy()]
    with pytest.raises(MetricError) as info:
        pack_states(metrics, StepOutput(torch.tensor(1.0)), 2)
    assert "metric 'broken' (_Broken.state) raised KeyError: 'outputs'" in str(info.value)
    assert info.value.code == "PX121"
    # the fix: what the step returned, and the StepOutput a metric of outputs needs
    assert "check 'broken' against the step's outputs and targets (outputs None, targets None)" in (
        info.value.message
    )
    assert "px.StepOutput(loss=..., outputs=..., targets=...)" in info.value.message
    two_classes = StepOutput(torch.tensor(1.0), torch.zeros(4, 2), torch.zeros(4))
    with pytest.raises(MetricError, match=r"\(outputs \(4, 2\), targets \(4,\)\)"):
        pack_states([_ThirdClass()], two_classes, 4)
    output = StepOutput(torch.tensor(1.0), torch.eye(2), torch.tensor([0, 1]))
    with pytest.raises(MetricError, match=r"metric 'broken' \(_Broken.compute\) raised") as info:
        compute_all(metrics, pack_states(metrics, output, 2))
    assert "check 'broken''s compute() against the summed state" in info.value.message


def test_a_steps_states_as_floats_are_pack_states_values_with_the_loss_read_once() -> None:
    """What a step sums (:func:`state_values`): the packed states' values; given the loss
    the step read, the built-in Loss metric's state is made from it, the same floats, and
    a subclass of Loss still has its own ``state`` called."""

    class HalfLoss(Loss):
        name = "half_loss"

        def state(self, output: StepOutput, samples: int) -> torch.Tensor:
            return super().state(output, samples) / 2

    g = torch.Generator().manual_seed(3)
    logits, targets = torch.randn(7, C, generator=g), torch.randint(0, C, (7,), generator=g)
    loss = torch.nn.functional.cross_entropy(logits, targets)
    output = StepOutput(loss=loss, outputs=logits, targets=targets)
    metrics = [Loss(), Accuracy(), HalfLoss()]
    packed = pack_states(metrics, output, 7).tolist()
    assert state_values(metrics, output, 7) == packed
    assert state_values(metrics, output, 7, loss=loss.item()) == packed
    got = state_values(metrics, output, 7, loss=123.0)  # (proof that the float is used)
    assert got[:2] == [123.0 * 7, 7.0] and got[2:] == packed[2:]
    # compute_all on floats and on the tensor: the same values (Loss's own, no tensor)
    loss_of = Loss().compute(torch.tensor(packed[:2], dtype=torch.float64))
    assert compute_all(metrics, packed)["loss"] == loss_of  # (the fast path is Loss's own)
    assert compute_all(metrics, packed) == compute_all(
        metrics, torch.tensor(packed, dtype=torch.float64)
    )
    none = compute_all(metrics, [0.0] * total_size(metrics))
    assert math.isnan(none["loss"]) and math.isnan(Loss().compute(torch.zeros(2)))
