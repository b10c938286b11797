"""A state (a loop's snapshot) as data that cannot run code plus its tensors: what the
ddp hand-over sends to the members behind and what a snapshot keeps in shared memory.
:mod:`.tree` splits a state into a skeleton and its tensors, :mod:`.wire` writes a skeleton
as JSON with typed nodes (never a pickle)."""

from phalanx.skeleton.tree import fill_tensors, slot_of, split_tensors, tensor_slots
from phalanx.skeleton.wire import TensorSlot, WireError, decode, encode

__all__ = [
    "TensorSlot",
    "WireError",
    "decode",
    "encode",
    "fill_tensors",
    "slot_of",
    "split_tensors",
    "tensor_slots",
]
