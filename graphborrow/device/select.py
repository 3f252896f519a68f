"""Which device a run uses: the real CUDA device, or the simulated one when there is none.

    backend = get_backend("auto")           # CUDA when torch sees a GPU, else the simulator
    backend = get_backend("sim", backed=False)   # layout only: real shapes in seconds
"""

from __future__ import annotations

import functools

import torch

from graphborrow.core.device_api import DeviceAPI
from graphborrow.sim import SimBackend

from .cuda import CudaBackend

__all__ = ["CUDA", "SIM", "cuda_available", "get_backend"]

CUDA = "cuda"
SIM = "sim"


def cuda_available() -> bool:
    """Whether torch sees a CUDA device.

    Returns:
        ``torch.cuda.is_available()``; ``get_backend("auto")`` picks the simulated device when False.
    """
    return torch.cuda.is_available()


@functools.lru_cache(maxsize=None)
def _cuda_backend() -> CudaBackend:
    return CudaBackend()


def get_backend(kind: str = "auto", **sim_options) -> DeviceAPI:
    """The device for ``"cuda"``, ``"sim"`` or ``"auto"`` (CUDA when present).

    Args:
        kind: which device.
        sim_options: ``capacity``, ``backed``, ... for a fresh simulated device; the CUDA
            backend is a per-process singleton, as the device is.

    Returns:
        A :class:`~graphborrow.core.device_api.DeviceAPI` implementation.

    Raises:
        ValueError: ``kind`` is not ``"auto"``, ``"cuda"`` or ``"sim"``.
        RuntimeError: ``"cuda"`` was asked for on a machine without CUDA.
    """
    kind = (kind or "auto").lower()
    if kind not in ("auto", CUDA, SIM):
        raise ValueError(f"device must be 'auto', 'cuda' or 'sim', got {kind!r}")
    if kind == "auto":
        kind = CUDA if cuda_available() else SIM
    if kind == CUDA:
        return _cuda_backend()
    return SimBackend(**sim_options)
