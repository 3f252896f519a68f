"""``nn.Module`` conversions onto the simulated device keep shared parameters shared.

On a GPU, ``Module._apply`` (``.cuda()``, ``.to("cuda", dtype)``, ``.half()`` ...) converts a
host parameter in place (``param.data = converted``): a parameter two modules hold (an output
head tied to the embedding) is converted at its first visit, and at its second it is already on
the device, so it stays one tensor. A host tensor cannot take a simulated tensor's data, so
here ``_apply`` puts a new Parameter in the module instead, and the second visit would convert
the host parameter again: two device copies. While a module is converted, each host parameter
(and its gradient) is therefore converted once, and every slot that held it gets the same new
Parameter, as on the GPU. Buffers are replaced per slot by torch on every device, and stay so.
"""

from __future__ import annotations

import threading

import torch

from .tensor import SimTensor

__all__ = ["install"]

_ORIGINAL_APPLY = torch.nn.Module._apply
_state = threading.local()  # .converting: an outer _apply is under way on this thread


def _apply(self, fn, recurse=True):
    if getattr(_state, "converting", False) or torch.__future__.get_overwrite_module_params_on_conversion():
        return _ORIGINAL_APPLY(self, fn, recurse)
    modules = list(self.modules()) if recurse else [self]
    slots = [(m, key, p) for m in modules for key, p in m._parameters.items() if p is not None]
    shared = {id(p) for _, _, p in slots} | {id(p.grad) for _, _, p in slots if p.grad is not None}
    converted: dict[int, tuple] = {}  # id(host tensor) -> (host tensor, its device tensor)

    def once(t):
        if id(t) in shared and not isinstance(t, SimTensor):
            hit = converted.get(id(t))
            if hit is not None and hit[0] is t:
                return hit[1]
            out = fn(t)
            if isinstance(out, SimTensor):
                converted[id(t)] = (t, out)
            return out
        return fn(t)

    _state.converting = True
    try:
        result = _ORIGINAL_APPLY(self, once, recurse)
    finally:
        _state.converting = False
    if converted:
        first: dict[int, torch.nn.Parameter] = {}
        for m, key, p in slots:
            new = m._parameters.get(key)
            if new is not p and id(p) in converted:
                kept = first.setdefault(id(p), new)
                if kept is not new:
                    m._parameters[key] = kept
    return result


def install() -> None:
    """Have ``torch.nn.Module._apply`` keep host parameters shared when they move onto a simulated
    device (idempotent; modules on other devices convert exactly as before)."""
    torch.nn.Module._apply = _apply


install()
