"""SIGTERM to a real training process: it finishes the step, checkpoints, exits with 143
(fit raises px.FitTerminated, a SystemExit), and a second run with resume=True continues
from that step and completes. Ctrl-C raises KeyboardInterrupt after
the checkpoint; learner.stop() returns."""

from __future__ import annotations

import importlib.util
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from phalanx.interrupt import FitTerminated, Interrupter, handle_signals

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")

SAMPLES, BATCH, EPOCHS = 96, 4, 4
STEPS_PER_EPOCH = SAMPLES // BATCH
TOTAL_STEPS = STEPS_PER_EPOCH * EPOCHS

SCRIPT = f'''
"""Train a tiny model; argv: run_dir resume(0/1) sleep_s out.json state.pt"""
import json
import sys
import time

import torch
from torch import nn
from torch.utils.data import TensorDataset

import phalanx as px

SLEEP = 0.0
torch.set_num_threads(1)  # tiny model; several processes share few cores


def make_model():
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(0.2), nn.Linear(8, 2))


def make_optimizer(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def train_step(model, batch):
    time.sleep(SLEEP)
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def dataset():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn({SAMPLES}, 4, generator=g),
                         torch.randint(0, 2, ({SAMPLES},), generator=g))


def main(argv):
    global SLEEP
    run_dir, resume, SLEEP, out, state = argv[0], argv[1] == "1", float(argv[2]), argv[3], argv[4]
    learner = px.Learner(make_model, make_optimizer, train_step)
    try:
        result = learner.fit(dataset(), epochs={EPOCHS}, batch_size={BATCH}, run_dir=run_dir,
                             resume=resume, seed=3)
    except px.FitTerminated as stopped:  # checkpointed; exits 143 so the job is requeued
        save(stopped.result, out, state)
        raise
    save(result, out, state)


def save(result, out, state):
    torch.save(result.model.state_dict(), state)
    with open(out, "w") as fh:
        json.dump({{"interrupted": result.interrupted, "steps": result.steps,
                    "epochs": result.epochs, "history": result.history}}, fh)


if __name__ == "__main__":
    main(sys.argv[1:])
'''


def position(global_step: int) -> tuple[int, int]:
    """(epoch, step within it) after ``global_step`` steps, as an interrupted run saves it:
    a stop at an epoch's last step is saved before that epoch ends, as step == steps."""
    epoch, step = divmod(global_step, STEPS_PER_EPOCH)
    return (epoch, step) if step else (epoch - 1, STEPS_PER_EPOCH)


def read_events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:  # a line being written right now
            break
    return records


def start(script: Path, tmp: Path, tag: str, resume: bool, sleep: float) -> subprocess.Popen[bytes]:
    args = [
        sys.executable,
        str(script),
        str(tmp / "run"),
        "1" if resume else "0",
        str(sleep),
        str(tmp / f"{tag}.json"),
        str(tmp / f"{tag}.pt"),
    ]
    return subprocess.Popen(
        args,
        stdout=(tmp / f"{tag}.stdout").open("wb"),
        stderr=(tmp / f"{tag}.stderr").open("wb"),
        cwd=tmp,
    )


def finish(proc: subprocess.Popen[bytes], timeout: float) -> int:
    try:
        return proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def logs(tmp: Path, tag: str) -> str:
    out = (tmp / f"{tag}.stdout").read_text(errors="replace")[-3000:]
    err = (tmp / f"{tag}.stderr").read_text(errors="replace")[-3000:]
    return f"--- stdout ---\n{out}\n--- stderr ---\n{err}"


