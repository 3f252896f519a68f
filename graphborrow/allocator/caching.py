"""A model of PyTorch's CUDA caching allocator (one device), rule for rule.

What it reproduces (``c10/cuda/CUDACachingAllocator.cpp``, torch 2.8 to 2.11): size
rounding (:mod:`graphborrow.core.sizes`), small/large block pools per pool, best fit on the
same stream with a single candidate, low-end splits where the old block becomes the
remainder, merging with free neighbours, segment sizes, expandable segments (one growing
virtual segment per stream and pool whose pages are mapped and unmapped), the
``max_split_size`` oversize rules, garbage collection under a memory fraction, private
pools with strict LIFO routing (graph capture by stream, ``use_mem_pool`` by thread),
pluggable-allocator pools, ``use_on_oom`` and ``no_split`` pools, ``record_stream`` events
and deferred frees, ``empty_cache``, out-of-memory handling, ``memory_stats`` kept as torch
keeps them (a :class:`StatArray` per statistic, changed only through
:func:`update_stat_array`), and snapshots / trace entries in torch's own format.

Streams are plain ints here (0 is the default stream); the :class:`Clockwork` turns
them into simulated streams with clocks when events are recorded.

This file runs as plain Python, and is also compiled as it stands by Cython with the C
types in ``caching.pxd`` (see ``compiled.py``), the build that makes sweeps fast.
"""

from __future__ import annotations

import threading
from bisect import bisect_left, insort
from collections import deque
from typing import Any, Callable

import torch
from sortedcontainers import SortedDict, SortedList

from graphborrow.core.sizes import (
    MIN_BLOCK_SIZE,
    SMALL_SIZE,
    allocation_size,
    expandable_page_size,
    format_size,
    round_size,
)

from .config import SIZE_MAX, AllocatorConfig
from .memory import PhysicalMemory
from .streams import Clockwork, Event

__all__ = [
    "ARRAY_STATS", "DEFAULT_POOL", "Block", "BlockPool", "CachingAllocator", "DeviceStats", "FreeKeys",
    "FreeList", "PrivatePool", "RestoredBlocks", "Segment", "Stat", "StatArray", "update_stat_array",
]

DEFAULT_POOL = (0, 0)
ARRAY_STATS = (
    "allocation", "segment", "active", "inactive_split",
    "allocated_bytes", "reserved_bytes", "active_bytes", "inactive_split_bytes", "requested_bytes",
)
COUNTERS = ("num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc", "num_device_free")
NO_STREAMS: frozenset[int] = frozenset()  # shared "no other stream used" value; record_stream replaces it
PTR_BITS = 64  # free-list keys are size << PTR_BITS | ptr, so addresses must be below 2**64


# ----------------------------------------------------------------------------- statistics


class Stat:
    """One statistic as torch keeps it: current value, peak, sum of increases, sum of decreases."""

    __slots__ = ("current", "peak", "allocated", "freed")

    def __init__(self) -> None:
        self.current = 0
        self.peak = 0
        self.allocated = 0
        self.freed = 0

    def increase(self, amount: int) -> None:
        self.current += amount
        self.allocated += amount
        if self.current > self.peak:
            self.peak = self.current

    def decrease(self, amount: int) -> None:
        self.current -= amount
        self.freed += amount

    def reset_peak(self) -> None:
        self.peak = self.current

    def reset_accumulated(self) -> None:
        self.allocated = 0
        self.freed = 0

    def as_dict(self) -> dict[str, int]:
        return {"current": self.current, "peak": self.peak, "allocated": self.allocated, "freed": self.freed}


class StatArray:
    """A statistic for each of torch's stat types: ``all`` (aggregate), ``small_pool``, ``large_pool``."""

    __slots__ = ("aggregate", "small_pool", "large_pool")

    def __init__(self) -> None:
        self.aggregate = Stat()
        self.small_pool = Stat()
        self.large_pool = Stat()

    def by_type(self) -> dict[str, Stat]:
        return {"all": self.aggregate, "small_pool": self.small_pool, "large_pool": self.large_pool}


def update_stat_array(stat_array: StatArray, is_small: bool, amount: int) -> None:
    """Change one statistic by ``amount`` for the aggregate and for the block's pool kind.

    The only way the allocator changes a :class:`StatArray` (torch's
    ``for_each_selected_stat_type`` with the stat types of a pool).
    """
    kind = stat_array.small_pool if is_small else stat_array.large_pool
    if amount >= 0:
        stat_array.aggregate.increase(amount)
        kind.increase(amount)
    else:
        stat_array.aggregate.decrease(-amount)
        kind.decrease(-amount)


class DeviceStats:
    """torch's ``DeviceStats``: the statistics behind ``memory_stats()``."""

    __slots__ = (*ARRAY_STATS, "oversize_allocations", "oversize_segments", *COUNTERS, "max_split_size")

    def __init__(self, max_split_size: int) -> None:
        self.allocation = StatArray()
        self.segment = StatArray()
        self.active = StatArray()
        self.inactive_split = StatArray()
        self.allocated_bytes = StatArray()
        self.reserved_bytes = StatArray()
        self.active_bytes = StatArray()
        self.inactive_split_bytes = StatArray()
        self.requested_bytes = StatArray()
        self.oversize_allocations = Stat()
        self.oversize_segments = Stat()
        self.num_alloc_retries = 0
        self.num_ooms = 0
        self.num_sync_all_streams = 0
        self.num_device_alloc = 0
        self.num_device_free = 0
        self.max_split_size = max_split_size

    def arrays(self) -> dict[str, StatArray]:
        return {name: getattr(self, name) for name in ARRAY_STATS}

    def as_dict(self) -> dict[str, int]:
        """Flat, sorted keys such as ``reserved_bytes.all.current``, as ``torch.cuda.memory_stats()``."""
        flat: dict[str, int] = {}
        for name, stat_array in self.arrays().items():
            for stat_type, stat in stat_array.by_type().items():
                for field, value in stat.as_dict().items():
                    flat[f"{name}.{stat_type}.{field}"] = value
        for name in ("oversize_allocations", "oversize_segments"):
            for field, value in getattr(self, name).as_dict().items():
                flat[f"{name}.{field}"] = value
        for name in COUNTERS:
            flat[name] = getattr(self, name)
        flat["max_split_size"] = _as_int64(self.max_split_size)
        return dict(sorted(flat.items()))

    def every_stat(self) -> list[Stat]:
        stats = [stat for stat_array in self.arrays().values() for stat in stat_array.by_type().values()]
        return stats + [self.oversize_allocations, self.oversize_segments]

    def reset_peak(self) -> None:
        for stat in self.every_stat():
            stat.reset_peak()

    def reset_accumulated(self) -> None:
        for stat in self.every_stat():
            stat.reset_accumulated()
        for name in COUNTERS:
            setattr(self, name, 0)


