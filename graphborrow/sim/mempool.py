"""Private pools on the simulated device: ``torch.cuda.MemPool`` and ``use_mem_pool``'s routing."""

from __future__ import annotations

import threading

from graphborrow.core.interrupts import CRITICAL, CRITICAL_ENTRY

__all__ = ["MemPool", "SimPoolRouting"]


class MemPool:
    """``torch.cuda.MemPool`` on the simulated device: a private pool with an id.

    ``allocator`` is ``None`` (segments from device memory) or an object with
    ``raw_alloc(nbytes, stream) -> address`` and ``raw_delete(address, nbytes, stream)``.
    """

    def __init__(self, backend: "SimBackend", allocator=None, use_on_oom: bool = False, no_split: bool = False) -> None:
        if allocator is not None and not (hasattr(allocator, "raw_alloc") and hasattr(allocator, "raw_delete")):
            raise TypeError(
                "MemPool allocator must have raw_alloc(nbytes, stream) and raw_delete(address, nbytes, "
                f"stream), as graphborrow.core.arena.BumpArena has; got {type(allocator).__name__}"
            )
        self._backend = backend
        self.allocator = allocator
        self._id = backend.new_pool_id(graph=False)
        self._closed = False
        with backend.allocator_call():
            backend.allocator.create_or_incref_pool(self._id, allocator, use_on_oom, no_split)

    @property
    def id(self) -> tuple[int, int]:
        return self._id

    def snapshot(self, include_traces: bool = True) -> list[dict]:
        """This pool's segments, as ``torch.cuda.MemPool.snapshot``.

        Args:
            include_traces: accepted for torch's signature; the simulated segments carry no
                per-segment traces either way.

        Returns:
            Segment dicts in torch's snapshot format.
        """
        return self._backend.memory_snapshot(self._id)

    def use_count(self) -> int:
        """Users of the pool, as ``torch.cuda.MemPool.use_count``.

        Returns:
            The pool itself, plus each routing into it under way and each graph captured into it.
        """
        return self._backend.allocator.private_pool(self._id).use_count

    def close(self) -> None:
        """What the destructor of torch's MemPool does: release the pool and empty its cache."""
        if self._closed:
            return
        self._closed = True
        backend = self._backend
        if backend.closed:
            return
        with backend.allocator_call():
            backend.allocator.release_pool(self._id)
            backend.allocator.empty_cache(self._id)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown or a device already gone
            pass

    def __repr__(self) -> str:
        kind = "device" if self.allocator is None else type(self.allocator).__name__
        return f"MemPool(id={self._id}, segments from {kind})"


class SimPoolRouting:
    """``use_mem_pool`` on the simulated device: routing starts at entry and stops (ending the
    routing and releasing the pool) at exit, safe against interrupts (Note [interrupt-safe
    scopes] in :mod:`graphborrow.core.interrupts`)."""

    __slots__ = ("backend", "pool_id", "routed")

    def __init__(self, backend: "SimBackend", pool_id: tuple[int, int]) -> None:
        self.backend, self.pool_id, self.routed = backend, pool_id, False

    def __enter__(self) -> None:
        backend, thread = self.backend, threading.get_ident()
        with CRITICAL_ENTRY:
            with backend.allocator_call():
                backend.allocator.begin_allocate_to_pool(self.pool_id, lambda stream, t: t == thread)
            self.routed = True

    def __exit__(self, *exc) -> bool:
        if self.routed:
            with CRITICAL:
                self._stop()
        return False

    def _stop(self) -> None:
        self.routed = False
        backend = self.backend
        with backend.allocator_call():
            backend.allocator.end_allocate_to_pool(self.pool_id)
            backend.allocator.release_pool(self.pool_id)

    def __del__(self) -> None:
        try:
            if self.routed and not self.backend._closed:
                with CRITICAL:
                    self._stop()
        except Exception:  # interpreter shutdown
            pass


