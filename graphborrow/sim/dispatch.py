"""The generic path of an aten op on simulated tensors: run it on the inner tensors, then give
each output its home, as the CUDA caching allocator would.

An output that aliases an input (views, in-place ops) shares the input's block; a fresh
output gets a new block on the current simulated stream, routed through captures and
``use_mem_pool`` like torch. On a layout-only device an op runs on CPU tensors when every
input has values and on META twins otherwise (:mod:`graphborrow.sim.values`). Inside a
capture the op is recorded for replay. What CUDA libraries allocate around a GEMM is
:mod:`graphborrow.sim.blas`'s.
"""

from __future__ import annotations

import torch
from torch.utils._mode_utils import no_dispatch

from . import blas, host
from .tensor import SimStorage, SimTensor, set_generic_dispatch
from .values import keeps_values, layout_error, meta_like

__all__ = ["INTERNAL_OVERLAP", "UNINITIALISED", "dispatch", "launch_kernel"]

_aten = torch.ops.aten
UNINITIALISED = {  # fresh outputs whose values need not be copied in
    _aten.empty.memory_format,
    _aten.empty_like.default,
    _aten.empty_strided.default,
    _aten.new_empty.default,
    _aten.new_empty_strided.default,
    torch.empty,
    torch.empty_like,
    torch.empty_strided,
    torch.Tensor.new_empty,
}
# ops whose Python-scalar operand CUDA copies to the device (a tiny block for the op's duration)
_SCALAR_TO_DEVICE = {_aten.where.self}


def _unwrap(x, sims: list):
    if isinstance(x, SimTensor):
        sims.append(x)
        return x.sim_inner
    if isinstance(x, (list, tuple)) and x and not isinstance(x, torch.Size):
        return type(x)(_unwrap(v, sims) for v in x)
    return x


def _twin(s: "SimTensor") -> torch.Tensor:
    """A META view with ``s``'s layout over its storage's META twin (same aliasing as on the CPU)."""
    inner = s.sim_inner
    storage = s.sim_storage
    if storage is None:
        return torch.empty_strided(inner.size(), inner.stride(), dtype=inner.dtype, device="meta")
    base = storage.meta_base()
    return torch.empty(0, dtype=inner.dtype, device="meta").set_(base.untyped_storage(), inner.storage_offset(),
                                                                  inner.size(), inner.stride())


def _unwrap_meta(x, twins: dict):
    """As ``_unwrap``, with every tensor that has values replaced by its META twin."""
    if isinstance(x, SimTensor):
        inner = x.sim_inner
        if inner.is_meta:
            return inner
        twin = _twin(x)
        twins[id(twin)] = x
        return twin
    if isinstance(x, (list, tuple)) and x and not isinstance(x, torch.Size):
        return type(x)(_unwrap_meta(v, twins) for v in x)
    return x


def _has_values(s: "SimTensor") -> bool:
    storage = s.sim_storage
    return not s.sim_inner.is_meta and (storage is None or storage.values)


_WRITES: dict = {}  # op -> positions of the arguments its schema writes


def _written(func, args, kwargs) -> list:
    """The SimTensor arguments an op writes (its schema's mutable arguments)."""
    positions = _WRITES.get(func)
    if positions is None:
        schema = getattr(func, "_schema", None)
        positions = _WRITES[func] = tuple(
            (i, a.name) for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write
        ) if schema is not None else ()
    out = []
    for i, name in positions:
        value = args[i] if i < len(args) else kwargs.get(name)
        if isinstance(value, SimTensor):
            out.append(value)
    return out


def _layout_only_inputs(func, args, kwargs, sims, inner_args, inner_kwargs):
    """On a layout-only device: CPU inputs when every tensor has values, else META ones.

    Returns ``(valued, twins, args, kwargs)``; ``twins`` maps a META twin's id to its tensor.
    """
    on_cpu = 0
    for s in sims:
        if not s.sim_inner.is_meta:
            on_cpu += 1
    if on_cpu and on_cpu == len(sims) and all(_has_values(s) for s in sims):
        return True, None, inner_args, inner_kwargs
    twins: dict = {}
    if on_cpu:
        inner_args = _unwrap_meta(args, twins)
        inner_kwargs = {k: _unwrap_meta(v, twins) for k, v in kwargs.items()} if kwargs else kwargs
        for s in _written(func, args, kwargs):  # shape-only data written into a tensor with values
            if s.sim_storage is not None and s.sim_storage.values:
                s.sim_storage.lose_values(func)
    if func is _aten._local_scalar_dense.default:
        raise layout_error("reading a tensor's value (.item(), bool(), int(), float(), a Python condition)",
                           _origin(sims))
    if inner_kwargs and _names_cpu(inner_kwargs.get("device")):
        # a decomposition copied the wrapper's reported device (cpu): it means "this device"
        inner_kwargs = dict(inner_kwargs, device=torch.device("meta"))
    return False, twins, inner_args, inner_kwargs


