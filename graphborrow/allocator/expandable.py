"""Expandable segments: one virtual reservation per stream and pool whose pages come and go.

With ``expandable_segments:True`` torch reserves, per stream and pool (and page kind: 2 MiB
pages for small blocks, ``large_segment_size`` pages for large ones), a virtual range of
9/8 of the device's memory, and maps physical pages into it as allocations need them
(``segment_map`` entries); ``empty_cache`` unmaps the whole pages inside free blocks
(``segment_unmap``). The unmapped parts of a reservation are blocks too (``mapped``
False), kept per stream in their pool's ``unmapped`` map, so a reservation is one
:class:`Segment` whose blocks tile it.

These functions are the expandable half of :class:`~graphborrow.allocator.caching.CachingAllocator`'s segment handling
(``_alloc_block`` and ``release_blocks`` call them); they change the allocator they are
given: its segments, device memory, statistics and trace.
"""

from __future__ import annotations

from typing import Any

from sortedcontainers import SortedDict

from graphborrow.core.sizes import expandable_page_size

from .blocks import Block, BlockPool, Segment, allocatable, splice
from .stats import update_stat_array

__all__ = ["allocate", "release_reservation", "reservation_size", "unmap_free_pages"]


def reservation_size(capacity: int, page: int) -> int:
    """The virtual range torch reserves for one expandable segment: 9/8 of the device, in whole pages."""
    return -(-(capacity + capacity // 8) // page) * page


def allocate(allocator: Any, pool: BlockPool, size: int, stream: int) -> Block | None:
    """Map pages until a free block of at least ``size`` exists on ``stream``; it leaves its free list.

    Returns None when the device has no memory for the pages.
    """
    candidate = _find_room(allocator, pool, stream, size)
    if not candidate.mapped and not _map(allocator, candidate, min(candidate.size, size)):
        return None
    while candidate.size < size:
        following = candidate.next
        if following is None or following.mapped:
            raise AssertionError(f"expandable segment at {candidate.segment.address:#x}: no unmapped room after {candidate!r}")
        if not _map(allocator, following, min(size - candidate.size, following.size)):
            return None
        candidate = following  # it absorbed the free block before it
    pool.remove(candidate)
    return candidate


def unmap_free_pages(allocator: Any, block: Block) -> None:
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
        splice(before, block.prev, block)
        pool.insert(before)
    after_size = block.size - before_size - unmapped_size
    if after_size > 0:
        after = Block(unmapped_ptr + unmapped_size, after_size, stream, pool, segment)
        splice(after, block, block.next)
        pool.insert(after)
    block.ptr = unmapped_ptr
    block.size = unmapped_size
    block.mapped = False
    _try_merge(block, block.prev)
    _try_merge(block, block.next)
    pool.unmapped.setdefault(stream, SortedDict())[block.ptr] = block
    allocator.memory.unmap_pages(unmapped_ptr, unmapped_size)
    allocator.total_allocated_memory -= unmapped_size
    update_stat_array(allocator.stats.reserved_bytes, pool.is_small, -unmapped_size)
    if pool.owner is not None:
        pool.owner.cudaMalloc_count -= 1
    allocator.stats.num_device_free += 1
    if allocator.history is not None:
        allocator.record_entry("segment_unmap", unmapped_ptr, unmapped_size, stream)


def release_reservation(allocator: Any, block: Block) -> None:
    """An expandable segment with nothing mapped (``block`` is all of it) goes away with its reservation."""
    segment = block.segment
    del block.pool.unmapped[block.stream][block.ptr]
    del allocator.live_segments[segment]
    allocator.memory.release_address_space(segment.address)


def _find_room(allocator: Any, pool: BlockPool, stream: int, size: int) -> Block:
    """The lowest address in this stream's expandable segments with ``size`` bytes of free or
    unmapped space; a new segment (a virtual reservation) when there is none."""
    unmapped = pool.unmapped.get(stream)
    if unmapped:
        for candidate in list(unmapped.values()):
            if allocatable(candidate.prev):
                candidate = candidate.prev
            room, block = 0, candidate
            while room < size and allocatable(block):
                room += block.size
                block = block.next
            if room >= size:
                return candidate
    page = expandable_page_size(pool.is_small, allocator.large_segment_size)
    virtual = reservation_size(allocator.memory.capacity, page)
    address = allocator.memory.reserve_address_space(virtual)
    segment = Segment(address, virtual, stream, pool, expandable=True, page_size=page)
    block = Block(address, virtual, stream, pool, segment)
    block.mapped = False
    segment.head = block
    allocator.live_segments[segment] = None
    pool.unmapped.setdefault(stream, SortedDict())[address] = block
    return block


def _map(allocator: Any, to_map: Block, size: int) -> bool:
    """Map the pages under the first ``size`` bytes of an unmapped block; it joins its free neighbours."""
    segment = to_map.segment
    page = segment.page_size
    offset = to_map.ptr - segment.address
    begin, end = offset // page, -(-(offset + size) // page)
    mapped_size = (end - begin) * page
    if mapped_size == 0 or not allocator.memory.map_pages(to_map.ptr, mapped_size):
        return False
    pool = to_map.pool
    stream = to_map.stream
    del pool.unmapped[stream][to_map.ptr]
    to_map.mapped = True
    ptr = to_map.ptr
    if mapped_size < to_map.size:
        remaining = Block(ptr + mapped_size, to_map.size - mapped_size, stream, pool, segment)
        remaining.mapped = False
        splice(remaining, to_map, to_map.next)
        pool.unmapped[stream][remaining.ptr] = remaining
        to_map.size = mapped_size
    _try_merge(to_map, to_map.prev)
    _try_merge(to_map, to_map.next)
    pool.insert(to_map)
    allocator.total_allocated_memory += mapped_size
    update_stat_array(allocator.stats.reserved_bytes, pool.is_small, mapped_size)
    allocator.stats.num_device_alloc += 1
    if allocator.history is not None:
        allocator.record_entry("segment_map", ptr, mapped_size, stream)
    return True


def _try_merge(dst: Block, src: Block | None) -> int:
    """Absorb neighbour ``src`` into ``dst`` when both are free and equally mapped; the bytes absorbed."""
    if src is None or not allocatable(src) or src.mapped != dst.mapped:
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
