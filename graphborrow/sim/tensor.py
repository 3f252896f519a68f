"""Tensors that live in simulated device memory.

A :class:`SimTensor` is a wrapper subclass (reported device ``cpu``, as measured: a
reported ``cuda`` breaks slicing and indexing on a CPU build). Its ``sim_inner`` is a
plain CPU view of the bytes of the allocator block it occupies, so ops really read
and write the simulated memory. In layout-only mode ``sim_inner`` is a META tensor:
shapes, strides and allocator state are exact, arithmetic does not happen.

Every op on a SimTensor reaches :meth:`SimTensor.__torch_dispatch__`, which runs it on
the inner tensors and then gives each output a home, as the CUDA caching allocator
would: an output that aliases an input (views, in-place ops) shares the input's
block; a fresh output gets a new block on the current simulated stream, routed
through captures and ``use_mem_pool`` like torch. A block goes back to the allocator
when the last tensor using it dies (:class:`SimStorage` is the refcount).

:class:`SimFunctionMode` is pushed while a backend is active on a thread; it maps
factory calls with ``device="cuda"`` onto the simulated device, so code written for
CUDA runs unchanged.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._mode_utils import no_dispatch

from . import host
from .torch_function import torch_functions_off
from .values import SimLayoutOnlyError, keeps_values, layout_error, meta_like

__all__ = [
    "CUDA_MODELS",
    "SimFunctionMode",
    "SimLayoutOnlyError",
    "SimStorage",
    "SimTensor",
    "is_sim_tensor",
    "non_overlapping_and_dense",
    "register_cuda_model",
    "register_factory_model",
    "to_host",
]

_OVERRIDES: dict[Callable, Callable] = {}
_aten = torch.ops.aten
_UNINITIALISED = {  # fresh outputs whose values need not be copied in
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
# cuBLAS calls: the first one on a stream allocates that stream's workspace (kept forever)
_BLAS_OPS = {
    _aten.mm, _aten.addmm, _aten.bmm, _aten.baddbmm, _aten.addbmm, _aten.mv, _aten.addmv,
    _aten.dot, _aten.vdot, _aten._addmm_activation,
}
# addmm's cuBLASLt path (bias fused in the epilogue): it also keeps a cuBLASLt workspace per stream
_BLASLT_OPS = {_aten.addmm.default, _aten._addmm_activation.default}
_BLASLT_DTYPES = {torch.float64, torch.float32, torch.float16, torch.bfloat16}
# ops whose Python-scalar operand CUDA copies to the device (a tiny block for the op's duration)
_SCALAR_TO_DEVICE = {_aten.where.self}
_DEVICE_IS_CUDA: dict[Any, bool] = {}


class SimStorage:
    """One allocator block in use by tensors; frees the block when the last user dies.

    On a layout-only device ``values`` says whether the tensors in it carry real values (CPU
    inner tensors, see :mod:`graphborrow.sim.values`); ``key`` identifies the inner tensors'
    storage and ``meta_key`` the META twin the storage gets when shape-only data meets it.
    """

    __slots__ = ("backend", "block", "host_ptr", "nbytes", "key", "values", "meta_key", "origin", "_meta",
                 "__weakref__")

    def __init__(self, backend, block, host_ptr: int, nbytes: int, key: int) -> None:
        self.backend = backend
        self.block = block
        self.host_ptr = host_ptr  # backed: CPU address of the block's first byte
        self.nbytes = nbytes
        self.key = key  # layout-only: identity of the inner tensors' storage
        self.values = False  # layout-only: the inner tensors are CPU tensors with the real values
        self.meta_key = None
        self.origin = None  # the op that made it (named when a value is asked of it)
        self._meta = None

    def meta_base(self) -> torch.Tensor:
        """A META byte tensor over this storage (made once): shape-only views of its tensors."""
        if self._meta is None:
            self._meta = torch.empty(self.nbytes, dtype=torch.uint8, device="meta")
            self.meta_key = self._meta.untyped_storage()._cdata
        return self._meta

    def lose_values(self, func) -> None:
        """Shape-only data was written here: the values its tensors show are no longer right."""
        self.values = False
        self.origin = func

    def __del__(self, _finalizing=sys.is_finalizing) -> None:
        # bound at definition: at interpreter exit module globals are gone, and so is the device
        backend = self.backend
        if backend is not None and not _finalizing():
            self.backend = None
            backend.release_block(self.block)


class SimTensor(torch.Tensor):
    """A tensor whose data is a view into simulated device memory (see module doc)."""

    sim_inner: torch.Tensor
    sim_storage: SimStorage | None
    sim_backend: Any

    @staticmethod
    def __new__(cls, inner: torch.Tensor, storage: SimStorage | None, backend):
        t = torch.Tensor._make_wrapper_subclass(
            cls,
            inner.size(),
            strides=inner.stride(),
            storage_offset=inner.storage_offset(),
            dtype=inner.dtype,
            layout=inner.layout,
            device="cpu",
            requires_grad=False,
        )
        t.sim_inner = inner
        t.sim_storage = storage
        t.sim_backend = backend
        return t

    def __init__(self, *args, **kwargs) -> None:  # all state is set in __new__
        pass

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        override = _OVERRIDES.get(func)
        if override is not None:
            return override(*args, **(kwargs or {}))
        # the guard lives in C++: no interrupt can leave it on (Note [torch functions off under interrupts])
        return torch._C._disabled_torch_function_impl(_call, types, (func, args, kwargs), None)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        cuda_model = CUDA_MODELS.get(func)
        if cuda_model is not None:  # an op whose CUDA implementation differs from the CPU one
            return cuda_model(func, args, kwargs)
        if _is_composite(func):  # decompose as CUDA would, so each piece gets its memory
            out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        return dispatch(func, args, kwargs)


def _call(func, args, kwargs):
    return func(*args, **(kwargs or {}))


_COMPOSITE: dict = {}
# ops modelled on their CUDA implementation (which backend, which outputs, which temporaries);
# filled by graphborrow.sim.attention through register_cuda_model
CUDA_MODELS: dict = {}


def register_cuda_model(*funcs):
    """Route ``funcs`` on simulated tensors to a Python model of their CUDA implementation.

    ``funcs`` are aten overloads (seen by ``__torch_dispatch__``; a composite op reaches it
    whole only in inference mode) or the Python-level functions that call them (seen by
    ``__torch_function__`` before any decomposition). The model is called as
    ``model(func, args, kwargs)`` with the SimTensor arguments and allocates what the CUDA
    kernel allocates, in the same order (see sim/attention.py).
    """

    def register(model):
        for f in funcs:
            if isinstance(f, torch._ops.OpOverload):
                CUDA_MODELS[f] = model
            else:
                _OVERRIDES[f] = lambda *args, _f=f, **kwargs: model(_f, args, kwargs)
        return model

    return register


# factories (torch.randperm...) whose CUDA implementation allocates temporaries after the output;
# filled by graphborrow.sim.cuda_ops through register_factory_model
FACTORY_MODELS: dict = {}


def register_factory_model(*funcs):
    """Have ``model(backend, args, kwargs, result)`` allocate what the CUDA implementation of the
    factories ``funcs`` allocates after its output, ``result`` (already placed on the device)."""

    def register(model):
        for f in funcs:
            FACTORY_MODELS[f] = model
        return model

    return register


def _is_composite(func) -> bool:
    """True for ops with a CompositeImplicitAutograd kernel (reached whole in inference mode)."""
    known = _COMPOSITE.get(func)
    if known is None:
        known = _COMPOSITE[func] = torch._C._dispatch_has_kernel_for_dispatch_key(
            func.name(), torch._C.DispatchKey.CompositeImplicitAutograd
        )
    return known


def is_sim_tensor(t: Any) -> bool:
    """True for a tensor that lives on a simulated device."""
    return isinstance(t, SimTensor)


# --------------------------------------------------------------------------- dispatch


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
    copy = func not in _UNINITIALISED
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
    if getattr(func, "overloadpacket", None) in _BLAS_OPS:
        if not backend.blas_handle:  # the first cuBLAS call makes the handle (cublasCreate)
            if capture is not None:  # which allocates device memory: refused inside a capture
                del result, out, fresh  # the output goes back as the error unwinds
                raise host.fails_in_capture(backend, CUBLAS_CREATE_IN_CAPTURE)
            backend.blas_handle = True
        copies = _cublas_operand_copies(func, args, backend)
        if backend.blas_workspace:
            backend.ensure_blas_workspace()
        if backend.blaslt_workspace and _uses_cublaslt(func, args, kwargs):
            backend.ensure_blaslt_workspace()
        del copies
    if capture is not None:
        _record_in_capture(capture, func, inner_args, inner_kwargs, fresh, result, backend, valued)
    return result


CUBLAS_CREATE_IN_CAPTURE = "CUDA error: CUBLAS_STATUS_NOT_INITIALIZED when calling `cublasCreate(handle)`"
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


def _uses_cublaslt(func, args, kwargs) -> bool:
    """addmm_out_cuda_impl's choice of cuBLASLt (isInputCompliesAddmmCudaLt, CUDA >= 12.1)."""
    if func not in _BLASLT_OPS:
        return False
    bias, mat1, mat2 = args[:3]
    beta = kwargs.get("beta", args[3] if len(args) > 3 else 1)
    activation = func is _aten._addmm_activation.default
    fusable_bias = (bias.is_contiguous() and (bias.dim() == 1 or bias.squeeze().dim() == 1)
                    and bias.shape[-1] == mat2.shape[1])
    # torch 2.11 takes the Lt path for a single row too (data/fuzz: a 1-D input's linear with bias),
    # but not for one column of mat1 or one row or column of mat2 (cuBLASLt's heuristic refuses
    # those: data/fuzz, linear layers of one input feature)
    return (beta == 1 and (fusable_bias or (activation and bias.dim() == 2))
            and mat1.dtype in _BLASLT_DTYPES and mat1.shape[1] > 1 and mat2.shape[0] > 1 and mat2.shape[1] > 1)


