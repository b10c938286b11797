"""Mixed precision: bf16 autocast, and fp16 with a gradient scaler whose overflowing steps
are skipped by every member together, pinned to torch's textbook AMP loop."""

from __future__ import annotations

import functools
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import phalanx as px
from amp_helpers import OVERFLOWING, SKIPS, Collect, halve_each, mlp, mse_step, sgd
from ddp_helpers import make_data
from phalanx.checkpoint.io import list_checkpoints, read_verified
from phalanx.errors import PrecisionError
from phalanx.events import StepEnded
from phalanx.precision import LossScaler, step_scheduler_quietly

DATA = make_data(256, seed=4)
BATCH, EPOCHS = 32, 2  # 8 steps an epoch
STEPS = EPOCHS * len(DATA) // BATCH


def by_hand(
    dtype: torch.dtype, scaler_args: dict[str, float] | None, clip: float | None = None
) -> tuple[nn.Module, list[bool]]:
    """torch's AMP recipe: autocast around forward and loss, scale, step, update."""
    net = mlp()
    optimizer = sgd(net.parameters())
    scaler = torch.amp.GradScaler("cpu", **scaler_args) if scaler_args is not None else None
    x, y = DATA.tensors
    skipped = []
    for _ in range(EPOCHS):
        for start in range(0, len(x), BATCH):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=dtype):
                loss = nn.functional.mse_loss(
                    net(x[start : start + BATCH]), y[start : start + BATCH]
                )
            if scaler is None:
                loss.backward()
                optimizer.step()
                skipped.append(False)
                continue
            before = scaler.get_scale()
            scaler.scale(loss).backward()
            if clip is not None:
                scaler.unscale_(optimizer)
                nn.utils.clip_grad_norm_(net.parameters(), clip)
            scaler.step(optimizer)
            scaler.update()
            skipped.append(scaler.get_scale() < before)
    return net, skipped


def find_key(tree: Any, key: str) -> Any:
    """The value of the first ``key`` in nested dicts (the checkpoint's layout may change)."""
    if isinstance(tree, dict):
        if key in tree:
            return tree[key]
        for value in tree.values():
            found = find_key(value, key)
            if found is not None:
                return found
    return None


def assert_close(a: nn.Module, b: nn.Module, tol: float) -> None:
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.allclose(p, q, rtol=tol, atol=tol), (name, (p - q).abs().max())


def fit(strategy: str, devices: str, precision: str, **kwargs: Any) -> tuple[px.FitResult, Collect]:
    sink = Collect()
    learner = px.Learner(mlp, sgd, mse_step, precision=precision, **kwargs.pop("learner", {}))
    result = learner.fit(
        DATA, epochs=EPOCHS, batch_size=BATCH, shuffle=False, strategy=strategy,
        devices=devices, sinks=[sink], **kwargs,
    )  # fmt: skip
    return result, sink


@pytest.mark.parametrize(("strategy", "devices"), [("single", "cpu"), ("threads", "cpu:0,cpu:1")])
def test_fp16_overflow_skips_the_step_and_training_goes_on(strategy: str, devices: str) -> None:
    reference, skipped = by_hand(torch.float16, OVERFLOWING)
    assert skipped[:SKIPS] == [True] * SKIPS and not any(skipped[SKIPS:])  # the scale forces it
    result, sink = fit(strategy, devices, "16-mixed", learner={"grad_scaler": OVERFLOWING})
    assert sink.skipped() == skipped  # the same steps skipped, then none
    assert result.steps == STEPS and result.ledger_ok  # skipped steps still consumed their data
    assert not result.failures  # a skip is not a failure, and no step was retried
    assert [e.global_step for e in sink.of(StepEnded)] == list(range(1, STEPS + 1))
    # Skipped steps left the weights alone; the others trained like torch's AMP loop.
    assert_close(result.model, reference, tol=2e-3)
    assert not torch.equal(result.model[0].weight, mlp()[0].weight)


@pytest.mark.parametrize(("strategy", "devices"), [("single", "cpu"), ("threads", "cpu:0,cpu:1")])
def test_fp16_clips_the_unscaled_gradients_like_the_amp_recipe(strategy: str, devices: str) -> None:
    scaler = OVERFLOWING
    reference, skipped = by_hand(torch.float16, scaler, clip=0.05)
    assert skipped[:SKIPS] == [True] * SKIPS and not any(skipped[SKIPS:])
    result, sink = fit(
        strategy, devices, "16-mixed", learner={"grad_scaler": scaler, "grad_clip_norm": 0.05}
    )
    assert sink.skipped() == skipped
    assert_close(result.model, reference, tol=2e-3)
    unclipped, _ = fit(strategy, devices, "16-mixed", learner={"grad_scaler": scaler})
    assert not torch.allclose(unclipped.model[0].weight, result.model[0].weight, atol=1e-3)