# ----------------------------------------------------------------------------- data model


class Segment:
    """One cudaMalloc (or pluggable raw_alloc) range, or one expandable segment's virtual range.

    ``head`` is its lowest block. An expandable segment (``expandable``) maps physical pages
    of ``page_size`` bytes into its range on demand; its unmapped parts are blocks too.
    """

    __slots__ = ("address", "size", "stream", "pool", "head", "expandable", "page_size")

    def __init__(self, address: int, size: int, stream: int, pool: "BlockPool",
                 expandable: bool = False, page_size: int = 0) -> None:
        self.address = address
        self.size = size
        self.stream = stream
        self.pool = pool
        self.head: Block | None = None
        self.expandable = expandable
        self.page_size = page_size

    def blocks(self):
        block = self.head
        while block is not None:
            yield block
            block = block.next


class Block:
    """A range of one segment: allocated, pending free (events outstanding), free in its pool, or unmapped."""

    __slots__ = (
        "ptr", "size", "requested_size", "stream", "allocated", "prev", "next", "pool",
        "event_count", "stream_uses", "segment", "key", "mapped", "gc_base",
    )

    def __init__(self, ptr: int, size: int, stream: int, pool: "BlockPool", segment: Segment,
                 prev: "Block | None" = None, next: "Block | None" = None) -> None:
        self.ptr = ptr
        self.size = size
        self.requested_size = 0
        self.stream = stream
        self.allocated = False
        self.prev = prev
        self.next = next
        self.pool = pool
        self.event_count = 0
        self.stream_uses: set[int] | frozenset[int] = NO_STREAMS
        self.segment = segment
        self.key: int | None = None  # size << PTR_BITS | ptr while in its pool's FreeList
        self.mapped = True  # False only for the unmapped parts of an expandable segment
        self.gc_base = 0  # the pool's get_free_block count when the block last entered its free list

    @property
    def state(self) -> str:
        if self.allocated:
            return "active_allocated"
        if self.event_count > 0 or self.stream_uses:
            return "active_pending_free"
        return "inactive"

    @property
    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None

    def __repr__(self) -> str:
        mapped = "" if self.mapped else ", unmapped"
        return f"Block(ptr={self.ptr:#x}, size={self.size}, stream={self.stream}, {self.state}{mapped})"


class FreeKeys(SortedList):
    """Sorted int keys ``size << PTR_BITS | ptr`` of one free list: the one place that reads SortedList's internals.

    A SortedList keeps its keys in runs (``_lists``) and each run's largest key in
    ``_maxes``. Best fit reads those two levels directly, and :meth:`rekey` rewrites or
    moves a key inside its run when the new key still belongs there, which changes no
    run's length and so keeps the SortedList's position index valid. Every split and
    merge re-keys one block, so this is the allocator's innermost loop.
    """

    def first_at_least(self, probe: int) -> int | None:
        """The smallest key >= ``probe`` (best fit), or None."""
        maxes = self._maxes
        pos = bisect_left(maxes, probe)
        if pos == len(maxes):
            return None
        run = self._lists[pos]
        return run[bisect_left(run, probe)]

    def after(self, key: int) -> int | None:
        """The next key after ``key`` (which is present), or None."""
        maxes = self._maxes
        pos = bisect_left(maxes, key)
        run = self._lists[pos]
        idx = bisect_left(run, key) + 1
        if idx < len(run):
            return run[idx]
        if pos + 1 < len(maxes):
            return self._lists[pos + 1][0]
        return None

    def rekey(self, old: int, new: int) -> None:
        """Replace the present key ``old`` by ``new`` (not present)."""
        maxes = self._maxes
        lists = self._lists
        pos = bisect_left(maxes, old)
        run = lists[pos]
        if new < old:
            if pos > 0 and maxes[pos - 1] >= new:  # ``new`` belongs to an earlier run
                self.remove(old)
                self.add(new)
                return
            idx = bisect_left(run, old)
            if idx == 0 or run[idx - 1] < new:
                run[idx] = new
            else:
                del run[idx]
                insort(run, new)
            maxes[pos] = run[-1]
        else:
            if pos + 1 < len(maxes) and new > lists[pos + 1][0]:  # ``new`` belongs to a later run
                self.remove(old)
                self.add(new)
                return
            idx = bisect_left(run, old)
            if idx + 1 == len(run) or new < run[idx + 1]:
                run[idx] = new
            else:
                del run[idx]
                insort(run, new)
            maxes[pos] = run[-1]

    def check(self) -> None:
        """SortedList's own invariants (order, run maxima and lengths, position index)."""
        self._check()

    def set_load(self, load: int) -> None:
        """Keys per run (SortedList's load factor); small values make re-keys cross runs, for tests."""
        self._reset(load)


class FreeList:
    """Free blocks of one stream in one pool, ordered by (size, ptr): keys and the block of each key."""

    __slots__ = ("keys", "blocks")

    def __init__(self) -> None:
        self.keys = FreeKeys()
        self.blocks: dict[int, Block] = {}

    def __len__(self) -> int:
        return len(self.blocks)

    def add(self, key: int, block: Block) -> None:
        self.keys.add(key)
        self.blocks[key] = block

    def remove(self, key: int) -> None:
        self.keys.remove(key)
        del self.blocks[key]

    def rekey(self, old: int, new: int, block: Block) -> None:
        """Give the slot of key ``old`` to ``block`` under key ``new`` (a split shrinks, a merge grows)."""
        self.keys.rekey(old, new)
        blocks = self.blocks
        del blocks[old]
        blocks[new] = block

    def best_fit(self, probe: int) -> Block | None:
        """The block of the smallest key >= ``probe``, or None."""
        key = self.keys.first_at_least(probe)
        return None if key is None else self.blocks[key]

    def successor(self, block: Block) -> Block | None:
        """The free block after ``block`` in (size, ptr) order, or None."""
        key = self.keys.after(block.key)
        return None if key is None else self.blocks[key]

    def __iter__(self):
        return map(self.blocks.__getitem__, list(self.keys))


