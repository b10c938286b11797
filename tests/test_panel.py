"""The worker panel and the plain lines, driven by a recorded event stream and a fake clock
(no processes): a hang must be visible while it happens, long before ``hang_timeout``."""

from __future__ import annotations

import io
import re

from rich.console import Console

from phalanx.events import (
    Balanced,
    Beat,
    EpochEnded,
    Event,
    GenerationStarted,
    RunStarted,
    StepEnded,
    WorkerState,
    WorkersTick,
)
from phalanx.sinks import ProgressSink
from phalanx.sinks.workers import Workers, notice_after

T0 = 1_000_000.0
HANG = 60.0
DEVICES = ["cpu:0", "cpu:1"]


class FakeClock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


def recorded_hang() -> list[Event]:
    """What the ddp supervisor emits for 2 workers where worker 1 hangs in the forward of
    step 21 (0-based 20) at T0 + 10, while worker 0 goes on to wait in the sync."""
    events: list[Event] = []
    for w, device in enumerate(DEVICES):
        events.append(WorkerState(w, device, "starting", pid=100 + w, time=T0))
    events.append(GenerationStarted(0, [0, 1], DEVICES, "start", time=T0))
    for w, device in enumerate(DEVICES):
        events.append(WorkerState(w, device, "preflight", rank=w, pid=100 + w, time=T0 + 2))
        events.append(
            WorkerState(w, device, "training", rank=w, generation=0, pid=100 + w, time=T0 + 3)
        )
    events.append(
        RunStarted("runs/x", "ddp", DEVICES, 8, 23, 64, 1437, 360, time=T0 + 3)
    )  # fmt: skip
    events.append(
        StepEnded(0, 19, 20, 23, 0.5, 2e-5, 64, 1000.0, time=T0 + 9.9)
    )  # fmt: skip
    # heartbeats every 0.5 s: worker 1 entered forward of step 20 at T0 + 10 and stays;
    # worker 0 entered sync at T0 + 10.2 and waits there for it
    t = T0 + 10.0
    while t <= T0 + 20:
        events.append(
            WorkersTick(
                [Beat(0, "sync", 20, T0 + 10.2, HANG), Beat(1, "forward", 20, T0 + 10.0, HANG)],
                time=t,
            )
        )
        t += 0.5
    return events


def test_the_waiting_line_names_the_silent_worker_long_before_the_hang_timeout() -> None:
    workers = Workers()
    for e in recorded_hang():
        workers.update(e)
    assert workers.waiting(T0 + 10.5) is None  # a step in progress is not a wait
    wait = workers.waiting(T0 + 10 + notice_after(HANG) + 0.2)
    assert wait is not None and wait.worker == 1
    assert wait.text() == (
        "waiting on worker 1 (cpu:1): no progress for 3.2 s in forward; hang at 60 s"
    )
    assert notice_after(HANG) + 0.2 < HANG / 10  # visible within a tenth of the timeout


def test_the_waiting_line_names_the_worker_behind_not_a_peer_that_waited_first() -> None:
    """A fast peer reaches the step's backward (and blocks in its all-reduce) before the
    slow worker enters the forward it hangs in: the silent longest is the waiting peer, the
    one behind (its step, then its phase) is the one the others wait on."""
    workers = Workers()
    for w, device in enumerate(DEVICES):
        workers.update(WorkerState(w, device, "training", rank=w, generation=0, time=T0))
    beats = [Beat(0, "backward", 20, T0 + 10.0, HANG), Beat(1, "forward", 20, T0 + 10.1, HANG)]
    workers.update(WorkersTick(beats, time=T0 + 14))
    wait = workers.waiting(T0 + 14)
    assert wait is not None and (wait.worker, wait.phase) == (1, "forward")
    assert wait.text().startswith("waiting on worker 1 (cpu:1): no progress for 3.9 s")
    # a worker still in an earlier step is behind whatever its phase
    beats = [Beat(0, "data", 21, T0 + 10.0, HANG), Beat(1, "optimizer", 20, T0 + 10.1, HANG)]
    workers.update(WorkersTick(beats, time=T0 + 14))
    assert workers.waiting(T0 + 14).worker == 1  # type: ignore[union-attr]


