"""Rebuild an allocator's state from torch-format snapshot segments, as if it had been allocated.

torch's allocator cannot do this; two callers need it. The capacity planner replays a step
against a copy of a pool (:mod:`graphborrow.planning.planner`), and trace replay starts a
mid-run trace from the state it reconstructed before the trace's first entry
(:mod:`graphborrow.fidelity.prestate`). Both need exactly the state an allocator that had
made these segments and blocks would have: blocks in their pools' free lists, statistics
counted, device memory marked used, pending frees waiting on events.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from sortedcontainers import SortedDict

from graphborrow.core.sizes import MIN_BLOCK_SIZE, SMALL_SIZE, expandable_page_size

from .blocks import DEFAULT_POOL, Block, BlockPool, Segment, pool_tuple, splice
from .caching import CachingAllocator
from .expandable import reservation_size
from .stats import COUNTERS, update_stat_array
from .streams import Event

__all__ = ["BLOCK_STATES", "RestoredBlocks", "restore", "take_over_stats"]

BLOCK_STATES = ("active_allocated", "active_pending_free", "inactive")


class RestoredBlocks:
    """What :func:`restore` rebuilt: active blocks by address."""

    __slots__ = ("allocated", "pending")

    def __init__(self, allocated: dict, pending: dict) -> None:
        self.allocated: dict[int, Block] = allocated  # active_allocated blocks
        self.pending: dict[int, Block] = pending  # active_pending_free blocks, waiting on the caller's events

    def __repr__(self) -> str:
        return f"RestoredBlocks({len(self.allocated)} allocated, {len(self.pending)} pending)"


@dataclass(frozen=True)
class _Restorable:
    """One checked snapshot segment: where, whose, and its blocks as (size, state, requested)."""

    address: int
    size: int
    stream: int
    pool_id: tuple[int, int]
    is_small: bool
    blocks: list
    expandable: bool
    reservation: int | None  # start of an expandable segment's reservation, when the snapshot gives it


def restore(allocator: CachingAllocator, segments: list[dict], *, allocators: dict | None = None, pending=None,
            stats: dict | None = None) -> RestoredBlocks:
    """Rebuild ``allocator``'s state from ``segments``, as if it had allocated them.

    ``segments`` is what ``torch.cuda.memory_snapshot()`` (or ``memory_snapshot(pool_id)``,
    or the model's :meth:`~CachingAllocator.snapshot`) returns. Each segment is placed at its
    address with its stream, pool (``segment_pool_id``; private pools are created as needed,
    use_count 1) and kind; ``active_allocated`` blocks become allocated blocks, ``inactive``
    ones go to their pool's free lists, ``active_pending_free`` ones wait on an event the
    caller controls. Device memory under the segments is marked used, and the statistics are
    those of an allocator that allocated these segments and blocks (peaks = current).
    Expandable segments' mapped ranges of one stream and pool become one expandable segment
    whose virtual range starts at the lowest of them, or at their ``reservation_address``
    when they give one (a reservation whose lowest pages were not mapped then: the pages
    below its first range are unmapped room, and its range ends where the real one does).

    Args:
        allocator: a fresh :class:`CachingAllocator` (no segments, no routing).
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

    Raises:
        RuntimeError: the allocator is not fresh.
        ValueError: a segment is malformed, segments overlap, a pluggable allocator is given for
            the default pool, or ``stats`` do not describe these segments.
    """
    if allocator.live_segments or allocator.captures_underway:
        raise RuntimeError(
            "restore() builds state into an empty allocator; this one already has segments or routing. "
            "Create a fresh CachingAllocator first"
        )
    given = allocators if allocators is not None else {}  # not `(allocators or {}).items()`: Cython 3.3.0 crashes on it
    allocators = {pool_tuple(pid): raw for pid, raw in given.items()}
    parsed = [_restorable(i, segment) for i, segment in enumerate(segments)]
    _check_no_overlap(parsed, allocators)
    for pool_id, raw in allocators.items():
        if pool_id == DEFAULT_POOL:
            raise ValueError("the default pool (0, 0) cannot have a pluggable allocator; name a private pool")
        if pool_id not in allocator.graph_pools:
            allocator.create_or_incref_pool(pool_id, allocator=raw)
    restored = RestoredBlocks({}, {})
    expandable: dict[tuple, list[_Restorable]] = {}
    for item in sorted(parsed, key=lambda p: (p.address, -p.size)):
        pool = _pool(allocator, item.pool_id, item.is_small)
        if item.expandable:
            expandable.setdefault((item.stream, item.pool_id, item.is_small), []).append(item)
            continue
        if pool.owner is not None:
            pool.owner.cudaMalloc_count += 1
        if pool.owner is None or pool.owner.allocator is None:
            allocator.memory.reserve(item.address, item.size)
        segment = Segment(item.address, item.size, item.stream, pool)
        allocator.live_segments[segment] = None
        update_stat_array(allocator.stats.segment, item.is_small, 1)
        _restore_mapped(allocator, segment, None, item.address, item.size, item.blocks, restored, pending)
    for (stream, pool_id, is_small), ranges in expandable.items():
        _restore_expandable(allocator, _pool(allocator, pool_id, is_small), stream, ranges, restored, pending)
    if stats is not None:
        take_over_stats(allocator, stats)
    return restored


def _pool(allocator: CachingAllocator, pool_id: tuple[int, int], is_small: bool) -> BlockPool:
    if pool_id == DEFAULT_POOL:
        return allocator.small_blocks if is_small else allocator.large_blocks
    if pool_id not in allocator.graph_pools:
        allocator.create_or_incref_pool(pool_id)
    private = allocator.graph_pools[pool_id]
    return private.small_blocks if is_small else private.large_blocks


def _restore_mapped(allocator: CachingAllocator, segment: Segment, prev: Block | None, address: int, size: int,
                    blocks: list, restored: RestoredBlocks, pending) -> Block:
    """The blocks of one mapped range, chained after ``prev``; returns the last one."""
    pool = segment.pool
    small = pool.is_small
    stats = allocator.stats
    allocator.total_allocated_memory += size
    update_stat_array(stats.reserved_bytes, small, size)
    if size >= allocator.max_split and not segment.expandable:
        stats.oversize_segments.increase(1)
    stats.num_device_alloc += 1
    split = len(blocks) > 1 or segment.expandable
    ptr = address
    for block_size, state, requested in blocks:
        block = Block(ptr, block_size, segment.stream, pool, segment)
        block.requested_size = requested
        splice(block, prev, None)
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
            if block_size >= allocator.max_split:
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
            allocator.cuda_events.setdefault(stream_id, deque()).append((event, block))
            restored.pending[block.ptr] = block
    return prev


def _restore_expandable(allocator: CachingAllocator, pool: BlockPool, stream: int, ranges: list[_Restorable],
                        restored: RestoredBlocks, pending) -> None:
    """One expandable segment from the mapped ranges of one stream and pool; the gaps are unmapped."""
    page = expandable_page_size(pool.is_small, allocator.large_segment_size)
    virtual = reservation_size(allocator.memory.capacity, page)
    starts = {r.reservation for r in ranges if r.reservation is not None}
    if len(starts) > 1:
        raise ValueError(
            f"expandable ranges of stream {stream} in one pool name {len(starts)} reservation starts "
            f"({', '.join(f'{a:#x}' for a in sorted(starts))}); one stream, kind and pool has one reservation"
        )
    base = starts.pop() if starts else ranges[0].address
    for r in ranges:
        if (r.address - base) % page or r.size % page or r.address + r.size > base + virtual:
            raise ValueError(
                f"expandable segment range of {r.size} bytes at {r.address:#x} does not fit one expandable segment "
                f"of {page}-byte pages starting at {base:#x}; the segments come from another device size or pool"
            )
    allocator.memory.expect_next_address(base)
    allocator.memory.reserve_address_space(virtual)
    segment = Segment(base, virtual, stream, pool, expandable=True, page_size=page)
    allocator.live_segments[segment] = None
    prev, cursor = None, base
    for r in ranges:
        if r.address > cursor:
            prev = _restore_unmapped(segment, prev, cursor, r.address - cursor)
        allocator.memory.map_pages(r.address, r.size)
        if pool.owner is not None:
            pool.owner.cudaMalloc_count += 1
        prev = _restore_mapped(allocator, segment, prev, r.address, r.size, r.blocks, restored, pending)
        cursor = r.address + r.size
    if cursor < base + virtual:
        _restore_unmapped(segment, prev, cursor, base + virtual - cursor)


def _restore_unmapped(segment: Segment, prev: Block | None, address: int, size: int) -> Block:
    block = Block(address, size, segment.stream, segment.pool, segment)
    block.mapped = False
    splice(block, prev, None)
    segment.pool.unmapped.setdefault(segment.stream, SortedDict())[address] = block
    return block


def take_over_stats(allocator: CachingAllocator, stats: dict) -> None:
    """Peaks, totals and counters from a memory_stats() dict whose current values match the allocator's."""
    mine = allocator.memory_stats()
    wrong = sorted(key for key in mine if key.endswith(".current") and stats.get(key, mine[key]) != mine[key])
    if wrong:
        key = wrong[0]
        raise ValueError(
            f"stats do not describe these segments: {key} is {stats[key]} there but {mine[key]} after restoring "
            f"({len(wrong)} current values differ); pass the memory_stats() taken with this snapshot, or none"
        )
    named = {f"{name}.{stat_type}": stat for name, stat_array in allocator.stats.arrays().items()
             for stat_type, stat in stat_array.by_type().items()}
    named["oversize_allocations"] = allocator.stats.oversize_allocations
    named["oversize_segments"] = allocator.stats.oversize_segments
    for prefix, stat in named.items():
        stat.peak = stats.get(f"{prefix}.peak", stat.peak)
        stat.allocated = stats.get(f"{prefix}.allocated", stat.allocated)
        stat.freed = stats.get(f"{prefix}.freed", stat.freed)
    for name in COUNTERS:
        if name in stats:
            setattr(allocator.stats, name, stats[name])


def _restorable(index: int, segment: dict) -> _Restorable:
    """A snapshot segment, checked."""
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
    pool_id = pool_tuple(segment.get("segment_pool_id", DEFAULT_POOL))
    if address <= 0 or total <= 0 or not blocks:
        raise ValueError(f"{where} at {address:#x}: needs a positive address and size and at least one block")
    parsed, ptr, previous_state = [], address, None
    for j, block in enumerate(blocks):
        size, state = int(block["size"]), block["state"]
        if size <= 0 or size % MIN_BLOCK_SIZE:
            raise ValueError(f"{where} block {j}: size {size} is not a positive multiple of {MIN_BLOCK_SIZE}")
        if state not in BLOCK_STATES:
            raise ValueError(f"{where} block {j}: unknown state {state!r}; expected one of {BLOCK_STATES}")
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
    return _Restorable(address, total, int(segment.get("stream", 0)), pool_id, kind == "small", parsed, expandable,
                      reservation)


def _check_no_overlap(parsed: list[_Restorable], allocators: dict) -> None:
    """Device segments must not overlap; pluggable pools' segments may lie inside other segments."""
    device = sorted((p.address, p.address + p.size) for p in parsed if p.pool_id not in allocators)
    for (start, end), (next_start, next_end) in zip(device, device[1:]):
        if next_start < end:
            raise ValueError(
                f"segments [{start:#x}, {end:#x}) and [{next_start:#x}, {next_end:#x}) overlap; if one belongs to a "
                "pluggable pool, pass its raw allocator in allocators={pool_id: allocator}"
            )
