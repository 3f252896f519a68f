"""Which bytes of a graph pool the captured graphs write when they are replayed.

A borrowed tensor that outlives its step is safe only where no replay writes; the simulated
device records each captured kernel's output ranges (``graph.written_ranges()``), so these
helpers can say how much of a span a replay overwrites before anything runs.
"""

from __future__ import annotations

from typing import Iterable, Optional

__all__ = ["merged_writes", "overlap_bytes", "covered_fraction"]


def merged_writes(graphs: Iterable) -> list[tuple[int, int]]:
    """The union of every graph's written ranges, as sorted, disjoint ``(address, nbytes)``.

    Args:
        graphs: captured graphs of the simulated device (each has ``written_ranges()``).
    """
    merged: list[list[int]] = []
    for a, n in sorted(r for g in graphs for r in g.written_ranges()):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], a + n)
        else:
            merged.append([a, a + n])
    return [(a, b - a) for a, b in merged]


def overlap_bytes(spans: Iterable[tuple[int, int]], ranges: Iterable[tuple[int, int]]) -> int:
    """Bytes the ``(address, nbytes)`` spans share with ``ranges`` (count each byte once:
    pass disjoint ``ranges``, e.g. from :func:`merged_writes`)."""
    ranges = list(ranges)
    return sum(max(0, min(a + n, b + m) - max(a, b)) for a, n in spans for b, m in ranges)


def covered_fraction(span: tuple[int, int], graphs: Iterable) -> Optional[float]:
    """Fraction of ``span``'s bytes that a replay of some graph in ``graphs`` writes.

    Args:
        span: ``(address, nbytes)``, e.g. an escaped borrowed tensor.
        graphs: captured graphs of the simulated device.

    Returns:
        The fraction, or None for a span of no bytes (nothing to cover).
    """
    if span[1] == 0:
        return None
    return overlap_bytes([span], merged_writes(graphs)) / span[1]
