"""The simulated caching allocator, rule by rule (torch's CUDACachingAllocator behaviour)."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphborrow.allocator.blocks import FreeList
from graphborrow.allocator.caching import CachingAllocator
from graphborrow.allocator.replay_support import block_at
from graphborrow.allocator.config import AllocatorConfig
from graphborrow.allocator.memory import PhysicalMemory
from graphborrow.allocator.streams import Clockwork, Event
from graphborrow.core.sizes import allocation_size as get_allocation_size
from graphborrow.core.sizes import format_size, round_size
from graphborrow.core.sizes import (
    roundup_power2_next_division as _roundup_power2_next_division,
)

KiB, MiB, GiB = 2**10, 2**20, 2**30


def make(capacity=80 * GiB, backed=False, config=None):
    clockwork = Clockwork()
    return CachingAllocator(PhysicalMemory(capacity=capacity, backed=backed), clockwork, config), clockwork


def states(alloc, pool_id=None):
    return [[(b["size"], b["state"]) for b in s["blocks"]] for s in alloc.snapshot(pool_id)]


def stat(alloc, key):
    return alloc.memory_stats()[key]


# ----------------------------------------------------------------------------- sizes


@pytest.mark.parametrize("n, rounded", [(1, 512), (511, 512), (512, 512), (513, 1024), (4096, 4096), (1000001, 1000448)])
def test_round_size_multiples_of_512(n, rounded):
    assert round_size(n) == rounded


def test_roundup_power2_divisions():
    config = AllocatorConfig({"roundup_power2_divisions": 4})
    assert _roundup_power2_next_division(1200, 4) == 1280  # 1024 + one quarter step of 256
    assert round_size(1200, config.divisions) == 1536  # n <= 512 * 4: plain 512 rounding
    assert round_size(5000, config.divisions) == 5120  # 4096 + one step of 1024
    assert round_size(8192, config.divisions) == 8192  # powers of two stay
    assert round_size(3 * MiB + 1, config.divisions) == 3 * MiB + 512 * KiB
    per_interval = AllocatorConfig("roundup_power2_divisions:[1:4,>:8]")
    assert per_interval.roundup_power2_divisions[:3] == (4, 8, 8)
    assert round_size(2 * MiB + 1, per_interval.divisions) == 2 * MiB + 256 * KiB  # 2 MiB interval uses 8 divisions
    with pytest.raises(ValueError, match="power of two"):
        AllocatorConfig({"roundup_power2_divisions": 3})


@pytest.mark.parametrize(
    "size, segment",
    [(512, 2 * MiB), (MiB, 2 * MiB), (MiB + 512, 20 * MiB), (10 * MiB - 512, 20 * MiB),
     (10 * MiB, 10 * MiB), (11 * MiB + 512, 12 * MiB)],
)
def test_segment_sizes(size, segment):
    assert get_allocation_size(size) == segment


def test_format_size_like_torch():
    assert format_size(1024) == "1024 bytes"
    assert format_size(2 * MiB) == "2.00 MiB"
    assert format_size(3 * GiB // 2) == "1.50 GiB"


# ----------------------------------------------------------------------------- split and merge


def test_first_allocation_cuts_a_new_segment_at_its_low_end():
    alloc, _ = make()
    block = alloc.malloc(4 * KiB, 0)
    [segment] = alloc.snapshot()
    assert segment["address"] == block.ptr and segment["total_size"] == 2 * MiB
    assert states(alloc) == [[(4 * KiB, "active_allocated"), (2 * MiB - 4 * KiB, "inactive")]]
    assert segment["segment_type"] == "small" and segment["segment_pool_id"] == (0, 0)


def test_split_keeps_the_old_block_object_as_remainder():
    alloc, _ = make()
    first = alloc.malloc(4 * KiB, 0)
    remainder = first.next
    old_ptr = remainder.ptr
    second = alloc.malloc(8 * KiB, 0)
    assert second.ptr == old_ptr and second.next is remainder
    assert remainder.ptr == old_ptr + 8 * KiB and remainder.requested_size == 0  # stale, never set


def test_large_split_needs_strictly_more_than_1mib_remaining():
    alloc, _ = make()
    whole = alloc.malloc(19 * MiB, 0)  # 20 MiB segment, exactly 1 MiB would remain
    assert whole.size == 20 * MiB and whole.next is None
    assert stat(alloc, "allocated_bytes.all.current") == 20 * MiB
    alloc2, _ = make()
    split = alloc2.malloc(19 * MiB - 512, 0)  # 1 MiB + 512 remains
    assert split.size == 19 * MiB - 512 and split.next.size == MiB + 512


def test_small_split_needs_at_least_512_remaining():
    alloc, _ = make()
    alloc.malloc(MiB, 0)
    tail = alloc.malloc(MiB - 512, 0)  # exactly 512 remains: split
    assert tail.next is not None and tail.next.size == 512
    last = alloc.malloc(512, 0)  # nothing remains: the whole block
    assert last.next is None and states(alloc)[0][-1] == (512, "active_allocated")


def test_free_merges_with_both_free_neighbours():
    alloc, _ = make()
    a, b, c = (alloc.malloc(4 * KiB, 0) for _ in range(3))
    alloc.free(a)
    alloc.free(c)  # merges with the free tail
    assert states(alloc)[0][:2] == [(4 * KiB, "inactive"), (4 * KiB, "active_allocated")]
    assert len(states(alloc)[0]) == 3
    alloc.free(b)
    assert states(alloc) == [[(2 * MiB, "inactive")]]
    assert stat(alloc, "inactive_split.all.current") == 0


def test_best_fit_smallest_block_lowest_address_single_candidate():
    alloc, _ = make()
    blocks = [alloc.malloc(size, 0) for size in (8 * KiB, 4 * KiB, 4 * KiB, 4 * KiB, 4 * KiB)]
    ptrs = [b.ptr for b in blocks]  # freed Block objects may move (a split keeps them as remainder)
    alloc.free(blocks[0])  # 8 KiB hole at the start
    alloc.free(blocks[2])  # 4 KiB hole
    chosen = alloc.malloc(4 * KiB, 0)
    assert chosen.ptr == ptrs[2]  # the smallest fitting hole, not the lower 8 KiB one
    alloc.free(blocks[4])  # now merges with the tail
    again = alloc.malloc(4 * KiB, 0)
    assert again.ptr == ptrs[0]  # 8 KiB hole is smaller than the big tail


def test_blocks_are_reused_only_on_their_stream():
    alloc, clockwork = make()
    side = clockwork.new_stream()
    block = alloc.malloc(4 * KiB, side.id)
    ptr = block.ptr
    alloc.free(block)
    other = alloc.malloc(4 * KiB, 0)
    assert other.segment is not block.segment  # a new segment for stream 0
    assert len(alloc.snapshot()) == 2
    same = alloc.malloc(4 * KiB, side.id)
    assert same.ptr == ptr


# ----------------------------------------------------------------------------- private pools


def test_routing_is_lifo_and_strict():
    alloc, _ = make()
    p1, p2 = alloc.new_pool_id("handle"), alloc.new_pool_id("graph")
    assert p1 == (0, 1) and p2 == (1, 0)
    default_block = alloc.malloc(4 * KiB, 0)
    default_ptr = default_block.ptr
    alloc.free(default_block)
    alloc.begin_allocate_to_pool(p1, lambda s, t: True)
    alloc.begin_allocate_to_pool(p2, lambda s, t: True)
    in_p2 = alloc.malloc(4 * KiB, 0)
    alloc.end_allocate_to_pool(p2)
    in_p1 = alloc.malloc(4 * KiB, 0)
    alloc.end_allocate_to_pool(p1)
    assert in_p2.pool.owner.id == p2 and in_p1.pool.owner.id == p1
    # never the default pool's cached block, and three separate segments
    assert default_ptr not in (in_p1.ptr, in_p2.ptr)
    assert {s["segment_pool_id"] for s in alloc.snapshot()} == {(0, 0), p1, p2}
    alloc.free(in_p1)
    plain = alloc.malloc(4 * KiB, 0)
    assert plain.pool.owner is None and plain.ptr == default_ptr  # private blocks are not borrowed
    assert len(alloc.snapshot(p1)) == 1 and alloc.snapshot(p1)[0]["segment_pool_id"] == p1


def test_routing_to_the_same_pool_twice_is_an_error():
    alloc, _ = make()
    pool = alloc.new_pool_id()
    alloc.begin_allocate_to_pool(pool, lambda s, t: True)
    with pytest.raises(RuntimeError, match="already recording"):
        alloc.begin_allocate_to_pool(pool, lambda s, t: True)
    with pytest.raises(RuntimeError, match="not currently recording"):
        alloc.end_allocate_to_pool((0, 99))


def test_use_mem_pool_routes_by_thread_not_stream():
    alloc, clockwork = make()
    pool = alloc.new_pool_id()
    me = threading.get_ident()
    alloc.begin_allocate_to_pool(pool, lambda stream, thread: thread == me)
    side = clockwork.new_stream()
    mine = alloc.malloc(4 * KiB, side.id)  # any stream of this thread
    others = alloc.malloc(4 * KiB, 0, thread=me + 1)
    alloc.end_allocate_to_pool(pool)
    alloc.release_pool(pool)
    assert mine.pool.owner.id == pool and others.pool.owner is None


def test_graph_capture_routes_by_stream():
    alloc, clockwork = make()
    capture_stream = clockwork.new_stream()
    pool = alloc.new_pool_id("graph")
    alloc.begin_allocate_to_pool(pool, lambda stream, thread: stream == capture_stream.id)
    captured = alloc.malloc(4 * KiB, capture_stream.id)
    eager = alloc.malloc(4 * KiB, 0)
    alloc.end_allocate_to_pool(pool)
    assert captured.pool.owner.id == pool and eager.pool.owner is None


def test_released_pool_cannot_be_reentered_and_empty_cache_frees_it():
    alloc, _ = make()
    pool = alloc.new_pool_id()
    alloc.begin_allocate_to_pool(pool, lambda s, t: True)
    block = alloc.malloc(4 * KiB, 0)
    alloc.end_allocate_to_pool(pool)
    alloc.free(block)
    alloc.empty_cache()
    assert len(alloc.snapshot()) == 1  # use_count 1: never released
    alloc.release_pool(pool)
    with pytest.raises(RuntimeError, match="cannot be used again"):
        alloc.begin_allocate_to_pool(pool, lambda s, t: True)
    alloc.empty_cache()
    assert alloc.snapshot() == [] and pool not in alloc.graph_pools
    assert stat(alloc, "reserved_bytes.all.current") == 0


def test_empty_cache_releases_only_whole_free_segments():
    alloc, _ = make()
    kept = alloc.malloc(4 * KiB, 0)
    loose = alloc.malloc(30 * MiB, 0)
    alloc.free(loose)
    alloc.empty_cache()
    assert [s["total_size"] for s in alloc.snapshot()] == [2 * MiB]  # the split small segment stays
    assert stat(alloc, "num_device_free") == 1
    alloc.free(kept)
    alloc.empty_cache()
    assert alloc.snapshot() == []


def test_empty_cache_skips_default_pool_while_routing():
    alloc, _ = make()
    alloc.free(alloc.malloc(4 * KiB, 0))
    pool = alloc.new_pool_id()
    alloc.begin_allocate_to_pool(pool, lambda s, t: True)
    alloc.empty_cache()
    alloc.end_allocate_to_pool(pool)
    assert len(alloc.snapshot()) == 1
    alloc.release_pool(pool)


def test_pluggable_pool_gets_segment_sizes_and_frees_on_release():
    alloc, _ = make()
    calls = []

    class Bump:
        cursor = 0x1000_0000

        def raw_alloc(self, nbytes, stream):
            calls.append(("alloc", nbytes))
            address, self.cursor = self.cursor, self.cursor + nbytes
            return address

        def raw_delete(self, address, nbytes, stream):
            calls.append(("delete", address, nbytes))

    pool = alloc.new_pool_id()
    alloc.create_or_incref_pool(pool, allocator=Bump())
    alloc.begin_allocate_to_pool(pool, lambda s, t: True)
    block = alloc.malloc(3 * MiB, 0)
    alloc.end_allocate_to_pool(pool)
    alloc.release_pool(pool)  # use_mem_pool's exit
    assert calls == [("alloc", 20 * MiB)] and block.ptr == 0x1000_0000
    alloc.release_pool(pool)  # the MemPool itself goes away
    assert alloc.memory.used == 0  # no cudaMalloc
    alloc.free(block)
    alloc.empty_cache()
    assert calls[-1] == ("delete", 0x1000_0000, 20 * MiB)
    assert stat(alloc, "reserved_bytes.all.current") == 0


def test_use_on_oom_pool_lends_free_blocks_but_never_grows():
    alloc, _ = make(capacity=24 * MiB)
    pool = alloc.new_pool_id()
    alloc.create_or_incref_pool(pool, use_on_oom=True)
    alloc.begin_allocate_to_pool(pool, lambda s, t: True)
    alloc.free(alloc.malloc(8 * MiB, 0))  # a 20 MiB segment, free, in the pool
    alloc.end_allocate_to_pool(pool)
    lent = alloc.malloc(8 * MiB, 0)  # default pool cannot cudaMalloc 20 MiB more
    assert lent.pool.owner.id == pool and lent.next.pool is lent.pool
    with pytest.raises(torch.OutOfMemoryError):
        alloc.malloc(16 * MiB, 0)  # the pool has only 12 MiB free: no fallback, no growth
    assert len(alloc.snapshot()) == 1


def test_no_split_pool_hands_out_whole_blocks():
    alloc, _ = make()
    pool = alloc.new_pool_id()
    alloc.create_or_incref_pool(pool, no_split=True)
    alloc.begin_allocate_to_pool(pool, lambda s, t: True)
    block = alloc.malloc(4 * KiB, 0)
    alloc.end_allocate_to_pool(pool)
    assert block.size == 2 * MiB and block.requested_size == 4 * KiB


# ----------------------------------------------------------------------------- streams and events


def test_streams_and_events():
    clockwork = Clockwork()
    side = clockwork.new_stream()
    assert side.id == 1 and clockwork.default_stream.id == 0
    side.enqueue(10.0)
    event = Event()
    event.record(side)
    assert not side.query() and not event.query()
    clockwork.advance(4.0)
    assert not event.query()
    event.synchronize()
    assert event.query() and side.query() and clockwork.now_us == 10.0
    side.enqueue(5.0)
    clockwork.synchronize()
    assert side.query() and clockwork.now_us == 15.0


def test_record_stream_keeps_block_pending_until_event_completes():
    alloc, clockwork = make()
    side = clockwork.new_stream()
    block = alloc.malloc(4 * MiB, 0)
    side.enqueue(100.0)
    alloc.record_stream(block, side.id)
    alloc.record_stream(block, 0)  # the allocation stream: ignored
    alloc.record_history()
    alloc.free(block)
    assert states(alloc) == [[(4 * MiB, "active_pending_free"), (16 * MiB, "inactive")]]
    assert stat(alloc, "allocated_bytes.all.current") == 0
    assert stat(alloc, "active_bytes.all.current") == 4 * MiB
    alloc.malloc(512, 0)  # events processed, but the side stream is still busy
    assert states(alloc)[0][0] == (4 * MiB, "active_pending_free")
    clockwork.advance(100.0)
    alloc.malloc(512, 0)
    assert states(alloc)[0] == [(20 * MiB, "inactive")]
    assert stat(alloc, "active_bytes.all.current") == 1024
    actions = [e["action"] for e in alloc.full_snapshot()["device_traces"][0] if e["action"] != "snapshot"]
    assert actions[:2] == ["free_requested", "segment_alloc"]
    assert actions.index("free_completed") > actions.index("alloc")  # completed at the second malloc


def test_frees_during_capture_are_deferred_until_no_capture():
    alloc, clockwork = make()
    side = clockwork.new_stream()
    block = alloc.malloc(4 * KiB, 0)
    alloc.record_stream(block, side.id)
    pool = alloc.new_pool_id("graph")
    alloc.begin_allocate_to_pool(pool, lambda s, t: s == 99)
    captured_use = alloc.malloc(4 * KiB, 0)
    alloc.record_stream(captured_use, side.id)  # recorded during capture: dropped later
    alloc.free(block)
    alloc.free(captured_use)
    clockwork.advance(1.0)
    alloc.malloc(512, 0)  # capture underway: no event processing
    assert block.state == "active_pending_free" and captured_use.state == "active_pending_free"
    alloc.end_allocate_to_pool(pool)
    alloc.malloc(512, 0)  # events inserted now; side stream idle, so both complete
    assert block.state == "inactive" and captured_use.state == "inactive"


def test_empty_cache_syncs_pending_events():
    alloc, clockwork = make()
    side = clockwork.new_stream()
    block = alloc.malloc(30 * MiB, 0)
    side.enqueue(1e6)
    alloc.record_stream(block, side.id)
    alloc.free(block)
    alloc.empty_cache()
    assert alloc.snapshot() == [] and side.query()
    assert stat(alloc, "num_sync_all_streams") == 1


# ----------------------------------------------------------------------------- OOM and stats


def test_oom_message_and_retry():
    alloc, _ = make(capacity=50 * MiB)
    keep = alloc.malloc(15 * MiB, 0)  # a 16 MiB segment, handed out whole (1 MiB left is not > 1 MiB)
    alloc.free(alloc.malloc(15 * MiB, 0))  # a second one, cached
    big = alloc.malloc(25 * MiB, 0)  # cudaMalloc of 26 MiB fails, cache flushed, retried
    assert stat(alloc, "num_alloc_retries") == 1 and big.size == 26 * MiB  # whole: 1 MiB left
    alloc.free(big)
    with pytest.raises(torch.OutOfMemoryError) as caught:
        alloc.malloc(35 * MiB, 0)
    assert str(caught.value).startswith(
        "CUDA out of memory. Tried to allocate 36.00 MiB. GPU 0 has a total capacity of 50.00 MiB of which "
        "34.00 MiB is free. "
    )
    assert "Of the allocated memory 16.00 MiB is allocated by PyTorch, and 0 bytes is reserved" in str(caught.value)
    assert stat(alloc, "num_ooms") == 1
    del keep


def test_no_flush_retry_while_routing():
    alloc, _ = make(capacity=40 * MiB)
    alloc.free(alloc.malloc(30 * MiB, 0))
    pool = alloc.new_pool_id()
    alloc.begin_allocate_to_pool(pool, lambda s, t: True)
    with pytest.raises(torch.OutOfMemoryError):
        alloc.malloc(12 * MiB, 0)
    alloc.end_allocate_to_pool(pool)
    assert stat(alloc, "num_alloc_retries") == 0
    alloc.begin_allocate_to_pool(pool, lambda s, t: True)
    alloc.end_allocate_to_pool(pool)


def test_stats_transitions_and_private_pools_count_everywhere():
    alloc, clockwork = make()
    side = clockwork.new_stream()
    block = alloc.malloc(3000, 0)
    assert stat(alloc, "allocated_bytes.small_pool.current") == 3072
    assert stat(alloc, "requested_bytes.all.current") == 3000
    assert stat(alloc, "reserved_bytes.all.current") == stat(alloc, "reserved_bytes.small_pool.current") == 2 * MiB
    side.enqueue(1.0)
    alloc.record_stream(block, side.id)
    alloc.free(block)
    assert (stat(alloc, "allocated_bytes.all.current"), stat(alloc, "active_bytes.all.current")) == (0, 3072)
    clockwork.advance(1.0)
    alloc.process_events()
    assert stat(alloc, "active_bytes.all.current") == 0 and stat(alloc, "requested_bytes.all.current") == 0
    assert stat(alloc, "allocated_bytes.all.peak") == 3072 and stat(alloc, "allocation.all.allocated") == 1
    pool = alloc.new_pool_id()
    alloc.begin_allocate_to_pool(pool, lambda s, t: True)
    alloc.malloc(5 * MiB, 0)
    alloc.end_allocate_to_pool(pool)
    assert stat(alloc, "reserved_bytes.large_pool.current") == 20 * MiB
    assert alloc.memory_reserved() == 22 * MiB and alloc.memory_allocated() == 5 * MiB
    alloc.reset_peak_memory_stats()
    assert stat(alloc, "allocated_bytes.all.peak") == 5 * MiB
    keys = alloc.memory_stats()
    assert list(keys) == sorted(keys) and keys["max_split_size"] == -1 and "oversize_segments.current" in keys


def test_snapshot_and_trace_formats():
    alloc, _ = make()
    alloc.record_history(max_entries=3)
    block = alloc.malloc(100, 0)
    alloc.free(block)
    full = alloc.full_snapshot()
    assert set(full) == {"segments", "device_traces", "allocator_settings", "external_annotations"}
    segment = full["segments"][0]
    assert set(segment) == {
        "device", "address", "total_size", "allocated_size", "active_size", "requested_size", "stream",
        "segment_type", "segment_pool_id", "is_expandable", "frames", "blocks",
    }
    assert set(segment["blocks"][0]) == {"address", "size", "requested_size", "state", "frames"}
    trace = full["device_traces"][0]
    assert [e["action"] for e in trace] == ["free_requested", "free_completed", "snapshot"]  # ring of 3
    assert set(trace[0]) == {"action", "addr", "size", "stream", "time_us", "compile_context", "user_metadata"}
    assert trace[0]["size"] == 100 and trace[0]["addr"] == block.ptr
    assert full["allocator_settings"]["roundup_power2_divisions"]["1"] == 0


def test_bad_input_is_named():
    alloc, _ = make()
    with pytest.raises(ValueError, match="positive"):
        alloc.malloc(0, 0)
    block = alloc.malloc(10, 0)
    alloc.free(block)
    with pytest.raises(ValueError, match="double free"):
        alloc.free(block)
    with pytest.raises(ValueError, match="not allocated"):
        alloc.free(None)  # the compiled model types its argument; None must not reach it
    with pytest.raises(ValueError, match="True or False"):
        AllocatorConfig("graph_capture_record_stream_reuse:on")
    with pytest.raises(ValueError, match="True or False"):
        AllocatorConfig("expandable_segments:yes")
    with pytest.raises(ValueError, match="unknown allocator option"):
        AllocatorConfig({"max_split": 3})
    with pytest.raises(ValueError, match="default pool"):
        alloc.create_or_incref_pool((0, 0))


def test_max_split_size_keeps_oversize_blocks_whole():
    alloc, _ = make(config="max_split_size_mb:40")
    big = alloc.malloc(50 * MiB, 0)
    alloc.free(big)
    small = alloc.malloc(12 * MiB, 0)  # may not take the 50 MiB oversize block
    assert small.segment is not big.segment
    assert stat(alloc, "oversize_segments.current") == 1


# ----------------------------------------------------------------------------- physical memory


def test_physical_memory_addresses_capacity_and_views():
    memory = PhysicalMemory(capacity=8 * MiB, backed=True)
    a = memory.cuda_malloc(2 * MiB)
    b = memory.cuda_malloc(3 * MiB)
    assert a == memory.base and b == a + 2 * MiB and b % (2 * MiB) == 0
    assert memory.cuda_malloc(4 * MiB) == 0  # 2 + 4 + 4 > 8
    memory.cuda_free(a)
    assert memory.cuda_malloc(MiB) == a  # lowest gap that fits
    assert memory.mem_get_info() == (2 * MiB, 8 * MiB)
    view = memory.host_view(b + 10, 4)
    view[:] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    assert memory.host_view(b + 8, 8).tolist()[2:6] == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="inside one cudaMalloc"):
        memory.host_view(b + 3 * MiB, 8 * MiB)
    memory.expect_next_address(memory.base + 100 * MiB)
    memory.cuda_free(b)
    assert memory.cuda_malloc(MiB) == memory.base + 100 * MiB
    with pytest.raises(RuntimeError, match="backed=False"):
        PhysicalMemory(backed=False).host_view(0, 1)


# ----------------------------------------------------------------------------- property test


def _recount(alloc):
    """memory_stats' current values rebuilt from the snapshot alone."""
    segments = alloc.snapshot()
    reserved = sum(s["total_size"] for s in segments)
    allocated = sum(s["allocated_size"] for s in segments)
    active = sum(s["active_size"] for s in segments)
    return reserved, allocated, active


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(1, 25 * MiB), st.integers(0, 2), st.booleans()),
                max_size=60))