def test_fp16_without_overflow_matches_the_amp_loop_and_fp32_roughly() -> None:
    reference, skipped = by_hand(torch.float16, {})
    assert not any(skipped)
    result, sink = fit("single", "cpu", "16-mixed")
    assert not any(sink.skipped())
    assert_close(result.model, reference, tol=2e-3)
    full, _ = fit("single", "cpu", "32")
    assert_close(result.model, full.model, tol=5e-2)  # fp16 rounding, not another model


AUTOCAST_SEEN: list[tuple[bool, torch.dtype]] = []


def recording_step(model: nn.Module, batch: Any) -> torch.Tensor:
    AUTOCAST_SEEN.append((torch.is_autocast_enabled("cpu"), model(batch[0]).dtype))
    return mse_step(model, batch)


@pytest.mark.parametrize(("strategy", "devices"), [("single", "cpu"), ("threads", "cpu:0,cpu:1")])
def test_bf16_runs_the_step_under_autocast_like_torch(strategy: str, devices: str) -> None:
    AUTOCAST_SEEN.clear()
    learner = px.Learner(mlp, sgd, recording_step, precision="bf16-mixed")
    result = learner.fit(
        DATA, DATA, epochs=EPOCHS, batch_size=BATCH, shuffle=False, sinks=[],
        strategy=strategy, devices=devices,
    )  # fmt: skip
    assert AUTOCAST_SEEN and all(seen == (True, torch.bfloat16) for seen in AUTOCAST_SEEN)
    calls = 2 * STEPS * (2 if strategy == "threads" else 1)  # each replica's share
    assert len(AUTOCAST_SEEN) == calls  # every training step and validation batch
    reference, _ = by_hand(torch.bfloat16, None)
    assert_close(result.model, reference, tol=1e-2)
    assert not torch.is_autocast_enabled("cpu")  # nothing leaks out of fit


def test_the_scalers_state_is_checkpointed_and_resumed(tmp_path: Any) -> None:
    """Stopped after the skipped steps, then resumed: the resumed run does not start again
    from the huge initial scale (it would skip two more steps) and ends like a straight one."""
    straight, _ = fit("single", "cpu", "16-mixed", learner={"grad_scaler": OVERFLOWING})
    run = str(tmp_path / "run")
    learner = px.Learner(mlp, sgd, mse_step, precision="16-mixed", grad_scaler=OVERFLOWING)
    sink = Collect()

    class StopAt:
        def handle(self, event: Any) -> None:
            if getattr(event, "global_step", None) == 5:
                learner.stop("test")

        def close(self) -> None:
            pass

    first = learner.fit(
        DATA, epochs=EPOCHS, batch_size=BATCH, shuffle=False, run_dir=run, sinks=[StopAt()]
    )
    assert first.interrupted and first.steps == 6  # (the stop is read in the next vote)
    (path, _), *_ = reversed(list_checkpoints(tmp_path / "run" / "checkpoints"))
    scaler = find_key(read_verified(path), "scaler")
    assert scaler["scale"] == 2.0**12  # backed off twice
    second = learner.fit(
        DATA, epochs=EPOCHS, batch_size=BATCH, shuffle=False, run_dir=run, resume=True,
        sinks=[sink],
    )  # fmt: skip
    assert not any(sink.skipped())
    assert_close(second.model, straight.model, tol=1e-6)


@pytest.mark.slow
def test_ddp_skips_together_and_matches_single() -> None:
    """Two workers, the same forced overflows: the same steps skipped as single, the same
    weights (a member that stepped while the other skipped would drift apart, and the averaged
    gradients after it would differ). The per-epoch scheduler steps on every member."""
    args = {
        "grad_scaler": OVERFLOWING,
        "lr_scheduler": halve_each,
        "lr_scheduler_interval": "epoch",
    }
    single, single_sink = fit("single", "cpu", "16-mixed", learner=args)
    ddp, sink = fit("ddp", "cpu:0,cpu:1", "16-mixed", learner=args)
    assert sink.skipped() == single_sink.skipped() and sum(sink.skipped()) == SKIPS
    assert ddp.ledger_ok and ddp.steps == STEPS and not ddp.failures  # no failure, no retry
    assert [h["train/lr"] for h in ddp.history] == [0.05, 0.025]  # once per epoch
    assert_close(ddp.model, single.model, tol=2e-3)


@pytest.mark.slow
def test_ddp_bf16_matches_single() -> None:
    single, _ = fit("single", "cpu", "bf16-mixed")
    ddp, sink = fit("ddp", "cpu:0,cpu:1", "bf16-mixed")
    assert not any(sink.skipped()) and ddp.steps == STEPS
    assert_close(ddp.model, single.model, tol=1e-2)  # bf16 rounding of two half-batches
    assert not torch.equal(ddp.model[0].weight, mlp()[0].weight)


