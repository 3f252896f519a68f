"""Trace replay: round trips through the simulator's own traces and hand-built traces."""

from __future__ import annotations

import pickle
import random
import threading

import pytest

from graphborrow.allocator.caching import CachingAllocator
from graphborrow.allocator.memory import PhysicalMemory
from graphborrow.allocator.replay_support import garbage_collection_victims
from graphborrow.allocator.streams import Clockwork
from graphborrow.core.errors import SnapshotFormatError
from graphborrow.fidelity.replay import ReplayReport, load_trace, replay_trace

KiB, MiB = 2**10, 2**20
A = 0x7F0000000000
B = A + 2 * MiB


def make():
    clockwork = Clockwork()
    alloc = CachingAllocator(PhysicalMemory(backed=False), clockwork)
    alloc.record_history()
    return alloc, clockwork


class RunArena:
    """Bump allocator over free runs of another pool (what a borrow pool's arena does)."""

    def __init__(self, runs):
        self.runs = [[start, start + size] for start, size in runs]

    def raw_alloc(self, nbytes, stream):
        for run in self.runs:
            if run[1] - run[0] >= nbytes:
                run[0] += nbytes
                return run[0] - nbytes
        return 0

    def raw_delete(self, address, nbytes, stream):
        pass


def free_runs(alloc, pool_id):
    runs = []
    for segment in alloc.snapshot(pool_id):
        for block in segment["blocks"]:
            if block["state"] == "inactive":
                runs.append((block["address"], block["size"]))
    return sorted(runs, key=lambda r: -r[1])


def entry(action, addr, size, stream=0):
    return {"action": action, "addr": addr, "size": size, "stream": stream, "time_us": 0,
            "compile_context": "N/A", "user_metadata": ""}


def snapshot_of(entries, segments=()):
    return {"segments": list(segments), "device_traces": [entries], "allocator_settings": {},
            "external_annotations": []}


def segment(address, blocks, stream=0):
    total = sum(size for size, _ in blocks)
    return {"device": 0, "address": address, "total_size": total, "stream": stream,
            "segment_type": "small" if total <= 2 * MiB else "large", "is_expandable": False,
            "segment_pool_id": (0, 0), "blocks": [{"size": size, "state": state} for size, state in blocks]}


# ----------------------------------------------------------------------------- round trips


def test_round_trip_default_pool_churn_with_streams_and_empty_cache():
    alloc, clockwork = make()
    side = clockwork.new_stream()
    rng = random.Random(7)
    live = []
    for _ in range(1500):
        r = rng.random()
        if r < 0.5 or not live:
            size = rng.choice([rng.randrange(1, 8 * KiB), rng.randrange(1, MiB), rng.randrange(MiB, 40 * MiB)])
            live.append(alloc.malloc(size, rng.choice([0, 0, side.id])))
        elif r < 0.9:
            block = live.pop(rng.randrange(len(live)))
            if rng.random() < 0.25:
                side.enqueue(rng.random() * 10)
                alloc.record_stream(block, side.id if block.stream == 0 else 0)
            alloc.free(block)
        elif r < 0.98:
            clockwork.advance(rng.random() * 4)
        else:
            alloc.empty_cache()
    report = replay_trace(alloc.full_snapshot())
    assert isinstance(report, ReplayReport)
    assert report.agreement == 1.0, report
    assert report.checks > 1000 and report.events == len(alloc.full_snapshot()["device_traces"][0]) - 1


