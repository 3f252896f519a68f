# C types for the allocator's data model, read by Cython only (see compiled.py and caching.pxd).
#
# Sizes and counters fit in 64 bits; addresses, streams and free-list keys (size << 64 | ptr)
# stay Python ints. Every class declared here must list exactly the fields of its __slots__
# in blocks.py, and every method exactly the arguments of its definition
# (tests/allocator/test_compiled_model.py checks).


cdef class Segment:
    cdef public object address, size, stream, pool, head
    cdef public bint expandable
    cdef public long long page_size


cdef class Block:
    cdef public long long size, requested_size, event_count, gc_base
    cdef public bint allocated, mapped
    cdef public object ptr, stream, prev, next, pool, stream_uses, segment, key


cpdef void init_block(Block block, object ptr, long long size, object stream, object pool, object segment, object prev,
                      object next)
cpdef Block new_block(object ptr, long long size, object stream, object pool, object segment, object prev, object next)


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
