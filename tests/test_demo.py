"""`phalanx demo` as a user runs it: a real process, its output read like a user reads it.

The single-device demo must pass 95% validation accuracy and print the summary; the chaos
demo must show three injected failures (kill, hang, exception), each with what was done
about it, and end with the accuracy of the clean run and an exact data ledger. The exit
status says whether the run trained to its end, not whether it reached an accuracy.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from procs import child_env

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX processes and signals")


def demo(tmp_path: Path, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "phalanx", "demo", "--run-dir", str(tmp_path / "run"), *args],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=timeout,
        cwd=tmp_path,
    )


def final_accuracy(out: str) -> float:
    m = re.search(
        r"final validation accuracy: ([\d.]+); every sample used exactly once per "
        r"epoch: (\w+)",
        out,
    )
    assert m, out[-2000:]
    assert m.group(2) == "True", "the data ledger is not exact"
    return float(m.group(1))


@pytest.mark.timeout(120)
def test_demo_reaches_95_percent_and_prints_progress_and_summary(tmp_path: Path) -> None:
    started = time.monotonic()
    run = demo(tmp_path, timeout=110)
    seconds = time.monotonic() - started
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    # The default demo runs in under a minute on 2 CPU cores (about 7 s there).
    assert seconds < 60, f"the default demo took {seconds:.1f} s"
    out = run.stdout
    assert final_accuracy(out) >= 0.95
    # progress: 1437 training images in global batches of 64
    assert re.search(
        r"epoch 1/8 step \d+/23 \(global \d+\): [\d,]+/1,437 samples  loss [\d.]+", out
    )
    assert "Learner Summary" in out
    for metric in ("accuracy", "f1", "loss"):
        assert re.search(rf"│ valid │ {metric} +│", out), metric
    assert (tmp_path / "run" / "metrics.csv").exists()
    assert list((tmp_path / "run").glob("checkpoints/*"))


@pytest.mark.timeout(180)
def test_demo_resumes_and_a_new_demo_run_starts_over(tmp_path: Path) -> None:
    """--resume continues the last demo run; without it the demo starts over in its run
    dir (fit alone would refuse to mix two runs there: PX118)."""
    checkpoints = tmp_path / "run" / "checkpoints"

    def newest() -> int:
        return max(int(p.stem.split("-")[1]) for p in checkpoints.glob("ckpt-*.pt"))

    first = demo(tmp_path, "--epochs", "2", timeout=110)
    # below 95% accuracy after 2 epochs, but it trained to its end: status 0
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert final_accuracy(first.stdout) < 0.95  # (0.883): the status says nothing of it
    assert newest() == 46  # 23 steps an epoch
    resumed = demo(tmp_path, "--epochs", "8", "--resume", timeout=110)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert re.search(r"resumed from \S+ckpt-000000046\.pt", resumed.stdout), resumed.stdout[:2000]
    assert "starting over" not in resumed.stdout
    assert final_accuracy(resumed.stdout) >= 0.95
    assert newest() == 184
    again = demo(tmp_path, "--epochs", "1", timeout=110)
    assert "starting over in" in again.stdout, again.stdout[:2000]
    assert "resumed from" not in again.stdout
    assert newest() == 23  # the new run's own checkpoints only
    # the last run's checkpoints and files were moved aside, not deleted
    (earlier,) = (tmp_path / "run" / "earlier").iterdir()
    assert (earlier / "checkpoints").is_dir() and (earlier / "run.json").exists()


def test_a_mistyped_argument_moves_or_deletes_nothing(tmp_path: Path) -> None:
    checkpoint = tmp_path / "run" / "checkpoints" / "ckpt-000000007.pt"
    checkpoint.parent.mkdir(parents=True)
    checkpoint.write_bytes(b"the last run's")
    for args in (["--strategy", "thread"], ["--devices", "cpu:0,cpu:0"], ["--fault", "kil:1@3"]):
        run = demo(tmp_path, *args, timeout=60)
        assert run.returncode in (1, 2), run.stdout + run.stderr
        assert checkpoint.read_bytes() == b"the last run's", args
        assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["checkpoints"], args


@pytest.mark.timeout(120)
def test_demo_without_a_run_dir_deletes_nothing(tmp_path: Path) -> None:
    """--run-dir "" trains without checkpoints; a checkpoints/ folder in the current
    directory is not the demo's to clear."""
    mine = tmp_path / "checkpoints" / "ckpt-000000007.pt"
    mine.parent.mkdir()
    mine.write_bytes(b"someone else's")
    run = subprocess.run(
        [sys.executable, "-m", "phalanx", "demo", "--run-dir", "", "--epochs", "1"],
        capture_output=True, text=True, env=child_env(), timeout=110, cwd=tmp_path,
    )  # fmt: skip
    assert "final validation accuracy" in run.stdout, run.stdout[-2000:] + run.stderr[-2000:]
    assert mine.read_bytes() == b"someone else's"
    assert "starting over" not in run.stdout


