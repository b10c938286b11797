"""strategy="fsdp" on CPU (gloo), three tables (issue 24):

    PYTHONPATH=src .venv/bin/python bench/fsdp.py [--only memory,steps,failures,end]
                                                  [--rounds 3] [--steps 60] [--root-norm] [--mp]

- ``memory``: bytes each worker holds of parameters and of Adam's state, counted in the
  worker after its first optimizer step (its shards' bytes, ``to_local()``), for a model of
  50.4 M parameters (48 x Linear(1024)) under fsdp at 1, 2 and 4 workers and under ddp at 2
  (a full replica each): must fall as 1/N. (Shard bytes, not the process's RSS: the model
  factory builds the whole model in each worker before it is sharded; see docs/fsdp.md.)
- ``steps``: step time of phalanx fsdp (with its shard snapshots every step, and with
  ``snapshots=False``: the difference is what keeps shards recoverable) against a plain
  FSDP2 script (``fully_shard`` on each layer then the root, Adam, the same model, data and
  global batch, 2 processes), arms interleaved round by round; median over rounds of the
  mean step interval after the first ``WARM`` steps, its ratio to the plain script's, and
  the median of the round-by-round ratios (the arms of a round run one after the other:
  the paired ratio leaves out the machine's drift between rounds). The model's root holds
  no parameter (every Linear is a unit): phalanx's vote box is then the root's only
  parameter, and its
  all-gather and reduce-scatter are collectives plain FSDP2 does not run. ``--root-norm``
  adds a LayerNorm after the Linears, outside every unit (as a transformer's final norm or
  embeddings are): FSDP2 then gathers and reduces the root in both arms. Without it a fourth
  arm runs the plain script with one small parameter in the root (the box's size, not in
  the optimizer): the cost of those two collectives alone.
- ``failures`` (3 workers): an exception in forward on worker 1 (its group rebuilt by the
  same members, each from the shards it kept) and in data (the vote carries it, zero passes
  line the step up); worker 1 killed under shrink and under respawn (every member of the new
  generation takes its rows from the newest complete shard set); all three killed in one
  step (every slot restarted from the set): time from the failure to the next committed
  step, and steps computed again.

- ``end``: how a run ends with the 50.4 M-parameter model on 2 workers (3 steps, a
  ``run_dir``): the default end gathers the whole model into rank 0 and writes
  ``run_dir/model.pt``; ``gather=False`` writes each member's shards of a last checkpoint
  instead. Time from the last committed step to ``fit``'s return, and the bytes one process
  holds of the model at the end (the whole model; a member's shards).

Timings on a shared 2-core machine are noisy: read the ratios.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import TensorDataset

import phalanx as px
from phalanx.events import Event, StepEnded

WARM = 5
BIG = (1024, 48)  # width, layers: 50.4 M parameters
MEDIUM = (256, 8)  # 0.5 M parameters


def layers(width: int, depth: int, root_norm: bool = False) -> nn.Module:
    torch.manual_seed(0)
    norm = [nn.LayerNorm(width)] if root_norm else []
    return nn.Sequential(*(nn.Linear(width, width) for _ in range(depth)), *norm)


def data(width: int, samples: int) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(
        torch.randn(samples, width, generator=g), torch.randn(samples, width, generator=g)
    )


def step(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def _bytes(tensor: torch.Tensor) -> int:
    shard = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return int(shard.numel() * shard.element_size())


class CountingAdam(torch.optim.Adam):
    """Adam that writes, after its first step, the bytes of parameters and of its state
    this worker holds (its shards under fsdp) to ``<out>/rank-<rank>.json``."""

    def __init__(self, params: Any, out: str, lr: float = 1e-4) -> None:
        super().__init__(params, lr=lr)
        self.out, self.counted = out, False

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = super().step(closure)
        if not self.counted:
            self.counted = True
            params = [p for g in self.param_groups for p in g["params"]]
            state = [v for s in self.state.values() for v in s.values() if torch.is_tensor(v)]
            rank = dist.get_rank() if dist.is_initialized() else px.rank()
            record = {"params": sum(map(_bytes, params)), "optimizer": sum(map(_bytes, state))}
            Path(self.out, f"rank-{rank}.json").write_text(json.dumps(record))
        return loss


def memory_table() -> None:
    width, depth = BIG
    count = sum(p.numel() for p in layers(width, depth).parameters()) / 1e6
    print(f"\n## Memory per worker: {count:.1f} M parameters, Adam\n")
    print(
        "| strategy | workers | parameters (MiB, the most of a worker) | Adam state (MiB) | share |"
    )
    print("|---|---|---|---|---|")
    one = None
    for strategy, workers in (("fsdp", 1), ("fsdp", 2), ("fsdp", 4), ("ddp", 2)):
        with tempfile.TemporaryDirectory() as out:
            optimizer = functools.partial(CountingAdam, out=out)
            model = functools.partial(layers, width, depth)
            devices = ",".join(f"cpu:{i}" for i in range(workers))
            px.Learner(model, optimizer, step).fit(
                data(width, 8), epochs=1, batch_size=8, devices=devices, strategy=strategy,
                sinks=[], preflight=False, snapshots=False,
            )  # fmt: skip
            counts = [json.loads(p.read_text()) for p in Path(out).glob("rank-*.json")]
        params = max(c["params"] for c in counts) / 2**20
        state = max(c["optimizer"] for c in counts) / 2**20
        one = one or params + state
        share = (params + state) / one
        print(f"| {strategy} | {workers} | {params:.1f} | {state:.1f} | {share:.3f} |")


# -- step time ------------------------------------------------------------------------------
class WithRootParameter(nn.Module):
    """``inner`` and a ``[2, 128]`` parameter used in its forward (times zero): a root unit
    that FSDP2 gathers and reduces, as phalanx's vote box is."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.box = nn.Parameter(torch.zeros(2, 128))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) + (self.box * 1.0).sum() * 0.0


