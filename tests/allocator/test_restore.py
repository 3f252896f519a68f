"""restore(): allocator state rebuilt from snapshot segments behaves like the allocator it came from.

The oracle is the allocator itself: a random workload runs on one allocator, its snapshot
is restored into a fresh one, and from then on both get the same operations; their
snapshots and full ``memory_stats()`` must agree after every one.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

from graphborrow.allocator.caching import CachingAllocator
from graphborrow.allocator.memory import PhysicalMemory
from graphborrow.allocator.restore import restore
from graphborrow.allocator.streams import Clockwork, Event

KiB, MiB = 2**10, 2**20
CAPACITY = 640 * MiB
POOLS = {"graph": (3, 0), "handle": (0, 4), "pluggable": (0, 7)}


class BumpPool:
    """A pluggable pool's raw allocator: a bump pointer over its own address range."""

    def __init__(self, base: int) -> None:
        self.next = base

    def raw_alloc(self, nbytes: int, stream: int) -> int:
        ptr, self.next = self.next, self.next + nbytes
        return ptr

    def raw_delete(self, ptr: int, nbytes: int, stream: int) -> None:
        pass


def fresh(config=None) -> CachingAllocator:
    return CachingAllocator(PhysicalMemory(capacity=CAPACITY, backed=False), Clockwork(), config)


def state(alloc: CachingAllocator):
    return alloc.snapshot(), alloc.memory_stats()


class Workload:
    """Random allocator operations over explicit pool ids and three streams, applied to one allocator."""

    def __init__(self, alloc: CachingAllocator) -> None:
        self.alloc = alloc
        self.live: list = []  # allocated blocks, in allocation order
        self.routed: list = []  # pool ids currently routed to

    def setup_pools(self) -> None:
        a = self.alloc
        a.create_or_incref_pool(POOLS["graph"])
        a.create_or_incref_pool(POOLS["handle"], use_on_oom=True)
        a.create_or_incref_pool(POOLS["pluggable"], BumpPool(0x5000_0000_0000), no_split=False)

    def step(self, rng: random.Random) -> str | None:
        a = self.alloc
        op = rng.random()
        if op < 0.45 or not self.live:
            size = rng.choice([rng.randint(1, 4 * KiB), rng.randint(1, MiB), rng.randint(MiB, 48 * MiB)])
            try:
                self.live.append(a.malloc(size, rng.choice((0, 0, 1)), thread=7))
            except torch.OutOfMemoryError as error:
                return f"oom {error}"
        elif op < 0.78:
            block = self.live.pop(rng.randrange(len(self.live)))
            if rng.random() < 0.3:
                a.record_stream(block, 2)
            a.free(block)
        elif op < 0.84:
            a.clockwork.stream(2).enqueue(rng.choice((5.0, 50.0)))
        elif op < 0.90:
            a.clockwork.advance(rng.choice((1.0, 20.0)))
        elif op < 0.96:
            if self.routed:
                a.end_allocate_to_pool(self.routed.pop())
            else:
                pool_id = rng.choice(list(POOLS.values()))
                if rng.random() < 0.5:
                    a.begin_allocate_to_pool(pool_id, lambda stream, thread: stream == 1)
                else:
                    a.begin_allocate_to_pool(pool_id, lambda stream, thread: thread == 7)
                a.release_pool(pool_id)  # begin took its own reference; the pool keeps use_count 1
                self.routed.append(pool_id)
        elif not self.routed:
            a.empty_cache()
        return None


def restore_copy(original: CachingAllocator, live: list, config) -> tuple[CachingAllocator, list]:
    """A fresh allocator restored from ``original``'s snapshot, with the same streams, events and pools."""
    copy_ = fresh(config)
    for stream_id, stream in original.clockwork.streams.items():
        mine = copy_.clockwork.stream(stream_id)
        mine.clock, mine.queued_until = stream.clock, stream.queued_until
    copy_.clockwork._host_us = original.clockwork.now_us
    markers = {}  # address -> the event the original's pending block waits on, rebuilt on the copy's streams
    for stream_id, queue in original.cuda_events.items():
        for event, block in queue:
            mirrored = Event()
            mirrored.stream, mirrored.marker = copy_.clockwork.stream(stream_id), event.marker
            markers[block.ptr] = mirrored
    plug = original.graph_pools[POOLS["pluggable"]].allocator
    restored = restore(
        copy_,
        original.snapshot(), allocators={POOLS["pluggable"]: copy.deepcopy(plug)},
        pending=markers.__getitem__, stats=original.memory_stats(),
    )
    for pool_id in POOLS.values():
        private = original.graph_pools[pool_id]
        if pool_id not in copy_.graph_pools:
            copy_.create_or_incref_pool(pool_id)
        copy_.set_use_on_oom(pool_id, private.use_on_oom)
    # the workload's own bookkeeping, translated to the copy's blocks
    return copy_, [restored.allocated[block.ptr] for block in live]