def test_the_live_panel_shows_every_worker_and_the_wait_within_80_columns() -> None:
    clock = FakeClock()
    console = Console(file=io.StringIO(), force_terminal=True, width=80, height=40)
    sink = ProgressSink(console, clock=clock)
    for e in recorded_hang():
        clock.now = e.time
        sink.handle(e)
    clock.now = T0 + 13.2
    frame = Console(file=io.StringIO(), width=80, record=True)
    assert sink._progress is not None
    frame.print(sink._progress.get_renderable())
    text = frame.export_text()
    sink.close()
    lines = text.splitlines()
    assert all(len(line) <= 80 for line in lines), text
    assert re.search(r"epoch 1/8\s+━+\s+20/23", text), text  # the bar is whole
    assert re.search(r"^\s*worker\s+device\s+rank\s+gen\s+state\s+phase\s+step\s+idle", text, re.M)
    row0 = next(line for line in lines if re.match(r"\s*0\s+cpu:0", line))
    row1 = next(line for line in lines if re.match(r"\s*1\s+cpu:1", line))
    # Both silent about as long, told apart: worker 0 is healthy, waiting in the collective
    # for worker 1, which makes no progress.
    assert row0.split() == ["0", "cpu:0", "0", "0", "waiting", "sync", "21", "3.0s"]
    assert row1.split() == ["1", "cpu:1", "1", "0", "no", "progress", "forward", "21", "3.2s"]
    assert "waiting on worker 1 (cpu:1): no progress for 3.2 s in forward; hang at 60 s" in text


def test_plain_output_has_a_line_per_state_change_and_the_wait_with_timestamps() -> None:
    console = Console(file=io.StringIO(), force_terminal=False, width=200)
    sink = ProgressSink(console, every=100)
    for e in recorded_hang():
        sink.handle(e)
    sink.handle(WorkerState(1, "cpu:1", "fallen", rank=1, generation=0, pid=101, time=T0 + 70))
    out = console.file.getvalue()  # type: ignore[attr-defined]
    lines = out.splitlines()
    assert all(re.match(r"\d\d:\d\d:\d\d ", line) for line in lines), out
    text = [line[9:] for line in lines]
    states = [t for t in text if t.startswith("worker ") and ": " in t and "waiting" not in t]
    assert states == [
        "worker 0 (cpu:0): starting (pid 100)",
        "worker 1 (cpu:1): starting (pid 101)",
        "worker 0 (cpu:0): preflight (pid 100)",
        "worker 0 (cpu:0): training as rank 0 of generation 0 (pid 100)",
        "worker 1 (cpu:1): preflight (pid 101)",
        "worker 1 (cpu:1): training as rank 1 of generation 0 (pid 101)",
        "worker 1 (cpu:1): fallen (pid 101)",
    ]
    waits = [t for t in text if t.startswith("waiting on")]
    # told at the first tick where both have been silent for 3 s (worker 0 since T0 + 10.2),
    # again after each 10 s of it
    assert waits[0] == (
        "waiting on worker 1 (cpu:1): no progress for 3.5 s in forward; hang at 60 s"
    )
    assert len(waits) == 1  # the recording ends at 10 s of silence: no repeat yet
    first_wait = text.index(waits[0])
    assert first_wait < text.index("worker 1 (cpu:1): fallen (pid 101)")


def test_no_wait_is_told_while_the_survivors_regroup_after_the_hang() -> None:
    """Worker 1 is found hung at T0 + 70 and generation 1 is announced: worker 0, still in
    the broken step's sync by its last beat, is leaving it to regroup, not hung. Its
    silence counts from the announcement; a line names it only if it stays silent."""
    console = Console(file=io.StringIO(), force_terminal=False, width=200)
    sink = ProgressSink(console, every=100)
    after = [
        WorkerState(1, "cpu:1", "fallen", rank=1, generation=0, pid=101, time=T0 + 70),
        GenerationStarted(1, [0], DEVICES[:1], "worker 1 hang: respawned", time=T0 + 70),
        WorkerState(1, "cpu:1", "replaced", pid=101, detail="by pid 102", time=T0 + 70),
        WorkerState(1, "cpu:1", "joining", pid=102, time=T0 + 70),
    ]
    ticks = [
        WorkersTick([Beat(0, "sync", 20, T0 + 10.2, HANG)], time=T0 + 70 + dt)
        for dt in (0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5)
    ]
    for e in [*recorded_hang(), *after, *ticks]:
        sink.handle(e)
    text = [line[9:] for line in console.file.getvalue().splitlines()]  # type: ignore[attr-defined]
    waits = [(i, t) for i, t in enumerate(text) if t.startswith("waiting on")]
    fallen = text.index("worker 1 (cpu:1): fallen (pid 101)")
    assert [t for i, t in waits if i < fallen] == [
        "waiting on worker 1 (cpu:1): no progress for 3.5 s in forward; hang at 60 s"
    ]
    # none in the regroup's first 3 s (notice_after(60)); then its real silence (at T0 + 73)
    assert [t for i, t in waits if i > fallen] == [
        "waiting on worker 0 (cpu:0): no progress for 62.8 s in sync; hang at 60 s"
    ]
    assert notice_after(HANG) == 3.0


