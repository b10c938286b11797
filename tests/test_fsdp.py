"""strategy="fsdp": the model's parameters, gradients and optimizer state sharded among the
workers (FSDP2 over gloo), trained to the weights of one device and of ddp, through
failures that lose no shard; what it does not take yet is refused before anything starts."""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import fsdp_helpers as h
import phalanx as px
from amp_helpers import Collect
from phalanx.checkpoint.io import list_checkpoints
from phalanx.errors import (
    CheckpointError,
    CheckpointMismatchError,
    InvalidSettingError,
    TrainingFailed,
)
from phalanx.sharding import innermost_first, units
from phalanx.snapshot.shards import ShardSet, Written, newest_set, reshard, rows, tag
from phalanx.snapshot.store import MAPPED_BYTES
from phalanx.spec import FitConfig
from phalanx.strategies.ddp.coordinator.roster import StateCopies
from phalanx.strategies.ddp.worker.fsdp_engine import box_carrier
from phalanx.validate import validate_sharding

TRAIN, VALID = h.data(62), h.data(20, seed=1)  # 62 = 5 x 12 + 2: the last batch is 2 rows
FIT: dict[str, Any] = dict(epochs=2, batch_size=12, seed=3, sinks=[])


def learner(**kw: Any) -> px.Learner:
    kw.setdefault("grad_accumulation", 2)
    kw.setdefault("grad_clip_norm", 0.5)
    return px.Learner(kw.pop("model", h.net), kw.pop("optimizer", h.adam), h.step, **kw)


def rel(a: nn.Module, b: nn.Module) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    return max(
        ((sa[k] - sb[k]).abs().max() / sb[k].abs().max().clamp_min(1e-12)).item() for k in sb
    )


@pytest.fixture(scope="module")
def single() -> px.FitResult:
    return learner().fit(TRAIN, VALID, devices="cpu", **FIT)


@pytest.fixture(scope="module")
def fsdp2() -> px.FitResult:
    return learner().fit(TRAIN, VALID, devices="cpu:0,cpu:1", strategy="fsdp", **FIT)


# -- which modules are units --------------------------------------------------------------


class Gpt(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 32)
        self.blocks = nn.ModuleList(h.Block() for _ in range(12))
        self.norm = nn.LayerNorm(32)  # (64 parameters: too small to be a unit)
        self.head = nn.Linear(32, 100)


def test_the_default_rule_makes_each_block_a_unit_and_leaves_small_modules_to_the_root() -> None:
    model = Gpt()
    found = units(model)
    assert found == [model.embed, *model.blocks, model.head]
    assert model.norm not in found


def test_the_default_rule_looks_inside_containers_and_wrappers_of_most_parameters() -> None:
    inner = nn.Sequential(*(nn.Linear(64, 64) for _ in range(6)))
    model = nn.Sequential(nn.Linear(4, 64), nn.Sequential(inner, nn.ReLU()))
    found = units(model)
    assert found == list(inner)  # (the wrapper holds nearly all: its layers are the units)


def test_units_by_class_or_by_function_and_innermost_first() -> None:
    model = Gpt()
    assert units(model, (h.Block,)) == list(model.blocks)
    assert units(model, h.Block) == list(model.blocks)
    chosen = units(model, lambda m: isinstance(m, h.Block | nn.Linear))
    assert model.blocks[0] in chosen and model.blocks[0].up in chosen
    ordered = innermost_first(chosen)
    assert ordered.index(model.blocks[0].up) < ordered.index(model.blocks[0])
    assert len(ordered) == len(chosen)


def test_the_box_is_carried_by_the_last_unit_only_where_the_root_would_hold_it_alone() -> None:
    """Every parameter in a unit: the last unit among the model's modules carries the
    vote's box; a parameter left to the root (the Gpt's final norm, a Net's input layer,
    weights tied across units), or no unit at all: the root carries it."""
    net = h.Net()
    assert box_carrier(net, innermost_first(units(net, (nn.Linear, h.Block)))) is net.out
    assert box_carrier(net, units(net, nn.Linear)) is None  # (the blocks' norms: the root)
    assert box_carrier(net, units(net)) is None  # (inp and out stay in the root)
    assert box_carrier(net, []) is None
    gpt = Gpt()
    assert box_carrier(gpt, units(gpt)) is None  # (its final norm)
    gpt.norm = nn.Identity()  # type: ignore[assignment]
    assert box_carrier(gpt, units(gpt)) is gpt.head
    gpt.head.weight = gpt.embed.weight  # (tied: the head is no unit, the root holds it)
    assert box_carrier(gpt, units(gpt)) is None


@pytest.mark.timeout(120)
def test_a_carrier_the_forward_does_not_use_leaves_the_vote_to_an_all_reduce(
    single: px.FitResult,
) -> None:
    """The last unit among the model's modules is never called (an unused head): its
    output takes no ballot, so each vote is summed in an all-reduce of its own; a data
    failure is still retried, and the run ends with one device's weights."""
    fault = px.Fault.parse("exception:1@3/data")
    result = px.Learner(h.unused_head_net, h.adam, h.step, grad_accumulation=2).fit(
        TRAIN, VALID, devices="cpu:0,cpu:1", strategy="fsdp", shard=(nn.Linear, h.Block),
        faults=[fault], **FIT,
    )  # fmt: skip
    reference = px.Learner(h.unused_head_net, h.adam, h.step, grad_accumulation=2).fit(
        TRAIN, VALID, devices="cpu", **FIT
    )
    assert [(f.phase, f.action) for f in result.failures] == [("data", "retried")]
    assert rel(result.model, reference.model) <= 1e-5 and result.ledger_ok is True
    model = h.unused_head_net()
    assert box_carrier(model, innermost_first(units(model, (nn.Linear, h.Block)))) is model.unused


@pytest.mark.timeout(120)
def test_a_box_carried_by_a_unit_counts_every_vote_through_failures(
    single: px.FitResult,
) -> None:
    """Every Linear and block a unit (the root holds nothing): the vote rides the output layer's
    reduce-scatter through accumulation, clipping, validation's padding, a failure in
    data (the vote carries it), one in backward (the group rebuilt) and a kill (a
    replacement from the set): one device's weights, every sample once."""
    faults = [px.Fault.parse(f) for f in ("exception:1@3/data", "exception:0@6/backward")]
    result = learner().fit(
        TRAIN, VALID, devices="cpu:0,cpu:1,cpu:2", strategy="fsdp",
        shard=(nn.Linear, h.Block), faults=[*faults, px.Fault.parse("kill:2@9")], **FIT,
    )  # fmt: skip
    assert [(f.phase, f.action) for f in result.failures] == [
        ("data", "retried"),
        ("backward", "retried"),
        ("forward", "respawned"),
    ]
    assert rel(result.model, single.model) <= 1e-5 and result.ledger_ok is True
    assert result.history[-1]["valid/loss"] == pytest.approx(
        single.history[-1]["valid/loss"], rel=1e-5
    )


# -- refused before anything starts --------------------------------------------------------


def test_more_members_than_a_snapshot_tag_holds_are_refused_counting_every_node() -> None:
    config = FitConfig(
        epochs=1, batch_size=8, devices=[f"cpu:{i}" for i in range(8)], strategy="fsdp"
    )
    validate_sharding(config, nodes=31)  # (248 members)
    with pytest.raises(InvalidSettingError, match=r"not 256 \(32 nodes of 8\)"):
        validate_sharding(config, nodes=32)


