"""strategy="ddp": the supervisor reads every end of a worker process right. A worker that
exits with code 0 without a report has fallen (user code called ``sys.exit``); a module of
the user's that the workers cannot import is a preflight failure; replaced processes never
outlive the run; each stack dump is read alone.
"""

from __future__ import annotations

import importlib
import multiprocessing
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import phalanx as px
from ddp_helpers import (
    StepTimes,
    dump_stacks_twice_target,
    exit_on_flag_step,
    flagged_data,
    make_data,
    mlp,
    mlp_exiting_in_worker_1,
    mse_step,
    segfault_on_flag_step,
    sgd,
)
from phalanx.interrupt import Interrupter
from phalanx.plan import Plan, split
from phalanx.spec import FitConfig, TrainSpec
from phalanx.strategies.ddp.supervisor import SlotState, Supervisor

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX processes and signals")

TWO = "cpu:0,cpu:1"
# 120 samples in global batches of 20: 6 steps an epoch; two workers take 10 each.
# (even shares: these runs are compared bit for bit, and balance follows the machine load)
FIT: dict[str, Any] = dict(batch_size=20, epochs=2, seed=3, balance=False)
EXIT_STEP = 3
DECISION_S = 5.0  # from the end of the last good step to the report


# -- sys.exit(0) -------------------------------------------------------------------------------


@pytest.mark.timeout(90)
def test_sys_exit_in_a_step_is_that_workers_failure() -> None:
    """Worker 1's step calls ``sys.exit(0)`` at step 3 (and again in the retry): it is worker
    1's failure of step 3, named within seconds, not its peer's ``Connection closed by peer``
    once the peer gave up waiting."""
    plan = Plan(120, FIT["batch_size"], FIT["seed"])
    flagged = split(plan.global_batch(0, EXIT_STEP), 2)[1][0]  # in worker 1's share
    steps = StepTimes()
    with pytest.raises(px.TrainingFailed) as info:
        px.Learner(mlp, sgd, exit_on_flag_step).fit(
            flagged_data(120, flagged), devices=TWO, strategy="ddp",
            on_failure=px.Recovery(mode="abort"), sinks=[steps], **FIT,
        )  # fmt: skip
    decided = time.time()
    err = info.value
    root = err.root_cause
    assert (root.worker, root.device, root.step, root.phase) == (1, "cpu:1", EXIT_STEP, "forward")
    assert max(steps.ended) == EXIT_STEP
    assert decided - steps.ended[EXIT_STEP] < DECISION_S
    # Caught in the step, as an exception: retried once, then a poison batch.
    assert root.kind == "exception" and root.exception_type == "SystemExit"
    assert root.traceback is not None and "sys.exit(0)" in root.traceback
    assert err.code == "PX204"
    assert [f.action for f in err.failures if f.worker == 1] == ["retried", "aborted"]
    first = str(err).splitlines()[0]
    assert "device cpu:1" in first and f"step {EXIT_STEP + 1} " in first and "SystemExit" in first


@pytest.mark.timeout(90)
def test_a_crash_in_native_code_is_reported_with_the_workers_stacks() -> None:
    """Worker 1's step reads address 0 at step 3: its process dies of SIGSEGV. The report
    names worker 1's crash with the Python stacks its faulthandler wrote as it died (the
    step function's line among them)."""
    plan = Plan(120, FIT["batch_size"], FIT["seed"])
    flagged = split(plan.global_batch(0, EXIT_STEP), 2)[1][0]  # in worker 1's share
    with pytest.raises(px.TrainingFailed) as info:
        px.Learner(mlp, sgd, segfault_on_flag_step).fit(
            flagged_data(120, flagged), devices=TWO, strategy="ddp",
            on_failure=px.Recovery(mode="abort"), sinks=[], **FIT,
        )  # fmt: skip
    root = info.value.root_cause
    assert (root.worker, root.kind, root.signal, root.step) == (1, "crash", 11, EXIT_STEP)
    assert root.stacks is not None and "Fatal Python error: Segmentation fault" in root.stacks
    assert "segfault_on_flag_step" in root.stacks
    assert "Stacks of the worker when it crashed:" in str(info.value)