_MATRIX_OPERANDS = {_aten.mm.default: (0, 1), _aten.addmm.default: (1, 2), _aten._addmm_activation.default: (1, 2)}


def _cublas_operand_copies(func, args, backend) -> list:
    """``prepare_matrix_for_cublas``: a matrix operand that is neither dense nor a strided row- or
    column-major matrix with a usable leading dimension (an ``expand``, a stride of 0) is cloned
    contiguous before the GEMM; the clones are freed when it returns."""
    positions = _MATRIX_OPERANDS.get(func)
    if positions is None:
        return []
    held = []
    for i in positions:
        m = args[i] if i < len(args) else None
        if not isinstance(m, SimTensor) or m.dim() != 2 or m.numel() == 0:
            continue
        (rows, cols), (s0, s1) = m.shape, m.stride()
        if non_overlapping_and_dense(m) or (s0 == 1 and s1 >= max(1, rows)) or (s1 == 1 and s0 >= max(1, cols)):
            continue
        held.append(backend.new_storage(m.numel() * m.element_size()))
    return held


def non_overlapping_and_dense(t) -> bool:
    """No gaps and no overlaps: some permutation of the dims is contiguous (as empty_like checks)."""
    expected = 1
    for size, stride in sorted(((n, st) for n, st in zip(t.shape, t.stride()) if n != 1), key=lambda p: p[1]):
        if stride != expected:
            return False
        expected *= size
    return True


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
    """``s.set_(source)``: ``s`` now lives in the source's storage."""
    source = next((t for t in sims if t is not s and t.sim_storage is not None and _same_storage(t.sim_inner, inner)),
                  None)
    s.sim_storage = None if source is None else source.sim_storage


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage()._cdata == b.untyped_storage()._cdata


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


