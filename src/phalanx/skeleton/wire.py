"""The hand-over's skeleton as data that cannot run code: JSON with typed nodes.

A skeleton (see :func:`.handover.split_tensors`) is what a checkpoint holds, with each
tensor swapped for a :class:`TensorSlot`: ``None``, bools, ints, floats (NaN and infinities
too), strings, lists, tuples, dicts with keys of those types (an optimizer's state has int
keys; they come back as ints), ``OrderedDict`` with a module state dict's ``_metadata``,
``Counter`` (MultiStepLR's milestones), sets, bytes, complex numbers, ``torch.Size``,
``torch.dtype``, ``torch.device``: what a checkpoint may hold
(:func:`phalanx.checkpoint.io.check_weights_only`). Anything else is refused loudly on the
sending side (:class:`WireError`), and a payload that is not such a document (a pickle, say)
is refused on the receiving one: nothing received is ever unpickled.

Every container is a tagged JSON object, so a plain JSON value never stands for more than
itself: ``{"@": "dict", "k": [...], "v": [...]}``, ``{"@": "tuple", "v": [...]}``, ...
"""

from __future__ import annotations

import base64
import json
import math
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from phalanx.torchprivate import set_state_metadata, state_metadata

FORMAT = "phalanx.skeleton/1"

# The dtypes a tensor slot or a dtype value may name (by torch's own name, "float32").
_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)
}


class WireError(ValueError):
    """A value the skeleton format cannot carry (sending), or a payload that is not a
    skeleton document (receiving)."""


