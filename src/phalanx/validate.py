"""Checks run in the caller's process before anything starts. Each raises a
:class:`~phalanx.errors.ConfigError` subclass whose message names the fix."""

from __future__ import annotations

import ast
import os
import sys
import types
from collections.abc import Mapping
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from phalanx.badsamples import ON_BAD_SAMPLE
from phalanx.devices import check_one_backend
from phalanx.errors import (
    BatchSizeError,
    BatchSmallerThanWorkersError,
    CheckpointError,
    DataLoaderAsDatasetError,
    DatasetNotPicklableError,
    EmptyDatasetError,
    EpochTooShortError,
    InvalidSettingError,
    LambdaStepError,
    MissingMainGuardError,
    MultiNodeUnavailableError,
    NotPicklableError,
    OptimizerInstanceError,
    PrecisionError,
    ProcessesPerNodeError,
    RunDirInUseError,
    UnknownStrategyError,
    UnsizedDatasetError,
)
from phalanx.launch import Launch, detect
from phalanx.snapshot.shards import MAX_WORLD
from phalanx.spec import FitConfig, TrainSpec
from phalanx.strategies import STRATEGIES, process_based


def check_launch(environ: Mapping[str, str], strategy: str = "ddp") -> Launch:
    """The launch ``fit`` accepts: one process per node (PX140 for an environment that
    cannot be read, PX141 for several processes per node), and several nodes only with
    ``strategy="ddp"`` or ``"fsdp"`` (PX142). Called first in ``fit``, before any process,
    thread or file."""
    launch = detect(environ)
    if launch.local_world_size > 1:
        raise ProcessesPerNodeError(_copies_message(launch))
    if launch.nnodes > 1 and not process_based(strategy):
        raise MultiNodeUnavailableError(
            f"this process is node {launch.node_rank} of {launch.nnodes} "
            f"({_NODES_FROM[launch.source]}), but strategy={strategy!r} trains on one node "
            "only: several nodes train with strategy='ddp' or 'fsdp' (every node runs the "
            "same script, "
            "fit(devices=...) naming that node's devices). Or run on one node (torchrun "
            "--nnodes 1 --nproc-per-node 1, srun --nodes 1 --ntasks-per-node 1, or without "
            "PHALANX_NNODES)"
        )
    return launch


_NODES_FROM = {
    "phalanx": "PHALANX_NNODES",
    "torchrun": "torchrun's GROUP_WORLD_SIZE",
    "slurm": "Slurm's node count for this step",
    "local": "no launcher",
}


def _copies_message(launch: Launch) -> str:
    n, rank = launch.local_world_size, launch.local_rank
    if launch.per_node_from == "torchrun":
        started = (
            f"torchrun started {n} processes on this node (LOCAL_WORLD_SIZE={n}; this is "
            f"LOCAL_RANK={rank})"
        )
        instead = "torchrun --nproc-per-node 1 script.py"
    else:
        started = f"srun started {n} tasks on this node (this is SLURM_LOCALID={rank})"
        instead = "srun --ntasks-per-node 1 python script.py"
    return (
        f"{started}: each would train a full copy of the job. "
        "phalanx starts one worker per device itself, so launch one process per node: "
        f"{instead}, and name this node's devices in fit(devices=...), e.g. "
        'devices="cuda:0,cuda:1" or "auto" (strategy="ddp")'
    )


