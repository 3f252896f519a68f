"""Which device a run uses: the real CUDA device, or the simulated one when there is none.

    backend = use_device("auto")            # torch.cuda itself is the GPU, or the simulated device
    backend = get_backend("auto")           # CUDA when torch sees a GPU, else the simulator
    backend = get_backend("sim", backed=False)   # layout only: real shapes in seconds
"""

from __future__ import annotations

import functools

import torch

from graphborrow.core.device_api import DeviceAPI
from graphborrow.core.errors import ParameterError
from graphborrow.sim import SimBackend, cuda_api
from graphborrow.sim.device import H200_MEMORY

from .cuda import CudaBackend

__all__ = ["CUDA", "SIM", "cuda_available", "get_backend", "use_device"]

CUDA = "cuda"
SIM = "sim"


def cuda_available() -> bool:
    """Whether torch sees a CUDA device.

    Returns:
        ``torch.cuda.is_available()`` of torch itself (a simulated device answering for
        ``torch.cuda`` is not a GPU); ``get_backend("auto")`` picks the simulated device when False.
    """
    return cuda_api.gpu_available()


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
        installed = cuda_api.installed()
        if installed is not None and not sim_options:  # torch.cuda is a simulated device: that one
            return installed.backend
        kind = CUDA if cuda_available() else SIM
    if kind == CUDA:
        return _cuda_backend()
    return SimBackend(**sim_options)


class _Used:
    """What :func:`use_device` installed last: its options and the device."""

    options: tuple | None = None
    backend: SimBackend | None = None


def use_device(device: str = "auto", layout_only: bool | None = None, capacity: int | None = None) -> DeviceAPI:
    """Make ``torch.cuda`` a device for the rest of the process: the GPU, or the simulated one.

    A notebook's first cell calls it, and then uses ``torch.cuda`` itself (``graph_pool_handle``,
    ``CUDAGraph``, ``MemPool``, ``memory_snapshot``...). On a GPU ``torch.cuda`` is left untouched.
    On the simulated device (:func:`graphborrow.sim.cuda_api.install`) every thread started from
    now on sees it too. Calling it again with the same arguments (a re-run cell) gives the same
    device back and installs nothing; other arguments install a fresh simulated device in its
    place (tensors of the old one keep their memory, on the old device).

    Args:
        device: ``"auto"`` (the GPU when torch sees one, else the simulated device), ``"cuda"``
            (a GPU, or an error) or ``"sim"`` (the simulated device, even on a GPU machine).
        layout_only: on the simulated device, keep addresses and sizes only (True: Llama-3-8B
            shapes in seconds) or real bytes (False; None means False). A GPU always has bytes.
        capacity: the simulated device's memory in bytes (None: an H200's, 150109880320).

    Returns:
        The backend: ``.simulated`` says which, ``.describe()`` is a line to print.

    Raises:
        ParameterError: an unknown ``device``; ``layout_only=True`` or a ``capacity`` for the GPU; a
            capacity the simulated device cannot have.
        RuntimeError: ``"cuda"`` on a machine where torch sees no GPU.
    """
    kind = (device or "auto").lower() if isinstance(device, str) else device
    if kind not in ("auto", CUDA, SIM):
        raise ParameterError(f"device must be 'auto', 'cuda' or 'sim', got {device!r}")
    if kind == "auto":
        kind = CUDA if cuda_available() else SIM
    if kind == CUDA:
        if layout_only:
            raise ParameterError("layout_only=True applies to the simulated device; a GPU always has bytes "
                                 "(use device='sim' to run layout-only)")
        if capacity is not None:
            raise ParameterError("capacity applies to the simulated device; a GPU has the memory it has "
                                 "(use device='sim' to choose one)")
        backend = _cuda_backend()  # refuses before anything is undone when there is no GPU
        if _Used.backend is not None:
            cuda_api.uninstall(cuda_api.installed() if _installed_here() else None)
            _Used.options = _Used.backend = None
        return backend
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0):
        raise ParameterError(f"capacity must be a positive whole number of bytes, got {capacity!r}")
    options = (bool(layout_only), H200_MEMORY if capacity is None else capacity)
    if _Used.options == options and _installed_here() and not _Used.backend.closed:
        return _Used.backend
    try:
        backend = SimBackend(capacity=options[1], backed=not options[0], activate=False)
    except ValueError as exc:
        raise ParameterError(str(exc)) from None
    if _installed_here():
        cuda_api.uninstall(cuda_api.installed())
    cuda_api.install(backend)
    _Used.options, _Used.backend = options, backend
    return backend


def _installed_here() -> bool:
    """Whether the device :func:`use_device` installed still answers for ``torch.cuda``."""
    current = cuda_api.installed()
    return current is not None and _Used.backend is not None and current.backend is _Used.backend
