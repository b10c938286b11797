"""Checkpoint file format and atomic, verified I/O.

A checkpoint file is what ``torch.save`` writes, and opens with plain
``torch.load(path, weights_only=True)``: only containers (dict, list, tuple), tensors,
numbers, strings and None are stored. Its SHA-256 and length are kept beside it, in the
directory's index (``checkpoints.json``, see checkpointer.py), so a truncated file ("truncated:
expected N bytes"), a damaged one ("checksum mismatch") and a foreign one ("not a phalanx
checkpoint") are told apart before unpickling anything. A file the index does not list (the
process died between the file's rename and the index's) is accepted when torch can open it.

Files of the first format (a ``PHALANX-CKPT-1`` header before torch's bytes, never released)
are refused with :class:`~phalanx.errors.CheckpointFormatError`.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import json
import os
import re
import tempfile
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from phalanx.errors import CheckpointError, CheckpointFormatError

OLD_MAGIC = b"PHALANX-CKPT-1\n"  # the first format's header (refused, see the module doc)
_ZIP_MAGIC = b"PK\x03\x04"  # torch.save's zip container
_NAME = re.compile(r"^ckpt-(\d{9,})\.pt$")
# fsdp: one file per rank of the world that wrote it (each member its own shards)
_SHARD = re.compile(r"^ckpt-(\d{9,})\.rank-(\d+)-of-(\d+)\.pt$")


@dataclass(frozen=True)
class Digest:
    """What the index records of a file: its SHA-256 (hex) and its length in bytes."""

    sha256: str
    size: int


def checkpoint_name(step: int) -> str:
    """The file name for a checkpoint at global step ``step``: ``ckpt-{step:09d}.pt``."""
    return f"ckpt-{step:09d}.pt"


def write_atomic(path: str | os.PathLike[str], payload: dict[str, Any]) -> Digest:
    """Write ``payload`` with ``torch.save`` to ``path`` so that ``path`` is either the old file
    or the complete new one, never a partial write: check that every leaf can be opened with
    ``weights_only=True`` (else :class:`~phalanx.errors.CheckpointError` naming where), serialize
    in memory, write a temp file in the same directory, fsync it, ``os.replace`` it onto
    ``path``, fsync the directory. If anything fails the temp file is removed, ``path`` is
    untouched and the error propagates. Returns the bytes' digest, for the index."""
    check_weights_only(payload)
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    body = buffer.getvalue()
    _replace_atomic(os.fspath(path), body)
    return Digest(hashlib.sha256(body).hexdigest(), len(body))


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes) -> None:
    """Atomically replace ``path`` with ``data`` (same guarantees as :func:`write_atomic`)."""
    _replace_atomic(os.fspath(path), data)


def _replace_atomic(path: str, data: bytes) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(directory)


