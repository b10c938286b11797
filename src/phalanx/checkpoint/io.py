"""Checkpoint file format and atomic, verified I/O.

A checkpoint file is::

    b"PHALANX-CKPT-1\\n"                      magic line
    b"<sha256 hex of payload> <payload length>\\n"   header line
    <payload: torch.save bytes>

so a truncated file ("truncated: expected N bytes"), a damaged one ("checksum mismatch") and a
foreign one ("not a phalanx checkpoint") are told apart before unpickling anything.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import os
import re
import tempfile
from typing import Any

import torch

from phalanx.errors import CheckpointError

MAGIC = b"PHALANX-CKPT-1\n"
_MAX_HEADER = 128  # 64 hex digits + a space + a length + a newline, with room to spare
_NAME = re.compile(r"^ckpt-(\d{9,})\.pt$")


def checkpoint_name(step: int) -> str:
    """The file name for a checkpoint at global step ``step``: ``ckpt-{step:09d}.pt``."""
    return f"ckpt-{step:09d}.pt"


def write_atomic(path: str | os.PathLike[str], payload: dict[str, Any]) -> None:
    """Write ``payload`` to ``path`` so that ``path`` is either the old file or the complete new
    one, never a partial write: serialize in memory, write a temp file in the same directory,
    fsync it, ``os.replace`` it onto ``path``, fsync the directory. If anything fails (e.g. the
    payload cannot be pickled) the temp file is removed, ``path`` is untouched and the error
    propagates."""
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    body = buffer.getvalue()
    header = f"{hashlib.sha256(body).hexdigest()} {len(body)}\n".encode("ascii")
    _replace_atomic(os.fspath(path), MAGIC + header + body)


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


def read_verified(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a checkpoint written by :func:`write_atomic` and return its payload (tensors on
    CPU). Raises :class:`~phalanx.errors.CheckpointError` naming the file and the reason:
    unreadable, "not a phalanx checkpoint", "truncated: expected N bytes ...",
    "checksum mismatch", or a payload that does not unpickle to a dict.

    ``weights_only=False``: the payload holds Python ints/lists/dicts and optimizer state, and
    the file is our own, verified against its checksum before anything is unpickled. Never
    point this at files from an untrusted source."""
    name = os.fspath(path)
    try:
        with open(name, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise CheckpointError(f"{name}: cannot read: {exc}") from exc
    body = _verify(name, data)
    try:
        payload = torch.load(io.BytesIO(body), map_location="cpu", weights_only=False)
    except Exception as exc:
        raise CheckpointError(f"{name}: payload does not load: {exc!r}") from exc
    if not isinstance(payload, dict):
        raise CheckpointError(f"{name}: payload is a {type(payload).__name__}, not a dict")
    return payload


def _verify(name: str, data: bytes) -> bytes:
    """The payload bytes of ``data`` after checking magic, length and checksum."""
    if not data.startswith(MAGIC):
        if MAGIC.startswith(data):
            raise CheckpointError(f"{name}: truncated: {len(data)} bytes, header incomplete")
        raise CheckpointError(f"{name}: not a phalanx checkpoint (bad magic)")
    end = data.find(b"\n", len(MAGIC), len(MAGIC) + _MAX_HEADER)
    if end < 0:
        if len(data) < len(MAGIC) + _MAX_HEADER:
            raise CheckpointError(f"{name}: truncated: {len(data)} bytes, header incomplete")
        raise CheckpointError(f"{name}: not a phalanx checkpoint (bad header)")
    try:
        digest, length_text = data[len(MAGIC) : end].decode("ascii").split(" ")
        length = int(length_text)
    except ValueError as exc:
        raise CheckpointError(f"{name}: not a phalanx checkpoint (bad header)") from exc
    body = data[end + 1 :]
    if len(body) < length:
        raise CheckpointError(
            f"{name}: truncated: expected {length} bytes of payload, found {len(body)}"
        )
    if len(body) > length:
        raise CheckpointError(
            f"{name}: trailing data: expected {length} bytes of payload, found {len(body)}"
        )
    if hashlib.sha256(body).hexdigest() != digest:
        raise CheckpointError(f"{name}: checksum mismatch (file is damaged)")
    return body


def list_checkpoints(directory: str | os.PathLike[str]) -> list[tuple[str, int]]:
    """``(path, step)`` for each ``ckpt-{step:09d}.pt`` in ``directory``, oldest step first.
    Temp files and other names are ignored; a missing directory has none."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    found = [
        (os.path.join(os.fspath(directory), n), int(m.group(1)))
        for n in names
        if (m := _NAME.match(n))
    ]
    return sorted(found, key=lambda item: (item[1], item[0]))


def to_cpu(obj: Any) -> Any:
    """A deep copy of a nested state (dicts, lists, tuples, tensors) with every tensor cloned
    to CPU, so later in-place updates to the live state do not change the snapshot. Mapping
    and sequence types are kept (dict subclasses such as OrderedDict, named tuples); other
    leaves are ``copy.deepcopy``-ed."""
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
    if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
        return obj
    return copy.deepcopy(obj)
