"""The plan of a trace: one pass over its entries that finds what each segment's life was.

Before anything is replayed, :class:`SegmentLifetimes` walks the trace once and finds every
segment (or expandable reservation) it shows: created by which entry, released by which,
and, from the final snapshot, its pool. What the trace uses without having created it
existed before the first entry (a mid-run trace): those lives are ``pre_trace``, with the
blocks the trace frees without having allocated them and the blocks alive in the snapshot
that the trace never allocated (:class:`KnownBlock`). Where the trace and its snapshot
cannot both be right, the plan says so (``contradictions``), for the replay to count.
"""

from __future__ import annotations

import dataclasses
import heapq
from bisect import bisect_left
from dataclasses import dataclass, field
from sortedcontainers import SortedDict

from graphborrow.allocator.blocks import DEFAULT_POOL, pool_tuple
from graphborrow.allocator.memory import GRANULE
from graphborrow.core.sizes import SMALL_BUFFER

__all__ = ["Geometry", "KnownBlock", "MappedRange", "Reservation", "SegmentId", "SegmentLife", "SegmentLifetimes",
           "reserved_before"]

RELEASES = frozenset({"segment_free", "segment_unmap"})
DEVICE_ACTIONS = frozenset({"segment_alloc", "segment_map", "segment_free", "segment_unmap"})
BLOCK_ACTIONS = frozenset({"alloc", "free_requested", "free_completed"})


