"""The device API: what graphborrow asks of a CUDA device, written down once.

Two implementations provide it: :class:`graphborrow.device.cuda.CudaBackend` (thin wrappers
over ``torch.cuda``) and :class:`graphborrow.sim.SimBackend` (the simulated device). The
borrow state, the EAGLE sampler, the workload and the planner are written against this
protocol only, so they run unchanged on an H200 and on a machine without a GPU. Names
mirror ``torch.cuda``. This is where the contract is written down: both implementations
subclass :class:`DeviceAPI` and inherit its docstrings, and a test compares each with it,
method by method and parameter by parameter.

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
    """One CUDA device as graphborrow uses it: the contract both devices keep.

    Sizes are bytes and names mirror ``torch.cuda``. Each implementation documents a method
    only where it adds to what is said here (the simulated device's own errors, say).
    """

    name: str                 # "cuda" or "sim"
    device: str               # what to pass as device= when creating tensors on it
    backed: bool              # tensors hold values (False: a layout-only simulated device)
    OutOfMemoryError: type    # raised when an allocation cannot be served

    # ------------------------------------------------------------------ streams, events, synchronisation
    def current_stream(self) -> Any:
        """The calling thread's current stream; a borrow pool is pinned to the one it was built on.

        Returns:
            The device's stream object (``torch.cuda.Stream`` on a GPU).
        """

    def current_stream_key(self) -> int:
        """A cheap identity of the current stream; the borrow scope compares it on every entry.

        Returns:
            An int (the raw ``cudaStream_t`` on a GPU, the stream id on the simulator).
        """

    def Stream(self, priority: int = 0) -> Any:
        """A new side stream, as ``torch.cuda.Stream``.

        Args:
            priority: the stream's priority (lower runs first; 0 is the default).

        Returns:
            The new stream.
        """

    def stream(self, s) -> ContextManager:
        """Make ``s`` the current stream for a with block, as ``torch.cuda.stream``.

        Args:
            s: a stream from :meth:`Stream`; None leaves the current stream as it is.

        Returns:
            The context manager.
        """

    def Event(self, enable_timing: bool = False) -> Any:
        """A new event, as ``torch.cuda.Event``.

        Args:
            enable_timing: the event can measure elapsed time.

        Returns:
            The event.
        """

    def synchronize(self) -> None:
        """Wait for every stream, as ``torch.cuda.synchronize``."""

    def sleep(self, stream, microseconds: float) -> None:
        """Keep ``stream`` busy for about ``microseconds`` (deferred-free demos), like ``torch.cuda._sleep``.

        Args:
            stream: the stream that spins.
            microseconds: how long.
        """

    def touch(self) -> None:
        """One small allocation outside any pool: lets the allocator process completed events."""

    # ------------------------------------------------------------------ pools and graphs
    def graph_pool_handle(self) -> Any:
        """A new private pool handle that several graph captures can share.

        Returns:
            The handle, as ``torch.cuda.graph_pool_handle``; pass it as ``pool=`` and as
            :class:`~graphborrow.core.borrow.BorrowState`'s ``pool_id``.
        """

    def CUDAGraph(self) -> Any:
        """An empty graph to capture into; its replay re-runs the kernels into the same addresses.

        Returns:
            The graph, as ``torch.cuda.CUDAGraph``.
        """

    def graph(self, g, pool=None, stream=None) -> ContextManager:
        """Capture the with block's work into ``g``, as ``torch.cuda.graph``.

        Args:
            g: a graph from :meth:`CUDAGraph`.
            pool: the pool handle to capture into (None: a private pool of its own).
            stream: the stream to capture on (None: a side stream of the device's choosing).

        Returns:
            The capture's context manager.
        """

    def MemPool(self, allocator=None, use_on_oom: bool = False, no_split: bool = False) -> Any:
        """A private pool, as ``torch.cuda.MemPool``.

        Args:
            allocator: a pluggable allocator whose memory the pool's segments use; None for
                the device's own.
            use_on_oom: let other allocations use this pool's cached memory when the device
                is out of memory.
            no_split: never split the pool's blocks.

        Returns:
            The pool.
        """

    def arena_pool(self, arena) -> Any:
        """A MemPool whose segments come from ``arena``.

        Args:
            arena: the :class:`~graphborrow.core.arena.BumpArena` whose extents the pool's
                segments are carved from.

        Returns:
            The pool; the caching allocator still splits its segments into blocks.
        """

    def use_mem_pool(self, pool) -> ContextManager:
        """Route this thread's allocations to ``pool`` for a with block, as ``torch.cuda.use_mem_pool``.

        Args:
            pool: a pool from :meth:`MemPool` or :meth:`arena_pool`.

        Returns:
            The context manager.
        """

    def route_to_pool(self, pool) -> ContextManager:
        """``use_mem_pool`` for the borrow scope's per-step routing (never during a capture).

        Args:
            pool: the borrow pool.

        Returns:
            The context manager.
        """

    def pool_id(self, pool) -> tuple[int, int]:
        """The id snapshots use for ``pool`` (``segment_pool_id``).

        Args:
            pool: a pool from :meth:`MemPool` or :meth:`arena_pool`.

        Returns:
            The pool's id as a tuple of two ints.
        """

    # ------------------------------------------------------------------ allocator introspection
    def memory_snapshot(self, pool_id=None) -> list[dict]:
        """The allocator's segments, as ``torch.cuda.memory_snapshot``.

        Args:
            pool_id: only the segments of this pool (a graph pool handle or
                :meth:`pool_id`); None for every segment of the device.

        Returns:
            Segment dicts in torch's format (sizes and addresses in bytes).
        """

    def memory_stats(self) -> dict[str, Any]:
        """The allocator's counters, as ``torch.cuda.memory_stats``.

        Returns:
            A flat dict such as ``"reserved_bytes.all.current"`` to int, with torch's keys.
        """

    def memory_reserved(self) -> int:
        """Bytes in the caching allocator's segments, as ``torch.cuda.memory_reserved``.

        Borrowed segments are counted here a second time although they use no new memory:
        measure the device with :meth:`mem_get_info` instead.

        Returns:
            Bytes.
        """

    def memory_allocated(self) -> int:
        """Bytes in blocks allocated to tensors, as ``torch.cuda.memory_allocated``.

        Returns:
            Bytes (allocator-rounded block sizes).
        """

    def mem_get_info(self) -> tuple[int, int]:
        """Free and total device memory as the driver sees it: the physical measure.

        Returns:
            ``(free, total)`` in bytes.
        """

    def empty_cache(self) -> None:
        """Release every cached segment no tensor uses, as ``torch.cuda.empty_cache``."""

    def record_memory_history(self, enabled: bool = True, max_entries: int = 1_000_000) -> None:
        """Start or stop recording allocator trace entries (for :meth:`full_snapshot`).

        Args:
            enabled: record every allocator event; False stops recording.
            max_entries: how many entries the ring buffer keeps.
        """

    def full_snapshot(self) -> dict:
        """Segments, device traces and allocator settings, as ``torch.cuda.memory._snapshot()``.

        Returns:
            The dict PyTorch's memory_viz reads.
        """

    # ------------------------------------------------------------------ tensors and memory outside the allocator
    def record_stream(self, tensor, stream) -> None:
        """Mark ``tensor`` as in use by ``stream``: its block stays ``active_pending_free``
        after it dies, until the work queued on ``stream`` by then has run.

        Args:
            tensor: a tensor on this device.
            stream: the other stream that uses it.
        """

    def data_ptr(self, tensor) -> int:
        """The device address of ``tensor``'s first element.

        Args:
            tensor: a tensor on this device.

        Returns:
            The address, comparable with snapshot block addresses.
        """

    def external_alloc(self, nbytes: int) -> ExternalBuffer:
        """Device memory from cudaMalloc itself, outside the caching allocator.

        Static borrow runs must be storage the caching allocator does not track: its block
        map is keyed by address, so a borrowed block starting where a live caching-allocator
        block starts would clobber that block's entry.

        Args:
            nbytes: bytes wanted.

        Returns:
            An :class:`ExternalBuffer`; call its ``free()`` when no static run uses it any more.

        Raises:
            OutOfMemoryError: the device has not that much free memory.
        """

    # ------------------------------------------------------------------ the device itself
    def describe(self) -> str:
        """The device in words, for tables and plots.

        Returns:
            One line.
        """

    def activated(self) -> ContextManager:
        """Make ``device="cuda"`` mean this device for the block (a no-op on the real one).

        Returns:
            The context manager.
        """

    def close(self) -> None:
        """Release what this device object holds (nothing on the real device, which outlives its users)."""