@pytest.mark.parametrize("config", [None, "max_split_size_mb:40,roundup_power2_divisions:4"])
@pytest.mark.parametrize("seed", range(4))
def test_restored_allocator_evolves_like_the_original(seed, config):
    rng = random.Random(seed)
    original = Workload(fresh(config))
    original.setup_pools()
    for _ in range(rng.randint(50, 400)):
        original.step(rng)
    while original.routed:  # restore starts from an allocator with no routing underway
        original.alloc.end_allocate_to_pool(original.routed.pop())
    original.alloc.process_events()  # deferred frees get their events, as the next malloc would do
    copy_alloc, copy_live = restore_copy(original.alloc, original.live, config)
    assert state(copy_alloc) == state(original.alloc)
    twin = Workload(copy_alloc)
    twin.live = copy_live
    rng_a, rng_b = random.Random(seed + 100), random.Random(seed + 100)
    for i in range(400):
        out_a, out_b = original.step(rng_a), twin.step(rng_b)
        assert out_a == out_b, (i, out_a, out_b)
        assert copy_alloc.snapshot() == original.alloc.snapshot(), f"step {i}"
        assert copy_alloc.memory_stats() == original.alloc.memory_stats(), f"step {i}"


def test_round_trip_of_a_hand_made_state():
    base = 0x7F00_0000_0000
    segments = [
        {"address": base, "total_size": 2 * MiB, "stream": 0, "segment_type": "small", "segment_pool_id": (0, 0),
         "blocks": [{"size": 4 * KiB, "state": "active_allocated", "requested_size": 4000},
                    {"size": 8 * KiB, "state": "inactive", "requested_size": 0},
                    {"size": 2 * MiB - 12 * KiB, "state": "active_allocated", "requested_size": 2 * MiB - 12 * KiB}]},
        {"address": base + 2 * MiB, "total_size": 20 * MiB, "stream": 5, "segment_type": "large",
         "segment_pool_id": (0, 2),
         "blocks": [{"size": 3 * MiB, "state": "active_pending_free", "requested_size": 3 * MiB - 7},
                    {"size": 17 * MiB, "state": "inactive", "requested_size": 0}]},
    ]
    alloc = fresh()
    side = alloc.clockwork.new_stream(9)
    side.enqueue(10.0)
    event = Event()
    event.record(side)
    restored = restore(alloc, segments, pending=event)
    assert sorted(restored.allocated) == [base, base + 12 * KiB] and list(restored.pending) == [base + 2 * MiB]
    snap = alloc.snapshot()
    assert [(s["address"], s["total_size"], s["stream"], s["segment_pool_id"], s["segment_type"]) for s in snap] == [
        (base, 2 * MiB, 0, (0, 0), "small"), (base + 2 * MiB, 20 * MiB, 5, (0, 2), "large")]
    assert [[(b["size"], b["state"], b["requested_size"]) for b in s["blocks"]] for s in snap] == [
        [(b["size"], b["state"], b["requested_size"]) for b in s["blocks"]] for s in segments]
    stats = alloc.memory_stats()
    assert stats["reserved_bytes.all.current"] == 22 * MiB == alloc.memory.used
    assert stats["allocated_bytes.small_pool.current"] == 2 * MiB - 8 * KiB
    assert stats["active_bytes.large_pool.current"] == 3 * MiB
    assert stats["requested_bytes.all.current"] == 4000 + 2 * MiB - 12 * KiB + 3 * MiB - 7
    assert stats["inactive_split.all.current"] == 2 and stats["inactive_split_bytes.all.current"] == 8 * KiB + 17 * MiB
    assert stats["segment.large_pool.current"] == 1 and stats["allocation.all.current"] == 2
    assert stats["allocated_bytes.all.peak"] == stats["allocated_bytes.all.current"]
    # the free block is reused by best fit; the pending one only after its event
    again = alloc.malloc(6 * KiB, 0)
    assert again.ptr == base + 4 * KiB
    alloc.begin_allocate_to_pool((0, 2), lambda stream, thread: True)
    assert alloc.malloc(3 * MiB, 5).ptr == base + 5 * MiB  # the pending block is not free yet
    alloc.end_allocate_to_pool((0, 2))
    assert restored.pending[base + 2 * MiB].state == "active_pending_free"
    side.synchronize()
    alloc.malloc(512, 0)  # processes the completed event
    assert restored.pending[base + 2 * MiB].state == "inactive"
    assert alloc.new_pool_id("handle") == (0, 3)  # restored pool ids are not handed out again
    alloc.free(restored.allocated[base])
    assert alloc.snapshot()[0]["blocks"][0] == {"address": base, "size": 4 * KiB, "requested_size": 4000,
                                                "state": "inactive", "frames": []}


