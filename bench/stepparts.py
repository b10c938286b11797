"""Where a phalanx ddp step's time goes, function by function, inside a real run.

    PYTHONPATH=src .venv/bin/python bench/stepparts.py [--steps 3000] [--size small]
                                                      [--workers 1] [--twice]

Timed alone, each piece of a step's bookkeeping costs a few microseconds; inside a step it
costs several times that (after a millisecond of forward and backward, the code and data of
these calls are out of the caches). This bench times them where they run: each function
below is wrapped, in every worker, to add up its wall time (``time.perf_counter_ns``), by a
``sitecustomize`` module in a temporary directory put first on the workers' ``PYTHONPATH``;
each worker writes its totals when it ends. The table gives microseconds per committed step,
inclusive (a function's time includes its callees'), and calls per step, for worker 0 (the
main member, which also sends the step's event). ``--twice`` calls ``Ballot.count`` twice a
step and times each call: the first pays for cold caches, the second does not. The wrappers
add about a microsecond per call; a function also called outside the steps counts those
calls too (``Outbox.send``: the run's other messages, the final ``Done`` with its ledger).
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import tempfile
import textwrap

# (module, owner attribute path or "" for a module function, name)
TIMED = [
    ("phalanx.loop", "TrainLoop", "_step"),
    ("phalanx.loop", "TrainLoop", "_emit_step"),
    ("phalanx.strategies.ddp.worker.engine", "DdpEngine", "attempt"),
    ("phalanx.strategies.ddp.worker.engine", "DdpEngine", "launch"),
    ("phalanx.strategies.ddp.worker.engine", "DdpEngine", "commit"),
    ("phalanx.strategies.ddp.worker.engine", "", "unpack_vote"),
    ("phalanx.replica", "Replica", "run"),
    ("phalanx.replica", "Replica", "_micro_steps"),
    ("phalanx.replica", "StepModule", "forward"),
    ("phalanx.replica", "StepModule", "backward"),
    ("phalanx.replica", "", "state_values"),
    ("phalanx.replica", "", "to_device"),
    ("phalanx.data", "", "_index"),
    ("phalanx.strategies.ddp.worker.ballot", "Ballot", "cast"),
    ("phalanx.strategies.ddp.worker.ballot", "Ballot", "count"),
    ("phalanx.strategies.ddp.worker.ballot", "Decoder", "__call__"),
    ("phalanx.loop", "", "compute_all"),
    ("phalanx.strategies.ddp.wire.protocol", "Outbox", "send"),
    ("phalanx.strategies.ddp.worker.worker", "Worker", "on_phase"),
    ("phalanx.rng", "", "reseed"),
    ("torch.nn.parallel", "DistributedDataParallel", "forward"),
    ("torch.optim", "SGD", "step"),
    ("torch.optim", "Optimizer", "zero_grad"),
]

# Run in each worker at start-up (the ``sitecustomize`` of the workers' PYTHONPATH).
SITE = """
import collections, importlib, os, time

OUT = os.environ.get("PX_STEPPARTS_OUT")
if OUT:
    totals = collections.defaultdict(lambda: [0, 0])

    def timed(owner, name, label):
        inner = getattr(owner, name)
        clock = time.perf_counter_ns

        def wrapper(*args, **kwargs):
            start = clock()
            try:
                return inner(*args, **kwargs)
            finally:
                entry = totals[label]
                entry[0] += clock() - start
                entry[1] += 1

        setattr(owner, name, wrapper)

    for module, owner, name in TIMED:
        target = importlib.import_module(module)
        if owner:
            target = getattr(target, owner)
        timed(target, name, f"{owner}.{name}" if owner else name)

    if os.environ.get("PX_STEPPARTS_TWICE"):
        from phalanx.strategies.ddp.worker.ballot import Ballot

        counted = Ballot.count

        def twice(self):
            for label in ("count, first call", "count, second call"):
                start = time.perf_counter_ns()
                got = counted(self)
                totals[label][0] += time.perf_counter_ns() - start
                totals[label][1] += 1
            return got

        Ballot.count = twice

    import phalanx.strategies.ddp.worker.worker as worker

    run = worker.Worker.run

    def run_and_write(self):
        try:
            return run(self)
        finally:
            with open(f"{OUT}/worker{self.a.slot}.txt", "w") as fh:
                for label, (ns, calls) in totals.items():
                    fh.write(f"{label}\\t{ns}\\t{calls}\\n")

    worker.Worker.run = run_and_write
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--size", default="small")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--twice", action="store_true")
    args = parser.parse_args(argv)
    here = os.path.dirname(os.path.abspath(__file__))
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "sitecustomize.py"), "w") as fh:
            fh.write(f"TIMED = {TIMED!r}\n" + textwrap.dedent(SITE))
        env = dict(os.environ, PX_STEPPARTS_OUT=tmp)
        env["PYTHONPATH"] = os.pathsep.join([tmp, env.get("PYTHONPATH", "")])
        if args.twice:
            env["PX_STEPPARTS_TWICE"] = "1"
        devices = ",".join(f"cpu:{i}" for i in range(args.workers))
        code = (
            "import sys; sys.path.insert(0, sys.argv[1]); import steps\n"
            "class Quiet:\n"
            "    def handle(self, event): pass\n"
            "    def close(self): pass\n"
            "if __name__ == '__main__':\n"
            "    steps.phalanx_fit(int(sys.argv[2]), sys.argv[3], sys.argv[4], Quiet())\n"
        )
        script = os.path.join(tmp, "run.py")
        with open(script, "w") as fh:
            fh.write(code)
        cmd = [sys.executable, script, here, str(args.steps), args.size, devices]
        subprocess.run(cmd, env=env, check=True)
        rows = {}
        for path in sorted(glob.glob(os.path.join(tmp, "worker*.txt"))):
            with open(path) as fh:
                rows[os.path.basename(path)] = [line.rstrip("\n").split("\t") for line in fh]
    found = rows.get("worker0.txt", [])
    steps = next((int(c) for label, _, c in found if label == "TrainLoop._step"), 0) or 1
    print(f"{args.size}, {args.workers} worker(s), {args.steps} steps; worker 0, per step:")
    print("| function | us per step | calls per step |")
    print("|---|---|---|")
    for label, ns, calls in sorted(found, key=lambda r: -int(r[1])):
        print(f"| {label} | {int(ns) / steps / 1e3:.1f} | {int(calls) / steps:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