@pytest.mark.parametrize(
    ("kw", "says"),
    [
        (dict(strategy="ddp", shard=(h.Block,)), "strategy=\"fsdp\" shards, but strategy='ddp'"),
        (dict(strategy="fsdp", on_bad_sample="skip"), 'does not take on_bad_sample="skip" yet'),
        (dict(strategy="fsdp", shard=3), "fit()'s shard must be None, module classes"),
        (dict(strategy="ddp", gather=False), "strategy='ddp' holds the whole model anyway"),
        (dict(strategy="fsdp", gather=False), "gather=False leaves the final weights in"),
        (dict(strategy="ddp", mp_policy=h.BF16), "but strategy='ddp': drop mp_policy="),
        (dict(strategy="fsdp", mp_policy=h.FP16), "torch.float16 needs a loss scaler"),
        (dict(strategy="fsdp", mp_policy="bf16"), "must be None or a torch.distributed.fsdp"),
        (dict(strategy="fsdp", mp_policy=h.BF16, precision="bf16-mixed"), "keep precision='32'"),
    ],
)
def test_what_fsdp_does_not_take_is_refused_with_the_fix(
    kw: dict[str, Any], says: str, tmp_path: Any
) -> None:
    if kw.get("run_dir") == "RUN":
        kw["run_dir"] = str(tmp_path / "run")
    precision = kw.pop("precision", "32")
    with pytest.raises(px.ConfigError) as err:
        learner(precision=precision).fit(TRAIN, devices="cpu:0,cpu:1", **kw, **FIT)
    assert says in str(err.value)
    assert not (tmp_path / "run").exists()


@pytest.mark.timeout(120)
def test_16_mixed_skips_on_every_member_when_one_members_shards_overflow() -> None:
    """Only the second member's gradient shards overflow (its rows are output 3's): the
    members agree (with the clipping norm, in one all-reduce) and all skip, the scale
    backs off on each, and the run ends with ddp's weights and skipped steps, one device's
    within fp16's rounding of partial sums over other rows (ddp's differ from it as
    much). (The back-off is steep: the first step overflows, the next ones do not.)"""
    scaler = {"init_scale": 2.0**16, "backoff_factor": 1e-4}
    args = dict(precision="16-mixed", grad_scaler=scaler, grad_accumulation=2, grad_clip_norm=0.5)
    runs = {}
    for devices, strategy in (("cpu", "single"), ("cpu:0,cpu:1", "ddp"), ("cpu:0,cpu:1", "fsdp")):
        sink = Collect()
        result = px.Learner(h.head, h.sgd, h.last_output_step, **args).fit(  # type: ignore[arg-type]
            TRAIN, devices=devices, strategy=strategy, **dict(FIT, sinks=[sink])
        )
        runs[strategy] = result, sink.skipped()
    (single, skipped), (ddp, _), (fsdp, fsdp_skipped) = runs.values()
    assert fsdp_skipped == skipped == [True] + [False] * 11
    assert rel(fsdp.model, ddp.model) <= 1e-5 and rel(fsdp.model, single.model) <= 1e-3
    assert rel(fsdp.model, h.head()) > 1e-2
    assert fsdp.ledger_ok is True and fsdp.failures == []


@pytest.mark.timeout(120)
def test_16_mixed_a_failure_before_any_gather_is_retried_a_kill_respawned_with_the_scale() -> None:
    """A member that fails in its data phase still takes part in the vote (zero passes); the
    others must not unscale then (under fsdp that is a collective the failed one skips):
    the attempt is retried and the run ends as a clean one. A killed member's replacement
    starts from the shard snapshots with the scaler's state."""
    args = dict(precision="16-mixed", grad_accumulation=2, grad_clip_norm=0.5)
    make = functools.partial(px.Learner, h.head, h.sgd, h.last_output_step, **args)
    clean = make().fit(TRAIN, devices="cpu:0,cpu:1", strategy="fsdp", **FIT)
    fault = px.Fault("exception", worker=0, step=3, phase="data")
    result = make().fit(TRAIN, devices="cpu:0,cpu:1", strategy="fsdp", faults=[fault], **FIT)
    [failure] = result.failures
    assert (failure.worker, failure.phase, failure.action) == (0, "data", "retried")
    assert rel(result.model, clean.model) <= 1e-6 and result.ledger_ok is True
    # A replacement takes the scaler's state with the shards (a fresh scale would overflow
    # its next step, which every member would then skip)
    killed = make(grad_scaler={"init_scale": 2.0**16, "backoff_factor": 1e-4})
    steep = killed.fit(TRAIN, devices="cpu:0,cpu:1", strategy="fsdp", **FIT)
    fault = px.Fault("kill", worker=1, step=7)
    result = killed.fit(TRAIN, devices="cpu:0,cpu:1", strategy="fsdp", faults=[fault], **FIT)
    assert [f.action for f in result.failures] == ["respawned"]
    # (until the replacement joins, the survivor trains alone, a world of one, whose sums
    # round otherwise: rel 1e-7 in float32, 3e-5 through fp16; a step skipped for a fresh
    # scale would be 1e-2)
    assert rel(result.model, steep.model) <= 1e-4 and result.ledger_ok is True


# -- the same math as one device -----------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [2, 3, 4])
def test_fsdp_trains_to_one_devices_weights(
    workers: int, single: px.FitResult, fsdp2: px.FitResult
) -> None:
    """Adam, 2 micro-batches, clipping, 12-row batches split 6/6, 4/4/4, 3/3/3/3, and a last
    batch of 2 rows (at 3 and 4 workers some members have none: template passes only)."""
    devices = ",".join(f"cpu:{i}" for i in range(workers))
    result = (
        fsdp2
        if workers == 2
        else learner().fit(TRAIN, VALID, devices=devices, strategy="fsdp", **FIT)
    )
    assert result.steps == single.steps == 12
    assert rel(result.model, single.model) <= 1e-5
    assert rel(result.model, h.Net()) > 1e-3  # (it trained)
    assert result.ledger_ok is True and result.failures == []
    assert "box" not in " ".join(result.model.state_dict())
    assert type(result.model) is h.Net and next(result.model.parameters()).device.type == "cpu"
    for mine, ref in zip(result.history, single.history, strict=True):
        assert mine["train/loss"] == pytest.approx(ref["train/loss"], rel=1e-5)
        assert mine["valid/loss"] == pytest.approx(ref["valid/loss"], rel=1e-5)


@pytest.mark.timeout(120)
def test_fsdp_equals_ddp_with_bf16_autocast_and_units_by_class() -> None:
    fit = dict(FIT, epochs=1)
    ddp = learner(precision="bf16-mixed", optimizer=h.sgd).fit(
        TRAIN, devices="cpu:0,cpu:1", strategy="ddp", **fit
    )
    fsdp = learner(precision="bf16-mixed", optimizer=h.sgd).fit(
        TRAIN, devices="cpu:0,cpu:1", strategy="fsdp", shard=(h.Block,), **fit
    )
    assert rel(fsdp.model, ddp.model) <= 1e-5
    assert fsdp.history[0]["train/loss"] == pytest.approx(ddp.history[0]["train/loss"], rel=1e-5)