class BlockPool:
    """Free blocks of one size class of one pool: a :class:`FreeList` per stream, unmapped blocks per stream."""

    __slots__ = ("is_small", "owner", "free", "unmapped", "expandable", "no_split", "gc_calls", "order")

    def __init__(self, is_small: bool, owner: "PrivatePool | None", expandable: bool) -> None:
        self.is_small = is_small
        self.owner = owner
        self.free: dict[int, FreeList] = {}  # stream -> its free blocks
        self.unmapped: dict[int, SortedDict] = {}  # stream -> ptr -> unmapped block (expandable segments)
        self.expandable = expandable  # expandable segments are active for allocations routed here
        self.no_split = False
        self.gc_calls = 0  # get_free_block calls while garbage collection is on (block ages count these)
        self.order: dict[int, int] = {}  # stream -> the key it sorts by (its cudaStream_t), where not itself

    def free_list(self, stream: int) -> FreeList:
        free = self.free.get(stream)
        if free is None:
            free = self.free[stream] = FreeList()
        return free

    def insert(self, block: Block) -> None:
        key = block.size << PTR_BITS | block.ptr
        block.key = key
        block.gc_base = self.gc_calls
        self.free_list(block.stream).add(key, block)

    def remove(self, block: Block) -> None:
        self.free[block.stream].remove(block.key)
        block.key = None

    def __iter__(self):
        """Free blocks in (stream, size, ptr) order (streams by their handle, as torch compares them)."""
        order = self.order
        for stream in (sorted(self.free, key=lambda s: order.get(s, s)) if order else sorted(self.free)):
            yield from self.free[stream]

    @property
    def owner_id(self) -> tuple[int, int]:
        return DEFAULT_POOL if self.owner is None else self.owner.id


class PrivatePool:
    """A graph pool / MemPool: its own small and large block pools, optional raw allocator."""

    def __init__(self, pool_id: tuple[int, int], allocator: Any, expandable: bool) -> None:
        self.id = pool_id
        self.use_count = 1
        self.cudaMalloc_count = 0
        self.allocator = allocator
        self.use_on_oom = False
        # expandable segments serve private pools too, except those with their own allocator
        expandable = expandable and allocator is None
        self.small_blocks = BlockPool(True, self, expandable)
        self.large_blocks = BlockPool(False, self, expandable)

    @property
    def no_split(self) -> bool:
        return self.small_blocks.no_split

    @no_split.setter
    def no_split(self, enabled: bool) -> None:
        self.small_blocks.no_split = self.large_blocks.no_split = bool(enabled)

    def __repr__(self) -> str:
        return f"PrivatePool(id={self.id}, use_count={self.use_count}, segments={self.cudaMalloc_count})"


