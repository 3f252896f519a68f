"""memory_stats() recomputed from the blocks: every statistic, every pool kind, every setting.

The oracle does not share the allocator's bookkeeping: after each random operation it
counts blocks and segments in the snapshot and checks every current value against the
count, every statistic's identity current = allocated - freed, "all" = small + large,
each peak against the largest value seen between operations, and the device call
counters against the trace. So a wrong line in any statistic update fails here.
"""

from __future__ import annotations

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from graphborrow.allocator.caching import CachingAllocator
from graphborrow.allocator.config import SIZE_MAX
from graphborrow.allocator.memory import PhysicalMemory
from graphborrow.allocator.stats import ARRAY_STATS
from graphborrow.allocator.streams import Clockwork

KiB, MiB = 2**10, 2**20
CONFIGS = [
    None,
    "expandable_segments:True",
    "max_split_size_mb:20,max_non_split_rounding_mb:21",
    "roundup_power2_divisions:[1:2,16:4,>:8]",
    "garbage_collection_threshold:0.4",
    "expandable_segments:True,max_split_size_mb:30,garbage_collection_threshold:0.5",
]
KINDS = ("small_pool", "large_pool")


def recount(alloc: CachingAllocator) -> dict[str, int]:
    """Current values of every statistic, counted from the snapshot."""
    counts = {f"{name}.{kind}.current": 0 for name in ARRAY_STATS for kind in KINDS}
    oversize_allocations = oversize_segments = 0
    max_split = alloc.max_split
    for segment in alloc.snapshot():
        kind = f"{segment['segment_type']}_pool"
        expandable = segment["is_expandable"]
        counts[f"reserved_bytes.{kind}.current"] += segment["total_size"]
        if not expandable:
            counts[f"segment.{kind}.current"] += 1
            oversize_segments += segment["total_size"] >= max_split
        split = len(segment["blocks"]) > 1
        for block in segment["blocks"]:
            state, size = block["state"], block["size"]
            if state == "inactive":
                if split and not expandable:
                    counts[f"inactive_split.{kind}.current"] += 1
                    counts[f"inactive_split_bytes.{kind}.current"] += size
                continue
            counts[f"active.{kind}.current"] += 1
            counts[f"active_bytes.{kind}.current"] += size
            counts[f"requested_bytes.{kind}.current"] += block["requested_size"]
            if state == "active_allocated":
                counts[f"allocation.{kind}.current"] += 1
                counts[f"allocated_bytes.{kind}.current"] += size
                oversize_allocations += size >= max_split
    for name in ARRAY_STATS:
        counts[f"{name}.all.current"] = sum(counts[f"{name}.{kind}.current"] for kind in KINDS)
    counts["oversize_allocations.current"] = oversize_allocations
    counts["oversize_segments.current"] = oversize_segments
    return counts


