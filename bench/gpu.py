"""One GPU, one table: phalanx on ``cuda:0`` end to end (issue 11, "For a lent GPU").

    .venv/bin/python bench/gpu.py [--device cuda:0] [--quick] [--only ROW,ROW]
                                  [--rounds 3] [--steps 300] [--sizes medium,large]

Meant to finish in under 5 minutes on one GPU (not yet timed on one: no GPU has been lent
so far); ``--device cpu --quick`` takes about 80 s on the 2-core development machine. Every
row is measured in this run, none is written in. Rows (``--only`` takes their keys):

- ``demo-single``, ``demo-ddp``: the demo CNN on scikit-learn's digits
  (``phalanx.demo``) trained on the device, ``strategy="single"`` and ``strategy="ddp"``
  with one worker (NCCL on CUDA): wall time and final validation accuracy (ok: every epoch
  ran, the ledger is exact and the accuracy reaches ``DEMO_MIN_ACCURACY``).
- ``overhead``: per-step cost of phalanx ddp (1 worker) against plain torch DDP (world size
  1, NCCL on CUDA, gloo on CPU), the same MLP, data and global batch as ``bench/steps.py``
  (its helpers; the plain arm is its ``floor``: rank 0 indexes its slice of the plan's
  batch from the tensors and copies it to the device, and reads the loss each step as
  phalanx does). Arms interleaved round by round (the order flips every round), median of
  the rounds' mean step intervals after the first ``steps.WARM``; one row per model size.
  ok: both arms ran (the ratio is reported, not judged).
- ``group``: phalanx's own process-group code (``GenerationGroup``) with one member on the
  device, in a fresh process: forms over NCCL (gloo on CPU), all-reduces the vote's float64
  tensor (blocking and async), broadcasts bytes, a barrier, one DDP backward over the
  group, leaves, and forms a second generation's group on a new prefix (what a rebuild
  does).
- ``reference``: a clean ddp run of a small MLP, 1 worker: the weights the next rows are
  checked against (relative difference at most ``TOLERANCE``).
- ``vote``: an exception in forward at step ``FAULT_STEP``: the vote carries it, the step
  is retried in the same group, the model matches the reference.
- ``oom-split``: a step that pads its batch to its longest sample (activation memory grows
  with rows x longest length); one long sample at step ``FAULT_STEP`` makes the full share
  ask the CUDA allocator for 1.5x the device's free memory (measured in the worker at that
  moment with ``cudaMemGetInfo``), so ``torch.OutOfMemoryError`` comes from the allocator
  itself. phalanx splits the share in two micro-batches (0.75x free each: it fits) and
  retries; ok: failure recorded as ``split``, no new generation, model matches the
  reference. On CPU there is no CUDA allocator: the step raises ``torch.OutOfMemoryError``
  itself past a 64 MiB budget (the row says "simulated").
- ``rebuild``: an exception in the middle of backward (after DDP began reducing): the
  group is aborted and a new one formed with the same member (a second NCCL communicator),
  the step computed again; model matches.
- ``restart``: the only worker SIGKILLed at step ``KILL_STEP``, snapshots off: every
  member fell, so the run starts a new process on the device from its newest checkpoint
  (every 5 steps); model and ledger match.
- ``snapshot``: the same kill without a run_dir, snapshots every 2 steps: the new process
  restores the snapshot in shared memory (on CUDA the parameters and optimizer state were
  copied device to host on a stream of their own, in a background thread fenced before
  the next optimizer step); the ``Resumed`` event names it, model and ledger match.
- ``fsdp-train``, ``fsdp-vote``, ``fsdp-rebuild``: ``strategy="fsdp"`` (FSDP2 over the
  generation's default group, NCCL on CUDA) with one worker: a clean run, an exception in
  ``data`` (the vote in the root's reduce-scatter, the step retried in the same group) and
  one in ``forward`` (the group aborted and rebuilt, the worker's kept shards taken back);
  each matches the reference. ``fsdp-respawn``: two devices, worker 1 killed at
  ``KILL_STEP`` and respawned, both restoring the newest shard set from shared memory;
  skipped with one GPU. ``fsdp-mp``: one worker, FSDP2's bfloat16 ``MixedPrecisionPolicy``
  (``fit(mp_policy=)``), every Linear a unit (the vote's box carried by the last, in 8-bit
  pieces), an exception in ``data`` retried; float32 weights within bfloat16's rounding of
  the reference.
- ``handover``: two workers, one killed at ``KILL_STEP``, respawned; the survivor goes on
  alone, then hands its state over to the replacement over the group (steps slowed to
  ``SLOW_S`` so that the replacement joins before the end). Needs two devices:
  ``cpu:0,cpu:1`` on CPU, the device and another GPU on CUDA; skipped with one GPU.

Exit status 0 when no row failed (skipped rows do not count), 1 otherwise, 2 when the
device is not there. ``--device cpu --quick`` is the smoke test on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import functools
import os
import queue
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import steps  # bench/steps.py, beside this file: the overhead table's model, data, timing
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import TensorDataset

import phalanx as px
from phalanx import demo
from phalanx.events import Event, GenerationStarted, Resumed, StepEnded
from phalanx.metrics import Accuracy
from phalanx.plan import Plan, split

ROWS = (
    "demo-single",
    "demo-ddp",
    "overhead",
    "group",
    "reference",
    "vote",
    "oom-split",
    "rebuild",
    "restart",
    "snapshot",
    "handover",
    "fsdp-train",
    "fsdp-vote",
    "fsdp-rebuild",
    "fsdp-respawn",
    "fsdp-mp",
)
NEEDS_REFERENCE = ROWS[ROWS.index("reference") + 1 :]  # (every row after it)

DEMO_BATCH = 64
# epochs -> the least final validation accuracy that passes (measured on CPU: 0.883 after 2)
DEMO_MIN_ACCURACY = {2: 0.80, 8: 0.90}

# The fault rows: a small MLP, 512 samples, global batch 32 (16 steps an epoch).
FAULT_SAMPLES, FAULT_BATCH, FAULT_SEED = 512, 32, 3
FAULT_EPOCHS = 4  # 64 steps, --quick too (the handover needs the time)
FAULT_STEP = 10  # vote, oom-split, rebuild: a step after preflight, in the first epoch
KILL_STEP = 12  # restart, handover (checkpoints every 5 steps: restart goes back to 10)
LONG = 16  # the long sample's length (every other sample has length 1)
TOLERANCE = 1e-4  # relative weight difference to the reference (split changes sum order)
CPU_BUDGET = 64 * 2**20  # the simulated free memory on CPU, bytes
HANG_S = 30.0
SLOW_S = 0.3  # the handover row's step: its 52 steps after the kill take about 16 s


@dataclass
class Row:
    key: str
    what: str
    result: str = "FAIL"
    seconds: float | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return not (self.result == "ok" or self.result.startswith("skipped"))

    def check(self, ok: bool, note: str) -> None:
        """A condition of the row: every one must hold; a broken one is named in the notes."""
        if not ok:
            self.notes.append(f"NOT MET: {note}")
            self.result = "FAIL"


class Recorder:
    """Every event of a run (sinks run in this process under ddp too)."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def handle(self, event: Event) -> None:
        self.events.append(event)

    def close(self) -> None:
        pass

    def generations(self) -> list[GenerationStarted]:
        return [e for e in self.events if isinstance(e, GenerationStarted)]

    def committed(self) -> list[int]:
        return [e.global_step for e in self.events if isinstance(e, StepEnded)]


