"""Which tensors of a layout-only device carry values, and what reading one that does not says.

A layout-only device (``SimBackend(backed=False)``) keeps exact shapes, strides and allocator
state and no bytes. Model code still reads some values: transformers checks position ids for
packed sequences and attention masks for padding, a cache asks its length, a sampler its
token ids. Those tensors are small, so the layout-only device keeps them as real CPU tensors
beside the layout, computed by the CPU kernels whenever every input of an op has values:

* integer and boolean tensors of at most :data:`INT_VALUES_LIMIT` bytes (positions, masks,
  token ids, indices, counters);
* any other tensor of at most :data:`FLOAT_VALUES_LIMIT` bytes (scalars, rotary frequencies,
  norms' epsilons, a small batch's cosines).

Everything else (weights, activations, logits) stays shape-only. An op with one shape-only
input gives shape-only outputs; an in-place op that writes shape-only data into a tensor with
values turns its storage shape-only. Reading a shape-only tensor raises
:class:`SimLayoutOnlyError` naming the operation, the line of model code that asked and the
op that made the tensor.
"""

from __future__ import annotations

import os
import sys

import torch

__all__ = ["FLOAT_VALUES_LIMIT", "INT_VALUES_LIMIT", "SimLayoutOnlyError", "keeps_values", "layout_error",
           "meta_like", "user_line"]

INT_VALUES_LIMIT = 16 * 2**20  # integer and boolean tensors up to this many bytes keep values
FLOAT_VALUES_LIMIT = 64 * 2**10  # any other tensor up to this many bytes keeps values

_OWN = (os.sep + os.path.join("torch", ""), os.path.join("graphborrow", "sim", ""), os.sep + "contextlib.py",
        os.sep + "functools.py", "<frozen ")


class SimLayoutOnlyError(RuntimeError):
    """A value was asked of a tensor on a layout-only (``backed=False``) device that has none."""


def keeps_values(t: torch.Tensor) -> bool:
    """Whether an op's output ``t`` (a CPU tensor) keeps its values on a layout-only device."""
    nbytes = t.untyped_storage().nbytes()
    if t.dtype.is_floating_point or t.dtype.is_complex:
        return nbytes <= FLOAT_VALUES_LIMIT
    return nbytes <= INT_VALUES_LIMIT


def meta_like(t: torch.Tensor) -> torch.Tensor:
    """A META tensor with ``t``'s layout: same sizes, strides, offset and storage bytes."""
    nbytes = t.untyped_storage().nbytes()
    base = torch.empty(nbytes, dtype=torch.uint8, device="meta")
    return torch.empty(0, dtype=t.dtype, device="meta").set_(base.untyped_storage(), t.storage_offset(), t.size(),
                                                             t.stride())


def user_line() -> str:
    """The innermost line of code outside torch and the simulator, and the script line under it."""
    frame = sys._getframe(1)
    found = []
    while frame is not None:
        name = frame.f_code.co_filename
        if not any(part in name for part in _OWN):
            found.append(f"{os.path.basename(name)}:{frame.f_lineno} in {frame.f_code.co_name}")
        frame = frame.f_back
    if not found:
        return "no Python frame outside torch"
    if len(found) == 1:
        return found[0]
    return f"{found[0]} (called from {found[-1]})"


def layout_error(what: str, origin: str | None = None) -> SimLayoutOnlyError:
    """The error for reading ``what`` of a shape-only tensor."""
    made = f", made by {origin}" if origin else ""
    return SimLayoutOnlyError(
        f"{what} at {user_line()} needs the values of a tensor that is shape-only on this layout-only simulated "
        f"device (backed=False){made}. Only small tensors keep values (integer and bool up to "
        f"{INT_VALUES_LIMIT // 2**20} MiB, others up to {FLOAT_VALUES_LIMIT // 2**10} KiB; see "
        "graphborrow.sim.values); create the backend with backed=True to compute everything."
    )
