# C types for the allocator model's hot path, read by Cython only (see compiled.py).
#
# Python ignores this file and runs allocator.py as written. When Cython compiles
# allocator.py it reads these declarations beside it: the listed classes become
# extension types whose fields are C structs, and the listed locals become C
# integers, so a malloc+free pair runs a few times faster with the same behaviour.
# Sizes and counters fit in 64 bits; addresses, streams and free-list keys
# (size << 64 | ptr) stay Python ints.

cimport cython


cdef class StatCounters:
    cdef public long long allocation, allocation_peak, allocation_total, allocation_base
    cdef public long long segment, segment_peak, segment_total, segment_base
    cdef public long long active, active_peak, active_total, active_base
    cdef public long long inactive_split, inactive_split_peak, inactive_split_total, inactive_split_base
    cdef public long long allocated_bytes, allocated_bytes_peak, allocated_bytes_total, allocated_bytes_base
    cdef public long long reserved_bytes, reserved_bytes_peak, reserved_bytes_total, reserved_bytes_base
    cdef public long long active_bytes, active_bytes_peak, active_bytes_total, active_bytes_base
    cdef public long long inactive_split_bytes, inactive_split_bytes_peak, inactive_split_bytes_total, inactive_split_bytes_base
    cdef public long long requested_bytes, requested_bytes_peak, requested_bytes_total, requested_bytes_base


cdef class Segment:
    cdef public object address, size, stream, pool, head


cdef class Block:
    cdef public long long size, requested_size, event_count
    cdef public bint allocated
    cdef public object ptr, stream, prev, next, pool, stream_uses, segment, key


cdef class FreeList:
    cdef public object keys
    cdef public dict blocks

    cpdef add(self, key, block)
    cpdef remove(self, key)
    @cython.locals(maxes=list, run=list, pos=Py_ssize_t, idx=Py_ssize_t, blocks=dict)
    cpdef shrink_key(self, old, new, block)
    @cython.locals(maxes=list, run=list, pos=Py_ssize_t, idx=Py_ssize_t, blocks=dict)
    cpdef grow_key(self, old, new, block)


cdef class BlockPool:
    cdef public object is_small, owner, stats, other_stats, all_stats, counters, min_remainder
    cdef public dict free

    cpdef FreeList free_list(self, stream)


cdef class CachingAllocator:
    cdef public object memory, clockwork, config, device
    cdef public object _counters_all, _counters_by_kind, _stat_counters, _counters
    cdef public object _oversize_allocations, _oversize_segments
    cdef public object small_blocks, large_blocks, graph_pools, graph_pools_freeable, captures_underway
    cdef public object total_allocated_memory, _segments
    cdef public object _cuda_events, _deferred, _capture_stream_uses, _use_on_oom, _history
    cdef public object _next_capture_id, _next_mempool_id, _max_split, _default_rules

    @cython.locals(pool=BlockPool, free=FreeList, maxes=list, run=list, pos=Py_ssize_t)
    cpdef malloc(self, nbytes, stream=*, thread=*)
    @cython.locals(pool=BlockPool, kind=StatCounters, size="long long")
    cpdef free(self, Block block)
    @cython.locals(pool=BlockPool, remaining=Block, prev=Block, kind=StatCounters, other=StatCounters,
                   every=StatCounters, already_split=bint, remaining_size="long long", c="long long",
                   settled=bint)
    cpdef Block _alloc_found_block(self, Block block, FreeList free, long long orig, long long size)
    @cython.locals(pool=BlockPool, prev=Block, nxt=Block, kind=StatCounters, other=StatCounters,
                   every=StatCounters, net_blocks="long long", net_bytes="long long", c="long long",
                   original_size="long long", requested="long long", size="long long")
    cpdef _free_block(self, Block block)