def test_a_wait_is_not_reported_while_any_watched_worker_makes_progress() -> None:
    workers = Workers()
    workers.update(WorkerState(0, "cpu:0", "training", rank=0, generation=0, time=T0))
    workers.update(WorkerState(1, "cpu:1", "training", rank=1, generation=0, time=T0))
    workers.update(
        WorkersTick([Beat(0, "forward", 5, T0 + 9.5, HANG), Beat(1, "sync", 5, T0, HANG)])
    )
    assert workers.waiting(T0 + 10) is None
    # a worker that is starting or has fallen is not watched
    workers.update(WorkerState(0, "cpu:0", "fallen", time=T0 + 11))
    assert workers.waiting(T0 + 20) is not None
    assert workers.waiting(T0 + 20).worker == 1  # type: ignore[union-attr]


def test_epoch_lines_above_the_bars_wrap_between_words() -> None:
    console = Console(file=io.StringIO(), force_terminal=True, width=60, height=40)
    sink = ProgressSink(console)
    metrics = {f"valid/metric_{i}": 0.123456 * i for i in range(1, 9)}
    sink.handle(EpochEnded(epoch=0, metrics=metrics, seconds=1.0))
    sink.close()
    out = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", console.file.getvalue())  # type: ignore[attr-defined]
    lines = [line.rstrip() for line in out.replace("\r", "\n").splitlines() if line.strip()]
    assert len(lines) > 1 and all(len(line) <= 60 for line in lines)
    words = " ".join(lines).split()
    for i in range(1, 9):
        assert f"valid/metric_{i}" in words  # no name cut in two


def test_a_replacement_row_starts_without_its_predecessors_rank_and_generation() -> None:
    workers = Workers()
    workers.update(WorkerState(1, "cpu:1", "training", rank=1, generation=0, pid=5, time=T0))
    workers.update(WorkerState(1, "cpu:1", "fallen", pid=5, time=T0 + 1))
    workers.update(WorkerState(1, "cpu:1", "replaced", pid=5, detail="by pid 6", time=T0 + 1))
    workers.update(WorkerState(1, "cpu:1", "joining", pid=6, time=T0 + 1))
    row = workers.rows[1]
    assert (row.state, row.rank, row.generation) == ("joining", None, None)
    workers.update(WorkerState(1, "cpu:1", "training", rank=1, generation=2, pid=6, time=T0 + 4))
    assert (row.state, row.rank, row.generation) == ("training", 1, 2)


# Balance (phalanx.balance): a member named slow, and the shares once they move from even.


def rendered(workers: Workers, now: float) -> list[list[str]]:
    """The panel's table as words, a list per line (the header first)."""
    frame = Console(file=io.StringIO(), width=80, record=True)
    frame.print(workers.table(now))
    return [line.split() for line in frame.export_text().splitlines() if line.strip()]