@pytest.mark.timeout(150)
def test_an_mp_policy_computes_in_bfloat16_keeps_float32_shards_and_recovers(
    fsdp2: px.FitResult,
) -> None:
    """FSDP2's MixedPrecisionPolicy on every unit and on the model's own parameters (the
    step fails unless the output layer, in the root, computed in bfloat16), which carry the
    vote's box in 8-bit pieces; the shards, the optimizer and the result stay float32. The
    same members retrying a step change nothing; another world size (3 workers, or 1 while
    a killed worker is respawned) rounds its partial sums in bfloat16 otherwise, far less
    than float32's run differs."""
    make = functools.partial(
        px.Learner, h.net, h.adam, h.bf16_step, grad_accumulation=2, grad_clip_norm=0.5
    )
    fit = dict(FIT, strategy="fsdp", mp_policy=h.BF16)
    clean = make().fit(TRAIN, VALID, devices="cpu:0,cpu:1", **fit)
    assert clean.failures == [] and clean.ledger_ok is True and clean.steps == 12
    assert type(clean.model) is h.Net
    assert {v.dtype for v in clean.model.state_dict().values()} == {torch.float32}
    far = rel(clean.model, fsdp2.model)  # (float32's run: the same data, step and seed)
    assert far > 5e-2
    three = make().fit(TRAIN, VALID, devices=fsdp_devices(3), **fit)
    assert three.failures == [] and rel(three.model, clean.model) <= far / 4
    fault = px.Fault("exception", worker=1, step=4, phase="backward")
    retried = make().fit(TRAIN, VALID, devices="cpu:0,cpu:1", faults=[fault], **fit)
    [failure] = retried.failures
    assert (failure.worker, failure.phase, failure.action) == (1, "backward", "retried")
    assert rel(retried.model, clean.model) <= 1e-6 and retried.ledger_ok is True
    fault = px.Fault("kill", worker=1, step=5)
    killed = make().fit(TRAIN, VALID, devices="cpu:0,cpu:1", faults=[fault], **fit)
    assert [f.action for f in killed.failures] == ["respawned"] and killed.ledger_ok is True
    assert rel(killed.model, clean.model) <= far / 4
    # Every parameter in a unit: the box rides the last unit's bfloat16 collectives (8-bit
    # pieces), through accumulation's zero deliveries and a failure the vote carries; the
    # policy casts outputs to float32 (the holder's too: the box is taken as it is gathered)
    fault = px.Fault("exception", worker=0, step=3, phase="data")
    policy = dataclasses.replace(h.BF16, output_dtype=torch.float32)
    units_only = px.Learner(h.net, h.adam, h.step, grad_accumulation=2, grad_clip_norm=0.5).fit(
        TRAIN, VALID, devices="cpu:0,cpu:1", shard=(nn.Linear, h.Block), faults=[fault],
        **dict(fit, mp_policy=policy),
    )  # fmt: skip
    assert [(f.phase, f.action) for f in units_only.failures] == [("data", "retried")]
    assert rel(units_only.model, clean.model) <= far / 4 and units_only.ledger_ok is True


# -- failures that lose no shard -----------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("phase", ["data", "forward", "backward"])
def test_an_exception_in_a_step_is_retried_and_changes_nothing(
    phase: str, fsdp2: px.FitResult
) -> None:
    """In ``data`` (before any gather) the member's zero passes line the step up and the
    vote carries the failure; in ``forward`` or ``backward`` (shards gathered) it leaves the
    group, its peers' collectives fail at once, and the same members rebuild the generation,
    each from the shards it kept."""
    fault = px.Fault("exception", worker=1, step=4, phase=phase)
    started = time.monotonic()
    result = learner().fit(
        TRAIN, VALID, devices="cpu:0,cpu:1", strategy="fsdp", faults=[fault], **FIT
    )
    assert time.monotonic() - started < 60
    assert rel(result.model, fsdp2.model) <= 1e-6
    assert result.steps == fsdp2.steps and result.ledger_ok is True
    [failure] = result.failures
    assert (failure.worker, failure.step, failure.phase) == (1, 4, phase)
    assert "injected exception" in failure.message
    assert failure.recovery_seconds is not None and failure.recovery_seconds < 10


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("fault", "mode", "every"),
    [
        ("kill:1@4", "shrink", 1),
        ("kill:0@9/backward", "respawn", None),
        ("oom:2@3/backward", "respawn", None),
    ],
)
def test_a_lost_worker_is_survived_from_the_shard_set(
    fault: str, mode: str, every: int | None, single: px.FitResult
) -> None:
    """The survivors (and a replacement) take the newest complete set of shard snapshots,
    re-sharded to the new world, and compute the steps since again: one device's weights,
    every sample once; snapshots every step replay at most one step, the measured cadence
    (agreed by the members after their 4th commit) at most its own. (An out-of-memory
    error is an exception under fsdp: no split, the group is rebuilt and the step
    retried.)"""
    started = time.monotonic()
    result = learner().fit(
        TRAIN, VALID, devices="cpu:0,cpu:1,cpu:2", strategy="fsdp",
        faults=[px.Fault.parse(fault)], on_failure=px.Recovery(mode=mode),
        snapshots=px.Snapshots(every_steps=every), **FIT,
    )  # fmt: skip
    assert time.monotonic() - started < 60
    assert rel(result.model, single.model) <= 1e-5
    assert result.steps == single.steps and result.ledger_ok is True
    [failure] = result.failures
    f = px.Fault.parse(fault)
    assert (failure.worker, failure.step) == (f.worker, f.step)
    assert failure.recovery_seconds is not None and failure.recovery_seconds < 10
    if f.kind == "kill":
        assert failure.kind == "crash" and failure.action == {"shrink": "shrunk"}.get(
            mode, mode + "ed"
        )
        assert failure.replayed_steps is not None
        assert 0 <= failure.replayed_steps <= (every or f.step - 4)
    else:
        assert (failure.kind, failure.action) == ("oom", "retried")


@pytest.mark.timeout(120)
def test_a_shrink_cuts_each_members_rows_out_of_mapped_snapshots() -> None:
    """Shards large enough for a mapped read (a block's weight: 512 KiB, 3 members): every
    member of the new generation cuts its rows out of the old ranks' snapshots as views of
    shared memory, and the run ends with one device's weights."""
    make = functools.partial(learner, model=h.wide_net, optimizer=h.sgd)  # (Adam would
    # magnify float32 rounding of other sums here: 3e-4 for a clean fsdp run)
    weight = h.wide_net().blocks[0].up.weight  # type: ignore[index]
    assert weight.nbytes // 3 >= MAPPED_BYTES  # (a member's shard of it)
    single = make().fit(TRAIN, devices="cpu", **FIT)
    result = make().fit(
        TRAIN, devices="cpu:0,cpu:1,cpu:2", strategy="fsdp", faults=[px.Fault.parse("kill:1@5")],
        on_failure=px.Recovery(mode="shrink"), snapshots=px.Snapshots(every_steps=2), **FIT,
    )  # fmt: skip
    [failure] = result.failures
    assert failure.action == "shrunk" and failure.replayed_steps in (0, 1)
    assert rel(result.model, single.model) <= 1e-5 and result.ledger_ok is True


@pytest.mark.timeout(120)
def test_a_data_failure_zero_passes_a_batchnorm_model_and_changes_nothing() -> None:
    """The zero pass runs a template of the run's first samples (two rows: BatchNorm1d
    refuses one in training mode), its running statistics put back."""
    fit = dict(FIT, epochs=1)
    norm, even = px.Learner(h.norm_net, h.sgd, h.step), h.data(60)  # (6 rows a member)
    clean = norm.fit(even, devices="cpu:0,cpu:1", strategy="fsdp", **fit)
    fault = px.Fault("exception", worker=0, step=2, phase="data")
    result = norm.fit(even, devices="cpu:0,cpu:1", strategy="fsdp", faults=[fault], **fit)
    assert [f.action for f in result.failures] == ["retried"]
    assert rel(result.model, clean.model) <= 1e-6  # (running statistics included)


