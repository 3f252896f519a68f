# C types for the allocator's statistics, read by Cython only (see compiled.py and caching.pxd).
#
# Every class declared here must list exactly the fields of its __slots__ in stats.py, and
# every function exactly the arguments of its definition (tests/allocator/test_compiled_model.py).

cimport cython


@cython.final
cdef class Stat:
    cdef public long long current, peak, allocated, freed

    cpdef void increase(self, long long amount)
    cpdef void decrease(self, long long amount)


@cython.final
cdef class StatArray:
    cdef public Stat aggregate, small_pool, large_pool


cpdef void update_stat_array(StatArray stat_array, bint is_small, long long amount)


@cython.final
cdef class DeviceStats:
    cdef public StatArray allocation, segment, active, inactive_split
    cdef public StatArray allocated_bytes, reserved_bytes, active_bytes, inactive_split_bytes, requested_bytes
    cdef public Stat oversize_allocations, oversize_segments
    cdef public long long num_alloc_retries, num_ooms, num_sync_all_streams, num_device_alloc, num_device_free
    cdef public object max_split_size
