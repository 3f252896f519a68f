"""Allocator settings, rule by rule, with outcomes worked out by hand from torch's allocator source.

Expandable segments (map / unmap of pages in one growing virtual segment per stream and
pool), max_split_size with the oversize rules and max_non_split_rounding_mb,
roundup_power2_divisions per interval (parsed per torch version), and
garbage_collection_threshold under a per-process memory fraction.
"""

from __future__ import annotations

import pytest
import torch

from graphborrow.allocator.caching import CachingAllocator
from graphborrow.allocator.config import AllocatorConfig
from graphborrow.allocator.memory import PhysicalMemory
from graphborrow.allocator.streams import Clockwork
from graphborrow.core.sizes import round_size

KiB, MiB, GiB = 2**10, 2**20, 2**30


def make(config=None, capacity=GiB):
    alloc = CachingAllocator(PhysicalMemory(capacity=capacity, backed=False), Clockwork(), config)
    alloc.record_history()
    return alloc


def layout(alloc, pool_id=None):
    return [(s["address"], s["is_expandable"], [(b["size"], b["state"]) for b in s["blocks"]])
            for s in alloc.snapshot(pool_id)]


def trace(alloc, *actions):
    return [(e["action"], e["addr"], e["size"]) for e in alloc.full_snapshot()["device_traces"][0]
            if e["action"] in actions]


# ----------------------------------------------------------------------------- expandable segments


def test_expandable_segment_grows_by_pages_and_shrinks_on_empty_cache():
    alloc = make("expandable_segments:True")
    a = alloc.malloc(4 * KiB, 0)
    base = a.ptr
    assert layout(alloc) == [(base, True, [(4 * KiB, "active_allocated"), (2 * MiB - 4 * KiB, "inactive")])]
    stats = alloc.memory_stats()
    assert stats["reserved_bytes.small_pool.current"] == 2 * MiB and stats["segment.all.current"] == 0
    assert stats["num_device_alloc"] == 1 and stats["inactive_split.all.current"] == 0
    b = alloc.malloc(MiB, 0)
    c = alloc.malloc(MiB, 0)  # 1 MiB - 4 KiB left: the next page is mapped right after and joins it
    assert (b.ptr, c.ptr) == (base + 4 * KiB, base + 4 * KiB + MiB)
    assert layout(alloc) == [(base, True, [(4 * KiB, "active_allocated"), (MiB, "active_allocated"),
                                           (MiB, "active_allocated"), (2 * MiB - 4 * KiB, "inactive")])]
    assert trace(alloc, "segment_map") == [("segment_map", base, 2 * MiB), ("segment_map", base + 2 * MiB, 2 * MiB)]
    alloc.free(b)
    alloc.free(c)
    alloc.empty_cache()  # only the whole page inside the free block is unmapped
    assert layout(alloc) == [(base, True, [(4 * KiB, "active_allocated"), (2 * MiB - 4 * KiB, "inactive")])]
    assert trace(alloc, "segment_unmap") == [("segment_unmap", base + 2 * MiB, 2 * MiB)]
    assert alloc.memory_reserved() == 2 * MiB == alloc.memory.used
    alloc.free(a)
    alloc.empty_cache()  # nothing mapped: the segment and its virtual range go away
    assert alloc.snapshot() == [] and alloc.memory_reserved() == 0 and alloc.segments() == []
    assert alloc.memory_stats()["num_device_free"] == 2


def test_best_fit_prefers_a_block_that_cannot_grow_over_the_growing_end():
    alloc = make("expandable_segments:True")
    a = alloc.malloc(MiB, 0)
    b = alloc.malloc(512 * KiB, 0)
    alloc.malloc(256 * KiB, 0)  # leaves a 256 KiB free block at the growing end
    alloc.free(b)  # a 512 KiB hole between allocated blocks
    chosen = alloc.malloc(200 * KiB, 0)
    assert chosen.ptr == a.ptr + MiB  # the hole, although the 256 KiB end block is the smaller fit
    plain = make()
    pa = plain.malloc(MiB, 0)
    pb = plain.malloc(512 * KiB, 0)
    plain.malloc(256 * KiB, 0)
    plain.free(pb)
    assert plain.malloc(200 * KiB, 0).ptr == pa.ptr + MiB + 768 * KiB  # without expandable segments: the end


def test_unmapped_holes_are_refilled_lowest_address_first():
    alloc = make("expandable_segments:True")
    blocks = [alloc.malloc(MiB, 0) for _ in range(5)]  # pages 0, 1, 2 (half used)
    base = blocks[0].ptr
    alloc.free(blocks[2])
    alloc.free(blocks[3])
    alloc.empty_cache()  # page 1 is unmapped: a hole between two mapped ranges
    assert [(s["address"], s["total_size"]) for s in alloc.snapshot()] == [(base, 2 * MiB), (base + 4 * MiB, 2 * MiB)]
    end = alloc.malloc(MiB, 0)  # the free MiB at the end of page 2
    hole = alloc.malloc(MiB, 0)  # no free block left: the lowest unmapped room is the hole
    assert end.ptr == base + 5 * MiB and hole.ptr == base + 2 * MiB