def dataset_size(dataset: Any, name: str) -> int:
    """The number of samples of a map-style dataset; a ConfigError naming the fix for a
    DataLoader (PX127) or anything without ``__len__`` and ``__getitem__`` (PX128)."""
    if isinstance(dataset, DataLoader):
        batch = dataset.batch_size if dataset.batch_size is not None else "<global batch>"
        raise DataLoaderAsDatasetError(
            f"the {name} dataset is a torch DataLoader; phalanx builds its own loaders from the "
            f"plan: pass loader.dataset and batch_size={batch} (the global batch) instead, e.g. "
            f"fit(loader.dataset, batch_size={batch}); shuffle=, drop_last=, num_workers=, "
            "collate_fn= and pin_memory= are fit() arguments"
        )
    streaming = isinstance(dataset, IterableDataset)
    text = isinstance(dataset, str | bytes)  # (has a len and indexing: not a dataset)
    if streaming or text or not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        kind = "an IterableDataset" if streaming else f"a {type(dataset).__qualname__}"
        kind += f" ({dataset!r:.60})" if text else ""
        raise UnsizedDatasetError(
            f"the {name} dataset is {kind}, without __len__ and __getitem__: phalanx cannot "
            "plan it exactly once per epoch. Stream it with px.Stream(shards, read) (a list of "
            "shard names and a module-level read(shard) that yields their samples; "
            "phalanx.stream.huggingface/webdataset wrap those libraries), or pass a map-style "
            "torch Dataset (with __len__ and __getitem__)"
        )
    try:
        n = len(dataset)
    except TypeError as exc:
        raise UnsizedDatasetError(
            f"the {name} dataset's len() raised {exc}; pass a map-style torch Dataset "
            "(with __len__ and __getitem__)"
        ) from None
    return int(n)


def validate_fit(
    spec: TrainSpec,
    config: FitConfig,
    train_size: int,
    has_valid: bool = False,
    train: Any = None,
    valid: Any = None,
    nodes: int = 1,
) -> None:
    """Every check before launch. ``train`` and ``valid`` (the datasets) are checked for
    pickling under ddp when given. ``nodes``: the job's node count (across nodes a fault's
    worker counts every node's devices, which no node knows before they join)."""
    _validate_numbers(spec, config)
    _validate_schedule(config, has_valid)
    _validate_factories(spec)
    _validate_precision(spec, config.devices)
    _validate_mp_policy(spec, config)
    _validate_data(config, train_size)
    _validate_strategy(config)
    validate_sharding(config, nodes)
    _validate_faults(config, nodes)
    _validate_early_stopping(spec, config, has_valid)
    _validate_keep_best(spec, config, has_valid)
    if process_based(config.strategy):
        check_one_backend(config.devices)
        _validate_picklable(spec)
        _check_pickles("collate_fn", config.collate_fn)
        _validate_datasets_picklable({"training": train, "validation": valid})
        _validate_main_guard(config.strategy)


def _validate_numbers(spec: TrainSpec, config: FitConfig) -> None:
    if config.batch_size < 1:
        raise BatchSizeError(
            f"batch_size={config.batch_size}; it must be >= 1 (it is the "
            "GLOBAL batch, split among devices)"
        )
    if config.epochs < 1:
        raise InvalidSettingError(f"epochs={config.epochs}; pass epochs >= 1")
    if spec.grad_accumulation < 1:
        raise InvalidSettingError(f"grad_accumulation={spec.grad_accumulation}; it must be >= 1")
    if spec.grad_clip_norm is not None and spec.grad_clip_norm <= 0:
        raise InvalidSettingError("grad_clip_norm must be > 0, or None to disable clipping")
    if config.hang_timeout.total_seconds() <= 0:
        raise InvalidSettingError("hang_timeout must be a positive timedelta")
    if config.node_timeout.total_seconds() <= 2:
        raise InvalidSettingError(
            "node_timeout must be more than 2 seconds (each node says something every "
            "second; a shorter silence is no loss)"
        )
    if config.resume and not config.run_dir:
        raise CheckpointError("resume=True needs run_dir= (where the checkpoints are)")
    _validate_loading(config)


def _validate_loading(config: FitConfig) -> None:
    if config.collate_fn is not None and not callable(config.collate_fn):
        raise InvalidSettingError(
            f"collate_fn={config.collate_fn!r} is not callable; pass a function that turns a "
            "list of samples into a batch, or None for torch's default_collate"
        )
    if not isinstance(config.pin_memory, bool):
        raise InvalidSettingError(f"pin_memory={config.pin_memory!r}; pass True or False")
    if not _whole(config.num_workers) or config.num_workers < 0:
        raise InvalidSettingError(
            f"num_workers={config.num_workers!r}; pass a whole number >= 0 (DataLoader worker "
            "processes per device; 0 loads in the training process)"
        )


