"""The caching allocator's size rules, shared by capacity queries and the simulator.

Values and rules follow PyTorch's CUDACachingAllocator with its default configuration.
"""

KB = 1024
MB = 1024 * KB
GB = 1024 * MB

MIN_BLOCK_SIZE = 512  # every request is rounded up to a multiple of this
SMALL_SIZE = 1 * MB  # requests up to this go to the small pool
SMALL_BUFFER = 2 * MB  # segment size for small requests
MIN_LARGE_ALLOC = 10 * MB  # below this a large request gets a LARGE_BUFFER segment
LARGE_BUFFER = 20 * MB
ROUND_LARGE = 2 * MB  # larger segments are rounded to a multiple of this


def round_size(nbytes: int) -> int:
    """Block size the allocator hands out for a request of ``nbytes``."""
    if nbytes < MIN_BLOCK_SIZE:
        return MIN_BLOCK_SIZE
    return MIN_BLOCK_SIZE * -(-nbytes // MIN_BLOCK_SIZE)


def is_small(size: int) -> bool:
    return size <= SMALL_SIZE


def allocation_size(size: int) -> int:
    """Segment size requested from cudaMalloc (or a pluggable allocator) for a rounded block."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * -(-size // ROUND_LARGE)


def mib(nbytes: float) -> float:
    return nbytes / MB