def test_random_sequences_keep_layout_and_stats_consistent(ops):
    alloc, clockwork = make()
    side = clockwork.new_stream()
    pool = alloc.new_pool_id()
    alloc.create_or_incref_pool(pool)
    live = []
    for op, size, choice, flag in ops:
        if op <= 1:
            routed = flag and choice == 2
            if routed:
                alloc.begin_allocate_to_pool(pool, lambda s, t: True)
            live.append(alloc.malloc(size, side.id if choice == 1 else 0))
            if routed:
                alloc.end_allocate_to_pool(pool)
        elif op == 2 and live:
            block = live.pop(size % len(live))
            if flag:
                side.enqueue(3.0)
                alloc.record_stream(block, side.id if block.stream == 0 else 0)
            alloc.free(block)
        elif op == 3:
            clockwork.advance(2.0)
        else:
            alloc.empty_cache()
        segments = alloc.snapshot()
        spans = sorted((s["address"], s["address"] + s["total_size"]) for s in segments)
        assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:])), "segments overlap"
        for s in segments:
            assert sum(b["size"] for b in s["blocks"]) == s["total_size"]
            ends = [b["address"] + b["size"] for b in s["blocks"]]
            assert [b["address"] for b in s["blocks"][1:]] == ends[:-1], "blocks overlap or leave gaps"
        reserved, allocated, active = _recount(alloc)
        assert reserved == alloc.memory_reserved() == alloc.total_allocated_memory
        assert allocated == alloc.memory_allocated()
        assert active == stat(alloc, "active_bytes.all.current")
        assert {b.ptr for b in live} <= {b["address"] for s in segments for b in s["blocks"]
                                          if b["state"] == "active_allocated"}


