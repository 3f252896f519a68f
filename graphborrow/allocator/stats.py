"""Allocator statistics as torch keeps them: the numbers behind ``torch.cuda.memory_stats()``.

Each statistic is a :class:`Stat` (current, peak, sum of increases, sum of decreases); most
come as a :class:`StatArray`, one for the aggregate and one per pool kind (small, large),
changed only through :func:`update_stat_array`. :class:`DeviceStats` holds them all, as
torch's ``DeviceStats`` does.

Compiled by Cython with ``stats.pxd`` together with the allocator (see ``compiled.py``).
"""

from __future__ import annotations

__all__ = ["ARRAY_STATS", "COUNTERS", "DeviceStats", "Stat", "StatArray", "update_stat_array"]

ARRAY_STATS = (
    "allocation", "segment", "active", "inactive_split",
    "allocated_bytes", "reserved_bytes", "active_bytes", "inactive_split_bytes", "requested_bytes",
)
COUNTERS = ("num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc", "num_device_free")


class Stat:
    """One statistic as torch keeps it: current value, peak, sum of increases, sum of decreases."""

    __slots__ = ("current", "peak", "allocated", "freed")

    def __init__(self) -> None:
        self.current = 0
        self.peak = 0
        self.allocated = 0
        self.freed = 0

    def increase(self, amount: int) -> None:
        self.current += amount
        self.allocated += amount
        if self.current > self.peak:
            self.peak = self.current

    def decrease(self, amount: int) -> None:
        self.current -= amount
        self.freed += amount

    def reset_peak(self) -> None:
        self.peak = self.current

    def reset_accumulated(self) -> None:
        self.allocated = 0
        self.freed = 0

    def as_dict(self) -> dict[str, int]:
        return {"current": self.current, "peak": self.peak, "allocated": self.allocated, "freed": self.freed}


class StatArray:
    """A statistic for each of torch's stat types: ``all`` (aggregate), ``small_pool``, ``large_pool``."""

    __slots__ = ("aggregate", "small_pool", "large_pool")

    def __init__(self) -> None:
        self.aggregate = Stat()
        self.small_pool = Stat()
        self.large_pool = Stat()

    def by_type(self) -> dict[str, Stat]:
        return {"all": self.aggregate, "small_pool": self.small_pool, "large_pool": self.large_pool}


def update_stat_array(stat_array: StatArray, is_small: bool, amount: int) -> None:
    """Change one statistic by ``amount`` for the aggregate and for the block's pool kind.

    The only way the allocator changes a :class:`StatArray` (torch's
    ``for_each_selected_stat_type`` with the stat types of a pool).
    """
    kind = stat_array.small_pool if is_small else stat_array.large_pool
    if amount >= 0:
        stat_array.aggregate.increase(amount)
        kind.increase(amount)
    else:
        stat_array.aggregate.decrease(-amount)
        kind.decrease(-amount)


class DeviceStats:
    """torch's ``DeviceStats``: the statistics behind ``memory_stats()``."""

    __slots__ = (*ARRAY_STATS, "oversize_allocations", "oversize_segments", *COUNTERS, "max_split_size")

    def __init__(self, max_split_size: int) -> None:
        self.allocation = StatArray()
        self.segment = StatArray()
        self.active = StatArray()
        self.inactive_split = StatArray()
        self.allocated_bytes = StatArray()
        self.reserved_bytes = StatArray()
        self.active_bytes = StatArray()
        self.inactive_split_bytes = StatArray()
        self.requested_bytes = StatArray()
        self.oversize_allocations = Stat()
        self.oversize_segments = Stat()
        self.num_alloc_retries = 0
        self.num_ooms = 0
        self.num_sync_all_streams = 0
        self.num_device_alloc = 0
        self.num_device_free = 0
        self.max_split_size = max_split_size

    def arrays(self) -> dict[str, StatArray]:
        return {name: getattr(self, name) for name in ARRAY_STATS}

    def as_dict(self) -> dict[str, int]:
        """Flat, sorted keys such as ``reserved_bytes.all.current``, as ``torch.cuda.memory_stats()``."""
        flat: dict[str, int] = {}
        for name, stat_array in self.arrays().items():
            for stat_type, stat in stat_array.by_type().items():
                for field, value in stat.as_dict().items():
                    flat[f"{name}.{stat_type}.{field}"] = value
        for name in ("oversize_allocations", "oversize_segments"):
            for field, value in getattr(self, name).as_dict().items():
                flat[f"{name}.{field}"] = value
        for name in COUNTERS:
            flat[name] = getattr(self, name)
        flat["max_split_size"] = _as_int64(self.max_split_size)
        return dict(sorted(flat.items()))

    def every_stat(self) -> list[Stat]:
        stats = [stat for stat_array in self.arrays().values() for stat in stat_array.by_type().values()]
        return stats + [self.oversize_allocations, self.oversize_segments]

    def reset_peak(self) -> None:
        for stat in self.every_stat():
            stat.reset_peak()

    def reset_accumulated(self) -> None:
        for stat in self.every_stat():
            stat.reset_accumulated()
        for name in COUNTERS:
            setattr(self, name, 0)


def _as_int64(n: int) -> int:
    """torch reports max_split_size as an int64: its unlimited value (SIZE_MAX) reads -1."""
    return n - 2**64 if n >= 2**63 else n
