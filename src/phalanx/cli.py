"""The ``phalanx`` command: ``explain [CODE]``, ``demo``, ``report RUN_DIR``, ``plot RUN_DIR``,
``run --nnodes N [--node-rank R|spare] [--head HOST:PORT] SCRIPT [ARGS]``.

:func:`main` returns the exit status instead of exiting, so it can be called from tests.
Exit statuses (also in ``phalanx --help``):

- 0: done (``demo``: the run trained to its end, whatever its accuracy);
- 1: training failed, or a configuration error (the report or the error, with its PX code,
  on stderr); ``explain``: an unknown code; ``report``/``plot``: no run in that folder;
- 2: a usage error (bad arguments; ``--help`` returns 0, no command prints the help and
  returns 2), or an optional dependency is missing (scikit-learn for ``demo``, matplotlib
  for ``plot``);
- 75: stopped and saved, a restart goes on: a batch system's warning (SIGUSR1) stopped the
  run after a checkpoint (:class:`~phalanx.interrupt.FitPreempted`), or, across machines on a
  node other than the head, the head was lost and the node saved the run's last committed
  step (:class:`~phalanx.errors.HeadLost`, PX147);
- 130: interrupted by Ctrl-C (the run stopped after a step and saved a checkpoint);
- 143: ended by SIGTERM (likewise; the exit status of a process ended by SIGTERM, so a batch
  system can requeue the job);
- 141: stdout was closed before the output was written (``phalanx explain | head -2``):
  nothing more is printed.

``run`` becomes the script (``exec``), so its exit status is the script's; 2 when its
arguments are wrong (nothing is started).
"""

from __future__ import annotations

import argparse
import os
import sys

from phalanx import catalog
from phalanx.errors import PhalanxError
from phalanx.strategies import STRATEGIES
from phalanx.version import __version__

EXIT_CODES = """exit status:
  0    done (demo: the run trained to its end, whatever its accuracy)
  1    training failed or a configuration error (the report on stderr); or a node (an old
       head too) was cut off or frozen and the run went on without it (PX145); explain:
       unknown code; report, plot: no run in that folder
  2    usage error, or a missing optional dependency (scikit-learn, matplotlib)
  75   stopped and saved, a restart goes on (a batch script requeues on it): a batch
       system's warning (SIGUSR1, Slurm's --signal=USR1@120) stopped the run after a
       checkpoint; or the head was lost and a node saved the run's last committed step
       (or the head lost most nodes at once and stood down); run the same command with
       resume=True (a requeued Slurm job resumes by itself)
  130  interrupted by Ctrl-C (the run saved a checkpoint: demo --resume goes on)
  143  ended by SIGTERM (likewise; a batch system can requeue the job)
  141  stdout closed early (e.g. piped into head): the rest of the output is dropped
  run: the script's own exit status (2: bad arguments, the script was not started)
"""


def _explain(args: argparse.Namespace) -> int:
    if args.code is None:
        print(catalog.list_codes())
        print("\nRun `phalanx explain CODE` for what a code means and how to fix it.")
        return 0
    try:
        print(catalog.explain(args.code))
    except KeyError as exc:
        print(f"phalanx explain: {exc.args[0]}", file=sys.stderr)
        return 1
    return 0


