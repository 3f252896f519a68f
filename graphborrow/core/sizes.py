"""The caching allocator's size rules, stated once: capacity queries and the simulator import them.

Values and rules follow PyTorch's CUDACachingAllocator (``c10/cuda/CUDACachingAllocator.cpp``
and ``c10/core/AllocatorConfig.h``). The rounding depends on one setting,
``roundup_power2_divisions``, passed as its 16-entry table (one entry per power-of-two
interval from 1 MiB up; ``None`` or all zeros is torch's default, plain 512-byte rounding).
The large-segment size is a setting too (``large_segment_size_mb`` in newer torch).
"""

from __future__ import annotations

import dataclasses

__all__ = [
    "KB", "MB", "GB",
    "MIN_BLOCK_SIZE", "SMALL_SIZE", "SMALL_BUFFER", "MIN_LARGE_ALLOC", "LARGE_BUFFER", "ROUND_LARGE",
    "ROUNDUP_INTERVALS",
    "round_size", "roundup_power2_next_division", "divisions_index", "is_small", "allocation_size",
    "expandable_page_size", "format_size", "mib", "short_size", "SizeClass", "size_class",
]

KB = 1024
MB = 1024 * KB
GB = 1024 * MB

MIN_BLOCK_SIZE = 512  # every request is rounded up to a multiple of this
SMALL_SIZE = 1 * MB  # requests up to this go to the small pool
SMALL_BUFFER = 2 * MB  # segment size for small requests (and an expandable small pool's page)
MIN_LARGE_ALLOC = 10 * MB  # below this a large request gets a large-buffer segment
LARGE_BUFFER = 20 * MB  # the default large-buffer segment (and an expandable large pool's page)
ROUND_LARGE = 2 * MB  # larger segments are rounded to a multiple of this
ROUNDUP_INTERVALS = 16  # roundup_power2_divisions entries: [1, 2), [2, 4), ... MiB, the last open-ended


def divisions_index(nbytes: int) -> int:
    """Which entry of the roundup_power2_divisions table applies to a request of ``nbytes``."""
    return min(max(nbytes.bit_length() - 21, 0), ROUNDUP_INTERVALS - 1)


def roundup_power2_next_division(nbytes: int, divisions: int) -> int:
    """``nbytes`` rounded up to the next of ``divisions`` equal steps between two powers of two.

    For example 1200 with 4 divisions lies between 1024 and 2048, whose steps are 1024,
    1280, 1536 and 1792: the result is 1280.
    """
    if nbytes & (nbytes - 1) == 0:
        return nbytes
    floor = 1 << (nbytes.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    rounded = nbytes & ~(step - 1)
    return nbytes if rounded == nbytes else rounded + step


def round_size(nbytes: int, divisions=None) -> int:
    """The block size the allocator hands out for a request of ``nbytes``.

    Args:
        nbytes: the request.
        divisions: the roundup_power2_divisions table (16 ints), or None for torch's default.
    """
    if nbytes < MIN_BLOCK_SIZE:
        return MIN_BLOCK_SIZE
    if divisions is not None:
        d = divisions[divisions_index(nbytes)]
        if d > 1 and nbytes > MIN_BLOCK_SIZE * d:
            return roundup_power2_next_division(nbytes, d)
    return MIN_BLOCK_SIZE * ((nbytes + MIN_BLOCK_SIZE - 1) // MIN_BLOCK_SIZE)


def is_small(size: int) -> bool:
    """Whether a rounded block of ``size`` bytes belongs to the small pool."""
    return size <= SMALL_SIZE


def allocation_size(size: int, large_segment_size: int = LARGE_BUFFER) -> int:
    """Segment size requested from cudaMalloc (or a pluggable allocator) for a rounded block."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return large_segment_size
    return ROUND_LARGE * ((size + ROUND_LARGE - 1) // ROUND_LARGE)


def expandable_page_size(small: bool, large_segment_size: int = LARGE_BUFFER) -> int:
    """The physical page an expandable segment maps at a time: 2 MiB (small pool) or the large segment size."""
    return SMALL_BUFFER if small else large_segment_size


def format_size(nbytes: int) -> str:
    """Sizes as torch prints them in OOM messages."""
    if nbytes <= 1024:
        return f"{nbytes} bytes"
    if nbytes <= MB:
        return f"{nbytes / 1024:.2f} KiB"
    if nbytes <= GB:
        return f"{nbytes / MB:.2f} MiB"
    return f"{nbytes / GB:.2f} GiB"


def short_size(nbytes: int) -> str:
    """Sizes in the planner's reasons: MiB with one decimal, KiB below a tenth of one, bytes
    below one KiB."""
    if nbytes < 1024:
        return f"{nbytes} B"
    return f"{nbytes / MB:.1f} MiB" if nbytes >= MB / 10 else f"{nbytes / 1024:.1f} KiB"


def mib(nbytes: float) -> float:
    return nbytes / MB


@dataclasses.dataclass(frozen=True)
class SizeClass:
    """How the caching allocator places one request of ``nbytes``."""

    name: str            # "small", "medium" or "large"
    nbytes: int          # the request
    block_bytes: int     # the block it gets (512-byte rounded)
    segment_bytes: int   # the segment a new one takes from the pool's allocator

    def describe(self) -> str:
        """How a request of this class is served, for failure reasons.

        Returns:
            One phrase: the class, its size range and the block or segment it takes.
        """
        if self.name == "small":
            return "small (up to 1 MiB): a block of a 2 MiB small-pool segment"
        if self.name == "medium":
            return ("medium (1-10 MiB): a cached large block, or a whole new 20 MiB segment")
        return (f"large (10 MiB and more): a cached large block, or a new segment of its size rounded up "
                f"to 2 MiB ({short_size(self.segment_bytes)})")


def size_class(nbytes: int) -> SizeClass:
    """The allocator's size class of a request (default configuration).

    Args:
        nbytes: the request in bytes.

    Returns:
        Its :class:`SizeClass`: small (<= 1 MiB), medium (< 10 MiB) or large.
    """
    block = round_size(nbytes)
    if block <= SMALL_SIZE:
        name = "small"
    elif block < MIN_LARGE_ALLOC:
        name = "medium"
    else:
        name = "large"
    return SizeClass(name, nbytes, block, allocation_size(block))
