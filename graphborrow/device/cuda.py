"""The real device: :class:`CudaBackend` implements :class:`~graphborrow.core.device_api.DeviceAPI`
over ``torch.cuda``.

Everything in graphborrow that touches device memory goes through a backend, so the
borrow state, the EAGLE sampler and the workload run unchanged on an H200 and on a
CPU-only machine. The names mirror ``torch.cuda``; only what the project needs is here.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from typing import Any

import torch

from graphborrow.core.arena import BumpArena
from graphborrow.core.device_api import DeviceAPI, ExternalBuffer
from graphborrow.core.interrupts import CRITICAL, CRITICAL_ENTRY
from graphborrow.sim.cuda_api import gpu_available

__all__ = ["CudaBackend", "ExternalBuffer"]


class CudaBackend(DeviceAPI):
    """The real device: thin wrappers over ``torch.cuda`` (the contract: :class:`DeviceAPI`).

    Get it from :func:`~graphborrow.device.select.get_backend` (one per process, as the device is). Sizes are bytes
    and streams are ``torch.cuda.Stream`` objects throughout.

    Raises:
        RuntimeError: torch sees no CUDA device (use the simulated device instead).
    """

    name = "cuda"
    device = "cuda"
    backed = True
    simulated = False
    OutOfMemoryError = torch.cuda.OutOfMemoryError

    def __init__(self) -> None:
        if not gpu_available():  # torch's own answer: a simulated device answering torch.cuda is no GPU
            raise RuntimeError(
                "CUDA backend requested but torch.cuda.is_available() is False; "
                "use device='sim' (or 'auto') to run on the simulated device"
            )
        self._index = torch.cuda.current_device()
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        alloc = getattr(torch._C, "_cuda_cudaCachingAllocator_raw_alloc", None)
        delete = getattr(torch._C, "_cuda_cudaCachingAllocator_raw_delete", None)
        # private fast paths (a few µs per borrow); public API when a torch lacks them
        self._raw_stream = (lambda: raw(self._index)) if raw else (lambda: torch.cuda.current_stream().cuda_stream)
        if alloc and delete:
            self._touch = lambda: delete(alloc(1, self._raw_stream()))
        else:
            self._touch = lambda: torch.empty(1, device="cuda")

    # streams and synchronisation
    def current_stream(self):
        return torch.cuda.current_stream()

    def current_stream_key(self) -> int:
        return self._raw_stream()

    def Stream(self, priority: int = 0):
        return torch.cuda.Stream(priority=priority)

    def stream(self, s):
        return torch.cuda.stream(s)

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def sleep(self, stream, microseconds: float) -> None:
        # converted to clock cycles at the device's nominal clock rate: the time is approximate
        cycles = int(microseconds * torch.cuda.get_device_properties(0).clock_rate / 1e3)
        with torch.cuda.stream(stream):
            torch.cuda._sleep(max(cycles, 1))

    def touch(self) -> None:
        self._touch()

    def clear_library_workspaces(self) -> None:
        """Release the cuBLAS workspaces torch keeps per stream (they are made again on demand)."""
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is None:
            raise RuntimeError("this torch build cannot release cuBLAS workspaces (no _cuda_clearCublasWorkspaces)")
        clear()

    # pools
    def graph_pool_handle(self):
        return torch.cuda.graph_pool_handle()

    def CUDAGraph(self):
        return torch.cuda.CUDAGraph()

    def graph(self, g, pool=None, stream=None):
        return torch.cuda.graph(g, pool=pool, stream=stream)

    def arena_pool(self, arena: BumpArena):
        # torch's pluggable allocator over the arena's C functions
        return torch.cuda.MemPool(arena.allocator)

    def use_mem_pool(self, pool):
        return torch.cuda.use_mem_pool(pool)

    def route_to_pool(self, pool):
        # use_mem_pool without its generator's overhead: the borrow scope enters this every decode step
        # (never during a capture), so it calls the allocator's routing hooks directly when torch has them
        if _ROUTING_HOOKS is None:
            return torch.cuda.use_mem_pool(pool)
        return _PoolRouting(self._index, pool.id)

    def pool_id(self, pool) -> tuple[int, int]:
        return tuple(pool.id)

    def memory_snapshot(self, pool_id=None) -> list[dict]:
        if pool_id is None:
            return torch.cuda.memory_snapshot()
        try:
            return torch.cuda.memory_snapshot(mempool_id=pool_id, include_traces=False)
        except TypeError:  # torch < 2.10 has no include_traces
            return torch.cuda.memory_snapshot(mempool_id=pool_id)

    def memory_stats(self) -> dict[str, Any]:
        return torch.cuda.memory_stats()

    def memory_reserved(self) -> int:
        return torch.cuda.memory_reserved()

    def memory_allocated(self) -> int:
        return torch.cuda.memory_allocated()

    def mem_get_info(self) -> tuple[int, int]:
        return torch.cuda.mem_get_info()

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def record_stream(self, tensor, stream) -> None:
        tensor.record_stream(stream)

    def data_ptr(self, tensor) -> int:
        return tensor.data_ptr()

    def describe(self) -> str:
        return f"{torch.cuda.get_device_name()} (torch {torch.__version__})"

    def MemPool(self, allocator=None, use_on_oom=False, no_split=False):
        # no_split is passed only when True, so torch versions without it still work
        kwargs = {}
        if use_on_oom:
            kwargs["use_on_oom"] = True
        if no_split:
            kwargs["no_split"] = True
        return torch.cuda.MemPool(allocator, **kwargs)

    def Event(self, enable_timing: bool = False):
        return torch.cuda.Event(enable_timing=enable_timing)

    def record_memory_history(self, enabled: bool = True, max_entries: int = 1_000_000) -> None:
        # "all": every event, with its stack
        torch.cuda.memory._record_memory_history("all" if enabled else None, max_entries=max_entries)

    def full_snapshot(self) -> dict:
        return torch.cuda.memory._snapshot()

    def activated(self):
        return contextlib.nullcontext()

    def close(self) -> None:
        pass  # nothing to release: the CUDA device outlives any one user

    def external_alloc(self, nbytes: int) -> "ExternalBuffer":
        cudart = _cudart()
        ptr = ctypes.c_void_p()
        err = cudart.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(nbytes))
        if err != 0:
            raise self.OutOfMemoryError(f"cudaMalloc({nbytes}) failed with CUDA error {err}")
        return ExternalBuffer(ptr.value, nbytes, lambda: cudart.cudaFree(ptr))


def _routing_hooks():
    names = ("_cuda_beginAllocateCurrentThreadToPool", "_cuda_endAllocateToPool", "_cuda_releasePool")
    hooks = tuple(getattr(torch._C, n, None) for n in names)
    return hooks if all(hooks) else None


_ROUTING_HOOKS = _routing_hooks()


class _PoolRouting:
    """What torch.cuda.use_mem_pool does outside a graph capture, as a plain class, safe against
    interrupts (Note [interrupt-safe scopes] in :mod:`graphborrow.core.interrupts`; nested in the
    borrow scope's sections, so nearly free there)."""

    __slots__ = ("device", "pool_id", "routed")

    def __init__(self, device: int, pool_id):
        self.device, self.pool_id, self.routed = device, pool_id, False

    def __enter__(self):
        with CRITICAL_ENTRY:
            _ROUTING_HOOKS[0](self.device, self.pool_id)
            self.routed = True

    def __exit__(self, *exc):
        if self.routed:
            with CRITICAL:
                self.routed = False
                try:
                    _ROUTING_HOOKS[1](self.device, self.pool_id)
                finally:
                    _ROUTING_HOOKS[2](self.device, self.pool_id)
        return False


@functools.lru_cache(maxsize=None)
def _cudart():
    torch.cuda.init()  # loads the runtime torch links against, so its soname resolves
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise RuntimeError("could not load the CUDA runtime library (libcudart) for external_alloc")
