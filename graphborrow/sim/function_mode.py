"""``device="cuda"`` means the simulated device: the TorchFunctionMode pushed while a backend is
active on a thread.

Factory calls with ``device="cuda"`` run on META (or, small and with defined values, on the
CPU) and their output is placed in a simulated block; ``.to("cuda")`` / ``.cuda()`` of a host
tensor copies it in under CUDA's capture rules (:mod:`graphborrow.sim.host`); ``pin_memory``
marks host tensors pinned. Code written for CUDA runs unchanged.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from . import host
from .dispatch import UNINITIALISED, launch_kernel
from .tensor import FACTORY_MODELS, SimTensor, check_index, is_cuda_device
from .values import keeps_values

__all__ = ["SimFunctionMode"]


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
            if dev is not None and is_cuda_device(dev):
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
        if (not backend.backed and isinstance(out, torch.Tensor) and out.is_meta and func not in UNINITIALISED
                and keeps_values(out)):
            kw["device"] = "cpu"  # small and with defined values: made again on the CPU, with its values
            out = func(*args, **kw)
        if isinstance(out, SimTensor) or not isinstance(out, torch.Tensor):
            result = out
        elif func in _FROM_PYTHON_DATA:
            result = host.from_python_data(backend, out)
        else:
            result = backend.place(out, func not in UNINITIALISED)
            result.sim_storage is not None and setattr(result.sim_storage, "origin", func)
            capture = backend.capture_for_current_stream()
            if capture is not None and (backend.backed or not result.sim_inner.is_meta):
                capture.record_op(func, args, kw, [(-1, result.sim_inner)])
            if capture is not None and func not in UNINITIALISED:
                launch_kernel(backend)
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
                check_index(torch.device("cuda", dev) if isinstance(dev, int) else torch.device(dev))
            return self._from_host(self_, kwargs.get("non_blocking", args[2] if len(args) > 2 else False))
        kw = {k: v for k, v in kwargs.items() if k != "copy"}
        device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args[1:], **kw)
        if device is None or device.type != "cuda":
            return func(*args, **kwargs)
        check_index(device)
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
        launch_kernel(backend)  # the copy
        return placed
