"""A model of PyTorch's CUDA caching allocator (one device), rule for rule.

What it reproduces (see the behavioural spec this project follows): size rounding,
small/large block pools per pool, best fit on the same stream with a single candidate,
low-end splits where the old block becomes the remainder, merging with free neighbours,
segment sizes, private pools with strict LIFO routing (graph capture by stream,
``use_mem_pool`` by thread), pluggable-allocator pools, ``use_on_oom`` and ``no_split``
pools, ``record_stream`` events and deferred frees, ``empty_cache``, out-of-memory
handling, ``memory_stats``, and snapshots / trace entries in torch's own format.

Streams are plain ints here (0 is the default stream); the :class:`Clockwork` turns
them into simulated streams with clocks when events are recorded.

This file runs as plain Python, and is also compiled as it stands by Cython with the C
types in ``allocator.pxd`` (see ``compiled.py``), the build that makes sweeps fast.
"""

from __future__ import annotations

import threading
from bisect import bisect_left, insort
from collections import deque
from typing import Any, Callable

import torch
from sortedcontainers import SortedList

from ..listsyntax import split_top_level
from .memory import PhysicalMemory
from .streams import Clockwork, Event

MiB = 2**20
K_MIN_BLOCK_SIZE = 512
K_SMALL_SIZE = 1 * MiB
K_SMALL_BUFFER = 2 * MiB
K_MIN_LARGE_ALLOC = 10 * MiB
K_LARGE_BUFFER = 20 * MiB
K_ROUND_LARGE = 2 * MiB
SIZE_MAX = 2**64 - 1
ROUNDUP_INTERVALS = 16  # 1 MiB .. 32 GiB, one entry per power of two

DEFAULT_POOL = (0, 0)
STAT_TYPES = ("all", "small_pool", "large_pool")
ARRAY_STATS = (
    "allocation", "segment", "active", "inactive_split",
    "allocated_bytes", "reserved_bytes", "active_bytes", "inactive_split_bytes", "requested_bytes",
)
NO_STREAMS: frozenset[int] = frozenset()  # shared "no other stream used" value; record_stream replaces it
PTR_BITS = 64  # free-list keys are size << PTR_BITS | ptr, so addresses must be below 2**64
STAT_SLOTS = tuple(f"{name}{suffix}" for name in ARRAY_STATS for suffix in ("", "_peak", "_total", "_base"))
COUNTERS = ("num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc", "num_device_free")


# ----------------------------------------------------------------------------- configuration


class AllocatorConfig:
    """The PYTORCH_CUDA_ALLOC_CONF options the model understands (torch's defaults)."""

    KEYS = (
        "max_split_size_mb", "max_non_split_rounding_mb", "roundup_power2_divisions",
        "garbage_collection_threshold", "expandable_segments", "graph_capture_record_stream_reuse",
    )

    def __init__(self, config: dict | str | None = None) -> None:
        self.max_split_size = SIZE_MAX
        self.max_non_split_rounding_size = K_LARGE_BUFFER
        self.roundup_power2_divisions = [0] * ROUNDUP_INTERVALS
        self.garbage_collection_threshold = 0.0
        self.source = config if isinstance(config, str) else ""
        if isinstance(config, str):
            config = self._parse_string(config)
        for key, value in (config or {}).items():
            self._set(key, value)
        self.uses_power2_rounding = any(d > 1 for d in self.roundup_power2_divisions)

    @staticmethod
    def _parse_string(text: str) -> dict:
        options: dict[str, Any] = {}
        for item in split_top_level(text):
            key, sep, value = item.partition(":")
            if not sep:
                raise ValueError(f"allocator option {item!r} has no value; write it as key:value")
            options[key.strip()] = value.strip()
        return options

    def _set(self, key: str, value: Any) -> None:
        if key == "max_split_size_mb":
            mb = int(value)
            if mb < K_LARGE_BUFFER // MiB:
                raise ValueError(f"max_split_size_mb={mb} is too small; it must be at least {K_LARGE_BUFFER // MiB}")
            self.max_split_size = mb * MiB
        elif key == "max_non_split_rounding_mb":
            self.max_non_split_rounding_size = int(value) * MiB
        elif key == "roundup_power2_divisions":
            self.roundup_power2_divisions = _parse_divisions(value)
        elif key == "garbage_collection_threshold":
            threshold = float(value)
            if not 0.0 <= threshold < 1.0:
                raise ValueError(f"garbage_collection_threshold must be in [0, 1), got {threshold}")
            self.garbage_collection_threshold = threshold  # recorded; the model has no memory fraction
        elif key == "expandable_segments":
            if _truthy(value):
                raise NotImplementedError(
                    "expandable_segments is not modelled by the simulated allocator; leave it off"
                )
        elif key == "graph_capture_record_stream_reuse":
            if _truthy(value):
                raise NotImplementedError(
                    "graph_capture_record_stream_reuse is not modelled; leave it off (torch's default)"
                )
        else:
            raise ValueError(f"unknown allocator option {key!r}; known options: {', '.join(self.KEYS)}")

    def settings(self) -> dict:
        """``allocator_settings`` as torch's ``_snapshot()`` reports them."""
        return {
            "PYTORCH_CUDA_ALLOC_CONF": self.source,
            "max_split_size": _as_int64(self.max_split_size),
            "garbage_collection_threshold": self.garbage_collection_threshold,
            "expandable_segments": False,
            "pinned_num_register_threads": 1,
            "release_lock_on_cudamalloc": False,
            "pinned_use_cuda_host_register": False,
            "graph_capture_record_stream_reuse": False,
            "roundup_power2_divisions": {
                str(1 << i): d for i, d in enumerate(self.roundup_power2_divisions)
            },
        }