def _validate_schedule(config: FitConfig, has_valid: bool) -> None:
    """``max_steps`` and ``val_every_steps``: whole numbers >= 1 or None; the bad-sample
    settings."""
    if config.on_bad_sample not in ON_BAD_SAMPLE:
        raise InvalidSettingError(
            f"on_bad_sample={config.on_bad_sample!r}; pass 'stop' (a sample that fails every "
            "time stops the run, named) or 'skip' (found, left out and listed)"
        )
    if config.slow_worker is not None and not config.slow_worker > 1:
        raise InvalidSettingError(
            f"slow_worker={config.slow_worker}; pass how many times slower than its peers a "
            "worker may be before it is put out, a number above 1 (e.g. 3.0), or None"
        )
    if config.max_bad_samples < 0:
        raise InvalidSettingError(
            f"max_bad_samples={config.max_bad_samples}; pass a whole number >= 0"
        )
    for name in ("max_steps", "val_every_steps"):
        value = getattr(config, name)
        if value is not None and (not _whole(value) or value < 1):
            raise InvalidSettingError(f"{name}={value!r}; pass a whole number >= 1, or None")
    if config.val_every_steps is not None and not has_valid:
        raise InvalidSettingError(
            f"val_every_steps={config.val_every_steps} needs a validation set: pass valid= to "
            "fit(), or drop val_every_steps"
        )


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _validate_factories(spec: TrainSpec) -> None:
    """Optimizer and scheduler are factories (PX131): each replica builds its own."""
    from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

    opt = spec.optimizer
    if isinstance(opt, torch.optim.Optimizer) or not callable(opt):
        name = type(opt).__name__
        raise OptimizerInstanceError(
            f"optimizer= got a {name} object, but each replica builds its own optimizer over "
            f"its own model: pass a factory, e.g. functools.partial(torch.optim.{name}, lr=...)"
            " (the class gets model.parameters()), or a function def make_optimizer(model) "
            "returning the optimizer (it gets the model, for parameter groups)"
        )
    sched = spec.lr_scheduler
    if sched is not None and (
        isinstance(sched, LRScheduler | ReduceLROnPlateau) or not callable(sched)
    ):
        name = type(sched).__name__
        if not isinstance(sched, LRScheduler | ReduceLROnPlateau):  # ("cosine", a number)
            name = "CosineAnnealingLR"
        raise OptimizerInstanceError(
            f"lr_scheduler= got a {type(sched).__name__} object ({sched!r:.40}); pass a "
            f"function of the optimizer, e.g. functools.partial(torch.optim.lr_scheduler."
            f"{name}, ...): each replica builds its own scheduler over its own optimizer"
        )
    if spec.lr_scheduler_interval not in ("step", "epoch"):
        raise InvalidSettingError(
            f"lr_scheduler_interval={spec.lr_scheduler_interval!r}; pass 'step' (the scheduler "
            "steps after every optimizer step) or 'epoch' (once after every epoch)"
        )


def _validate_precision(spec: TrainSpec, devices: list[str]) -> None:
    from phalanx.precision import MEANINGS, PRECISIONS, SCALER_ARGS

    precision = spec.precision
    if precision.name not in PRECISIONS:
        meaning = MEANINGS.get(precision.name)
        known = f"use one of {', '.join(repr(p) for p in PRECISIONS)} (or '32-true')"
        raise PrecisionError(
            f"precision={precision.name!r}: {meaning}; {known}"
            if meaning
            else f"precision={precision.name!r} is unknown; {known} (Lightning's names)"
        )
    unknown = sorted(set(precision.scaler_args) - set(SCALER_ARGS))
    if precision.scaler_args and precision.name != "16-mixed":
        raise PrecisionError(
            f"grad_scaler= was given with precision={precision.name!r}; only '16-mixed' uses a "
            "gradient scaler: drop grad_scaler= or pass precision='16-mixed'"
        )
    if unknown:
        raise PrecisionError(
            f"grad_scaler= has {', '.join(unknown)}, which torch.amp.GradScaler does not take; "
            f"use {', '.join(SCALER_ARGS)}"
        )
    cuda = [d for d in devices if d.startswith("cuda")]
    if precision.name == "bf16-mixed" and cuda and not torch.cuda.is_bf16_supported():
        raise PrecisionError(
            f"precision='bf16-mixed' but {cuda[0]} does not support bfloat16; use "
            "precision='16-mixed' on this GPU"
        )


