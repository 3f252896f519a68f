"""The allocator's data model, as torch's: segments, blocks, free lists, block pools, private pools.

A :class:`Segment` is one cudaMalloc range (or one expandable segment's virtual range) tiled by
:class:`Block` s linked in address order. Free blocks wait in their :class:`BlockPool` (one per
size class of a pool), in a :class:`FreeList` per stream ordered by (size, address), which is
what best fit searches. A :class:`PrivatePool` (a graph pool or MemPool) has its own two
block pools.

Compiled by Cython with ``blocks.pxd`` together with the allocator (see ``compiled.py``).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from typing import Any

from sortedcontainers import SortedDict, SortedList

__all__ = [
    "DEFAULT_POOL", "NO_STREAMS", "PTR_BITS", "Block", "BlockPool", "FreeKeys", "FreeList", "PrivatePool", "Segment",
    "allocatable", "expandable_size", "init_block", "new_block", "pool_tuple", "splice",
]

DEFAULT_POOL = (0, 0)
NO_STREAMS: frozenset[int] = frozenset()  # shared "no other stream used" value; record_stream replaces it
PTR_BITS = 64  # free-list keys are size << PTR_BITS | ptr, so addresses must be below 2**64


class Segment:
    """One cudaMalloc (or pluggable raw_alloc) range, or one expandable segment's virtual range.

    ``head`` is its lowest block. An expandable segment (``expandable``) maps physical pages
    of ``page_size`` bytes into its range on demand; its unmapped parts are blocks too.
    """

    __slots__ = ("address", "size", "stream", "pool", "head", "expandable", "page_size")

    def __init__(self, address: int, size: int, stream: int, pool: BlockPool,
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

    def __init__(self, ptr: int, size: int, stream: int, pool: BlockPool, segment: Segment,
                 prev: Block | None = None, next: Block | None = None) -> None:
        init_block(self, ptr, size, stream, pool, segment, prev, next)

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


def init_block(block: Block, ptr: int, size: int, stream: int, pool: BlockPool, segment: Segment,
               prev: Block | None, next: Block | None) -> None:
    """Every field of a new block: free, unmapped never, in no free list, used on its own stream only."""
    block.ptr = ptr
    block.size = size
    block.requested_size = 0
    block.stream = stream
    block.allocated = False
    block.prev = prev
    block.next = next
    block.pool = pool
    block.event_count = 0
    block.stream_uses = NO_STREAMS  # record_stream replaces it with a set of the other streams
    block.segment = segment
    block.key = None  # size << PTR_BITS | ptr while in its pool's FreeList
    block.mapped = True  # False only for the unmapped parts of an expandable segment
    block.gc_base = 0  # the pool's get_free_block count when the block last entered its free list


def new_block(ptr: int, size: int, stream: int, pool: BlockPool, segment: Segment, prev: Block | None,
              next: Block | None) -> Block:
    """A new block without a Python constructor call: the allocator's split (its hot path) makes one each time."""
    block = Block.__new__(Block)
    init_block(block, ptr, size, stream, pool, segment, prev, next)
    return block


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

    def __init__(self, is_small: bool, owner: PrivatePool | None, expandable: bool) -> None:
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


def allocatable(block: Block | None) -> bool:
    """Free or unmapped: usable address space for an expandable segment."""
    return block is not None and not block.allocated and block.event_count == 0 and not block.stream_uses


def expandable_size(block: Block) -> int:
    """How big a free block of an expandable segment can grow: itself and the unmapped room after it."""
    following = block.next
    return block.size + (following.size if following is not None and not following.mapped else 0)


def splice(block: Block, before: Block | None, after: Block | None) -> None:
    """Link ``block`` between ``before`` and ``after`` in its segment."""
    block.prev = before
    block.next = after
    if before is None:
        block.segment.head = block
    else:
        before.next = block
    if after is not None:
        after.prev = block


def pool_tuple(pool_id) -> tuple[int, int]:
    """A pool id as a pair of ints (torch hands them out as tuples, snapshots may hold lists)."""
    try:
        first, second = pool_id
        return (int(first), int(second))
    except (TypeError, ValueError):
        raise ValueError(f"a pool id is a pair of ints like (0, 1), got {pool_id!r}") from None