def test_a_hole_counts_together_with_the_free_block_before_it():
    alloc = make("expandable_segments:True")
    blocks = [alloc.malloc(10 * MiB, 0) for _ in range(5)]  # 20 MiB pages 0, 1, 2 (half used)
    base = blocks[0].ptr
    for block in blocks[1:4]:
        alloc.free(block)
    alloc.empty_cache()  # page 1 unmapped; 10 MiB free before it, 10 MiB free at the end of page 2
    big = alloc.malloc(30 * MiB, 0)  # the free 10 MiB and the 20 MiB hole together are enough
    assert big.ptr == base + 10 * MiB


def test_large_pool_pages_are_the_large_segment_size_and_split_at_512_bytes():
    alloc = make("expandable_segments:True")
    x = alloc.malloc(19 * MiB + 512 * KiB, 0)
    assert x.size == 19 * MiB + 512 * KiB and x.next.size == 512 * KiB  # 512 KiB left: split all the same
    assert trace(alloc, "segment_map") == [("segment_map", x.ptr, 20 * MiB)]
    small = make("expandable_segments:True,large_segment_size_mb:8", capacity=GiB)
    y = small.malloc(3 * MiB, 0)
    assert trace(small, "segment_map") == [("segment_map", y.ptr, 8 * MiB)]


def test_streams_and_pools_get_their_own_expandable_segments():
    alloc = make("expandable_segments:True")
    a = alloc.malloc(4 * KiB, 0)
    b = alloc.malloc(4 * KiB, 1)
    pool = alloc.new_pool_id("graph")
    alloc.begin_allocate_to_pool(pool, lambda stream, thread: True)
    c = alloc.malloc(4 * KiB, 0)
    alloc.end_allocate_to_pool(pool)
    assert len({a.segment, b.segment, c.segment}) == 3 and all(s.segment.expandable for s in (a, b, c))
    assert [s["segment_pool_id"] for s in alloc.snapshot(pool)] == [pool]


def test_pluggable_pools_never_use_expandable_segments():
    class Bump:
        next = 0x6000_0000_0000

        def raw_alloc(self, nbytes, stream):
            self.next += nbytes
            return self.next - nbytes

        def raw_delete(self, ptr, nbytes, stream):
            pass

    alloc = make("expandable_segments:True")
    pool = alloc.new_pool_id()
    alloc.create_or_incref_pool(pool, allocator=Bump())
    alloc.begin_allocate_to_pool(pool, lambda stream, thread: True)
    block = alloc.malloc(4 * KiB, 0)
    alloc.end_allocate_to_pool(pool)
    assert not block.segment.expandable and block.ptr == 0x6000_0000_0000
    assert [a for a, *_ in trace(alloc, "segment_alloc", "segment_map")] == ["segment_alloc"]


def test_mapping_past_the_device_capacity_is_an_out_of_memory_error():
    alloc = make("expandable_segments:True", capacity=16 * MiB)
    with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate 20.00 MiB"):
        alloc.malloc(3 * MiB, 0)  # one 20 MiB page does not fit in 16 MiB
    assert alloc.memory_stats()["num_ooms"] == 1 and alloc.memory.used == 0


# ----------------------------------------------------------------------------- max_split_size


def test_oversize_requests_take_cached_oversize_blocks_within_the_rounding_limit():
    alloc = make("max_split_size_mb:40,max_non_split_rounding_mb:24")
    a = alloc.malloc(64 * MiB, 0)
    alloc.free(a)
    b = alloc.malloc(48 * MiB, 0)  # 64 < 48 + 24: taken whole (oversize blocks never split)
    assert b.ptr == a.ptr and b.size == 64 * MiB
    alloc.free(b)
    c = alloc.malloc(40 * MiB, 0)  # 64 >= 40 + 24: not taken, a new segment
    assert c.ptr != a.ptr and c.size == 40 * MiB
    d = alloc.malloc(12 * MiB, 0)  # a request under the limit never takes an oversize block
    assert d.segment.size == 12 * MiB
    stats = alloc.memory_stats()
    assert stats["oversize_segments.current"] == 2 and stats["oversize_allocations.current"] == 1
    assert stats["max_split_size"] == 40 * MiB


def test_out_of_memory_releases_oversize_cached_blocks_from_the_largest_down():
    alloc = make("max_split_size_mb:40", capacity=150 * MiB)
    blocks = [alloc.malloc(size, 0) for size in (64 * MiB, 44 * MiB, 30 * MiB)]
    for block in blocks:
        alloc.free(block)
    big = alloc.malloc(70 * MiB, 0)  # 138 + 70 > 150: release 64 and 44 (oversize), keep 30
    assert big.size == 70 * MiB
    assert sorted(s["total_size"] for s in alloc.snapshot()) == [30 * MiB, 70 * MiB]
    stats = alloc.memory_stats()
    assert stats["num_alloc_retries"] == 0 and stats["num_device_free"] == 2
    assert [size for _, _, size in trace(alloc, "segment_free")] == [64 * MiB, 44 * MiB]


