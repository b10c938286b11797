"""px.rank(), px.world_size(), px.is_main() in user code on every strategy, through a shrink;
torch.distributed's default group called from user code is named (PX124) before training."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import torch

import phalanx as px
from ddp_helpers import make_data, ranks_model, ranks_step, sgd, torch_rank_step
from phalanx.faults import Fault


def _read(folder: Path, prefix: str, workers_only: bool = False) -> list[list[tuple[int, ...]]]:
    """Per process/thread file: its lines as integer tuples (``workers_only``: not this
    process's, where ddp builds the result's model)."""
    mine = f"{prefix}-{os.getpid()}-"
    return [
        [tuple(int(v) for v in line.split()) for line in path.read_text().splitlines()]
        for path in sorted(folder.glob(f"{prefix}-*.txt"))
        if not (workers_only and path.name.startswith(mine))
    ]


def _fit(folder: Path, strategy: str, devices: str, **kwargs: object) -> px.FitResult:
    learner = px.Learner(
        functools.partial(ranks_model, str(folder)),
        sgd,
        functools.partial(ranks_step, folder=str(folder)),
    )
    return learner.fit(
        make_data(96), batch_size=12, strategy=strategy, devices=devices, sinks=[], **kwargs
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("strategy", "devices", "n"), [("single", "cpu", 1), ("threads", "cpu:0,cpu:1,cpu:2", 3)]
)
def test_ranks_inside_training_in_process(
    tmp_path: Path, strategy: str, devices: str, n: int
) -> None:
    _fit(tmp_path, strategy, devices)
    steps = _read(tmp_path, "step")
    assert len(steps) == n  # one writer per replica
    assert sorted({line for lines in steps for line in lines}) == [
        (r, n, int(r == 0)) for r in range(n)
    ]
    for lines in steps:  # each replica always sees the same rank
        assert len(set(lines)) == 1
    assert sorted(line for lines in _read(tmp_path, "model") for line in lines) == [
        (r, n) for r in range(n)
    ]
    # Outside training again: the node's view (one machine: rank 0, the main one).
    assert (px.rank(), px.is_main(), px.world_size(devices)) == (0, True, n)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_ranks_follow_a_shrink_under_ddp(tmp_path: Path) -> None:
    kill = Fault.parse("kill:2@4")
    _fit(tmp_path, "ddp", "cpu:0,cpu:1,cpu:2", faults=[kill], on_failure=px.Recovery("shrink"))
    seen = [line for lines in _read(tmp_path, "step") for line in lines]
    worlds = {world for _, world, _ in seen}
    assert worlds == {3, 2}  # before the kill, and after the shrink
    for world in worlds:
        ranks = {rank for rank, w, _ in seen if w == world}
        assert ranks == set(range(world))
    assert all(main == int(rank == 0) for rank, _, main in seen)
    built = [line for lines in _read(tmp_path, "model", workers_only=True) for line in lines]
    assert sorted(built) == [(0, 3), (1, 3), (2, 3)]  # each worker's factory, as planned


def test_world_size_outside_training_needs_devices() -> None:
    with pytest.raises(px.ConfigError, match=r"px\.world_size"):
        px.world_size()


def test_world_size_outside_training_counts_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PHALANX_NNODES", "3")
    monkeypatch.setenv("PHALANX_NODE_RANK", "2")
    monkeypatch.setenv("PHALANX_HEAD", "10.0.0.1:29410")
    assert px.world_size("cpu:0,cpu:1") == 6
    assert (px.rank(), px.is_main()) == (2, False)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("strategy", "devices", "phase"),
    [("single", "cpu", "forward"), ("ddp", "cpu:0,cpu:1", "preflight")],
)
def test_torch_get_rank_in_the_step_is_named(strategy: str, devices: str, phase: str) -> None:
    learner = px.Learner(ranks_model_plain, sgd, torch_rank_step)
    with pytest.raises(px.InvalidStepError) as caught:
        learner.fit(make_data(48), batch_size=12, strategy=strategy, devices=devices, sinks=[])
    err = caught.value
    assert err.code == "PX124"
    assert err.root_cause.phase == phase  # under ddp: before any step was trained
    assert err.root_cause.exception_type == "TorchDistributedCallError"
    assert err.root_cause.attempt in (None, 0)  # stopped at once: no retry
    assert "px.rank()" in str(err) and "px.is_main()" in str(err)
    assert "init_process_group" in str(err)  # torch's own words are kept, as the cause


def ranks_model_plain() -> torch.nn.Module:
    from ddp_helpers import mlp

    return mlp()