def test_new_segments_of_a_restored_pluggable_pool_come_from_its_allocator():
    host = 0x7F00_0000_0000
    segments = [
        {"address": host, "total_size": 40 * MiB, "stream": 0, "segment_type": "large", "segment_pool_id": (0, 1),
         "blocks": [{"size": 40 * MiB, "state": "inactive"}]},
        {"address": host + 10 * MiB, "total_size": 2 * MiB, "stream": 0, "segment_type": "small",
         "segment_pool_id": (0, 2), "blocks": [{"size": 2 * MiB, "state": "active_allocated", "requested_size": 9}]},
    ]
    alloc = fresh()
    with pytest.raises(ValueError, match="overlap.*allocators="):
        restore(fresh(), segments)
    arena = BumpPool(host + 20 * MiB)
    restore(alloc, segments, allocators={(0, 2): arena})
    assert alloc.memory.used == 40 * MiB  # the nested segment is the arena's memory, not the device's
    alloc.begin_allocate_to_pool((0, 2), lambda stream, thread: True)
    block = alloc.malloc(2 * MiB, 0)
    alloc.end_allocate_to_pool((0, 2))
    assert block.ptr == host + 20 * MiB and arena.next == host + 40 * MiB


@pytest.mark.parametrize("segment, message", [
    ({"address": 2**21, "total_size": 2 * MiB, "blocks": [{"size": MiB, "state": "inactive"}]}, "add up to"),
    ({"address": 2**21, "total_size": 2 * MiB, "blocks": [{"size": 1000, "state": "inactive"},
                                                        {"size": 2 * MiB - 1000, "state": "active_allocated"}]},
     "multiple of 512"),
    ({"address": 2**21, "total_size": 2 * MiB, "blocks": [{"size": MiB, "state": "inactive"},
                                                        {"size": MiB, "state": "inactive"}]}, "merges free neighbours"),
    ({"address": 2**21, "total_size": 2 * MiB, "blocks": [{"size": 2 * MiB, "state": "busy"}]}, "unknown state"),
    ({"address": 2**21, "total_size": 2 * MiB, "blocks": [{"size": MiB, "state": "active_allocated"},
                                                        {"address": 2**21 + 512, "size": MiB, "state": "inactive"}]},
     "without gaps"),
    ({"address": 2**21, "blocks": []}, "not a snapshot segment"),
    ({"address": 2**21, "total_size": 2 * MiB, "blocks": [{"size": 2 * MiB, "state": "active_pending_free"}]},
     "pending="),
])
def test_inconsistent_segments_are_refused_with_the_reason(segment, message):
    with pytest.raises(ValueError, match=message):
        restore(CachingAllocator(PhysicalMemory(capacity=CAPACITY, backed=False, base=2**21), Clockwork()), [segment])


def test_stats_that_do_not_match_the_segments_are_refused():
    source = fresh()
    source.malloc(5000, 0)
    stats = source.memory_stats()
    stats["allocated_bytes.all.current"] += 512
    with pytest.raises(ValueError, match="allocated_bytes.all.current"):
        restore(fresh(), source.snapshot(), stats=stats)
    with pytest.raises(RuntimeError, match="empty allocator"):
        restore(source, source.snapshot())