def test_a_slow_member_and_the_shares_show_in_its_row_within_80_columns() -> None:
    """Worker 1 named slow after step 16 and given 40% of each batch: its row says so, and
    says ``no progress`` still when the others wait on it."""
    events = recorded_hang()
    at = next(i for i, e in enumerate(events) if isinstance(e, WorkersTick))
    decided = Balanced(16, [0.6, 0.4], [1e-3, 1.6e-3], slow=[1], changed=True, time=T0 + 9.95)
    events.insert(at, decided)
    clock = FakeClock()
    console = Console(file=io.StringIO(), force_terminal=True, width=80, height=40)
    sink = ProgressSink(console, clock=clock)
    frames = []
    for e in events:
        clock.now = e.time
        sink.handle(e)
        if e.time in (T0 + 10.5, T0 + 13.5):  # a step in progress; the others wait on 1
            frame = Console(file=io.StringIO(), width=80, record=True)
            assert sink._progress is not None
            frame.print(sink._progress.get_renderable())
            frames.append(frame.export_text())
    sink.close()
    for text in frames:
        assert all(len(line) <= 80 for line in text.splitlines()), text
        header = r"^\s*worker\s+device\s+rank\s+gen\s+state\s+phase\s+step\s+idle\s+share\s*$"
        assert re.search(header, text, re.M), text
    rows = [[line.split() for line in f.splitlines() if re.match(r"\s*[01]\s+cpu:", line)]
            for f in frames]  # fmt: skip
    assert rows[0] == [
        ["0", "cpu:0", "0", "0", "training", "sync", "21", "0.3s", "60%"],
        ["1", "cpu:1", "1", "0", "slow", "forward", "21", "0.5s", "40%"],
    ]
    assert rows[1] == [
        ["0", "cpu:0", "0", "0", "waiting", "sync", "21", "3.3s", "60%"],
        ["1", "cpu:1", "1", "0", "no", "progress", "forward", "21", "3.5s", "40%"],
    ]


def test_ranks_become_rows_through_the_generation_and_a_new_one_starts_even() -> None:
    """Generation 1 is workers 0 and 2 (worker 1 fell): rank 1 is worker 2's row. Named
    with shares kept even: no share column. Generation 2 forgets both."""
    devices = ["cpu:0", "cpu:1", "cpu:2"]
    workers = Workers()
    workers.update(GenerationStarted(0, [0, 1, 2], devices, "start", time=T0))
    for w, device in enumerate(devices):
        workers.update(WorkerState(w, device, "training", rank=w, generation=0, time=T0))
    workers.update(WorkerState(1, "cpu:1", "fallen", time=T0 + 1))
    workers.update(GenerationStarted(1, [0, 2], ["cpu:0", "cpu:2"], "worker 1 crash", time=T0 + 2))
    for rank, w in enumerate((0, 2)):
        workers.update(WorkerState(w, devices[w], "training", rank=rank, generation=1, time=T0 + 3))
    workers.update(Balanced(24, [0.5, 0.5], [1e-3, 2e-3], slow=[1], changed=False, time=T0 + 4))
    table = rendered(workers, T0 + 5)
    assert table[0] == ["worker", "device", "rank", "gen", "state", "phase", "step", "idle"]
    assert [row[4] for row in table[1:]] == ["training", "fallen", "slow"]
    workers.update(Balanced(32, [0.7, 0.3], [1e-3, 2e-3], changed=True, time=T0 + 6))
    table = rendered(workers, T0 + 7)
    assert table[0][-1] == "share"
    assert [(row[0], row[-1]) for row in table[1:]] == [("0", "70%"), ("1", "fallen"),
                                                        ("2", "30%")]  # fmt: skip
    workers.update(GenerationStarted(2, [0, 2], ["cpu:0", "cpu:2"], "rebuild", time=T0 + 8))
    table = rendered(workers, T0 + 9)
    assert table[0][-1] == "idle"
    assert "slow" not in [word for row in table for word in row]
    assert all(row.share is None and not row.slow for row in workers.rows.values())


def test_in_process_members_are_found_by_their_rank() -> None:
    """threads: no generations; the rows RunStarted made carry the ranks."""
    workers = Workers()
    devices = ["cpu:0", "cpu:1", "cpu:2"]
    workers.update(RunStarted("runs/x", "threads", devices, 1, 10, 30, 300, 0, time=T0))
    workers.update(Balanced(8, [0.4, 0.4, 0.2], [1e-3, 1e-3, 2e-3], slow=[2], time=T0 + 1))
    table = rendered(workers, T0 + 2)
    states = [(row[4], row[-1]) for row in table[1:]]
    assert states == [("training", "40%"), ("training", "40%"), ("slow", "20%")]
