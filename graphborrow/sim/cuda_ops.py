"""Ops whose CUDA kernels accept inputs their CPU kernels refuse, modelled for the simulated device.

Model code branches on ``tensor.device.type``; simulated tensors answer ``cuda``, so it
takes its CUDA branch and may call a kernel with a dtype only CUDA implements (e.g.
transformers' grouped-GEMM experts call ``torch.histc`` on int32 expert ids on CUDA, float
on CPU). Each model here computes the same values by a CPU route and allocates exactly
the output CUDA allocates.
"""

from __future__ import annotations

import contextlib

import torch

from .tensor import _dispatch, register_cuda_model

__all__ = ["H200_CAPABILITY", "device_queries", "histc_any_dtype"]


def histc_any_dtype(x, bins=100, min=0, max=0):
    """``torch.histc`` for integer inputs too (CUDA supports them; the CPU kernel does not)."""
    if x.is_floating_point():
        return torch.histc(x, bins=bins, min=min, max=max)
    return torch.histc(x.double(), bins=bins, min=min, max=max).to(x.dtype)


@register_cuda_model(torch.ops.aten.histc.default)
def _histc(func, args, kwargs):
    return _dispatch(histc_any_dtype, args, kwargs)


H200_CAPABILITY = (9, 0)


@contextlib.contextmanager
def device_queries(capability: tuple[int, int] = H200_CAPABILITY):
    """Answer ``torch.cuda.get_device_capability`` as the simulated GPU would, for a block.

    Model code asks it to choose kernels (transformers' grouped GEMM needs sm80+); a CPU
    build has no CUDA to ask. Only this query is answered: everything else about CUDA
    stays unavailable, so nothing else silently takes a GPU path.
    """
    original = torch.cuda.get_device_capability

    def get_device_capability(device=None):
        return capability

    torch.cuda.get_device_capability = get_device_capability
    try:
        yield
    finally:
        torch.cuda.get_device_capability = original
