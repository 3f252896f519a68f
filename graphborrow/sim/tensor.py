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

__all__ = [
    "CUDA_MODELS",
    "SimCaptureError",
    "SimFunctionMode",
    "SimLayoutOnlyError",
    "SimStorage",
    "SimTensor",
    "is_sim_tensor",
    "register_cuda_model",
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


class SimLayoutOnlyError(RuntimeError):
    """A value was asked of a tensor on a layout-only (``backed=False``) device."""


class SimCaptureError(RuntimeError):
    """An operation that a real CUDA graph capture forbids happened during capture."""


class SimStorage:
    """One allocator block in use by tensors; frees the block when the last user dies."""

    __slots__ = ("backend", "block", "host_ptr", "nbytes", "key", "__weakref__")

    def __init__(self, backend, block, host_ptr: int, nbytes: int, key: int) -> None:
        self.backend = backend
        self.block = block
        self.host_ptr = host_ptr  # backed: CPU address of the block's first byte
        self.nbytes = nbytes
        self.key = key  # layout-only: identity of the META storage

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
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

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


def dispatch(func, args, kwargs):
    sims: list[SimTensor] = []
    inner_args = _unwrap(args, sims)
    inner_kwargs = {k: _unwrap(v, sims) for k, v in kwargs.items()} if kwargs else kwargs
    backend = sims[0].sim_backend
    if not backend.backed and inner_kwargs and _names_cpu(inner_kwargs.get("device")):
        # a decomposition copied the wrapper's reported device (cpu): it means "this device"
        inner_kwargs = dict(inner_kwargs, device=torch.device("meta"))
    for s in sims:
        if s.sim_backend is not backend:
            raise RuntimeError(
                f"{func}: tensors from two different simulated devices were mixed "
                f"({backend.describe()} and {s.sim_backend.describe()}); move one with .cpu() first"
            )
    capture = backend.capture_for_current_stream()
    if capture is not None:
        _check_capturable(func, args, kwargs)
    if not backend.backed and func is _aten._local_scalar_dense.default:
        raise SimLayoutOnlyError(
            "this tensor lives on a layout-only simulated device (backed=False) and has no "
            "values to read; create the backend with backed=True to use .item() / bool()"
        )
    scalars = _scalars_on_device(func, args, backend)
    try:
        out = func(*inner_args, **inner_kwargs)
    except (NotImplementedError, RuntimeError) as e:
        if not backend.backed and "meta" in str(e).lower():
            raise SimLayoutOnlyError(
                f"{func} cannot run on a layout-only simulated device (backed=False): "
                f"its output depends on tensor values ({e}). Create the backend with backed=True."
            ) from None
        raise
    fresh: list = []
    copy = func not in _UNINITIALISED
    if isinstance(out, torch.Tensor):
        result = _adopt(out, -1, sims, backend, fresh, copy)
    elif isinstance(out, (tuple, list)):
        result = type(out)(
            _adopt(o, i, sims, backend, fresh, copy) if isinstance(o, torch.Tensor) else o
            for i, o in enumerate(out)
        )
    else:
        result = out
    del scalars
    if getattr(func, "overloadpacket", None) in _BLAS_OPS:
        if backend.blas_workspace:
            backend.ensure_blas_workspace()
        if backend.blaslt_workspace and _uses_cublaslt(func, args, kwargs):
            backend.ensure_blaslt_workspace()
    if capture is not None:
        if fresh:  # the device bytes this op's new outputs occupy: what a replay writes
            inners = {id(view) for _, view in fresh}
            outs = result if isinstance(result, (tuple, list)) else (result,)
            capture.record_written((backend.data_ptr(o), o.numel() * o.element_size()) for o in outs
                                   if isinstance(o, SimTensor) and id(o.sim_inner) in inners)
        if backend.backed:
            capture.record_op(func, inner_args, inner_kwargs, fresh)
    return result


def _uses_cublaslt(func, args, kwargs) -> bool:
    """addmm_out_cuda_impl's choice of cuBLASLt (isInputCompliesAddmmCudaLt, CUDA >= 12.1)."""
    if func not in _BLASLT_OPS:
        return False
    bias, mat1, mat2 = args[:3]
    beta = kwargs.get("beta", args[3] if len(args) > 3 else 1)
    activation = func is _aten._addmm_activation.default
    fusable_bias = (bias.is_contiguous() and (bias.dim() == 1 or bias.squeeze().dim() == 1)
                    and bias.shape[-1] == mat2.shape[1])
    return (beta == 1 and (fusable_bias or (activation and bias.dim() == 2))
            and mat1.dtype in _BLASLT_DTYPES and min(mat1.shape) > 1 and min(mat2.shape) > 1)


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


def _check_capturable(func, args, kwargs) -> None:
    if func is torch.ops.aten._local_scalar_dense.default:
        raise SimCaptureError(
            "reading a tensor value (.item(), bool(), printing) is not permitted while a "
            "stream is capturing a CUDA graph: it would synchronise the device. Read it "
            "after the capture ends."
        )

    def check(x):
        if isinstance(x, torch.Tensor):
            if not isinstance(x, SimTensor) and x.dim() > 0:
                raise SimCaptureError(
                    f"{func} read a plain CPU tensor of shape {tuple(x.shape)} during graph "
                    "capture; a CUDA graph can only read device memory. Create it with "
                    "device='cuda' (or .to('cuda')) before the capture."
                )
        elif isinstance(x, (list, tuple)):
            for v in x:
                check(v)

    check(args)
    check(list(kwargs.values()))


def _adopt(o: torch.Tensor, index: int, sims: list[SimTensor], backend, fresh: list, copy: bool):
    """Give an op output its place in device memory (shared with an input, or new)."""
    for s in sims:
        if o is s.sim_inner:  # in-place op or out=: the wrapper itself is the result
            if o.shape != s.shape or o.stride() != s.stride():
                raise NotImplementedError(
                    "an in-place op changed the shape or strides of a simulated tensor "
                    f"({tuple(s.shape)} -> {tuple(o.shape)}); use the out-of-place form"
                )
            return s
    storage = _aliased_storage(o, sims, backend)
    if storage is not None:
        inference = _base_of(storage, sims).is_inference()
        if inference != torch.is_inference_mode_enabled():
            with torch.inference_mode(inference):  # a view is as inference as its base
                return SimTensor(o, storage, backend)
        return SimTensor(o, storage, backend)
    if o.device.type != ("cpu" if backend.backed else "meta"):
        return o  # e.g. an op that explicitly produced a meta tensor
    t = backend.place(o, copy)
    fresh.append((index, t.sim_inner))
    return t


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
        if st is not None and st.key == key:
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
    """A plain CPU copy of ``t`` (what ``.cpu()`` gives on CUDA)."""
    backend = t.sim_backend
    if not backend.backed:
        raise SimLayoutOnlyError(
            "this tensor lives on a layout-only simulated device (backed=False) and has "
            "no values; create the backend with backed=True to read tensors"
        )
    if backend.capture_for_current_stream() is not None:
        raise SimCaptureError(
            "copying a tensor to the host is not permitted while a stream is capturing a "
            "CUDA graph; do it after the capture ends"
        )
    with torch._C.DisableTorchFunctionSubclass():
        return t.sim_inner.clone()


@_override(torch.Tensor.cpu)
def _cpu(self, memory_format=torch.preserve_format):
    return to_host(self)


@_override(torch.Tensor.to)
def _to(self, *args, **kwargs):
    copy = kwargs.pop("copy", False)
    device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
    if device is not None and device.type == "cpu":
        host = to_host(self)
        return host.to(dtype=dtype or host.dtype, memory_format=memory_format or torch.preserve_format)
    if device is not None and device.type != "cuda":
        raise RuntimeError(f"a simulated CUDA tensor can move to 'cpu' or stay on 'cuda', not {device}")
    if device is not None:
        _check_index(device)
    kw = {"copy": copy}
    if memory_format is not None:
        kw["memory_format"] = memory_format
    with torch._C.DisableTorchFunctionSubclass():
        if dtype is None:
            return torch.Tensor.to(self, self.dtype, **kw)
        return torch.Tensor.to(self, dtype, **kw)


@_override(torch.Tensor.cuda)
def _cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
    if device is not None:
        _check_index(torch.device("cuda", device) if isinstance(device, int) else torch.device(device))
    return self


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
    return to_host(self).tolist()


@_override(torch.Tensor.data_ptr)
def _data_ptr(self):
    return self.sim_backend.data_ptr(self)


@_override(torch.Tensor.new_tensor)
def _new_tensor(self, data, dtype=None, device=None, requires_grad=False, **kwargs):
    if device is not None and not _is_cuda(device):
        return torch.tensor(data, dtype=dtype or self.dtype, device=device)
    plain = torch.tensor(data, dtype=dtype or self.dtype, requires_grad=False)
    return self.sim_backend.from_host(plain)


@_override(torch.Tensor.__repr__)
def _repr(self, *args, tensor_contents=None):
    backend = self.sim_backend
    if not backend.backed:
        return (
            f"tensor(..., size={tuple(self.shape)}, dtype={self.dtype}, device='sim', "
            "layout_only=True)"
        )
    with torch._C.DisableTorchFunctionSubclass():
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


class SimFunctionMode(TorchFunctionMode):
    """Maps ``device="cuda"`` onto one simulated device (pushed while it is active)."""

    def __init__(self, backend) -> None:
        super().__init__()
        self.backend = backend

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.to or func is torch.Tensor.cuda:
            return self._move(func, args, kwargs or {})
        if kwargs:
            dev = kwargs.get("device")
            if dev is not None and _is_cuda(dev):
                return self._factory(func, args, kwargs)
        return func(*args, **(kwargs or {}))

    def _factory(self, func, args, kwargs):
        backend = self.backend
        kw = dict(kwargs)
        kw["device"] = "cpu" if backend.backed else "meta"
        kw.pop("pin_memory", None)
        requires_grad = kw.pop("requires_grad", False)
        out = func(*args, **kw)
        if isinstance(out, SimTensor) or not isinstance(out, torch.Tensor):
            result = out
        else:
            result = backend.place(out, func not in _UNINITIALISED)
            capture = backend.capture_for_current_stream()
            if capture is not None and backend.backed:
                capture.record_op(func, args, kw, [(-1, result.sim_inner)])
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
            return self.backend.from_host(self_)
        kw = {k: v for k, v in kwargs.items() if k != "copy"}
        device, dtype, _, memory_format = torch._C._nn._parse_to(*args[1:], **kw)
        if device is None or device.type != "cuda":
            return func(*args, **kwargs)
        _check_index(device)
        host = self_
        if dtype is not None and dtype != host.dtype:
            host = host.to(dtype)
        return self.backend.from_host(host)