# -------------------------------------------------------------- Tensor method overrides


def _override(*funcs):
    def register(fn):
        for f in funcs:
            _OVERRIDES[f] = fn
        return fn

    return register


def to_host(t: SimTensor) -> torch.Tensor:
    """A plain CPU copy of ``t`` (what ``.cpu()`` gives on CUDA); see :func:`graphborrow.sim.host.to_host`."""
    return host.to_host(t)


@_override(torch.Tensor.cpu)
def _cpu(self, memory_format=torch.preserve_format):
    return host.to_host(self)


@_override(torch.Tensor.to)
def _to(self, *args, **kwargs):
    copy = kwargs.pop("copy", False)
    device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
    if device is not None and device.type == "cpu":
        moved = host.to_host(self)
        return moved.to(dtype=dtype or moved.dtype, memory_format=memory_format or torch.preserve_format)
    if device is not None and device.type != "cuda":
        raise RuntimeError(f"a simulated CUDA tensor can move to 'cpu' or stay on 'cuda', not {device}")
    if device is not None:
        _check_index(device)
    kw = {"copy": copy}
    if memory_format is not None:
        kw["memory_format"] = memory_format
    with torch_functions_off(subclasses_only=True):
        if dtype is None:
            return torch.Tensor.to(self, self.dtype, **kw)
        return torch.Tensor.to(self, dtype, **kw)


