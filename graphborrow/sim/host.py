"""Host memory and the simulated device: copies both ways, pinned memory, and what a capture refuses.

CUDA's rules, as recorded on the H200 (torch 2.11, ``data/fuzz``: the ``rule_*`` programs):

* a copy between the device and *pageable* host memory inside a graph capture is refused
  before anything is enqueued, with torch's ``RuntimeError`` (:data:`PAGEABLE_IN_CAPTURE`):
  ``torch.tensor(data, device="cuda")``, ``.to("cuda")`` / ``.cuda()`` of an ordinary CPU
  tensor, ``copy_`` from one, ``.cpu()``, ``.tolist()``. The device block of the destination
  is allocated first and freed as the error unwinds; the capture goes on;
* anything that makes the host wait inside a capture (``.item()``, ``bool()``, printing,
  ``nonzero``, boolean indexing, ``masked_select``, a blocking copy from pinned memory,
  ``synchronize``) fails with ``torch.AcceleratorError`` (:data:`NOT_PERMITTED`) and
  *invalidates* the capture: leaving the ``torch.cuda.graph`` block then fails with
  :data:`CAPTURE_INVALIDATED`, raised while handling the first error;
* a non-blocking copy between the device and *pinned* memory is captured (a replay copies
  again from the same host bytes), as are device-side factories, CPU scalar operands,
  ``pin_memory()`` and ``empty_cache()``.

Outside a capture every copy is allowed. ``pin_memory()`` / ``pin_memory=True`` give CPU
tensors that :func:`is_pinned` recognises (the CPU build has no page-locked memory).
"""

from __future__ import annotations

import weakref

import torch

from .torch_function import torch_functions_off
from .values import layout_error

__all__ = ["CAPTURE_INVALIDATED", "DEVICES_DIFFER", "EVENT_IN_CAPTURE", "NOT_PERMITTED", "PAGEABLE_IN_CAPTURE",
           "check_operands", "fails_in_capture", "from_python_data", "is_pinned", "not_permitted", "pin", "refuse_pageable"]

PAGEABLE_IN_CAPTURE = ("Cannot copy between CPU and CUDA tensors during CUDA graph capture unless the CPU tensor is "
                       "pinned. Please use tensor.pin_memory() or allocate the tensor with pin_memory=True.")
NOT_PERMITTED = "CUDA error: operation not permitted when stream is capturing"
EVENT_IN_CAPTURE = "CUDA error: operation not permitted on an event last recorded in a capturing stream"
CAPTURE_INVALIDATED = "CUDA error: operation failed due to a previous error during capture"
DEVICES_DIFFER = "Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!"

_aten = torch.ops.aten
_PINNED: "weakref.WeakSet" = weakref.WeakSet()  # storages of pinned host tensors
# ops that make the host wait for the device (their output's size, or a value, comes back)
_SYNCING = {
    _aten._local_scalar_dense.default, _aten.nonzero.default, _aten.masked_select.default, _aten.equal.default,
    _aten.is_nonzero.default, _aten._unique2.default, _aten.unique_dim.default, _aten.unique_consecutive.default,
    _aten.repeat_interleave.Tensor,
}
# ops that accept host tensors next to device tensors: index tensors (CUDA moves them), copies
_TAKES_HOST_TENSORS = {_aten.index.Tensor, _aten.index_put_.default, _aten.index_put.default,
                       _aten._index_put_impl_.default, _aten.copy_.default}


def pin(t: torch.Tensor) -> torch.Tensor:
    """``t.pin_memory()``: a copy in (simulated) page-locked host memory."""
    if t.device.type != "cpu":
        raise RuntimeError(f"cannot pin '{t.type()}' only dense CPU tensors can be pinned")
    with torch_functions_off():
        pinned = t.clone(memory_format=torch.contiguous_format) if not t.is_contiguous() else t.clone()
    _PINNED.add(pinned.untyped_storage())
    return pinned


