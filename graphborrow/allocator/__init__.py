"""A model of PyTorch's CUDA caching allocator, shared by the simulated device and the planner.

Importing this package loads the Cython build of :mod:`.caching` when an intact one matches
its source (see :mod:`.compiled`), before anything imports the model itself.
"""

from . import compiled

compiled.install()

__all__ = ["compiled"]