@_override(torch.Tensor.cuda)
def _cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
    if device is not None:
        _check_index(torch.device("cuda", device) if isinstance(device, int) else torch.device(device))
    return self


@_override(torch.Tensor.data.__set__)
def _set_data(self, new) -> None:
    """``param.data = x`` (what ``Module.to`` / ``.half()`` / ``_apply`` do): ``self`` takes ``x``'s
    storage, dtype and layout, and its old storage is freed once nothing else uses it, as on CUDA."""
    if not isinstance(new, SimTensor):
        raise RuntimeError(
            f"cannot set the data of a simulated cuda tensor to a {new.device} tensor; move it with "
            "x.to('cuda') first")
    with torch_functions_off(subclasses_only=True):
        torch.Tensor.data.__set__(self, new)
    self.sim_inner, self.sim_storage, self.sim_backend = new.sim_inner, new.sim_storage, new.sim_backend


@_override(torch._has_compatible_shallow_copy_type)
def _compatible_shallow_copy(tensor, other) -> bool:
    """A host parameter moved to the simulated device is replaced by a new Parameter (as
    ``Module._apply`` does for tensors of another kind), not given the device tensor's data."""
    return isinstance(tensor, SimTensor) == isinstance(other, SimTensor)


@_override(torch.Tensor.record_stream)
def _record_stream(self, stream) -> None:
    self.sim_backend.record_stream(self, getattr(stream, "sim_stream", stream))


@_override(torch.Tensor.pin_memory)
def _pin_memory(self, device=None):
    raise RuntimeError(f"cannot pin '{self.type()}' only dense CPU tensors can be pinned")


@_override(torch.Tensor.is_pinned)
def _is_pinned(self, device=None) -> bool:
    return False


@_override(torch.Tensor.type)
def _type(self, dtype=None, non_blocking=False, **kwargs):
    if dtype is None:
        return {torch.float32: "torch.cuda.FloatTensor", torch.float16: "torch.cuda.HalfTensor",
                torch.bfloat16: "torch.cuda.BFloat16Tensor", torch.int64: "torch.cuda.LongTensor",
                torch.int32: "torch.cuda.IntTensor", torch.bool: "torch.cuda.BoolTensor"}.get(
            self.dtype, f"torch.cuda.{self.dtype}")
    if isinstance(dtype, str):
        raise NotImplementedError(f"Tensor.type({dtype!r}) on the simulated device; pass a torch.dtype")
    return self.to(dtype, non_blocking=non_blocking)