def test_round_trip_graph_pool_and_borrow_cycles_through_pluggable_pools(tmp_path):
    alloc, clockwork = make()
    capture = clockwork.new_stream()
    graph_pool = alloc.new_pool_id("handle")
    alloc.create_or_incref_pool(graph_pool)
    kept = []
    for tokens in (64, 16, 4, 1):  # largest first, one shared pool
        alloc.begin_allocate_to_pool(graph_pool, lambda s, t: s == capture.id)
        scratch = [alloc.malloc(tokens * size, capture.id) for size in (40 * KiB, 600 * KiB, 90 * KiB)]
        kept.append(alloc.malloc(tokens * 8 * KiB, capture.id))
        for block in scratch:
            alloc.free(block)
        alloc.end_allocate_to_pool(graph_pool)
    me = threading.get_ident()
    borrowed = None
    for cycle in range(3):
        pool = alloc.new_pool_id("mempool")
        alloc.create_or_incref_pool(pool, allocator=RunArena(free_runs(alloc, graph_pool)))
        alloc.begin_allocate_to_pool(pool, lambda s, t: t == me)
        blocks = [alloc.malloc(size, 0) for size in (300 * KiB, 700 * KiB, 5 * KiB)]
        alloc.end_allocate_to_pool(pool)
        alloc.release_pool(pool)
        if cycle < 2:
            for block in blocks:
                alloc.free(block)
            alloc.release_pool(pool)
            alloc.empty_cache(pool)
        else:
            borrowed = blocks
        alloc.free(alloc.malloc(3 * MiB, 0))  # eager work in between
    assert borrowed and any(s["segment_pool_id"] == pool for s in alloc.snapshot())
    path = tmp_path / "trace.pickle"
    path.write_bytes(pickle.dumps(alloc.full_snapshot()))
    report = replay_trace(str(path))
    assert report.agreement == 1.0, report
    assert report.checks >= 2 * 30


# ----------------------------------------------------------------------------- hand-built traces


def test_hand_built_trace_with_known_outcome():
    entries = [
        entry("segment_alloc", A, 2 * MiB), entry("alloc", A, 4096), entry("alloc", A + 4096, 1000),
        entry("free_requested", A, 4096), entry("free_completed", A, 4096), entry("alloc", A, 2048),
    ]
    final = [segment(A, [(2048, "active_allocated"), (2048, "inactive"), (1024, "active_allocated"),
                         (2 * MiB - 5120, "inactive")])]
    report = replay_trace(snapshot_of(entries, final))
    # 3 allocations x (device calls, block) + the final segment
    assert (report.agreement, report.checks, report.events, report.mismatches) == (1.0, 7, 6, [])
    assert not report.mid_run and report.unverifiable == 0


def test_wrong_block_choice_is_detected():
    entries = [
        entry("segment_alloc", A, 2 * MiB), entry("alloc", A, 4096), entry("alloc", A + 4096, 1000),
        entry("free_requested", A, 4096), entry("free_completed", A, 4096),
        entry("alloc", A + 5120, 2048),  # a real allocator would take the 4 KiB hole at A
    ]
    final = [segment(A, [(4096, "inactive"), (1024, "active_allocated"), (2048, "active_allocated"),
                         (2 * MiB - 7168, "inactive")])]
    report = replay_trace(snapshot_of(entries, final))
    assert report.agreement < 1.0
    assert any(m.startswith("event 5 alloc") and f"expected block at {A + 5120:#x}, simulated {A:#x}" in m
               for m in report.mismatches), report.mismatches


def test_unexpected_new_segment_is_detected():
    entries = [
        entry("segment_alloc", A, 2 * MiB), entry("alloc", A, 4096),
        entry("free_requested", A, 4096), entry("free_completed", A, 4096),
        entry("segment_alloc", B, 2 * MiB), entry("alloc", B, 4096),  # the cached block would be reused
    ]
    final = [segment(A, [(2 * MiB, "inactive")]), segment(B, [(4096, "active_allocated"), (2 * MiB - 4096, "inactive")])]
    report = replay_trace(snapshot_of(entries, final))
    assert report.agreement < 1.0
    assert any("expected device calls [segment_alloc 2097152 B at" in m and "simulated none" in m
               for m in report.mismatches), report.mismatches


def test_cross_stream_free_stays_pending_until_completed():
    entries = [
        entry("segment_alloc", A, 2 * MiB), entry("alloc", A, 4096),
        entry("free_requested", A, 4096),
        entry("alloc", A + 4096, 4096),  # A is still pending: the tail is used
        entry("free_completed", A, 4096),
        entry("alloc", A, 4096),
    ]
    final = [segment(A, [(4096, "active_allocated"), (4096, "active_allocated"), (2 * MiB - 8192, "inactive")])]
    report = replay_trace(snapshot_of(entries, final))
    assert report.agreement == 1.0 and report.checks == 8, report  # 3 allocs x 2, the completion, the segment
    early = [dict(e) for e in entries]
    early[3]["addr"] = A  # claims reuse before the event completed
    early[5]["addr"] = A + 4096
    bad = replay_trace(snapshot_of(early, final))
    assert bad.agreement < 1.0 and any("event 3 alloc" in m for m in bad.mismatches)