def _policy(bf16: bool) -> dict[str, Any]:
    """``fully_shard``'s and ``fit``'s keyword for ``--mp``: bfloat16 gathers and compute,
    float32 reductions (torchtitan's default)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return {"mp_policy": policy} if bf16 else {}


def _plain_fsdp(
    rank: int,
    port: int,
    steps: int,
    out: Any,
    root_norm: bool,
    box: bool = False,
    bf16: bool = False,
) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    width, depth = MEDIUM
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    inner = layers(width, depth, root_norm)
    for layer in inner:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, **_policy(bf16))
    model = WithRootParameter(inner) if box else inner
    fully_shard(model, mesh=mesh, **_policy(bf16))
    opt = torch.optim.Adam(inner.parameters(), lr=1e-4)
    x, y = data(width, steps * 64).tensors
    stamps = []
    for s in range(steps):
        rows = slice(s * 64 + rank * 32, s * 64 + rank * 32 + 32)
        loss = step(model, (x[rows], y[rows]))
        loss.backward()
        loss.item()
        opt.step()
        opt.zero_grad()
        stamps.append(time.time())
    out.put((rank, stamps))
    dist.destroy_process_group()


def plain_fsdp(steps: int, root_norm: bool = False, box: bool = False, bf16: bool = False) -> float:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_plain_fsdp, args=(r, store.port, steps, out, root_norm, box, bf16))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    return interval(results[0])


class Stamps:
    def __init__(self) -> None:
        self.times: list[float] = []
        self.failures: list[Any] = []

    def handle(self, event: Event) -> None:
        if isinstance(event, StepEnded):
            self.times.append(event.time)

    def close(self) -> None:
        pass


def phalanx_fsdp(
    steps: int, snapshots: bool = True, root_norm: bool = False, bf16: bool = False
) -> float:
    width, depth = MEDIUM
    sink = Stamps()
    opt = functools.partial(torch.optim.Adam, lr=1e-4)
    px.Learner(functools.partial(layers, width, depth, root_norm), opt, step).fit(
        data(width, steps * 64), epochs=1, batch_size=64, devices="cpu:0,cpu:1",
        strategy="fsdp", shard=(nn.Linear,), sinks=[sink], shuffle=False, preflight=False,
        snapshots=snapshots, **_policy(bf16),
    )  # fmt: skip
    return interval(sink.times)


def interval(stamps: list[float]) -> float:
    warm = stamps[WARM:]
    return (warm[-1] - warm[0]) / (len(warm) - 1)


def steps_table(rounds: int, steps: int, root_norm: bool = False, bf16: bool = False) -> None:
    plain: list[float] = []
    ours: list[float] = []
    bare: list[float] = []
    boxed: list[float] = []
    base = functools.partial(plain_fsdp, root_norm=root_norm, bf16=bf16)
    snapping = functools.partial(phalanx_fsdp, root_norm=root_norm, bf16=bf16)
    quiet = functools.partial(phalanx_fsdp, snapshots=False, root_norm=root_norm, bf16=bf16)
    for r in range(rounds):
        arms = [(plain, base), (ours, snapping), (bare, quiet)]
        if not root_norm:
            arms.append((boxed, functools.partial(plain_fsdp, box=True, bf16=bf16)))
        for into, run in arms if r % 2 == 0 else arms[::-1]:
            into.append(run(steps))
    p, o = statistics.median(plain), statistics.median(ours)
    width, depth = MEDIUM
    root = "a LayerNorm in the root" if root_norm else "no parameter in the root"
    root += ", bfloat16 MixedPrecisionPolicy in both" if bf16 else ""
    setup = (
        f"{depth} x Linear({width}) ({root}), global batch 64, Adam, {rounds} rounds x "
        f"{steps} steps"
    )
    print(f"\n## Step time, 2 workers, {setup}\n")
    print("| arm | ms per step (median of rounds) | rounds | ratio | paired ratio |")
    print("|---|---|---|---|---|")
    b = statistics.median(bare)
    rows = [
        ("plain FSDP2 script", p, plain),
        ("phalanx fsdp (shard snapshots, measured cadence)", o, ours),
        ("phalanx fsdp, snapshots=False", b, bare),
    ]
    if boxed:
        rows.append(
            ("plain FSDP2 script, one parameter in the root", statistics.median(boxed), boxed)
        )
    for name, median, arm in rows:
        each = ", ".join(f"{x * 1e3:.1f}" for x in arm)
        # (each round's arms ran one after the other: the median of their ratios round by
        # round leaves out the machine's drift between rounds, which the medians keep)
        paired = statistics.median(x / y for x, y in zip(arm, plain, strict=True))
        print(f"| {name} | {median * 1e3:.2f} | {each} | {median / p:.3f} | {paired:.3f} |")


# -- failures -------------------------------------------------------------------------------
def failures_table() -> None:
    width, depth = MEDIUM
    opt = functools.partial(torch.optim.Adam, lr=1e-4)
    learner = px.Learner(functools.partial(layers, width, depth), opt, step)
    fit = dict(epochs=1, batch_size=64, devices="cpu:0,cpu:1,cpu:2", strategy="fsdp", sinks=[])
    print("\n## Failures, 3 workers, 40 steps\n")
    print("| fault | outcome | failure -> next committed step (s) | steps replayed |")
    print("|---|---|---|---|")
    for phase in ("forward", "data"):
        fault = px.Fault("exception", worker=1, step=20, phase=phase)
        result = learner.fit(data(width, 40 * 64), faults=[fault], **fit)
        f = result.failures[0]
        how = "group rebuilt, step retried" if phase == "forward" else "vote, step retried"
        print(f"| exception in {phase} | {how} | {f.recovery_seconds:.2f} | 0 |")
    for mode in ("shrink", "respawn"):
        fault = px.Fault("kill", worker=1, step=20)
        result = learner.fit(
            data(width, 40 * 64), faults=[fault], on_failure=px.Recovery(mode=mode), **fit
        )
        f = result.failures[0]
        how = f"{f.action} from the shard set"
        print(f"| kill worker 1 ({mode}) | {how} | {f.recovery_seconds:.2f} | {f.replayed_steps} |")
    kills = [px.Fault("kill", worker=w, step=20) for w in range(3)]
    result = learner.fit(data(width, 40 * 64), faults=kills, **fit)
    f = next(f for f in result.failures if f.action == "restarted")
    how = "every slot restarted from the shard set"
    print(f"| kill all 3 | {how} | {f.recovery_seconds:.2f} | {f.replayed_steps} |")


# -- the end ---------------------------------------------------------------------------------
def end_table(rounds: int) -> None:
    width, depth = BIG
    opt = functools.partial(torch.optim.Adam, lr=1e-4)
    learner = px.Learner(functools.partial(layers, width, depth), opt, step)
    times: dict[bool, list[float]] = {True: [], False: []}
    for r in range(rounds):
        for gather in (True, False) if r % 2 == 0 else (False, True):
            sink = Stamps()
            with tempfile.TemporaryDirectory() as run_dir:
                result = learner.fit(
                    data(width, 3 * 16), epochs=1, batch_size=16, devices="cpu:0,cpu:1",
                    strategy="fsdp", shard=(nn.Linear,), sinks=[sink], preflight=False,
                    snapshots=False, run_dir=run_dir, gather=gather,
                    checkpoint=px.Checkpoints(every_epoch=False, every_steps=100),
                )  # fmt: skip
                returned = time.time()
                assert (result.model is None) is not gather
            times[gather].append(returned - sink.times[-1])
    params = sum(p.numel() for p in layers(width, depth).parameters())
    whole = params * 4 / 2**20
    print(f"\n## The end, 2 workers, {params / 1e6:.1f} M parameters, {rounds} rounds\n")
    print("| end | last step -> fit returns (s, median) | rounds | model bytes in one process |")
    print("|---|---|---|---|")
    for gather, name, held in (
        (True, "gathered (default): model.pt, FitResult.model", f"{whole:.0f} MiB (whole)"),
        (False, "gather=False: a last sharded checkpoint", f"{whole / 2:.0f} MiB (its shards)"),
    ):
        each = ", ".join(f"{x:.2f}" for x in times[gather])
        print(f"| {name} | {statistics.median(times[gather]):.2f} | {each} | {held} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default="memory,steps,failures")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--root-norm", action="store_true", help="a LayerNorm in the root")
    parser.add_argument("--mp", action="store_true", help="steps: a bf16 MixedPrecisionPolicy")
    args = parser.parse_args(argv)
    only = set(args.only.split(","))
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, gloo")
    if "memory" in only:
        memory_table()
    if "end" in only:
        end_table(args.rounds)
    if "steps" in only:
        steps_table(args.rounds, args.steps, args.root_norm, args.mp)
    if "failures" in only:
        failures_table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