def mark_pinned(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor just made with ``pin_memory=True``: remember it as pinned."""
    _PINNED.add(t.untyped_storage())
    return t


def is_pinned(t: torch.Tensor) -> bool:
    """Whether a plain CPU tensor lives in memory that ``pin_memory`` gave (views included)."""
    return t.device.type == "cpu" and t.untyped_storage() in _PINNED


def refuse_pageable() -> RuntimeError:
    """torch's error for a copy between the device and pageable memory inside a capture."""
    return RuntimeError(PAGEABLE_IN_CAPTURE)


def from_python_data(backend, plain: torch.Tensor):
    """``torch.tensor(data, device="cuda")``: the device block, then a copy from pageable memory
    (refused inside a capture, the block freed as the refusal unwinds, as on CUDA)."""
    placed = backend.from_host(plain)
    if backend.capture_for_current_stream() is not None and plain.numel():  # nothing to copy: no copy
        del placed
        raise refuse_pageable()
    return placed


def not_permitted(backend, message: str = NOT_PERMITTED) -> torch.AcceleratorError:
    """The error of a host wait inside a capture; the capture it happened in is invalidated."""
    graph = backend.capture_for_current_stream()
    if graph is not None:
        graph.invalidate()
    return torch.AcceleratorError(message)


def fails_in_capture(backend, message: str) -> RuntimeError:
    """An error a library raises when it needs fresh device memory inside a capture (cuDNN building
    an execution plan); the capture it happened in is invalidated, as CUDA does."""
    graph = backend.capture_for_current_stream()
    if graph is not None:
        graph.invalidate()
    return RuntimeError(message)


def _has_bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


def check_operands(func, args, kwargs, backend, capturing: bool, sim_type) -> None:
    """Refuse what CUDA refuses: host tensors as operands, and host waits inside a capture.

    Args:
        func: the aten op about to run.
        args, kwargs: its arguments (simulated tensors and anything else).
        backend: the simulated device.
        capturing: whether the current stream is capturing a graph.
        sim_type: the simulated tensor class (plain tensors are host tensors).

    Raises:
        RuntimeError: a host tensor of one or more dimensions next to device tensors.
        torch.AcceleratorError: a host wait inside a capture (which it invalidates).
    """
    if capturing and (func in _SYNCING or (func is _aten.index.Tensor and _has_bool_index(args))):
        raise not_permitted(backend)
    if func in _TAKES_HOST_TENSORS:
        return

    def host_operand(x) -> bool:
        if isinstance(x, torch.Tensor):
            return not isinstance(x, sim_type) and x.dim() > 0
        if isinstance(x, (list, tuple)):
            return any(host_operand(v) for v in x)
        return False

    if host_operand(args) or (kwargs and host_operand(list(kwargs.values()))):
        raise RuntimeError(DEVICES_DIFFER)


def to_host(t, non_blocking: bool = False, into: torch.Tensor | None = None) -> torch.Tensor:
    """Copy a simulated tensor to the host: ``.cpu()``, ``.tolist()``, ``host.copy_(t)``.

    Args:
        t: the simulated tensor.
        non_blocking: the copy does not wait (allowed in a capture into pinned memory).
        into: the host tensor to copy into (None: a new pageable one).

    Returns:
        The host tensor with ``t``'s values.

    Raises:
        RuntimeError: inside a capture, into pageable memory (torch's message).
        torch.AcceleratorError: inside a capture, a blocking copy into pinned memory.
        SimLayoutOnlyError: ``t`` has no values (a large tensor on a layout-only device).
    """
    backend = t.sim_backend
    if backend.capture_for_current_stream() is not None:
        if into is None or not is_pinned(into):
            raise refuse_pageable()
        if not non_blocking:
            raise not_permitted(backend)
    inner = t.sim_inner
    if inner.is_meta or (not backend.backed and t.sim_storage is not None and not t.sim_storage.values):
        origin = t.sim_storage.origin if t.sim_storage is not None else None
        raise layout_error("copying a tensor to the host (.cpu(), .tolist(), printing, numpy)",
                           None if origin is None else str(origin))
    with torch_functions_off():
        if into is None:
            return inner.clone()
        into.copy_(inner)
        capture = backend.capture_for_current_stream()
        if capture is not None:  # a replay copies again into the same pinned bytes
            capture.record_op(torch.Tensor.copy_, (into, inner), {}, [])
        return into


def check_host_to_device(backend, host: torch.Tensor, non_blocking: bool) -> None:
    """Refuse a copy from ``host`` inside a capture unless it is pinned and non-blocking.

    CUDA allocates the destination block first: callers allocate it, call this, and drop it in
    an ``except`` clause that names no exception (a frame of the traceback that held the error
    would keep the failing program's tensors alive until the garbage collector runs).

    Raises:
        RuntimeError: a pageable source inside a capture (torch's message).
        torch.AcceleratorError: a blocking copy from pinned memory inside a capture.
    """
    if backend.capture_for_current_stream() is None or host.numel() == 0:  # an empty copy copies nothing
        return
    if not is_pinned(host):
        raise refuse_pageable()
    if not non_blocking:
        raise not_permitted(backend)
