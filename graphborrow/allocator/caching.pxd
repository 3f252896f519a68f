# C types for the allocator model's hot path, read by Cython only (see compiled.py).
#
# Python ignores this file and runs caching.py as written. When Cython compiles
# caching.py it reads these declarations beside it: the listed classes become
# extension types whose fields are C structs, and the listed locals become C
# integers, so a malloc+free pair runs a few times faster with the same behaviour.
# Sizes and counters fit in 64 bits; addresses, streams and free-list keys
# (size << 64 | ptr) stay Python ints.
#
# Every class declared here must list exactly the fields of its __slots__ in
# caching.py (tests/allocator/test_sim_compiled.py checks), and every function exactly the
# arguments of its definition.

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


cdef class Segment:
    cdef public object address, size, stream, pool, head
    cdef public bint expandable
    cdef public long long page_size


cdef class Block:
    cdef public long long size, requested_size, event_count, gc_base
    cdef public bint allocated, mapped
    cdef public object ptr, stream, prev, next, pool, stream_uses, segment, key


cdef class FreeList:
    cdef public object keys
    cdef public dict blocks

    cpdef add(self, key, block)
    cpdef remove(self, key)
    cpdef rekey(self, old, new, block)
    cpdef best_fit(self, probe)
    cpdef successor(self, block)


cdef class BlockPool:
    cdef public bint is_small, expandable, no_split
    cdef public object owner
    cdef public dict free, unmapped, order
    cdef public long long gc_calls

    cpdef FreeList free_list(self, stream)


cdef class CachingAllocator:
    cdef public object memory, clockwork, config, device, stats
    cdef public object small_blocks, large_blocks, graph_pools, graph_pools_freeable, captures_underway
    cdef public object use_on_oom_pools, total_allocated_memory, _segments
    cdef public object _cuda_events, _deferred, _capture_stream_uses, _history
    cdef public object _next_capture_id, _next_mempool_id, stream_keys, _stream_plan
    cdef public object max_split, divisions, large_segment_size, allowed_memory_maximum
    cdef public bint expandable, gc_enabled, _fast

    @cython.locals(pool=BlockPool, free=FreeList, size="long long")
    cpdef malloc(self, nbytes, stream=*, thread=*)
    @cython.locals(stats=DeviceStats, small=bint, size="long long")
    cpdef free(self, Block block)
    @cython.locals(pool=BlockPool, remaining="long long")
    cpdef bint _should_split(self, Block block, long long size, bint es_active)
    @cython.locals(pool=BlockPool, remaining=Block, prev=Block, stats=DeviceStats, small=bint, expandable=bint,
                   already_split=bint, remaining_size="long long")
    cpdef Block _alloc_found_block(self, Block block, FreeList free, long long orig, long long size, bint es_active)
    @cython.locals(pool=BlockPool, prev=Block, nxt=Block, stats=DeviceStats, small=bint, net_blocks="long long",
                   net_bytes="long long", original_size="long long", requested="long long", size="long long")
    cpdef _free_block(self, Block block)
