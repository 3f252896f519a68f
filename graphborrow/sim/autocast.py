"""CUDA autocast on simulated tensors: ``torch.autocast("cuda")`` casts as it does on a GPU.

A simulated tensor reports device ``cpu`` to the dispatcher, so torch's AutocastCUDA kernels,
which cast only CUDA tensors, never run for it. Here each op call that has an AutocastCUDA
kernel learns what that kernel does from the kernel itself: it is called once on probe tensors
(wrappers that report ``cuda``, one per tensor argument, with the same dtypes) and the probes
record which arguments it casts to which dtype, in order, and the call it makes then (with a
``dtype`` appended, or another overload). That plan, cached per op and argument dtypes, is then
carried out on the simulated tensors: the casts allocate their copies where CUDA's do, with
autocast's cache of lower-precision casts of float32 leaf tensors that require grad (model
weights) until the outermost autocast region ends (``torch.clear_autocast_cache``). The casting
rules are torch's own, of the installed version; nothing here lists them.

Ops reach the simulated device whole in inference mode; with autograd on, a composite op
(``group_norm``) reaches it already decomposed, and its pieces are cast by their own rules. The
Python-level CUDA models (``linear``, ``softmax``, ``layer_norm``, ``rms_norm``, ...) see the op
whole in every mode and apply its plan before the kernels under it, as CUDA's autocast kernel
runs before autograd.
"""

from __future__ import annotations

import threading
import weakref

import torch

__all__ = ["clear_cache", "enabled", "observe", "plan_call"]

_AUTOCAST_CUDA = torch._C.DispatchKey.AutocastCUDA
_INSIDE_DISPATCH = torch._C.DispatchKey.PythonTLSSnapshot  # excluded only while a Python key handler runs
_excluded = torch._C._dispatch_tls_is_dispatch_key_excluded
_HAS_KERNEL: dict = {}
_PLANS: dict = {}
_NO_PLAN = object()  # the op has no autocast kernel, or it does nothing for these dtypes
_state = threading.local()  # .inside: an autocast plan is being carried out on this thread
_cache: dict[int, tuple] = {}  # id(weight) -> (weakref to it, its cast)
_original_clear = torch.clear_autocast_cache
_CASTS = {torch.ops.aten.to.dtype, torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype_layout,
          torch.ops.aten.to.device}


def observe() -> None:
    """Note whether CUDA autocast is on, where torch can tell: at a torch function's entry (inside
    ``__torch_dispatch__`` every key above Python, autocast's included, is excluded)."""
    if not _excluded(_INSIDE_DISPATCH):
        _state.on = not _excluded(_AUTOCAST_CUDA)


def enabled() -> bool:
    """Whether CUDA autocast was on at the torch function this op belongs to, and no plan of it is
    being carried out already (the kernel excludes itself for the call it makes)."""
    return getattr(_state, "on", False) and not getattr(_state, "inside", False)


def clear_cache() -> None:
    """``torch.clear_autocast_cache``: torch's cache and the casts kept for simulated weights."""
    _cache.clear()
    _original_clear()


class _Probe(torch.Tensor):
    """Stands for argument ``slot`` (cast to ``dtype`` by the kernel, or as given) inside a probe call."""

    @staticmethod
    def __new__(cls, like: torch.Tensor, slot: int, dtype: torch.dtype, cast: bool):
        probe = torch.Tensor._make_wrapper_subclass(cls, like.shape, strides=like.stride(), dtype=dtype,
                                                    device="cuda", requires_grad=False)
        probe.slot, probe.cast, probe.like = slot, cast, like
        return probe

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return torch._C._disabled_torch_function_impl(func, types, args, kwargs or {})

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _CASTS and isinstance(args[0], _Probe):
            dtype = kwargs.get("dtype", next((a for a in args[1:] if isinstance(a, torch.dtype)), None))
            source = args[0]
            if dtype is None or dtype == source.dtype:
                return source
            _state.casts.append((source.slot, dtype))
            return _Probe(source.like, source.slot, dtype, True)
        raise _Called(func, args, kwargs)


class _Called(Exception):
    """The probe call reached the op the kernel calls after casting (with its arguments)."""

    def __init__(self, func, args, kwargs) -> None:
        super().__init__()
        self.call = (func, args, kwargs)


def _flatten(args, kwargs) -> list:
    """The tensors of a call in order (lists of tensors, as ``cat`` takes, included)."""
    found = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(v for v in value if isinstance(v, torch.Tensor))
    return found


def _signature(value, sim_type):
    if isinstance(value, sim_type):
        return ("sim", value.dtype)
    if isinstance(value, torch.Tensor):
        return ("host", value.dtype, value.dim())
    if isinstance(value, (list, tuple)):
        return tuple(_signature(v, sim_type) for v in value)
    if value is None or isinstance(value, (bool, torch.dtype)):
        return value
    return type(value)


