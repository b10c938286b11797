"""What to train (:class:`TrainSpec`) and how to run it (:class:`FitConfig`).

Both are plain picklable dataclasses: the ddp strategy sends them to every worker process.
"""

from __future__ import annotations

import copy
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from phalanx.checkpoint import Checkpoints
from phalanx.data import Loading
from phalanx.early_stopping import EarlyStopping
from phalanx.faults import Fault
from phalanx.metrics import LoopMetric, Metric
from phalanx.policy import Recovery
from phalanx.precision import Precision
from phalanx.snapshot.config import Snapshots

ModelSource = Callable[[], nn.Module] | nn.Module
OptimizerFactory = Callable[[Any], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]


@dataclass
class TrainSpec:
    """The Learner's recipe: model, optimizer, step function, metrics, schedule."""

    model: ModelSource
    optimizer: OptimizerFactory
    step: Callable[[nn.Module, Any], Any]
    metrics: list[Metric | LoopMetric] = field(default_factory=list)
    lr_scheduler: SchedulerFactory | None = None
    grad_accumulation: int = 1
    grad_clip_norm: float | None = None
    precision: Precision = field(default_factory=Precision)
    lr_scheduler_interval: str = "step"  # or "epoch": the scheduler steps once per epoch

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """The optimizer factory's result: see :func:`factory_takes_model` for what it gets."""
        if factory_takes_model(self.optimizer):
            return self.optimizer(model)
        return self.optimizer(model.parameters())

    def build_model(self) -> nn.Module:
        """A fresh replica: the factory's result, or a deep copy of the given module."""
        if isinstance(self.model, nn.Module):
            return copy.deepcopy(self.model)
        model = self.model()
        if not isinstance(model, nn.Module):
            from phalanx.errors import InvalidSettingError

            raise InvalidSettingError(
                f"the model factory returned {type(model).__name__}, not an nn.Module; "
                "pass model=<zero-argument function returning the nn.Module>"
            )
        return model

    def build_empty(self, tied: bool = True) -> nn.Module | None:
        """The factory's model built on the meta device, for a state loaded into it next:
        an fsdp regroup's (sharded, then given each member's shards only: ``to_empty``),
        the run's result (``load_state_dict(assign=True)``: ``tied=False``). So neither
        holds the model twice, nor spends the time to initialise it. None (build it with
        :meth:`build_model`) where the factory does not build on the meta device (it reads
        a file, or computes with a tensor's values; a module given, not a factory), the
        model has a buffer no state holds (a non-persistent one, which its constructor
        computes), or, unless ``tied``, a parameter under two names (an assignment would
        untie it)."""
        if isinstance(self.model, nn.Module):
            return None
        try:
            with torch.device("meta"):
                model = self.build_model()
        except Exception:
            return None
        held = model.state_dict().keys()
        named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]
        if not all(t.is_meta for _, t in named) or not all(n in held for n, _ in named):
            return None
        if not tied and len({id(t) for _, t in named}) < len(named):
            return None
        return model

    def summed_metrics(self) -> list[Metric]:
        """Loss first, then every summed metric the user asked for (each name once)."""
        from phalanx.metrics import Loss

        user = [m for m in self.metrics if isinstance(m, Metric) and m.name != "loss"]
        return [Loss(), *user]

    def loop_metrics(self) -> list[LoopMetric]:
        return [m for m in self.metrics if isinstance(m, LoopMetric)]


@dataclass
class FitConfig:
    """Where and how long: validated by :func:`phalanx.validate.validate_fit` before launch."""

    epochs: int
    batch_size: int
    devices: list[str]
    strategy: str
    seed: int = 0
    run_dir: str | None = None
    checkpoint: Checkpoints | None = None
    early_stopping: EarlyStopping | None = None
    resume: bool = False
    drop_last: bool = False
    shuffle: bool = True
    faults: list[Fault] = field(default_factory=list)
    preflight: bool = True
    hang_timeout: timedelta = timedelta(seconds=60)
    node_timeout: timedelta = timedelta(seconds=10)  # several nodes: a silent node is lost
    num_workers: int = 0
    min_free_memory: int | None = None
    recovery: Recovery = field(default_factory=Recovery)  # ddp: what to do when a worker falls
    collate_fn: Callable[[list[Any]], Any] | None = None  # None: torch's default_collate
    pin_memory: bool = False
    max_steps: int | None = None  # stop after this many committed steps (global step count)
    val_every_steps: int | None = None  # validate every N committed steps too
    balance: bool = True  # members' shares in proportion to their speed (phalanx.balance)
    slow_worker: float | None = None  # put out a member this many times slower (balance)
    on_bad_sample: str = "stop"  # or "skip": find bad samples, leave them out (badsamples)
    max_bad_samples: int = 8  # with "skip": more than this stops the run (data broken)
    # ddp: snapshots of the committed state in each machine's shared memory (None: none)
    snapshots: Snapshots | None = field(default_factory=Snapshots)
    # ddp across nodes with a shared run_dir: the fencing term of the head this run's
    # workers answer to (0: none); a checkpoint is not written once a newer head leads
    head_term: int = 0
    # fsdp: which modules are sharded as units (phalanx.sharding; None: its default rule)
    shard: Any = None
    # fsdp: the final weights gathered into one process at the end (False: they stay in the
    # run's last sharded checkpoint, which nobody gathers; FitResult.model is None)
    gather: bool = True
    # fsdp: FSDP2's MixedPrecisionPolicy for every unit (None: float32 parameters, with
    # autocast when the Learner's precision asks for it)
    mp_policy: Any = None

    def loading(self) -> Loading:
        """What every DataLoader of the run is built with."""
        return Loading(self.num_workers, self.collate_fn, self.pin_memory)


def factory_takes_model(factory: Callable[..., Any]) -> bool:
    """Whether the optimizer factory is called with the model rather than its parameters.

    A torch optimizer class (or a ``functools.partial`` of one) gets ``model.parameters()``.
    Any other callable gets the model when its first parameter is named ``model`` or
    ``module``, or is annotated as an ``nn.Module``: it can then build parameter groups from
    ``model.named_parameters()`` (weight decay for weights, none for biases and norms).
    Otherwise it gets ``model.parameters()``, as a plain ``def make_optimizer(params)`` expects.
    """
    target = factory
    while isinstance(target, functools.partial):
        target = target.func
    if isinstance(target, type) and issubclass(target, torch.optim.Optimizer):
        return False
    try:
        parameters = list(inspect.signature(factory).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature
        return False
    if not parameters:
        return False
    first = parameters[0]
    if first.name in ("model", "module"):
        return True
    annotation = first.annotation
    if isinstance(annotation, str):  # postponed annotations: "nn.Module", "torch.nn.Module"
        return annotation.rsplit(".", 1)[-1] == "Module"
    return isinstance(annotation, type) and issubclass(annotation, nn.Module)
