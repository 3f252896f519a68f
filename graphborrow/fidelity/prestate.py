"""What existed before a mid-run trace's first entry, rebuilt from the trace and its snapshot.

A trace recorded after history was enabled late, or by a ring buffer that wrapped, begins in
the middle of a run. The segments it uses without creating them, the blocks it frees without
allocating them, and the blocks alive in the snapshot that it never allocated existed before
it (:class:`~graphborrow.fidelity.lifetimes.SegmentLifetimes` finds them). This module lays them out:

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

from dataclasses import dataclass

from sortedcontainers import SortedDict

from graphborrow.allocator.memory import GRANULE
from graphborrow.core.sizes import SMALL_BUFFER, round_size

from .lifetimes import Geometry, KnownBlock, Reservation, SegmentLife, SegmentLifetimes

__all__ = [
    "RESERVATION_ALIGNMENT", "LaidBlock", "UnexplainedRanges", "block_layout",
    "expandable_at_start", "overlapping_lives", "reservation_known_blocks", "reservation_segments", "reservation_starts",
    "separate_reservations",
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


def block_layout(start: int, size: int, known: list[KnownBlock], divisions, learned=None) -> list[LaidBlock]:
    """The blocks tiling ``[start, start + size)``: the known blocks where they are, the rest free.

    A known block whose size is not known gets the size the trace taught (``learned``: address ->
    size, see :class:`graphborrow.fidelity.checking_pass.Learned`), else its request rounded as the
    allocator rounds it (``divisions``: the roundup_power2_divisions setting, a guess), cut at the
    next known block.
    """
    learned = learned or {}
    end = start + size
    layout, cursor = [], start
    known = sorted(known, key=lambda b: b.address)
    for n, block in enumerate(known):
        addr = block.address
        if addr < cursor or addr >= end:
            continue
        limit = known[n + 1].address if n + 1 < len(known) else end
        guessed = block.size is None and addr not in learned
        if block.size is not None:
            bsize = block.size
        else:
            bsize = learned.get(addr) or round_size(max(block.requested, 1), divisions)
        bsize = min(bsize, limit - addr)
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


def overlapping_lives(plan: SegmentLifetimes) -> tuple[list[str], list[SegmentLife]]:
    """Segments from before the trace that overlap another one: the trace and its snapshot disagree
    (a trace cut short, or a snapshot of another moment). A pluggable pool's segments lie inside
    other segments' memory by nature and are not compared.

    Returns:
        One message per overlap, and the lives to leave out of the rebuilt state: of each pair,
        the one the trace does not release (it comes from the snapshot).
    """
    lives = sorted((life for life in plan.pre if not life.expandable and not life.pluggable), key=lambda life: life.address)
    messages: list[str] = []
    dropped: list[SegmentLife] = []
    for life in lives:
        if life.address % GRANULE or life.size % GRANULE:  # cudaMalloc memory lies on its 2 MiB grid
            messages.append(f"a segment {life.size} B at {life.address:#x} of the default pool existed before the "
                            f"trace off cudaMalloc's 2 MiB grid: the trace and its snapshot disagree")
            dropped.append(life)
    lives = [life for life in lives if life not in dropped]
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


def expandable_at_start(plan: SegmentLifetimes, geometry: Geometry) -> list[Reservation]:
    """The expandable reservations mapped when the trace began, with their ranges and starts.

    Ranges of one stream and kind further apart than one reservation are other reservations.

    Raises:
        UnexplainedRanges: the ranges fit no set of reservations (a range one reservation cannot
            hold, or two reservations of one stream, kind and pool).
    """
    large_page = geometry.large_page
    groups = plan.start_reservations()
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


def separate_reservations(groups: list[Reservation], plan: SegmentLifetimes, geometry: Geometry) -> tuple[list[str], list[Reservation]]:
    """Rebuilt reservations whose virtual range overlaps another's, or a device segment from before the
    trace: the trace and its snapshot disagree (pages of two reservations nearer than one reservation's
    size, or a reservation over cudaMalloc memory). Each such reservation is left out.

    Returns:
        One message per reservation left out, and the reservations kept.
    """
    taken = SortedDict()  # start -> end of the ranges kept so far
    for life in plan.pre:
        if not life.expandable and not life.pluggable:
            taken[life.address] = max(taken.get(life.address, 0), life.address + -(-life.size // GRANULE) * GRANULE)
    messages, kept = [], []
    for group in sorted(groups, key=lambda g: (g.pool is None, g.start)):  # those the snapshot names first
        end = group.start + geometry.virtual_size(SMALL_BUFFER if group.small else geometry.large_page)
        i = taken.bisect_left(end)
        clash = i > 0 and taken.peekitem(i - 1)[1] > group.start
        if clash:
            other, other_end = taken.peekitem(i - 1)
            messages.append(
                f"expandable pages of stream {group.stream} mapped at {group.first.address:#x} before the trace "
                f"need a reservation [{group.start:#x}, {end:#x}) that overlaps memory at [{other:#x}, "
                f"{other_end:#x}) from before the trace: the trace and its snapshot disagree")
            continue
        taken[group.start] = end
        kept.append(group)
    kept.sort(key=lambda g: groups.index(g))
    return messages, kept


def reservation_known_blocks(plan: SegmentLifetimes) -> list[KnownBlock]:
    """Blocks of expandable memory from before the trace: freed by the trace, or alive in the snapshot
    (sizes exact where the snapshot shows them: expandable segments split at 512 bytes). A block inside
    a segment from before the trace (a pluggable pool's, within a reservation's free block) is that
    segment's, not the reservation's."""
    inner = SortedDict()
    for life in plan.pre:
        if not life.expandable:
            inner[life.address] = max(inner.get(life.address, 0), life.address + life.size)
    largest = max((end - start for start, end in inner.items()), default=0)

    def in_a_segment(address: int) -> bool:
        return any(inner[start] > address for start in inner.irange(address - largest, address))

    known = [block for block in plan.freed_before if not in_a_segment(block.address)]
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