@pytest.mark.timeout(120)
def test_a_failure_in_a_units_backward_without_clipping_is_retried(
    fsdp2: px.FitResult,
) -> None:
    """Every Linear a unit (the first layer's parameters sharded between passes), no
    clipping: the fault fires inside the backward, before the root's reduce-scatter carries
    the vote, so no member commits the step; the same members rebuild and retry it."""
    plain = learner(grad_clip_norm=None)
    fit = dict(FIT, epochs=1)
    clean = plain.fit(TRAIN, devices="cpu:0,cpu:1", strategy="fsdp", shard=(nn.Linear,), **fit)
    fault = px.Fault("exception", worker=1, step=3, phase="backward")
    result = plain.fit(
        TRAIN, devices="cpu:0,cpu:1", strategy="fsdp", shard=(nn.Linear,), faults=[fault], **fit
    )
    [failure] = result.failures
    assert (failure.phase, failure.action) == ("backward", "retried")
    assert rel(result.model, clean.model) <= 1e-6 and result.ledger_ok is True


@pytest.mark.timeout(150)
def test_a_second_loss_right_after_a_restore_finds_the_set_still_whole(
    single: px.FitResult,
) -> None:
    """Worker 1 killed in step 5, worker 2 in step 6: the second shrink finds a complete
    set, though the survivors' first snapshots after the first restore went into their
    buffers (each forgot its snapshots newer than the set it restored)."""
    faults = [px.Fault("kill", worker=1, step=4), px.Fault("kill", worker=2, step=5)]
    result = learner().fit(
        TRAIN, VALID, devices="cpu:0,cpu:1,cpu:2", strategy="fsdp", faults=faults,
        on_failure=px.Recovery(mode="shrink"), snapshots=px.Snapshots(every_steps=1), **FIT,
    )  # fmt: skip
    assert [f.action for f in result.failures] == ["shrunk", "shrunk"]
    assert rel(result.model, single.model) <= 1e-5 and result.ledger_ok is True


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("fault", "mode", "action"),
    [
        ("kill:2@5/optimizer", "shrink", "shrunk"),  # (the last worker, in its commit)
        ("kill:0@5/data", "respawn", "respawned"),  # (the first, before any gather)
        ("hang:2@4/forward", "respawn", "respawned"),  # (its peers wait in an all-gather)
        ("exception:0@5/sync", "respawn", "retried"),  # (after forward's gathers: rebuilt)
    ],
)
def test_the_fault_matrix_rows_end_with_one_devices_weights(
    fault: str, mode: str, action: str, single: px.FitResult
) -> None:
    """Rows of ddp's fault matrix under fsdp (first and last worker, other phases): each
    failure named where it happened, the run goes on, one device's weights, every sample
    once."""
    f = px.Fault.parse(fault)
    result = learner().fit(
        TRAIN, VALID, devices="cpu:0,cpu:1,cpu:2", strategy="fsdp", faults=[f],
        on_failure=px.Recovery(mode=mode), hang_timeout=3, **FIT,
    )  # fmt: skip
    [failure] = result.failures
    kind = {"kill": "crash"}.get(f.kind, f.kind)
    assert (failure.worker, failure.kind, failure.step, failure.action) == (
        f.worker, kind, f.step, action,
    )  # fmt: skip
    assert failure.phase == f.phase
    assert rel(result.model, single.model) <= 1e-5 and result.ledger_ok is True


@pytest.mark.timeout(150)
@pytest.mark.parametrize("source", ["snapshots", "checkpoint"])
def test_every_worker_lost_restarts_from_the_newest_copy(
    source: str, single: px.FitResult, tmp_path: Path
) -> None:
    """All three members killed in one step: every slot starts again, from the newest
    complete shard set in shared memory, or (snapshots off) from the newest sharded
    checkpoint, and computes the steps since again."""
    faults = [px.Fault("kill", worker=w, step=4) for w in range(3)]
    extra: dict[str, Any] = (
        {}
        if source == "snapshots"
        else dict(
            snapshots=False, run_dir=str(tmp_path / "run"), checkpoint=px.Checkpoints(every_steps=3)
        )
    )
    result = learner().fit(
        TRAIN, VALID, devices="cpu:0,cpu:1,cpu:2", strategy="fsdp", faults=faults, **extra,
        **FIT,
    )  # fmt: skip
    assert rel(result.model, single.model) <= 1e-5
    assert result.ledger_ok is True and result.steps == single.steps
    # (with snapshots off the first death alone restarts every slot, and a death seen after
    # that decision may be answered by a restart of its own: one or more restarts)
    assert {f.action for f in result.failures} <= {"restarted", "respawned"}
    restarted = [f for f in result.failures if f.action == "restarted"]
    assert restarted and restarted[-1].replayed_steps is not None
    if source == "checkpoint":
        # (the checkpoint is step 3's; the deaths came in step 5, and the head counts step 4
        # committed once rank 0's word of it is read, which may come after the deaths)
        assert restarted[-1].replayed_steps in (0, 1)


@pytest.mark.timeout(120)
def test_a_hung_worker_is_named_not_the_peers_that_wait_for_it(single: px.FitResult) -> None:
    """Worker 0 hangs in the first micro-batch's backward; its peers wait for it in the
    next micro-batch's forward (an earlier phase by their heartbeats: under fsdp every pass
    gathers shards). The hung one is named and replaced; nothing else fails."""
    fault = px.Fault("hang", worker=0, step=6, phase="backward")
    result = learner().fit(
        TRAIN, VALID, devices="cpu:0,cpu:1,cpu:2", strategy="fsdp", faults=[fault],
        hang_timeout=3, **FIT,
    )  # fmt: skip
    [failure] = result.failures
    assert (failure.worker, failure.kind, failure.action) == (0, "hang", "respawned")
    assert rel(result.model, single.model) <= 1e-5 and result.ledger_ok is True


@pytest.mark.timeout(120)
def test_without_snapshots_a_lost_worker_ends_the_run_with_one_report() -> None:
    fault = px.Fault("kill", worker=1, step=4)
    started = time.monotonic()
    with pytest.raises(TrainingFailed) as err:
        learner().fit(
            TRAIN, devices="cpu:0,cpu:1,cpu:2", strategy="fsdp", faults=[fault],
            snapshots=False, **FIT,
        )  # fmt: skip
    assert time.monotonic() - started < 40
    root = err.value.root_cause
    assert (root.worker, root.kind, root.step) == (1, "crash", 4)
    assert "no copy of a lost worker's shards" in str(err.value)


def losing(tmp_path: Path) -> px.Learner:
    """A learner whose worker 1 is lost at step 4 (5th micro-batch pair) with its slot's shard
    snapshots: the set the coordinator heard of is not there (fsdp_helpers.losing_step)."""
    marker = str(tmp_path / "lost-once")
    step = functools.partial(h.losing_step, agent=os.getpid(), marker=marker)
    return px.Learner(h.net, h.adam, step, grad_accumulation=2, grad_clip_norm=0.5)


