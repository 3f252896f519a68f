"""What trace replay asks of the allocator model beyond torch's own operations.

Replaying a recorded trace (:mod:`graphborrow.fidelity`) needs to look into the model
without changing it (which cached block a request would take, what garbage collection
would release, which block starts at an address), to read the trace entries the model wrote,
and to release one private pool's memory at a moment torch never would. None of that is
something a program can ask torch's allocator, so none of it is on :class:`CachingAllocator`:
these functions take the allocator and keep to its rules (the queries call the very code
malloc and garbage collection run).
"""

from __future__ import annotations

from graphborrow.core.sizes import SMALL_SIZE, round_size

from .blocks import DEFAULT_POOL, Block, Segment, pool_tuple
from .caching import CachingAllocator, collection_victims

__all__ = [
    "block_at", "cached_block_for", "drain_trace", "garbage_collection_victims", "holds_segment",
    "release_pool_memory", "segment_count",
]


def block_at(allocator: CachingAllocator, address: int) -> Block | None:
    """The active block (allocated or pending free) starting at ``address``, or None.

    A walk over the segments, for inspection: the allocator itself never looks blocks up by
    address. Where pools nest (a pluggable pool's segment inside another pool's block) the
    innermost segment's block is the answer.
    """
    found = None
    for segment in allocator.live_segments:
        if segment.address <= address < segment.address + segment.size and (
            found is None or segment.size < found.segment.size
        ):
            for block in segment.blocks():
                if block.ptr == address and block.mapped and block.state != "inactive":
                    found = block
    return found


def cached_block_for(allocator: CachingAllocator, nbytes: int, stream: int = 0, pool_id=DEFAULT_POOL) -> Block | None:
    """The cached block a malloc of ``nbytes`` on ``stream`` routed to ``pool_id`` would take, or None.

    The same best-fit search malloc runs, without its side effects (garbage collection's block
    ages are not advanced). Replay asks it to rule pools out: a pool that had a block for a
    request would not have needed a new segment.
    """
    pool_id = pool_tuple(pool_id)
    size = round_size(nbytes, allocator.divisions)
    if pool_id == DEFAULT_POOL:
        pool = allocator.small_blocks if size <= SMALL_SIZE else allocator.large_blocks
    else:
        private = allocator.private_pool(pool_id)
        pool = private.small_blocks if size <= SMALL_SIZE else private.large_blocks
    found = allocator.get_free_block(pool, size, stream, pool.expandable, False)
    return None if found is None else found[0]


def garbage_collection_victims(allocator: CachingAllocator) -> list[Block]:
    """The blocks garbage collection would release now, in order (nothing is released)."""
    return collection_victims(allocator)


def drain_trace(allocator: CachingAllocator) -> list[dict]:
    """The trace entries recorded since the last call (history must be on), oldest first."""
    if allocator.history is None:
        raise RuntimeError("drain_trace() needs record_history() first")
    entries = list(allocator.history)
    allocator.history.clear()
    return entries


def release_pool_memory(allocator: CachingAllocator, pool_id) -> None:
    """Release a private pool's whole free segments and free pages now, whether or not it is freeable.

    Not something torch can do: replay's layout pass puts each segment in a pool of its own
    and releases memory exactly when the trace does.
    """
    private = allocator.private_pool(pool_tuple(pool_id))
    allocator.release_blocks(private.small_blocks)
    allocator.release_blocks(private.large_blocks)


def segment_count(allocator: CachingAllocator) -> int:
    """How many segments are live (cheaper than ``len(allocator.segments())``: nothing is sorted)."""
    return len(allocator.live_segments)


def holds_segment(allocator: CachingAllocator, segment: Segment) -> bool:
    """True while ``segment`` is live (not yet released to the device)."""
    return segment in allocator.live_segments