@pytest.mark.slow
def test_ddp_replacement_takes_the_scalers_state_in_the_hand_over() -> None:
    """A worker killed after the skipped steps is replaced; the replacement takes the scale
    from its peer (a fresh 2**36 would make its gradients overflow, or average garbage)."""
    single, _ = fit("single", "cpu", "16-mixed", learner={"grad_scaler": OVERFLOWING})
    ddp, sink = fit(
        "ddp", "cpu:0,cpu:1", "16-mixed", learner={"grad_scaler": OVERFLOWING},
        faults=[px.Fault("kill", worker=1, step=6)],
    )  # fmt: skip
    assert [f.kind for f in ddp.failures] == ["crash"]
    assert sum(sink.skipped()) == SKIPS and ddp.ledger_ok and ddp.steps == STEPS
    assert_close(ddp.model, single.model, tol=2e-3)


@pytest.mark.parametrize(
    ("kwargs", "text"),
    [
        ({"precision": "fp16"}, "'fp16': float16 autocast with a loss scaler is "),
        ({"precision": "16"}, 'Lightning 1.x\'s name for "16-mixed"'),
        ({"precision": "bf16"}, 'Lightning 1.x\'s name for "bf16-mixed"'),
        ({"precision": "16-true"}, "does not offer it"),
        ({"precision": "half"}, "'half' is unknown"),
        ({"precision": "bf16-mixed", "grad_scaler": {"init_scale": 2.0}}, "only '16-mixed'"),
        ({"precision": "16-mixed", "grad_scaler": {"init_scal": 2.0}}, "init_scal"),
    ],
)
def test_bad_precision_settings_are_refused_before_start(kwargs: dict[str, Any], text: str) -> None:
    learner = px.Learner(mlp, functools.partial(torch.optim.SGD, lr=0.1), mse_step, **kwargs)
    with pytest.raises(PrecisionError, match=text) as info:
        learner.fit(DATA, strategy="ddp", devices="cpu:0,cpu:1", sinks=[])
    assert info.value.code == "PX130"


def scaler_after_backward(scale: float) -> tuple[LossScaler, nn.Module, torch.optim.Optimizer]:
    net = mlp()
    optimizer = sgd(net.parameters())
    scaler = LossScaler(torch.device("cpu"), optimizer, {"init_scale": scale})
    x, y = DATA.tensors
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(net(x[:BATCH]), y[:BATCH])
    scaler.scale(loss).backward()
    return scaler, net, optimizer


def test_the_vote_decides_the_skip_even_where_this_member_saw_no_overflow() -> None:
    """A member whose own gradients were finite still skips, and backs its scale off the same
    way, when the vote says another member's overflowed: the scales stay equal."""
    scaler, net, optimizer = scaler_after_backward(2.0**8)
    assert scaler.unscale() is False  # finite here
    before = [p.detach().clone() for p in net.parameters()]
    scheduler = halve_each(optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()"
        scaler.skip()
        step_scheduler_quietly(scheduler, optimizer_stepped=False)
    assert scaler.get_scale() == 2.0**7
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters(), strict=True))


def test_a_discarded_attempt_keeps_the_scale_and_can_unscale_again() -> None:
    scaler, net, optimizer = scaler_after_backward(2.0**40)
    assert scaler.unscale() is True  # overflowed
    scaler.reset()  # the attempt failed elsewhere: retried, not skipped
    assert scaler.get_scale() == 2.0**40
    optimizer.zero_grad()
    x, y = DATA.tensors
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(net(x[:BATCH]), y[:BATCH])
    scaler.scale(loss).backward()
    assert scaler.unscale() is True  # (torch refuses a second unscale_ without the reset)
    scaler.skip()
    assert scaler.get_scale() == 2.0**39


def test_lightnings_32_true_is_plain_float32() -> None:
    for name in ("32-true", 32, "32"):
        learner = px.Learner(
            mlp, functools.partial(torch.optim.SGD, lr=0.1), mse_step, precision=name
        )
        assert learner.spec.precision.name == "32"
    result = learner.fit(DATA, sinks=[])
    assert result.steps > 0


def test_16_mixed_on_cpu_gives_a_warning_and_not_on_32() -> None:
    from phalanx.events import Notice
    from recorder import Recorder

    for name, warned in (("16-mixed", True), ("32", False)):
        rec = Recorder()
        learner = px.Learner(
            mlp, functools.partial(torch.optim.SGD, lr=0.1), mse_step, precision=name
        )
        learner.fit(DATA, max_steps=1, sinks=[rec])
        slow = [n for n in rec.of(Notice) if "float16 CPU kernels" in n.text]
        assert len(slow) == int(warned)
        if warned:
            assert slow[0].level == "warning" and 'precision="32"' in slow[0].text
