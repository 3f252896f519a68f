"""A model of PyTorch's CUDA caching allocator (one device), rule for rule.

What it reproduces (``c10/cuda/CUDACachingAllocator.cpp``, torch 2.8 to 2.11): size
rounding (:mod:`graphborrow.core.sizes`), small/large block pools per pool, best fit on the
same stream with a single candidate, low-end splits where the old block becomes the
remainder, merging with free neighbours, segment sizes, expandable segments
(:mod:`.expandable`), the ``max_split_size`` oversize rules, garbage collection under a
memory fraction, private pools with strict LIFO routing (graph capture by stream,
``use_mem_pool`` by thread), pluggable-allocator pools, ``use_on_oom`` and ``no_split``
pools, ``record_stream`` events and deferred frees, ``empty_cache``, out-of-memory handling
(:class:`AllocatorOutOfMemoryError`), ``memory_stats`` kept as torch keeps them
(:mod:`.stats`), and snapshots / trace entries in torch's own format (:mod:`.snapshots`).
The data model (segments, blocks, free lists, pools) is :mod:`.blocks`.

:class:`CachingAllocator` holds torch's own operations only. What torch's allocator cannot
do lives beside it: rebuilding state from a snapshot (:mod:`.restore`) and the queries trace
replay asks (:mod:`.replay_support`).

Streams are plain ints here (0 is the default stream); the :class:`Clockwork` turns
them into simulated streams with clocks when events are recorded.

This file runs as plain Python, and is also compiled as it stands by Cython with the C
types in ``caching.pxd`` (with ``stats`` and ``blocks``; see ``compiled.py``), the build
that makes sweeps fast.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections import deque
from typing import Callable

from graphborrow.core.sizes import MIN_BLOCK_SIZE, SMALL_SIZE, allocation_size, round_size

from . import expandable as expandable_segments
from . import snapshots
from .blocks import (
    DEFAULT_POOL,
    NO_STREAMS,
    PTR_BITS,
    Block,
    BlockPool,
    FreeList,
    PrivatePool,
    Segment,
    expandable_size,
    new_block,
    pool_tuple,
)
from .config import SIZE_MAX, AllocatorConfig
from .errors import AllocatorOutOfMemoryError, PoolReleasedError
from .memory import PhysicalMemory
from .stats import DeviceStats, update_stat_array
from .streams import Clockwork, Event

__all__ = ["CachingAllocator", "collection_victims"]


# ----------------------------------------------------------------------------- the allocator


class CachingAllocator:
    """The device caching allocator: ``malloc`` / ``free`` of Blocks, pools, stats, snapshots.

    Args:
        memory: the device memory segments come from (its capacity is the GPU's total memory).
        clockwork: the device's streams (events of cross-stream frees are recorded on them).
        config: an :class:`AllocatorConfig`, or what it accepts (a settings string or dict).
    """

    def __init__(self, memory: PhysicalMemory, clockwork: Clockwork,
                 config: AllocatorConfig | dict | str | None = None) -> None:
        self.memory = memory
        self.clockwork = clockwork
        self.config = config if isinstance(config, AllocatorConfig) else AllocatorConfig(config)
        self.device = 0
        self.max_split = self.config.max_split_size
        self.divisions = self.config.divisions
        self.large_segment_size = self.config.large_segment_size
        self.expandable = self.config.expandable_segments
        self.stats = DeviceStats(self.max_split)
        self.small_blocks = BlockPool(True, None, self.expandable)
        self.large_blocks = BlockPool(False, None, self.expandable)
        self.stream_keys: dict[int, int] = {}  # stream -> handle it sorts by (follow_streams)
        self._stream_plan: deque = deque()
        self.small_blocks.order = self.large_blocks.order = self.stream_keys
        self.graph_pools: dict[tuple[int, int], PrivatePool] = {}
        self.graph_pools_freeable: dict[tuple[int, int], PrivatePool] = {}
        self.captures_underway: list[tuple[tuple[int, int], Callable[[int, int], bool]]] = []
        self.use_on_oom_pools: dict[tuple[int, int], None] = {}
        self.total_allocated_memory = 0
        self.live_segments: dict[Segment, None] = {}
        self.cuda_events: dict[int, deque] = {}
        self._deferred: dict[Block, tuple] = {}  # frees waiting for the capture: block -> (graph, markers)
        self.reuse_in_capture = bool(self.config.graph_capture_record_stream_reuse)
        self._capture_stream_uses: dict[Block, set[int]] = {}
        self.history: deque | None = None
        self._next_capture_id = 1
        self._next_mempool_id = 1
        self.allowed_memory_maximum: int | None = None
        self.gc_enabled = False
        self._fast = False
        self.set_memory_fraction(self.config.per_process_memory_fraction)

    def follow_streams(self, handles) -> None:
        """Order streams as a recorded run's were: torch compares free blocks of different streams by
        their ``cudaStream_t`` (which ``empty_cache`` and the out-of-memory retry release first), a
        value the driver picks. ``handles``: the recorded run's streams in the order each first
        allocated; the n-th stream to allocate here sorts as the n-th handle."""
        self._stream_plan = deque(int(h) for h in handles)
        self.stream_keys.clear()

    # ------------------------------------------------------------------ malloc / free

    def malloc(self, nbytes: int, stream: int = 0, thread: int | None = None) -> Block:
        """Allocate a block for ``nbytes`` on ``stream`` (an int); raises :class:`AllocatorOutOfMemoryError`."""
        if nbytes <= 0:
            raise ValueError(
                f"malloc({nbytes}): the caching allocator only sees positive sizes; "
                "a 0-byte tensor needs no block (torch gives it data_ptr 0)"
            )
        if not self._fast or self.captures_underway or self.cuda_events or self._deferred:
            return self._malloc_general(nbytes, stream, thread)
        # the hot path: default rules, nothing pending, no routing, no expandable segments or GC
        size = round_size(nbytes)
        pool = self.small_blocks if size <= SMALL_SIZE else self.large_blocks
        free = pool.free.get(stream)
        if free is not None:
            block = free.best_fit(size << PTR_BITS)
            if block is not None:
                return self._alloc_found_block(block, free, nbytes, size, False)
        block, free = self._malloc_slow(pool, size, stream)
        return self._alloc_found_block(block, free, nbytes, size, False)

    def _malloc_general(self, nbytes: int, stream: int, thread: int | None) -> Block:
        """malloc with everything: pending events, routing to private pools, configured rules."""
        captures = self.captures_underway
        if not captures and (self.cuda_events or self._deferred):
            self.process_events()
        elif captures and self._deferred and self.reuse_in_capture:
            self._free_safe_blocks_in_capture(stream)
        size = round_size(nbytes, self.divisions)
        if captures:
            pool = self._get_pool(size, stream, threading.get_ident() if thread is None else thread)
        else:
            pool = self.small_blocks if size <= SMALL_SIZE else self.large_blocks
        es_active = pool.expandable
        found = self.get_free_block(pool, size, stream, es_active)
        if found is None:
            found = self._malloc_slow(pool, size, stream)
            if found[1] is not None:
                es_active = False  # a block lent by a use_on_oom pool is split by the non-expandable rule
        block, free = found
        return self._alloc_found_block(block, free, nbytes, size, es_active)

    def _malloc_slow(self, pool: BlockPool, size: int, stream: int) -> tuple:
        """No cached block fits: GC, new segment, use_on_oom pools, release cached and retry, or OOM.

        Returns ``(block, None)`` for a block in no free list (a new segment's, or newly
        mapped pages), or ``(block, free_list)`` for one lent by a ``use_on_oom`` pool.
        """
        if self._stream_plan and stream not in self.stream_keys:  # a stream's first malloc comes here
            self.stream_keys[stream] = self._stream_plan.popleft()
        alloc_size = allocation_size(size, self.large_segment_size)
        if self.gc_enabled:
            self._garbage_collect_cached_blocks()
        block = self._alloc_block(pool, size, alloc_size, stream, False)
        if block is not None:
            return (block, None)
        found = self._try_mempool_fallback(pool, size, stream)
        if found is not None:
            return found
        if self._release_available_cached_blocks(pool, size, stream):
            block = self._alloc_block(pool, size, alloc_size, stream, False)
            if block is not None:
                return (block, None)
        if not self.captures_underway and self.release_cached_blocks(DEFAULT_POOL):
            block = self._alloc_block(pool, size, alloc_size, stream, True)
            if block is not None:
                return (block, None)
        self._raise_oom(pool, size, alloc_size, stream)

    def free(self, block: Block) -> None:
        """Return ``block``; completes now unless it was used on other streams (record_stream)."""
        if block is None or not block.allocated:
            raise ValueError(f"free({block!r}): the block is not allocated (double free?)")
        block.allocated = False
        stats = self.stats
        small = block.pool.is_small
        size = block.size
        update_stat_array(stats.allocation, small, -1)
        update_stat_array(stats.allocated_bytes, small, -size)
        if self.history is not None:
            self.record_entry("free_requested", block.ptr, block.requested_size, block.stream)
        if size >= self.max_split:
            stats.oversize_allocations.decrease(1)
        if block.stream_uses:
            if self.captures_underway:  # no event can be waited for: freed when the capture proves it safe, or after it
                self._deferred[block] = self._free_markers(block) if self.reuse_in_capture else (None, ())
            else:
                self._insert_events(block)
        else:
            self._free_block(block)

    def record_stream(self, block: Block, stream: int) -> None:
        """Mark ``block`` as used on ``stream``; its free then waits for that stream's work."""
        if stream == block.stream:
            return
        if block.stream_uses:
            block.stream_uses.add(stream)
        else:
            block.stream_uses = {stream}
        if self.captures_underway:
            self._capture_stream_uses.setdefault(block, set()).add(stream)

    # ------------------------------------------------------------------ search, split, merge

    def _get_pool(self, size: int, stream: int, thread: int) -> BlockPool:
        for pool_id, route in reversed(self.captures_underway):
            if route(stream, thread):
                private = self.graph_pools[pool_id]
                return private.small_blocks if size <= SMALL_SIZE else private.large_blocks
        return self.small_blocks if size <= SMALL_SIZE else self.large_blocks

    def get_free_block(self, pool: BlockPool, size: int, stream: int, es_active: bool, count: bool = True) -> tuple | None:
        """Best fit on the same stream: the single smallest block >= size, lowest address on ties.

        Returns the block and its free list; it stays there until _alloc_found_block
        re-keys or removes it. Among expandable blocks, the one that can grow the least
        is preferred; with expandable segments off they are skipped. ``count`` False
        makes it a pure query (garbage collection's block ages count searches).
        """
        if self.gc_enabled and count:
            pool.gc_calls += 1
        free = pool.free.get(stream)
        if free is None:
            return None
        block = free.best_fit(size << PTR_BITS)
        if block is None:
            return None
        if block.segment.expandable:
            if es_active:
                following = free.successor(block)
                while (block.segment.expandable and following is not None
                       and expandable_size(following) < expandable_size(block)):
                    block = following
                    following = free.successor(block)
            else:
                block = free.successor(block)
                while block is not None and block.segment.expandable:
                    block = free.successor(block)
                if block is None:
                    return None
        max_split = self.max_split
        if size < max_split and block.size >= max_split:
            return None  # a request under the limit may not take an oversize block
        if size >= max_split and block.size >= size + self.config.max_non_split_rounding_size:
            return None  # an oversize request may take at most max_non_split_rounding_size of slack
        return (block, free)

    def _should_split(self, block: Block, size: int, es_active: bool) -> bool:
        pool = block.pool
        if pool.no_split:
            return False
        remaining = block.size - size
        if pool.is_small or es_active:
            return remaining >= MIN_BLOCK_SIZE
        return size < self.max_split and remaining > SMALL_SIZE

    def _alloc_found_block(self, block: Block, free: FreeList | None, orig: int, size: int,
                           es_active: bool) -> Block:
        """Hand out ``block`` (split if the rules say so) from its free list ``free``,
        or None for a block that is in no free list (a new segment's, a newly mapped one)."""
        pool = block.pool
        stats = self.stats
        small = pool.is_small
        expandable = block.segment.expandable
        already_split = block.prev is not None or block.next is not None
        if self._should_split(block, size, es_active):
            # the caller gets a new block at the low end; the old block object is the remainder
            remaining = block
            remaining_size = remaining.size - size
            prev = remaining.prev
            block = new_block(remaining.ptr, size, remaining.stream, pool, remaining.segment, prev, remaining)
            if prev is None:
                remaining.segment.head = block
            else:
                prev.next = block
            remaining.prev = block
            remaining_ptr = remaining.ptr + size
            remaining.ptr = remaining_ptr
            remaining.size = remaining_size
            key = remaining_size << PTR_BITS | remaining_ptr
            if free is None:
                pool.free_list(remaining.stream).add(key, remaining)
            else:
                free.rekey(remaining.key, key, remaining)
            remaining.key = key
            remaining.gc_base = pool.gc_calls
            if not expandable:
                if already_split:  # an already-split free block shrinks by size bytes
                    update_stat_array(stats.inactive_split_bytes, small, -size)
                else:  # a new split free block appears
                    update_stat_array(stats.inactive_split_bytes, small, remaining_size)
                    update_stat_array(stats.inactive_split, small, 1)
        else:
            if free is not None:
                free.remove(block.key)
                block.key = None
            if already_split and not expandable:  # an already-split free block becomes active
                update_stat_array(stats.inactive_split_bytes, small, -block.size)
                update_stat_array(stats.inactive_split, small, -1)
        block.allocated = True
        block.requested_size = orig
        if self.history is not None:
            self.record_entry("alloc", block.ptr, orig, block.stream)
        size = block.size
        update_stat_array(stats.allocation, small, 1)
        update_stat_array(stats.allocated_bytes, small, size)
        update_stat_array(stats.active, small, 1)
        update_stat_array(stats.active_bytes, small, size)
        update_stat_array(stats.requested_bytes, small, orig)
        if size >= self.max_split:
            stats.oversize_allocations.increase(1)
        return block

    def _free_block(self, block: Block) -> None:
        """Complete a free: merge with free neighbours and put the result in its pool's free list."""
        if self.history is not None:
            self.record_entry("free_completed", block.ptr, block.requested_size, block.stream)
        original_size = block.size
        requested = block.requested_size
        pool = block.pool
        net_blocks = 0
        net_bytes = 0
        reused_key = None  # an absorbed neighbour's slot in the free list, re-keyed for the merged block
        prev = block.prev
        if prev is not None and prev.key is not None:  # free and mapped (not allocated, pending or unmapped)
            reused_key = prev.key
            prev.key = None
            block.ptr = prev.ptr
            block.size += prev.size
            net_blocks -= 1
            net_bytes -= prev.size
            prev = block.prev = prev.prev
            if prev is None:
                block.segment.head = block
            else:
                prev.next = block
        nxt = block.next
        if nxt is not None and nxt.key is not None:
            if reused_key is None:
                reused_key = nxt.key
            else:
                pool.remove(nxt)
            nxt.key = None
            block.size += nxt.size
            net_blocks -= 1
            net_bytes -= nxt.size
            nxt = block.next = nxt.next
            if nxt is not None:
                nxt.prev = block
        size = block.size
        key = size << PTR_BITS | block.ptr
        if reused_key is None:
            pool.free_list(block.stream).add(key, block)
        else:
            pool.free[block.stream].rekey(reused_key, key, block)
        block.key = key
        block.gc_base = pool.gc_calls
        if prev is not None or nxt is not None:
            net_blocks += 1
            net_bytes += size
        stats = self.stats
        small = pool.is_small
        if not block.segment.expandable:  # expandable segments keep no inactive_split statistics
            if net_blocks != 0:
                update_stat_array(stats.inactive_split, small, net_blocks)
            if net_bytes != 0:
                update_stat_array(stats.inactive_split_bytes, small, net_bytes)
        update_stat_array(stats.active, small, -1)
        update_stat_array(stats.active_bytes, small, -original_size)
        update_stat_array(stats.requested_bytes, small, -requested)

    # ------------------------------------------------------------------ segments

    def _alloc_block(self, pool: BlockPool, size: int, alloc_size: int, stream: int, retry: bool) -> Block | None:
        """A new segment (or newly mapped expandable pages) for a block of ``size``; None when out of memory."""
        if retry:
            self.stats.num_alloc_retries += 1
        allowed = self.allowed_memory_maximum
        if allowed is not None and self.total_allocated_memory + alloc_size > allowed:
            return None
        owner = pool.owner
        if pool.expandable:
            block = expandable_segments.allocate(self, pool, size, stream)
            if block is not None and owner is not None:
                owner.cudaMalloc_count += 1
            return block
        if owner is not None and owner.allocator is not None:
            ptr = owner.allocator.raw_alloc(alloc_size, stream)
            if ptr and not (isinstance(ptr, int) and 0 < ptr < 2**PTR_BITS):
                raise ValueError(
                    f"raw_alloc returned {ptr!r}; a pool allocator must return an int address in (0, 2**64), "
                    "or 0 when out of memory"
                )
        else:
            ptr = self.memory.cuda_malloc(alloc_size)
        if not ptr:
            return None
        if owner is not None:
            owner.cudaMalloc_count += 1
        self.total_allocated_memory += alloc_size
        segment = Segment(ptr, alloc_size, stream, pool)
        block = Block(ptr, alloc_size, stream, pool, segment)
        segment.head = block
        self.live_segments[segment] = None
        stats = self.stats
        update_stat_array(stats.segment, pool.is_small, 1)
        update_stat_array(stats.reserved_bytes, pool.is_small, alloc_size)
        if alloc_size >= self.max_split:
            stats.oversize_segments.increase(1)
        stats.num_device_alloc += 1
        if self.history is not None:
            self.record_entry("segment_alloc", ptr, alloc_size, stream)
        return block

    def _release_block(self, block: Block) -> None:
        """Give a whole free (non-expandable) segment back: cudaFree or the pool's raw_delete."""
        stats = self.stats
        stats.num_device_free += 1
        if self.history is not None:
            self.record_entry("segment_free", block.ptr, block.size, block.stream)
        pool = block.pool
        owner = pool.owner
        if owner is not None and owner.allocator is not None:
            owner.allocator.raw_delete(block.ptr, block.size, block.stream)
        else:
            self.memory.cuda_free(block.ptr)
        self.total_allocated_memory -= block.size
        if owner is not None:
            owner.cudaMalloc_count -= 1
        update_stat_array(stats.segment, pool.is_small, -1)
        update_stat_array(stats.reserved_bytes, pool.is_small, -block.size)
        if block.size >= self.max_split:
            stats.oversize_segments.decrease(1)
        pool.remove(block)
        del self.live_segments[block.segment]

    def release_blocks(self, pool: BlockPool) -> None:
        """Release every whole free segment of ``pool``; unmap the free pages of its expandable segments."""
        to_unmap = []
        for block in list(pool):
            if block.segment.expandable:
                to_unmap.append(block)
            elif block.prev is None and block.next is None:
                self._release_block(block)
        for block in to_unmap:
            expandable_segments.unmap_free_pages(self, block)
            if block.prev is None and block.next is None:
                expandable_segments.release_reservation(self, block)

    def _release_available_cached_blocks(self, pool: BlockPool, size: int, stream: int) -> bool:
        """With max_split_size set: free one oversize cached block big enough, or several from the largest down."""
        max_split = self.max_split
        if max_split == SIZE_MAX:
            return False
        target = max(size, max_split)
        free = pool.free.get(stream)
        blocks = list(free) if free is not None else []
        i = bisect_left([block.key for block in blocks], target << PTR_BITS)
        if i < len(blocks) and not blocks[i].segment.expandable:
            self._release_block(blocks[i])
            return True
        released = 0
        i -= 1
        while released < target and i >= 0 and blocks[i].size >= max_split:
            block = blocks[i]
            if not block.segment.expandable:
                released += block.size
                self._release_block(block)
            i -= 1
        return released >= target

    def release_cached_blocks(self, pool_id: tuple[int, int] = DEFAULT_POOL) -> bool:
        """empty_cache's work: whole free segments of the default pool and of freeable pools."""
        pool_id = tuple(pool_id)
        if pool_id == DEFAULT_POOL and not self.captures_underway:
            self.synchronize_and_free_events()
            self.release_blocks(self.large_blocks)
            self.release_blocks(self.small_blocks)
        for freeable_id, private in list(self.graph_pools_freeable.items()):
            if pool_id != DEFAULT_POOL:
                if freeable_id != pool_id:
                    continue
                self.synchronize_and_free_events(private)
            self.release_blocks(private.small_blocks)
            self.release_blocks(private.large_blocks)
            if private.cudaMalloc_count == 0:
                del self.graph_pools[freeable_id]
                del self.graph_pools_freeable[freeable_id]
        return True

    def empty_cache(self, pool_id: tuple[int, int] | None = None) -> None:
        """``torch.cuda.empty_cache()`` (pool_id None) or the MemPool destructor's ``emptyCache(id)``."""
        self.release_cached_blocks(DEFAULT_POOL if pool_id is None else pool_id)

    # ------------------------------------------------------------------ memory fraction and garbage collection

    def set_memory_fraction(self, fraction: float) -> None:
        """``torch.cuda.set_per_process_memory_fraction``: cap new segments at ``fraction`` of the device."""
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"invalid fraction: {fraction}. Please set within [0, 1].")
        self.allowed_memory_maximum = None if fraction >= 1.0 else int(fraction * float(self.memory.capacity))
        self.gc_enabled = self.allowed_memory_maximum is not None and self.config.garbage_collection_threshold > 0.0
        self._fast = (self.divisions is None and self.max_split == SIZE_MAX and not self.expandable
                      and not self.gc_enabled)

    def get_memory_fraction(self) -> float:
        if self.allowed_memory_maximum is None:
            return 1.0
        return self.allowed_memory_maximum / self.memory.capacity

    def _garbage_collect_cached_blocks(self) -> None:
        """Release whole free segments of the default large pool, oldest first, down to the threshold."""
        for block in collection_victims(self):
            self._release_block(block)

    # ------------------------------------------------------------------ events

    def _insert_events(self, block: Block) -> None:
        streams = block.stream_uses
        block.stream_uses = NO_STREAMS
        for stream_id in streams:
            event = Event()
            event.record(self.clockwork.stream(stream_id))
            block.event_count += 1
            queue = self.cuda_events.get(stream_id)
            if queue is None:
                queue = self.cuda_events[stream_id] = deque()
            queue.append((event, block))

    def _free_markers(self, block: Block) -> tuple:
        """``record_free_markers``: the capture graph and the terminal nodes, now, of every stream that
        used ``block``; ``(None, ())`` when one of them is not capturing (the free waits for the end)."""
        streams = self.clockwork.streams
        graph = None
        markers: dict[int, None] = {}
        for stream_id in (block.stream, *block.stream_uses):
            stream = streams.get(stream_id)
            capture = stream.capture if stream is not None else None
            if capture is None:
                return (None, ())
            graph = capture
            markers.update(dict.fromkeys(capture.terminals.get(stream_id, ())))
        return (graph, tuple(markers))

    def _free_safe_blocks_in_capture(self, stream_id: int) -> None:
        """``graph_capture_record_stream_reuse``: at an allocation on a capturing stream, free the
        deferred blocks of that stream whose every free marker precedes the stream's terminals (the
        graph orders all later work after their last use; no event is needed)."""
        stream = self.clockwork.streams.get(stream_id)
        graph = stream.capture if stream is not None else None
        if graph is None or not graph.terminals.get(stream_id):
            return
        seen = graph.preceding(stream_id)
        safe = [block for block, (owner, markers) in self._deferred.items()
                if markers and owner is graph and block.stream == stream_id and all(m in seen for m in markers)]
        for block in safe:
            block.stream_uses = NO_STREAMS
            del self._deferred[block]
            self._free_block(block)

    def _insert_deferred_events(self) -> None:
        deferred, self._deferred = self._deferred, {}
        for block in deferred:
            captured = self._capture_stream_uses.pop(block, None)
            if captured:
                block.stream_uses = {s for s in block.stream_uses if s not in captured}
            self._insert_events(block)
            if block.event_count == 0:
                self._free_block(block)

    def process_events(self) -> None:
        """Free blocks whose events completed (FIFO per stream); runs at malloc when no capture is underway."""
        if self._deferred:
            self._insert_deferred_events()
        for stream_id, queue in list(self.cuda_events.items()):
            while queue:
                event, block = queue[0]
                if not event.query():
                    break
                queue.popleft()
                block.event_count -= 1
                if block.event_count == 0:
                    self._free_block(block)
            if not queue:
                del self.cuda_events[stream_id]

    def synchronize_and_free_events(self, private: PrivatePool | None = None) -> None:
        """Wait for outstanding events (of one pool, or all) and free their blocks."""
        self.stats.num_sync_all_streams += 1
        if self.captures_underway:
            raise RuntimeError(
                "cannot synchronize allocator events while a capture or use_mem_pool is active "
                f"(routing to {[pid for pid, _ in self.captures_underway]}); leave those contexts first"
            )
        if self._deferred:
            self._insert_deferred_events()
        for stream_id, queue in list(self.cuda_events.items()):
            kept = deque()
            for event, block in queue:
                if private is not None and block.pool.owner is not private:
                    kept.append((event, block))
                    continue
                event.synchronize()
                block.event_count -= 1
                if block.event_count == 0:
                    self._free_block(block)
            if kept:
                self.cuda_events[stream_id] = kept
            else:
                del self.cuda_events[stream_id]

    # ------------------------------------------------------------------ private pools

    def new_pool_id(self, kind: str = "handle") -> tuple[int, int]:
        """A fresh pool id: ``"graph"`` -> (n, 0) as a capture without pool; ``"handle"`` -> (0, n)
        as ``graph_pool_handle()`` / ``MemPool``."""
        if kind == "graph":
            pool_id = (self._next_capture_id, 0)
            self._next_capture_id += 1
        elif kind in ("handle", "mempool"):
            pool_id = (0, self._next_mempool_id)
            self._next_mempool_id += 1
        else:
            raise ValueError(f"pool id kind must be 'graph', 'handle' or 'mempool', got {kind!r}")
        return pool_id

    def create_or_incref_pool(self, pool_id, allocator=None, use_on_oom: bool = False, no_split: bool = False) -> None:
        """Create the private pool (use_count 1) or add a user to an existing, not yet released one."""
        pool_id = pool_tuple(pool_id)
        if pool_id == DEFAULT_POOL:
            raise ValueError("(0, 0) is the default pool; private pools need another id (see new_pool_id)")
        private = self.graph_pools.get(pool_id)
        if private is None:
            if allocator is not None and not (hasattr(allocator, "raw_alloc") and hasattr(allocator, "raw_delete")):
                raise TypeError("a pool allocator needs raw_alloc(nbytes, stream) and raw_delete(address, nbytes, stream)")
            private = self.graph_pools[pool_id] = PrivatePool(pool_id, allocator, self.expandable)
            private.small_blocks.order = private.large_blocks.order = self.stream_keys
            self._bump_pool_ids(pool_id)
        else:
            if private.use_count <= 0:
                raise PoolReleasedError(pool_id)
            if allocator is not None:
                raise RuntimeError(f"pool {pool_id} already exists; its allocator can only be given at creation")
            private.use_count += 1
        if use_on_oom:
            self.set_use_on_oom(pool_id, True)
        if no_split:
            private.no_split = True

    def set_use_on_oom(self, pool_id, enabled: bool) -> None:
        pool_id = pool_tuple(pool_id)
        private = self.private_pool(pool_id)
        private.use_on_oom = bool(enabled)
        if enabled:
            self.use_on_oom_pools[pool_id] = None
        else:
            self.use_on_oom_pools.pop(pool_id, None)

    def set_no_split(self, pool_id, enabled: bool = True) -> None:
        self.private_pool(pool_tuple(pool_id)).no_split = bool(enabled)

    def begin_allocate_to_pool(self, pool_id, filter: Callable[[int, int], bool]) -> None:
        """Route allocations for which ``filter(stream, thread)`` holds into the private pool."""
        pool_id = pool_tuple(pool_id)
        self.create_or_incref_pool(pool_id)
        for routed_id, _ in self.captures_underway:
            if routed_id == pool_id:
                raise RuntimeError(
                    f"beginAllocateToPool: already recording to mempool_id {pool_id}; "
                    "end the current capture/use_mem_pool of this pool before starting another"
                )
        self.captures_underway.append((pool_id, filter))

    def end_allocate_to_pool(self, pool_id) -> None:
        pool_id = pool_tuple(pool_id)
        for i, (routed_id, _) in enumerate(self.captures_underway):
            if routed_id == pool_id:
                del self.captures_underway[i]
                return
        raise RuntimeError(f"endAllocateToPool: not currently recording to mempool_id {pool_id}")

    def release_pool(self, pool_id) -> None:
        """Drop one user; at use_count 0 the pool's free segments become releasable by empty_cache."""
        pool_id = pool_tuple(pool_id)
        private = self.private_pool(pool_id)
        if private.use_count <= 0:
            raise RuntimeError(f"release_pool({pool_id}): the pool was already released")
        private.use_count -= 1
        if private.use_count == 0:
            self.graph_pools_freeable[pool_id] = private

    def _bump_pool_ids(self, pool_id: tuple[int, int]) -> None:
        """Keep new_pool_id from handing out an id that a pool already has."""
        first, second = pool_id
        self._next_capture_id = max(self._next_capture_id, first + 1)
        self._next_mempool_id = max(self._next_mempool_id, second + 1)

    def private_pool(self, pool_id: tuple[int, int]) -> PrivatePool:
        private = self.graph_pools.get(pool_id)
        if private is None:
            raise KeyError(f"no private pool {pool_id}; create it with create_or_incref_pool first")
        return private

    def _try_mempool_fallback(self, pool: BlockPool, size: int, stream: int) -> tuple[Block, FreeList] | None:
        """A default-pool request may take a free block from a ``use_on_oom`` pool (never growing it)."""
        if pool.owner is not None:
            return None
        for pool_id in self.use_on_oom_pools:
            private = self.graph_pools.get(pool_id)
            if private is None:
                continue
            lender = private.small_blocks if size <= SMALL_SIZE else private.large_blocks
            found = self.get_free_block(lender, size, stream, False)
            if found is not None:
                return found
        return None

    # ------------------------------------------------------------------ out of memory

    def _raise_oom(self, pool: BlockPool, size: int, alloc_size: int, stream: int) -> None:
        device_free, device_total = self.memory.mem_get_info()
        if self.history is not None:
            self.record_entry("oom", device_free, size, stream)
        self.stats.num_ooms += 1
        allocated = self.stats.allocated_bytes.aggregate.current
        reserved = self.stats.reserved_bytes.aggregate.current
        in_private = sum(
            block.size for private in self.graph_pools.values()
            for bp in (private.large_blocks, private.small_blocks) for block in bp
        )
        raise AllocatorOutOfMemoryError(
            device=self.device, alloc_size=alloc_size, requested=size, stream=stream, device_free=device_free,
            device_total=device_total, process_used=self.memory.used, allowed=self.allowed_memory_maximum,
            allocated=allocated, in_private=in_private, reserved=reserved,
        )

    # ------------------------------------------------------------------ history and snapshots

    def record_history(self, enabled: bool = True, max_entries: int = 1_000_000) -> None:
        """Start (or stop and clear) recording trace entries, keeping the newest ``max_entries``."""
        if not enabled:
            self.history = None
            return
        if max_entries <= 0:
            raise ValueError(f"max_entries must be positive, got {max_entries}")
        self.history = deque(self.history or (), maxlen=max_entries)

    def record_entry(self, action: str, addr: int, size: int, stream: int) -> None:
        """Append one trace entry in torch's format (callers check that ``history`` is on)."""
        self.history.append({
            "action": action,
            "device_free" if action == "oom" else "addr": addr,
            "size": size,
            "stream": stream,
            "time_us": int(self.clockwork.now_us),
            "compile_context": "N/A",
            "user_metadata": "",
        })

    def segments(self) -> list[Segment]:
        """Live segments sorted by address (nested pluggable segments after their host)."""
        return sorted(self.live_segments, key=lambda s: (s.address, -s.size))

    def snapshot(self, pool_id=None) -> list[dict]:
        """``torch.cuda.memory_snapshot(mempool_id)``: segments in torch's format, by address (see :mod:`.snapshots`)."""
        only, unknown = None, False
        if pool_id is not None and pool_tuple(pool_id) != DEFAULT_POOL:
            only = self.graph_pools.get(pool_tuple(pool_id))
            unknown = only is None
        result = [] if unknown else snapshots.segment_infos(self, only)
        if self.history is not None:
            self.record_entry("snapshot", 0, sum(info["active_size"] for info in result), 0)
        return result

    def full_snapshot(self) -> dict:
        """``torch.cuda.memory._snapshot()``: segments, device traces, settings."""
        segments = self.snapshot()
        return {
            "segments": segments,
            "device_traces": [list(self.history or ())],
            "allocator_settings": self.config.settings(),
            "external_annotations": [],
        }

    # ------------------------------------------------------------------ statistics

    def memory_stats(self) -> dict[str, int]:
        """``torch.cuda.memory_stats()``: flat, sorted keys such as ``reserved_bytes.all.current``."""
        return self.stats.as_dict()

    def memory_reserved(self) -> int:
        return self.stats.reserved_bytes.aggregate.current

    def memory_allocated(self) -> int:
        return self.stats.allocated_bytes.aggregate.current

    def reset_peak_memory_stats(self) -> None:
        self.stats.reset_peak()

    def reset_accumulated_memory_stats(self) -> None:
        self.stats.reset_accumulated()


