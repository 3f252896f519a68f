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

__all__ = ["CudaBackend", "ExternalBuffer"]


class CudaBackend:
    """The real device: thin wrappers over ``torch.cuda``.

    Get it from :func:`get_backend` (one per process, as the device is). Sizes are bytes
    and streams are ``torch.cuda.Stream`` objects throughout.

    Raises:
        RuntimeError: torch sees no CUDA device (use the simulated device instead).
    """

    name = "cuda"
    device = "cuda"
    backed = True
    OutOfMemoryError = torch.cuda.OutOfMemoryError

    def __init__(self) -> None:
        if not torch.cuda.is_available():
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
        """The calling thread's current stream; a borrow pool is pinned to the one it was built on.

        Returns:
            A ``torch.cuda.Stream``.
        """
        return torch.cuda.current_stream()

    def current_stream_key(self) -> int:
        """A cheap identity of the current stream (its raw handle).

        Returns:
            The ``cudaStream_t`` as an int; the borrow scope compares it on every entry.
        """
        return self._raw_stream()

    def Stream(self, priority: int = 0):
        """A new side stream, as ``torch.cuda.Stream``.

        Args:
            priority: the stream's priority (lower runs first; 0 is the default).

        Returns:
            A ``torch.cuda.Stream``.
        """
        return torch.cuda.Stream(priority=priority)

    def stream(self, s):
        """Make ``s`` the current stream for a with block, as ``torch.cuda.stream``.

        Args:
            s: a stream from :meth:`Stream`; None leaves the current stream as it is.

        Returns:
            The context manager.
        """
        return torch.cuda.stream(s)

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def sleep(self, stream, microseconds: float) -> None:
        """Keep ``stream`` busy for about ``microseconds`` (for deferred-free demos).

        Converted to clock cycles at the device's nominal clock rate, so the time is approximate.

        Args:
            stream: the stream that spins.
            microseconds: how long, in microseconds.
        """
        cycles = int(microseconds * torch.cuda.get_device_properties(0).clock_rate / 1e3)
        with torch.cuda.stream(stream):
            torch.cuda._sleep(max(cycles, 1))

    def touch(self) -> None:
        """One small allocation outside any pool: lets the allocator process completed events."""
        self._touch()

    def clear_library_workspaces(self) -> None:
        """Release the cuBLAS workspaces torch keeps per stream (they are made again on demand)."""
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is None:
            raise RuntimeError("this torch build cannot release cuBLAS workspaces (no _cuda_clearCublasWorkspaces)")
        clear()

    # pools
    def graph_pool_handle(self):
        """A new private pool handle that several graph captures can share.

        Returns:
            The handle, as ``torch.cuda.graph_pool_handle``; pass it as ``pool=`` and as
            :class:`~graphborrow.core.borrow.BorrowState`'s ``pool_id``.
        """
        return torch.cuda.graph_pool_handle()

    def CUDAGraph(self):
        """An empty graph to capture into.

        Returns:
            A ``torch.cuda.CUDAGraph``.
        """
        return torch.cuda.CUDAGraph()

    def graph(self, g, pool=None, stream=None):
        """Capture the with block's work into ``g``, as ``torch.cuda.graph``.

        Args:
            g: a graph from :meth:`CUDAGraph`.
            pool: the pool handle to capture into (None: a private pool of its own).
            stream: the stream to capture on (None: torch's side stream).

        Returns:
            The capture's context manager.
        """
        return torch.cuda.graph(g, pool=pool, stream=stream)

    def arena_pool(self, arena: BumpArena):
        """A MemPool whose segments come from ``arena`` (torch's pluggable allocator).

        Args:
            arena: the :class:`~graphborrow.core.arena.BumpArena` whose extents the pool's
                segments are carved from.

        Returns:
            A ``torch.cuda.MemPool``; the caching allocator still splits its segments into blocks.
        """
        return torch.cuda.MemPool(arena.allocator)

    def use_mem_pool(self, pool):
        """Route this thread's allocations to ``pool`` for a with block, as ``torch.cuda.use_mem_pool``.

        Args:
            pool: a MemPool from :meth:`MemPool` or :meth:`arena_pool`.

        Returns:
            The context manager.
        """
        return torch.cuda.use_mem_pool(pool)

    def route_to_pool(self, pool):
        """``use_mem_pool`` outside graph capture, without its generator's overhead.

        The borrow scope enters this every decode step (never during a capture: the
        owner slot excludes that), so it calls the allocator's routing hooks directly.

        Args:
            pool: the borrow pool (a MemPool).

        Returns:
            A context manager; with a torch that lacks the hooks, ``use_mem_pool``'s.
        """
        if _ROUTING_HOOKS is None:
            return torch.cuda.use_mem_pool(pool)
        return _PoolRouting(self._index, pool.id)

    def pool_id(self, pool) -> tuple[int, int]:
        """The id snapshots use for ``pool`` (``segment_pool_id``).

        Args:
            pool: a MemPool.

        Returns:
            The pool's id as a tuple of two ints.
        """
        return tuple(pool.id)

    def memory_snapshot(self, pool_id=None) -> list[dict]:
        """The allocator's segments, as ``torch.cuda.memory_snapshot``.

        Args:
            pool_id: only the segments of this pool (a graph pool handle or
                :meth:`pool_id`); None for every segment of the device.

        Returns:
            Segment dicts in torch's format (sizes and addresses in bytes).
        """
        if pool_id is None:
            return torch.cuda.memory_snapshot()
        try:
            return torch.cuda.memory_snapshot(mempool_id=pool_id, include_traces=False)
        except TypeError:  # torch < 2.10 has no include_traces
            return torch.cuda.memory_snapshot(mempool_id=pool_id)

    def memory_stats(self) -> dict[str, Any]:
        """The allocator's counters, as ``torch.cuda.memory_stats``.

        Returns:
            A flat dict such as ``"reserved_bytes.all.current"`` to int.
        """
        return torch.cuda.memory_stats()

    def memory_reserved(self) -> int:
        """Bytes in the caching allocator's segments, as ``torch.cuda.memory_reserved``.

        Borrowed segments are counted here a second time although they use no new memory:
        measure the device with :meth:`mem_get_info` instead.

        Returns:
            Bytes.
        """
        return torch.cuda.memory_reserved()

    def memory_allocated(self) -> int:
        """Bytes in blocks allocated to tensors, as ``torch.cuda.memory_allocated``.

        Returns:
            Bytes (allocator-rounded block sizes).
        """
        return torch.cuda.memory_allocated()

    def mem_get_info(self) -> tuple[int, int]:
        """Free and total device memory as the driver sees it: the physical measure.

        Returns:
            ``(free, total)`` in bytes.
        """
        return torch.cuda.mem_get_info()

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def record_stream(self, tensor, stream) -> None:
        """Mark ``tensor`` as in use by ``stream``: its block stays ``active_pending_free``
        after it dies, until the work queued on ``stream`` by then has run.

        Args:
            tensor: a CUDA tensor.
            stream: the other stream that uses it.
        """
        tensor.record_stream(stream)

    def data_ptr(self, tensor) -> int:
        """The device address of ``tensor``'s first element.

        Args:
            tensor: a CUDA tensor.

        Returns:
            The address, comparable with snapshot block addresses.
        """
        return tensor.data_ptr()

    def describe(self) -> str:
        """The device in words, for tables and plots.

        Returns:
            The device name and torch version.
        """
        return f"{torch.cuda.get_device_name()} (torch {torch.__version__})"

    def MemPool(self, allocator=None, use_on_oom=False, no_split=False):
        """A private pool, as ``torch.cuda.MemPool``.

        Args:
            allocator: a pluggable allocator whose memory the pool's segments use; None
                for the device's own.
            use_on_oom: let other allocations use this pool's cached memory when the
                device is out of memory.
            no_split: never split the pool's blocks (only passed when True, so older
                torch versions without it work).

        Returns:
            A ``torch.cuda.MemPool``.
        """
        kwargs = {}
        if use_on_oom:
            kwargs["use_on_oom"] = True
        if no_split:
            kwargs["no_split"] = True
        return torch.cuda.MemPool(allocator, **kwargs)

    def Event(self, enable_timing: bool = False):
        """A new event, as ``torch.cuda.Event``.

        Args:
            enable_timing: the event can measure elapsed time.

        Returns:
            A ``torch.cuda.Event``.
        """
        return torch.cuda.Event(enable_timing=enable_timing)

    def record_memory_history(self, enabled: bool = True, max_entries: int = 1_000_000) -> None:
        """Start or stop recording allocator trace entries (for :meth:`full_snapshot`).

        Args:
            enabled: record every event with its stack (``"all"``); False stops recording.
            max_entries: how many entries the ring buffer keeps.
        """
        torch.cuda.memory._record_memory_history("all" if enabled else None, max_entries=max_entries)

    def full_snapshot(self) -> dict:
        """segments, device traces and allocator settings, as memory_viz reads them.

        Returns:
            The dict of ``torch.cuda.memory._snapshot()``.
        """
        return torch.cuda.memory._snapshot()

    def activated(self):
        """The real device needs no activation; present so callers can treat backends alike.

        Returns:
            A context manager that does nothing.
        """
        return contextlib.nullcontext()

    def close(self) -> None:
        """Nothing to release: the CUDA device outlives any one user."""

    def external_alloc(self, nbytes: int) -> "ExternalBuffer":
        """Device memory from cudaMalloc itself, outside the caching allocator.

        Static borrow runs must be storage the caching allocator does not track: its
        block map is keyed by address, so a borrowed block starting where a live
        caching-allocator block starts would clobber that block's entry.

        Args:
            nbytes: bytes wanted.

        Returns:
            An :class:`ExternalBuffer`; call its ``free()`` when no static run uses it any more.

        Raises:
            torch.cuda.OutOfMemoryError: cudaMalloc failed.
        """
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
    """What torch.cuda.use_mem_pool does outside a graph capture, as a plain class.

    Entry and exit each run in a critical section (nested in the borrow scope's, so
    nearly free there): an interrupt cannot fall between ending the routing and
    releasing the pool, and a second exit does nothing.
    """

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