def _truthy(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("true", "1", "yes")
    return bool(value)


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _parse_divisions(value: Any) -> list[int]:
    """``N`` for every interval, or ``[64:8,256:4,>:1]`` / ``{64: 8, 256: 4, ">": 1}`` per MB interval."""
    table = [0] * ROUNDUP_INTERVALS
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            pairs = [p.split(":") for p in text.strip("[]").split(",") if p.strip()]
            value = {k.strip(): v.strip() for k, v in pairs}
        else:
            value = int(text)
    if isinstance(value, int):
        if value != 0 and not _is_power_of_two(value):
            raise ValueError(f"roundup_power2_divisions must be a power of two, got {value}")
        return [value] * ROUNDUP_INTERVALS
    if not isinstance(value, dict):
        raise ValueError(f"roundup_power2_divisions must be an int or a dict of MB -> divisions, got {value!r}")
    first, last_index = True, 0
    for key, divisions in value.items():
        divisions = int(divisions)
        if divisions != 0 and not _is_power_of_two(divisions):
            raise ValueError(f"roundup_power2_divisions values must be powers of two, got {divisions}")
        if str(key).strip() == ">":
            for i in range(last_index + 1, ROUNDUP_INTERVALS):
                table[i] = divisions
            continue
        mb = int(key)
        if not _is_power_of_two(mb):
            raise ValueError(f"roundup_power2_divisions intervals must be powers of two (MB), got {mb}")
        index = min(mb.bit_length() - 1, ROUNDUP_INTERVALS - 1)
        if first:
            for i in range(index):
                table[i] = divisions
            first = False
        table[index] = divisions
        last_index = index
    return table


def _as_int64(n: int) -> int:
    return n - 2**64 if n >= 2**63 else n


# ----------------------------------------------------------------------------- size rules


def round_size(nbytes: int, config: AllocatorConfig | None = None) -> int:
    """The block size a request of ``nbytes`` gets (multiples of 512, or power-of-two divisions)."""
    if nbytes < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    if config is not None and config.uses_power2_rounding:
        index = min(max(nbytes.bit_length() - 1 - 20, 0), ROUNDUP_INTERVALS - 1)
        divisions = config.roundup_power2_divisions[index]
        if divisions > 1 and nbytes > K_MIN_BLOCK_SIZE * divisions:
            return _roundup_power2_next_division(nbytes, divisions)
    return (nbytes + K_MIN_BLOCK_SIZE - 1) // K_MIN_BLOCK_SIZE * K_MIN_BLOCK_SIZE


def _roundup_power2_next_division(nbytes: int, divisions: int) -> int:
    if _is_power_of_two(nbytes):
        return nbytes
    floor = 1 << (nbytes.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    return nbytes if nbytes % step == 0 else (nbytes // step + 1) * step


def get_allocation_size(size: int) -> int:
    """Segment size asked of cudaMalloc (or of a pluggable allocator) for a rounded ``size``."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return (size + K_ROUND_LARGE - 1) // K_ROUND_LARGE * K_ROUND_LARGE


def format_size(nbytes: int) -> str:
    """Sizes as torch prints them in OOM messages."""
    if nbytes <= 1024:
        return f"{nbytes} bytes"
    if nbytes <= MiB:
        return f"{nbytes / 1024:.2f} KiB"
    if nbytes <= 2**30:
        return f"{nbytes / MiB:.2f} MiB"
    return f"{nbytes / 2**30:.2f} GiB"


# ----------------------------------------------------------------------------- data model


class Stat:
    """One scalar stat (the oversize counters): current, peak, allocated, freed."""

    __slots__ = ("current", "peak", "allocated", "freed")

    def __init__(self) -> None:
        self.current = self.peak = self.allocated = self.freed = 0

    def increase(self, n: int) -> None:
        self.current += n
        self.peak = max(self.peak, self.current)
        self.allocated += n

    def decrease(self, n: int) -> None:
        self.current -= n
        self.freed += n

    def as_dict(self) -> dict:
        return {"current": self.current, "peak": self.peak, "allocated": self.allocated, "freed": self.freed}


class StatCounters:
    """The array stats of one pool kind ("small_pool" or "large_pool") as flat int slots.

    For a stat ``x``, slot ``x`` is the current value and ``x_peak`` its peak; ``x_total`` is
    the sum of increases since the last reset (torch's "allocated") and ``x_base`` the current
    value at that reset, so "freed" = total - (current - base) and a decrease touches only ``x``.
    Active blocks and bytes only ever grow together with allocations, so their totals are
    ``allocation_total`` / ``allocated_bytes_total``. The "all" stat type needs only peaks
    (``x_peak`` of a third StatCounters): its current value is the two kinds' sum. The hot
    path updates the slots inline; everything else uses :func:`_increase` / :func:`_decrease`.
    """

    __slots__ = STAT_SLOTS

    def __init__(self) -> None:
        for slot in self.__slots__:
            setattr(self, slot, 0)

    def as_rows(self, name: str) -> tuple[int, int, int, int]:
        """(current, peak, allocated, freed) of stat ``name`` for this pool kind."""
        total_name = {"active": "allocation", "active_bytes": "allocated_bytes"}.get(name, name) + "_total"
        current, total = getattr(self, name), getattr(self, total_name)
        return (current, getattr(self, name + "_peak"), total, total - current + getattr(self, name + "_base"))


def _increase(pool: "BlockPool", name: str, n: int) -> None:
    """Raise stat ``name`` by ``n`` for the pool's kind and for "all" (off the hot path)."""
    kind, every = pool.stats, pool.all_stats
    current = getattr(kind, name) + n
    setattr(kind, name, current)
    setattr(kind, name + "_total", getattr(kind, name + "_total") + n)
    if current > getattr(kind, name + "_peak"):
        setattr(kind, name + "_peak", current)
    current += getattr(pool.other_stats, name)
    if current > getattr(every, name + "_peak"):
        setattr(every, name + "_peak", current)


def _decrease(pool: "BlockPool", name: str, n: int) -> None:
    setattr(pool.stats, name, getattr(pool.stats, name) - n)


class Segment:
    """One cudaMalloc (or pluggable raw_alloc) range; ``head`` is its lowest block."""

    __slots__ = ("address", "size", "stream", "pool", "head")

    def __init__(self, address: int, size: int, stream: int, pool: "BlockPool") -> None:
        self.address = address
        self.size = size
        self.stream = stream
        self.pool = pool
        self.head: Block | None = None

    def blocks(self):
        block = self.head
        while block is not None:
            yield block
            block = block.next


class Block:
    """A range of one segment: allocated, pending free (events outstanding) or free in its pool."""

    __slots__ = (
        "ptr", "size", "requested_size", "stream", "allocated", "prev", "next", "pool",
        "event_count", "stream_uses", "segment", "key",
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
        return f"Block(ptr={self.ptr:#x}, size={self.size}, stream={self.stream}, {self.state})"


class FreeList:
    """Free blocks of one stream in one pool, ordered by (size, ptr).

    ``keys`` is a SortedList of ints ``size << PTR_BITS | ptr`` (cheap to compare) and
    ``blocks`` maps each key to its block. Best-fit lookups read the SortedList's two
    levels (``_maxes``: largest key of each run, ``_lists``: the runs) directly. Inserts
    and removals go through its public methods. A re-key (every split and merge) whose
    new key still belongs to the same run rewrites or moves it inside that run, which
    changes no run's length and so leaves the SortedList's index valid.
    """

    __slots__ = ("keys", "blocks")

    def __init__(self) -> None:
        self.keys = SortedList()
        self.blocks: dict[int, Block] = {}

    def __len__(self) -> int:
        return len(self.blocks)

    def add(self, key: int, block: Block) -> None:
        self.keys.add(key)
        self.blocks[key] = block

    def remove(self, key: int) -> None:
        self.keys.remove(key)
        del self.blocks[key]

    def shrink_key(self, old: int, new: int, block: Block) -> None:
        """Give the slot of key ``old`` to ``block`` under the smaller key ``new``."""
        keys = self.keys
        maxes = keys._maxes
        pos = bisect_left(maxes, old)
        if pos == 0 or maxes[pos - 1] < new:  # ``new`` still belongs to the run of ``old``
            run = keys._lists[pos]
            idx = bisect_left(run, old)
            if idx == 0 or run[idx - 1] < new:
                run[idx] = new
            else:
                del run[idx]
                insort(run, new)
            maxes[pos] = run[-1]
        else:
            keys.remove(old)
            keys.add(new)
        blocks = self.blocks
        del blocks[old]
        blocks[new] = block

    def grow_key(self, old: int, new: int, block: Block) -> None:
        """Give the slot of key ``old`` to ``block`` under the larger key ``new``."""
        keys = self.keys
        maxes = keys._maxes
        pos = bisect_left(maxes, old)
        if pos == len(maxes) - 1 or new < keys._lists[pos + 1][0]:  # ``new`` stays in the run of ``old``
            run = keys._lists[pos]
            if maxes[pos] == old:
                run[-1] = maxes[pos] = new
            else:
                idx = bisect_left(run, old)
                if new < run[idx + 1]:
                    run[idx] = new
                else:
                    del run[idx]
                    insort(run, new)
                    maxes[pos] = run[-1]
        else:
            keys.remove(old)
            keys.add(new)
        blocks = self.blocks
        del blocks[old]
        blocks[new] = block

    def best_fit(self, probe: int) -> Block | None:
        """The block of the smallest key >= ``probe``, or None."""
        keys = self.keys
        maxes = keys._maxes
        pos = bisect_left(maxes, probe)
        if pos == len(maxes):
            return None
        run = keys._lists[pos]
        return self.blocks[run[bisect_left(run, probe)]]

    def __iter__(self):
        return map(self.blocks.__getitem__, self.keys)


class BlockPool:
    """Free blocks of one size class of one pool: a :class:`FreeList` per stream."""

    __slots__ = ("is_small", "owner", "free", "stats", "other_stats", "all_stats", "counters", "min_remainder")

    def __init__(self, is_small: bool, owner: "PrivatePool | None", counters: tuple[StatCounters, ...]) -> None:
        self.is_small = is_small
        self.owner = owner
        self.free: dict[int, FreeList] = {}  # stream -> its free blocks
        self.min_remainder = 0  # a block splits when the rest would be at least this
        self.set_split_rule(no_split=False)
        every, small, large = counters
        self.all_stats = every  # peaks of "all"; every pool of the allocator shares these three
        self.stats, self.other_stats = (small, large) if is_small else (large, small)
        self.counters = (self.stats, self.other_stats, every)  # unpacked in one go on the hot path

    def set_split_rule(self, no_split: bool) -> None:
        """Small blocks split when >= 512 B would remain, large ones when > 1 MiB would; never in no_split pools."""
        if no_split:
            self.min_remainder = SIZE_MAX + 1
        else:
            self.min_remainder = K_MIN_BLOCK_SIZE if self.is_small else K_SMALL_SIZE + 1

    def free_list(self, stream: int) -> FreeList:
        free = self.free.get(stream)
        if free is None:
            free = self.free[stream] = FreeList()
        return free

    def insert(self, block: Block) -> None:
        key = block.size << PTR_BITS | block.ptr
        block.key = key
        self.free_list(block.stream).add(key, block)

    def remove(self, block: Block) -> None:
        self.free[block.stream].remove(block.key)
        block.key = None

    def __iter__(self):
        """Free blocks in (stream, size, ptr) order."""
        for stream in sorted(self.free):
            yield from self.free[stream]

    @property
    def owner_id(self) -> tuple[int, int]:
        return DEFAULT_POOL if self.owner is None else self.owner.id


class PrivatePool:
    """A graph pool / MemPool: its own small and large block pools, optional raw allocator."""

    def __init__(self, pool_id: tuple[int, int], allocator: Any, counters: tuple[StatCounters, ...]) -> None:
        self.id = pool_id
        self.use_count = 1
        self.cudaMalloc_count = 0
        self.allocator = allocator
        self.use_on_oom = False
        self.small_blocks = BlockPool(True, self, counters)
        self.large_blocks = BlockPool(False, self, counters)
        self.no_split = False

    @property
    def no_split(self) -> bool:
        return self._no_split

    @no_split.setter
    def no_split(self, enabled: bool) -> None:
        self._no_split = bool(enabled)
        self.small_blocks.set_split_rule(self._no_split)
        self.large_blocks.set_split_rule(self._no_split)

    def __repr__(self) -> str:
        return f"PrivatePool(id={self.id}, use_count={self.use_count}, segments={self.cudaMalloc_count})"


# ----------------------------------------------------------------------------- the allocator


class CachingAllocator:
    """The device caching allocator: ``malloc`` / ``free`` of Blocks, pools, stats, snapshots."""

    def __init__(self, memory: PhysicalMemory, clockwork: Clockwork, config: dict | str | None = None) -> None:
        self.memory = memory
        self.clockwork = clockwork
        self.config = AllocatorConfig(config)
        self.device = 0
        self._counters_all = StatCounters()
        self._counters_by_kind = (StatCounters(), StatCounters())  # small_pool, large_pool
        stat_counters = (self._counters_all, *self._counters_by_kind)
        self._stat_counters = stat_counters
        self._oversize_allocations = Stat()
        self._oversize_segments = Stat()
        self._counters = dict.fromkeys(COUNTERS, 0)
        self.small_blocks = BlockPool(True, None, stat_counters)
        self.large_blocks = BlockPool(False, None, stat_counters)
        self.graph_pools: dict[tuple[int, int], PrivatePool] = {}
        self.graph_pools_freeable: dict[tuple[int, int], PrivatePool] = {}
        self.captures_underway: list[tuple[tuple[int, int], Callable[[int, int], bool]]] = []
        self.total_allocated_memory = 0
        self._segments: dict[Segment, None] = {}
        self._cuda_events: dict[int, deque] = {}
        self._deferred: list[Block] = []
        self._capture_stream_uses: dict[Block, set[int]] = {}
        self._use_on_oom: dict[tuple[int, int], None] = {}
        self._history: deque | None = None
        self._next_capture_id = 1
        self._next_mempool_id = 1
        self._max_split = self.config.max_split_size
        # torch's defaults (512 B rounding, no split limit) let malloc take its short path
        self._default_rules = not self.config.uses_power2_rounding and self._max_split == SIZE_MAX

    # ------------------------------------------------------------------ malloc / free

    def malloc(self, nbytes: int, stream: int = 0, thread: int | None = None) -> Block:
        """Allocate a block for ``nbytes`` on ``stream`` (an int); raises torch.OutOfMemoryError."""
        if nbytes <= 0:
            raise ValueError(
                f"malloc({nbytes}): the caching allocator only sees positive sizes; "
                "a 0-byte tensor needs no block (torch gives it data_ptr 0)"
            )
        if self.captures_underway or self._cuda_events or self._deferred or not self._default_rules:
            return self._malloc_general(nbytes, stream, thread)
        # the hot path: default rules, nothing pending, no private pool routing
        size = 512 if nbytes < 512 else (nbytes + 511) & ~511
        pool = self.small_blocks if size <= K_SMALL_SIZE else self.large_blocks
        # best fit: the first key >= size << PTR_BITS in the stream's free list
        free = pool.free.get(stream)
        if free is not None:
            probe = size << PTR_BITS
            keys = free.keys
            maxes = keys._maxes
            pos = bisect_left(maxes, probe)
            if pos != len(maxes):
                run = keys._lists[pos]
                return self._alloc_found_block(free.blocks[run[bisect_left(run, probe)]], free, nbytes, size)
        return self._alloc_found_block(*self._malloc_slow(pool, size, stream), nbytes, size)

    def _malloc_general(self, nbytes: int, stream: int, thread: int | None) -> Block:
        """malloc with everything: pending events, routing to private pools, configured rounding and split limits."""
        captures = self.captures_underway
        if not captures and (self._cuda_events or self._deferred):
            self.process_events()
        size = round_size(nbytes, self.config)
        if captures:
            pool = self._get_pool(size, stream, threading.get_ident() if thread is None else thread)
        else:
            pool = self.small_blocks if size <= K_SMALL_SIZE else self.large_blocks
        found = self._get_free_block(pool, size, stream)
        if found is None:
            found = self._malloc_slow(pool, size, stream)
        return self._alloc_found_block(*found, nbytes, size)

    def _malloc_slow(self, pool: BlockPool, size: int, stream: int) -> tuple:
        """No cached block fits: new segment, mempool fallback, release cached and retry, or OOM."""
        alloc_size = get_allocation_size(size)
        block = self._alloc_block(pool, alloc_size, stream, retry=False)
        if block is not None:
            return (block, None)
        found = self._try_mempool_fallback(size, stream)
        if found is not None:
            return found
        block = (
            (self._release_available_cached_blocks(pool, size, stream)
             and self._alloc_block(pool, alloc_size, stream, retry=False))
            or (not self.captures_underway
                and self.release_cached_blocks(DEFAULT_POOL)
                and self._alloc_block(pool, alloc_size, stream, retry=True))
        )
        if not block:
            self._raise_oom(pool, size, alloc_size, stream)
        return (block, None)

    def free(self, block: Block) -> None:
        """Return ``block``; completes now unless it was used on other streams (record_stream)."""
        if block is None or not block.allocated:
            raise ValueError(f"free({block!r}): the block is not allocated (double free?)")
        block.allocated = False
        pool = block.pool
        size = block.size
        kind = pool.stats
        kind.allocation -= 1
        kind.allocated_bytes -= size
        if self._history is not None:
            self._trace("free_requested", block.ptr, block.requested_size, block.stream)
        if size >= self._max_split:
            self._oversize_allocations.decrease(1)
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
                    if block.ptr == address and block.state != "inactive":
                        found = block
        return found

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
        allocators = {_pool_id(pid): raw for pid, raw in (allocators or {}).items()}
        parsed = [_restorable_segment(i, segment) for i, segment in enumerate(segments)]
        _check_no_overlap(parsed, allocators)
        for pool_id, raw in allocators.items():
            if pool_id == DEFAULT_POOL:
                raise ValueError("the default pool (0, 0) cannot have a pluggable allocator; name a private pool")
            if pool_id not in self.graph_pools:
                self.create_or_incref_pool(pool_id, allocator=raw)
        restored = RestoredBlocks({}, {})
        for address, size, stream, pool_id, is_small, blocks in sorted(parsed, key=lambda p: (p[0], -p[1])):
            if pool_id != DEFAULT_POOL and pool_id not in self.graph_pools:
                self.create_or_incref_pool(pool_id)
            private = self.graph_pools.get(pool_id)
            if private is None:
                pool = self.small_blocks if is_small else self.large_blocks
            else:
                pool = private.small_blocks if is_small else private.large_blocks
                private.cudaMalloc_count += 1
                self._bump_pool_ids(pool_id)
            if private is None or private.allocator is None:
                self.memory.reserve(address, size)
            self.total_allocated_memory += size
            segment = Segment(address, size, stream, pool)
            self._segments[segment] = None
            _increase(pool, "segment", 1)
            _increase(pool, "reserved_bytes", size)
            if size >= self._max_split:
                self._oversize_segments.increase(1)
            self._counters["num_device_alloc"] += 1
            prev = None
            ptr = address
            split = len(blocks) > 1
            for block_size, state, requested in blocks:
                block = Block(ptr, block_size, stream, pool, segment, prev=prev)
                block.requested_size = requested
                if prev is None:
                    segment.head = block
                else:
                    prev.next = block
                prev = block
                ptr += block_size
                if state == "inactive":
                    pool.insert(block)
                    if split:
                        _increase(pool, "inactive_split", 1)
                        _increase(pool, "inactive_split_bytes", block_size)
                    continue
                _increase(pool, "active", 1)
                _increase(pool, "active_bytes", block_size)
                _increase(pool, "requested_bytes", requested)
                if state == "active_allocated":
                    block.allocated = True
                    _increase(pool, "allocation", 1)
                    _increase(pool, "allocated_bytes", block_size)
                    if block_size >= self._max_split:
                        self._oversize_allocations.increase(1)
                    restored.allocated[block.ptr] = block
                else:
                    event = pending(block.ptr) if callable(pending) else pending
                    if not isinstance(event, Event):
                        raise ValueError(
                            f"the block of {block_size} bytes at {block.ptr:#x} is active_pending_free: pass "
                            "pending=<Event> (or a callable address -> Event) that it should wait on"
                        )
                    stream_id = event.stream.id if event.stream is not None else stream
                    block.event_count = 1
                    self._cuda_events.setdefault(stream_id, deque()).append((event, block))
                    restored.pending[block.ptr] = block
        if stats is not None:
            self._take_over_stats(stats)
        return restored

    def _bump_pool_ids(self, pool_id: tuple[int, int]) -> None:
        """Keep new_pool_id from handing out an id that a restored pool already has."""
        first, second = pool_id
        self._next_capture_id = max(self._next_capture_id, first + 1)
        self._next_mempool_id = max(self._next_mempool_id, second + 1)

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
        small, large = self._counters_by_kind
        for name in ARRAY_STATS:
            total_name = {"active": "allocation", "active_bytes": "allocated_bytes"}.get(name, name)
            for kind, counters in (("small_pool", small), ("large_pool", large)):
                current = getattr(counters, name)
                peak = stats.get(f"{name}.{kind}.peak", current)
                setattr(counters, name + "_peak", peak)
                if total_name == name:
                    total = stats.get(f"{name}.{kind}.allocated", current)
                    freed = stats.get(f"{name}.{kind}.freed", 0)
                    setattr(counters, name + "_total", total)
                    setattr(counters, name + "_base", freed - total + current)
            setattr(self._counters_all, name + "_peak", stats.get(f"{name}.all.peak", getattr(small, name) + getattr(large, name)))
        for name, stat in (("oversize_allocations", self._oversize_allocations), ("oversize_segments", self._oversize_segments)):
            stat.peak = stats.get(f"{name}.peak", stat.peak)
            stat.allocated = stats.get(f"{name}.allocated", stat.allocated)
            stat.freed = stats.get(f"{name}.freed", stat.freed)
        for name in COUNTERS:
            if name in stats:
                self._counters[name] = stats[name]

    # ------------------------------------------------------------------ search, split, merge

    def _get_pool(self, size: int, stream: int, thread: int) -> BlockPool:
        for pool_id, route in reversed(self.captures_underway):
            if route(stream, thread):
                private = self.graph_pools[pool_id]
                return private.small_blocks if size <= K_SMALL_SIZE else private.large_blocks
        return self.small_blocks if size <= K_SMALL_SIZE else self.large_blocks

    def _get_free_block(self, pool: BlockPool, size: int, stream: int) -> tuple | None:
        """Best fit on the same stream: the single smallest block >= size, lowest address on ties.

        Returns the block and its free list; it stays there until
        _alloc_found_block re-keys or removes it.
        """
        free = pool.free.get(stream)
        if free is None:
            return None
        block = free.best_fit(size << PTR_BITS)
        if block is None:
            return None
        max_split = self._max_split
        if size < max_split and block.size >= max_split:
            return None
        if size >= max_split and block.size >= size + self.config.max_non_split_rounding_size:
            return None
        return (block, free)

    def _alloc_found_block(self, block: Block, free: FreeList | None, orig: int, size: int) -> Block:
        """Hand out ``block`` (split if the rules say so) from its free list ``free``,
        or None for a new segment's block, which is in no free list yet."""
        pool = block.pool
        already_split = block.prev is not None or block.next is not None
        remaining_size = block.size - size
        kind, other, every = pool.counters
        if remaining_size >= pool.min_remainder and size < self._max_split:
            # the caller gets a new block at the low end; the old block object is the remainder
            remaining = block
            prev = remaining.prev
            block = Block.__new__(Block)  # Block.__init__ spelled out: this is the hot path
            block.ptr = remaining.ptr
            block.size = size
            block.stream = remaining.stream
            block.pool = pool
            block.segment = remaining.segment
            block.prev = prev
            block.next = remaining
            block.event_count = 0
            block.stream_uses = NO_STREAMS
            block.key = None
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
                free.shrink_key(remaining.key, key, remaining)
            remaining.key = key
            if already_split:
                kind.inactive_split_bytes -= size
            else:
                c = kind.inactive_split + 1
                kind.inactive_split = c
                kind.inactive_split_total += 1
                if c > kind.inactive_split_peak:
                    kind.inactive_split_peak = c
                c += other.inactive_split  # "all"
                if c > every.inactive_split_peak:
                    every.inactive_split_peak = c
                c = kind.inactive_split_bytes + remaining_size
                kind.inactive_split_bytes = c
                kind.inactive_split_bytes_total += remaining_size
                if c > kind.inactive_split_bytes_peak:
                    kind.inactive_split_bytes_peak = c
                c += other.inactive_split_bytes  # "all"
                if c > every.inactive_split_bytes_peak:
                    every.inactive_split_bytes_peak = c
        else:
            if free is not None:
                free.remove(block.key)
                block.key = None
            if already_split:
                kind.inactive_split_bytes -= block.size
                kind.inactive_split -= 1
        block.allocated = True
        block.requested_size = orig
        ptr = block.ptr
        size = block.size
        # allocation and active +1, allocated_bytes and active_bytes +size, requested_bytes +orig.
        # With no free pending on events, active == allocation (and active_bytes == allocated_bytes)
        # in both kinds; an active peak, never below its allocation peak, then moves only with it.
        settled = not (self._cuda_events or self._deferred)
        if not settled:
            c = kind.active + 1
            kind.active = c
            if c > kind.active_peak:
                kind.active_peak = c
            c += other.active  # "all"
            if c > every.active_peak:
                every.active_peak = c
            c = kind.active_bytes + size
            kind.active_bytes = c
            if c > kind.active_bytes_peak:
                kind.active_bytes_peak = c
            c += other.active_bytes  # "all"
            if c > every.active_bytes_peak:
                every.active_bytes_peak = c
        c = kind.allocation + 1
        kind.allocation = c
        kind.allocation_total += 1
        if settled:
            kind.active = c
        if c > kind.allocation_peak:
            kind.allocation_peak = c
            if settled and c > kind.active_peak:
                kind.active_peak = c
        c += other.allocation  # "all"
        if c > every.allocation_peak:
            every.allocation_peak = c
            if settled and c > every.active_peak:
                every.active_peak = c
        c = kind.allocated_bytes + size
        kind.allocated_bytes = c
        kind.allocated_bytes_total += size
        if settled:
            kind.active_bytes = c
        if c > kind.allocated_bytes_peak:
            kind.allocated_bytes_peak = c
            if settled and c > kind.active_bytes_peak:
                kind.active_bytes_peak = c
        c += other.allocated_bytes  # "all"
        if c > every.allocated_bytes_peak:
            every.allocated_bytes_peak = c
            if settled and c > every.active_bytes_peak:
                every.active_bytes_peak = c
        c = kind.requested_bytes + orig
        kind.requested_bytes = c
        kind.requested_bytes_total += orig
        if c > kind.requested_bytes_peak:
            kind.requested_bytes_peak = c
        c += other.requested_bytes  # "all"
        if c > every.requested_bytes_peak:
            every.requested_bytes_peak = c
        if size >= self._max_split:
            self._oversize_allocations.increase(1)
        if self._history is not None:
            self._trace("alloc", ptr, orig, block.stream)
        return block

    def _free_block(self, block: Block) -> None:
        """Complete a free: merge with free neighbours and put the result in its pool's set."""
        if self._history is not None:
            self._trace("free_completed", block.ptr, block.requested_size, block.stream)
        original_size = block.size
        requested = block.requested_size
        pool = block.pool
        net_blocks = net_bytes = 0
        reused_key = None  # an absorbed neighbour's slot in the sorted set, re-keyed for the merged block
        prev = block.prev
        if prev is not None and prev.key is not None:  # free in its pool (not allocated, not pending)
            reused_key, prev.key = prev.key, None
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
        if nxt is not None and nxt.key is not None:  # free in its pool (not allocated, not pending)
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
            pool.free[block.stream].grow_key(reused_key, key, block)
        block.key = key
        if prev is not None or nxt is not None:
            net_blocks += 1
            net_bytes += size
        kind, other, every = pool.counters
        if net_blocks > 0:
            c = kind.inactive_split + net_blocks
            kind.inactive_split = c
            kind.inactive_split_total += net_blocks
            if c > kind.inactive_split_peak:
                kind.inactive_split_peak = c
            c += other.inactive_split  # "all"
            if c > every.inactive_split_peak:
                every.inactive_split_peak = c
        elif net_blocks < 0:
            kind.inactive_split += net_blocks
        if net_bytes > 0:
            c = kind.inactive_split_bytes + net_bytes
            kind.inactive_split_bytes = c
            kind.inactive_split_bytes_total += net_bytes
            if c > kind.inactive_split_bytes_peak:
                kind.inactive_split_bytes_peak = c
            c += other.inactive_split_bytes  # "all"
            if c > every.inactive_split_bytes_peak:
                every.inactive_split_bytes_peak = c
        elif net_bytes < 0:
            kind.inactive_split_bytes += net_bytes
        kind.active -= 1
        kind.active_bytes -= original_size
        kind.requested_bytes -= requested

    # ------------------------------------------------------------------ segments

    def _alloc_block(self, pool: BlockPool, alloc_size: int, stream: int, retry: bool) -> Block | None:
        if retry:
            self._counters["num_alloc_retries"] += 1
        owner = pool.owner
        if owner is not None and owner.allocator is not None:
            ptr = owner.allocator.raw_alloc(alloc_size, stream)
            if ptr and not (isinstance(ptr, int) and 0 < ptr < 2**PTR_BITS):
                raise ValueError(
                    f"raw_alloc returned {ptr!r}; a pool allocator must return an int address in (0, 2**64), or 0 when out of memory"
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
        _increase(pool, "segment", 1)
        _increase(pool, "reserved_bytes", alloc_size)
        if alloc_size >= self._max_split:
            self._oversize_segments.increase(1)
        self._counters["num_device_alloc"] += 1
        if self._history is not None:
            self._trace("segment_alloc", ptr, alloc_size, stream)
        return block

    def _release_block(self, block: Block) -> None:
        self._counters["num_device_free"] += 1
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
        _decrease(pool, "segment", 1)
        _decrease(pool, "reserved_bytes", block.size)
        if block.size >= self._max_split:
            self._oversize_segments.decrease(1)
        pool.remove(block)
        del self._segments[block.segment]

    def _release_blocks(self, pool: BlockPool) -> None:
        for block in list(pool):
            if block.prev is None and block.next is None:
                self._release_block(block)

    def _release_available_cached_blocks(self, pool: BlockPool, size: int, stream: int) -> bool:
        max_split = self._max_split
        if max_split == SIZE_MAX:
            return False
        target = max(size, max_split)
        free = pool.free.get(stream)
        blocks = list(free) if free is not None else []
        i = bisect_left([block.key for block in blocks], target << PTR_BITS)
        if i < len(blocks):
            self._release_block(blocks[i])
            return True
        released = 0
        i -= 1
        while released < target and i >= 0:
            block = blocks[i]
            if block.size < max_split:
                break
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

    def empty_cache(self, pool_id: tuple[int, int] | None = None) -> None:
        """``torch.cuda.empty_cache()`` (pool_id None) or the MemPool destructor's ``emptyCache(id)``."""
        self.release_cached_blocks(DEFAULT_POOL if pool_id is None else pool_id)

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
        self._counters["num_sync_all_streams"] += 1
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
            private = self.graph_pools[pool_id] = PrivatePool(pool_id, allocator, self._stat_counters)
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
            self._use_on_oom[pool_id] = None
        else:
            self._use_on_oom.pop(pool_id, None)

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

    def _private(self, pool_id: tuple[int, int]) -> PrivatePool:
        private = self.graph_pools.get(pool_id)
        if private is None:
            raise KeyError(f"no private pool {pool_id}; create it with create_or_incref_pool first")
        return private

    def _try_mempool_fallback(self, size: int, stream: int) -> tuple[Block, FreeList] | None:
        for pool_id in self._use_on_oom:
            private = self.graph_pools.get(pool_id)
            if private is None:
                continue
            pool = private.small_blocks if size <= K_SMALL_SIZE else private.large_blocks
            found = self._get_free_block(pool, size, stream)
            if found is not None:
                return found
        return None

    # ------------------------------------------------------------------ out of memory

    def _raise_oom(self, pool: BlockPool, size: int, alloc_size: int, stream: int) -> None:
        device_free, device_total = self.memory.mem_get_info()
        if self._history is not None:
            self._trace("oom", device_free, size, stream)
        self._counters["num_ooms"] += 1
        allocated = self.memory_allocated()
        reserved = self.memory_reserved()
        in_private = sum(
            block.size for private in self.graph_pools.values()
            for bp in (private.large_blocks, private.small_blocks) for block in bp
        )
        private_msg = (
            f"with {format_size(in_private)} allocated in private pools (e.g., CUDA Graphs), " if in_private else ""
        )
        raise torch.OutOfMemoryError(
            f"CUDA out of memory. Tried to allocate {format_size(alloc_size)}. GPU {self.device} has a total "
            f"capacity of {format_size(device_total)} of which {format_size(device_free)} is free. "
            f"Including non-PyTorch memory, this process has {format_size(self.memory.used)} memory in use. "
            f"Of the allocated memory {format_size(allocated + in_private)} is allocated by PyTorch, "
            f"{private_msg}and {format_size(reserved - allocated - in_private)} is reserved by PyTorch but "
            "unallocated. If reserved but unallocated memory is large try setting "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for "
            "Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
        )

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

    def snapshot(self, pool_id=None) -> list[dict]:
        """``torch.cuda.memory_snapshot(mempool_id)``: segments in torch's format, by address."""
        only = None
        if pool_id is not None and _pool_id(pool_id) != DEFAULT_POOL:
            only = self.graph_pools.get(_pool_id(pool_id))
        result = []
        total_active = 0
        for segment in self.segments():
            pool = segment.head.pool
            if only is not None and pool.owner is not only:
                continue
            blocks, address = [], segment.address
            allocated_size = active_size = requested_size = 0
            for block in segment.blocks():
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
            total_active += active_size
            result.append({
                "device": self.device,
                "address": segment.address,
                "total_size": segment.size,
                "allocated_size": allocated_size,
                "active_size": active_size,
                "requested_size": requested_size,
                "stream": segment.head.stream,
                "segment_type": "small" if pool.is_small else "large",
                "segment_pool_id": pool.owner_id,
                "is_expandable": False,
                "frames": [],
                "blocks": blocks,
            })
        if self._history is not None:
            self._trace("snapshot", 0, total_active, 0)
        return result

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
        flat: dict[str, int] = {}
        fields = ("current", "peak", "allocated", "freed")
        for name in ARRAY_STATS:
            small, large = (counters.as_rows(name) for counters in self._counters_by_kind)
            every = (small[0] + large[0], getattr(self._counters_all, name + "_peak"), small[2] + large[2], small[3] + large[3])
            for stat_type, row in zip(STAT_TYPES, (every, small, large)):
                for field, value in zip(fields, row):
                    flat[f"{name}.{stat_type}.{field}"] = value
        for name, stat in (("oversize_allocations", self._oversize_allocations),
                           ("oversize_segments", self._oversize_segments)):
            for field, value in stat.as_dict().items():
                flat[f"{name}.{field}"] = value
        flat.update(self._counters)
        flat["max_split_size"] = _as_int64(self._max_split)
        return dict(sorted(flat.items()))

    def memory_reserved(self) -> int:
        small, large = self._counters_by_kind
        return small.reserved_bytes + large.reserved_bytes

    def memory_allocated(self) -> int:
        small, large = self._counters_by_kind
        return small.allocated_bytes + large.allocated_bytes

    def reset_peak_memory_stats(self) -> None:
        small, large = self._counters_by_kind
        for name in ARRAY_STATS:
            setattr(small, name + "_peak", getattr(small, name))
            setattr(large, name + "_peak", getattr(large, name))
            setattr(self._counters_all, name + "_peak", getattr(small, name) + getattr(large, name))
        for stat in (self._oversize_allocations, self._oversize_segments):
            stat.peak = stat.current

    def reset_accumulated_memory_stats(self) -> None:
        for counters in self._counters_by_kind:
            for name in ARRAY_STATS:
                setattr(counters, name + "_total", 0)
                setattr(counters, name + "_base", getattr(counters, name))
        for stat in (self._oversize_allocations, self._oversize_segments):
            stat.allocated = stat.freed = 0
        self._counters = dict.fromkeys(COUNTERS, 0)


def _pool_id(pool_id) -> tuple[int, int]:
    try:
        first, second = pool_id
        return (int(first), int(second))
    except (TypeError, ValueError):
        raise ValueError(f"a pool id is a pair of ints like (0, 1), got {pool_id!r}") from None


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
    """(address, size, stream, pool id, is_small, [(size, state, requested)]) of one snapshot segment, checked."""
    where = f"segment {index}"
    try:
        address, total = int(segment["address"]), int(segment["total_size"])
        blocks = segment["blocks"]
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(
            f"{where} is not a snapshot segment ({type(error).__name__}: {error}); pass the segments of "
            "torch.cuda.memory_snapshot() (dicts with address, total_size and blocks)"
        ) from None
    if segment.get("is_expandable"):
        raise NotImplementedError(f"{where} is an expandable segment; restoring those is not supported yet")
    kind = segment.get("segment_type", "small" if total <= K_SMALL_BUFFER else "large")
    if kind not in ("small", "large"):
        raise ValueError(f"{where}: segment_type must be 'small' or 'large', got {kind!r}")
    pool_id = _pool_id(segment.get("segment_pool_id", DEFAULT_POOL))
    if address <= 0 or total <= 0 or not blocks:
        raise ValueError(f"{where} at {address:#x}: needs a positive address and size and at least one block")
    parsed, ptr, previous_state = [], address, None
    for j, block in enumerate(blocks):
        size, state = int(block["size"]), block["state"]
        if size <= 0 or size % K_MIN_BLOCK_SIZE:
            raise ValueError(f"{where} block {j}: size {size} is not a positive multiple of {K_MIN_BLOCK_SIZE}")
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
    return (address, total, int(segment.get("stream", 0)), pool_id, kind == "small", parsed)


def _check_no_overlap(parsed: list[tuple], allocators: dict) -> None:
    """Device segments must not overlap; pluggable pools' segments may lie inside other segments."""
    device = sorted((p[0], p[0] + p[1]) for p in parsed if p[3] not in allocators)
    for (start, end), (next_start, next_end) in zip(device, device[1:]):
        if next_start < end:
            raise ValueError(
                f"segments [{start:#x}, {end:#x}) and [{next_start:#x}, {next_end:#x}) overlap; if one belongs to a "
                "pluggable pool, pass its raw allocator in allocators={pool_id: allocator}"
            )
