"""Tensor methods and properties of a simulated tensor, answered as on a CUDA tensor.

``x.device`` is ``cuda:0``, ``is_cuda`` is True, ``.cpu()`` / ``.tolist()`` copy to the host
(refused inside a capture), ``.to(dtype)`` converts on the device, ``param.data = x`` swaps
storages as ``Module._apply`` does, ``data_ptr()`` is the simulated address and
``record_stream`` defers the block's free, ``copy.deepcopy`` copies into a new block of the storage's
size, and DLPack (which would hand out a device pointer no host code can read) is refused by
name. Registered in
:data:`graphborrow.sim.tensor.FUNCTION_MODELS` when :mod:`graphborrow.sim` is imported.
"""

from __future__ import annotations

import copy

import torch

from . import host
from .tensor import SimTensor, check_index, is_cuda_device, register_cuda_model, register_function
from .torch_function import torch_functions_off

__all__ = ["DLPACK_REFUSED", "to_dlpack"]


@register_function(torch.Tensor.cpu)
def _cpu(self, memory_format=torch.preserve_format):
    return host.to_host(self)


@register_function(torch.Tensor.to)
def _to(self, *args, **kwargs):
    copy = kwargs.pop("copy", False)
    device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
    if device is not None and device.type == "cpu":
        moved = host.to_host(self)
        return moved.to(dtype=dtype or moved.dtype, memory_format=memory_format or torch.preserve_format)
    if device is not None and device.type != "cuda":
        raise RuntimeError(f"a simulated CUDA tensor can move to 'cpu' or stay on 'cuda', not {device}")
    if device is not None:
        check_index(device)
    kw = {"copy": copy}
    if memory_format is not None:
        kw["memory_format"] = memory_format
    with torch_functions_off(subclasses_only=True):
        if dtype is None:
            return torch.Tensor.to(self, self.dtype, **kw)
        return torch.Tensor.to(self, dtype, **kw)


@register_function(torch.Tensor.cuda)
def _cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
    if device is not None:
        check_index(torch.device("cuda", device) if isinstance(device, int) else torch.device(device))
    return self


@register_function(torch.Tensor.data.__set__)
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


@register_function(torch._has_compatible_shallow_copy_type)
def _compatible_shallow_copy(tensor, other) -> bool:
    """A host parameter moved to the simulated device is replaced by a new Parameter (as
    ``Module._apply`` does for tensors of another kind), not given the device tensor's data."""
    return isinstance(tensor, SimTensor) == isinstance(other, SimTensor)


@register_function(torch.Tensor.record_stream)
def _record_stream(self, stream) -> None:
    self.sim_backend.record_stream(self, getattr(stream, "sim_stream", stream))


@register_function(torch.Tensor.pin_memory)
def _pin_memory(self, device=None):
    raise RuntimeError(f"cannot pin '{self.type()}' only dense CPU tensors can be pinned")


@register_function(torch.Tensor.is_pinned)
def _is_pinned(self, device=None) -> bool:
    return False


@register_function(torch.Tensor.type)
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


@register_function(torch.Tensor.device.__get__)
def _device(self):
    """Python code sees ``cuda:0`` (so ``.to(x.device)`` and ``device=x.device`` stay on the
    simulated device, as model code expects); the dispatcher still sees the CPU wrapper."""
    return _SIM_CUDA


@register_function(torch.Tensor.is_cuda.__get__)
def _is_cuda_attr(self):
    return True


@register_function(torch.Tensor.is_cpu.__get__)
def _is_cpu_attr(self):
    return False


@register_function(torch.Tensor.numpy, torch.Tensor.__array__)
def _numpy(self, *args, **kwargs):
    raise TypeError(
        "can't convert a (simulated) cuda:0 device type tensor to numpy. Use Tensor.cpu() "
        "to copy the tensor to host memory first."
    )


@register_function(torch.Tensor.tolist)
def _tolist(self):
    return host.to_host(self).tolist()


@register_function(torch.Tensor.data_ptr)
def _data_ptr(self):
    return self.sim_backend.data_ptr(self)


@register_function(torch.Tensor.new_tensor)
def _new_tensor(self, data, dtype=None, device=None, requires_grad=False, **kwargs):
    if device is not None and not is_cuda_device(device):
        return torch.tensor(data, dtype=dtype or self.dtype, device=device)
    plain = torch.tensor(data, dtype=dtype or self.dtype, requires_grad=False)
    return host.from_python_data(self.sim_backend, plain)


@register_function(torch.Tensor.__repr__)
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


@register_function(torch.Tensor.__reduce_ex__)
def _reduce_ex(self, proto):
    raise TypeError("a simulated CUDA tensor cannot be pickled; call .cpu() first")


@register_function(torch.Tensor.__deepcopy__)
def _deepcopy(self, memo):
    """``copy.deepcopy``: as on CUDA, the whole storage is copied into a new block of its size (tensors
    sharing a storage in one deepcopy share the copy), and the tensor's own attributes are deep-copied."""
    if not self.is_leaf:
        raise RuntimeError("Only Tensors created explicitly by the user (graph leaves) support the deepcopy "
                           "protocol at the moment.")
    if id(self) in memo:
        return memo[id(self)]
    with torch.no_grad():
        new = self.sim_backend.deep_copy(self, memo)
    new.requires_grad_(self.requires_grad)
    for name, value in vars(self).items():
        if not name.startswith("sim_"):
            setattr(new, name, copy.deepcopy(value, memo))
    if self.grad is not None:
        new.grad = copy.deepcopy(self.grad, memo)
    memo[id(self)] = new
    return new


@register_cuda_model(torch.ops.aten.set_.source_Storage, torch.ops.aten.set_.source_Storage_storage_offset)
def _set_storage(func, args, kwargs):
    """A simulated tensor's torch storage is the wrapper's empty one, never its device memory: a tensor
    set onto it would read memory that does not exist (the interpreter crashed)."""
    raise NotImplementedError(
        "set_(storage) onto a simulated CUDA tensor is not simulated: the simulated device's tensors have no "
        "torch storage (untyped_storage() is an empty placeholder). Share memory with a view or "
        "set_(other_tensor) instead")


DLPACK_REFUSED = ("a simulated CUDA tensor has no device memory another library could read through DLPack "
                  "(torch.from_dlpack, __dlpack__, to_dlpack); copy it to the host with .cpu() and share that")


@register_function(torch.Tensor.__dlpack__, torch.Tensor.__dlpack_device__)
def _dlpack(self, *args, **kwargs):
    raise BufferError(DLPACK_REFUSED)


_to_dlpack = torch.utils.dlpack.to_dlpack


def to_dlpack(tensor):
    """``torch.utils.dlpack.to_dlpack`` (a C function, which no tensor override reaches): refused for a
    simulated tensor, torch's own otherwise (installed with the simulated device)."""
    if isinstance(tensor, SimTensor):
        raise BufferError(DLPACK_REFUSED)
    return _to_dlpack(tensor)