def test_block_at_finds_active_blocks_only():
    alloc, _ = make()
    a, b = alloc.malloc(1000, 0), alloc.malloc(3000, 0)
    assert block_at(alloc, a.ptr) is a and block_at(alloc, b.ptr) is b
    assert block_at(alloc, a.ptr + 512) is None  # inside a block, not its start
    alloc.record_stream(b, 1)
    alloc.clockwork.stream(1).enqueue(10.0)
    alloc.free(b)
    assert block_at(alloc, b.ptr) is b and b.state == "active_pending_free"
    alloc.free(a)
    assert block_at(alloc, a.ptr) is None


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 10**6), min_size=1, max_size=200, unique=True),
       st.lists(st.tuples(st.integers(0, 10**9), st.integers(1, 10**6), st.booleans()), max_size=200),
       st.integers(4, 16))
def test_free_list_rekeys_keep_the_sorted_list_valid(initial, rekeys, load):
    """Shrink and grow re-keys across many short runs (a small load factor) against a sorted reference."""
    free = FreeList()
    free.keys.set_load(load)  # short runs, so keys move within and across runs
    for key in initial:
        free.add(key, key)
    for pick, amount, grow in rekeys:
        old = sorted(free.blocks)[pick % len(free)]
        new = old + amount if grow else old - amount
        if new <= 0 or new in free.blocks:
            continue
        free.rekey(old, new, new)
        free.keys.check()  # SortedList's own invariants: order, run maxima, lengths, index
        assert list(free.keys) == sorted(free.blocks)
        assert all(free.blocks[key] == key for key in free.keys)
        probe = new - amount // 2
        assert free.best_fit(probe) == min(key for key in free.blocks if key >= probe)

