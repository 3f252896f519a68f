"""The device API: what graphborrow asks of a CUDA device, written down once.

Two implementations provide it: :class:`graphborrow.device.cuda.CudaBackend` (thin wrappers
over ``torch.cuda``) and :class:`graphborrow.sim.SimBackend` (the simulated device). The
borrow state, the EAGLE sampler, the workload and the planner are written against this
protocol only, so they run unchanged on an H200 and on a machine without a GPU. Names
mirror ``torch.cuda``; a test compares both implementations with it, method by method
and parameter by parameter.

Tensors are created with ``device=backend.device`` (the string ``"cuda"``) or from
existing tensors (``new_empty``, ``empty_like``, ops). On the simulated device a
TorchFunctionMode maps ``"cuda"`` onto simulated memory while it is active.

This module imports nothing else from graphborrow: both devices depend on it, never the
other way round.
"""

from __future__ import annotations

from typing import Any, Callable, ContextManager, Optional, Protocol, runtime_checkable

__all__ = ["DeviceAPI", "ExternalBuffer"]


class ExternalBuffer:
    """Device memory the caching allocator knows nothing about (see ``external_alloc``).

    Static borrow runs must be such storage: the allocator's block map is keyed by
    address, so a borrowed block starting where one of its live blocks starts would
    clobber that block's entry.
    """

    def __init__(self, address: int, nbytes: int, release: Optional[Callable[[], Any]]):
        self.address, self.nbytes, self._release = address, nbytes, release

    def free(self) -> None:
        """Give the memory back (once; later calls do nothing)."""
        if self._release is not None:
            self._release()
            self._release = None

    def __repr__(self) -> str:
        return f"ExternalBuffer(address={self.address:#x}, nbytes={self.nbytes}, freed={self._release is None})"


@runtime_checkable
class DeviceAPI(Protocol):
    """One CUDA device as graphborrow uses it."""

    name: str                 # "cuda" or "sim"
    device: str               # what to pass as device= when creating tensors on it
    backed: bool              # tensors hold values (False: a layout-only simulated device)
    OutOfMemoryError: type    # raised when an allocation cannot be served

    # streams, events and synchronisation
    def current_stream(self) -> Any: ...
    def current_stream_key(self) -> int:
        """A cheap identity of the current stream (checked on every borrow)."""
    def Stream(self, priority: int = 0) -> Any: ...
    def stream(self, s) -> ContextManager: ...
    def Event(self, enable_timing: bool = False) -> Any: ...
    def synchronize(self) -> None: ...
    def sleep(self, stream, microseconds: float) -> None:
        """Keep ``stream`` busy for about ``microseconds`` (deferred-free demos)."""
    def touch(self) -> None:
        """One small allocation outside any pool: lets the allocator process completed events."""

    # pools and graphs
    def graph_pool_handle(self) -> Any: ...
    def CUDAGraph(self) -> Any: ...
    def graph(self, g, pool=None, stream=None) -> ContextManager: ...
    def MemPool(self, allocator=None, use_on_oom: bool = False, no_split: bool = False) -> Any: ...
    def arena_pool(self, arena) -> Any:
        """A MemPool whose segments come from a :class:`~graphborrow.core.arena.BumpArena`."""
    def use_mem_pool(self, pool) -> ContextManager: ...
    def route_to_pool(self, pool) -> ContextManager:
        """``use_mem_pool`` for the borrow scope's per-step routing (never during a capture)."""
    def pool_id(self, pool) -> tuple[int, int]: ...

    # allocator introspection
    def memory_snapshot(self, pool_id=None) -> list[dict]: ...
    def memory_stats(self) -> dict[str, Any]: ...
    def memory_reserved(self) -> int: ...
    def memory_allocated(self) -> int: ...
    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) device memory as the driver sees it: the physical measure."""
    def empty_cache(self) -> None: ...
    def record_memory_history(self, enabled: bool = True, max_entries: int = 1_000_000) -> None: ...
    def full_snapshot(self) -> dict:
        """Segments, device traces and allocator settings, as memory_viz reads them."""

    # tensors and memory outside the allocator
    def record_stream(self, tensor, stream) -> None: ...
    def data_ptr(self, tensor) -> int: ...
    def external_alloc(self, nbytes: int) -> ExternalBuffer: ...

    # the device itself
    def describe(self) -> str: ...
    def activated(self) -> ContextManager:
        """Make ``device="cuda"`` mean this device for the block (a no-op on the real one)."""
    def close(self) -> None: ...