def backend(device: str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(torch.device(device))


# -- demo ---------------------------------------------------------------------------------------
def demo_row(row: Row, device: str, strategy: str, epochs: int, seen: dict[str, float]) -> None:
    train, valid = demo.load_digits_split()
    learner = px.Learner(
        demo.make_model, demo.make_optimizer, demo.train_step, metrics=[Accuracy()]
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as `phalanx demo` does (its batches are small)
    try:
        result = learner.fit(
            train,
            valid=valid,
            epochs=epochs,
            batch_size=DEMO_BATCH,
            devices=device,
            strategy=strategy,
            seed=0,
            sinks=[],
        )
    finally:
        torch.set_num_threads(threads)
    accuracy = result.history[-1].get("valid/accuracy") if result.history else None
    row.result = "ok"
    row.check(result.epochs == epochs, f"{epochs} epochs (ran {result.epochs})")
    row.check(result.ledger_ok is True, "ledger exact")
    row.check(accuracy is not None, "a validation accuracy")
    if accuracy is not None:
        seen[strategy] = accuracy
        least = DEMO_MIN_ACCURACY[epochs]
        row.check(accuracy >= least, f"accuracy >= {least}")
        other = seen.get("single") if strategy == "ddp" else None
        vs = f" (single: {other:.3f})" if other is not None else ""
        row.notes.insert(0, f"valid accuracy {accuracy:.3f}{vs}")
    per_step = result.seconds / max(1, result.steps) * 1e3
    row.notes.append(f"{result.steps} steps, {epochs} epochs, fit {result.seconds:.1f} s "
                     f"({per_step:.1f} ms/step incl. validation and start-up)")  # fmt: skip


# -- overhead: phalanx ddp against plain torch DDP, one worker -----------------------------------
def _plain_worker(device: str, port: int, n: int, size: str, out: Any) -> None:
    """Plain torch DDP, world size 1: ``steps.py``'s floor, on ``device``."""
    width, layers, batch = steps.SIZES[size]
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    else:
        torch.set_num_threads(max(1, os.cpu_count() or 1))
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group(backend(device), store=store, rank=0, world_size=1)
    torch.manual_seed(0)
    ids = [dev.index or 0] if dev.type == "cuda" else None
    model = DistributedDataParallel(steps.make_model(width, layers).to(dev), device_ids=ids)
    opt = steps.make_optimizer(model.parameters())
    data = steps.dataset(n * batch)
    plan = Plan(len(data), batch, seed=0)
    order = plan.order(0)
    x, y = data.tensors
    stamps: list[float] = []
    for s in range(n):
        idx = torch.tensor(split(plan.global_batch(0, s, order), 1)[0])
        xb, yb = x[idx].to(dev, non_blocking=True), y[idx].to(dev, non_blocking=True)
        loss = nn.functional.cross_entropy(model(xb), yb)
        float(loss.detach())  # the loss read each step, as phalanx reads it (and users log it)
        opt.zero_grad()
        loss.backward()
        opt.step()
        stamps.append(time.time())
    sync(device)
    out.put(stamps)
    dist.destroy_process_group()


def in_child(target: Callable[..., None], *args: Any, limit: float = 300.0) -> Any:
    """Run ``target(*args, queue)`` in a spawned process; what it put on the queue. Raises
    when the process ends without a word or takes longer than ``limit`` seconds."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, out))
    proc.start()
    deadline = time.monotonic() + limit
    try:
        while True:
            try:
                return out.get(timeout=1.0)
            except queue.Empty:
                if not proc.is_alive() and out.empty():
                    raise RuntimeError(f"the process exited ({proc.exitcode}), no result") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no result in {limit:.0f} s") from None
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
            proc.join()


def plain_run(device: str, n: int, size: str) -> list[float]:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    stamps: list[float] = in_child(_plain_worker, device, store.port, n, size)
    return stamps


def phalanx_run(device: str, n: int, size: str) -> list[float]:
    sink = steps.Stamps()
    steps.phalanx_fit(n, size, device, sink)
    return sink.times


def overhead_row(row: Row, device: str, n: int, rounds: int, size: str) -> None:
    arms: dict[str, Callable[[], list[float]]] = {
        "ddp": lambda: plain_run(device, n, size),
        "phalanx": lambda: phalanx_run(device, n, size),
    }
    times: dict[str, list[float]] = {a: [] for a in arms}
    for r in range(rounds):
        for arm in list(arms) if r % 2 == 0 else list(arms)[::-1]:
            stamps = arms[arm]()
            if len(stamps) != n:
                raise RuntimeError(f"{arm}: {len(stamps)} steps stamped, {n} expected")
            times[arm].append(steps.mean_interval(stamps))
        line = ", ".join(f"{a} {times[a][-1] * 1e3:.3f}" for a in arms)
        print(f"overhead {size}, round {r + 1}: {line} ms/step", file=sys.stderr, flush=True)
    plain, ours = (statistics.median(times[a]) * 1e3 for a in ("ddp", "phalanx"))
    rounds_text = "; ".join(f"{a} " + "/".join(f"{t * 1e3:.2f}" for t in times[a]) for a in arms)
    row.result = "ok"
    row.notes += [
        f"torch DDP {plain:.3f} ms/step, phalanx {ours:.3f} ms/step: "
        f"{ours / plain:.3f}x, {ours - plain:+.3f} ms/step (median of {rounds})",
        f"goal +0.5 ms/step or less: {'met' if ours - plain <= 0.5 else 'not met'}",
        f"rounds (ms): {rounds_text}",
    ]


# -- group: phalanx's GenerationGroup with one member --------------------------------------------
def _group_child(device: str, out: Any) -> None:
    from phalanx.strategies.ddp.worker.group import GenerationGroup

    try:
        dev = torch.device(device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        timeout = timedelta(seconds=HANG_S)
        notes, t0 = [], time.perf_counter()
        group = GenerationGroup.form(store, "g0/", 0, 1, dev, timeout)
        vote = torch.arange(16, dtype=torch.float64, device=dev)
        group.all_reduce(vote)  # (an NCCL communicator is created lazily, at its first use)
        sync(device)
        notes.append(f"formed + first all-reduce {time.perf_counter() - t0:.3f} s")
        t = time.perf_counter()
        for _ in range(100):
            group.wait(group.all_reduce_async(vote))
        sync(device)
        notes.append(f"vote all-reduce {(time.perf_counter() - t) * 1e4:.0f} us")
        assert vote.cpu().tolist() == [float(i) for i in range(16)], "all-reduce of 1 changed it"
        assert group.broadcast_bytes(b"phalanx", 0) == b"phalanx", "broadcast_bytes"
        group.barrier()
        torch.manual_seed(0)
        model = group.wrap(nn.Linear(8, 4).to(dev), init_sync=True)
        model(torch.randn(5, 8, device=dev)).sum().backward()
        sync(device)
        grad = model.module.weight.grad
        assert grad is not None and bool(torch.isfinite(grad).all()), "DDP backward"
        del model
        group.leave()
        t = time.perf_counter()
        second = GenerationGroup.form(store, "g1/", 0, 1, dev, timeout)
        again = torch.ones(4, device=dev)
        second.all_reduce(again)
        sync(device)
        notes.append(f"second group {time.perf_counter() - t:.3f} s")
        second.leave()
        out.put(("ok", notes))
    except Exception as exc:
        out.put(("FAIL", [f"{type(exc).__name__}: {exc}".splitlines()[0][:200]]))


def group_row(row: Row, device: str) -> None:
    row.result, notes = in_child(_group_child, device, limit=120.0)
    row.notes += notes


# -- the fault rows ------------------------------------------------------------------------------
def fault_data() -> TensorDataset:
    """x (8 features), y (a smooth target) and each sample's length: 1, but ``LONG`` for the
    first sample of step ``FAULT_STEP``'s batch (the one that makes the out-of-memory step)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(FAULT_SAMPLES, 8, generator=gen)
    y = (x[:, :3].sum(dim=1, keepdim=True) - x[:, 3:4] * x[:, 4:5]).tanh()
    length = torch.ones(FAULT_SAMPLES, dtype=torch.long)
    length[long_sample()] = LONG
    return TensorDataset(x, y, length)


def long_sample() -> int:
    plan = Plan(FAULT_SAMPLES, FAULT_BATCH, FAULT_SEED)
    epoch, step = divmod(FAULT_STEP, plan.steps)
    return plan.global_batch(epoch, step)[0]


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def mse(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y, _ = batch
    return nn.functional.mse_loss(model(x), y)


class PaddedStep:
    """``mse``, plus the activation memory of a batch padded to its longest sample:
    ``rows x longest x unit`` bytes, where the unit makes a full share (``share`` rows) with
    the long sample need ``OVER`` x the device's free memory (read when it is needed). On
    CUDA the allocator raises torch.OutOfMemoryError; on CPU (no allocator to ask) the step
    raises it itself past ``CPU_BUDGET``."""

    OVER = 1.5

    def __init__(self, share: int) -> None:
        self.share = share

    def __call__(self, model: nn.Module, batch: Any) -> torch.Tensor:
        x, _, length = batch
        longest = int(length.max())
        if longest > 1:
            dev = x.device
            cuda = dev.type == "cuda"
            free = torch.cuda.mem_get_info(dev)[0] if cuda else CPU_BUDGET
            need = int(self.OVER * free * len(x) * longest / (self.share * LONG))
            if not cuda and need > free:
                raise torch.OutOfMemoryError(
                    f"simulated out of memory: tried to allocate {need} bytes, {free} free"
                )
            padded = torch.empty(need, dtype=torch.uint8, device=dev)  # the padded activations
            del padded
            if cuda:
                torch.cuda.empty_cache()  # (so the later steps run as the reference's did)
        return mse(model, batch)


def slow_mse(model: nn.Module, batch: Any) -> torch.Tensor:
    """``mse`` after ``SLOW_S``: the handover run lasts long enough for a replacement (a new
    process: imports, CUDA context, model) to start and join before the last step."""
    time.sleep(SLOW_S)
    return mse(model, batch)


def fault_fit(
    device: str,
    epochs: int,
    faults: Sequence[px.Fault] = (),
    step: Callable[[nn.Module, Any], torch.Tensor] = mse,
    **fit: Any,
) -> tuple[px.FitResult, Recorder]:
    rec = Recorder()
    result = px.Learner(mlp, sgd, step).fit(
        fault_data(),
        epochs=epochs,
        batch_size=FAULT_BATCH,
        devices=fit.pop("devices", device),
        strategy=fit.pop("strategy", "ddp"),
        seed=FAULT_SEED,
        faults=faults,
        hang_timeout=timedelta(seconds=HANG_S),
        sinks=[rec],
        **fit,
    )
    return result, rec


def params(model: nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone().cpu() for t in model.state_dict().values()]


def rel_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """Per tensor max|a-b| / max|b|; the largest over the tensors."""
    return max(float((x - y).abs().max() / y.abs().max()) for x, y in zip(a, b, strict=True))


def reference_row(row: Row, device: str, epochs: int, ref: dict[str, Any]) -> None:
    result, rec = fault_fit(device, epochs)
    total = epochs * Plan(FAULT_SAMPLES, FAULT_BATCH).steps
    row.result = "ok"
    row.check(result.steps == total, f"{total} steps (ran {result.steps})")
    row.check(result.failures == [], "no failure")
    row.check(result.ledger_ok is True, "ledger exact")
    gens = rec.generations()
    row.check([g.members for g in gens] == [[0]], "one generation of one member")
    ref["params"], ref["steps"] = params(result.model), total
    row.notes.append(f"{total} steps, {result.seconds:.1f} s")


def same_run(row: Row, result: px.FitResult, rec: Recorder, ref: dict[str, Any]) -> None:
    """Every step committed, each sample once an epoch, the reference's weights."""
    total = ref["steps"]
    row.check(result.steps == total, f"{total} steps (ran {result.steps})")
    row.check(sorted(set(rec.committed())) == list(range(1, total + 1)), "every step committed")
    row.check(result.ledger_ok is True, "ledger exact")
    diff = rel_diff(params(result.model), ref["params"])
    row.check(diff <= TOLERANCE, f"model matches the reference ({diff:.1e} > {TOLERANCE:.0e})")
    row.notes.append(f"model vs reference {diff:.1e}")


def summary(result: px.FitResult) -> list[tuple[int, str, int | None, str | None]]:
    return [(f.worker, f.kind, f.step, f.action) for f in result.failures]


def expect(row: Row, result: px.FitResult, wanted: list[tuple[int, str, int, str]]) -> None:
    got = summary(result)
    row.check(got == wanted, f"failures {wanted} (got {got})")
    for f in result.failures:
        back = "" if f.recovery_seconds is None else f", next step {f.recovery_seconds:.2f} s later"
        row.notes.insert(0, f"worker {f.worker} {f.kind}@{f.step}/{f.phase}: {f.action}{back}")


def causes(rec: Recorder) -> list[tuple[list[int], str]]:
    return [(g.members, g.cause) for g in rec.generations()]


def vote_row(row: Row, device: str, epochs: int, ref: dict[str, Any]) -> None:
    result, rec = fault_fit(device, epochs, [px.Fault("exception", 0, FAULT_STEP)])
    row.result = "ok"
    expect(row, result, [(0, "exception", FAULT_STEP, "retried")])
    row.check(causes(rec) == [([0], "start")], "no new generation")
    same_run(row, result, rec, ref)


def oom_row(row: Row, device: str, epochs: int, ref: dict[str, Any]) -> None:
    result, rec = fault_fit(device, epochs, step=PaddedStep(FAULT_BATCH))
    row.result = "ok"
    expect(row, result, [(0, "oom", FAULT_STEP, "split")])
    ooms = [f for f in result.failures if f.kind == "oom"]
    if ooms:
        row.notes.append(f"{ooms[0].exception_type}: {ooms[0].message.splitlines()[0][:90]}")
    row.check(causes(rec) == [([0], "start")], "no new generation")
    same_run(row, result, rec, ref)


def rebuild_row(row: Row, device: str, epochs: int, ref: dict[str, Any]) -> None:
    fault = px.Fault("exception", 0, FAULT_STEP, phase="backward")
    result, rec = fault_fit(device, epochs, [fault])
    row.result = "ok"
    expect(row, result, [(0, "exception", FAULT_STEP, "retried")])
    wanted = [([0], "start"), ([0], "worker 0 exception in backward: rebuilt")]
    row.check(causes(rec) == wanted, f"generations {wanted} (got {causes(rec)})")
    same_run(row, result, rec, ref)


def restart_row(row: Row, device: str, epochs: int, ref: dict[str, Any]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        result, rec = fault_fit(
            device,
            epochs,
            [px.Fault("kill", 0, KILL_STEP)],
            run_dir=os.path.join(tmp, "run"),
            checkpoint=px.Checkpoints(every_steps=5),
            on_failure=px.Recovery(mode="respawn"),
            snapshots=False,
        )
    row.result = "ok"
    expect(row, result, [(0, "crash", KILL_STEP, "restarted")])
    wanted = [([0], "start"), ([0], "restart from the newest snapshot or checkpoint")]
    row.check(causes(rec) == wanted, f"generations {wanted} (got {causes(rec)})")
    same_run(row, result, rec, ref)


def snapshot_row(row: Row, device: str, epochs: int, ref: dict[str, Any]) -> None:
    result, rec = fault_fit(
        device,
        epochs,
        [px.Fault("kill", 0, KILL_STEP)],
        on_failure=px.Recovery(mode="respawn"),
        snapshots=px.Snapshots(every_steps=2),
    )
    row.result = "ok"
    expect(row, result, [(0, "crash", KILL_STEP, "restarted")])
    resumed = [e.path for e in rec.events if isinstance(e, Resumed)]
    from_memory = len(resumed) == 1 and resumed[0].startswith("shared memory")
    row.check(from_memory, f"restored from a snapshot in shared memory (got {resumed})")
    same_run(row, result, rec, ref)


def second_device(device: str) -> str | None:
    dev = torch.device(device)
    if dev.type == "cpu":
        return "cpu:1" if device != "cpu:1" else "cpu:0"
    if dev.type == "cuda":
        index = dev.index or 0
        others = [i for i in range(torch.cuda.device_count()) if i != index]
        return f"cuda:{others[0]}" if others else None
    return None


def handover_row(row: Row, device: str, epochs: int, ref: dict[str, Any]) -> None:
    other = second_device(device)
    if other is None:
        row.result = "skipped: needs a second device (one GPU here)"
        return
    first = "cpu:0" if torch.device(device).type == "cpu" else device
    result, rec = fault_fit(
        device,
        epochs,
        [px.Fault("kill", 1, KILL_STEP)],
        step=slow_mse,
        devices=f"{first},{other}",
        on_failure=px.Recovery(mode="respawn"),
    )
    row.what += f" ({first},{other})"
    row.result = "ok"
    expect(row, result, [(1, "crash", KILL_STEP, "respawned")])
    gens = causes(rec)
    row.check(bool(gens) and gens[-1][0] == [0, 1], f"the replacement rejoined (got {gens})")
    row.check(any(m == [0] for m, _ in gens), "the survivor went on alone first")
    crash = next((f for f in result.failures if f.kind == "crash"), None)
    joined = rec.generations()[-1]
    if crash is not None and joined.members == [0, 1]:
        row.notes.append(
            f"replacement joined {joined.time - crash.time:.1f} s after the kill "
            f"(generation {joined.number}: {joined.cause}); no run_dir, so its state came "
            "from the survivor"
        )
    same_run(row, result, rec, ref)


def fsdp_train_row(row: Row, device: str, epochs: int, ref: dict[str, Any]) -> None:
    result, rec = fault_fit(device, epochs, strategy="fsdp")
    row.result = "ok"
    row.check(result.failures == [], "no failure")
    row.check(causes(rec) == [([0], "start")], "one generation")
    same_run(row, result, rec, ref)


def fsdp_vote_row(row: Row, device: str, epochs: int, ref: dict[str, Any]) -> None:
    fault = px.Fault("exception", 0, FAULT_STEP, phase="data")
    result, rec = fault_fit(device, epochs, [fault], strategy="fsdp")
    row.result = "ok"
    expect(row, result, [(0, "exception", FAULT_STEP, "retried")])
    row.check(causes(rec) == [([0], "start")], "no new generation")
    same_run(row, result, rec, ref)


def fsdp_rebuild_row(row: Row, device: str, epochs: int, ref: dict[str, Any]) -> None:
    fault = px.Fault("exception", 0, FAULT_STEP, phase="forward")
    result, rec = fault_fit(device, epochs, [fault], strategy="fsdp")
    row.result = "ok"
    expect(row, result, [(0, "exception", FAULT_STEP, "retried")])
    wanted = [([0], "start"), ([0], "worker 0 exception in forward: rebuilt")]
    row.check(causes(rec) == wanted, f"generations {wanted} (got {causes(rec)})")
    same_run(row, result, rec, ref)


def fsdp_respawn_row(row: Row, device: str, epochs: int, ref: dict[str, Any]) -> None:
    other = second_device(device)
    if other is None:
        row.result = "skipped: needs a second device (one GPU here)"
        return
    first = "cpu:0" if torch.device(device).type == "cpu" else device
    result, rec = fault_fit(
        device, epochs, [px.Fault("kill", 1, KILL_STEP)], step=slow_mse,
        devices=f"{first},{other}", on_failure=px.Recovery(mode="respawn"), strategy="fsdp",
    )  # fmt: skip
    row.what += f" ({first},{other})"
    row.result = "ok"
    expect(row, result, [(1, "crash", KILL_STEP, "respawned")])
    gens = causes(rec)
    row.check(bool(gens) and gens[-1][0] == [0, 1], f"the replacement rejoined (got {gens})")
    same_run(row, result, rec, ref)


MP_TOLERANCE = 5e-2  # bfloat16 compute against the float32 reference


def fsdp_mp_row(row: Row, device: str, epochs: int, ref: dict[str, Any]) -> None:
    """fsdp with FSDP2's bfloat16 MixedPrecisionPolicy, every Linear a unit (the vote's box
    carried by the last, its ballot in 8-bit pieces): an exception in data is retried; the
    weights stay float32, within bfloat16's rounding of the float32 reference."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if torch.device(device).type == "cuda" and not torch.cuda.is_bf16_supported():
        row.result = "skipped: this GPU has no bfloat16"
        return
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fault = px.Fault("exception", 0, FAULT_STEP, phase="data")
    result, _ = fault_fit(
        device, epochs, [fault], strategy="fsdp", mp_policy=policy, shard=(nn.Linear,)
    )
    row.result = "ok"
    expect(row, result, [(0, "exception", FAULT_STEP, "retried")])
    row.check(result.ledger_ok is True, "ledger exact")
    assert result.model is not None
    weights = params(result.model)
    row.check(all(w.dtype == torch.float32 for w in weights), "float32 weights")
    diff = rel_diff(weights, ref["params"])
    row.check(diff <= MP_TOLERANCE, f"near the reference ({diff:.1e} > {MP_TOLERANCE:.0e})")
    row.notes.append(f"model vs float32 reference {diff:.1e}")


# -- the table ------------------------------------------------------------------------------------
def header(device: str) -> str:
    dev = torch.device(device)
    where = f"{os.cpu_count()} cores"
    if dev.type == "cuda" and torch.cuda.is_available():
        name = torch.cuda.get_device_name(dev)
        try:
            nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
        except Exception as exc:  # (a build without NCCL: the ddp rows will say why)
            nccl = f"unknown ({type(exc).__name__})"
        where = f"{name}, CUDA {torch.version.cuda}, NCCL {nccl}, {where}"
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return f"# {stamp}, torch {torch.__version__}, {device}: {where}"


def print_table(rows: list[Row]) -> None:
    print("\n| what | result | time | notes |")
    print("|---|---|---|---|")
    for r in rows:
        took = "-" if r.seconds is None else f"{r.seconds:.1f} s"
        notes = "; ".join(r.notes).replace("|", "/")
        print(f"| {r.key}: {r.what} | {r.result} | {took} | {notes} |", flush=True)


def plan_rows(args: argparse.Namespace) -> list[tuple[Row, Callable[[Row], None]]]:
    dev, b = args.device, backend(args.device)
    cuda = torch.device(dev).type == "cuda"
    e_demo, e_fault = (2 if args.quick else 8), FAULT_EPOCHS
    ref: dict[str, Any] = {}
    seen: dict[str, float] = {}
    oom = "CUDA out-of-memory in forward -> split" if cuda else (
        "out-of-memory in forward -> split (simulated: no CUDA allocator on cpu)"
    )  # fmt: skip
    made: list[tuple[Row, Callable[[Row], None]]] = [
        (Row("demo-single", f"demo CNN (digits), single on {dev}"),
         lambda r: demo_row(r, dev, "single", e_demo, seen)),
        (Row("demo-ddp", f"demo CNN (digits), ddp, 1 worker on {dev} ({b})"),
         lambda r: demo_row(r, dev, "ddp", e_demo, seen)),
    ]  # fmt: skip
    for size in args.sizes.split(","):
        what = f"step overhead, {size} MLP: phalanx ddp vs torch DDP, 1 worker ({b})"
        made.append(
            (Row("overhead", what),
             functools.partial(overhead_row, device=dev, n=args.steps, rounds=args.rounds,
                               size=size))
        )  # fmt: skip
    made += [
        (Row("group", f"phalanx group, 1 member ({b}): form, vote, bytes, DDP, re-form"),
         lambda r: group_row(r, dev)),
        (Row("reference", f"clean ddp run, MLP, 1 worker on {dev} (the rows below match it)"),
         lambda r: reference_row(r, dev, e_fault, ref)),
        (Row("vote", f"exception in forward -> vote -> retried ({b})"),
         lambda r: vote_row(r, dev, e_fault, ref)),
        (Row("oom-split", oom), lambda r: oom_row(r, dev, e_fault, ref)),
        (Row("rebuild", f"exception mid-backward -> group aborted, rebuilt ({b})"),
         lambda r: rebuild_row(r, dev, e_fault, ref)),
        (Row("restart", f"only worker SIGKILLed -> new process on {dev} from checkpoint"),
         lambda r: restart_row(r, dev, e_fault, ref)),
        (Row("snapshot", f"only worker SIGKILLed, no run_dir -> from its snapshot ({dev})"),
         lambda r: snapshot_row(r, dev, e_fault, ref)),
        (Row("handover", f"2 workers, one killed -> respawned, state handed over ({b})"),
         lambda r: handover_row(r, dev, e_fault, ref)),
        (Row("fsdp-train", f"clean fsdp run (FSDP2), 1 worker on {dev} ({b})"),
         lambda r: fsdp_train_row(r, dev, e_fault, ref)),
        (Row("fsdp-vote", f"fsdp: exception in data -> vote in reduce-scatter -> retried ({b})"),
         lambda r: fsdp_vote_row(r, dev, e_fault, ref)),
        (Row("fsdp-rebuild", f"fsdp: exception in forward -> group aborted, rebuilt ({b})"),
         lambda r: fsdp_rebuild_row(r, dev, e_fault, ref)),
        (Row("fsdp-respawn", f"fsdp, 2 workers, one killed -> respawned from shard set ({b})"),
         lambda r: fsdp_respawn_row(r, dev, e_fault, ref)),
        (Row("fsdp-mp", f"fsdp, bf16 MixedPrecisionPolicy, data failure retried ({b})"),
         lambda r: fsdp_mp_row(r, dev, e_fault, ref)),
    ]  # fmt: skip
    return made


def run_row(row: Row, body: Callable[[Row], None]) -> None:
    t0 = time.perf_counter()
    try:
        body(row)
    except Exception as exc:
        row.result = "FAIL"
        first = str(exc).splitlines()[0][:300] if str(exc) else ""
        row.notes.append(f"{type(exc).__name__}: {first}")
        traceback.print_exc(file=sys.stderr)
    row.seconds = time.perf_counter() - t0
    print(f"{row.key}: {row.result} ({row.seconds:.1f} s)", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--device", default="cuda:0", help="cuda:0 (default), or cpu to smoke")
    parser.add_argument("--quick", action="store_true", help="fewer epochs, steps and rounds")
    parser.add_argument("--only", default="", help=f"comma-separated rows of: {','.join(ROWS)}")
    parser.add_argument("--rounds", type=int, help="overhead rounds (default 3, --quick 1)")
    parser.add_argument("--steps", type=int, help="overhead steps a run (300, --quick 40)")
    parser.add_argument("--sizes", help="overhead MLPs of bench/steps.py (medium,large; small)")
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.steps = args.steps or (40 if args.quick else 300)
    args.sizes = args.sizes or ("small" if args.quick else "medium,large")
    only = {k for k in args.only.split(",") if k}
    unknown = only - set(ROWS)
    if unknown:
        parser.error(f"unknown rows {sorted(unknown)}; pick from {', '.join(ROWS)}")
    if only & set(NEEDS_REFERENCE):
        only.add("reference")
    for size in args.sizes.split(","):
        if size not in steps.SIZES:
            parser.error(f"unknown size {size!r}; bench/steps.py has {', '.join(steps.SIZES)}")
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print(f"{args.device}: CUDA is not available here (torch {torch.__version__}); "
              "run with --device cpu for the smoke test", file=sys.stderr)  # fmt: skip
        return 2
    print(header(args.device), flush=True)
    rows: list[Row] = []
    for row, body in plan_rows(args):
        rows.append(row)
        if only and row.key not in only:
            row.result = "skipped: not in --only"
            continue
        if row.key in NEEDS_REFERENCE and any(r.key == "reference" and r.failed for r in rows):
            row.result = "skipped: the reference run failed"
            continue
        run_row(row, body)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    print_table(rows)
    failed = [r.key for r in rows if r.failed]
    print(f"\n{len(rows) - len(failed)} of {len(rows)} rows ok or skipped"
          + (f"; failed: {', '.join(failed)}" if failed else ""), flush=True)  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
