# C types for the allocator model's hot path, read by Cython only (see compiled.py).
#
# Python ignores this file and runs caching.py as written. When Cython compiles
# caching.py it reads these declarations beside it: the allocator becomes an extension
# type whose fields are C values, the listed locals become C integers, and the
# statistics and blocks it uses are the C types of stats.pxd and blocks.pxd, so a
# malloc+free pair runs a few times faster with the same behaviour.
#
# Every field declared here must be set in CachingAllocator.__init__ and every method
# must list exactly the arguments of its definition (tests/allocator/test_compiled_model.py).

cimport cython

from graphborrow.allocator.blocks cimport Block, BlockPool, FreeList, Segment
from graphborrow.allocator.stats cimport DeviceStats, Stat, StatArray, update_stat_array


cdef class CachingAllocator:
    cdef public object memory, clockwork, config, device, stats
    cdef public object small_blocks, large_blocks, graph_pools, graph_pools_freeable, captures_underway
    cdef public object use_on_oom_pools, total_allocated_memory, live_segments
    cdef public object cuda_events, _deferred, _capture_stream_uses, history
    cdef public object _next_capture_id, _next_mempool_id, stream_keys, _stream_plan
    cdef public object max_split, divisions, large_segment_size, allowed_memory_maximum
    cdef public bint expandable, gc_enabled, _fast, reuse_in_capture

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
