"""The devices graphborrow runs on: the real CUDA device, and the choice between it and the simulator.

Both implement :class:`~graphborrow.core.device_api.DeviceAPI`; the simulated one lives in
:mod:`graphborrow.sim`.
"""

from .cuda import CudaBackend
from .select import CUDA, SIM, cuda_available, get_backend

__all__ = ["CUDA", "SIM", "CudaBackend", "cuda_available", "get_backend"]