MP_DTYPES = (torch.bfloat16, torch.float32)  # what an mp_policy may name (no loss scaler)


def _validate_mp_policy(spec: TrainSpec, config: FitConfig) -> None:
    """``mp_policy=`` only with fsdp, on float32 parameters, in bfloat16 or float32 (no loss
    scaler runs on that path), and not with a precision that autocasts as well."""
    policy = config.mp_policy
    if policy is None:
        return
    if config.strategy != "fsdp":
        raise InvalidSettingError(
            f'mp_policy= is FSDP2\'s policy for the units strategy="fsdp" shards, but '
            f"strategy={config.strategy!r}: drop mp_policy= (precision='bf16-mixed' "
            'autocasts under any strategy) or pass strategy="fsdp"'
        )
    if spec.precision.name != "32":
        raise PrecisionError(
            f"mp_policy= and precision={spec.precision.name!r} both say how the step "
            "computes: keep precision='32' with mp_policy=, or drop mp_policy= to autocast"
        )
    for name in ("param_dtype", "reduce_dtype", "output_dtype"):
        dtype = getattr(policy, name)
        if dtype is not None and dtype not in MP_DTYPES:
            fix = (
                "torch.float16 needs a loss scaler, which runs with precision='16-mixed' "
                "(autocast, float32 parameters): use that, or torch.bfloat16"
                if dtype == torch.float16
                else "use torch.bfloat16 or torch.float32"
            )
            raise PrecisionError(f"mp_policy's {name}={dtype}: {fix}")
    cuda = [d for d in config.devices if d.startswith("cuda")]
    if policy.param_dtype == torch.bfloat16 and cuda and not torch.cuda.is_bf16_supported():
        raise PrecisionError(
            f"mp_policy's param_dtype=torch.bfloat16 but {cuda[0]} does not support "
            "bfloat16; use precision='16-mixed' on this GPU"
        )


def validate_run_dir(config: FitConfig) -> None:
    """A fresh run must not start among an earlier run's checkpoints (PX118). Called by
    ``fit`` once it holds the run_dir's lock, so that a live run's folder is named as such
    (PX143) rather than as an earlier run's."""
    from phalanx.checkpoint.io import list_checkpoints
    from phalanx.runner import checkpoint_dir

    if config.resume or not config.run_dir:
        return
    folder = checkpoint_dir(config.run_dir)
    found = list_checkpoints(folder)
    if found:
        newest, step = found[-1]
        raise RunDirInUseError(
            f"run_dir {config.run_dir!r} already holds {len(found)} checkpoint(s) of an "
            f"earlier run (newest: {os.path.basename(newest)}, step {step}); pass "
            "resume=True to continue that run, use a new run_dir, or delete "
            f"{folder} to start over"
        )


def _validate_data(config: FitConfig, n: int) -> None:
    if n == 0:
        raise EmptyDatasetError(
            "the training dataset is empty; check the path or the filter that built it"
        )
    if n < config.batch_size:
        raise EpochTooShortError(
            f"the training dataset has {n} samples, fewer than one global batch "
            f"(batch_size={config.batch_size}); lower batch_size to at most {n}"
        )
    workers = len(config.devices)
    if config.strategy != "single" and config.batch_size < workers:
        raise BatchSmallerThanWorkersError(
            f"batch_size={config.batch_size} is smaller than the {workers} devices; batch_size "
            f"is the GLOBAL batch: raise it to at least {workers} or use fewer devices"
        )


def _validate_strategy(config: FitConfig) -> None:
    if config.strategy not in STRATEGIES:
        raise UnknownStrategyError(
            f"strategy={config.strategy!r} is unknown; use one of {', '.join(STRATEGIES)}"
        )
    if config.strategy == "single" and len(config.devices) > 1:
        raise InvalidSettingError(
            f'strategy="single" runs on one device but {len(config.devices)} were given '
            f'({", ".join(config.devices)}); use strategy="ddp" (or "threads") for several'
        )