def _probe_args(value, sim_type, slots: list):
    if isinstance(value, sim_type):
        slots.append(value)
        return _Probe(value, len(slots) - 1, value.dtype, False)
    if isinstance(value, (list, tuple)) and any(isinstance(v, sim_type) for v in value):
        return type(value)(_probe_args(v, sim_type, slots) for v in value)
    return value


def _template(value):
    """The kernel's call with each probe as ``(slot, cast)``."""
    if isinstance(value, _Probe):
        return _Slot(value.slot, value.dtype if value.cast else None)
    if isinstance(value, (list, tuple)):
        return type(value)(_template(v) for v in value)
    return value


class _Slot:
    __slots__ = ("slot", "dtype")

    def __init__(self, slot: int, dtype) -> None:
        self.slot, self.dtype = slot, dtype


def _learn(func, args, kwargs, sim_type):
    """The plan of ``func``'s AutocastCUDA kernel for these arguments: ``(casts, func2, args2, kwargs2)``."""
    slots: list = []
    probe_args = tuple(_probe_args(a, sim_type, slots) for a in args)
    probe_kwargs = {k: _probe_args(v, sim_type, slots) for k, v in kwargs.items()}
    _state.casts = []
    try:
        with torch.inference_mode():  # composite ops reach the probes whole
            func._op_dk(_AUTOCAST_CUDA, *probe_args, **probe_kwargs)
    except _Called as called:
        func2, args2, kwargs2 = called.call
        casts = tuple(_state.casts)
        if not casts and func2 is func and len(args2) == len(args) and set(kwargs2) == set(kwargs):
            return _NO_PLAN  # called as it was: nothing to do
        return casts, func2, _template(tuple(args2)), {k: _template(v) for k, v in kwargs2.items()}
    except RuntimeError as exc:
        if "not linked with support for cuda" in str(exc):
            return _NO_PLAN  # the kernel took a CUDA-only path on the probes; leave the call as it is
        raise  # the kernel's own refusal (a banned op): CUDA's message
    finally:
        _state.casts = []
    return _NO_PLAN


def plan_call(func, args, kwargs, sim_type):
    """CUDA autocast's version of ``func(*args, **kwargs)`` on simulated tensors, or None.

    Args:
        func: an aten overload reached by a simulated tensor while :func:`enabled`.
        args, kwargs: its arguments.
        sim_type: the simulated tensor class.

    Returns:
        None when autocast leaves the call alone; else a function of no arguments that makes
        the casts and calls the op the kernel calls (with autocast off for it, as the kernel
        excludes itself).
    """
    has = _HAS_KERNEL.get(func)
    if has is None:
        has = _HAS_KERNEL[func] = torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), _AUTOCAST_CUDA)
    if not has:
        return None
    key = (func, torch.get_autocast_dtype("cuda"), tuple(_signature(a, sim_type) for a in args),
           tuple((k, _signature(v, sim_type)) for k, v in kwargs.items()))
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = _learn(func, args, kwargs, sim_type)
    if plan is _NO_PLAN:
        return None
    casts, func2, args2, kwargs2 = plan
    tensors = [t for t in _flatten(args, kwargs) if isinstance(t, sim_type)]

    def run():
        _state.inside = True
        try:
            cast = {}
            for slot, dtype in casts:
                cast[slot] = _cast(tensors[slot], dtype)
            out = func2(*_fill(args2, tensors, cast), **{k: _fill(v, tensors, cast) for k, v in kwargs2.items()})
            for slot, _ in reversed(casts):  # C++ destroys the kernel's temporaries in reverse order of making
                cast.pop(slot, None)
            return out
        finally:
            _state.inside = False

    return run


def _fill(value, tensors, cast):
    """The kernel's call with each slot given its tensor (cast when the kernel cast it)."""
    if isinstance(value, _Slot):
        return cast[value.slot] if value.dtype is not None else tensors[value.slot]
    if isinstance(value, (list, tuple)):
        return type(value)(_fill(v, tensors, cast) for v in value)
    return value


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``cached_cast``: lower-precision casts of float32 weights (leaves that require grad) are kept
    for the autocast region, every other cast is made anew."""
    cacheable = (dtype == torch.get_autocast_dtype("cuda") and t.dtype == torch.float32 and t.requires_grad
                 and t.is_leaf and not t._is_view() and torch.is_autocast_cache_enabled())
    if not cacheable:
        return t.to(dtype)
    kept = _cache.get(id(t))
    if kept is not None and kept[0]() is t:
        return kept[1]
    cast = t.to(dtype)
    _cache[id(t)] = (weakref.ref(t), cast)
    return cast
