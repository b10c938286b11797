"""The ``phalanx`` command: ``phalanx explain [CODE]`` and ``phalanx demo``.

:func:`main` returns the exit status instead of exiting (``--help`` returns 0, a usage error
2, no subcommand prints the help and returns 2), so it can be called from tests.
"""

from __future__ import annotations

import argparse
import sys

from phalanx import catalog
from phalanx.errors import PhalanxError


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
        where = f" after step {result.steps}" if result is not None else ""
        resume = " (phalanx demo --resume continues)" if args.run_dir and result else ""
        print(f"phalanx demo: interrupted{where}{resume}", file=sys.stderr)
        return 130


def build_parser() -> argparse.ArgumentParser:
    """The argument parser; each subparser sets ``handler`` to the function that runs it."""
    parser = argparse.ArgumentParser(
        prog="phalanx",
        description="Data-parallel PyTorch training that names every worker failure.",
    )
    sub = parser.add_subparsers(title="commands", metavar="COMMAND")

    explain = sub.add_parser(
        "explain",
        help="explain an error code (no code: list every code)",
        description="Print what an error code means, when it happens, its common causes, "
        "what to do and an example fix. Without CODE, list every code.",
    )
    explain.add_argument("code", nargs="?", metavar="CODE", help="e.g. PX113 (or px113)")
    explain.set_defaults(handler=_explain)

    demo = sub.add_parser(
        "demo",
        help="train a small model and watch failures being named and survived",
        description="Train a small classifier data-parallel, optionally injecting faults.",
    )
    demo.add_argument("--epochs", type=int, default=8, help="epochs to train (default 8)")
    demo.add_argument(
        "--batch-size", type=int, default=64, help="GLOBAL batch size, all devices (default 64)"
    )
    demo.add_argument(
        "--devices", default="cpu", help='e.g. "cpu", "cpu:0,cpu:1", "cuda:0,cuda:1", "auto"'
    )
    demo.add_argument("--strategy", default="single", help="single, threads or ddp")
    demo.add_argument(
        "--run-dir",
        default="runs/demo",
        help="checkpoints and logs go here; without --resume, its checkpoints are replaced",
    )
    demo.add_argument("--resume", action="store_true", help="resume from --run-dir")
    demo.add_argument(
        "--fault",
        action="append",
        default=None,
        metavar="KIND:WORKER@STEP",
        help="inject a fault, e.g. kill:1@30 (repeatable)",
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
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the CLI on ``argv`` (``sys.argv[1:]`` when ``None``); return the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2)
        return exc.code if isinstance(exc.code, int) else 2
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 2
    status: int = handler(args)
    return status