def _origin(sims) -> str | None:
    for s in sims:
        if s.sim_storage is not None and s.sim_storage.origin is not None:
            return str(s.sim_storage.origin)
    return None


def dispatch(func, args, kwargs):
    sims: list[SimTensor] = []
    inner_args = _unwrap(args, sims)
    inner_kwargs = {k: _unwrap(v, sims) for k, v in kwargs.items()} if kwargs else kwargs
    backend = sims[0].sim_backend
    for s in sims:
        if s.sim_backend is not backend:
            raise RuntimeError(
                f"{func}: tensors from two different simulated devices were mixed "
                f"({backend.describe()} and {s.sim_backend.describe()}); move one with .cpu() first"
            )
    capture = backend.capture_for_current_stream()
    host.check_operands(func, args, kwargs, backend, capture is not None, SimTensor)
    _check_internal_overlap(func, args, kwargs)
    valued, twins = True, None
    if not backend.backed:
        valued, twins, inner_args, inner_kwargs = _layout_only_inputs(func, args, kwargs, sims, inner_args,
                                                                      inner_kwargs)
    scalars = _scalars_on_device(func, args, backend)
    try:
        out = func(*inner_args, **inner_kwargs)
    except (NotImplementedError, RuntimeError) as e:
        if not valued and "meta" in str(e).lower():
            raise layout_error(f"{func} (its output's shape depends on tensor values: {_first_line(e)})",
                               _origin(sims)) from None
        raise
    if _inplace_view(func):
        with no_dispatch():  # the wrapper's own sizes and strides follow the inner tensor's
            func(*args, **kwargs)
    fresh: list = []
    copy = func not in UNINITIALISED
    if isinstance(out, torch.Tensor):
        result = _adopt(out, -1, sims, twins, backend, fresh, copy, func)
    elif isinstance(out, (tuple, list)):
        result = type(out)(
            _adopt(o, i, sims, twins, backend, fresh, copy, func) if isinstance(o, torch.Tensor) else o
            for i, o in enumerate(out)
        )
    else:
        result = out
    del scalars
    if getattr(func, "overloadpacket", None) in blas.BLAS_OPS:
        if blas.creates_handle_in_capture(backend, capture):
            del result, out, fresh  # the output goes back as the error unwinds
            raise blas.handle_in_capture(backend)
        blas.library_allocations(func, args, kwargs, backend)
    if capture is not None:
        _record_in_capture(capture, func, inner_args, inner_kwargs, fresh, result, backend, valued)
        if (fresh and copy) or _written(func, args, kwargs):  # views and empty tensors launch nothing
            launch_kernel(backend)
    return result


def launch_kernel(backend) -> None:
    """A kernel ran on the current stream: inside a capture, a node of the capture's graph (what
    ``graph_capture_record_stream_reuse`` reads)."""
    if backend.captures:
        backend.current_stream().launch()


INTERNAL_OVERLAP = ("unsupported operation: more than one element of the written-to tensor refers to a single "
                    "memory location. Please clone() the tensor before performing the operation.")
# written without TensorIterator's overlap check: fill is idempotent (set_check_mem_overlap(false)),
# the others only change a tensor's metadata
_OVERLAP_ALLOWED = {_aten.fill_.Scalar, _aten.fill_.Tensor, _aten.zero_.default, _aten.set_.source_Storage,
                    _aten.set_.source_Storage_storage_offset, _aten.set_.source_Tensor, _aten.set_.default,
                    _aten.resize_.default, _aten.as_strided_.default}


def _check_internal_overlap(func, args, kwargs) -> None:
    """CUDA refuses to write into a tensor whose elements share memory (an ``expand``): ATen's
    ``assert_no_internal_overlap`` in TensorIterator and the scatter / index kernels. The META
    kernels a layout-only device runs do not check it."""
    if func in _OVERLAP_ALLOWED or _inplace_view(func):
        return
    for s in _written(func, args, kwargs):
        if s.dim() and torch._debug_has_internal_overlap(s) == 1:
            raise RuntimeError(INTERNAL_OVERLAP)


