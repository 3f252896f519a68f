"""Simulated device memory: what cudaMalloc / cudaFree / cuMem* / cudaMemGetInfo see.

Two kinds of ranges share one address space, as on a GPU:

- cudaMalloc ranges, handed out at 2 MiB aligned addresses, reusing the lowest freed
  gap that fits (as the driver tends to); each is physical memory at once;
- virtual reservations (cuMemAddressReserve), placed far above them, into which
  expandable segments map physical pages (cuMemCreate + cuMemMap) and later unmap them.

Only physical bytes (cudaMalloc'd ranges and mapped pages) count against the capacity.
With ``backed=True`` every range has real host bytes behind it, so device tensors can be
views of them (a reservation is one lazily committed anonymous mapping);
``backed=False`` keeps only the layout (fast, for sweeps).
"""

from __future__ import annotations

import math
import mmap
from collections import deque
from typing import Iterable

import torch
from sortedcontainers import SortedDict

from .errors import AddressInUseError

__all__ = ["GRANULE", "PhysicalMemory"]

GRANULE = 2 * 2**20  # cudaMalloc's address and size granularity
_RESERVATION_OFFSET = 2**44  # virtual reservations start this far above the cudaMalloc base


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class PhysicalMemory:
    """Device memory of a given capacity; counts cudaMalloc'd bytes and mapped pages as used."""

    def __init__(self, capacity: int = 80 * 2**30, backed: bool = True, base: int = 0x7F0000000000) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be a positive number of bytes, got {capacity}")
        if base % GRANULE:
            raise ValueError(f"base address {base:#x} must be 2 MiB aligned")
        self.capacity = int(capacity)
        self.backed = bool(backed)
        self.base = int(base)
        self.used = 0
        self._ranges = SortedDict()  # address -> reserved bytes (2 MiB multiple): cudaMalloc ranges and reservations
        self._gaps = SortedDict({self.base: math.inf})  # start -> end of the free space at or above base
        self._sizes: dict[int, int] = {}  # cudaMalloc address -> bytes asked for
        self._reservations: dict[int, int] = {}  # reservation address -> bytes
        self._next_reservation = self.base + _RESERVATION_OFFSET
        self._backing: dict[int, torch.Tensor] = {}
        self._mappings: dict[int, mmap.mmap] = {}  # reservation address -> its host mapping (backed only)
        self._expected: int | None = None
        self._plan: dict[int, deque] = {}  # nbytes -> addresses a recorded run's cudaMallocs got

    # ------------------------------------------------------------------ cudaMalloc / cudaFree

    def cuda_malloc(self, nbytes: int) -> int:
        """Reserve ``nbytes``; returns the address, or 0 when it would exceed the capacity."""
        if nbytes <= 0:
            raise ValueError(f"cuda_malloc needs a positive size, got {nbytes}")
        reserved = _round_up(nbytes, GRANULE)
        if self.used + reserved > self.capacity:
            self._expected = None
            return 0
        address = self._planned_address(nbytes, reserved) if self._plan and self._expected is None else None
        if address is None:
            address = self._place(reserved)
        self._ranges[address] = reserved
        self._take_gap(address, address + reserved)
        self._sizes[address] = nbytes
        self.used += reserved
        if self.backed:
            self._backing[address] = torch.empty(reserved, dtype=torch.uint8)
        return address

    def reserve(self, address: int, nbytes: int) -> None:
        """Mark ``[address, address + nbytes)`` used, as a cudaMalloc that returned ``address`` would.

        For rebuilding a device's state from a snapshot; raises when the range overlaps a live
        range or exceeds the capacity.
        """
        reserved = _round_up(nbytes, GRANULE)
        if address % GRANULE:
            raise ValueError(f"reserve({address:#x}): device ranges start at 2 MiB aligned addresses")
        if self.used + reserved > self.capacity:
            raise ValueError(
                f"reserving {reserved} bytes at {address:#x} exceeds the device capacity ({self.used} of "
                f"{self.capacity} bytes already used); give the device more capacity"
            )
        self.expect_next_address(address)
        self.cuda_malloc(nbytes)

    def cuda_free(self, address: int) -> None:
        reserved = self._ranges.get(address)
        if reserved is None or address not in self._sizes:
            raise ValueError(f"cuda_free({address:#x}): no cudaMalloc range starts at this address")
        del self._ranges[address]
        del self._sizes[address]
        self._return_gap(address, address + reserved)
        self._backing.pop(address, None)
        self.used -= reserved

    # ------------------------------------------------------------------ virtual reservations and pages

    def reserve_address_space(self, nbytes: int) -> int:
        """cuMemAddressReserve: a virtual range of ``nbytes`` (no physical memory yet); its address."""
        if nbytes <= 0 or nbytes % GRANULE:
            raise ValueError(f"reserve_address_space({nbytes}): give a positive multiple of 2 MiB")
        if self._expected is not None:
            address, self._expected = self._expected, None
            self._check_free(address, nbytes)
        else:
            address = self._next_reservation
        self._next_reservation = max(self._next_reservation, address + nbytes)
        self._ranges[address] = nbytes
        self._take_gap(address, address + nbytes)
        self._reservations[address] = nbytes
        if self.backed:
            mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0))
            self._mappings[address] = mapping
            self._backing[address] = torch.frombuffer(mapping, dtype=torch.uint8)
        return address

    def release_address_space(self, address: int) -> None:
        """cuMemAddressFree of a reservation whose pages are all unmapped."""
        nbytes = self._reservations.pop(address, None)
        if nbytes is None:
            raise ValueError(f"release_address_space({address:#x}): no reservation starts at this address")
        del self._ranges[address]
        self._return_gap(address, address + nbytes)
        self._backing.pop(address, None)
        mapping = self._mappings.pop(address, None)
        if mapping is not None:
            try:
                mapping.close()
            except BufferError:  # a tensor view still exports it; the mapping goes when that view does
                pass

    def map_pages(self, address: int, nbytes: int) -> bool:
        """cuMemCreate + cuMemMap of ``nbytes`` at ``address`` in a reservation; False when out of memory."""
        if self.used + nbytes > self.capacity:
            return False
        self._reservation_of(address, nbytes)
        self.used += nbytes
        return True

    def unmap_pages(self, address: int, nbytes: int) -> None:
        """cuMemUnmap + cuMemRelease: the pages' physical memory goes back (their host bytes too)."""
        start = self._reservation_of(address, nbytes)
        self.used -= nbytes
        mapping = self._mappings.get(start)
        if mapping is not None and hasattr(mapping, "madvise"):
            mapping.madvise(mmap.MADV_DONTNEED, address - start, nbytes)

    def _reservation_of(self, address: int, nbytes: int) -> int:
        found = self.range_of(address)
        if found is None or found[0] not in self._reservations or address + nbytes > found[0] + found[1]:
            raise ValueError(f"[{address:#x}, +{nbytes}) does not lie inside one virtual reservation")
        return found[0]

    # ------------------------------------------------------------------ queries

    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) as cudaMemGetInfo reports them, counting physical bytes only."""
        return self.capacity - self.used, self.capacity

    def expect_next_address(self, address: int | None) -> None:
        """Make the next successful cuda_malloc (or reservation) return exactly ``address`` (None cancels)."""
        self._expected = None if address is None else int(address)

    def follow_addresses(self, plan: Iterable[tuple[int, int]]) -> None:
        """Give cudaMalloc the addresses a recorded run got, size by size, in their order.

        ``plan``: ``(nbytes, address)`` of every ``segment_alloc`` of a GPU trace. Where a
        segment lands is the driver's choice, not the caching allocator's, yet the
        allocator's best fit breaks ties between equal free blocks by address, so the same
        allocation sequence fills segments differently unless their address order is the
        GPU's. The n-th cudaMalloc of a size takes the plan's next address for that size
        that is free now (a run that allocates differently stays close: only that size's
        queue moves); a size the plan has run out of gets the lowest free address.
        """
        queues: dict[int, deque] = {}
        for nbytes, address in plan:
            if int(address) % GRANULE:
                raise ValueError(f"planned address {int(address):#x} is not 2 MiB aligned; "
                                 "is this a cudaMalloc address?")
            queues.setdefault(int(nbytes), deque()).append(int(address))
        self._plan = queues

    def _planned_address(self, nbytes: int, reserved: int) -> int | None:
        queue = self._plan.get(nbytes)
        while queue:
            address = queue.popleft()
            if not self.overlaps(address, reserved):
                return address
        return None

    def range_of(self, address: int) -> tuple[int, int] | None:
        """(start, bytes) of the cudaMalloc range or reservation containing ``address``, if any."""
        i = self._ranges.bisect_right(address) - 1
        if i < 0:
            return None
        start, reserved = self._ranges.peekitem(i)
        return (start, reserved) if address < start + reserved else None

    def host_view(self, address: int, nbytes: int) -> torch.Tensor:
        """A uint8 CPU tensor aliasing device bytes [address, address + nbytes)."""
        if not self.backed:
            raise RuntimeError(
                "this PhysicalMemory was created with backed=False and keeps no bytes; "
                "create the simulated device with backed=True to read or write tensor data"
            )
        found = self.range_of(address)
        if found is None or address + nbytes > found[0] + found[1]:
            raise ValueError(
                f"[{address:#x}, {address + nbytes:#x}) does not lie inside one cudaMalloc'd range; "
                "views must stay within the segment they were allocated from"
            )
        start = found[0]
        return self._backing[start][address - start : address - start + nbytes]

    def overlaps(self, address: int, nbytes: int) -> bool:
        """Whether [address, address + nbytes) overlaps a live cudaMalloc range or reservation."""
        i = self._ranges.bisect_left(address + nbytes) - 1
        if i < 0:
            return False
        start, reserved = self._ranges.peekitem(i)
        return start + reserved > address

    # ------------------------------------------------------------------ placement

    def _place(self, nbytes: int) -> int:
        if self._expected is not None:
            address, self._expected = self._expected, None
            self._check_free(address, nbytes)
            return address
        return self._lowest_fit(nbytes)

    def _check_free(self, address: int, nbytes: int) -> None:
        if self.overlaps(address, nbytes):
            raise AddressInUseError(address, nbytes)

    def _lowest_fit(self, nbytes: int) -> int:
        """The lowest address >= base with ``nbytes`` free: the first free gap that is big enough."""
        for start, end in self._gaps.items():
            if end - start >= nbytes:
                return start
        raise AssertionError("the free space above the last range is unbounded")

    def _take_gap(self, start: int, end: int) -> None:
        """Mark [start, end) (a range that overlaps nothing live) as used in the gap map."""
        start = max(start, self.base)
        if start >= end:
            return
        gaps = self._gaps
        gap_start, gap_end = gaps.peekitem(gaps.bisect_right(start) - 1)
        del gaps[gap_start]
        if gap_start < start:
            gaps[gap_start] = start
        if end < gap_end:
            gaps[end] = gap_end

    def _return_gap(self, start: int, end: int) -> None:
        """Mark [start, end) free again, merging with the gaps on either side."""
        start = max(start, self.base)
        if start >= end:
            return
        gaps = self._gaps
        following_end = gaps.pop(end, None)
        if following_end is not None:
            end = following_end
        i = gaps.bisect_left(start) - 1
        if i >= 0:
            before_start, before_end = gaps.peekitem(i)
            if before_end == start:
                start = before_start
        gaps[start] = end

    def __repr__(self) -> str:
        return (
            f"PhysicalMemory(used={self.used}, capacity={self.capacity}, ranges={len(self._ranges)}, "
            f"backed={self.backed})"
        )