def _allocatable(block: Block | None) -> bool:
    """Free or unmapped: usable address space for an expandable segment."""
    return block is not None and not block.allocated and block.event_count == 0 and not block.stream_uses


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
        self._segments: dict[Segment, None] = {}
        self._cuda_events: dict[int, deque] = {}
        self._deferred: list[Block] = []
        self._capture_stream_uses: dict[Block, set[int]] = {}
        self._history: deque | None = None
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
        """Allocate a block for ``nbytes`` on ``stream`` (an int); raises torch.OutOfMemoryError."""
        if nbytes <= 0:
            raise ValueError(
                f"malloc({nbytes}): the caching allocator only sees positive sizes; "
                "a 0-byte tensor needs no block (torch gives it data_ptr 0)"
            )
        if not self._fast or self.captures_underway or self._cuda_events or self._deferred:
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
        if not captures and (self._cuda_events or self._deferred):
            self.process_events()
        size = round_size(nbytes, self.divisions)
        if captures:
            pool = self._get_pool(size, stream, threading.get_ident() if thread is None else thread)
        else:
            pool = self.small_blocks if size <= SMALL_SIZE else self.large_blocks
        es_active = pool.expandable
        found = self._get_free_block(pool, size, stream, es_active)
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
        if self._history is not None:
            self._trace("free_requested", block.ptr, block.requested_size, block.stream)
        if size >= self.max_split:
            stats.oversize_allocations.decrease(1)
        if block.stream_uses:
            if self.captures_underway:
                self._deferred.append(block)
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

    def block_at(self, address: int) -> Block | None:
        """The active block (allocated or pending free) starting at ``address``.

        A walk over the segments, for inspection: the allocator itself never looks
        blocks up by address. Where pools nest (a pluggable pool's segment inside
        another pool's block) the innermost segment's block is the answer.
        """
        found = None
        for segment in self._segments:
            if segment.address <= address < segment.address + segment.size and (
                found is None or segment.size < found.segment.size
            ):
                for block in segment.blocks():
                    if block.ptr == address and block.mapped and block.state != "inactive":
                        found = block
        return found

    def cached_block_for(self, nbytes: int, stream: int = 0, pool_id=DEFAULT_POOL) -> Block | None:
        """The cached block a malloc of ``nbytes`` on ``stream`` routed to ``pool_id`` would take, or None.

        A query without side effects (trace replay asks it to rule pools out).
        """
        pool_id = _pool_id(pool_id)
        size = round_size(nbytes, self.divisions)
        if pool_id == DEFAULT_POOL:
            pool = self.small_blocks if size <= SMALL_SIZE else self.large_blocks
        else:
            private = self._private(pool_id)
            pool = private.small_blocks if size <= SMALL_SIZE else private.large_blocks
        found = self._get_free_block(pool, size, stream, pool.expandable, False)
        return None if found is None else found[0]

    def drain_trace(self) -> list[dict]:
        """The trace entries recorded since the last call (history must be on), oldest first."""
        if self._history is None:
            raise RuntimeError("drain_trace() needs record_history() first")
        entries = list(self._history)
        self._history.clear()
        return entries

    # ------------------------------------------------------------------ search, split, merge

    def _get_pool(self, size: int, stream: int, thread: int) -> BlockPool:
        for pool_id, route in reversed(self.captures_underway):
            if route(stream, thread):
                private = self.graph_pools[pool_id]
                return private.small_blocks if size <= SMALL_SIZE else private.large_blocks
        return self.small_blocks if size <= SMALL_SIZE else self.large_blocks

    def _get_free_block(self, pool: BlockPool, size: int, stream: int, es_active: bool, count: bool = True) -> tuple | None:
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
                       and _expandable_size(following) < _expandable_size(block)):
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
            block = Block.__new__(Block)  # Block.__init__ spelled out: this is the hot path
            block.ptr = remaining.ptr
            block.size = size
            block.requested_size = 0
            block.stream = remaining.stream
            block.pool = pool
            block.segment = remaining.segment
            block.prev = prev
            block.next = remaining
            block.event_count = 0
            block.stream_uses = NO_STREAMS
            block.key = None
            block.mapped = True
            block.gc_base = 0
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
        if self._history is not None:
            self._trace("alloc", block.ptr, orig, block.stream)
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
        if self._history is not None:
            self._trace("free_completed", block.ptr, block.requested_size, block.stream)
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
            block = self._try_allocate_expandable_block(pool, size, stream)
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
        self._segments[segment] = None
        stats = self.stats
        update_stat_array(stats.segment, pool.is_small, 1)
        update_stat_array(stats.reserved_bytes, pool.is_small, alloc_size)
        if alloc_size >= self.max_split:
            stats.oversize_segments.increase(1)
        stats.num_device_alloc += 1
        if self._history is not None:
            self._trace("segment_alloc", ptr, alloc_size, stream)
        return block

    def _release_block(self, block: Block) -> None:
        """Give a whole free (non-expandable) segment back: cudaFree or the pool's raw_delete."""
        stats = self.stats
        stats.num_device_free += 1
        if self._history is not None:
            self._trace("segment_free", block.ptr, block.size, block.stream)
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
        del self._segments[block.segment]

    def _release_blocks(self, pool: BlockPool) -> None:
        """Release every whole free segment of ``pool``; unmap the free pages of its expandable segments."""
        to_unmap = []
        for block in list(pool):
            if block.segment.expandable:
                to_unmap.append(block)
            elif block.prev is None and block.next is None:
                self._release_block(block)
        for block in to_unmap:
            self._unmap_block(block)
            if block.prev is None and block.next is None:
                self._release_expandable_segment(block)

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
            self._release_blocks(self.large_blocks)
            self._release_blocks(self.small_blocks)
        for freeable_id, private in list(self.graph_pools_freeable.items()):
            if pool_id != DEFAULT_POOL:
                if freeable_id != pool_id:
                    continue
                self.synchronize_and_free_events(private)
            self._release_blocks(private.small_blocks)
            self._release_blocks(private.large_blocks)
            if private.cudaMalloc_count == 0:
                del self.graph_pools[freeable_id]
                del self.graph_pools_freeable[freeable_id]
        return True

    def release_pool_memory(self, pool_id) -> None:
        """Release a private pool's whole free segments and free pages now, whether or not it is freeable.

        Not something torch can do: trace replay uses it to follow each segment's layout in a
        pool of its own, releasing memory exactly when the trace does.
        """
        private = self._private(_pool_id(pool_id))
        self._release_blocks(private.small_blocks)
        self._release_blocks(private.large_blocks)

    def empty_cache(self, pool_id: tuple[int, int] | None = None) -> None:
        """``torch.cuda.empty_cache()`` (pool_id None) or the MemPool destructor's ``emptyCache(id)``."""
        self.release_cached_blocks(DEFAULT_POOL if pool_id is None else pool_id)

    # ------------------------------------------------------------------ expandable segments

    def _find_expandable_block(self, pool: BlockPool, stream: int, size: int) -> Block:
        """The lowest address in this stream's expandable segments with ``size`` bytes of free or
        unmapped space; a new segment (a virtual reservation) when there is none."""
        unmapped = pool.unmapped.get(stream)
        if unmapped:
            for candidate in list(unmapped.values()):
                if _allocatable(candidate.prev):
                    candidate = candidate.prev
                room, block = 0, candidate
                while room < size and _allocatable(block):
                    room += block.size
                    block = block.next
                if room >= size:
                    return candidate
        page = expandable_page_size(pool.is_small, self.large_segment_size)
        total = self.memory.capacity
        handles = -(-(total + total // 8) // page)  # room for 1 1/8 of the device's memory
        address = self.memory.reserve_address_space(handles * page)
        segment = Segment(address, handles * page, stream, pool, expandable=True, page_size=page)
        block = Block(address, handles * page, stream, pool, segment)
        block.mapped = False
        segment.head = block
        self._segments[segment] = None
        pool.unmapped.setdefault(stream, SortedDict())[address] = block
        return block

    def _map_block(self, to_map: Block, size: int) -> bool:
        """Map the pages under the first ``size`` bytes of an unmapped block; it joins its free neighbours."""
        segment = to_map.segment
        page = segment.page_size
        offset = to_map.ptr - segment.address
        begin, end = offset // page, -(-(offset + size) // page)
        mapped_size = (end - begin) * page
        if mapped_size == 0 or not self.memory.map_pages(to_map.ptr, mapped_size):
            return False
        pool = to_map.pool
        stream = to_map.stream
        del pool.unmapped[stream][to_map.ptr]
        to_map.mapped = True
        ptr = to_map.ptr
        if mapped_size < to_map.size:
            remaining = Block(ptr + mapped_size, to_map.size - mapped_size, stream, pool, segment)
            remaining.mapped = False
            _splice(remaining, to_map, to_map.next)
            pool.unmapped[stream][remaining.ptr] = remaining
            to_map.size = mapped_size
        self._try_merge(to_map, to_map.prev)
        self._try_merge(to_map, to_map.next)
        pool.insert(to_map)
        self.total_allocated_memory += mapped_size
        update_stat_array(self.stats.reserved_bytes, pool.is_small, mapped_size)
        self.stats.num_device_alloc += 1
        if self._history is not None:
            self._trace("segment_map", ptr, mapped_size, stream)
        return True

    def _try_allocate_expandable_block(self, pool: BlockPool, size: int, stream: int) -> Block | None:
        """Map pages until a free block of at least ``size`` exists; it leaves its free list."""
        candidate = self._find_expandable_block(pool, stream, size)
        if not candidate.mapped and not self._map_block(candidate, min(candidate.size, size)):
            return None
        while candidate.size < size:
            following = candidate.next
            if following is None or following.mapped:
                raise AssertionError(f"expandable segment at {candidate.segment.address:#x}: no unmapped room after {candidate!r}")
            if not self._map_block(following, min(size - candidate.size, following.size)):
                return None
            candidate = following  # it absorbed the free block before it
        pool.remove(candidate)
        return candidate

    def _unmap_block(self, block: Block) -> None:
        """Unmap the whole pages inside a free block of an expandable segment (empty_cache)."""
        segment = block.segment
        page = segment.page_size
        offset = block.ptr - segment.address
        begin, end = -(-offset // page), (offset + block.size) // page
        if begin >= end:
            return
        pool = block.pool
        stream = block.stream
        unmapped_ptr, unmapped_size = segment.address + begin * page, (end - begin) * page
        pool.remove(block)
        before_size = unmapped_ptr - block.ptr
        if before_size > 0:
            before = Block(block.ptr, before_size, stream, pool, segment)
            _splice(before, block.prev, block)
            pool.insert(before)
        after_size = block.size - before_size - unmapped_size
        if after_size > 0:
            after = Block(unmapped_ptr + unmapped_size, after_size, stream, pool, segment)
            _splice(after, block, block.next)
            pool.insert(after)
        block.ptr = unmapped_ptr
        block.size = unmapped_size
        block.mapped = False
        self._try_merge(block, block.prev)
        self._try_merge(block, block.next)
        pool.unmapped.setdefault(stream, SortedDict())[block.ptr] = block
        self.memory.unmap_pages(unmapped_ptr, unmapped_size)
        self.total_allocated_memory -= unmapped_size
        update_stat_array(self.stats.reserved_bytes, pool.is_small, -unmapped_size)
        if pool.owner is not None:
            pool.owner.cudaMalloc_count -= 1
        self.stats.num_device_free += 1
        if self._history is not None:
            self._trace("segment_unmap", unmapped_ptr, unmapped_size, stream)

    def _try_merge(self, dst: Block, src: Block | None) -> int:
        """Absorb neighbour ``src`` into ``dst`` when both are free and equally mapped; the bytes absorbed."""
        if src is None or not _allocatable(src) or src.mapped != dst.mapped:
            return 0
        pool = dst.pool
        if src.mapped:
            pool.remove(src)
        else:
            del pool.unmapped[src.stream][src.ptr]
        if dst.prev is src:
            dst.ptr = src.ptr
            dst.prev = src.prev
            if dst.prev is None:
                dst.segment.head = dst
            else:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size
        return src.size

    def _release_expandable_segment(self, block: Block) -> None:
        """An expandable segment with nothing mapped goes away with its virtual reservation."""
        segment = block.segment
        del block.pool.unmapped[block.stream][block.ptr]
        del self._segments[segment]
        self.memory.release_address_space(segment.address)

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
        for block in self.garbage_collection_victims():
            self._release_block(block)

    def garbage_collection_victims(self) -> list[Block]:
        """The blocks garbage collection would release now, in order (a query: nothing is released).

        Above the threshold (a fraction of the allowed memory), whole free segments of the
        default large pool at least as old as the average (in searches of that pool since they
        became free) go, pass after pass, until enough is reclaimed.
        """
        if self.allowed_memory_maximum is None or self.config.garbage_collection_threshold <= 0.0:
            return []
        threshold = int(self.config.garbage_collection_threshold * float(self.allowed_memory_maximum))
        if self.total_allocated_memory <= threshold:
            return []
        target = self.total_allocated_memory - threshold
        pool = self.large_blocks
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

    # ------------------------------------------------------------------ events

    def _insert_events(self, block: Block) -> None:
        streams = block.stream_uses
        block.stream_uses = NO_STREAMS
        for stream_id in streams:
            event = Event()
            event.record(self.clockwork.stream(stream_id))
            block.event_count += 1
            queue = self._cuda_events.get(stream_id)
            if queue is None:
                queue = self._cuda_events[stream_id] = deque()
            queue.append((event, block))

    def _insert_deferred_events(self) -> None:
        deferred, self._deferred = self._deferred, []
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
        for stream_id, queue in list(self._cuda_events.items()):
            while queue:
                event, block = queue[0]
                if not event.query():
                    break
                queue.popleft()
                block.event_count -= 1
                if block.event_count == 0:
                    self._free_block(block)
            if not queue:
                del self._cuda_events[stream_id]

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
        for stream_id, queue in list(self._cuda_events.items()):
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
                self._cuda_events[stream_id] = kept
            else:
                del self._cuda_events[stream_id]

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
        pool_id = _pool_id(pool_id)
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
                raise RuntimeError(
                    f"pool {pool_id} was released (use_count 0) and cannot be used again; "
                    "create a new pool (a fresh graph_pool_handle() or MemPool)"
                )
            if allocator is not None:
                raise RuntimeError(f"pool {pool_id} already exists; its allocator can only be given at creation")
            private.use_count += 1
        if use_on_oom:
            self.set_use_on_oom(pool_id, True)
        if no_split:
            private.no_split = True

    def set_use_on_oom(self, pool_id, enabled: bool) -> None:
        pool_id = _pool_id(pool_id)
        private = self._private(pool_id)
        private.use_on_oom = bool(enabled)
        if enabled:
            self.use_on_oom_pools[pool_id] = None
        else:
            self.use_on_oom_pools.pop(pool_id, None)

    def set_no_split(self, pool_id, enabled: bool = True) -> None:
        self._private(_pool_id(pool_id)).no_split = bool(enabled)

    def begin_allocate_to_pool(self, pool_id, filter: Callable[[int, int], bool]) -> None:
        """Route allocations for which ``filter(stream, thread)`` holds into the private pool."""
        pool_id = _pool_id(pool_id)
        self.create_or_incref_pool(pool_id)
        for routed_id, _ in self.captures_underway:
            if routed_id == pool_id:
                raise RuntimeError(
                    f"beginAllocateToPool: already recording to mempool_id {pool_id}; "
                    "end the current capture/use_mem_pool of this pool before starting another"
                )
        self.captures_underway.append((pool_id, filter))

    def end_allocate_to_pool(self, pool_id) -> None:
        pool_id = _pool_id(pool_id)
        for i, (routed_id, _) in enumerate(self.captures_underway):
            if routed_id == pool_id:
                del self.captures_underway[i]
                return
        raise RuntimeError(f"endAllocateToPool: not currently recording to mempool_id {pool_id}")

    def release_pool(self, pool_id) -> None:
        """Drop one user; at use_count 0 the pool's free segments become releasable by empty_cache."""
        pool_id = _pool_id(pool_id)
        private = self._private(pool_id)
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

    def _private(self, pool_id: tuple[int, int]) -> PrivatePool:
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
            found = self._get_free_block(lender, size, stream, False)
            if found is not None:
                return found
        return None

    # ------------------------------------------------------------------ out of memory

    def _raise_oom(self, pool: BlockPool, size: int, alloc_size: int, stream: int) -> None:
        device_free, device_total = self.memory.mem_get_info()
        if self._history is not None:
            self._trace("oom", device_free, size, stream)
        self.stats.num_ooms += 1
        allocated = self.stats.allocated_bytes.aggregate.current
        reserved = self.stats.reserved_bytes.aggregate.current
        in_private = sum(
            block.size for private in self.graph_pools.values()
            for bp in (private.large_blocks, private.small_blocks) for block in bp
        )
        private_msg = (
            f"with {format_size(in_private)} allocated in private pools (e.g., CUDA Graphs), " if in_private else ""
        )
        allowed = self.allowed_memory_maximum
        allowed_msg = "" if allowed is None else f"{format_size(allowed)} allowed; "
        raise torch.OutOfMemoryError(
            f"CUDA out of memory. Tried to allocate {format_size(alloc_size)}. GPU {self.device} has a total "
            f"capacity of {format_size(device_total)} of which {format_size(device_free)} is free. "
            f"Including non-PyTorch memory, this process has {format_size(self.memory.used)} memory in use. "
            f"{allowed_msg}Of the allocated memory {format_size(allocated + in_private)} is allocated by PyTorch, "
            f"{private_msg}and {format_size(reserved - allocated - in_private)} is reserved by PyTorch but "
            "unallocated. If reserved but unallocated memory is large try setting "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for "
            "Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
        )

    # ------------------------------------------------------------------ restoring state

    def restore(self, segments: list[dict], *, allocators: dict | None = None, pending=None,
                stats: dict | None = None) -> "RestoredBlocks":
        """Rebuild allocator state from torch-format snapshot segments, as if it had been allocated.

        ``segments`` is what ``torch.cuda.memory_snapshot()`` (or ``memory_snapshot(pool_id)``,
        or this model's :meth:`snapshot`) returns. Each segment is placed at its address with
        its stream, pool (``segment_pool_id``; private pools are created as needed, use_count
        1) and kind; ``active_allocated`` blocks become allocated blocks, ``inactive`` ones go
        to their pool's free lists, ``active_pending_free`` ones wait on an event the caller
        controls. Device memory under the segments is marked used, and the statistics are
        those of an allocator that allocated these segments and blocks (peaks = current).
        Expandable segments' mapped ranges of one stream and pool become one expandable
        segment whose virtual range starts at the lowest of them, or at their
        ``reservation_address`` when they give one (a reservation whose lowest pages were not
        mapped then: the pages below its first range are unmapped room, and its range ends
        where the real one does).

        Why: the capacity planner replays a step against a copy of a pool, and trace replay
        starts mid-run traces from a reconstructed state; both need exactly this state.

        Args:
            segments: snapshot segments (dicts with address, total_size, stream,
                segment_type, segment_pool_id and blocks with size, state, requested_size).
            allocators: ``{pool_id: raw allocator}`` for pluggable pools: their segments are
                that allocator's memory (not device memory), and new segments come from it.
            pending: the :class:`Event` the ``active_pending_free`` blocks wait on, or a
                callable ``address -> Event`` giving each its own; required when there are any.
            stats: a ``memory_stats()`` dict whose peaks, totals and counters to take over;
                its current values must equal the restored ones.

        Returns:
            :class:`RestoredBlocks`: the allocated and the pending blocks by address.
        """
        if self._segments or self.captures_underway:
            raise RuntimeError(
                "restore() builds state into an empty allocator; this one already has segments or routing. "
                "Create a fresh CachingAllocator first"
            )
        given = allocators if allocators is not None else {}  # not `(allocators or {}).items()`: Cython 3.3.0 crashes on it
        allocators = {_pool_id(pid): raw for pid, raw in given.items()}
        parsed = [_restorable_segment(i, segment) for i, segment in enumerate(segments)]
        _check_no_overlap(parsed, allocators)
        for pool_id, raw in allocators.items():
            if pool_id == DEFAULT_POOL:
                raise ValueError("the default pool (0, 0) cannot have a pluggable allocator; name a private pool")
            if pool_id not in self.graph_pools:
                self.create_or_incref_pool(pool_id, allocator=raw)
        restored = RestoredBlocks({}, {})
        expandable: dict[tuple, list] = {}
        for item in sorted(parsed, key=lambda p: (p[0], -p[1])):
            address, size, stream, pool_id, is_small, blocks, is_expandable, _ = item
            pool = self._restored_pool(pool_id, is_small)
            if is_expandable:
                expandable.setdefault((stream, pool_id, is_small), []).append(item)
                continue
            if pool.owner is not None:
                pool.owner.cudaMalloc_count += 1
            if pool.owner is None or pool.owner.allocator is None:
                self.memory.reserve(address, size)
            segment = Segment(address, size, stream, pool)
            self._segments[segment] = None
            update_stat_array(self.stats.segment, is_small, 1)
            self._restore_mapped(segment, None, address, size, blocks, restored, pending)
        for (stream, pool_id, is_small), ranges in expandable.items():
            self._restore_expandable(self._restored_pool(pool_id, is_small), stream, ranges, restored, pending)
        if stats is not None:
            self._take_over_stats(stats)
        return restored

    def _restored_pool(self, pool_id: tuple[int, int], is_small: bool) -> BlockPool:
        if pool_id == DEFAULT_POOL:
            return self.small_blocks if is_small else self.large_blocks
        if pool_id not in self.graph_pools:
            self.create_or_incref_pool(pool_id)
        private = self.graph_pools[pool_id]
        return private.small_blocks if is_small else private.large_blocks

    def _restore_mapped(self, segment: Segment, prev: Block | None, address: int, size: int, blocks: list,
                        restored: "RestoredBlocks", pending) -> Block:
        """The blocks of one mapped range, chained after ``prev``; returns the last one."""
        pool = segment.pool
        small = pool.is_small
        stats = self.stats
        self.total_allocated_memory += size
        update_stat_array(stats.reserved_bytes, small, size)
        if size >= self.max_split and not segment.expandable:
            stats.oversize_segments.increase(1)
        stats.num_device_alloc += 1
        split = len(blocks) > 1 or segment.expandable
        ptr = address
        for block_size, state, requested in blocks:
            block = Block(ptr, block_size, segment.stream, pool, segment)
            block.requested_size = requested
            _splice(block, prev, None)
            prev = block
            ptr += block_size
            if state == "inactive":
                pool.insert(block)
                if split and not segment.expandable:
                    update_stat_array(stats.inactive_split, small, 1)
                    update_stat_array(stats.inactive_split_bytes, small, block_size)
                continue
            update_stat_array(stats.active, small, 1)
            update_stat_array(stats.active_bytes, small, block_size)
            update_stat_array(stats.requested_bytes, small, requested)
            if state == "active_allocated":
                block.allocated = True
                update_stat_array(stats.allocation, small, 1)
                update_stat_array(stats.allocated_bytes, small, block_size)
                if block_size >= self.max_split:
                    stats.oversize_allocations.increase(1)
                restored.allocated[block.ptr] = block
            else:
                event = pending(block.ptr) if callable(pending) else pending
                if not isinstance(event, Event):
                    raise ValueError(
                        f"the block of {block_size} bytes at {block.ptr:#x} is active_pending_free: pass "
                        "pending=<Event> (or a callable address -> Event) that it should wait on"
                    )
                stream_id = event.stream.id if event.stream is not None else segment.stream
                block.event_count = 1
                self._cuda_events.setdefault(stream_id, deque()).append((event, block))
                restored.pending[block.ptr] = block
        return prev

    def _restore_expandable(self, pool: BlockPool, stream: int, ranges: list, restored: "RestoredBlocks",
                            pending) -> None:
        """One expandable segment from the mapped ranges of one stream and pool; the gaps are unmapped."""
        page = expandable_page_size(pool.is_small, self.large_segment_size)
        total = self.memory.capacity
        virtual = -(-(total + total // 8) // page) * page
        starts = {r[7] for r in ranges if r[7] is not None}
        if len(starts) > 1:
            raise ValueError(
                f"expandable ranges of stream {stream} in one pool name {len(starts)} reservation starts "
                f"({', '.join(f'{a:#x}' for a in sorted(starts))}); one stream, kind and pool has one reservation"
            )
        base = starts.pop() if starts else ranges[0][0]
        for address, size, *_ in ranges:
            if (address - base) % page or size % page or address + size > base + virtual:
                raise ValueError(
                    f"expandable segment range of {size} bytes at {address:#x} does not fit one expandable segment "
                    f"of {page}-byte pages starting at {base:#x}; the segments come from another device size or pool"
                )
        self.memory.expect_next_address(base)
        self.memory.reserve_address_space(virtual)
        segment = Segment(base, virtual, stream, pool, expandable=True, page_size=page)
        self._segments[segment] = None
        prev, cursor = None, base
        for address, size, _, _, _, blocks, _, _ in ranges:
            if address > cursor:
                prev = self._restore_unmapped(segment, prev, cursor, address - cursor)
            self.memory.map_pages(address, size)
            if pool.owner is not None:
                pool.owner.cudaMalloc_count += 1
            prev = self._restore_mapped(segment, prev, address, size, blocks, restored, pending)
            cursor = address + size
        if cursor < base + virtual:
            self._restore_unmapped(segment, prev, cursor, base + virtual - cursor)

    def _restore_unmapped(self, segment: Segment, prev: Block | None, address: int, size: int) -> Block:
        block = Block(address, size, segment.stream, segment.pool, segment)
        block.mapped = False
        _splice(block, prev, None)
        segment.pool.unmapped.setdefault(segment.stream, SortedDict())[address] = block
        return block

    def _take_over_stats(self, stats: dict) -> None:
        """Peaks, totals and counters from a memory_stats() dict whose current values match ours."""
        mine = self.memory_stats()
        wrong = sorted(key for key in mine if key.endswith(".current") and stats.get(key, mine[key]) != mine[key])
        if wrong:
            key = wrong[0]
            raise ValueError(
                f"stats do not describe these segments: {key} is {stats[key]} there but {mine[key]} after restoring "
                f"({len(wrong)} current values differ); pass the memory_stats() taken with this snapshot, or none"
            )
        named = {f"{name}.{stat_type}": stat for name, stat_array in self.stats.arrays().items()
                 for stat_type, stat in stat_array.by_type().items()}
        named["oversize_allocations"] = self.stats.oversize_allocations
        named["oversize_segments"] = self.stats.oversize_segments
        for prefix, stat in named.items():
            stat.peak = stats.get(f"{prefix}.peak", stat.peak)
            stat.allocated = stats.get(f"{prefix}.allocated", stat.allocated)
            stat.freed = stats.get(f"{prefix}.freed", stat.freed)
        for name in COUNTERS:
            if name in stats:
                setattr(self.stats, name, stats[name])

    # ------------------------------------------------------------------ history and snapshots

    def record_history(self, enabled: bool = True, max_entries: int = 1_000_000) -> None:
        """Start (or stop and clear) recording trace entries, keeping the newest ``max_entries``."""
        if not enabled:
            self._history = None
            return
        if max_entries <= 0:
            raise ValueError(f"max_entries must be positive, got {max_entries}")
        self._history = deque(self._history or (), maxlen=max_entries)

    def _trace(self, action: str, addr: int, size: int, stream: int) -> None:
        self._history.append({
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
        return sorted(self._segments, key=lambda s: (s.address, -s.size))

    def segment_count(self) -> int:
        """How many segments are live (cheaper than ``len(segments())``: nothing is sorted)."""
        return len(self._segments)

    def holds_segment(self, segment: Segment) -> bool:
        """True while ``segment`` is live (not yet released to the device)."""
        return segment in self._segments

    def snapshot(self, pool_id=None) -> list[dict]:
        """``torch.cuda.memory_snapshot(mempool_id)``: segments in torch's format, by address.

        An expandable segment appears as one segment per contiguous mapped range. Like torch,
        a range whose first block is free in a private pool that was already deleted (its
        count of device allocations reached 0 while expandable pages stayed mapped) is missing.
        """
        only = None
        if pool_id is not None and _pool_id(pool_id) != DEFAULT_POOL:
            only = self.graph_pools.get(_pool_id(pool_id))
        result = []
        total_active = 0
        if pool_id is None or _pool_id(pool_id) == DEFAULT_POOL or only is not None:
            for segment in self.segments():
                pool = segment.pool
                if only is not None and pool.owner is not only:
                    continue
                block = segment.head
                while block is not None:
                    if not block.mapped:
                        block = block.next
                        continue
                    reported = block.state != "inactive" or pool.owner is None or self.graph_pools.get(
                        pool.owner.id) is pool.owner
                    info, block = self._segment_info(segment, block)
                    if reported:  # torch lists free blocks only of pools it still has (see below)
                        total_active += info["active_size"]
                        result.append(info)
        result.sort(key=lambda s: s["address"])
        if self._history is not None:
            self._trace("snapshot", 0, total_active, 0)
        return result

    def _segment_info(self, segment: Segment, head: Block) -> tuple[dict, Block | None]:
        """One snapshot segment: the mapped range starting at ``head``; and the block after it."""
        blocks, address = [], head.ptr
        allocated_size = active_size = requested_size = 0
        block = head
        while block is not None and block.mapped:
            state = block.state
            blocks.append({
                "address": address, "size": block.size, "requested_size": block.requested_size,
                "state": state, "frames": [],
            })
            address += block.size
            if state == "active_allocated":
                allocated_size += block.size
            if state != "inactive":
                active_size += block.size
                requested_size += block.requested_size
            block = block.next
        pool = segment.pool
        info = {
            "device": self.device,
            "address": head.ptr,
            "total_size": address - head.ptr,
            "allocated_size": allocated_size,
            "active_size": active_size,
            "requested_size": requested_size,
            "stream": head.stream,
            "segment_type": "small" if pool.is_small else "large",
            "segment_pool_id": pool.owner_id,
            "is_expandable": segment.expandable,
            "frames": [],
            "blocks": blocks,
        }
        return info, block

    def full_snapshot(self) -> dict:
        """``torch.cuda.memory._snapshot()``: segments, device traces, settings."""
        segments = self.snapshot()
        return {
            "segments": segments,
            "device_traces": [list(self._history or ())],
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


def _expandable_size(block: Block) -> int:
    """How big a free block of an expandable segment can grow: itself and the unmapped room after it."""
    following = block.next
    return block.size + (following.size if following is not None and not following.mapped else 0)


def _splice(block: Block, before: Block | None, after: Block | None) -> None:
    """Link ``block`` between ``before`` and ``after`` in its segment."""
    block.prev = before
    block.next = after
    if before is None:
        block.segment.head = block
    else:
        before.next = block
    if after is not None:
        after.prev = block


def _pool_id(pool_id) -> tuple[int, int]:
    try:
        first, second = pool_id
        return (int(first), int(second))
    except (TypeError, ValueError):
        raise ValueError(f"a pool id is a pair of ints like (0, 1), got {pool_id!r}") from None


def _as_int64(n: int) -> int:
    return n - 2**64 if n >= 2**63 else n


class RestoredBlocks:
    """What :meth:`CachingAllocator.restore` rebuilt: active blocks by address."""

    __slots__ = ("allocated", "pending")

    def __init__(self, allocated: dict, pending: dict) -> None:
        self.allocated: dict[int, Block] = allocated  # active_allocated blocks
        self.pending: dict[int, Block] = pending  # active_pending_free blocks, waiting on the caller's events

    def __repr__(self) -> str:
        return f"RestoredBlocks({len(self.allocated)} allocated, {len(self.pending)} pending)"


_BLOCK_STATES = ("active_allocated", "active_pending_free", "inactive")


def _restorable_segment(index: int, segment: dict) -> tuple:
    """(address, size, stream, pool id, is_small, [(size, state, requested)], expandable, reservation start or
    None) of a snapshot segment, checked."""
    where = f"segment {index}"
    try:
        address, total = int(segment["address"]), int(segment["total_size"])
        blocks = segment["blocks"]
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(
            f"{where} is not a snapshot segment ({type(error).__name__}: {error}); pass the segments of "
            "torch.cuda.memory_snapshot() (dicts with address, total_size and blocks)"
        ) from None
    kind = segment.get("segment_type", "small" if total <= 2 * SMALL_SIZE else "large")
    if kind not in ("small", "large"):
        raise ValueError(f"{where}: segment_type must be 'small' or 'large', got {kind!r}")
    pool_id = _pool_id(segment.get("segment_pool_id", DEFAULT_POOL))
    if address <= 0 or total <= 0 or not blocks:
        raise ValueError(f"{where} at {address:#x}: needs a positive address and size and at least one block")
    parsed, ptr, previous_state = [], address, None
    for j, block in enumerate(blocks):
        size, state = int(block["size"]), block["state"]
        if size <= 0 or size % MIN_BLOCK_SIZE:
            raise ValueError(f"{where} block {j}: size {size} is not a positive multiple of {MIN_BLOCK_SIZE}")
        if state not in _BLOCK_STATES:
            raise ValueError(f"{where} block {j}: unknown state {state!r}; expected one of {_BLOCK_STATES}")
        if "address" in block and int(block["address"]) != ptr:
            raise ValueError(
                f"{where} block {j} claims address {int(block['address']):#x} but the blocks before it end at "
                f"{ptr:#x}: blocks must tile their segment without gaps or overlaps"
            )
        if state == "inactive" and previous_state == "inactive":
            raise ValueError(
                f"{where} blocks {j - 1} and {j} are both inactive: the allocator merges free neighbours, so this "
                "snapshot is inconsistent"
            )
        parsed.append((size, state, int(block.get("requested_size", 0))))
        ptr += size
        previous_state = state
    if ptr - address != total:
        raise ValueError(f"{where} at {address:#x}: its blocks add up to {ptr - address} bytes, not total_size {total}")
    expandable = bool(segment.get("is_expandable", False))
    reservation = segment.get("reservation_address")
    if reservation is not None:
        reservation = int(reservation)
        if not expandable or reservation > address:
            raise ValueError(
                f"{where} at {address:#x}: reservation_address {reservation:#x} must be the start of the virtual "
                "reservation holding this expandable segment, at or below its address; leave it out for other segments"
            )
    return (address, total, int(segment.get("stream", 0)), pool_id, kind == "small", parsed, expandable, reservation)


def _check_no_overlap(parsed: list[tuple], allocators: dict) -> None:
    """Device segments must not overlap; pluggable pools' segments may lie inside other segments."""
    device = sorted((p[0], p[0] + p[1]) for p in parsed if p[3] not in allocators)
    for (start, end), (next_start, next_end) in zip(device, device[1:]):
        if next_start < end:
            raise ValueError(
                f"segments [{start:#x}, {end:#x}) and [{next_start:#x}, {next_end:#x}) overlap; if one belongs to a "
                "pluggable pool, pass its raw allocator in allocators={pool_id: allocator}"
            )