@pytest.mark.timeout(120)
def test_a_set_counted_but_not_there_restarts_every_slot_from_the_checkpoint(
    tmp_path: Path, single: px.FitResult
) -> None:
    """The window of two losses close together, made for real: worker 1 is killed after
    removing its snapshots. The survivors find no set; the first to say so is recorded once
    and every slot starts again from the newest checkpoint: no worker is respawned for it,
    the steps since are computed again, the weights end as one device's."""
    result = losing(tmp_path).fit(
        TRAIN, VALID, devices="cpu:0,cpu:1,cpu:2", strategy="fsdp", run_dir=tmp_path / "run",
        checkpoint=px.Checkpoints(every_steps=3), **FIT,
    )  # fmt: skip
    lost, found = result.failures
    assert (lost.worker, lost.kind, lost.step) == (1, "crash", 4)  # (the 5th step: 4 committed)
    said = (found.exception_type, found.phase, found.action)
    assert said == ("NoShardSet", "regroup", "restarted")
    assert found.replayed_steps == 1  # (from the checkpoint of step 3: the 4th again)
    assert rel(result.model, single.model) <= 1e-5 and result.ledger_ok is True


@pytest.mark.timeout(120)
def test_a_set_counted_but_not_there_without_a_checkpoint_ends_with_the_loss_as_root_cause(
    tmp_path: Path,
) -> None:
    started = time.monotonic()
    with pytest.raises(TrainingFailed) as err:
        losing(tmp_path).fit(TRAIN, devices="cpu:0,cpu:1,cpu:2", strategy="fsdp", **FIT)
    assert time.monotonic() - started < 40
    root = err.value.root_cause
    assert (root.worker, root.kind, root.step) == (1, "crash", 4)
    assert root.action == "respawned"  # (the survivors were to go on: their set was not there)
    names = [f.exception_type for f in err.value.failures]
    assert names.count("NoShardSet") == 1  # (every survivor says so: recorded once)
    assert "found no complete set of shard snapshots where the head counted one" in str(err.value)


def test_a_later_generation_builds_its_model_on_the_meta_device() -> None:
    """A regroup's model is built on the meta device and given only each member's shards,
    for the state it takes next; a factory that cannot build there, or a model with a
    buffer no state holds, is built as in the first generation."""

    def empty(model: Any, tied: bool = True) -> nn.Module | None:
        return px.Learner(model, h.adam, h.step).spec.build_empty(tied)

    model = empty(h.net)
    assert model is not None and all(p.is_meta for p in model.parameters())
    assert empty(h.Cached) is None
    assert empty(h.Net()) is None  # (a module given: each worker copies it)
    assert empty(h.Tied) is not None and empty(h.Tied, tied=False) is None

    def reads_values() -> nn.Module:
        net = h.Net()
        net.inp.weight.data[0, 0] = float(net.out.weight.abs().max())  # (no value on meta)
        return net

    assert empty(reads_values) is None


@pytest.mark.timeout(120)
def test_survivors_rebuild_on_the_meta_device_and_end_as_one_device(
    tmp_path: Path, single: px.FitResult
) -> None:
    """fsdp(3), worker 1 killed, shrink: each worker's factory built its model on the CPU
    once (preflight), each survivor's regroup on the meta device, and the result's in this
    process too (the gathered tensors assigned); the weights end as one device's (every
    parameter NaN in a regroup until the set was loaded into it)."""
    path = str(tmp_path / "built")
    model = functools.partial(h.Recorded, path)
    result = learner(model=model).fit(
        TRAIN, VALID, devices="cpu:0,cpu:1,cpu:2", strategy="fsdp",
        faults=[px.Fault("kill", worker=1, step=4)], on_failure=px.Recovery(mode="shrink"),
        **FIT,
    )  # fmt: skip
    assert [f.action for f in result.failures] == ["shrunk"]
    built = Path(path).read_text().split()
    assert built == ["cpu"] * 3 + ["meta"] * 3, built
    assert rel(result.model, single.model) <= 1e-5 and result.ledger_ok is True


# -- shard sets, re-sharded (pure) ---------------------------------------------------------


@pytest.mark.parametrize(("d0", "world"), [(10, 4), (3, 4), (5, 4), (7, 3), (1, 2), (12, 1)])
def test_rows_are_torch_chunks_with_empty_ones_last(d0: int, world: int) -> None:
    full = torch.arange(d0)
    chunks = list(torch.chunk(full, world))
    for rank in range(world):
        start, stop = rows(d0, world, rank)
        expected = chunks[rank].tolist() if rank < len(chunks) else []
        assert full[start:stop].tolist() == expected


def shards_of(full: torch.Tensor, world: int) -> list[torch.Tensor]:
    return [full[slice(*rows(full.shape[0], world, r))].clone() for r in range(world)]


@pytest.mark.parametrize("path", [(3, 2, 1), (1, 3), (2, 3), (3, 4), (4, 1)])
def test_reshard_through_worlds_gives_back_the_tensor(path: tuple[int, ...]) -> None:
    full = torch.randn(7, 3)
    pieces = shards_of(full, path[0])
    for world in path[1:]:
        pieces = [reshard(pieces, 7, world, r) for r in range(world)]
        assert [p.shape[0] for p in pieces] == [
            len(range(*rows(7, world, r))) for r in range(world)
        ]
    assert torch.equal(torch.cat(pieces), full)


def test_reshard_refuses_a_piece_of_the_wrong_rows() -> None:
    pieces = shards_of(torch.randn(7, 3), 2)
    with pytest.raises(ValueError, match="rank 1 of 2 holds"):
        reshard([pieces[0], pieces[1][:2]], 7, 3, 0)


def test_the_newest_complete_set_wins() -> None:
    written = (
        [Written(0, 3, r, 5, 0) for r in (0, 1, 2)]
        + [Written(0, 3, r, 6, 0) for r in (0, 2)]
        + [Written(1, 2, r, 6, 0) for r in (0, 1)]
    )
    assert newest_set(written) == ShardSet(1, 2, 6, 0)  # (step 6 of generation 0 lacks rank 1)
    assert newest_set(written[:5]) == ShardSet(0, 3, 5, 0)
    assert newest_set(written[3:5]) is None
    for generation, world, rank in ((0, 1, 0), (7, 3, 2), (2**30, 255, 254)):
        found = Written.of(tag(generation, world, rank), 4, 1)
        assert found == Written(generation, world, rank, 4, 1)
    assert Written.of(-1, 4, 1) is None  # (a ddp snapshot's tag)


# -- sharded checkpoints -------------------------------------------------------------------


def fsdp_devices(n: int) -> str:
    return ",".join(f"cpu:{i}" for i in range(n)) if n > 1 else "cpu"


@pytest.mark.timeout(200)
@pytest.mark.parametrize("worlds", [(3, 2, 1), (1, 3)])
def test_sharded_checkpoints_resume_on_any_number_of_workers(
    worlds: tuple[int, ...], single: px.FitResult, tmp_path: Any
) -> None:
    """Each run stops after a few steps and the next one resumes from its newest checkpoint
    on another number of workers (1: strategy="single"); the last ends with one device's
    weights, every sample once; load_checkpoint and model.pt give those weights."""
    run_dir = str(tmp_path / "run")
    every = px.Checkpoints(every_steps=2, keep_last=2)
    result = None
    for i, world in enumerate(worlds):
        strategy = "fsdp" if world > 1 else "single"
        stop = None if i == len(worlds) - 1 else 3 + 4 * i
        result = learner().fit(
            TRAIN, VALID, devices=fsdp_devices(world), strategy=strategy, run_dir=run_dir,
            checkpoint=every, resume=i > 0, max_steps=stop, **FIT,
        )  # fmt: skip
        written = sorted(os.listdir(tmp_path / "run" / "checkpoints"))
        if world > 1:
            assert f"ckpt-{result.steps:09d}.rank-{world - 1}-of-{world}.pt" in written
    assert result is not None
    assert rel(result.model, single.model) <= 1e-5
    assert result.ledger_ok is True and result.steps == single.steps
    saved = px.load_checkpoint(run_dir)
    assert saved["phalanx"]["step"] == single.steps
    model = h.Net()
    model.load_state_dict(saved["model"])
    assert rel(model, result.model) == 0.0
    assert result.model_path is not None
    model.load_state_dict(torch.load(result.model_path, weights_only=True))
    assert rel(model, result.model) == 0.0