def test_stats_missing_some_keys_take_over_the_rest_and_keep_the_recount_for_those():
    """A memory_stats() dict from a torch that lacks some keys (requested_bytes came later):
    the keys present are taken over, the missing ones keep what restoring counted."""
    source = fresh()
    keep = source.malloc(5000, 0)
    source.free(source.malloc(3 * MiB, 0))
    stats = {k: v for k, v in source.memory_stats().items() if not k.startswith("requested_bytes.")}
    copy_alloc = fresh()
    restore(copy_alloc, source.snapshot(), stats=stats)
    restored = copy_alloc.memory_stats()
    recount = fresh()
    restore(recount, source.snapshot())
    for key, value in recount.memory_stats().items():
        assert restored[key] == stats.get(key, value), key
    assert restored["allocated_bytes.all.peak"] == 5120 + 3 * MiB  # taken over, not the restored peak
    assert restored["requested_bytes.all.current"] == restored["requested_bytes.all.peak"] == 5000
    del keep


def _expandable_with_its_lowest_pages_unmapped():
    """An allocator whose expandable reservation has nothing mapped below its first mapped range."""
    alloc = fresh("expandable_segments:True")
    low = alloc.malloc(60 * MiB, 0)
    kept = alloc.malloc(30 * MiB, 0)
    alloc.free(low)
    alloc.empty_cache()  # the pages under the freed block go back; the reservation stays
    (segment,) = alloc.segments()
    assert segment.address < kept.ptr  # what this test is about: the reservation starts lower
    return alloc, segment.address, kept


def _layout(alloc: CachingAllocator):
    """Segments, blocks and statistics; a free block's requested_size is left out (a stale value the
    allocator never reads, kept from the block's last allocation, which a restore cannot know)."""
    segments = [{**s, "blocks": [{k: v for k, v in b.items() if not (b["state"] == "inactive" and k == "requested_size")}
                                 for b in s["blocks"]]} for s in alloc.snapshot()]
    return segments, alloc.memory_stats()


@pytest.mark.parametrize("told", [True, False])
def test_an_expandable_reservation_restored_with_its_start_grows_like_the_original(told):
    original, start, kept = _expandable_with_its_lowest_pages_unmapped()
    segments = original.snapshot()
    assert [s["address"] for s in segments] == [kept.ptr]  # a snapshot shows mapped ranges only
    if told:
        segments = [{**s, "reservation_address": start} for s in segments]
    copy_ = fresh("expandable_segments:True")
    restored = restore(copy_, segments, stats=original.memory_stats())
    assert _layout(copy_) == _layout(original)
    live = [(kept, restored.allocated[kept.ptr])]
    rng = random.Random(3)
    for i in range(200):  # the same operations on both; the copy must place and map exactly as the original
        if rng.random() < 0.55 or not live:
            size = rng.choice([rng.randint(1, MiB), rng.randint(MiB, 40 * MiB)])
            pair = (original.malloc(size, 0), copy_.malloc(size, 0))
            if pair[0].ptr != pair[1].ptr:
                assert not told, f"step {i}: {pair[0].ptr:#x} != {pair[1].ptr:#x}"
                return  # without its start the copy maps elsewhere: the reason the option exists
            live.append(pair)
        else:
            a, b = live.pop(rng.randrange(len(live)))
            original.free(a)
            copy_.free(b)
            if rng.random() < 0.2:
                original.empty_cache()
                copy_.empty_cache()
        assert _layout(copy_) == _layout(original), f"step {i}"
    assert told, "a copy that starts at its lowest mapped page should have diverged"


@pytest.mark.parametrize("change, message", [
    (lambda s, start: {**s, "reservation_address": s["address"] + 2 * MiB}, "at or below its address"),
    (lambda s, start: {**s, "is_expandable": False, "reservation_address": start}, "expandable segment"),
])
def test_a_reservation_start_that_cannot_hold_the_range_is_refused(change, message):
    original, start, _ = _expandable_with_its_lowest_pages_unmapped()
    segments = [change(s, start) for s in original.snapshot()]
    with pytest.raises(ValueError, match=message):
        restore(fresh("expandable_segments:True"), segments)


def test_ranges_of_one_reservation_must_name_one_start():
    original, start, _ = _expandable_with_its_lowest_pages_unmapped()
    (segment,) = original.snapshot()
    half = segment["total_size"] // 2  # two ranges of one stream and pool: one reservation
    first = {**segment, "total_size": half, "blocks": [{"size": half, "state": "inactive"}], "reservation_address": start}
    second = {**first, "address": segment["address"] + half, "reservation_address": start + 32 * MiB}
    with pytest.raises(ValueError, match="reservation starts"):
        restore(fresh("expandable_segments:True"), [first, second])
