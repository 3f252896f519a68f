"""Tensors that live in simulated device memory, and the tables that say how ops run on them.

A :class:`SimTensor` is a wrapper subclass (reported device ``cpu``, as measured: a
reported ``cuda`` breaks slicing and indexing on a CPU build). Its ``sim_inner`` is a
plain CPU view of the bytes of the allocator block it occupies, so ops really read
and write the simulated memory. In layout-only mode ``sim_inner`` is a META tensor:
shapes, strides and allocator state are exact, arithmetic does not happen. A block goes
back to the allocator when the last tensor using it dies (:class:`SimStorage` is the
refcount).

Every torch function on a SimTensor reaches ``__torch_function__``, which answers it from
:data:`FUNCTION_MODELS` when one is registered there (Tensor methods: :mod:`.methods`; CUDA
models of Python-level functions); every aten op reaches ``__torch_dispatch__``, which runs
its CUDA model from :data:`CUDA_MODELS` (:mod:`.cuda_ops`, :mod:`.blas`, :mod:`.attention`,
:mod:`.reductions`), decomposes it as CUDA would, or hands it to the generic path
(:func:`graphborrow.sim.dispatch.dispatch`, which gives each output its home).
"""

from __future__ import annotations

import inspect
import sys
from typing import Any, Callable

import torch

from . import autocast

__all__ = [
    "CUDA_MODELS",
    "FACTORY_MODELS",
    "FUNCTION_MODELS",
    "SimStorage",
    "SimTensor",
    "check_index",
    "is_cuda_device",
    "is_sim_tensor",
    "non_overlapping_and_dense",
    "register_cuda_model",
    "register_factory_model",
    "register_function",
    "set_generic_dispatch",
]

# torch functions answered on simulated tensors (Tensor methods, Python-level CUDA models)
FUNCTION_MODELS: dict[Callable, Callable] = {}
# ops modelled on their CUDA implementation (which backend, which outputs, which temporaries)
CUDA_MODELS: dict = {}
# factories (torch.randperm...) whose CUDA implementation allocates temporaries after the output
FACTORY_MODELS: dict = {}
_COMPOSITE: dict = {}
_DEVICE_IS_CUDA: dict[Any, bool] = {}


def _no_generic_dispatch(func, args, kwargs):
    raise RuntimeError("graphborrow.sim.dispatch was not imported; import graphborrow.sim")


_generic = [_no_generic_dispatch]  # every other op: set by graphborrow.sim.dispatch (it builds SimTensors)


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
        autocast.observe()
        override = FUNCTION_MODELS.get(func)
        if override is not None:
            return override(*args, **(kwargs or {}))
        # the guard lives in C++: no interrupt can leave it on (Note [torch functions off under interrupts])
        return torch._C._disabled_torch_function_impl(_call, types, (func, args, kwargs), None)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if autocast.enabled():  # CUDA autocast's casts first, as its kernel runs before the op's
            planned = autocast.plan_call(func, args, kwargs, SimTensor)
            if planned is not None:
                return planned()
        cuda_model = CUDA_MODELS.get(func)
        if cuda_model is not None:  # an op whose CUDA implementation differs from the CPU one
            return cuda_model(func, args, kwargs)
        if _is_composite(func):  # decompose as CUDA would, so each piece gets its memory
            out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        return _generic[0](func, args, kwargs)


def _call(func, args, kwargs):
    return func(*args, **(kwargs or {}))


def set_generic_dispatch(fn: Callable) -> None:
    """Run every op without a CUDA model through ``fn(func, args, kwargs)`` (graphborrow.sim.dispatch)."""
    _generic[0] = fn


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
                FUNCTION_MODELS[f] = _function_model(f, model, _same_op(f, funcs))
        return model

    return register


def _same_op(f, funcs):
    """The aten overload among ``funcs`` that the Python-level function ``f`` is (by name)."""
    name = getattr(f, "__name__", None)
    return next((op for op in funcs if isinstance(op, torch._ops.OpOverload) and op.overloadpacket.__name__ == name),
                None)


def _function_model(f, model, op):
    """``model`` for the Python-level function ``f``; under CUDA autocast with autograd off, the call
    goes in as the aten op ``op``, so autocast's casts apply to it whole (a composite op would
    otherwise reach the device decomposed)."""

    def call(*args, **kwargs):
        if op is not None and autocast.enabled() and not torch.is_grad_enabled():
            return SimTensor.__torch_dispatch__(op, (), (), _aten_arguments(f, op, args, kwargs))
        return model(f, args, kwargs)

    return call


def _aten_arguments(f, op, args, kwargs) -> dict:
    """A call of the Python-level ``f`` as keyword arguments of its aten overload ``op``."""
    try:
        bound = inspect.signature(f).bind(*args, **kwargs)
    except (TypeError, ValueError):  # a builtin binding: the schema's own order and names
        names = [a.name for a in op._schema.arguments]
        return dict(zip(names, args), **kwargs)
    given = dict(bound.arguments)
    if "input" in given and "input" not in [a.name for a in op._schema.arguments]:
        given["self"] = given.pop("input")
    out = {a.name: given[a.name] for a in op._schema.arguments if a.name in given}
    if "dim" in out and out["dim"] is None:  # F.softmax's legacy implicit dim
        out["dim"] = 0 if out["self"].dim() in (0, 1, 3) else 1
    return out


def register_function(*funcs):
    """Answer the torch functions ``funcs`` (Tensor methods, properties) on simulated tensors with
    ``fn(*args, **kwargs)``, called in place of torch's."""

    def register(fn):
        for f in funcs:
            FUNCTION_MODELS[f] = fn
        return fn

    return register


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


def non_overlapping_and_dense(t) -> bool:
    """No gaps and no overlaps: some permutation of the dims is contiguous (as empty_like checks)."""
    expected = 1
    for size, stride in sorted(((n, st) for n, st in zip(t.shape, t.stride()) if n != 1), key=lambda p: p[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def is_cuda_device(dev) -> bool:
    """Whether ``dev`` (a device, a string or an index) names the simulated GPU, ``cuda:0``."""
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
            check_index(d)
    else:
        return False
    try:
        _DEVICE_IS_CUDA[dev] = result
    except TypeError:
        pass
    return result


def check_index(d: torch.device) -> None:
    """Refuse any CUDA device but the one simulated GPU."""
    if d.index not in (None, 0):
        raise RuntimeError(
            f"the simulated device is a single GPU (cuda:0); got {d}. Use device='cuda'."
        )