@pytest.mark.timeout(90)
def test_an_exit_with_code_0_without_a_report_is_a_crash() -> None:
    """Worker 1's model factory calls ``sys.exit(0)`` (outside any step: nothing catches
    it) and the process ends with code 0. That is worker 1's fall at once, not a clean end
    that leaves worker 0 waiting for it to form a group."""
    started = time.time()
    with pytest.raises(px.TrainingFailed) as info:
        px.Learner(mlp_exiting_in_worker_1, sgd, mse_step).fit(
            make_data(120), devices=TWO, strategy="ddp", sinks=[], **FIT
        )
    took = time.time() - started
    root = info.value.root_cause
    assert (root.worker, root.device, root.kind, root.phase) == (1, "cpu:1", "crash", "preflight")
    assert root.exit_code == 0 and root.signal is None
    assert "exited with code 0 without a report" in root.message
    assert info.value.code == "PX205"
    # Worker 0 would have waited 10 s for the group to form, then 10 s for a new generation.
    assert took < 20, f"{took:.0f}s to the report"


# -- a module the workers cannot import ----------------------------------------------------------

USER_MODULE = """\
import os

if os.environ.get("PHALANX_TEST_BREAK_IMPORT"):
    import phalanx_no_such_package_at_module_level  # noqa: F401

from ddp_helpers import mlp


def model():
    return mlp()
"""