# ----------------------------------------------------------------------------- roundup_power2_divisions


def test_per_interval_divisions_are_parsed_as_each_torch_version_did():
    text = "roundup_power2_divisions:[64:8,256:4,>:1]"
    new = AllocatorConfig(text, torch_version="2.11.0").roundup_power2_divisions
    old = AllocatorConfig(text, torch_version="2.8.0").roundup_power2_divisions
    assert new[:6] == (8,) * 6 and new[6] == 8 and new[7] == 0  # 128 MB: named by no entry
    assert new[8] == 4 and new[9:] == (1,) * 7  # '>' starts after 256
    assert old[8] == 1 and old[:8] == new[:8]  # before 2.9 '>' started at 256 itself
    with pytest.raises(ValueError, match="more than 20"):
        AllocatorConfig("max_split_size_mb:20", torch_version="2.8")
    assert AllocatorConfig("max_split_size_mb:20", torch_version="2.9").max_split_size == 20 * MiB


def test_power_of_two_rounding_of_requests():
    config = AllocatorConfig("roundup_power2_divisions:[1:4,>:8]", torch_version="2.11")
    assert config.roundup_power2_divisions[:3] == (4, 8, 8)
    alloc = make(config)
    block = alloc.malloc(MiB + 1, 0)  # [1, 2) MiB interval: 4 divisions of 256 KiB
    assert block.size == MiB + 256 * KiB == round_size(MiB + 1, config.divisions)
    assert alloc.malloc(2 * MiB + 1, 0).size == 2 * MiB + 256 * KiB  # [2, 4) MiB: 8 divisions
    assert alloc.malloc(1500, 0).size == 1536  # not above 512 * 4: plain 512-byte rounding


def test_recorded_settings_decide_over_the_string():
    settings = AllocatorConfig("max_split_size_mb:64", torch_version="2.11").settings()
    settings["max_split_size"] = 100 * MiB  # changed at run time with _set_allocator_settings
    config = AllocatorConfig.from_settings(settings, torch_version="2.11")
    assert config.max_split_size == 100 * MiB and config.source == "max_split_size_mb:64"
    settings["roundup_power2_divisions"]["4"] = 2
    assert AllocatorConfig.from_settings(settings).roundup_power2_divisions[2] == 2


# ----------------------------------------------------------------------------- memory fraction and GC


def test_memory_fraction_caps_new_segments():
    alloc = make(capacity=100 * MiB)
    alloc.set_memory_fraction(0.5)
    alloc.malloc(30 * MiB, 0)
    with pytest.raises(torch.OutOfMemoryError, match=r"50.00 MiB allowed; Of the allocated memory"):
        alloc.malloc(22 * MiB, 0)
    assert alloc.memory.used == 30 * MiB and alloc.get_memory_fraction() == 0.5
    with pytest.raises(ValueError, match="within"):
        alloc.set_memory_fraction(1.5)


def test_garbage_collection_releases_old_cached_segments_above_the_threshold():
    alloc = make("garbage_collection_threshold:0.5", capacity=100 * MiB)
    alloc.set_memory_fraction(0.8)  # 80 MiB allowed, collect above 40 MiB
    cached = alloc.malloc(30 * MiB, 1)
    alloc.free(cached)  # 30 MiB cached on stream 1
    alloc.malloc(20 * MiB, 0)  # 30 MiB total <= 40: no collection
    assert len(alloc.snapshot()) == 2
    alloc.malloc(12 * MiB, 0)  # 50 MiB > 40: the cached segment (age 2 >= average 2) goes first
    assert sorted(s["total_size"] for s in alloc.snapshot()) == [12 * MiB, 20 * MiB]
    assert [a for a, *_ in trace(alloc, "segment_free", "segment_alloc")][-2:] == ["segment_free", "segment_alloc"]
    without = make("garbage_collection_threshold:0.5", capacity=100 * MiB)  # no fraction: GC is off
    without.free(without.malloc(30 * MiB, 1))
    without.malloc(20 * MiB, 0)
    without.malloc(12 * MiB, 0)
    assert len(without.snapshot()) == 3


def test_garbage_collection_frees_blocks_at_least_as_old_as_the_average_first():
    alloc = make("garbage_collection_threshold:0.25", capacity=200 * MiB)
    alloc.set_memory_fraction(1.0 - 2**-10)  # just under the device: GC on (above ~50 MiB), the cap out of the way
    old = alloc.malloc(24 * MiB, 1)
    young = alloc.malloc(22 * MiB, 2)
    alloc.free(old)  # enters the free list after 2 searches of the large pool
    for _ in range(3):
        alloc.free(alloc.malloc(12 * MiB, 3))  # 3 more searches; this block last enters after 5
    alloc.free(young)  # enters after 5
    alloc.malloc(12 * MiB, 4)  # 58 MiB > 50: ages 4, 1, 1 (average 2): only the old one goes
    sizes = sorted(s["total_size"] for s in alloc.snapshot())
    assert sizes == [12 * MiB, 12 * MiB, 22 * MiB]