def collection_victims(allocator: CachingAllocator) -> list[Block]:
    """The blocks garbage collection would release now, in order (torch's rule; nothing is released here).

    Above the threshold (a fraction of the allowed memory), whole free segments of the
    default large pool at least as old as the average (in searches of that pool since they
    became free) go, pass after pass, until enough is reclaimed.
    """
    if allocator.allowed_memory_maximum is None or allocator.config.garbage_collection_threshold <= 0.0:
        return []
    threshold = int(allocator.config.garbage_collection_threshold * float(allocator.allowed_memory_maximum))
    if allocator.total_allocated_memory <= threshold:
        return []
    target = allocator.total_allocated_memory - threshold
    pool = allocator.large_blocks
    candidates = list(pool)
    total_age = 0
    freeable = 0
    for block in candidates:
        if block.prev is None and block.next is None:
            total_age += pool.gc_calls - block.gc_base
            freeable += 1
    victims: list[Block] = []
    if freeable == 0:
        return victims
    chosen = set()
    reclaimed = 0
    freed_one = True
    while reclaimed < target and freed_one and freeable > 0:
        age_threshold = total_age / freeable  # blocks at least as old as the average go first
        freed_one = False
        for block in candidates:
            if id(block) in chosen:
                continue
            age = pool.gc_calls - block.gc_base
            if block.prev is None and block.next is None and not block.segment.expandable and age >= age_threshold:
                freed_one = True
                reclaimed += block.size
                total_age -= age
                freeable -= 1
                chosen.add(id(block))
                victims.append(block)
    return victims
