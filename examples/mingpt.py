"""A minGPT-style character-level GPT, trained by phalanx.

minGPT's DDP trainer (Karpathy's minGPT, as adapted in PyTorch's DDP tutorial series) builds
a GPT, an AdamW optimizer whose weight decay applies to Linear weights only (``configure_
optimizers`` splits the parameters by name), trains with fp16 autocast and a GradScaler (on
CUDA devices; float32 on CPU, where float16 is several times slower), clips gradients, and
saves snapshots to resume from. Here phalanx does the processes, the data split, the
scaler's vote (an overflowing step is skipped by every worker together) and the checkpoints;
the model, its optimizer groups and the step are the user's. The text is the Zen of Python
(``import this``): offline, and small enough to train on a CPU in a minute.

    .venv/bin/python examples/mingpt.py                    # 2 CPU workers (after make demo)
    .venv/bin/python examples/mingpt.py --fault kill:0@30  # rank 0 killed: training goes on
    .venv/bin/python examples/mingpt.py --resume           # after Ctrl-C: from the checkpoint
    .venv/bin/python examples/mingpt.py --shards 4         # the text streamed from 4 files

Ctrl-C stops after the current step with a checkpoint in --run-dir and exits 130 (a
KeyboardInterrupt); SIGTERM likewise, exiting 143. Run again with --resume to continue;
without --resume a new run starts, and the last run's files and checkpoints move to
--run-dir's earlier/<run id>/ (px.start_over). When it finishes, --run-dir holds
model.pt, the final state dict, which torch.load(path, weights_only=True) opens.
"""

from __future__ import annotations

import argparse
import codecs
import functools
import math
import sys
import this
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

import phalanx as px


class CharDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Every window of ``block_size + 1`` characters: input, and the same shifted by one."""

    def __init__(self, text: str, block_size: int) -> None:
        self.chars = sorted(set(text))
        index = {c: i for i, c in enumerate(self.chars)}
        self.data = torch.tensor([index[c] for c in text], dtype=torch.long)
        self.block_size = block_size

    def __len__(self) -> int:
        return len(self.data) - self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i : i + self.block_size + 1]
        return chunk[:-1], chunk[1:]


def write_shards(text: str, folder: Path, count: int) -> list[str]:
    """The text cut into ``count`` files (what a corpus in shards looks like)."""
    folder.mkdir(parents=True, exist_ok=True)
    size = -(-len(text) // count)
    paths = []
    for i in range(count):
        path = folder / f"zen-{i:03d}.txt"
        path.write_text(text[i * size : (i + 1) * size])
        paths.append(str(path))
    return paths


def read_windows(
    shard: str, start: int = 0, *, block_size: int, chars: str
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """A shard's windows of ``block_size + 1`` characters, front to back, from window
    ``start`` on (phalanx passes ``start`` to begin mid-shard without reading what is
    before it). At module level: ddp workers read the stream themselves."""
    index = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([index[c] for c in Path(shard).read_text()], dtype=torch.long)
    for i in range(start, len(data) - block_size):
        chunk = data[i : i + block_size + 1]
        yield chunk[:-1], chunk[1:]


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.c_attn, self.c_proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd)
        )
        self.n_head = n_head
        self.mask: torch.Tensor
        mask = torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size)
        self.register_buffer("mask", mask, persistent=False)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
        att = F.softmax(att.masked_fill(self.mask[:, :, :t, :t] == 0, float("-inf")), dim=-1)
        return self.c_proj((att @ v).transpose(1, 2).contiguous().view(b, t, c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, block_size: int, n_layer: int, n_head: int, n_embd: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, n_embd), nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, block_size) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def configure_optimizers(
    model: nn.Module, lr: float = 2e-3, weight_decay: float = 0.1
) -> torch.optim.Optimizer:
    """minGPT's rule: Linear weights decay; biases, LayerNorm and Embedding weights do not.
    The first parameter is called ``model``, so phalanx passes the model."""
    decay, no_decay = set(), set()
    for module_name, module in model.named_modules():
        for name, _ in module.named_parameters(recurse=False):
            full = f"{module_name}.{name}" if module_name else name
            if name == "weight" and isinstance(module, nn.Linear):
                decay.add(full)
            else:
                no_decay.add(full)
    params = dict(model.named_parameters())
    groups = [
        {"params": [params[n] for n in sorted(decay)], "weight_decay": weight_decay},
        {"params": [params[n] for n in sorted(no_decay)], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def lm_step(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    """Cross-entropy of the next character at every position (mean over the local batch)."""
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))


def zen() -> str:
    return codecs.decode(this.s, "rot13")


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="cpu:0,cpu:1")
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--embd", type=int, default=64)
    parser.add_argument(
        "--precision",
        default=None,
        help='default: "16-mixed" on CUDA devices, "32" on CPU (float16 is slow on CPU)',
    )
    parser.add_argument("--run-dir", default="runs/mingpt")
    parser.add_argument("--resume", action="store_true", help="continue from --run-dir")
    parser.add_argument("--fault", action="append", default=[], help="e.g. kill:0@30")
    parser.add_argument(
        "--shards",
        type=int,
        default=0,
        help="stream the text from this many files (px.Stream) instead of indexing it",
    )
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse(argv)
    if args.precision is None:
        args.precision = "16-mixed" if "cuda" in args.devices else "32"
    text = zen()
    indexed = CharDataset(text, args.block_size)
    train: Dataset[tuple[torch.Tensor, torch.Tensor]] = indexed
    if args.shards:  # the same text as a stream of shards, read front to back
        paths = write_shards(text, Path(args.run_dir) / "shards", args.shards)
        read = functools.partial(
            read_windows, block_size=args.block_size, chars="".join(indexed.chars)
        )
        train = px.Stream(paths, read)
    model = functools.partial(
        GPT, len(indexed.chars), args.block_size, args.layers, n_head=4, n_embd=args.embd
    )
    learner = px.Learner(
        model,
        configure_optimizers,
        lm_step,
        grad_clip_norm=1.0,
        precision=args.precision,
    )
    if not args.resume:  # a new run: the last one's files and checkpoints move aside
        moved = px.start_over(args.run_dir)
        if moved is not None:
            print(f"starting over in {args.run_dir}; the last run's files are in {moved}")
    try:
        result = learner.fit(
            train,
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
    print("sample:", sample(result.model, indexed, "Beautiful is ", 60))
    return 0


@torch.no_grad()
def sample(model: nn.Module, data: CharDataset, prompt: str, length: int) -> str:
    """Greedy continuation of ``prompt`` (characters the text does not contain are dropped)."""
    index = {c: i for i, c in enumerate(data.chars)}
    idx = torch.tensor([[index[c] for c in prompt if c in index]])
    model.eval()
    for _ in range(length):
        logits = model(idx[:, -data.block_size :])
        idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return "".join(data.chars[i] for i in idx[0].tolist())


if __name__ == "__main__":  # required: ddp starts its workers with spawn
    sys.exit(main(sys.argv[1:]))