def _demo(args: argparse.Namespace) -> int:
    from phalanx.demo import run_demo  # lazy: the demo pulls in torch and scikit-learn

    args.fault = args.fault or []
    try:
        return run_demo(args)
    except PhalanxError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    except ImportError as exc:
        if (exc.name or "").partition(".")[0] != "sklearn":
            raise
        print(
            "phalanx demo needs scikit-learn (its digits data set), which is not installed: "
            "pip install 'phalanx[demo]'",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt as exc:  # fit's, after the checkpoint (.result)
        result = getattr(exc, "result", None)
        step = f" after step {result.steps}" if result is not None else ""
        where = f" --run-dir {args.run_dir}" if args.run_dir != "runs/demo" else ""
        resume = f"; `phalanx demo --resume{where}` goes on from here" if result else ""
        print(f"phalanx demo: interrupted{step}{resume}", file=sys.stderr)
        return 130


def _report(args: argparse.Namespace) -> int:
    from rich.console import Console

    from phalanx.runview import report_run

    return report_run(args.run_dir, Console())


def _plot(args: argparse.Namespace) -> int:
    from phalanx.plot import load_run, plot_run  # matplotlib only once it draws

    data = load_run(args.run_dir)
    if not data.steps:
        print(f"phalanx plot: no committed steps in {args.run_dir}/events.jsonl", file=sys.stderr)
        return 1
    try:
        drawn = plot_run(args.run_dir, args.output)
    except ImportError as exc:
        if (exc.name or "").partition(".")[0] != "matplotlib":
            raise
        print(
            "phalanx plot needs matplotlib, which is not installed: pip install 'phalanx[plot]'",
            file=sys.stderr,
        )
        return 2
    kinds = ", ".join(f"{len(v)} {k}" for k, v in drawn.by_step.items()) or "no failures"
    print(f"wrote {drawn.path} ({len(data.steps)} steps, {kinds})")
    return 0


def run_command(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """The command line and environment ``phalanx run`` executes: this Python on the script
    with its arguments, the environment with ``PHALANX_NNODES``, ``PHALANX_NODE_RANK`` and
    (when given) ``PHALANX_HEAD`` set. Raises LaunchEnvironmentError (PX140) for values
    :func:`phalanx.launch.detect` would refuse, and FileNotFoundError for a missing script."""
    from phalanx.launch import detect

    env = {k: v for k, v in os.environ.items() if k != "PHALANX_HEAD"}
    env["PHALANX_NNODES"] = str(args.nnodes)
    env["PHALANX_NODE_RANK"] = str(args.node_rank)
    if args.head is not None:
        env["PHALANX_HEAD"] = args.head
    detect({k: v for k, v in env.items() if k.startswith("PHALANX_")})  # the same rules as fit
    if not os.path.isfile(args.script):
        raise FileNotFoundError(f"no such script: {args.script}")
    return [sys.executable, args.script, *args.args], env


def _node_rank(text: str) -> int | str:
    return "spare" if text.strip().lower() == "spare" else int(text)


def _run_usage(args: argparse.Namespace) -> str | None:
    """What is wrong with ``phalanx run``'s flags, in their own names (None: nothing)."""
    n, rank = args.nnodes, args.node_rank
    if n < 1:
        return f"--nnodes {n}: pass the number of nodes, 1 or more"
    if rank is None and n > 1:
        return f"--nnodes {n} needs --node-rank: this node's number, 0 (the head) to {n - 1}"
    if rank == "spare" and n < 2:
        return f"--node-rank spare with --nnodes {n}: a spare stands in for a node of 2 or more"
    if rank not in (None, "spare") and not 0 <= int(rank) < n:
        return f"--node-rank {rank} with --nnodes {n}: pass 0 (the head) to {n - 1}"
    if args.head is None and n > 1:
        return f"--nnodes {n} needs --head HOST:PORT: node 0's address and a free port"
    return None


def _run(args: argparse.Namespace) -> int:
    usage = _run_usage(args)
    if args.node_rank is None:
        args.node_rank = 0
    try:
        if usage is not None:
            raise ValueError(usage)
        argv, env = run_command(args)
    except (PhalanxError, OSError, ValueError) as exc:
        print(f"phalanx run: {exc}", file=sys.stderr)
        return 2
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(argv[0], argv, env)  # never returns


def build_parser() -> argparse.ArgumentParser:
    """The argument parser; each subparser sets ``handler`` to the function that runs it."""
    parser = argparse.ArgumentParser(
        prog="phalanx",
        description="Data-parallel PyTorch training that names every worker failure.",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"phalanx {__version__}")
    sub = parser.add_subparsers(title="commands", metavar="COMMAND")

    explain = sub.add_parser(
        "explain",
        help="explain an error code (no code: list every code)",
        description="Print what an error code means, when it happens, its common causes, "
        "what to do and an example fix. Without CODE, list every code.",
    )
    explain.add_argument("code", nargs="?", metavar="CODE", help="e.g. PX113 (or px113)")
    explain.set_defaults(handler=_explain)
    _add_demo(sub)

    report = sub.add_parser(
        "report",
        help="print a run's summary from its folder",
        description="The end of a run as it was printed live (summary table, failures and "
        "recoveries, world size, respawns, where its files are), read from RUN_DIR.",
    )
    report.add_argument("run_dir", metavar="RUN_DIR")
    report.set_defaults(handler=_report)

    plot = sub.add_parser(
        "plot",
        help="draw a run's loss and failures to a PNG",
        description="Loss, validation metrics (panels of their own) and world size with "
        "its generations, against step and wall time; failures marked by kind. Needs "
        "matplotlib (pip install 'phalanx[plot]').",
    )
    plot.add_argument("run_dir", metavar="RUN_DIR")
    plot.add_argument("-o", "--output", metavar="FILE", help="default: RUN_DIR/run.png")
    plot.set_defaults(handler=_plot)
    export = sub.add_parser(
        "export",
        help="write a checkpoint's model as a torch.distributed.checkpoint (DCP) folder",
        description="The model of SOURCE (a checkpoint file, any rank's file of a sharded "
        "one, or a run_dir for its newest that verifies) as a DCP folder OUT, under the key "
        "'model' with your model's keys: dcp.load({'model': model.state_dict()}, "
        "checkpoint_id=OUT) fills a model, whole or sharded (docs/fsdp.md).",
    )
    export.add_argument("source", metavar="SOURCE")
    export.add_argument("--dcp", required=True, metavar="OUT", help="a new folder")
    export.set_defaults(handler=_export)
    _add_run(sub)
    return parser


def _export(args: argparse.Namespace) -> int:
    from phalanx.checkpoint.dcp import export_dcp

    try:
        out = export_dcp(args.source, args.dcp)
    except PhalanxError as exc:
        print(f"phalanx export: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {out} (DCP: the model under 'model')")
    return 0


def _add_run(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    run = sub.add_parser(
        "run",
        help="start a script as one node of a job (sets PHALANX_NNODES, _NODE_RANK, _HEAD)",
        description="Set PHALANX_NNODES, PHALANX_NODE_RANK and PHALANX_HEAD and run SCRIPT "
        "with this Python (the process becomes the script: its exit status is the script's). "
        "Start one per node, with the same PHALANX_TOKEN on each (or a shared run_dir); "
        "phalanx starts one worker per device of the node itself. Node 0 is the head; "
        "several nodes train with strategy='ddp' or 'fsdp' (docs/multinode.md).",
    )
    run.add_argument("--nnodes", type=int, required=True, help="number of nodes (1: one machine)")
    run.add_argument(
        "--node-rank",
        type=_node_rank,
        default=None,
        help="this node's number, 0 (the head) to NNODES-1 (default 0 with --nnodes 1), or "
        "'spare': a node that waits at the head and takes the place of the first node lost",
    )
    run.add_argument("--head", metavar="HOST:PORT", help="node 0's address and a port")
    run.add_argument("script", metavar="SCRIPT", help="the training script (a .py file)")
    run.add_argument("args", nargs="*", metavar="ARGS", help="its arguments, passed as they are")
    run.set_defaults(handler=_run)


FAULT_GRAMMAR = """\
faults (--fault, repeatable): KIND:WORKER@STEP[/PHASE][xTIMES]
  KIND    kill       the worker process dies (SIGKILL)
          hang       the worker stops making progress (its peers wait: the hang limit names it)
          exception  the step raises (transient: a retry passes)
          oom        the step runs out of memory (the share is split and retried)
  WORKER  the worker slot, from 0
  STEP    the global step, from 0 (kill:1@30 fires in the 31st step)
  PHASE   where in the step (default forward): preflight, data, forward, backward, sync,
          optimizer, metrics, validation
  xTIMES  fire in that many attempts of the step (default 1; x2: the retry fails too)
examples:
  phalanx demo --strategy ddp --devices cpu:0,cpu:1 --fault kill:1@30
  phalanx demo --strategy ddp --devices cpu:0,cpu:1,cpu:2 --fault hang:0@20/backward
  phalanx demo --strategy ddp --devices cpu:0,cpu:1 --fault exception:1@10x2  (a poison batch)
"""


def _add_demo(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    demo = sub.add_parser(
        "demo",
        help="train a small model and watch failures being named and survived",
        description="Train a small classifier data-parallel, optionally injecting faults. "
        "Exit status 0 when the run trains to its end (its accuracy is printed, not judged).",
        epilog=FAULT_GRAMMAR,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument("--epochs", type=int, default=8, help="epochs to train (default 8)")
    demo.add_argument(
        "--batch-size", type=int, default=64, help="GLOBAL batch size, all devices (default 64)"
    )
    demo.add_argument(
        "--devices", default="cpu", help='e.g. "cpu", "cpu:0,cpu:1", "cuda:0,cuda:1", "auto"'
    )
    demo.add_argument("--strategy", default="single", choices=STRATEGIES)
    demo.add_argument(
        "--run-dir",
        default="runs/demo",
        help="checkpoints and logs go here; without --resume, the last run's files move to "
        "RUN_DIR/earlier/<its run id>/",
    )
    demo.add_argument("--resume", action="store_true", help="resume from --run-dir")
    demo.add_argument(
        "--fault",
        action="append",
        default=None,
        metavar="KIND:WORKER@STEP",
        help="inject a fault, e.g. kill:1@30 (STEP counts from 0: the 31st step; repeatable)",
    )
    demo.add_argument(
        "--chaos",
        type=int,
        default=0,
        metavar="N",
        help="inject N random failures (kill, hang, exception); needs --strategy ddp",
    )
    demo.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    demo.set_defaults(handler=_demo)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI on ``argv`` (``sys.argv[1:]`` when ``None``); return the exit status."""
    try:
        return _main(argv)
    except BrokenPipeError:
        # The reader of our stdout left (`| head`): drop the rest quietly, and keep Python
        # from complaining again when it flushes stdout at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141


def _split_script(argv: list[str]) -> tuple[list[str], list[str]]:
    """``run``'s own arguments up to SCRIPT, and the script's arguments after it, verbatim
    (argparse would take a ``--`` or an option of the script's as its own)."""
    if argv[:1] != ["run"]:
        return argv, []
    valued = ("--nnodes", "--node-rank", "--head")
    i = 1
    while i < len(argv):
        token = argv[i]
        if token == "--":
            return argv[:i] + argv[i + 1 : i + 2], argv[i + 2 :]
        if token in valued:
            i += 2
        elif token.startswith("-"):
            i += 1
        else:
            return argv[: i + 1], argv[i + 1 :]
    return argv, []


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    own, script_args = _split_script(list(sys.argv[1:] if argv is None else argv))
    try:
        args = parser.parse_args(own)
    except SystemExit as exc:  # --help, --version (0) or a usage error (2)
        return exc.code if isinstance(exc.code, int) else 2
    if getattr(args, "handler", None) is _run:
        args.args = script_args
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 2
    status: int = handler(args)
    return status