_SIM_CUDA = torch.device("cuda", 0)


@_override(torch.Tensor.device.__get__)
def _device(self):
    """Python code sees ``cuda:0`` (so ``.to(x.device)`` and ``device=x.device`` stay on the
    simulated device, as model code expects); the dispatcher still sees the CPU wrapper."""
    return _SIM_CUDA


@_override(torch.Tensor.is_cuda.__get__)
def _is_cuda_attr(self):
    return True


@_override(torch.Tensor.is_cpu.__get__)
def _is_cpu_attr(self):
    return False


@_override(torch.Tensor.numpy, torch.Tensor.__array__)
def _numpy(self, *args, **kwargs):
    raise TypeError(
        "can't convert a (simulated) cuda:0 device type tensor to numpy. Use Tensor.cpu() "
        "to copy the tensor to host memory first."
    )


@_override(torch.Tensor.tolist)
def _tolist(self):
    return host.to_host(self).tolist()


@_override(torch.Tensor.data_ptr)
def _data_ptr(self):
    return self.sim_backend.data_ptr(self)


@_override(torch.Tensor.new_tensor)
def _new_tensor(self, data, dtype=None, device=None, requires_grad=False, **kwargs):
    if device is not None and not _is_cuda(device):
        return torch.tensor(data, dtype=dtype or self.dtype, device=device)
    plain = torch.tensor(data, dtype=dtype or self.dtype, requires_grad=False)
    return _from_python_data(self.sim_backend, plain)


def _from_python_data(backend, plain: torch.Tensor) -> SimTensor:
    """``torch.tensor(data, device="cuda")``: the device block, then a copy from pageable memory."""
    placed = backend.from_host(plain)
    if backend.capture_for_current_stream() is not None and plain.numel():  # nothing to copy: no copy
        del placed  # allocated, then freed as the refusal unwinds (as on CUDA)
        raise host.refuse_pageable()
    return placed


@_override(torch.Tensor.__repr__)
def _repr(self, *args, tensor_contents=None):
    backend = self.sim_backend
    if backend.capture_for_current_stream() is not None:
        raise host.not_permitted(backend)
    if not backend.backed and (self.sim_inner.is_meta or (self.sim_storage is not None and
                                                         not self.sim_storage.values)):
        return (
            f"tensor(..., size={tuple(self.shape)}, dtype={self.dtype}, device='sim', "
            "layout_only=True)"
        )
    with torch_functions_off(subclasses_only=True):
        text = repr(self.sim_inner)
    if text.endswith(")"):
        text = text[:-1] + ", device='sim')"
    return text


@_override(torch.Tensor.__reduce_ex__)
def _reduce_ex(self, proto):
    raise TypeError("a simulated CUDA tensor cannot be pickled; call .cpu() first")


# -------------------------------------------------------------------- function mode


def _is_cuda(dev) -> bool:
    try:
        cached = _DEVICE_IS_CUDA.get(dev)
    except TypeError:  # unhashable
        cached = None
    if cached is not None:
        return cached
    if isinstance(dev, int) and not isinstance(dev, bool):
        result = True
    elif isinstance(dev, (str, torch.device)):
        d = torch.device(dev)
        result = d.type == "cuda"
        if result:
            _check_index(d)
    else:
        return False
    try:
        _DEVICE_IS_CUDA[dev] = result
    except TypeError:
        pass
    return result


def _check_index(d: torch.device) -> None:
    if d.index not in (None, 0):
        raise RuntimeError(
            f"the simulated device is a single GPU (cuda:0); got {d}. Use device='cuda'."
        )


_FROM_PYTHON_DATA = {torch.tensor, torch.as_tensor, torch.asarray}
_PARSE_TO = torch._C._nn._parse_to