def validate_sharding(config: FitConfig, nodes: int = 1) -> None:
    """``shard=`` only with fsdp, and what fsdp does not do yet (each named, with what to
    do instead: docs/fsdp.md keeps the list)."""
    if config.strategy != "fsdp":
        if config.shard is not None:
            raise InvalidSettingError(
                f'shard= says which modules strategy="fsdp" shards, but strategy='
                f'{config.strategy!r}: drop shard= or pass strategy="fsdp"'
            )
        if not config.gather:
            raise InvalidSettingError(
                f"gather=False keeps a sharded model's final weights in its shards, but "
                f"strategy={config.strategy!r} holds the whole model anyway: drop gather=False "
                'or pass strategy="fsdp"'
            )
        return
    if not config.gather and not config.run_dir:
        raise InvalidSettingError(
            "gather=False leaves the final weights in the run's last sharded checkpoint, "
            "which needs a run_dir: pass run_dir=... (a folder every node shares, across "
            "nodes), or drop gather=False"
        )
    world = len(config.devices) * nodes  # (across nodes: each node as many as this one)
    if world > MAX_WORLD:
        each = f" ({nodes} nodes of {len(config.devices)})" if nodes > 1 else ""
        raise InvalidSettingError(
            f'strategy="fsdp" takes at most {MAX_WORLD} devices (a shard snapshot\'s tag '
            f"holds the rank in 8 bits), not {world}{each}"
        )
    if config.on_bad_sample == "skip":
        raise InvalidSettingError(
            'strategy="fsdp" does not take on_bad_sample="skip" yet (the bad-sample search '
            'over shards is not built; docs/fsdp.md): drop on_bad_sample="skip", or train '
            'with strategy="ddp"'
        )


def _validate_faults(config: FitConfig, nodes: int = 1) -> None:
    for fault in config.faults:
        if fault.worker >= len(config.devices) and nodes == 1:
            raise InvalidSettingError(
                f"{fault} targets worker {fault.worker} but there are only "
                f"{len(config.devices)} devices (workers 0..{len(config.devices) - 1})"
            )
        own_process = fault.kind == "kill" or (fault.kind == "hang" and config.strategy == "single")
        if own_process and not process_based(config.strategy):
            raise InvalidSettingError(
                f'a {fault.kind!r} fault needs strategy="ddp" (one process per device): under '
                f'"{config.strategy}" it would {fault.kind} your own process'
            )
        if fault.phase == "preflight" and not (process_based(config.strategy) and config.preflight):
            raise InvalidSettingError(
                'a preflight fault needs strategy="ddp" or "fsdp", and preflight=True'
            )


def _validate_early_stopping(spec: TrainSpec, config: FitConfig, has_valid: bool) -> None:
    """The metric must be a key of the epoch results: ``train/<metric>``, ``train/lr`` and,
    with a validation set, ``valid/<metric>`` (the same keys the loop's history gets)."""
    if config.early_stopping is not None:
        _check_history_key("EarlyStopping metric", config.early_stopping.metric, spec, has_valid)


def _validate_keep_best(spec: TrainSpec, config: FitConfig, has_valid: bool) -> None:
    """``Checkpoints(keep_best=...)`` names an epoch result too, checked the same way."""
    keep_best = config.checkpoint.keep_best if config.checkpoint is not None else None
    if keep_best is not None:
        _check_history_key("Checkpoints keep_best", keep_best, spec, has_valid)


def _check_history_key(what: str, key: str, spec: TrainSpec, has_valid: bool) -> None:
    names = [m.name for m in spec.summed_metrics()]
    known = [f"train/{n}" for n in names] + ["train/lr"]
    if has_valid:
        known += [f"valid/{n}" for n in names]
    if key not in known:
        raise InvalidSettingError(
            f"{what} {key!r} is not in the epoch results ({', '.join(sorted(known))}); pass "
            "one of those (add valid= to fit() for valid/ metrics)"
        )