def _fsync_dir(directory: str) -> None:
    if os.name != "posix":  # directories cannot be opened for fsync on Windows
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_verified(path: str | os.PathLike[str], expected: Digest | None = None) -> dict[str, Any]:
    """Read a checkpoint written by :func:`write_atomic` and return its payload (tensors on
    CPU), opened with ``torch.load(weights_only=True)``. With ``expected`` (from the index) the
    length and checksum are checked first. Raises :class:`~phalanx.errors.CheckpointError`
    naming the file and the reason: unreadable, "not a phalanx checkpoint", "truncated:
    expected N bytes ...", "checksum mismatch", or a payload that does not load to a dict;
    :class:`~phalanx.errors.CheckpointFormatError` for a file of the first format."""
    name = os.fspath(path)
    try:
        with open(name, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise CheckpointError(f"{name}: cannot read: {exc}") from exc
    _verify(name, data, expected)
    return _load_dict(name, io.BytesIO(data))


def _verify(name: str, data: bytes, expected: Digest | None) -> None:
    """Check the format, then length and checksum against ``expected`` when known."""
    head = data[: len(OLD_MAGIC)]
    _check_format(name, head)
    if expected is not None:
        _check_digest(name, len(data), lambda: hashlib.sha256(data).hexdigest(), expected)
    _check_torch_file(name, head, len(data))


def _check_format(name: str, head: bytes) -> None:
    """``head``: the file's first bytes (``len(OLD_MAGIC)`` of them when it has them)."""
    if head.startswith(OLD_MAGIC):
        raise CheckpointFormatError(
            f"{name} was written by an earlier phalanx build (format 1: a header before "
            "torch's bytes), which this version does not read; start a new run_dir, or delete "
            "the file to resume from the checkpoints beside it"
        )


def _check_torch_file(name: str, head: bytes, size: int) -> None:
    if not head.startswith(_ZIP_MAGIC):
        if size < len(_ZIP_MAGIC) and _ZIP_MAGIC.startswith(head):
            raise CheckpointError(f"{name}: truncated: {size} bytes")
        raise CheckpointError(f"{name}: not a phalanx checkpoint (not a torch.save file)")


def _check_digest(name: str, size: int, sha256: Callable[[], str], expected: Digest) -> None:
    if size < expected.size:
        raise CheckpointError(f"{name}: truncated: expected {expected.size} bytes, found {size}")
    if size > expected.size:
        raise CheckpointError(
            f"{name}: trailing data: expected {expected.size} bytes, found {size}"
        )
    if sha256() != expected.sha256:
        raise CheckpointError(f"{name}: checksum mismatch (file is damaged)")


def peek(path: str | os.PathLike[str], key: str, expected: Digest | None = None) -> Any:
    """``payload[key]`` of a checkpoint, verified as :func:`read_verified` does but without
    holding the file in memory (:func:`read_mapped`), so the tensors are never read. For
    checks in the caller's process before a run starts (the plan record)."""
    return read_mapped(path, expected).get(key)


def read_mapped(path: str | os.PathLike[str], expected: Digest | None = None) -> dict[str, Any]:
    """:func:`read_verified`'s payload, its tensors mapped from the file (``mmap=True``), not
    read: the checksum is computed in chunks, and only the bytes of what is then used are
    read."""
    name = os.fspath(path)
    try:
        size = os.path.getsize(name)
        with open(name, "rb") as f:
            head = f.read(len(OLD_MAGIC))
    except OSError as exc:
        raise CheckpointError(f"{name}: cannot read: {exc}") from exc
    _check_format(name, head)
    if expected is not None:
        _check_digest(name, size, lambda: _file_sha256(name), expected)
    _check_torch_file(name, head, size)
    return _load_dict(name, name, mmap=True)


def _file_sha256(name: str) -> str:
    digest = hashlib.sha256()
    with open(name, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def list_checkpoints(directory: str | os.PathLike[str]) -> list[tuple[str, int]]:
    """``(path, step)`` for each ``ckpt-{step:09d}.pt`` in ``directory``, and each sharded
    checkpoint whose every rank's file is there (named by its rank 0's file, see
    :func:`shard_name`), oldest step first. Temp files, other names and a sharded one that
    lacks a rank are ignored; a missing directory has none."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    folder = os.fspath(directory)
    found = [(os.path.join(folder, n), int(m.group(1))) for n in names if (m := _NAME.match(n))]
    ranks: dict[tuple[int, int], set[int]] = {}
    for n in names:
        if m := _SHARD.match(n):
            ranks.setdefault((int(m.group(1)), int(m.group(3))), set()).add(int(m.group(2)))
    for (step, world), have in ranks.items():
        if have == set(range(world)):
            found.append((os.path.join(folder, shard_name(step, 0, world)), step))
    return sorted(found, key=lambda item: (item[1], item[0]))


def shard_name(step: int, rank: int, world: int) -> str:
    """The file of rank ``rank`` of a sharded checkpoint at ``step`` by ``world`` members."""
    return f"ckpt-{step:09d}.rank-{rank}-of-{world}.pt"


def digest_file(path: str) -> str:
    """Where a shard file's digest is kept (each rank writes its own, beside its file)."""
    return path[: -len(".pt")] + ".sha256.json"


def shard_files(path: str) -> list[str] | None:
    """Every rank's file of the sharded checkpoint that ``path`` names (None: ``path`` is
    a checkpoint of one file)."""
    m = _SHARD.match(os.path.basename(path))
    if m is None:
        return None
    folder, step, world = os.path.dirname(path), int(m.group(1)), int(m.group(3))
    return [os.path.join(folder, shard_name(step, r, world)) for r in range(world)]


def write_shard(path: str, payload: dict[str, Any]) -> Digest:
    """A rank's file of a sharded checkpoint, then its digest beside it (both atomic: a
    rank's file is there only once it is whole)."""
    with contextlib.suppress(FileNotFoundError):  # (an earlier file's digest never pairs
        os.remove(digest_file(path))  # with this one: a file without one loads unchecked)
    digest = write_atomic(path, payload)
    record = {"sha256": digest.sha256, "bytes": digest.size}
    write_bytes_atomic(digest_file(path), json.dumps(record).encode("utf-8") + b"\n")
    return digest


def _shard_digest(path: str) -> Digest | None:
    try:
        with open(digest_file(path), encoding="utf-8") as fh:
            record = json.load(fh)
        return Digest(str(record["sha256"]), int(record["bytes"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def read_checkpoint(
    path: str | os.PathLike[str],
    expected: Digest | None = None,
    member: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """:func:`read_verified` for a checkpoint of one file; for a sharded one (``path`` is a
    rank's file) every rank's file, each checked against its own digest, joined into the
    whole state (:func:`phalanx.snapshot.shards.whole`), or, with ``member`` (``(world,
    rank)``), cut to the rows that member takes (:func:`phalanx.snapshot.shards.part`): the
    files are then mapped, not read, so a member's memory holds its rows, not the model. A
    missing or damaged rank's file raises CheckpointError naming it."""
    name = os.fspath(path)
    files = shard_files(name)
    if files is None:
        return read_verified(name, expected)
    from phalanx.snapshot.shards import part, whole

    states = []
    for rank, file in enumerate(files):
        if not os.path.exists(file):
            raise CheckpointError(f"{file}: missing (a rank's shard of {os.path.basename(name)})")
        if member is None:
            state = read_verified(file, _shard_digest(file))
        else:
            state = read_mapped(file, _shard_digest(file))
        record = state.get("phalanx") or {}
        said = (record.get("rank"), record.get("world"))
        if said != (rank, len(files)):
            raise CheckpointError(f"{file}: its record says rank {said[0]} of {said[1]}")
        states.append(state)
    steps = {s["phalanx"].get("step") for s in states}
    if len(steps) > 1:
        raise CheckpointError(f"{name}: its ranks' files are of different steps {sorted(steps)}")
    if member is None:
        return whole(states)
    try:
        return part(states, *member)
    except ValueError as exc:
        raise CheckpointError(f"{name}: {exc}") from exc


def stale_shards(directory: str | os.PathLike[str], before: int) -> list[str]:
    """The files of sharded checkpoints older than step ``before`` that lack a rank (a run
    that fell while its members wrote one): they will never be read, and retention, which
    sees only whole checkpoints, would never delete them."""
    folder = os.fspath(directory)
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return []
    listed = {os.path.basename(p) for p, _ in list_checkpoints(folder)}
    whole_sets = {tuple(shard_files(os.path.join(folder, n)) or []) for n in listed}
    kept = {os.path.basename(f) for files in whole_sets for f in files}
    stale = []
    for n in names:
        m = _SHARD.match(n)
        if m and int(m.group(1)) < before and n not in kept:
            stale += [os.path.join(folder, n), digest_file(os.path.join(folder, n))]
    return stale


def remove_checkpoint(path: str) -> None:
    """Delete a checkpoint: its file, or every rank's file and digest of a sharded one."""
    files = shard_files(path)
    doomed = [path] if files is None else [f for file in files for f in (file, digest_file(file))]
    for file in doomed:
        with contextlib.suppress(FileNotFoundError):
            os.remove(file)


def to_cpu(obj: Any) -> Any:
    """A deep copy of a nested state (dicts, lists, tuples, tensors) with every tensor cloned
    to CPU, so later in-place updates to the live state do not change the snapshot. Mapping
    and sequence types are kept (dict subclasses such as OrderedDict, named tuples); other
    leaves are ``copy.deepcopy``-ed, numpy scalars become Python numbers."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        if type(obj) is dict:
            return {k: to_cpu(v) for k, v in obj.items()}
        out = copy.copy(obj)  # keeps the subclass and e.g. a defaultdict's factory
        out.clear()
        out.update((k, to_cpu(v)) for k, v in obj.items())
        return out
    if isinstance(obj, list):
        return [to_cpu(v) for v in obj]
    if isinstance(obj, tuple):
        values = [to_cpu(v) for v in obj]
        return type(obj)(*values) if hasattr(obj, "_fields") else type(obj)(values)
    if isinstance(obj, np.generic):  # a numpy scalar (a metric's value, say): plain Python
        return obj.item()
    if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
        return obj
    return copy.deepcopy(obj)


_PLAIN = frozenset(
    {bool, int, float, complex, str, bytes, bytearray, type(None), torch.dtype, torch.device}
)
_MAPPINGS = (dict, OrderedDict, Counter)  # (Counter: MultiStepLR's milestones)
_SEQUENCES = (list, tuple, set, torch.Size)


def check_weights_only(obj: Any, where: str = "checkpoint") -> None:
    """Raise :class:`~phalanx.errors.CheckpointError` naming the first value in ``obj`` that
    ``torch.load(weights_only=True)`` would refuse (anything but dicts, OrderedDicts, Counters,
    lists, tuples, sets, tensors, numbers, strings, bytes and None), so that a checkpoint
    always opens with plain torch, and the error names the key instead of failing on load."""
    if type(obj) in _PLAIN or isinstance(obj, torch.Tensor):
        return
    if type(obj) in _MAPPINGS:
        for key, value in obj.items():
            check_weights_only(key, f"{where} (a key)")
            check_weights_only(value, f"{where}[{key!r}]")
        return
    if type(obj) in _SEQUENCES:
        for i, value in enumerate(obj):
            check_weights_only(value, f"{where}[{i}]")
        return
    raise CheckpointError(
        f"{where} is a {type(obj).__module__}.{type(obj).__qualname__}, which "
        "torch.load(weights_only=True) cannot open; keep state_dict() values to tensors, "
        "numbers, strings, None and dicts, lists or tuples of them"
    )


def _load_dict(name: str, source: Any, mmap: bool = False) -> dict[str, Any]:
    """``torch.load(source, weights_only=True)`` of checkpoint ``name``: a dict, or a
    CheckpointError naming the file and why it does not load."""
    try:
        payload = torch.load(source, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as exc:
        detail = " ".join(str(exc).split())[:300]
        raise CheckpointError(
            f"{name}: payload does not load: {type(exc).__name__}: {detail}"
        ) from exc
    if not isinstance(payload, dict):
        raise CheckpointError(f"{name}: payload is a {type(payload).__name__}, not a dict")
    return payload