@pytest.mark.timeout(150)
def test_gather_false_ends_in_a_sharded_checkpoint_and_gathers_nothing(
    single: px.FitResult, tmp_path: Any
) -> None:
    """fsdp(2), a worker killed on the way, checkpoints every 5 steps (not at the last, 12):
    the final weights are never gathered: each member writes its shards of a last
    checkpoint, which ``model_path`` names and ``load_checkpoint`` reads whole, with one
    device's weights; no run_dir/model.pt, no model in the result."""
    run_dir = tmp_path / "run"
    result = learner().fit(
        TRAIN, VALID, devices="cpu:0,cpu:1", strategy="fsdp", run_dir=str(run_dir),
        checkpoint=px.Checkpoints(every_steps=5, every_epoch=False), gather=False,
        faults=[px.Fault.parse("kill:1@7")], **FIT,
    )  # fmt: skip
    assert result.model is None and result.steps == single.steps == 12
    assert result.ledger_ok is True and [f.kind for f in result.failures] == ["crash"]
    assert result.model_path == str(run_dir / "checkpoints" / "ckpt-000000012.rank-0-of-2.pt")
    assert not (run_dir / "model.pt").exists()
    saved = px.load_checkpoint(result.model_path)
    assert saved["phalanx"]["step"] == 12
    model = h.Net()
    model.load_state_dict(saved["model"])
    assert rel(model, single.model) <= 1e-5


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory: Any) -> Path:
    run_dir = tmp_path_factory.mktemp("sharded") / "run"
    learner().fit(
        TRAIN, devices="cpu:0,cpu:1,cpu:2", strategy="fsdp", run_dir=str(run_dir),
        checkpoint=px.Checkpoints(every_steps=3, keep_last=3), **FIT,
    )  # fmt: skip
    return run_dir / "checkpoints"


def copy_of(folder: Path, tmp_path: Path) -> Path:
    shutil.copytree(folder, tmp_path / "checkpoints")
    return tmp_path / "checkpoints"


READ_PEAK = """
import sys, torch
from phalanx.checkpoint.io import read_checkpoint
member = None if sys.argv[2] == "whole" else (8, 1)
if sys.argv[2] != "none":
    state = read_checkpoint(sys.argv[1], member=member)
    w, rows = state["model"]["w"], torch.arange(8192.0)
    assert w.shape[1] == 8192 and state["model"]["b"].shape == (7,)
    assert torch.equal(w[:, 0], rows if member is None else rows[1024:2048])
status = open("/proc/self/status").read().split("VmHWM:")[1]  # (this program's own peak)
print(int(status.split()[0]))
"""


@pytest.mark.timeout(120)
def test_a_member_reads_only_its_rows_of_a_sharded_checkpoint(tmp_path: Path) -> None:
    """A resume under fsdp reads each rank's file mapped and copies out only the rows the
    member takes: its peak memory holds an eighth of the tensor (member 1 of 8), not the
    joined whole (256 MiB in 2 ranks' files; each process measured alone, against one that
    reads nothing)."""
    from phalanx.checkpoint.io import shard_name, write_shard

    full = torch.arange(8192.0)[:, None].expand(8192, 8192)  # (each row its index)
    for rank, piece in enumerate(full.chunk(2)):
        write_shard(
            str(tmp_path / shard_name(5, rank, 2)),
            {
                "model": {"w": piece.clone(), "b": torch.zeros(7)},
                "optimizer": {"state": {}, "param_groups": []},
                "shards": {"model": ["w"], "optimizer": {}},
                "phalanx": {"rank": rank, "world": 2, "step": 5},
            },
        )
    path = str(tmp_path / shard_name(5, 0, 2))
    peaks = {}
    for how in ("none", "whole", "member"):
        out = subprocess.run(
            [sys.executable, "-c", READ_PEAK, path, how],
            capture_output=True, text=True, timeout=90, check=True,
        )  # fmt: skip
        peaks[how] = int(out.stdout.split()[-1]) / 1024  # MiB (VmHWM: KiB)
    # (whole: 256 MiB joined, and each file's bytes while it loads; member: its 32 MiB of
    # rows, and the mapped pages it read them from)
    more = {how: peaks[how] - peaks["none"] for how in ("whole", "member")}
    assert more["whole"] > 256 and more["member"] < more["whole"] / 3, peaks