@pytest.mark.timeout(90)
def test_a_module_the_workers_cannot_import_is_a_preflight_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The module that defines the model factory imports, at module level, a package the
    workers' environment lacks (here: only when an environment variable is set, and it is
    set after this process imported the module, so only the spawned workers see it).
    Unpickling the user's parts fails in each worker: a preflight failure naming the
    device, with the ModuleNotFoundError and its traceback."""
    name = "phalanx_test_user_module"
    (tmp_path / f"{name}.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))  # spawn hands sys.path to the workers
    monkeypatch.delitem(sys.modules, name, raising=False)
    module = importlib.import_module(name)
    monkeypatch.setenv("PHALANX_TEST_BREAK_IMPORT", "1")
    try:
        with pytest.raises(px.TrainingFailed) as info:
            px.Learner(module.model, sgd, mse_step).fit(
                make_data(120), devices=TWO, strategy="ddp", sinks=[], **FIT
            )
    finally:
        sys.modules.pop(name, None)
    err = info.value
    root = err.root_cause
    assert err.code == "PX205"
    assert (root.phase, root.kind, root.exception_type) == (
        "preflight",
        "exception",
        "ModuleNotFoundError",
    )
    assert root.device == f"cpu:{root.worker}"
    assert (
        root.traceback is not None and "phalanx_no_such_package_at_module_level" in root.traceback
    )
    first = str(err).splitlines()[0]
    assert f"device cpu:{root.worker}" in first and "(preflight)" in first
    assert "ModuleNotFoundError: No module named 'phalanx_no_such_package_at_module_level'" in first
    assert all(f.phase == "preflight" and f.action == "aborted" for f in err.failures)


# -- the supervisor's own housekeeping, on real processes ----------------------------------------


def _supervisor() -> Supervisor:
    data = make_data(40)
    spec = TrainSpec(mlp, sgd, mse_step)
    config = FitConfig(epochs=1, batch_size=20, devices=["cpu:0"], strategy="ddp")
    return Supervisor(spec, config, Plan(40, 20), (data, None, 0), lambda e: None, Interrupter())


@pytest.mark.timeout(60)
def test_close_kills_a_replaced_process_that_is_still_alive() -> None:
    sup = _supervisor()
    lingering = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(120,))
    lingering.start()
    try:
        sup.retired.append(lingering)
        started = time.time()
        sup.close()
        took = time.time() - started
        assert not lingering.is_alive()
        assert took < 5.0, f"close took {took:.1f}s"
    finally:
        if lingering.is_alive():
            lingering.kill()
        lingering.join(timeout=10)


@pytest.mark.timeout(60)
def test_a_second_stack_dump_holds_only_the_new_stacks(tmp_path: Path) -> None:
    """Two dumps of one live process: the second shows where it waits now, not the first
    dump's stacks before it (which could make a hung worker look like one waiting in a
    collective)."""
    sup = _supervisor()
    ready, switch, moved = tmp_path / "ready", tmp_path / "switch", tmp_path / "moved"
    ctx = multiprocessing.get_context("spawn")
    reader, writer = ctx.Pipe(duplex=False)
    paths = (sup._stack_file(0), str(ready), str(switch), str(moved))
    proc = ctx.Process(target=dump_stacks_twice_target, args=paths)
    proc.start()
    try:
        state = SlotState(proc, reader)
        deadline = time.time() + 30
        while not ready.exists():  # SIGUSR1 before the handler is registered would kill it
            assert time.time() < deadline and proc.is_alive()
            time.sleep(0.02)
        first = ""
        while "waiting_before_the_switch" not in first:
            assert time.time() < deadline and proc.is_alive(), first
            first = sup._dump_stacks(0, state)
        switch.touch()
        while not moved.exists():
            assert time.time() < deadline and proc.is_alive()
            time.sleep(0.02)
        second = sup._dump_stacks(0, state)
        assert "waiting_after_the_switch" in second, second
        assert "waiting_before_the_switch" not in second, second
        assert "\0" not in second
        assert second.count("most recent call first") == first.count("most recent call first")
    finally:
        proc.kill()
        proc.join(timeout=10)
        reader.close()
        writer.close()
        sup.close()


class OutvotedHub:
    """A hub whose poll finds node 1 lost by silence, outvoted (see NodeHub.poll)."""

    def __init__(self) -> None:
        from types import SimpleNamespace

        self.node = SimpleNamespace(rank=1, host="h1", lost=True)
        self.nodes = {1: self.node, 2: SimpleNamespace(rank=2, host="h2", lost=True)}
        self.outvoted = self.node

    def poll(self) -> tuple[list[Any], list[Any]]:
        return [], [(self.node, "no word for 3.1s (node_timeout 3s)")]

    def close(self) -> None:
        pass


@pytest.mark.timeout(60)
@pytest.mark.parametrize("successor", [True, False])
def test_an_outvoted_head_stands_down_and_waits_for_the_successors_term(
    tmp_path: Path, successor: bool
) -> None:
    """The hub says the nodes the head lost may take over: the head saves (no worker here)
    and watches head.json; a successor's term there ends it with PX145 (exit 1), none in the
    takeover's time with PX147 (exit 75), naming the loss and that no node took over."""
    import threading
    from datetime import timedelta

    from phalanx.errors import HeadLost, NodeFencedError
    from phalanx.strategies.ddp.nodes.fencing import Fence, claim
    from phalanx.strategies.ddp.timing import Timing

    run_dir = str(tmp_path)
    term = claim(run_dir, 0, "h0", 0)
    sup = _supervisor()
    sup.timing = Timing(node=timedelta(seconds=0.5), takeover=timedelta(seconds=1))
    sup.hub = OutvotedHub()  # type: ignore[assignment]
    sup.fence = Fence(run_dir, term, every=1.0)
    later = threading.Timer(0.4, lambda: claim(run_dir, 1, "h1", 41000))
    if successor:
        later.start()
    started = time.monotonic()
    try:
        with pytest.raises((NodeFencedError, HeadLost)) as ended:
            sup._hear()
    finally:
        later.cancel()
        sup.close()
    took = time.monotonic() - started
    if successor:
        assert isinstance(ended.value, NodeFencedError) and took < 1.4
        assert "was replaced by node 1" in str(ended.value)
    else:
        assert isinstance(ended.value, HeadLost) and ended.value.code == 75
        assert 1.4 < took < 5.0  # (the takeover's time and node_timeout, watched)
        text = str(ended.value)
        assert "node 1 lost (no word for 3.1s" in text and "no node took over within 1.5s" in text