def test_empty_cache_release_set_is_compared():
    entries = [
        entry("segment_alloc", A, 2 * MiB), entry("alloc", A, 4096),
        entry("segment_alloc", B, 20 * MiB), entry("alloc", B, 4 * MiB),
        entry("free_requested", B, 4 * MiB), entry("free_completed", B, 4 * MiB),
        entry("segment_free", B, 20 * MiB), entry("segment_free", A, 2 * MiB),  # A still holds a block
    ]
    report = replay_trace(snapshot_of(entries))
    assert report.agreement < 1.0
    assert any(m.startswith("events 6..7 empty_cache") and f"simulated [segment_free 20971520 B at {B:#x}]" in m
               for m in report.mismatches), report.mismatches


# ----------------------------------------------------------------------------- traces that say too little


def _churn_trace(steps: int, seed: int = 3, history_from: int = 0, max_entries: int = 10**6):
    """A trace of the simulator itself: random churn on two streams, history from step ``history_from``."""
    alloc, clockwork = make()
    alloc.record_history(False)
    side = clockwork.new_stream()
    rng = random.Random(seed)
    live = []
    for step in range(steps):
        if step == history_from:
            alloc.record_history(True, max_entries=max_entries)
        if rng.random() < 0.55 or not live:
            size = rng.choice([rng.randrange(1, 8 * KiB), rng.randrange(1, MiB), rng.randrange(MiB, 40 * MiB)])
            live.append(alloc.malloc(size, rng.choice([0, 0, side.id])))
        else:
            block = live.pop(rng.randrange(len(live)))
            if rng.random() < 0.2:
                side.enqueue(rng.random() * 10)
                alloc.record_stream(block, side.id if block.stream == 0 else 0)
            alloc.free(block)
            if rng.random() < 0.1:
                clockwork.advance(5.0)
        if rng.random() < 0.02:
            alloc.empty_cache()
    return alloc.full_snapshot()


