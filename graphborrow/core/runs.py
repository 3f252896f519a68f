"""Free-run discovery: where a graph pool is idle, read from an allocator snapshot.

A *run* is a maximal stretch of consecutive ``inactive`` blocks inside one segment.
Runs never cross segments (segments need not be adjacent in address space) and never
cover ``active_allocated`` or ``active_pending_free`` blocks (the latter still wait for
another stream's work). Memory of a segment nested inside another segment's free block
(a borrow pool's segment inside a graph pool, in a snapshot of every pool) counts once,
for the nested segment: the host's runs stop at it. Two policies:

``"runs"``            every segment counts, mixed ones included.
``"whole_segments"``  only segments with nothing allocated (the first upstream rule);
                      one live block hides its whole segment.

Every snapshot is read through :func:`graphborrow.core.snapshot.load_snapshot`, so a
malformed one is refused with a message naming the segment and block, never turned
into runs over memory no free block covers.
"""

from __future__ import annotations

from typing import Any, Iterable

from .snapshot import FREE_STATE, load_snapshot, nested_in

__all__ = ["find_free_runs", "summarize", "runs_total", "load_snapshot", "POLICIES"]

POLICIES = ("runs", "whole_segments")


def _runs_of(segment, holes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Maximal stretches of free blocks in one segment, less the nested segments' ranges.

    The nested segments lie in free blocks and apart from each other: one pass over both,
    by address, cuts them out (however many one run holds)."""
    runs = []
    start = length = 0
    for block in segment["blocks"]:
        if block["state"] == FREE_STATE:
            if length == 0:
                start = block["address"]
            length += block["size"]
        elif length:
            runs.append((start, length))
            length = 0
    if length:
        runs.append((start, length))
    if not holes:
        return runs
    holes = sorted(holes)
    cut, k = [], 0
    for a, n in runs:
        at, end = a, a + n
        while k < len(holes) and holes[k][0] < end:  # the holes of this run (none lies between runs)
            hole_start, hole_size = holes[k]
            if at < hole_start:
                cut.append((at, hole_start - at))
            at = hole_start + hole_size
            k += 1
        if at < end:
            cut.append((at, end - at))
    return cut


def _holes(segments: list) -> dict[int, list[tuple[int, int]]]:
    holes: dict[int, list[tuple[int, int]]] = {}
    for inner, host in nested_in(segments).items():
        holes.setdefault(host, []).append((segments[inner]["address"], segments[inner]["total_size"]))
    return holes


def find_free_runs(segments: Any, policy: str = "runs") -> list[tuple[int, int]]:
    """``(address, nbytes)`` of every free run, largest first (lowest address on ties).

    Args:
        segments: a snapshot in any form :func:`~graphborrow.core.snapshot.load_snapshot` reads.
        policy: ``"runs"`` or ``"whole_segments"``.

    Returns:
        ``(address, nbytes)`` pairs in bytes. Borrowing uses them as the arena's extents,
        so the largest come first: that is where a large tensor must go.

    Raises:
        ValueError: an unknown ``policy``.
        SnapshotFormatError: ``segments`` is not a valid snapshot.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    segs = load_snapshot(segments)["segments"]
    holes = _holes(segs)
    runs: list[tuple[int, int]] = []
    for i, segment in enumerate(segs):
        if policy == "whole_segments" and (
            i in holes or any(b["state"] != FREE_STATE for b in segment["blocks"])
        ):
            continue
        runs.extend(_runs_of(segment, holes.get(i, ())))
    runs.sort(key=lambda r: (-r[1], r[0]))
    return runs


def summarize(segments: Any) -> dict[str, int]:
    """Reserved, allocated and free bytes of a segment list, and the runs by policy.

    Nested segments (a borrow pool inside a graph pool's free blocks) count once:
    ``reserved_bytes`` and ``inactive_bytes`` are those of the outermost segments, less
    the nested ones' memory for ``inactive_bytes``.

    Args:
        segments: a snapshot in any form :func:`~graphborrow.core.snapshot.load_snapshot` reads.

    Returns:
        A dict of ints: ``segments`` (count), ``reserved_bytes``, ``inactive_bytes``,
        ``runs`` (count), ``run_bytes``, ``largest_run``, ``whole_segment_runs`` (count)
        and ``whole_segment_bytes`` (the seed's rule, for comparison).
    """
    segs = load_snapshot(segments)["segments"]
    nested = nested_in(segs)
    outer = [s for i, s in enumerate(segs) if i not in nested]
    reserved = sum(s["total_size"] for s in outer)
    runs = find_free_runs(segs, "runs")
    whole = find_free_runs(segs, "whole_segments")
    return {
        "segments": len(segs),
        "reserved_bytes": reserved,
        "inactive_bytes": sum(n for _, n in runs),
        "runs": len(runs),
        "run_bytes": sum(n for _, n in runs),
        "largest_run": runs[0][1] if runs else 0,
        "whole_segment_runs": len(whole),
        "whole_segment_bytes": sum(n for _, n in whole),
    }


def runs_total(runs: Iterable[tuple[int, int]]) -> int:
    """Total size of some runs.

    Args:
        runs: ``(address, nbytes)`` pairs, as :func:`find_free_runs` returns them.

    Returns:
        The sum of their sizes, in bytes.
    """
    return sum(n for _, n in runs)
