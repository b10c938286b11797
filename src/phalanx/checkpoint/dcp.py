"""A phalanx checkpoint as a ``torch.distributed.checkpoint`` (DCP) folder, for tools that
read DCP (torchtitan, ``dcp.load`` into a model sharded any way, ``dcp_to_torch_save``).

phalanx writes its own checkpoints (one torch file per member under fsdp, see
docs/fsdp.md): DCP's save is a collective, which a peer lost during a background save would
fail or block. :func:`export_dcp` writes one afterwards, in one process, from any
checkpoint phalanx wrote (sharded or not): the model's state dict under ``"model"``, with
your model's keys, so ``dcp.load({"model": model.state_dict()}, checkpoint_id=folder)``
fills a model, whole or sharded with ``fully_shard`` (DCP cuts each rank's rows).

The optimizer's state is not exported: phalanx keeps it by parameter index, as
``optimizer.state_dict()`` does, and DCP's tools expect it by parameter name
(``get_optimizer_state_dict``), which only the model and optimizer that wrote it could map.
"""

from __future__ import annotations

import os
import shutil
import warnings

import torch

from phalanx.checkpoint.checkpointer import load_checkpoint
from phalanx.errors import CheckpointError


def export_dcp(source: str | os.PathLike[str], out: str | os.PathLike[str]) -> str:
    """Write the model of checkpoint ``source`` (a checkpoint file, any rank's file of a
    sharded one, or a ``run_dir`` for its newest that verifies) as a DCP folder ``out``
    (``.metadata`` and the data file), and return ``out``. The checkpoint is read whole in
    this process (a sharded one joined: the model and the optimizer's state). ``out`` must
    not exist, or be an empty folder; it appears whole or not at all (written beside it,
    then renamed; an export killed half-way leaves ``<out>.partial-<pid>``). Raises
    CheckpointError (PX120) naming what could not be read or written."""
    from torch.distributed.checkpoint import CheckpointException, FileSystemWriter, save

    target = os.path.abspath(os.fspath(out))
    if os.path.exists(target) and (not os.path.isdir(target) or os.listdir(target)):
        raise CheckpointError(
            f"{target}: exists and is not an empty folder; export into a new folder "
            "(nothing was written)"
        )
    state = load_checkpoint(source)  # (CheckpointError naming what does not verify)
    model = state.get("model")
    if not isinstance(model, dict) or not all(isinstance(v, torch.Tensor) for v in model.values()):
        raise CheckpointError(f"{os.fspath(source)}: holds no model state dict of tensors")
    partial = f"{target}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    try:
        with warnings.catch_warnings():  # (one process is what is meant here)
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            save({"model": model}, storage_writer=FileSystemWriter(partial), no_dist=True)
        os.replace(partial, target)  # (onto an empty folder too)
    except (OSError, CheckpointException) as exc:  # (DCP's write errors: the latter)
        raise CheckpointError(f"{target}: could not be written: {exc}") from exc
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return target
