"""What existed before a mid-run trace's first entry, rebuilt from the trace and its snapshot.

A trace recorded after history was enabled late, or by a ring buffer that wrapped, begins in
the middle of a run. The segments it uses without creating them, the blocks it frees without
allocating them, and the blocks alive in the snapshot that it never allocated existed before
it (:class:`~graphborrow.fidelity.plan.TracePlan` finds them). This module lays them out:

- a segment's blocks (:func:`block_layout`): the known ones where they are, exact when the
  snapshot shows them, the request's rounded size when only a free says they existed (a
  guess: the block may have been handed out whole), the rest free;
- expandable memory (:func:`expandable_at_start`): the pages mapped at the first entry (the
  snapshot's, less what the trace mapped, plus what it unmapped), grouped into reservations,
  one per stream, kind and pool, each starting at its lowest range or, below a rebuilt
  reservation, where the driver's end-to-end layout puts it (:func:`reservation_starts`);
- segments from before the trace that overlap (:func:`overlapping_lives`): the trace and its
  snapshot disagree, and one of each pair is left out.

Which pool a segment the snapshot does not name belonged to is not decided here: the replay's
passes choose it (and may refute the choice).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from graphborrow.allocator.blocks import DEFAULT_POOL, pool_tuple
from graphborrow.core.sizes import SMALL_BUFFER, round_size

from .plan import Geometry, KnownBlock, SegmentLife, TracePlan

__all__ = [
    "RESERVATION_ALIGNMENT", "LaidBlock", "MappedRange", "Reservation", "UnexplainedRanges", "block_layout",
    "expandable_at_start", "overlapping_lives", "reservation_starts",
]

# the grid the driver lays virtual reservations on (cuMemAddressReserve with alignment 0): every
# expandable reservation of the H200 corpus that starts on a 2 MiB page boundary starts on it
RESERVATION_ALIGNMENT = 32 * 2**20


class UnexplainedRanges(Exception):  # noqa: N818 (a finding, not a failure)
    """The expandable ranges mapped when the trace began fit no set of reservations."""


@dataclass(frozen=True)
class LaidBlock:
    """One block of a rebuilt segment: its size and state, and whether the size is a guess."""

    size: int
    state: str
    requested: int
    guessed: bool

    def as_snapshot_block(self) -> dict:
        return {"size": self.size, "state": self.state, "requested_size": self.requested}


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


def block_layout(start: int, size: int, known: list[KnownBlock], divisions) -> list[LaidBlock]:
    """The blocks tiling ``[start, start + size)``: the known blocks where they are, the rest free.

    A known block whose size is not known gets its request rounded as the allocator rounds it
    (``divisions``: the roundup_power2_divisions setting), cut at the next known block.
    """
    end = start + size
    layout, cursor = [], start
    known = sorted(known, key=lambda b: b.address)
    for n, block in enumerate(known):
        addr = block.address
        if addr < cursor or addr >= end:
            continue
        limit = known[n + 1].address if n + 1 < len(known) else end
        guessed = block.size is None
        bsize = min(round_size(max(block.requested, 1), divisions) if guessed else block.size, limit - addr)
        if bsize <= 0:
            continue
        if addr > cursor:
            layout.append(LaidBlock(addr - cursor, "inactive", 0, False))
        layout.append(LaidBlock(bsize, block.state, block.requested, guessed))
        cursor = addr + bsize
    if cursor < end:
        layout.append(LaidBlock(end - cursor, "inactive", 0, False))
    merged: list[LaidBlock] = []
    for item in layout:
        if merged and item.state == "inactive" and merged[-1].state == "inactive":
            merged[-1] = LaidBlock(merged[-1].size + item.size, "inactive", 0, False)
        else:
            merged.append(item)
    return merged


def overlapping_lives(plan: TracePlan) -> tuple[list[str], list[SegmentLife]]:
    """Segments from before the trace that overlap another one: the trace and its snapshot disagree
    (a trace cut short, or a snapshot of another moment).

    Returns:
        One message per overlap, and the lives to leave out of the rebuilt state: of each pair,
        the one the trace does not release (it comes from the snapshot).
    """
    lives = sorted((life for life in plan.pre if not life.expandable), key=lambda life: life.address)
    messages: list[str] = []
    dropped: list[SegmentLife] = []
    last = None
    for life in lives:
        if last is not None and life.address < last.address + last.size:
            drop = life if life.end is None or last.end is not None else last
            messages.append(f"a segment {life.size} B at {life.address:#x} and a segment {last.size} B at "
                            f"{last.address:#x} both existed before the trace began: the trace and its "
                            f"snapshot disagree")
            dropped.append(drop)
            last = last if drop is life else life
            continue
        last = life
    return messages, dropped


def _pages_at_start(plan: TracePlan, large_page: int) -> dict[int, MappedRange]:
    """Expandable pages mapped when the trace began, each as a one-page range (kind None when unknown)."""
    pages: dict[int, MappedRange] = {}
    for segment in plan.final:
        if segment.get("is_expandable"):
            pool = pool_tuple(segment.get("segment_pool_id", DEFAULT_POOL))
            for page in range(segment["address"], segment["address"] + segment["total_size"], SMALL_BUFFER):
                pages[page] = MappedRange(page, SMALL_BUFFER, segment.get("stream", 0),
                                          segment.get("segment_type") == "small", pool)
    for entry in reversed(plan.entries):
        action = entry.get("action")
        if action == "segment_map":
            for page in range(entry["addr"], entry["addr"] + entry["size"], SMALL_BUFFER):
                pages.pop(page, None)
        elif action == "segment_unmap":
            small = True if entry["size"] % large_page else None
            for page in range(entry["addr"], entry["addr"] + entry["size"], SMALL_BUFFER):
                pages[page] = MappedRange(page, SMALL_BUFFER, entry.get("stream", 0), small, None)
    return pages


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


def expandable_at_start(plan: TracePlan, geometry: Geometry) -> list[Reservation]:
    """The expandable reservations mapped when the trace began, with their ranges and starts.

    Ranges of one stream and kind further apart than one reservation are other reservations.

    Raises:
        UnexplainedRanges: the ranges fit no set of reservations (a range one reservation cannot
            hold, or two reservations of one stream, kind and pool).
    """
    large_page = geometry.large_page
    pages = _pages_at_start(plan, large_page)
    if not pages:
        return []
    groups: list[Reservation] = []
    for rng in _ranges(pages):
        rng.small = bool(rng.small)
        for group in groups:
            first = group.first
            if first.stream == rng.stream and first.small == rng.small and rng.address - first.address < \
                    geometry.virtual_size(SMALL_BUFFER if rng.small else large_page) \
                    and (rng.pool is None or group.pool in (None, rng.pool)):
                group.ranges.append(rng)
                break
        else:
            groups.append(Reservation([rng]))
    named = set()
    for group in groups:
        page = SMALL_BUFFER if group.small else large_page
        base = group.first.address
        span = geometry.virtual_size(page)
        if any((r.address - base) % page or r.size % page or r.end > base + span for r in group.ranges):
            raise UnexplainedRanges("ranges that one reservation cannot hold")
        if group.pool is not None:
            if (group.stream, group.small, group.pool) in named:
                raise UnexplainedRanges("two reservations of one stream, kind and pool")
            named.add((group.stream, group.small, group.pool))
    return groups


def reservation_starts(groups: list[Reservation], geometry: Geometry) -> dict[str, str]:
    """Set where each rebuilt reservation begins: its lowest page mapped then, or below it.

    The driver lays reservations end to end on a ``RESERVATION_ALIGNMENT`` grid, each one its
    virtual size rounded up to that grid. A reservation whose lowest pages were unmapped when
    the trace began would, started at its lowest mapped page, reach into the next reservation
    and take the pages the trace maps there. Its start is taken as the highest address on that
    grid and on its page grid, at or below its lowest page, whose range ends at or below the
    start of the next rebuilt reservation above it (all of them existed together), walked from
    the top. That is never below the true start when the one above is not, so a range never
    reaches into a reservation the driver laid after it. Without a reservation above, or with
    no such address, the lowest mapped page (a reservation cannot be shown to start lower).

    Returns:
        The decisions made, as ``{"reservation <lowest page>": "starts at <start>, ..."}``.
    """
    decisions = {}
    above = None  # start of the rebuilt reservation just above
    for group in sorted(groups, key=lambda g: -g.first.address):
        low, high = group.first.address, max(r.end for r in group.ranges)
        page = SMALL_BUFFER if group.small else geometry.large_page
        virtual = geometry.virtual_size(page)
        start = low
        if above is not None and above >= high:
            limit = min(above - virtual, low)
            candidate = limit - limit % RESERVATION_ALIGNMENT
            while candidate >= high - virtual and (low - candidate) % page:
                candidate -= RESERVATION_ALIGNMENT
            if candidate < high - virtual:  # off the grid: the highest start on its page grid
                candidate = low - -(-(low - limit) // page) * page
            if candidate >= high - virtual and candidate != low:
                start = candidate
                decisions[f"reservation {low:#x}"] = f"starts at {start:#x}, below the next reservation"
        group.start = start
        above = start
    return decisions


def reservation_known_blocks(plan: TracePlan) -> list[KnownBlock]:
    """Blocks of expandable memory from before the trace: freed by the trace, or alive in the snapshot
    (sizes exact where the snapshot shows them: expandable segments split at 512 bytes)."""
    known = list(plan.freed_before)
    for segment in plan.final:
        if segment.get("is_expandable"):
            known += plan.alive_before(segment)
    return known


def reservation_segments(group: Reservation, pool_id: tuple[int, int], known: list[KnownBlock],
                         divisions) -> list[dict]:
    """The snapshot segments (for :func:`graphborrow.allocator.restore.restore`) of one rebuilt reservation."""
    out = []
    for rng in group.ranges:
        inside = [k for k in known if rng.address <= k.address < rng.end]
        out.append({"address": rng.address, "total_size": rng.size, "stream": group.stream, "is_expandable": True,
                    "reservation_address": group.start, "segment_type": "small" if group.small else "large",
                    "segment_pool_id": pool_id,
                    "blocks": [b.as_snapshot_block() for b in block_layout(rng.address, rng.size, inside, divisions)]})
    return out