def _validate_picklable(spec: TrainSpec) -> None:
    step = spec.step
    qualname = getattr(step, "__qualname__", "")
    if getattr(step, "__name__", "") == "<lambda>" or "<locals>" in qualname:
        kind = "a lambda" if getattr(step, "__name__", "") == "<lambda>" else "a local function"
        raise LambdaStepError(
            f'the step function ({qualname}) is {kind}, which strategy="ddp" cannot send '
            "to worker processes; define it with def at module level"
        )
    for name in ("model", "optimizer", "step", "lr_scheduler", "metrics"):
        _check_pickles(name, getattr(spec, name))


def _check_pickles(name: str, value: Any) -> None:
    probe = _ProbePickler(_Discard())
    try:
        probe.dump(value)
    except Exception as exc:
        raise NotPicklableError(
            f"the {name} argument ({_describe(value)}) cannot be pickled for "
            f'strategy="ddp" ({type(exc).__name__}: {exc}); use a module-level function '
            "or functools.partial of one instead of a lambda or a nested function"
        ) from None
    _check_main_definitions(f"the {name} argument", probe.from_main, NotPicklableError)


class _Discard:
    """A file that keeps nothing."""

    def write(self, data: bytes) -> int:
        return len(data)


class _ProbePickler(ForkingPickler):
    """Pickles the way spawn sends a worker its arguments (multiprocessing's reducers), but
    keeps nothing and skips tensors and numeric arrays: those always pickle, a large dataset
    is not copied just to be checked, and its tensors are not moved to shared memory (as
    torch's reducer for spawn would) before the run needs it."""

    def __init__(self, file: Any) -> None:
        super().__init__(file)
        # Classes and functions of the main module that the pickle refers to by name: a
        # worker re-imports that module without running its `if __name__ == "__main__":`
        # block, so each must be defined outside it (:func:`_check_main_definitions`).
        self.from_main: dict[str, Any] = {}

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor | torch.UntypedStorage | torch.TypedStorage):
            return "tensor"
        if isinstance(obj, np.ndarray) and obj.dtype != object:
            return "array"
        return None

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, type | types.FunctionType) and obj.__module__ == "__main__":
            self.from_main.setdefault(obj.__qualname__, obj)
        return NotImplemented  # (pickled as it would be anyway)


def _validate_datasets_picklable(datasets: dict[str, Any]) -> None:
    """Each ddp worker gets its own copy of the datasets, pickled at spawn: a dataset that
    cannot be pickled would fail there, inside process start, with a bare PicklingError."""
    for name, dataset in datasets.items():
        if dataset is None:
            continue
        probe = _ProbePickler(_Discard())
        try:
            probe.dump(dataset)
        except Exception as exc:
            raise DatasetNotPicklableError(
                f"the {name} dataset ({type(dataset).__qualname__}) cannot be pickled for "
                f'strategy="ddp" ({type(exc).__name__}: {exc}); every worker process gets '
                "a copy of it. Define the Dataset class at module level, keep tensors (or "
                "arrays, file paths) in it, and open files or connections in __getitem__, "
                "not in __init__"
            ) from None
        _check_main_definitions(f"the {name} dataset", probe.from_main, DatasetNotPicklableError)


def _check_main_definitions(
    what: str, found: dict[str, Any], error: type[NotPicklableError]
) -> None:
    """Each class or function of the main module in ``found`` (by qualified name) must be
    one that a worker re-importing the main module defines: at its top level, outside an
    ``if __name__ == "__main__":`` block, and the main module must be a file (a notebook
    cell, ``python -c`` or a REPL has none to re-import). Else PX119 (a dataset) or PX114,
    naming the class, before anything starts."""
    if not found:
        return
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    source = _read(path) if path is not None else None
    if path is None:
        top: set[str] | None = set()
        where = "the interactive session or notebook (no file the workers could import)"
    else:
        top = _top_level_names(source) if source is not None else None
        where = os.path.basename(path)
    if top is None:  # (unreadable or unparsable: given the benefit of the doubt)
        return
    for qualname, obj in found.items():
        if qualname.split(".")[0] in top:
            continue
        kind = "class" if isinstance(obj, type) else "function"
        guarded = path is not None and qualname.split(".")[0] in _guarded_names(source or "")
        place = 'under `if __name__ == "__main__":` in ' + where if guarded else "in " + where
        fix = (
            f"Define {qualname} at the top level of the script (above `if __name__ == "
            '"__main__":`), or in a module you import'
            if path is not None
            else f"Define {qualname} in a .py module next to it and import it from there"
        )
        raise error(
            f"{what} uses the {kind} {qualname}, defined {place}: ddp workers re-import the "
            f"main module without running that code, so none of them could find "
            f"{qualname} and every worker would die at start. {fix}"
        )