@dataclass(frozen=True)
class TensorSlot:
    """Where a tensor was in a state being handed over: its index among the tensors (the
    order they travel in), shape, type and device."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: str


def encode(skeleton: Any) -> bytes:
    """``skeleton`` as UTF-8 JSON; :class:`WireError` names the first value it cannot carry
    and where it is."""
    return json.dumps({"format": FORMAT, "value": _enc(skeleton, "")}).encode()


def decode(payload: bytes) -> Any:
    """The skeleton :func:`encode` made; :class:`WireError` for anything else."""
    try:
        doc = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WireError(f"the hand-over payload is not a skeleton document: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or "value" not in doc:
        raise WireError("the hand-over payload is not a skeleton document (format)")
    return _dec(doc["value"])


_PLAIN = frozenset({bool, str, int, type(None)})  # (JSON's own: each is itself on the wire)


def _enc(value: Any, where: str) -> Any:
    if value is None or type(value) in (bool, str, int):  # (not an IntEnum, a str subclass)
        return value
    if type(value) is float:
        return value if math.isfinite(value) else {"@": "float", "v": repr(value)}
    torch_value = _enc_torch(value)
    if torch_value is not None:
        return torch_value
    if type(value) in (list, tuple, set):
        if set(map(type, value)) <= _PLAIN:  # (at once: Python's RNG state is 625 ints)
            items = list(value)
        else:
            items = [_enc(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return items if type(value) is list else {"@": type(value).__name__, "v": items}
    if type(value) in (dict, Counter) or isinstance(value, OrderedDict):  # (module states)
        return _enc_dict(value, where)
    if type(value) in (bytes, bytearray):
        return {"@": type(value).__name__, "v": base64.b64encode(value).decode()}
    if type(value) is complex:
        return {"@": "complex", "v": [_enc(value.real, where), _enc(value.imag, where)]}
    _refuse(value, where)


def _enc_torch(value: Any) -> dict[str, Any] | None:
    if isinstance(value, TensorSlot):
        return {
            "@": "tensor",
            "i": value.index,
            "shape": list(value.shape),
            "dtype": _dtype_name(value.dtype),
            "device": value.device,
        }
    if isinstance(value, torch.Size):
        return {"@": "size", "v": list(value)}
    if isinstance(value, torch.dtype):
        return {"@": "dtype", "v": _dtype_name(value)}
    if isinstance(value, torch.device):
        return {"@": "device", "v": str(value)}
    return None


def _enc_dict(value: dict[Any, Any], where: str) -> dict[str, Any]:
    keys = list(value.keys())
    doc: dict[str, Any] = {
        "@": _MAPPING_TAGS.get(type(value), "odict"),
        "k": [_key(k, where) for k in keys],
        "v": [_enc(value[k], f"{where}[{k!r}]") for k in keys],
    }
    metadata = state_metadata(value)
    if metadata is not None:
        doc["meta"] = _enc(metadata, f"{where}._metadata")
    return doc


_MAPPING_TAGS: dict[type, str] = {dict: "dict", Counter: "counter"}
_MAPPINGS: dict[str, Callable[[list[tuple[Any, Any]]], dict[Any, Any]]] = {
    "dict": dict,
    "odict": OrderedDict,
    "counter": lambda pairs: Counter(dict(pairs)),
}


def _key(key: Any, where: str) -> Any:
    if key is None or type(key) in (bool, int, float, str, bytes, complex, tuple):
        return _enc(key, where)
    _refuse(key, f"{where} (a key)")


def _refuse(value: Any, where: str) -> Any:
    raise WireError(
        f"the hand-over cannot carry a {type(value).__module__}.{type(value).__qualname__} "
        f"(at {where or 'the top'}): a state dict may hold what a checkpoint may: tensors, "
        "numbers, strings, bytes, None, lists, tuples, sets, dicts, torch.Size, dtypes and "
        "devices"
    )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dec(doc: Any) -> Any:
    if doc is None or isinstance(doc, bool | int | float | str):
        return doc
    if isinstance(doc, list):
        return [_dec(v) for v in doc]
    if not isinstance(doc, dict):
        raise WireError(f"unexpected JSON value {type(doc).__name__} in a skeleton")
    tag = doc.get("@")
    node = _NODES.get(tag) if isinstance(tag, str) else None
    if node is None:
        raise WireError(f"unknown node {tag!r} in a skeleton")
    try:
        return node(doc)
    except (KeyError, TypeError, RuntimeError) as exc:
        raise WireError(f"a malformed {tag!r} node in a skeleton: {exc}") from None


def _dec_dict(doc: dict[str, Any]) -> dict[Any, Any]:
    keys, values = _list(doc["k"]), _list(doc["v"])
    if len(keys) != len(values):
        raise WireError("a dict's keys and values differ in number")
    pairs = [(_hashable(_dec(k)), _dec(v)) for k, v in zip(keys, values, strict=True)]
    out = _MAPPINGS[doc["@"]](pairs)
    if "meta" in doc:
        set_state_metadata(out, _dec(doc["meta"]))
    return out


def _dec_float(doc: dict[str, Any]) -> float:
    text = _str(doc["v"])
    if text not in ("nan", "inf", "-inf"):
        raise WireError(f"not a special float: {text!r}")
    return float(text)


_NODES: dict[str, Callable[[dict[str, Any]], Any]] = {
    "tuple": lambda doc: tuple(_dec(v) for v in _list(doc["v"])),
    "set": lambda doc: {_hashable(_dec(v)) for v in _list(doc["v"])},
    "dict": _dec_dict,
    "odict": _dec_dict,
    "counter": _dec_dict,
    "bytes": lambda doc: base64.b64decode(_str(doc["v"]), validate=True),
    "bytearray": lambda doc: bytearray(base64.b64decode(_str(doc["v"]), validate=True)),
    "complex": lambda doc: complex(_number(doc["v"][0]), _number(doc["v"][1])),
    "tensor": lambda doc: TensorSlot(
        _int(doc["i"]),
        tuple(_int(s) for s in _list(doc["shape"])),
        _dtype(doc["dtype"]),
        _str(doc["device"]),
    ),
    "size": lambda doc: torch.Size([_int(s) for s in _list(doc["v"])]),
    "dtype": lambda doc: _dtype(doc["v"]),
    "device": lambda doc: torch.device(_str(doc["v"])),
    "float": _dec_float,
}


def _list(v: Any) -> list[Any]:
    if not isinstance(v, list):
        raise WireError("expected a list in a skeleton node")
    return v


def _int(v: Any) -> int:
    if type(v) is not int:
        raise WireError("expected an int in a skeleton node")
    return v


def _number(v: Any) -> float:
    value = _dec(v)
    if type(value) not in (int, float):
        raise WireError("expected a number in a skeleton node")
    return float(value)


def _str(v: Any) -> str:
    if not isinstance(v, str):
        raise WireError("expected a string in a skeleton node")
    return v


def _dtype(name: Any) -> torch.dtype:
    dtype = _DTYPES.get(_str(name))
    if dtype is None:
        raise WireError(f"unknown dtype {name!r} in a skeleton")
    return dtype


def _hashable(key: Any) -> Any:
    try:
        hash(key)
    except TypeError:
        raise WireError("an unhashable dict key in a skeleton") from None
    return key