def straight_run(script: Path, tmp: Path) -> None:
    """The script's main(), uninterrupted and without sleeping, in this process."""
    spec = importlib.util.spec_from_file_location("phalanx_sigterm_script", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    threads = torch.get_num_threads()
    try:
        spec.loader.exec_module(module)  # sets torch's threads to 1, like the subprocesses
        (tmp / "straight").mkdir()
        module.main(
            [str(tmp / "straight"), "0", "0", str(tmp / "straight.json"), str(tmp / "straight.pt")]
        )
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_sigterm_checkpoints_exits_143_and_resume_completes(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT, encoding="utf-8")
    events_path = tmp_path / "run" / "events.jsonl"

    # 1. A slow run (0.1 s per step): SIGTERM after its first step.
    proc = start(script, tmp_path, "first", resume=False, sleep=0.1)
    try:
        deadline = time.monotonic() + 60
        while not any(r["event"] == "StepEnded" for r in read_events(events_path)):
            assert proc.poll() is None, f"exited early ({proc.returncode})\n" + logs(
                tmp_path, "first"
            )
            assert time.monotonic() < deadline, "no StepEnded within 60 s\n" + logs(
                tmp_path, "first"
            )
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        code = finish(proc, timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert code == 143, logs(tmp_path, "first")  # 128 + SIGTERM: a batch system requeues it

    first = json.loads((tmp_path / "first.json").read_text())
    assert first["interrupted"] == "Training interrupted: received SIGTERM"
    saved = first["steps"]
    assert 1 <= saved < TOTAL_STEPS
    checkpoint = tmp_path / "run" / "checkpoints" / f"ckpt-{saved:09d}.pt"
    assert checkpoint.is_file()
    ended = [r for r in read_events(events_path) if r["event"] == "RunEnded"]
    assert ended[-1]["interrupted"] == "Training interrupted: received SIGTERM"
    assert not ended[-1]["failed"]
    shown = (tmp_path / "first.stdout").read_text(errors="replace")  # the default sinks
    assert shown.count("Training interrupted") == 1, shown[-2000:]
    assert "Training interrupted: received SIGTERM" in shown
    first_events = len(read_events(events_path))

    # 2. The same script with resume=True (and no sleep) continues from that step.
    #    While it runs, a straight run of the same script runs in this process (for step 3).
    proc = start(script, tmp_path, "second", resume=True, sleep=0.0)
    try:
        straight_run(script, tmp_path)
        code = finish(proc, timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert code == 0, logs(tmp_path, "second")

    second = json.loads((tmp_path / "second.json").read_text())
    assert second["interrupted"] is None
    assert second["steps"] == TOTAL_STEPS
    assert second["epochs"] == EPOCHS
    assert [h["epoch"] for h in second["history"]] == list(range(EPOCHS))

    records = read_events(events_path)[first_events:]  # the log is appended to
    (resumed,) = [r for r in records if r["event"] == "Resumed"]
    assert resumed["global_step"] == saved
    assert resumed["path"] == str(checkpoint)
    assert (resumed["epoch"], resumed["step"]) == position(saved)
    (started,) = [r for r in records if r["event"] == "RunStarted"]
    assert (started["start_epoch"], started["start_step"]) == position(saved)
    steps = [r["global_step"] for r in records if r["event"] == "StepEnded"]
    assert steps == list(range(saved + 1, TOTAL_STEPS + 1))

    # 3. ...and ends where a straight run ends.
    straight = json.loads((tmp_path / "straight.json").read_text())
    assert second["history"] == straight["history"]
    resumed_state = torch.load(tmp_path / "second.pt")
    straight_state = torch.load(tmp_path / "straight.pt")
    assert resumed_state.keys() == straight_state.keys()
    for key in straight_state:
        assert torch.equal(resumed_state[key], straight_state[key]), key


def test_handle_signals_sets_the_reason_and_restores_handlers() -> None:
    """In-process: SIGTERM inside the context asks to stop; the old handler comes back."""
    interrupter = Interrupter()
    previous = signal.getsignal(signal.SIGTERM)
    with handle_signals(interrupter):
        signal.raise_signal(signal.SIGTERM)
        assert interrupter.should_stop()
        assert interrupter.reason == "received SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is previous
    interrupter.reset()
    assert not interrupter.should_stop() and interrupter.reason is None


def test_second_sigint_raises_keyboard_interrupt() -> None:
    interrupter = Interrupter()
    with handle_signals(interrupter):
        signal.raise_signal(signal.SIGINT)
        assert interrupter.reason == "received SIGINT"
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)


def test_first_stop_reason_wins() -> None:
    interrupter = Interrupter()
    interrupter.stop("first")
    interrupter.stop("second")
    assert interrupter.reason == "first"


class StopWhenRead(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Asks ``learner`` to stop when sample ``index`` is loaded: a stop that arrives in
    the middle of a step, as a signal does."""

    def __init__(self, learner: Any, index: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(SAMPLES, 4, generator=g)
        self.y = torch.randint(0, 2, (SAMPLES,), generator=g)
        self.learner, self.index = learner, index

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if i == self.index:
            self.learner.stop("asked mid-step")
        return self.x[i], self.y[i]


@pytest.mark.parametrize("strategy", ["single", "threads"])
def test_a_stop_during_a_step_ends_the_run_after_that_step(strategy: str, tmp_path: Path) -> None:
    import phalanx as px
    from phalanx.plan import Plan

    learner = px.Learner(
        lambda: torch.nn.Linear(4, 2), torch.optim.SGD, px.cross_entropy_step
    )  # in-process strategies need no pickling
    step = 9  # the stop comes while this step's samples load
    index = Plan(SAMPLES, BATCH, seed=3).global_batch(0, step)[1]
    devices = "cpu:0,cpu:1" if strategy == "threads" else "cpu"
    result = learner.fit(
        StopWhenRead(learner, index), epochs=EPOCHS, batch_size=BATCH, seed=3,
        strategy=strategy, devices=devices, run_dir=str(tmp_path / "run"), sinks=[],
    )  # fmt: skip
    assert result.interrupted == "Training interrupted: asked mid-step"
    assert result.steps == step + 1  # that step finished, no other began
    assert (tmp_path / "run" / "checkpoints" / f"ckpt-{step + 1:09d}.pt").is_file()


class SignalWhenRead(StopWhenRead):
    """Raises ``signum`` in this process when sample ``index`` is loaded (mid-step)."""

    def __init__(self, signum: int, index: int) -> None:
        super().__init__(None, index)
        self.signum = signum

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if i == self.index:
            signal.raise_signal(self.signum)
        return self.x[i], self.y[i]


@pytest.mark.parametrize("strategy", ["single", "threads"])
@pytest.mark.parametrize(
    ("signum", "raised"),
    [(signal.SIGINT, KeyboardInterrupt), (signal.SIGTERM, FitTerminated)],
)
def test_a_signal_checkpoints_then_raises(
    strategy: str, signum: int, raised: type[BaseException], tmp_path: Path
) -> None:
    """Ctrl-C ends as Python's Ctrl-C does (KeyboardInterrupt), SIGTERM as a SystemExit with
    code 143; each after the step finished and the checkpoint was written."""
    import phalanx as px
    from phalanx.plan import Plan

    step = 5
    index = Plan(SAMPLES, BATCH, seed=3).global_batch(0, step)[0]
    learner = px.Learner(lambda: torch.nn.Linear(4, 2), torch.optim.SGD, px.cross_entropy_step)
    devices = "cpu:0,cpu:1" if strategy == "threads" else "cpu"
    with pytest.raises(raised) as info:
        learner.fit(
            SignalWhenRead(signum, index), epochs=EPOCHS, batch_size=BATCH, seed=3,
            strategy=strategy, devices=devices, run_dir=str(tmp_path / "run"), sinks=[],
        )  # fmt: skip
    name = signal.Signals(signum).name
    result = info.value.result  # type: ignore[attr-defined]
    assert result.interrupted == f"Training interrupted: received {name}"
    assert result.steps == step + 1
    assert (tmp_path / "run" / "checkpoints" / f"ckpt-{step + 1:09d}.pt").is_file()
    if signum == signal.SIGINT:
        assert type(info.value) is KeyboardInterrupt  # exactly: uncaught, ends as Ctrl-C does
    else:
        assert isinstance(info.value, SystemExit) and info.value.code == 143


class SignalAtStep:
    """A sink (it runs in the calling process, the ddp supervisor) that raises SIGINT there
    when step ``step`` has ended, as a terminal's Ctrl-C would."""

    def __init__(self, step: int) -> None:
        self.step = step

    def handle(self, event: Any) -> None:
        if getattr(event, "global_step", None) == self.step and type(event).__name__ == "StepEnded":
            signal.raise_signal(signal.SIGINT)

    def close(self) -> None:
        pass


@pytest.mark.slow
def test_ctrl_c_under_ddp_checkpoints_then_raises_keyboard_interrupt(tmp_path: Path) -> None:
    import phalanx as px
    from ddp_helpers import make_data, mlp, sgd, slow_step

    learner = px.Learner(mlp, sgd, slow_step)
    with pytest.raises(KeyboardInterrupt) as info:
        learner.fit(
            make_data(64), epochs=2, batch_size=8, strategy="ddp", devices="cpu:0,cpu:1",
            run_dir=str(tmp_path / "run"), sinks=[SignalAtStep(2)],
        )  # fmt: skip
    assert type(info.value) is KeyboardInterrupt  # exactly: Python then exits as by Ctrl-C
    result = info.value.result  # type: ignore[attr-defined]
    assert result.interrupted == "Training interrupted: received SIGINT"
    assert 2 <= result.steps < 16
    assert (tmp_path / "run" / "checkpoints" / f"ckpt-{result.steps:09d}.pt").is_file()


class StopAtStep:
    """A sink (in the calling process, the ddp supervisor) that calls ``learner.stop`` when
    step ``step`` has ended, as user code watching the run would."""

    def __init__(self, learner: Any, step: int) -> None:
        self.learner, self.step = learner, step

    def handle(self, event: Any) -> None:
        if getattr(event, "global_step", None) == self.step and type(event).__name__ == "StepEnded":
            self.learner.stop("enough for now")

    def close(self) -> None:
        pass


@pytest.mark.slow
def test_learner_stop_under_ddp_returns_with_interrupted_set(tmp_path: Path) -> None:
    """learner.stop() is not a signal: fit returns (no exception) with ``interrupted`` set,
    after a checkpoint of the step the stop was read in, and no model.pt (not finished)."""
    import phalanx as px
    from ddp_helpers import make_data, mlp, sgd, slow_step

    learner = px.Learner(mlp, sgd, slow_step)
    result = learner.fit(
        make_data(64), epochs=2, batch_size=8, strategy="ddp", devices="cpu:0,cpu:1",
        run_dir=str(tmp_path / "run"), sinks=[StopAtStep(learner, 2)],
    )  # fmt: skip
    assert result.interrupted == "Training interrupted: enough for now"
    assert 2 <= result.steps < 16 and result.model_path is None
    assert (tmp_path / "run" / "checkpoints" / f"ckpt-{result.steps:09d}.pt").is_file()
    assert not (tmp_path / "run" / "model.pt").exists()