def test_a_trace_cut_in_half_never_replays_at_one():
    full = _churn_trace(800)
    entries = full["device_traces"][0]
    assert replay_trace(full).agreement == 1.0
    cut = dict(full, device_traces=[entries[: len(entries) // 2]])  # the snapshot still shows the end
    report = replay_trace(cut)
    assert report.agreement < 1.0 and any(m.startswith("final snapshot segment") for m in report.mismatches)


def test_a_pool_snapshot_is_compared_for_its_pools_only():
    """A snapshot of one pool (what MemPool.snapshot() gives) with the whole device's trace: the
    end is compared for that pool's segments, and a trace cut short still shows in them."""
    alloc, clockwork = make()
    capture = clockwork.new_stream()
    graph_pool = alloc.new_pool_id("handle")
    alloc.create_or_incref_pool(graph_pool)
    eager = [alloc.malloc(size, 0) for size in (5 * MiB, 300 * KiB)]  # default pool, alive at the end
    alloc.begin_allocate_to_pool(graph_pool, lambda s, t: s == capture.id)
    kept = [alloc.malloc(size, capture.id) for size in (30 * MiB, 700 * KiB)]
    alloc.free(alloc.malloc(12 * MiB, capture.id))
    alloc.end_allocate_to_pool(graph_pool)
    full = alloc.full_snapshot()
    pool_only = dict(full, segments=[s for s in full["segments"] if s["segment_pool_id"] == graph_pool])
    assert eager and kept and len(pool_only["segments"]) < len(full["segments"])

    assert replay_trace(full).agreement == 1.0
    unannounced = replay_trace(pool_only)  # the default pool's segments seem to be missing
    assert unannounced.agreement < 1.0
    assert all("(0, 0)" in m for m in unannounced.mismatches), unannounced
    report = replay_trace(pool_only, snapshot_pools=[graph_pool])
    assert report.agreement == 1.0 and report.checks > 10, report

    entries = full["device_traces"][0]
    before_free = next(i for i, e in enumerate(entries) if e["action"] == "free_requested")
    cut = dict(pool_only, device_traces=[entries[:before_free]])  # the 12 MiB block is never freed
    report = replay_trace(cut, snapshot_pools=[graph_pool])
    assert report.agreement < 1.0 and any(m.startswith("final snapshot segment") for m in report.mismatches)

    with pytest.raises(ValueError, match="snapshot_pools"):
        replay_trace(pool_only, snapshot_pools=[(0, 0)])


def test_an_empty_trace_makes_no_claim():
    report = replay_trace(snapshot_of([]))
    assert report.checks == 0 and report.agreement is None and report.mismatches == []
    assert report.unchecked == "no check could be made: the trace has no entries"
    assert str(report).startswith("agreement undefined: no check could be made") and "1.0" not in str(report)


def test_a_trace_of_one_entry_is_not_called_empty():
    report = replay_trace(snapshot_of([{"action": "snapshot", "addr": 0, "size": 0, "stream": 0}]))
    assert report.checks == 0 and report.agreement is None and report.events == 1
    assert report.unchecked == "no check could be made: its 1 entries change no allocator state (snapshot)"
    one = replay_trace(snapshot_of([entry("segment_alloc", A, 2 * MiB), entry("alloc", A, 512)],
                                   [segment(A, [(512, "active_allocated"), (2 * MiB - 512, "inactive")])]))
    assert one.agreement == 1.0 and one.checks == 3  # a trace of one allocation: its device call, its block, the end


def test_a_snapshot_shown_in_full_by_a_trace_without_entries_proves_nothing():
    """Every segment of the snapshot then lies before the trace and is rebuilt from the snapshot itself,
    expandable ones too: comparing them with themselves is no check."""
    snapshot = _expandable_churn_trace(300, seed=2)
    assert any(s["is_expandable"] for s in snapshot["segments"])
    report = replay_trace(dict(snapshot, device_traces=[[]]))
    assert report.checks == 0 and report.agreement is None and report.mismatches == []
    assert report.unchecked == "no check could be made: the trace has no entries"


def test_a_device_index_must_name_a_device_with_a_trace():
    snapshot = snapshot_of([entry("segment_alloc", A, 2 * MiB), entry("alloc", A, 512)])
    for bad in (-1, 1, True, "0"):
        with pytest.raises(ValueError, match=r"device=.*pass the index of a device|device 1 is not among them"):
            replay_trace(snapshot, device=bad)


def test_the_device_memory_must_be_a_positive_number_of_bytes():
    snapshot = snapshot_of([entry("segment_alloc", A, 2 * MiB), entry("alloc", A, 512)],
                           [segment(A, [(512, "active_allocated"), (2 * MiB - 512, "inactive")])])
    for bad in (1.5, 0, -1, True, "80GiB"):
        with pytest.raises(ValueError, match=r"device_memory=.*positive whole number of bytes"):
            replay_trace(snapshot, device_memory=bad)
    assert replay_trace(snapshot, device_memory=80 * 2**30).agreement == 1.0


@pytest.mark.parametrize("key", ["addr", "size", "stream"])
def test_a_negative_address_size_or_stream_in_a_trace_is_refused_naming_the_entry(key):
    entries = [entry("segment_alloc", A, 2 * MiB), entry("alloc", A, 512)]
    entries[1][key] = -512
    with pytest.raises(SnapshotFormatError, match=rf"device_traces\[0\]\[1\] \(alloc\) has {key} -512"):
        replay_trace(snapshot_of(entries))


def test_a_trace_said_to_start_empty_reports_memory_from_before_it():
    """Of one pool's snapshot, a prefix of the trace cannot be told from a trace that began mid-run: the
    caller who enabled history at the start says so, and the segments the trace never made are mismatches."""
    entries = [entry("segment_alloc", A, 2 * MiB), entry("alloc", A, 512)]
    final = [segment(A, [(512, "active_allocated"), (2 * MiB - 512, "inactive")]),
             dict(segment(B, [(2 * MiB, "inactive")]), segment_pool_id=(0, 9))]
    assert replay_trace(snapshot_of(entries, final)).agreement == 1.0  # B: memory from before the trace
    report = replay_trace(snapshot_of(entries, final), starts_empty=True)
    assert report.agreement < 1.0
    assert report.mismatches == [f"a segment at {B:#x} existed before the first entry of a trace that starts at an "
                                 "empty allocator: the trace and its snapshot disagree"]


def test_memory_of_a_pluggable_pool_from_before_the_trace_is_rebuilt_as_that_pool_s():
    """A MemPool over an arena puts its segments inside another pool's free blocks, off cudaMalloc's
    2 MiB grid. Before the trace began they were rebuilt as cudaMalloc memory, which raised; they are the
    arena's, and replaying the trace in them agrees."""
    alloc, clockwork = make()
    graph_pool = alloc.new_pool_id("handle")
    alloc.create_or_incref_pool(graph_pool)
    alloc.begin_allocate_to_pool(graph_pool, lambda s, t: True)
    alloc.free(alloc.malloc(40 * MiB, 0))  # a 40 MiB segment whose free block the arena lends out
    alloc.end_allocate_to_pool(graph_pool)
    (host,) = [s for s in alloc.snapshot() if s["segment_pool_id"] == graph_pool]
    arena = RunArena([(host["address"] + 4096, 30 * MiB)])  # off the 2 MiB grid
    borrow = alloc.new_pool_id("mempool")
    alloc.create_or_incref_pool(borrow, allocator=arena)
    alloc.begin_allocate_to_pool(borrow, lambda s, t: True)
    first = alloc.malloc(3 * MiB, 0)  # the arena's first segment, made before the history below
    alloc.record_history(False)
    alloc.record_history(True)
    second = alloc.malloc(500 * KiB, 0)
    alloc.free(first)
    alloc.free(second)
    alloc.end_allocate_to_pool(borrow)
    snapshot = alloc.full_snapshot()
    made = [e["addr"] for e in snapshot["device_traces"][0] if e["action"] == "segment_alloc"]
    assert first.segment.address % (2 * MiB) and first.segment.address not in made  # from before the trace
    report = replay_trace(snapshot)
    assert report.mid_run and report.mismatches == [] and report.agreement == 1.0, report
    assert report.checks >= 3


def test_a_snapshot_that_contradicts_its_trace_is_reported():
    entries = [entry("segment_alloc", A, 2 * MiB), entry("alloc", A, 4096)]
    wrong = [segment(A, [(8192, "active_allocated"), (2 * MiB - 8192, "inactive")])]
    report = replay_trace(snapshot_of(entries, wrong))
    assert report.agreement < 1.0 and "final snapshot segment" in report.mismatches[-1]


@pytest.mark.parametrize("start, ring", [(300, 10**6), (0, 500)], ids=["late start", "ring overflow"])
def test_mid_run_traces_are_rebuilt_and_replayed(start, ring):
    """History enabled late, or a ring buffer that dropped the oldest entries: the state at the first
    entry is rebuilt from the snapshot and the trace, then every check that can be made agrees."""
    snapshot = _churn_trace(900, seed=5, history_from=start, max_entries=ring)
    report = replay_trace(snapshot)
    assert report.mid_run and report.unverifiable < 0.01 * report.checks  # sizes of blocks from before: learned
    assert report.mismatches == [], report
    assert report.agreement == 1.0 and report.checks > 300


def test_foreign_input_is_refused_with_the_reason(tmp_path):
    with pytest.raises(SnapshotFormatError, match="_record_memory_history"):
        replay_trace({"segments": []})
    broken = tmp_path / "broken.pickle.gz"
    broken.write_bytes(b"not gzip")
    with pytest.raises(SnapshotFormatError, match="broken.pickle.gz is not a readable snapshot pickle"):
        replay_trace(broken)
    with pytest.raises(SnapshotFormatError, match="unknown action"):
        replay_trace(snapshot_of([entry("teleport", A, 1)]))


def test_traces_are_read_by_the_one_snapshot_reader():
    """A trace whose final snapshot is malformed is refused before the replay trusts it."""
    good = segment(A, [(4096, "active_allocated"), (2 * MiB - 4096, "inactive")])
    assert load_trace(snapshot_of([entry("alloc", A, 4096)], [good]))["segments"] == [good]
    negative = dict(good, blocks=[{"size": 4096, "state": "active_allocated"}, {"size": -4096, "state": "inactive"}])
    with pytest.raises(SnapshotFormatError, match="block 1 has size -4096"):
        replay_trace(snapshot_of([entry("alloc", A, 4096)], [negative]))
    overlapping = [good, segment(A + 1 * MiB, [(2 * MiB, "inactive")])]
    with pytest.raises(SnapshotFormatError, match="overlap partly"):
        replay_trace(snapshot_of([entry("alloc", A, 4096)], overlapping))


def test_snapshot_pools_must_be_pool_ids():
    snapshot = snapshot_of([entry("alloc", A, 4096)])
    for bad in ([], [(0,)], [("0", 1)]):
        with pytest.raises(ValueError, match="snapshot_pools must be pool ids"):
            replay_trace(snapshot, snapshot_pools=bad)


def test_a_release_that_failed_at_the_end_leaves_its_segment():
    """torch writes segment_free before cudaFree; when cudaFree fails (a free inside a capture) the
    segment stays. After the trace's last segment allocation, a release whose segment the snapshot
    still shows is that; anywhere else it is a contradiction."""
    entries = [
        entry("segment_alloc", A, 2 * MiB), entry("alloc", A, 4096),
        entry("free_requested", A, 4096), entry("free_completed", A, 4096),
        entry("segment_free", A, 2 * MiB),  # the cudaFree after this entry failed
    ]
    final = [segment(A, [(2 * MiB, "inactive")])]
    report = replay_trace(snapshot_of(entries, final))
    assert report.agreement == 1.0 and not report.mid_run and report.unverifiable == 0, report
    assert replay_trace(snapshot_of(entries)).agreement == 1.0  # the release that worked

    later = entries + [entry("segment_alloc", B, 2 * MiB), entry("alloc", B, 512)]
    final_later = final + [segment(B, [(512, "active_allocated"), (2 * MiB - 512, "inactive")])]
    report = replay_trace(snapshot_of(later, final_later))  # released, then the segment is back unallocated
    assert report.agreement < 1.0, report


def test_an_empty_cache_before_an_allocation_over_the_cap_is_not_its_retry():
    """Under a memory fraction with garbage collection, releases that complete a pending free just
    before an allocation that could not fit without them: the out-of-memory retry would have
    collected garbage first (its releases before the completion), so with a victim for garbage
    collection they were an empty_cache. Either reading leaves the same segments; only the order
    of the entries tells, and the statistics (no retry) must come out right."""
    from graphborrow.allocator.config import AllocatorConfig

    capacity, fraction = 64 * MiB, 0.5  # 32 MiB allowed, garbage collection above 16 MiB
    config = AllocatorConfig.from_settings({"garbage_collection_threshold": 0.5})
    clockwork = Clockwork()
    alloc = CachingAllocator(PhysicalMemory(capacity=capacity, backed=False), clockwork, config)
    alloc.set_memory_fraction(fraction)
    alloc.record_history()
    side = clockwork.new_stream()
    big = alloc.malloc(30 * MiB, 0)  # a 30 MiB segment
    small = alloc.malloc(4096, 0)  # a 2 MiB segment: 32 MiB reserved, all that is allowed
    side.enqueue(5.0)
    alloc.record_stream(small, side.id)
    alloc.free(small)  # pending until the side stream is done
    alloc.free(big)  # a whole free segment above the threshold: garbage collection's victim
    assert garbage_collection_victims(alloc)
    alloc.empty_cache()
    alloc.malloc(4096, side.id)  # a new small segment, for which the empty_cache made room
    snapshot = alloc.full_snapshot()
    actions = [e["action"] for e in snapshot["device_traces"][0] if e["action"] != "snapshot"]
    assert actions[-5:] == ["free_completed", "segment_free", "segment_free", "segment_alloc", "alloc"], actions
    report = replay_trace(snapshot, memory_fraction=fraction, device_memory=capacity)
    assert report.agreement == 1.0 and report.mismatches == [], report
    # read as the retry, the releases contradict the default pool, and a private pool is made up instead
    assert {report.inferred[f"segment at event {i}"] for i in (0, 2)} == {"(0, 0)"}, report.inferred


def _expandable_churn_trace(steps: int, seed: int, history_from: int = 0, max_entries: int = 10**6):
    """The simulator's own trace with expandable segments: churn on two streams, empty_cache now and then."""
    from graphborrow.allocator.config import AllocatorConfig

    clockwork = Clockwork()
    config = AllocatorConfig.from_settings({"expandable_segments": True})
    alloc = CachingAllocator(PhysicalMemory(backed=False), clockwork, config)
    side = clockwork.new_stream()
    rng = random.Random(seed)
    live = []
    for step in range(steps):
        if step == history_from:
            alloc.record_history(True, max_entries=max_entries)
        if rng.random() < 0.55 or not live:
            size = rng.choice([rng.randrange(1, 8 * KiB), rng.randrange(1, MiB), rng.randrange(MiB, 40 * MiB)])
            live.append(alloc.malloc(size, rng.choice([0, 0, side.id])))
        else:
            alloc.free(live.pop(rng.randrange(len(live))))
        if rng.random() < 0.03:
            alloc.empty_cache()
    return alloc.full_snapshot()


@pytest.mark.parametrize("start, ring", [(300, 10**6), (0, 500)], ids=["late start", "ring overflow"])
def test_expandable_reservations_from_before_the_trace_are_rebuilt(start, ring):
    """The mapped ranges at the first entry (the snapshot's, less what the trace mapped, plus what it
    unmapped) and their blocks are restored as reservations: every check is made and agrees, and
    the same trace cut short does not."""
    snapshot = _expandable_churn_trace(900, seed=5, history_from=start, max_entries=ring)
    entries = snapshot["device_traces"][0]
    assert entries[0]["action"] != "segment_map" and any(e["action"] == "segment_unmap" for e in entries)
    report = replay_trace(snapshot)
    assert report.mid_run and report.mismatches == [], report
    assert report.agreement == 1.0 and report.checks > 300 and report.unverifiable == 0, report
    for keep in (len(entries) // 2, len(entries) - 10):
        cut = replay_trace(dict(snapshot, device_traces=[entries[:keep]]))
        assert cut.agreement < 1.0, (keep, str(cut))


@pytest.mark.parametrize("start_mib,overlaps", [(-2, True), (2, True), (-4, False), (4, False)])
def test_a_segment_the_trace_made_and_released_over_memory_the_snapshot_kept_is_a_contradiction(start_mib, overlaps):
    """The snapshot's segment at A (4 MiB) was never allocated by the trace, so it lived all through it:
    a 4 MiB segment the trace made and released at A + start_mib MiB shared its memory when the two
    ranges meet, whether it starts before A or inside it."""
    kept = A + 8 * MiB
    other = kept + start_mib * MiB
    entries = [entry("segment_alloc", other, 4 * MiB), entry("segment_free", other, 4 * MiB)]
    final = [dict(segment(kept, [(4 * MiB, "inactive")]), segment_pool_id=(0, 9))]
    report = replay_trace(snapshot_of(entries, final))
    said = [m for m in report.mismatches if "was never allocated by the trace" in m]
    if overlaps:
        assert said == [f"final snapshot segment {4 * MiB} B at {kept:#x} was never allocated by the trace, yet the "
                        f"trace released the segment {4 * MiB} B at {other:#x} in its memory at event 1: the trace "
                        "and its snapshot disagree (a trace cut short, or a snapshot of another moment)"]
    else:
        assert said == []


def test_a_pluggable_segment_made_and_released_inside_memory_from_before_the_trace_is_the_arena_s():
    """The trace begins after the graph pool's segment was made; a borrow pool's arena then carves a
    segment out of its free block and gives it back, so the snapshot shows no segment of that pool.
    The segment lies inside memory that existed before the trace: it is the arena's, not cudaMalloc's."""
    alloc, clockwork = make()
    graph_pool = alloc.new_pool_id("handle")
    alloc.create_or_incref_pool(graph_pool)
    alloc.begin_allocate_to_pool(graph_pool, lambda s, t: True)
    alloc.free(alloc.malloc(40 * MiB, 0))
    alloc.end_allocate_to_pool(graph_pool)
    (host,) = [s for s in alloc.snapshot() if s["segment_pool_id"] == graph_pool]
    alloc.record_history(False)
    alloc.record_history(True)  # the trace starts here
    borrow = alloc.new_pool_id("mempool")
    alloc.create_or_incref_pool(borrow, allocator=RunArena([(host["address"] + 2 * MiB, 30 * MiB)]))
    alloc.begin_allocate_to_pool(borrow, lambda s, t: True)
    alloc.free(alloc.malloc(12 * MiB, 0))
    alloc.end_allocate_to_pool(borrow)
    alloc.release_pool(borrow)  # use_mem_pool's exit
    alloc.release_pool(borrow)  # the MemPool deleted
    alloc.empty_cache()  # its free segment goes back to the arena
    snapshot = alloc.full_snapshot()
    assert [s["segment_pool_id"] for s in snapshot["segments"]] == [graph_pool]
    report = replay_trace(snapshot)
    assert report.mid_run and report.mismatches == [] and report.agreement == 1.0, report