def check(alloc: CachingAllocator, peaks: dict[str, int], where: str) -> None:
    stats = alloc.memory_stats()
    for key, counted in recount(alloc).items():
        assert stats[key] == counted, f"{where}: {key} is {stats[key]}, the blocks say {counted}"
    prefixes = [f"{name}.{kind}" for name in ARRAY_STATS for kind in ("all", *KINDS)]
    for prefix in prefixes + ["oversize_allocations", "oversize_segments"]:
        current = stats[f"{prefix}.current"]
        assert current == stats[f"{prefix}.allocated"] - stats[f"{prefix}.freed"], f"{where}: {prefix} totals"
        seen = max(peaks.get(prefix, 0), current)
        if prefix.startswith("inactive_split"):
            # one operation can complete several pending frees (empty_cache, an event check in
            # malloc); as in torch, each free updates the count, so a block freed before its
            # neighbour splits a segment for a moment: the peak may exceed what is seen between
            # operations, never fall below it or below an earlier peak
            assert stats[f"{prefix}.peak"] >= max(seen, peaks.get(prefix + ".stat", 0)), f"{where}: {prefix}.peak"
            peaks[prefix + ".stat"] = stats[f"{prefix}.peak"]
            seen = stats[f"{prefix}.peak"]
        peaks[prefix] = seen
        assert stats[f"{prefix}.peak"] == peaks[prefix], f"{where}: {prefix}.peak"
    for name in ARRAY_STATS:
        for field in ("current", "allocated", "freed"):
            parts = sum(stats[f"{name}.{kind}.{field}"] for kind in KINDS)
            assert stats[f"{name}.all.{field}"] == parts, f"{where}: {name}.all.{field} is not small + large"
    actions = [entry["action"] for entry in alloc.full_snapshot()["device_traces"][0]]
    assert stats["num_device_alloc"] == actions.count("segment_alloc") + actions.count("segment_map"), where
    assert stats["num_device_free"] == actions.count("segment_free") + actions.count("segment_unmap"), where
    assert stats["num_ooms"] == actions.count("oom"), where
    assert alloc.total_allocated_memory == stats["reserved_bytes.all.current"], where
    assert stats["max_split_size"] == (-1 if alloc.max_split == SIZE_MAX else alloc.max_split), where


operation = st.tuples(st.integers(0, 9), st.integers(0, 104), st.integers(0, 2**20), st.booleans())


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(CONFIGS), st.lists(operation, min_size=1, max_size=70))
@example(None, [(0, 0, 0, False), (0, 0, 0, False), (4, 0, 0, True), (4, 0, 0, True), (4, 0, 0, False)])  # empty_cache frees two
def test_every_statistic_matches_the_blocks(config, ops):
    alloc = CachingAllocator(PhysicalMemory(capacity=256 * MiB, backed=False), Clockwork(), config)
    alloc.set_memory_fraction(0.75)
    alloc.record_history(max_entries=10**6)
    graph_pool = alloc.new_pool_id("graph")
    alloc.create_or_incref_pool(graph_pool)
    side = alloc.clockwork.new_stream()
    live, routed, peaks = [], False, {}
    for step, (op, scale, mantissa, flag) in enumerate(ops):
        if op <= 3:
            size = max(1, int(2 ** (scale / 4) * (1 + mantissa / 2**21)))  # log-uniform: 1 B .. 96 MiB
            try:
                live.append(alloc.malloc(size, side.id if flag else 0))
            except torch.OutOfMemoryError:
                pass
        elif op <= 6 and live:
            block = live.pop(mantissa % len(live))
            if flag:
                side.enqueue(3.0)
                alloc.record_stream(block, side.id if block.stream == 0 else 0)
            alloc.free(block)
        elif op == 7:
            alloc.clockwork.advance(2.0)
        elif op == 8:
            if routed:
                alloc.end_allocate_to_pool(graph_pool)
            else:
                alloc.begin_allocate_to_pool(graph_pool, lambda stream, thread: stream == side.id)
                alloc.release_pool(graph_pool)  # routing holds its own use
            routed = not routed
        elif not routed:
            alloc.empty_cache()
        check(alloc, peaks, f"{config!r}, step {step}")


def test_reset_peak_and_accumulated_statistics():
    alloc = CachingAllocator(PhysicalMemory(capacity=256 * MiB, backed=False), Clockwork())
    a = alloc.malloc(3 * MiB, 0)
    alloc.free(alloc.malloc(5 * MiB, 0))
    alloc.free(a)
    alloc.reset_peak_memory_stats()
    stats = alloc.memory_stats()
    assert all(stats[k] == stats[k.replace(".peak", ".current")] for k in stats if k.endswith(".peak"))
    alloc.reset_accumulated_memory_stats()
    stats = alloc.memory_stats()
    assert all(stats[k] == 0 for k in stats if k.endswith((".allocated", ".freed")))
    assert stats["num_device_alloc"] == 0 and stats["reserved_bytes.all.current"] == 20 * MiB
