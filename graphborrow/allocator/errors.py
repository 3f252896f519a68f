"""Errors the allocator model raises, typed so that callers never read their messages.

:class:`AllocatorOutOfMemoryError` is a ``torch.OutOfMemoryError`` (code written for CUDA
catches it unchanged) carrying the numbers its message states. :class:`PoolReleasedError`
and :class:`AddressInUseError` are the two refusals trace replay reasons about.
"""

from __future__ import annotations

import torch

from graphborrow.core.sizes import format_size

__all__ = ["AddressInUseError", "AllocatorOutOfMemoryError", "PoolReleasedError"]


class AllocatorOutOfMemoryError(torch.OutOfMemoryError):
    """No cached block, no new segment, nothing left to release: torch's out-of-memory error.

    The message is torch's, word for word where the model knows the numbers. Args (all bytes
    but ``device`` and ``stream``):
        device: the device index.
        alloc_size: the segment size the allocator tried to get.
        requested: the rounded size of the block asked for.
        stream: the stream asked on.
        device_free, device_total: what cudaMemGetInfo reported.
        process_used: device memory this process holds (all pools, all segments).
        allowed: the cap a memory fraction sets, or None.
        allocated: bytes allocated in the default pool.
        in_private: bytes of blocks in private pools (CUDA graphs, MemPools).
        reserved: bytes of segments (reserved_bytes).
    """

    def __init__(self, *, device: int, alloc_size: int, requested: int, stream: int, device_free: int,
                 device_total: int, process_used: int, allowed: int | None, allocated: int, in_private: int,
                 reserved: int) -> None:
        self.numbers = dict(device=device, alloc_size=alloc_size, requested=requested, stream=stream,
                            device_free=device_free, device_total=device_total, process_used=process_used,
                            allowed=allowed, allocated=allocated, in_private=in_private, reserved=reserved)
        self.alloc_size, self.requested, self.stream = alloc_size, requested, stream
        self.device_free, self.allowed = device_free, allowed
        private_msg = f"with {format_size(in_private)} allocated in private pools (e.g., CUDA Graphs), " if in_private else ""
        allowed_msg = "" if allowed is None else f"{format_size(allowed)} allowed; "
        super().__init__(
            f"CUDA out of memory. Tried to allocate {format_size(alloc_size)}. GPU {device} has a total "
            f"capacity of {format_size(device_total)} of which {format_size(device_free)} is free. "
            f"Including non-PyTorch memory, this process has {format_size(process_used)} memory in use. "
            f"{allowed_msg}Of the allocated memory {format_size(allocated + in_private)} is allocated by PyTorch, "
            f"{private_msg}and {format_size(reserved - allocated - in_private)} is reserved by PyTorch but "
            "unallocated. If reserved but unallocated memory is large try setting "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for "
            "Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
        )

    def __reduce__(self):  # keyword-only arguments: rebuilt from them (a sweep worker sends it back pickled)
        return (_rebuild_oom, (self.numbers,))


def _rebuild_oom(numbers: dict) -> AllocatorOutOfMemoryError:
    return AllocatorOutOfMemoryError(**numbers)


class PoolReleasedError(RuntimeError):
    """A private pool whose last user released it was asked to take allocations again.

    Args:
        pool_id: the pool's id.
    """

    def __init__(self, pool_id: tuple[int, int]) -> None:
        self.pool_id = pool_id
        super().__init__(
            f"pool {pool_id} was released (use_count 0) and cannot be used again; "
            "create a new pool (a fresh graph_pool_handle() or MemPool)"
        )

    def __reduce__(self):
        return (PoolReleasedError, (self.pool_id,))


class AddressInUseError(ValueError):
    """A device range was dictated (or restored) at an address a live range already covers.

    Args:
        address: the dictated start.
        nbytes: the range's size.
    """

    def __init__(self, address: int, nbytes: int) -> None:
        self.address, self.nbytes = address, nbytes
        super().__init__(
            f"dictated address {address:#x} (+{nbytes} bytes) overlaps a live device range; "
            "free that range first or dictate another address"
        )

    def __reduce__(self):
        return (AddressInUseError, (self.address, self.nbytes))
