"""The simulated CUDA device: PyTorch's caching allocator, streams, graphs and tensors on CPU.

``SimBackend`` has the methods of :class:`graphborrow.device.cuda.CudaBackend`, so the rest of
graphborrow runs unchanged on an H200 and on a machine without a GPU.
"""

from . import blas, cuda_ops, dispatch, foreach, methods, modules, reductions  # noqa: F401  (register CUDA op models, methods)
from .device import MemPool, SimBackend, SimEvent
from .tensor import SimTensor, is_sim_tensor
from .values import SimLayoutOnlyError

__all__ = [
    "MemPool",
    "SimBackend",
    "SimEvent",
    "SimLayoutOnlyError",
    "SimTensor",
    "is_sim_tensor",
]