@pytest.mark.timeout(120)
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # (dcp.load, one process)
def test_a_checkpoint_exported_to_dcp_loads_whole_and_into_another_sharding(
    sharded_run: Path, tmp_path: Path
) -> None:
    """``phalanx export`` writes the newest checkpoint of an fsdp(3) run as a DCP folder:
    ``dcp.load`` fills a plain model with its weights, and two FSDP2 processes (another
    world, units per block) each get their rows of them; a second export into the same
    folder is refused, naming it."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import torch.multiprocessing as mp

    from phalanx.cli import main
    from phalanx.snapshot.shards import rows as rows_of

    out = tmp_path / "dcp"
    assert main(["export", str(sharded_run.parent), "--dcp", str(out)]) == 0
    assert (out / ".metadata").exists()
    whole = px.load_checkpoint(sharded_run)["model"]
    model = h.Net()
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(out), no_dist=True)
    model.load_state_dict(state["model"])
    assert all(torch.equal(model.state_dict()[k], v) for k, v in whole.items())
    assert rel(model, h.Net()) > 1e-3
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=h.load_dcp_sharded, args=(r, store.port, str(out), str(tmp_path)))
        for r in range(2)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=90)
    assert [proc.exitcode for proc in procs] == [0, 0]
    for rank in range(2):
        mine = torch.load(tmp_path / f"rank-{rank}.pt")
        for key, full in whole.items():
            start, stop = rows_of(full.shape[0], 2, rank)
            assert torch.equal(mine[key], full[start:stop]), key
    with pytest.raises(CheckpointError, match="exists and is not an empty folder"):
        px.export_dcp(sharded_run, out)


def test_a_checkpoint_missing_a_ranks_shard_is_passed_over(
    sharded_run: Path, tmp_path: Path
) -> None:
    """A run killed while its members wrote step 12 left rank 2's file unwritten: the
    newest checkpoint is step 9's (step 12's other files are left as they are)."""
    folder = copy_of(sharded_run, tmp_path)
    (folder / "ckpt-000000012.rank-2-of-3.pt").unlink()
    assert [step for _, step in list_checkpoints(folder)] == [6, 9]
    assert px.load_checkpoint(folder)["phalanx"]["step"] == 9
    assert (folder / "ckpt-000000012.rank-0-of-3.pt").exists()


def test_a_truncated_shard_is_named_and_the_checkpoint_before_is_used(
    sharded_run: Path, tmp_path: Path
) -> None:
    folder = copy_of(sharded_run, tmp_path)
    shard = folder / "ckpt-000000012.rank-1-of-3.pt"
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"ckpt-000000012\.rank-1-of-3\.pt: truncated"):
        px.load_checkpoint(folder / "ckpt-000000012.rank-0-of-3.pt")
    assert px.load_checkpoint(folder)["phalanx"]["step"] == 9
    assert shard.exists()  # (nothing deleted)


def test_a_checkpoint_of_another_model_is_refused_naming_it(
    sharded_run: Path, tmp_path: Path
) -> None:
    folder = copy_of(sharded_run, tmp_path / "run")
    other = px.Learner(functools.partial(h.Net, depth=2), h.adam, h.step)
    with pytest.raises(CheckpointMismatchError, match=r"ckpt-000000012\.rank-0-of-3\.pt"):
        other.fit(TRAIN, devices="cpu", run_dir=str(tmp_path / "run"), resume=True, **FIT)
    assert len(list_checkpoints(folder)) == 3


@pytest.mark.timeout(120)
def test_a_checkpoint_of_other_sizes_is_refused_by_every_member_reading_its_rows(
    sharded_run: Path, tmp_path: Path
) -> None:
    """Resumed under fsdp(2), each member reads only its rows: a checkpoint whose output
    layer has 3 rows, into a model whose has 6, is refused (PX122) on every member alike,
    naming the file (a member's cut of 1 row would otherwise broadcast into its 3)."""
    folder = copy_of(sharded_run, tmp_path / "run")
    other = px.Learner(functools.partial(h.Net, outputs=6), h.adam, h.step)
    with pytest.raises(TrainingFailed) as err:
        other.fit(
            TRAIN, devices="cpu:0,cpu:1", strategy="fsdp", run_dir=str(tmp_path / "run"),
            resume=True, **FIT,
        )  # fmt: skip
    assert "ckpt-000000012.rank-0-of-3.pt does not fit" in str(err.value)
    assert "out.weight: 3 rows in the checkpoint, 6 in the model" in str(err.value)
    assert "PX122" in str(err.value) and len(list_checkpoints(folder)) == 3


@pytest.mark.timeout(120)
def test_a_one_file_checkpoint_of_other_sizes_is_refused_by_every_member(tmp_path: Path) -> None:
    """A checkpoint of one device's run (the whole tensors), resumed under fsdp(2) into a
    model whose output layer has 6 rows, not 3: refused on every member (PX122), before a
    member could cut rows of a tensor of another size."""
    run_dir = str(tmp_path / "run")
    learner().fit(TRAIN, devices="cpu", run_dir=run_dir, **dict(FIT, epochs=1))
    other = px.Learner(functools.partial(h.Net, outputs=6), h.adam, h.step)
    with pytest.raises(TrainingFailed) as err:
        other.fit(TRAIN, devices="cpu:0,cpu:1", strategy="fsdp", run_dir=run_dir, resume=True,
                  **FIT)  # fmt: skip
    assert "out.weight: (3, 32) in the checkpoint, (6, 32) here" in str(err.value)
    assert str(err.value).count("PX122") >= 1 and "does not fit" in str(err.value)


def wrote(
    state: StateCopies, writers: dict[int, set[int]], steps: tuple[int, ...] = (1,)
) -> StateCopies:
    """Each slot of ``writers[g]`` wrote a shard snapshot of each of ``steps`` in
    generation g."""
    for generation, slots in writers.items():
        for slot in slots:
            for step in steps:
                state.snapshot(0, step, writer=(generation, slot))
    return state


@pytest.mark.parametrize(
    ("writers", "failed", "kept"),
    [
        ({}, False, False),  # (no snapshot yet)
        ({0: {0, 1}}, False, False),  # (generation 0 has 3 members: one has not written)
        ({0: {0, 1, 2}}, False, True),
        ({0: {0, 1}, 1: {0, 1}}, False, True),  # (generation 1, the shrink, is complete)
        ({0: {0, 1, 2}}, True, False),  # (a member's snapshots failed: no set after)
    ],
)
def test_the_coordinator_counts_on_a_shard_set_only_when_one_is_complete(
    writers: dict[int, set[int]], failed: bool, kept: bool
) -> None:
    state = wrote(StateCopies(shard_failed=failed), writers)
    assert state.shard_set({0: [0, 1, 2], 1: [0, 1]}) is kept


def test_a_shard_set_counts_only_when_the_next_generation_reaches_every_writer() -> None:
    """Across nodes the survivors read the snapshots on their own machines (and send them
    to each other): a set whose writer is on a node none of them runs on is out of reach;
    a lost node takes its slots' snapshots with it."""
    state = wrote(StateCopies(), {0: {0, 1, 2, 3}})
    members = {0: [0, 1, 2, 3]}
    node_of = {0: 0, 1: 0, 2: 1, 3: 1}.__getitem__
    assert state.shard_set(members, {0, 1}.__contains__, node_of)
    assert not state.shard_set(members, {0}.__contains__, node_of)
    state.lost(1, [2, 3])
    assert not state.shard_set(members)


def test_a_set_is_one_step_that_every_member_still_keeps() -> None:
    """A member's folder keeps its last two snapshots: a set is a step every member of a
    generation keeps. Members one snapshot apart (the last one's still being written
    elsewhere) share the one before; two more of a later generation replace a folder's."""
    state = StateCopies()
    members = {0: [0, 1], 1: [0, 1]}
    wrote(state, {0: {0, 1}}, steps=(4, 8))
    wrote(state, {0: {0}}, steps=(12,))
    assert state.shard_set(members)  # (step 8: slot 0 keeps 8 and 12, slot 1 4 and 8)
    wrote(state, {0: {0}}, steps=(16,))
    assert not state.shard_set(members)  # (slot 0 keeps 12 and 16 only)
    state = wrote(StateCopies(), {0: {0, 1}})
    wrote(state, {1: {0}}, steps=(2, 3))
    assert not state.shard_set(members)  # (generation 1 lacks slot 1, 0 lacks slot 0)


def test_a_restored_member_keeps_only_the_set_it_started_from() -> None:
    """A new generation's member forgets, in its own folder, every snapshot but the set it
    restored (its Joined says which): an older set no longer counts on it."""
    state = wrote(StateCopies(), {0: {0, 1}}, steps=(4, 8))
    members = {0: [0, 1], 1: [0, 1]}
    state.joined(0, 1, 8, restored=(0, 8))
    assert state.local[0] == [(0, 8)] and state.shard_set(members)
    wrote(state, {1: {0}}, steps=(9, 10))  # (slot 0 goes on alone: its set of 8 is gone)
    assert state.local[0] == [(1, 9), (1, 10)] and not state.shard_set(members)


def test_a_restored_set_counts_the_snapshots_the_coordinator_did_not_hear_of() -> None:
    """Worker 1 wrote its snapshot of step 4 and was killed before its word left: the
    coordinator heard of 2 and 3 only. The survivors found the set of 4 whole and restored
    it (their Joined says so), then slot 0 wrote 5 and slot 2 was killed before its word of
    5 left: the set of 4 is still whole (slot 1's folder and the survivors' kept it), and
    the second loss must count on it (a real run under load: see the next test)."""
    members = {0: [0, 1, 2], 1: [0, 2]}
    state = wrote(StateCopies(), {0: {0, 1, 2}}, steps=(2, 3))
    wrote(state, {0: {0, 2}}, steps=(4,))
    for slot in (0, 2):
        state.joined(slot, 1, 4, (0, 4), members[0])
    wrote(state, {1: {0}}, steps=(5,))
    assert state.local[1] == [(0, 3), (0, 4)]
    assert state.shard_set(members)
    state = wrote(StateCopies(), {0: {0, 1, 2}}, steps=(2, 3))  # (the same, heard of 3 only)
    for slot in (0, 2):
        state.joined(slot, 1, 4, (0, 4), members[0])
    assert state.local == {0: [(0, 4)], 1: [(0, 3), (0, 4)], 2: [(0, 4)]}


def test_a_restored_set_from_a_lost_nodes_copies_is_counted_on_its_buddys_node() -> None:
    """Node 1 (slots 2 and 3) is lost; the survivors restored the set of step 8 from the
    copies of 2's and 3's snapshots on node 0, though the coordinator heard of copies of 4
    only (each sender was killed with its node before its word left): the copies of 8 are
    counted on node 0, the buddy's, not in the lost folders."""
    node_of = {0: 0, 1: 0, 2: 1, 3: 1}.__getitem__
    members = {0: [0, 1, 2, 3], 1: [0, 1]}
    state = wrote(StateCopies(), {0: {0, 1, 2, 3}}, steps=(4, 8))
    for slot in (2, 3):
        state.copy(0, slot, 0, 4, seconds=0.01)
    state.lost(1, [2, 3])
    for slot in (0, 1):
        state.joined(slot, 1, 8, (0, 8), members[0], node_of)
    assert state.copies == {(2, 0): [(0, 4), (0, 8)], (3, 0): [(0, 4), (0, 8)]}
    assert 2 not in state.local and 3 not in state.local
    assert state.shard_set(members, {0}.__contains__, node_of)


def test_a_copy_on_another_node_keeps_a_lost_nodes_writers_in_reach() -> None:
    """A member's snapshots copied to another node (phalanx.snapshot.copies) keep the set
    within reach of the survivors when its node is lost; copies held on the lost node go
    with it."""
    members = {0: [0, 1, 2, 3]}
    node_of = {0: 0, 1: 0, 2: 1, 3: 1}.__getitem__
    state = wrote(StateCopies(), {0: {0, 1, 2, 3}}, steps=(4,))
    for slot, holder in ((0, 1), (1, 1), (2, 0), (3, 0)):
        state.copy(0, slot, holder, 4, seconds=0.01)
    assert state.shard_set(members, {0}.__contains__, node_of)  # (2 and 3: their copies)
    state.lost(1, [2, 3])
    assert state.shard_set(members) and state.shard_set(members, {0}.__contains__, node_of)
    assert sorted(state.copies) == [(2, 0), (3, 0)]  # (0's and 1's copies were on node 1)
    state.lost(0, [0, 1])  # (and then node 0: nothing is left anywhere)
    assert not state.shard_set(members)
    state.snapshot(0, 8, nbytes=1000, seconds=0.001)
    assert "; 4 copied to another node" in str(state.summary(4, "worker"))


def test_a_copy_of_another_step_than_the_survivors_keep_is_no_set() -> None:
    """Slot 1's copies stopped at step 4 (failed) while slot 0 went on to 8 and 12: after
    node 1's loss, slot 0 keeps 8 and 12, slot 1's copy is of 4: no set."""
    node_of = {0: 0, 1: 1}.__getitem__
    members = {0: [0, 1]}
    state = wrote(StateCopies(), {0: {0, 1}}, steps=(4,))
    state.copy(0, 1, 0, 4, seconds=0.01)
    assert state.shard_set(members, {0}.__contains__, node_of)
    wrote(state, {0: {0, 1}}, steps=(8, 12))
    state.copies_failed(0, 1)
    state.lost(1, [1])
    assert not state.shard_set(members, {0}.__contains__, node_of)


def test_copies_that_stopped_in_a_later_generation_leave_no_stale_set() -> None:
    """Generation 0's copies were whole; in generation 1 slot 0's copies stop, then its
    node is lost. Slot 1 has written two snapshots in generation 1 since (its folder no
    longer holds generation 0's), so no set is counted: the run restarts from a
    checkpoint instead of looking for a set that is gone."""
    node_of = {0: 0, 1: 1}.__getitem__
    members = {0: [0, 1], 1: [0, 1]}
    state = wrote(StateCopies(), {0: {0, 1}}, steps=(4,))
    state.copy(0, 0, 1, 4, seconds=0.01)
    state.copy(0, 1, 0, 4, seconds=0.01)
    state.joined(0, 1, 6, None)
    state.joined(1, 1, 6, None)
    wrote(state, {1: {0, 1}}, steps=(6, 8))
    state.copy(1, 1, 0, 6, seconds=0.01)
    state.copy(1, 0, 1, 6, seconds=0.01)
    assert state.shard_set(members, {1}.__contains__, node_of)  # (step 6: 0's copy on 1)
    wrote(state, {1: {0, 1}}, steps=(10,))
    state.copy(1, 1, 0, 8, seconds=0.01)
    state.copy(1, 0, 1, 8, seconds=0.01)
    state.copies_failed(1, 0)  # (its copy of step 10, written over 6's on node 1)
    state.lost(0, [0])
    # (slot 1 keeps 8 and 10 on node 1; slot 0's copy there is of 8 only: the set of 8)
    assert state.shard_set(members, {1}.__contains__, node_of)
    wrote(state, {1: {1}}, steps=(12,))  # (slot 1 goes on alone: 10 and 12)
    assert not state.shard_set(members, {1}.__contains__, node_of)


def test_a_new_generations_first_copy_drops_the_copies_past_its_start() -> None:
    """The receiver forgets the copies of steps past the one a new generation started
    from (they are of a run that fell): the coordinator does likewise."""
    state = StateCopies()
    for step in (8, 12):
        state.copy(0, 0, 1, step, seconds=0.01)
    state.joined(0, 1, 9, (0, 8))
    state.copy(1, 0, 1, 9, seconds=0.01)
    assert state.copies[(0, 1)] == [(0, 8), (1, 9)]


def test_gather_false_fails_the_member_when_its_final_checkpoint_lacks_a_rank(
    sharded_run: Path, tmp_path: Path
) -> None:
    """The last checkpoint is the final weights' only copy under gather=False: one missing
    a rank's file is a failure of the main member (PX120, naming the step and the folder),
    one that is whole is named by its rank 0's file."""
    import types

    from phalanx.failures import FailedHere
    from phalanx.loop import TrainLoop
    from phalanx.replica import Identity

    folder = copy_of(sharded_run, tmp_path)
    loop: Any = types.SimpleNamespace(
        state=types.SimpleNamespace(global_step=12, epoch=2),
        engine=types.SimpleNamespace(identity=Identity(0, 0, "cpu:0")),
        checkpointer=types.SimpleNamespace(directory=str(folder)),
    )
    loop._fails_as = functools.partial(TrainLoop._fails_as, loop)
    assert TrainLoop.final_checkpoint(loop) == str(folder / "ckpt-000000012.rank-0-of-3.pt")
    (folder / "ckpt-000000012.rank-2-of-3.pt").unlink()
    with pytest.raises(FailedHere) as failed:
        TrainLoop.final_checkpoint(loop)
    failure = failed.value.failure
    assert failure.phase == "checkpoint" and failure.step == 12
    assert "PX120" in failure.message and "the final checkpoint (step 12) is not complete" in (
        failure.message
    )