class SimFunctionMode(TorchFunctionMode):
    """Maps ``device="cuda"`` onto one simulated device (pushed while it is active)."""

    def __init__(self, backend) -> None:
        super().__init__()
        self.backend = backend

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.to or func is torch.Tensor.cuda:
            return self._move(func, args, kwargs or {})
        if func is torch.Tensor.pin_memory and not isinstance(args[0], SimTensor):
            return host.pin(args[0])
        if func is torch.Tensor.is_pinned and not isinstance(args[0], SimTensor):
            return host.is_pinned(args[0])
        if kwargs and func is not _PARSE_TO:  # Module.to parses its arguments: not a factory
            dev = kwargs.get("device")
            if dev is not None and _is_cuda(dev):
                return self._factory(func, args, kwargs)
            if kwargs.get("pin_memory"):
                return host.mark_pinned(func(*args, **dict(kwargs, pin_memory=False)))
        return func(*args, **(kwargs or {}))

    def _factory(self, func, args, kwargs):
        backend = self.backend
        kw = dict(kwargs)
        kw["device"] = "cpu" if backend.backed else "meta"
        kw.pop("pin_memory", None)
        requires_grad = kw.pop("requires_grad", False)
        out = func(*args, **kw)
        if (not backend.backed and isinstance(out, torch.Tensor) and out.is_meta and func not in _UNINITIALISED
                and keeps_values(out)):
            kw["device"] = "cpu"  # small and with defined values: made again on the CPU, with its values
            out = func(*args, **kw)
        if isinstance(out, SimTensor) or not isinstance(out, torch.Tensor):
            result = out
        elif func in _FROM_PYTHON_DATA:
            result = _from_python_data(backend, out)
        else:
            result = backend.place(out, func not in _UNINITIALISED)
            result.sim_storage is not None and setattr(result.sim_storage, "origin", func)
            capture = backend.capture_for_current_stream()
            if capture is not None and (backend.backed or not result.sim_inner.is_meta):
                capture.record_op(func, args, kw, [(-1, result.sim_inner)])
            model = FACTORY_MODELS.get(func)
            if model is not None:
                model(backend, args, kw, result)
        if requires_grad:
            result.requires_grad_(True)
        return result

    def _move(self, func, args, kwargs):
        self_ = args[0]
        if isinstance(self_, SimTensor):
            return func(*args, **kwargs)
        if func is torch.Tensor.cuda:
            dev = args[1] if len(args) > 1 else kwargs.get("device")
            if dev is not None:
                _check_index(torch.device("cuda", dev) if isinstance(dev, int) else torch.device(dev))
            return self._from_host(self_, kwargs.get("non_blocking", args[2] if len(args) > 2 else False))
        kw = {k: v for k, v in kwargs.items() if k != "copy"}
        device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args[1:], **kw)
        if device is None or device.type != "cuda":
            return func(*args, **kwargs)
        _check_index(device)
        plain = self_
        if dtype is not None and dtype != plain.dtype:
            plain = plain.to(dtype)  # a copy with a conversion converts on the host (copy_kernel_cuda)
        return self._from_host(plain, non_blocking)

    def _from_host(self, plain: torch.Tensor, non_blocking: bool) -> SimTensor:
        """``.to("cuda")`` of a host tensor: the device block, then the copy (refused in a capture
        from pageable memory, or blocking; a captured copy from pinned memory runs again on replay)."""
        backend = self.backend
        placed = backend.from_host(plain)
        try:
            host.check_host_to_device(backend, plain, bool(non_blocking))
        except BaseException:
            del placed  # the destination block goes back as the error unwinds
            raise
        capture = backend.capture_for_current_stream()
        if capture is not None and not placed.sim_inner.is_meta:
            capture.record_op(torch.Tensor.copy_, (placed.sim_inner, plain), {}, [])
        return placed
