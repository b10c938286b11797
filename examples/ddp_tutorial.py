"""The PyTorch DDP tutorial's toy model, trained by phalanx.

The tutorial (pytorch.org, "Getting Started with Distributed Data Parallel") spawns one
process per device, sets MASTER_ADDR/MASTER_PORT, calls init_process_group, wraps the model
in DistributedDataParallel, and trains ``ToyModel`` (10 -> 10 -> 5) on random data with MSE
and SGD. Here phalanx does the processes, the group, DDP, the data split and the
checkpoints; what stays is the model, the loss and the optimizer. On top of the tutorial:
fp16 mixed precision with a gradient scaler on CUDA devices (float32 on CPU), and AdamW with
weight decay on the weights only.

    .venv/bin/python examples/ddp_tutorial.py                    # 2 CPU workers
    .venv/bin/python examples/ddp_tutorial.py --devices cuda:0,cuda:1
    .venv/bin/python examples/ddp_tutorial.py --fault kill:1@20  # a worker killed: goes on
    .venv/bin/python examples/ddp_tutorial.py --resume           # after Ctrl-C: continues

Ctrl-C stops after the current step with a checkpoint in --run-dir and exits 130 (a
KeyboardInterrupt); SIGTERM likewise, exiting 143. Run again with --resume to continue;
without --resume a new run starts, and the last run's files and checkpoints move to
--run-dir's earlier/<run id>/ (px.start_over). When it finishes, --run-dir holds
model.pt, the final state dict, which torch.load(path, weights_only=True) opens.
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch import nn
from torch.utils.data import TensorDataset

import phalanx as px


class ToyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """Named weight-decay groups: weights (2-D) decay, biases do not. The first parameter is
    called ``model``, so phalanx passes the model (not its parameters)."""
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    groups = [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=1e-3)


def train_step(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    """The tutorial's step: MSE between the outputs and the labels (mean over the batch)."""
    inputs, labels = batch
    return nn.functional.mse_loss(model(inputs), labels)


def toy_data(samples: int, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 10, generator=g)
    return TensorDataset(x, torch.tanh(x[:, :5] * 2) + 0.1 * torch.randn(samples, 5, generator=g))


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="cpu:0,cpu:1")
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument(
        "--precision",
        default=None,
        help='default: "16-mixed" on CUDA devices, "32" on CPU (float16 is slow on CPU)',
    )
    parser.add_argument("--run-dir", default="runs/ddp_tutorial")
    parser.add_argument("--resume", action="store_true", help="continue from --run-dir")
    parser.add_argument("--fault", action="append", default=[], help="e.g. kill:1@20")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse(argv)
    if args.precision is None:
        args.precision = "16-mixed" if "cuda" in args.devices else "32"
    learner = px.Learner(ToyModel, make_optimizer, train_step, precision=args.precision)
    if not args.resume:  # a new run: the last one's files and checkpoints move aside
        moved = px.start_over(args.run_dir)
        if moved is not None:
            print(f"starting over in {args.run_dir}; the last run's files are in {moved}")
    try:
        result = learner.fit(
            toy_data(args.samples),
            epochs=args.epochs,
            batch_size=args.batch_size,
            strategy=args.strategy,
            devices=args.devices,
            run_dir=args.run_dir,
            resume=args.resume,
            checkpoint=px.Checkpoints(every_steps=10, keep_last=2),
            faults=[px.Fault.parse(f) for f in args.fault],
        )
    except KeyboardInterrupt as stopped:  # Ctrl-C: the checkpoint is written
        steps = getattr(stopped, "result", None) and stopped.result.steps  # type: ignore[attr-defined]
        print(f"interrupted after step {steps}; --resume continues")
        return 130
    # fit saved the final weights as run_dir/model.pt: a plain state dict, so
    # model.load_state_dict(torch.load(result.model_path, weights_only=True)) opens it
    print(
        f"final train loss {result.history[-1]['train/loss']:.4f} after {result.steps} steps; "
        f"failures survived: {len(result.failures)}; exactly-once: {result.ledger_ok}; "
        f"saved {result.model_path}"
    )
    return 0


if __name__ == "__main__":  # required: ddp starts its workers with spawn
    sys.exit(main(sys.argv[1:]))