def _top_level_names(source: str) -> set[str] | None:
    """Names a module defines when imported under another name than ``__main__``: its
    top-level definitions, assignments and imports, also inside top-level ``if``/``try``/
    ``with`` blocks, but not in the body of ``if __name__ == "__main__":`` (nor the
    ``else`` of ``if __name__ != "__main__":``). None when the source does not parse."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    names: set[str] = set()
    _collect(tree.body, names, skip_main=True)
    return names


def _guarded_names(source: str) -> set[str]:
    """Names defined inside the main module's ``if __name__ == "__main__":`` blocks."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.If) and _main_test(node.test) is not None:
            _collect(node.body if _main_test(node.test) else node.orelse, names, False)
    return names


def _main_test(test: ast.expr) -> bool | None:
    """True for ``__name__ == "__main__"``, False for ``!=``, None for any other test."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1):
        return None
    sides = [test.left, test.comparators[0]]
    names = [n.id for n in sides if isinstance(n, ast.Name)]
    values = [n.value for n in sides if isinstance(n, ast.Constant)]
    if names != ["__name__"] or values != ["__main__"]:
        return None
    if isinstance(test.ops[0], ast.Eq):
        return True
    return False if isinstance(test.ops[0], ast.NotEq) else None


def _collect(body: list[ast.stmt], names: set[str], skip_main: bool) -> None:
    for node in body:
        names.update(_bound(node))
        for block in _blocks(node, skip_main):
            _collect(block, names, skip_main)


def _bound(node: ast.stmt) -> set[str]:
    """The names a simple statement binds at its own level."""
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return {node.name}
    if isinstance(node, ast.Import | ast.ImportFrom):
        return {(a.asname or a.name).split(".")[0] for a in node.names}
    if isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return set()


def _blocks(node: ast.stmt, skip_main: bool) -> list[list[ast.stmt]]:
    """The statement blocks inside ``node`` that run at import (``skip_main``: not the
    main-guarded one)."""
    if isinstance(node, ast.If):
        main = _main_test(node.test) if skip_main else None
        return [
            b
            for b, keep in ((node.body, main is not True), (node.orelse, main is not False))
            if keep
        ]
    if isinstance(node, ast.Try):
        return [node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)]
    if isinstance(node, ast.With | ast.AsyncWith | ast.For | ast.While):
        return [node.body]
    return []


def _validate_main_guard(strategy: str) -> None:
    """With spawn, the main module is re-imported in each worker: unguarded top-level code
    would start training again there. Detectable when fit() is called while the main module
    is still being executed at top level (not from a function called under the guard)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or path is None:
        return
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals is vars(main):
            source = _read(path)
            if source is not None and not _has_main_guard(source):
                raise MissingMainGuardError(
                    f'{path} calls fit(strategy="{strategy}") at top level without an '
                    '`if __name__ == "__main__":` guard; worker processes re-import this file. '
                    'Put the call under `if __name__ == "__main__":`'
                )
            return
        frame = frame.f_back  # type: ignore[assignment]


def _has_main_guard(source: str) -> bool:
    """Whether the module compares ``__name__`` with ``"__main__"`` somewhere (an
    ``if __name__ == "__main__":``, either way round); unparsable source gets the benefit
    of the doubt."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return True
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and len(node.comparators) == 1:
            sides = [node.left, node.comparators[0]]
            names = [n.id for n in sides if isinstance(n, ast.Name)]
            values = [n.value for n in sides if isinstance(n, ast.Constant)]
            if names == ["__name__"] and values == ["__main__"]:
                return True
    return False


def _read(path: str) -> str | None:
    try:
        with open(path) as fh:
            return fh.read()
    except OSError:
        return None


def _describe(value: Any) -> str:
    name = getattr(value, "__qualname__", None) or type(value).__name__
    return str(name)