@dataclass(frozen=True)
class Geometry:
    """The device the trace was recorded on, as far as segment sizes depend on it.

    ``device_memory`` (totalGlobalMem) sizes an expandable segment's virtual reservation;
    ``large_page`` is the allocator's ``large_segment_size`` (the large pages' size).
    """

    device_memory: int
    large_page: int

    def virtual_size(self, size: int) -> int:
        """An expandable segment's virtual range for pages of this size's kind (as the allocator reserves it)."""
        page = SMALL_BUFFER if size % self.large_page else self.large_page
        total = self.device_memory
        return -(-(total + total // 8) // page) * page

    @property
    def large_virtual(self) -> int:
        return self.virtual_size(self.large_page)

    def kind_of(self, size: int) -> int | None:
        """The virtual size of the reservation pages of ``size`` mapped at once come from; None when
        the size does not tell (a multiple of the large page: large pages, or small ones unmapped together)."""
        virtual = self.virtual_size(size)
        return None if virtual == self.large_virtual else virtual


@dataclass(frozen=True)
class SegmentId:
    """How a segment is named across replays: the entry that created it, or its address before the trace."""

    entry: int = -1  # the creating entry; -1 for memory from before the trace
    address: int = 0  # (memory from before the trace) its address, size and the entry that released it:
    size: int = 0  # a pluggable pool's segment may start where the segment holding it starts, and a
    end: int | None = None  # trace cut short may release what the snapshot still shows

    def __str__(self) -> str:
        if self.entry >= 0:
            return str(self.entry)
        return f"pre@{self.address:#x}+{self.size:#x}" + ("" if self.end is None else f"-{self.end}")


@dataclass(eq=False)
class SegmentLife:
    """One traced segment (or expandable reservation): where, when, and the pool if the snapshot names it."""

    address: int
    size: int
    stream: int
    start: int  # the creating entry; -1 for memory from before the trace
    expandable: bool = False
    pre_trace: bool = False
    end: int | None = None  # the releasing entry
    pool: tuple[int, int] | None = None  # known from the final snapshot
    touched: bool = False  # an entry of the trace falls inside it
    pluggable: bool = False  # memory of a pluggable pool's allocator (inside another segment), not cudaMalloc's

    @property
    def identity(self) -> SegmentId:
        return SegmentId(self.start) if self.start >= 0 else SegmentId(-1, self.address, self.size, self.end)


@dataclass(frozen=True)
class KnownBlock:
    """A block that existed before the trace: freed by the trace without being allocated, or alive at the end.

    ``size`` is None when only the request is known (a block the trace frees); ``ends_at`` is
    the entry that frees (or completes) it, None for one alive in the snapshot.
    """

    address: int
    size: int | None
    state: str
    ends_at: int | None
    requested: int


@dataclass
class MappedRange:
    """Contiguous expandable pages mapped when the trace began, of one stream (and kind, and pool if known)."""

    address: int
    size: int
    stream: int
    small: bool | None  # None: the pages' kind is not known (unmapped in a multiple of the large page)
    pool: tuple[int, int] | None  # known from the snapshot

    @property
    def end(self) -> int:
        return self.address + self.size


@dataclass
class Reservation:
    """The ranges of one expandable reservation from before the trace, and where it starts."""

    ranges: list[MappedRange] = field(default_factory=list)
    start: int = 0

    @property
    def first(self) -> MappedRange:
        return self.ranges[0]

    @property
    def stream(self) -> int:
        return self.first.stream

    @property
    def small(self) -> bool:
        return bool(self.first.small)

    @property
    def pool(self) -> tuple[int, int] | None:
        """The pool the snapshot names for one of its ranges, if any."""
        return next((r.pool for r in self.ranges if r.pool is not None), None)

    def life(self, geometry: Geometry) -> SegmentLife:
        """The reservation as a segment from before the trace (by which passes name its pool)."""
        virtual = geometry.virtual_size(SMALL_BUFFER if self.small else geometry.large_page)
        return SegmentLife(self.first.address, virtual, self.stream, -1, expandable=True, pre_trace=True)


class _LiveIndex:
    """An interval index of the lives that exist at the entry being walked."""

    def __init__(self) -> None:
        self.by_address = SortedDict()  # address -> lives starting there

    def add(self, life: SegmentLife) -> None:
        self.by_address.setdefault(life.address, []).append(life)

    def remove(self, life: SegmentLife) -> None:
        lives = self.by_address[life.address]
        lives.remove(life)
        if not lives:
            del self.by_address[life.address]

    def at(self, address: int) -> list[SegmentLife]:
        return self.by_address.get(address, ())

    def find(self, address: int, end: int, stream: int | None = None, virtual: int | None = None) -> SegmentLife | None:
        """The smallest life holding ``[address, end)``; with ``stream``, only an expandable
        reservation of that stream (and, with ``virtual``, of that size: of that page kind) can
        hold pages mapped or unmapped there: a reservation serves one stream and kind."""
        live = self.by_address
        i = live.bisect_right(address)
        best = None
        for key in reversed(live.keys()[max(0, i - 64):i]):
            for life in live[key]:
                if stream is not None and (not life.expandable or life.stream != stream
                                           or (virtual is not None and life.size != virtual)):
                    continue
                if life.address <= address and end <= life.address + life.size:
                    if best is None or life.size < best.size:
                        best = life
        return best


@dataclass
class _Walk:
    """What the walk keeps while it reads the entries."""

    live: _LiveIndex = field(default_factory=_LiveIndex)
    mapped: dict[int, int] = field(default_factory=dict)  # id(reservation life) -> bytes mapped by the trace
    in_trace: dict[int, int] = field(default_factory=dict)  # address -> blocks the trace allocated and did not free
    pending_in_trace: dict[int, int] = field(default_factory=dict)  # address -> traced frees awaiting completion
    freed_before: list[KnownBlock] = field(default_factory=list)  # blocks the trace frees without allocating


class SegmentLifetimes:
    """One pass over the trace: segment lives, what existed before the first entry, known pools.

    Args:
        entries: the device trace.
        final: the snapshot's segments (at the end of the trace).
        geometry: the device's memory and large page (expandable reservations' sizes).
    """

    def __init__(self, entries: list[dict], final: list[dict], geometry: Geometry) -> None:
        self.entries = entries
        self.final = final
        self.geometry = geometry
        self.lives: dict[int, SegmentLife] = {}  # creating entry index -> life
        self.pre: list[SegmentLife] = []  # segments (or reservations) from before the trace
        self.kept: list[SegmentLife] = []  # ... of them, those the snapshot shows (alive all through the trace)
        self.pre_blocks: dict[int, list[KnownBlock]] = {}  # id(pre life) -> its blocks from before the trace
        self.problems: list[str] = []  # memory from before the trace that nothing places
        self.contradictions: list[str] = []  # what no state before the trace can explain
        self._start_groups: list | None = None  # (built when needed) reservations mapped when the trace began
        self._touched: tuple | None = None  # (built when needed) block addresses and device calls' ranges
        self.failed_releases = self._failed_releases()  # entry indices of releases that did not happen
        walk = _Walk()
        for i, entry in enumerate(entries):
            self._read(i, entry, walk)
        self.end_live = walk.live
        self.mapped_by_trace = self._pages_mapped_by_the_trace()
        self.in_trace_at_end = walk.in_trace
        self._final_segments(walk.live)
        self._place_pre_blocks(walk.freed_before, walk.in_trace, walk.pending_in_trace)
        self._mark_pluggable()
        overlapping = self._overlapping_kept()
        for life in self.kept:
            self._check_kept(life, overlapping[id(life)])
        self.freed_before = walk.freed_before
        self.pending_in_trace = walk.pending_in_trace

    @property
    def mid_run(self) -> bool:
        """Whether the trace did not start at an empty allocator (something existed before its first entry)."""
        return bool(self.pre)

    def all_lives(self) -> list[SegmentLife]:
        return [*self.lives.values(), *self.pre]

    def _failed_releases(self) -> set[int]:
        """``segment_free`` entries whose segment is still in the snapshot: the release failed.

        The allocator writes the entry before it calls ``cudaFree``; when that call fails (a CUDA
        error: a free inside a graph capture invalidates it) the allocator raises and the segment
        stays. Recognised only after the trace's last allocation of device memory, with the same
        address, size and stream in the snapshot: anywhere else a segment that comes back without
        being allocated is a contradiction, and the replay reports it.
        """
        entries = self.entries
        last_made = max((i for i, e in enumerate(entries) if e.get("action") in ("segment_alloc", "segment_map")),
                        default=-1)
        still = {(s["address"], s["total_size"], s.get("stream", 0)) for s in self.final if not s.get("is_expandable")}
        failed = set()
        for i in range(last_made + 1, len(entries)):
            e = entries[i]
            if e.get("action") == "segment_free" and (e.get("addr"), e.get("size"), e.get("stream", 0)) in still:
                failed.add(i)
        return failed

    # ------------------------------------------------------------------ the walk, entry by entry

    def _read(self, i: int, entry: dict, walk: _Walk) -> None:
        action = entry.get("action")
        if action == "segment_alloc":
            self._segment_alloc(i, entry, walk)
        elif action == "segment_free" and i not in self.failed_releases:
            self._segment_free(i, entry, walk)
        elif action == "segment_map":
            self._segment_map(i, entry, walk)
        elif action == "segment_unmap":
            self._segment_unmap(i, entry, walk)
        elif action == "alloc":
            addr, size = entry.get("addr", 0), entry.get("size", 0)
            host = walk.live.find(addr, addr + max(size, 1))
            if host is not None:
                host.touched = True
            walk.in_trace[addr] = walk.in_trace.get(addr, 0) + 1
        elif action == "free_requested":
            self._free_requested(i, entry, walk)
        elif action == "free_completed":
            self._free_completed(i, entry, walk)

    def _segment_alloc(self, i: int, entry: dict, walk: _Walk) -> None:
        addr, size = entry.get("addr", 0), entry.get("size", 0)
        host = walk.live.find(addr, addr + size)
        life = SegmentLife(addr, size, entry.get("stream", 0), i, pluggable=host is not None)
        if host is not None:
            host.touched = True
        walk.live.add(life)
        self.lives[i] = life

    def _segment_free(self, i: int, entry: dict, walk: _Walk) -> None:
        addr, size = entry.get("addr", 0), entry.get("size", 0)
        life = None
        for candidate in walk.live.at(addr):
            if candidate.size == size and not candidate.expandable:
                life = candidate
        if life is None:  # allocated before the trace began
            life = SegmentLife(addr, size, entry.get("stream", 0), -1, pre_trace=True)
            self.pre.append(life)
        else:
            walk.live.remove(life)
        life.end = i
        life.touched = True

    def _segment_map(self, i: int, entry: dict, walk: _Walk) -> None:
        addr, size, stream = entry.get("addr", 0), entry.get("size", 0), entry.get("stream", 0)
        host = walk.live.find(addr, addr + size, stream, self.geometry.kind_of(size))
        if host is None or not host.expandable:
            host = SegmentLife(addr, self.geometry.virtual_size(size), stream, i, expandable=True)
            walk.live.add(host)
            self.lives[i] = host
        host.touched = True
        walk.mapped[id(host)] = walk.mapped.get(id(host), 0) + size

    def _segment_unmap(self, i: int, entry: dict, walk: _Walk) -> None:
        addr, size, stream = entry.get("addr", 0), entry.get("size", 0), entry.get("stream", 0)
        host = walk.live.find(addr, addr + size, stream, self.geometry.kind_of(size))
        if host is None or not host.expandable:
            host = SegmentLife(self._reservation_start(addr, stream, self.geometry.kind_of(size) is not None),
                               self.geometry.virtual_size(size), stream, -1, expandable=True, pre_trace=True)
            self.pre.append(host)
            walk.live.add(host)
            walk.mapped[id(host)] = self._mapped_at_start_near(host)
        host.touched = True
        walk.mapped[id(host)] = walk.mapped.get(id(host), 0) - size
        if walk.mapped[id(host)] <= 0:  # the allocator releases a reservation with nothing mapped
            walk.live.remove(host)
            host.end = i

    def _free_requested(self, i: int, entry: dict, walk: _Walk) -> None:
        addr, size = entry.get("addr", 0), entry.get("size", 0)
        following = self.entries[i + 1] if i + 1 < len(self.entries) else {}
        plain = following.get("action") == "free_completed" and following.get("addr") == addr
        if walk.in_trace.get(addr, 0) > 0:
            walk.in_trace[addr] -= 1
        else:
            walk.freed_before.append(KnownBlock(addr, None, "active_allocated", i, size))
        if not plain:
            walk.pending_in_trace[addr] = walk.pending_in_trace.get(addr, 0) + 1

    def _free_completed(self, i: int, entry: dict, walk: _Walk) -> None:
        addr, size = entry.get("addr", 0), entry.get("size", 0)
        previous = self.entries[i - 1] if i else {}
        if previous.get("action") == "free_requested" and previous.get("addr") == addr:
            return
        if walk.pending_in_trace.get(addr, 0) > 0:
            walk.pending_in_trace[addr] -= 1
        else:
            walk.freed_before.append(KnownBlock(addr, None, "active_pending_free", i, size))

    # ------------------------------------------------------------------ expandable pages

    def start_reservations(self) -> list[Reservation]:
        """The expandable reservations mapped when the trace began, with their ranges (starts not set).

        The pages: the snapshot's, less what the trace mapped, plus what it unmapped (pages
        unmapped in a multiple of the large page taken as large ones: ten free small pages in a row
        would be the exception). Contiguous pages of one stream and kind are a range; ranges of one
        stream and kind further apart than one reservation are other reservations.
        """
        if self._start_groups is None:
            self._start_groups = _group_ranges(_ranges(self._pages_at_start()), self.geometry)
        return self._start_groups

    def _pages_at_start(self) -> dict[int, MappedRange]:
        """Expandable pages mapped when the trace began, each as a one-page range (kind None when unknown)."""
        pages: dict[int, MappedRange] = {}
        for segment in self.final:
            if segment.get("is_expandable"):
                pool = pool_tuple(segment.get("segment_pool_id", DEFAULT_POOL))
                for page in range(segment["address"], segment["address"] + segment["total_size"], SMALL_BUFFER):
                    pages[page] = MappedRange(page, SMALL_BUFFER, segment.get("stream", 0),
                                              segment.get("segment_type") == "small", pool)
        for entry in reversed(self.entries):
            action = entry.get("action")
            if action == "segment_map":
                for page in range(entry["addr"], entry["addr"] + entry["size"], SMALL_BUFFER):
                    pages.pop(page, None)
            elif action == "segment_unmap":
                small = True if entry["size"] % self.geometry.large_page else None
                for page in range(entry["addr"], entry["addr"] + entry["size"], SMALL_BUFFER):
                    pages[page] = MappedRange(page, SMALL_BUFFER, entry.get("stream", 0), small, None)
        return pages

    def _reservation_start(self, address: int, stream: int, small: bool) -> int:
        """Where the reservation from before the trace holding the page at ``address`` is taken to begin:
        the first page of its group among :meth:`start_reservations` (else the page itself)."""
        for group in self.start_reservations():
            if group.stream == stream and group.small == small and any(r.address <= address < r.end for r in group.ranges):
                return group.first.address
        return address

    def _mapped_at_start_near(self, host: SegmentLife) -> int:
        """Bytes mapped in the reservation from before the trace that holds ``host``'s first page when the
        trace began (the reservation of its stream and kind among :meth:`start_reservations`), so that
        it is taken as released when all of them are unmapped."""
        small = host.size != self.geometry.large_virtual
        for group in self.start_reservations():
            if group.stream == host.stream and group.small == small and any(
                    r.address <= host.address < r.end for r in group.ranges):
                return sum(r.size for r in group.ranges)
        return 0

    def _pages_mapped_by_the_trace(self) -> set[int]:
        """The 2 MiB pages (by address) that a segment_map of the trace mapped and nothing unmapped since."""
        pages: set[int] = set()
        for entry in self.entries:
            action = entry.get("action")
            if action in ("segment_map", "segment_unmap"):
                span = range(entry["addr"], entry["addr"] + entry["size"], SMALL_BUFFER)
                if action == "segment_map":
                    pages.update(span)
                else:
                    pages.difference_update(span)
        return pages

    def touches(self, address: int, size: int) -> bool:
        """Whether some entry of the trace falls inside ``[address, address + size)``: a block
        allocated or freed there, or a device call over it."""
        if self._touched is None:
            points = sorted(e["addr"] for e in self.entries if e.get("action") in BLOCK_ACTIONS)
            spans = [(e["addr"], e["addr"] + e["size"]) for e in self.entries if e.get("action") in DEVICE_ACTIONS]
            self._touched = (points, spans)
        points, spans = self._touched
        end = address + size
        i = bisect_left(points, address)
        return (i < len(points) and points[i] < end) or any(start < end and address < stop for start, stop in spans)

    def mapped_before(self, address: int, size: int) -> bool:
        """Whether some page of this expandable range was mapped before the trace began (the trace never mapped it)."""
        return any(page not in self.mapped_by_trace for page in range(address, address + size, SMALL_BUFFER))

    # ------------------------------------------------------------------ the end, and what came before

    def _final_segments(self, live: _LiveIndex) -> None:
        """Match the snapshot's segments with the lives alive at the end; the rest existed before the trace."""
        for segment in self.final:
            address, size, stream = segment["address"], segment["total_size"], segment.get("stream", 0)
            pool = pool_tuple(segment.get("segment_pool_id", DEFAULT_POOL))
            if segment.get("is_expandable"):
                small = segment.get("segment_type") == "small"
                kind = self.geometry.virtual_size(SMALL_BUFFER) if small else self.geometry.large_virtual
                host = live.find(address, address + size, stream, kind)
                if host is None or not host.expandable:
                    host = SegmentLife(self._reservation_start(address, stream, small), self.geometry.virtual_size(size),
                                       stream, -1, expandable=True, pre_trace=True)
                    self.pre.append(host)
                    live.add(host)
                host.pool = pool
                continue
            match = None
            for candidate in live.at(address):
                if candidate.size == size and not candidate.expandable:
                    match = candidate
            if match is None:  # alive all through the trace; touched when an entry allocates or frees in it
                match = SegmentLife(address, size, stream, -1, pre_trace=True, touched=self.touches(address, size))
                self.pre.append(match)
                self.kept.append(match)
                live.add(match)
            match.pool = pool

    def _overlapping_kept(self) -> dict[int, list[SegmentLife]]:
        """``{id(kept life): the lives the trace made or released that share its memory}``, each list
        in :meth:`all_lives` order: one sweep by address (a host block holding thousands of arena
        segments is not walked once per segment)."""
        lives = self.all_lives()
        order = {id(life): k for k, life in enumerate(lives)}
        others = sorted((life for life in lives if not life.expandable and not (life.end is None and life.start < 0)),
                        key=lambda life: life.address)
        starts = [life.address for life in others]
        open_: list[tuple] = []  # (end, order, life) of the others starting before the kept life looked at
        found, j = {}, 0
        for kept in sorted(self.kept, key=lambda life: life.address):
            while j < len(others) and others[j].address < kept.address:
                heapq.heappush(open_, (others[j].address + others[j].size, order[id(others[j])], others[j]))
                j += 1
            while open_ and open_[0][0] <= kept.address:
                heapq.heappop(open_)
            inside = others[j:bisect_left(starts, kept.address + kept.size, lo=j)]
            found[id(kept)] = sorted([life for _, _, life in open_] + inside, key=lambda life: order[id(life)])
        return found

    def _check_kept(self, kept: SegmentLife, overlapping: list[SegmentLife]) -> None:
        """A snapshot segment the trace never allocated lived through the whole trace: no segment the
        trace made or released may have shared its memory (unless one lies inside the other and that
        one is a pluggable pool's: an arena's segment within another pool's block). Otherwise the
        trace and its snapshot disagree (a trace cut short, or a snapshot of another moment)."""
        address, size = kept.address, kept.size
        end = address + size
        for life in overlapping:
            if life is kept:
                continue
            other_end = life.address + life.size
            if (address <= life.address and other_end <= end and life.size < size and life.pluggable) or \
                    (life.address <= address and end <= other_end and size < life.size and kept.pluggable):
                continue
            did = f"released the segment {life.size} B at {life.address:#x} in its memory at event {life.end}" \
                if life.end is not None else \
                f"allocated the segment {life.size} B at {life.address:#x} in its memory at event {life.start}"
            self.contradictions.append(
                f"final snapshot segment {size} B at {address:#x} was never allocated by the trace, yet the trace "
                f"{did}: the trace and its snapshot disagree (a trace cut short, or a snapshot of another moment)"
            )
            return

    def _place_pre_blocks(self, freed_before: list[KnownBlock], in_trace: dict, pending_in_trace: dict) -> None:
        """Blocks that existed before the trace, in the segments that did."""
        if not self.pre:
            return
        index = _LiveIndex()
        for life in self.pre:
            index.add(life)
            self.pre_blocks[id(life)] = []
        still_pending = {addr: block["size"] for segment in self.final for addr, block in _blocks_with_addresses(segment)
                         if block["state"] == "active_pending_free" and pending_in_trace.get(addr, 0) > 0}
        for known in freed_before:
            if known.size is None and known.address in still_pending:  # freed, never completed: the snapshot's
                known = dataclasses.replace(known, size=still_pending[known.address])
            life = index.find(known.address, known.address + 1)
            if life is None:
                self.problems.append(
                    f"event {known.ends_at} frees {known.address:#x}, which lies in no segment the trace or its "
                    "snapshot knows"
                )
                continue
            life.touched = True
            self.pre_blocks[id(life)].append(known)
        for segment in self.final:
            for addr, block in _blocks_with_addresses(segment):
                state = block["state"]
                if state == "inactive":
                    continue
                life = index.find(addr, addr + block["size"])
                if life is None:
                    continue
                if state == "active_allocated" and in_trace.get(addr, 0) > 0:
                    continue  # allocated by the trace
                if state == "active_pending_free" and pending_in_trace.get(addr, 0) > 0:
                    continue
                self.pre_blocks[id(life)].append(
                    KnownBlock(addr, block["size"], state, None, block.get("requested_size", 0)))

    def _mark_pluggable(self) -> None:
        """Segments from before the trace that a pluggable pool's allocator made (a MemPool over an
        arena: its memory lies inside another pool's blocks). Such a segment is off cudaMalloc's
        2 MiB grid, or lies inside another segment that existed with it (at the start, or in the
        snapshot); every segment of a pool the snapshot shows holding one is too. The default pool
        has no pluggable allocator: a segment of it that looks so is a contradiction (see
        :func:`graphborrow.fidelity.prestate.overlapping_lives`)."""
        pluggable_pools = set()
        at_end = [(segment["address"], segment["total_size"], bool(segment.get("is_expandable")),
                   pool_tuple(segment.get("segment_pool_id", DEFAULT_POOL))) for segment in self.final]
        for _, _, _, pool in _nested_or_unaligned(at_end):
            if pool != DEFAULT_POOL:
                pluggable_pools.add(pool)
        at_start = [(life.address, life.size, life.expandable, life) for life in self.pre]
        for _, _, _, life in _nested_or_unaligned(at_start):  # a pool the snapshot names is known from the snapshot
            if life.pool is None:
                life.pluggable = True
        for life in self.pre:
            if not life.expandable and life.pool is not None and life.pool in pluggable_pools:
                life.pluggable = True
        # made inside memory that existed before the trace and was not released yet: one sweep by address over
        # the segments from before the trace (which coexisted, so those holding an address are few)
        hosts = sorted((life for life in self.pre if not life.pluggable), key=lambda life: life.address)
        open_: list[tuple] = []  # (end, index, host) of the hosts starting at or before the life looked at
        j = 0
        for life in sorted(self.lives.values(), key=lambda life: life.address):
            if life.expandable or life.pluggable:
                continue
            while j < len(hosts) and hosts[j].address <= life.address:
                heapq.heappush(open_, (hosts[j].address + hosts[j].size, j, hosts[j]))
                j += 1
            while open_ and open_[0][0] <= life.address:
                heapq.heappop(open_)
            if life.pool in pluggable_pools or any(
                    host.size > life.size and end >= life.address + life.size
                    and (host.end is None or host.end > life.start) for end, _, host in open_):
                life.pluggable = True

    def alive_before(self, segment: dict) -> list[KnownBlock]:
        """The blocks of a snapshot segment that the trace did not allocate (or free): alive before it began."""
        known = []
        for addr, block in _blocks_with_addresses(segment):
            state = block["state"]
            if state == "inactive":
                continue
            if state == "active_allocated" and self.in_trace_at_end.get(addr, 0) > 0:
                continue
            if state == "active_pending_free" and self.pending_in_trace.get(addr, 0) > 0:
                continue
            known.append(KnownBlock(addr, block["size"], state, None, block.get("requested_size", 0)))
        return known


def _blocks_with_addresses(segment: dict) -> list[tuple[int, dict]]:
    """(address, block) of a snapshot segment's blocks; they may omit their addresses: they tile it in order."""
    cursor, out = segment["address"], []
    for block in segment["blocks"]:
        addr = block.get("address", cursor)
        cursor = addr + block["size"]
        out.append((addr, block))
    return out


def reserved_before(entries: list[dict], final: list[dict]) -> list[int]:
    """Device memory reserved before each entry (and after the last), walking back from the snapshot."""
    reserved = [0] * (len(entries) + 1)
    reserved[-1] = sum(segment["total_size"] for segment in final)
    for i in range(len(entries) - 1, -1, -1):
        action, size = entries[i].get("action"), entries[i].get("size", 0)
        change = size if action in ("segment_alloc", "segment_map") else -size if action in RELEASES else 0
        reserved[i] = reserved[i + 1] - change
    return reserved


def _nested_or_unaligned(ranges: list[tuple]) -> list[tuple]:
    """Of ranges (address, size, expandable, tag) of memory that coexisted, the segments (not expandable
    ones) that are not on cudaMalloc's 2 MiB grid or lie inside a larger range: cudaMalloc never
    returns memory inside another allocation or inside a reserved virtual range."""
    found = []
    hosts: list[tuple] = []  # (end, size) of the ranges open at the one being looked at, by start
    for address, size, expandable, tag in sorted(ranges, key=lambda r: (r[0], -r[1])):
        hosts = [(end, host_size) for end, host_size in hosts if end > address]
        inside = any(address + size <= end and host_size > size for end, host_size in hosts)
        if not expandable and (inside or address % GRANULE or size % GRANULE):
            found.append((address, size, expandable, tag))
        hosts.append((address + size, size))
    return found


def _ranges(pages: dict[int, MappedRange]) -> list[MappedRange]:
    """Consecutive pages of one stream and a compatible kind, merged into ranges."""
    ranges: list[MappedRange] = []
    for page in sorted(pages):
        this = pages[page]
        last = ranges[-1] if ranges else None
        if last is not None and last.end == page and last.stream == this.stream \
                and (this.small is None or last.small is None or last.small == this.small):
            last.size += SMALL_BUFFER
            last.small = last.small if last.small is not None else this.small
            last.pool = last.pool if last.pool is not None else this.pool
        else:
            ranges.append(MappedRange(page, SMALL_BUFFER, this.stream, this.small, this.pool))
    return ranges


def _group_ranges(ranges: list[MappedRange], geometry: Geometry) -> list[Reservation]:
    """Ranges of one stream, kind and (when named) pool within one reservation's size of a group's first range."""
    groups: list[Reservation] = []
    for rng in ranges:
        rng.small = bool(rng.small)
        for group in groups:
            first = group.first
            if first.stream == rng.stream and first.small == rng.small and rng.address - first.address < \
                    geometry.virtual_size(SMALL_BUFFER if rng.small else geometry.large_page) \
                    and (rng.pool is None or group.pool in (None, rng.pool)):
                group.ranges.append(rng)
                break
        else:
            groups.append(Reservation([rng]))
    return groups
