"""``phalanx demo``: a small CNN on scikit-learn's bundled digits, trained through phalanx.

The data ships with scikit-learn (1797 grey 8x8 images, 10 classes), so the demo runs
offline. The model factory, optimizer factory and step function are module-level functions
and the datasets are ``TensorDataset``\\ s, so all of them pickle: ``--strategy ddp`` sends
them to worker processes.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from datetime import timedelta

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import phalanx as px
from phalanx.metrics import F1, Accuracy, LearningRate, SamplesPerSecond
from phalanx.strategies import process_based

VALID_FRACTION = 0.2
SPLIT_SEED = 0


def load_digits_split(seed: int = SPLIT_SEED) -> tuple[TensorDataset, TensorDataset]:
    """Train and validation sets: images ``(N, 1, 8, 8)`` float32 in [0, 1], int64 labels.

    The split is stratified and fixed by ``seed``, so every run validates on the same images.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = digits.images.astype("float32") / 16.0  # pixels are 0..16
    x_train, x_valid, y_train, y_valid = train_test_split(
        images,
        digits.target,
        test_size=VALID_FRACTION,
        stratify=digits.target,
        random_state=seed,
    )

    def as_dataset(x: object, y: object) -> TensorDataset:
        return TensorDataset(torch.as_tensor(x).unsqueeze(1), torch.as_tensor(y).long())

    return as_dataset(x_train, y_train), as_dataset(x_valid, y_valid)


def make_model() -> nn.Module:
    """Conv 1->16, Conv 16->32 (3x3, padded), max-pool to 4x4, linear to 10 classes."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 10),
    )


def make_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """Adam, learning rate 3e-3."""
    return torch.optim.Adam(params, lr=3e-3)


def train_step(model: nn.Module, batch: list[torch.Tensor]) -> px.StepOutput:
    """Cross-entropy over the local batch (phalanx has moved it to the model's device), with
    logits and labels for the metrics."""
    images, labels = batch
    logits = model(images)
    return px.StepOutput(loss=F.cross_entropy(logits, labels), outputs=logits, targets=labels)


def run_demo(args: argparse.Namespace) -> int:
    """Train on digits with the CLI's settings. 0 when the run trains to its end (its
    validation accuracy is printed, not judged), 130 when it was stopped by a stop request;
    Ctrl-C raises KeyboardInterrupt and SIGTERM px.FitTerminated out of ``fit`` (the CLI
    returns 130, and exits 143), a failed run its TrainingFailed (the CLI returns 1)."""
    faults = check_args(args)  # every argument, before anything is moved or written
    train, valid = load_digits_split()
    # One intra-op thread: with batches this small, a second torch thread only adds
    # synchronisation. Measured on 2 cores (10 epochs, single): 1-3 s with 1 thread; with 2,
    # about the same on an idle machine but 4-21 s while other processes use the cores.
    # The caller's setting is restored afterwards.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    chaos = getattr(args, "chaos", 0)
    if chaos:
        steps = -(-len(train) // args.batch_size) * args.epochs
        workers = len(args.devices.split(","))
        faults += px.faults.chaos(chaos, workers, steps, seed=args.seed)
    if args.run_dir and not args.resume:
        start_over(args.run_dir)
    try:
        result = _fit(args, train, valid, faults)
        clean = None
        if chaos:
            print(
                "phalanx demo: now a clean run with the same seed and no faults, for "
                "comparison (no output until it ends)...",
                flush=True,
            )
            clean = _fit(args, train, valid, [], quiet=True)
    finally:
        torch.set_num_threads(threads)
    accuracy = result.history[-1].get("valid/accuracy") if result.history else None
    if clean is not None:
        print(
            f"clean run, same seed, no failures: validation accuracy "
            f"{clean.history[-1]['valid/accuracy']:.3f}"
        )
    shown = "none (no epoch finished)" if accuracy is None else f"{accuracy:.3f}"
    print(
        f"final validation accuracy: {shown}; every sample used exactly once per "
        f"epoch: {result.ledger_ok}"
    )
    if result.interrupted:
        where = f" --run-dir {args.run_dir}" if args.run_dir != "runs/demo" else ""
        print(f"phalanx demo: interrupted; `phalanx demo --resume{where}` goes on from here")
        return 130
    return 0


def check_args(args: argparse.Namespace) -> list[px.Fault]:
    """Check what the demo can before it touches the run dir (the rest fit checks, and the
    last run's files are only moved aside, never deleted); return the parsed faults."""
    from phalanx.devices import parse_devices
    from phalanx.errors import InvalidSettingError

    parse_devices(args.devices)
    faults = [px.Fault.parse(f) for f in args.fault]
    if getattr(args, "chaos", 0) and not process_based(args.strategy):
        raise InvalidSettingError(
            "phalanx demo: --chaos needs --strategy ddp or fsdp (and several --devices)"
        )
    if args.epochs < 1 or args.batch_size < 1:
        raise InvalidSettingError(
            f"phalanx demo: --epochs and --batch-size must be at least 1, got {args.epochs} "
            f"and {args.batch_size}"
        )
    return faults


def start_over(run_dir: str) -> None:
    """The demo without --resume starts a new run: the last run's checkpoints and files in
    ``run_dir`` move to ``run_dir/earlier/<its run id>/`` (fit itself refuses to mix two
    runs: PX118), unless a live run holds the folder (PX143: nothing is moved)."""
    from phalanx.runinfo import start_over as move_last_run_aside

    moved = move_last_run_aside(run_dir)
    if moved is not None:
        print(
            f"phalanx demo: starting over in {run_dir}; the last run's files are in {moved} "
            "(--resume continues the last run instead)"
        )


def _fit(
    args: argparse.Namespace,
    train: TensorDataset,
    valid: TensorDataset,
    faults: list[px.Fault],
    quiet: bool = False,
) -> px.FitResult:
    learner = px.Learner(
        make_model,
        make_optimizer,
        train_step,
        metrics=[Accuracy(), F1(num_classes=10), LearningRate(), SamplesPerSecond()],
    )
    return learner.fit(
        train,
        valid=valid,
        epochs=args.epochs,
        batch_size=args.batch_size,
        devices=args.devices,
        strategy=args.strategy,
        seed=args.seed,
        run_dir=None if quiet else args.run_dir,
        resume=args.resume and not quiet,
        checkpoint=px.Checkpoints(every_steps=20, keep_last=2, keep_best="valid/accuracy"),
        faults=faults,
        hang_timeout=timedelta(seconds=5),
        sinks=[] if quiet else None,
    )
