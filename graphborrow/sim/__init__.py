"""The simulated CUDA device: PyTorch's caching allocator, streams, graphs and tensors on CPU.

``SimBackend`` has the methods of :class:`graphborrow.backend.CudaBackend`, so the rest of
graphborrow runs unchanged on an H200 and on a machine without a GPU.
"""

from . import compiled

compiled.install()  # the Cython build of allocator.py when one matches the source

from . import cuda_ops  # noqa: F401  (registers CUDA op models)
from .device import MemPool, SimBackend, SimEvent
from .tensor import SimCaptureError, SimLayoutOnlyError, SimTensor, is_sim_tensor

__all__ = [
    "MemPool",
    "SimBackend",
    "SimCaptureError",
    "SimEvent",
    "SimLayoutOnlyError",
    "SimTensor",
    "is_sim_tensor",
    "load_trace",
    "replay_trace",
]


def __getattr__(name):
    # replay.py is optional at import time and pulls in more than most callers need
    if name in ("replay_trace", "ReplayReport", "load_trace"):
        from . import replay

        return getattr(replay, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