@pytest.mark.timeout(240)
def test_chaos_demo_survives_three_failures_with_the_clean_accuracy(tmp_path: Path) -> None:
    run = demo(
        tmp_path,
        "--strategy", "ddp", "--devices", "cpu:0,cpu:1,cpu:2", "--chaos", "3",
        timeout=220,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = run.stdout
    # Each failure as it happens, named, with its action ...
    live = re.findall(
        r"worker (\d) \(rank \d\) on device cpu:\1 failed at step (\d+).*-> (\w+)", out
    )
    assert len(live) == 3, out
    # ... and the timeline at the end: one row each, kill, hang and exception in turn.
    table = out[out.index("Failures and recoveries") :]
    rows = re.findall(r"│ (\d) +│ cpu:\1 +│ (\w+) +│ (\d+) +│ (\w+) +│ (\w+) +│", table)
    assert [r[1] for r in rows] == ["crash", "hang", "exception"], table
    assert [r[4] for r in rows] == ["respawned", "respawned", "retried"], table
    assert [(r[0], r[2], r[4]) for r in rows] == [(w, s, a) for w, s, a in live]
    assert "rejoin" in out  # a replacement came back in
    assert "Survived 3 failure(s): 1 crash, 1 hang, 1 exception." in out
    # the last replacement may still be starting when the run ends (a few seconds)
    assert re.search(r"Final world size: [23] of 3 worker\(s\) \(generation \d\)\.", out)
    fates = re.findall(r"Respawn: worker (\d) \(cpu:\1\), (\w+) at step (\d+): (.*)", out)
    assert [f[:3] for f in fates] == [r[:3] for r in rows[:2]], fates  # worker, kind, step
    assert fates[0][3].startswith("its replacement joined generation"), fates
    assert "now a clean run with the same seed and no faults" in out
    clean = re.search(r"clean run, same seed, no failures: validation accuracy ([\d.]+)", out)
    assert clean, out[-2000:]
    # The same model within float tolerance: the members' sums are added in another order
    # while the world is smaller, which can move one borderline validation sample of 360
    # (seen once in a loaded full suite: 0.972 against 0.969); never more.
    assert abs(final_accuracy(out) - float(clean.group(1))) <= 1 / 360 + 1e-3
    assert float(clean.group(1)) >= 0.95


@pytest.mark.timeout(120)
def test_ctrl_c_checkpoints_exits_130_and_resume_finishes(tmp_path: Path) -> None:
    """Ctrl-C is not success: the demo stops after its step with the checkpoint written,
    says so, exits 130 (as Python's KeyboardInterrupt does); --resume finishes the run."""
    import json
    import signal

    events = tmp_path / "run" / "events.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "phalanx", "demo", "--run-dir", str(tmp_path / "run")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
        cwd=tmp_path,
    )
    try:
        deadline = time.monotonic() + 60
        while not (events.exists() and '"StepEnded"' in events.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert proc.returncode == 130, out[-2000:] + err[-2000:]
    assert "interrupted after step" in err and "--resume" in err
    assert "final validation accuracy" not in out  # not reported as a finished run
    ended = [json.loads(line) for line in events.read_text().splitlines()][-1]
    assert ended["event"] == "RunEnded" and ended["interrupted"]
    assert list((tmp_path / "run" / "checkpoints").glob("ckpt-*.pt"))
    resumed = demo(tmp_path, "--resume", timeout=100)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert final_accuracy(resumed.stdout) >= 0.95
