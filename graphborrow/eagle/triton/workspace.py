"""A step's temporaries as one allocation, carved into typed slots.

A fused step needs a dozen small arrays (row statistics, per-slice partial results,
search state). One allocation per step instead of one per array saves host time (each
CUDA allocation is a few microseconds of Python and allocator work) and keeps the step's
allocation sequence to a single request whose size depends on the shape alone, which is
what the capacity planner replays. A :class:`Layout` is computed once per shape, and a
workspace's slots are typed views of its buffer, made once per buffer.
"""

from __future__ import annotations

from collections import namedtuple
from typing import NamedTuple

import torch

__all__ = ["SLOT_ALIGN", "Layout", "Slot"]

SLOT_ALIGN = 128  # bytes: every slot starts on a cache line (and a Triton-aligned address)


class Slot(NamedTuple):
    """One array of the workspace: its byte offset, dtype and shape."""

    offset: int
    dtype: torch.dtype
    shape: tuple


class Layout:
    """Named slots packed into one byte buffer, each ``SLOT_ALIGN``-aligned.

    Args:
        slots: ``(name, dtype, shape)`` in order; a slot of no elements takes no room.
    """

    __slots__ = ("names", "slots", "nbytes", "record")

    def __init__(self, slots):
        self.names: tuple = tuple(name for name, _, _ in slots)
        self.record = namedtuple("Workspace", self.names)  # one field per slot
        self.slots: dict = {}
        offset = 0
        for name, dtype, shape in slots:
            shape = tuple(int(n) for n in shape)
            self.slots[name] = Slot(offset, dtype, shape)
            offset += -(-_nbytes(dtype, shape) // SLOT_ALIGN) * SLOT_ALIGN
        self.nbytes = max(offset, SLOT_ALIGN)

    def allocate(self, like: torch.Tensor) -> torch.Tensor:
        """The workspace: ``nbytes`` uninitialised bytes on ``like``'s device."""
        return like.new_empty(self.nbytes, dtype=torch.uint8)

    def views(self, buffer: torch.Tensor):
        """Every slot as a typed tensor over ``buffer``, as a record with one field per slot."""
        return self.record._make(self.view(buffer, name) for name in self.names)

    def view(self, buffer: torch.Tensor, name: str) -> torch.Tensor:
        """One slot as a typed tensor over ``buffer`` (contiguous, any dtype)."""
        offset, dtype, shape = self.slots[name]
        return buffer.view(torch.uint8)[offset:offset + _nbytes(dtype, shape)].view(dtype).view(shape)


def _nbytes(dtype: torch.dtype, shape: tuple) -> int:
    count = 1
    for n in shape:
        count *= n
    return count * dtype.itemsize