def _record_in_capture(capture, func, inner_args, inner_kwargs, fresh, result, backend, valued) -> None:
    """What a replay needs: the bytes the op's new outputs occupy, and the op itself when it has values."""
    if fresh:
        inners = {id(view) for _, view in fresh}
        outs = result if isinstance(result, (tuple, list)) else (result,)
        capture.record_written((backend.data_ptr(o), o.numel() * o.element_size()) for o in outs
                               if isinstance(o, SimTensor) and id(o.sim_inner) in inners)
    if backend.backed:
        capture.record_op(func, inner_args, inner_kwargs, fresh)
    elif valued:  # layout only: ops on tensors with values run again on replay (their values change)
        capture.record_op(func, inner_args, inner_kwargs, [(i, v) for i, v in fresh if not v.is_meta])


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


_INPLACE_VIEW: dict = {}


def _inplace_view(func) -> bool:
    """Ops that change a tensor's sizes or strides in place (``unsqueeze_``, ``t_``, ``set_``...)."""
    known = _INPLACE_VIEW.get(func)
    if known is None:
        tags = getattr(func, "tags", ())
        known = _INPLACE_VIEW[func] = torch.Tag.inplace_view in tags or getattr(
            func, "overloadpacket", None) is _aten.set_
    return known


def _names_cpu(device) -> bool:
    return device is not None and torch.device(device).type == "cpu"


def _scalars_on_device(func, args, backend) -> list | None:
    """CUDA turns a Python scalar operand of some ops into a device tensor; so do we."""
    if func not in _SCALAR_TO_DEVICE:
        return None
    return [
        backend.new_storage(a.element_size())
        for a in args
        if isinstance(a, torch.Tensor) and not isinstance(a, SimTensor) and a.dim() == 0
    ]


def _adopt(o: torch.Tensor, index: int, sims: list[SimTensor], twins, backend, fresh: list, copy: bool, func):
    """Give an op output its place in device memory (shared with an input, or new)."""
    for s in sims:
        if o is s.sim_inner:  # in-place op or out=: the wrapper itself is the result
            if o.shape != s.shape or o.stride() != s.stride():
                raise NotImplementedError(
                    "an in-place op changed the shape or strides of a simulated tensor "
                    f"({tuple(s.shape)} -> {tuple(o.shape)}); use the out-of-place form"
                )
            if func is not None and _aten.set_ is getattr(func, "overloadpacket", None):
                _take_storage(s, o, sims)
            return s
    if twins:
        s = twins.get(id(o))
        if s is not None:  # in place into a tensor with values, from shape-only data: they are lost
            return s
    storage = _aliased_storage(o, sims, backend)
    if storage is not None:
        inference = _base_of(storage, sims).is_inference()
        if inference != torch.is_inference_mode_enabled():
            with torch.inference_mode(inference):  # a view is as inference as its base
                return SimTensor(o, storage, backend)
        return SimTensor(o, storage, backend)
    if backend.backed:
        if o.device.type != "cpu":
            return o  # e.g. an op that explicitly produced a meta tensor
        t = backend.place(o, copy)
    else:
        kind = o.device.type
        if kind == "cpu" and (not copy or not keeps_values(o)):  # no defined values, or too large to keep
            o = meta_like(o)
        elif kind not in ("cpu", "meta"):
            return o
        t = backend.place(o, False)
    if t.sim_storage is not None:
        t.sim_storage.origin = func
    fresh.append((index, t.sim_inner))
    return t


def _take_storage(s: SimTensor, inner: torch.Tensor, sims: list[SimTensor]) -> None:
    """``s.set_(source)``: ``s`` now lives in the source's storage (its inner tensor's, or on a layout-only
    device the META twin's a source with values lends to shape-only data)."""
    key = inner.untyped_storage()._cdata
    source = next((t for t in sims if t is not s and t.sim_storage is not None
                   and key in (t.sim_inner.untyped_storage()._cdata, t.sim_storage.meta_key)), None)
    s.sim_storage = None if source is None else source.sim_storage


def _base_of(storage: SimStorage, sims: list[SimTensor]) -> SimTensor:
    for s in sims:
        if s.sim_storage is storage:
            return s
    raise AssertionError("storage not found among the inputs")


def _aliased_storage(o: torch.Tensor, sims: list[SimTensor], backend) -> SimStorage | None:
    if backend.backed:
        p = o.data_ptr()
        for s in sims:
            st = s.sim_storage
            if st is not None and st.host_ptr <= p < st.host_ptr + st.nbytes:
                return st
        return None
    key = o.untyped_storage()._cdata
    for s in sims:
        st = s.sim_storage
        if st is not None and (st.key == key or st.meta_key == key):
            return st
    return None


set_generic_dispatch(dispatch)
