"""The snapshot reader: random valid snapshots against a unit-grid oracle, random corruptions."""

import copy
import pickle
from pathlib import Path

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from graphborrow.core.errors import SnapshotFormatError
from graphborrow.core.runs import find_free_runs, summarize
from graphborrow.core.snapshot import check_segments, load_snapshot, nested_in

UNIT = 512
DATA = Path(__file__).resolve().parents[2] / "data"
STATES = ("inactive", "active_allocated", "active_pending_free")


def make_segment(address, blocks, pool=(0, 1)):
    out, at = [], address
    for state, size in blocks:
        out.append({"address": at, "size": size, "state": state, "requested_size": size, "frames": []})
        at += size
    return {
        "device": 0,
        "address": address,
        "total_size": at - address,
        "allocated_size": sum(s for st_, s in blocks if st_ == "active_allocated"),
        "active_size": sum(s for st_, s in blocks if st_ != "inactive"),
        "stream": 0,
        "segment_type": "large",
        "segment_pool_id": pool,
        "blocks": out,
    }


blocks_st = st.lists(st.tuples(st.sampled_from(STATES), st.integers(1, 12)), min_size=1, max_size=8)


@st.composite
def snapshots(draw):
    """Disjoint segments at random gaps, some with segments nested in their free blocks (several
    in one block too, side by side or apart, as a borrow pool's arena carves them)."""
    segments, at = [], 1 << 30
    for layout in draw(st.lists(blocks_st, min_size=0, max_size=6)):
        at += draw(st.integers(0, 8)) * UNIT
        outer = make_segment(at, [(s, n * UNIT) for s, n in layout])
        segments.append(outer)
        at += outer["total_size"]
        for host in [b for b in outer["blocks"] if b["state"] == "inactive" and b["size"] >= 2 * UNIT]:
            if not draw(st.booleans()):
                continue
            units = host["size"] // UNIT
            points = sorted(draw(st.sets(st.integers(0, units), min_size=2, max_size=6)))
            for lo, hi in zip(points, points[1:]):  # consecutive ranges, each nested or not
                if not draw(st.booleans()):
                    continue
                inner_units = hi - lo
                cuts = sorted(draw(st.sets(st.integers(1, max(inner_units - 1, 1)), max_size=3)) - {inner_units})
                sizes = [b - a for a, b in zip([0, *cuts], [*cuts, inner_units])]
                inner_blocks = [(draw(st.sampled_from(STATES)), n * UNIT) for n in sizes]
                segments.append(make_segment(host["address"] + lo * UNIT, inner_blocks, pool=(0, 5)))
    order = draw(st.permutations(range(len(segments))))
    return [segments[k] for k in order]


def oracle_runs(segments, whole_only=False):
    """Free runs on a grid of 512-byte units. Each unit belongs to the innermost segment
    covering it (a nested segment's memory counts once, for the nested one) and is free
    when that segment's block there is inactive; runs are maximal stretches of free units
    of one segment. Shares no code with runs.py."""
    owner, free = {}, {}

    def wholly_free(s):
        return len(s["blocks"]) == 1 and s["blocks"][0]["state"] == "inactive"

    # outer ones first, so inner ones take their units over; of two equal ranges the wholly
    # free one is the host (the convention both sides state)
    for i, s in sorted(enumerate(segments), key=lambda p: (-p[1]["total_size"], not wholly_free(p[1]))):
        for b in s["blocks"]:
            for u in range(b["address"] // UNIT, (b["address"] + b["size"]) // UNIT):
                owner[u], free[u] = i, b["state"] == "inactive"
    runs = []
    for i in range(len(segments)):
        units = sorted(u for u in owner if owner[u] == i)
        if whole_only and (not all(free[u] for u in units) or len(units) * UNIT != segments[i]["total_size"]):
            continue
        start = prev = None
        for u in units + [None]:
            if u is not None and free[u] and (start is None or u == prev + 1):
                start = u if start is None else start
            else:
                if start is not None:
                    runs.append((start * UNIT, (prev + 1 - start) * UNIT))
                start = u if (u is not None and free[u]) else None
            prev = u
    return sorted(runs, key=lambda r: (-r[1], r[0]))


@given(snapshots())
def test_runs_of_random_valid_snapshots_match_the_grid_oracle(segments):
    assert load_snapshot(segments)["segments"] == segments
    assert find_free_runs(segments) == oracle_runs(segments)
    assert find_free_runs(segments, "whole_segments") == oracle_runs(segments, whole_only=True)
    runs = find_free_runs(segments)
    assert summarize(segments)["run_bytes"] == sum(n for _, n in runs)
    for (a, n), (b, m) in zip(sorted(runs), sorted(runs)[1:]):
        assert a + n <= b  # disjoint


def test_the_h200_borrow_snapshot_nests_the_borrow_pool_and_its_memory_counts_once():
    snapshot = load_snapshot(DATA / "traces" / "borrow_cycles.pickle", need_traces=True)
    segments = snapshot["segments"]
    hosts = nested_in(segments)
    assert hosts and all(segments[k]["segment_pool_id"] != segments[h]["segment_pool_id"] for k, h in hosts.items())
    runs = find_free_runs(segments)
    assert runs == oracle_runs(segments)
    nested = [(segments[k]["address"], segments[k]["address"] + segments[k]["total_size"]) for k in hosts]
    for a, n in runs:  # a run is the borrow pool's (inside its segment) or the graph pool's (outside)
        assert all(a + n <= lo or hi <= a or (lo <= a and a + n <= hi) for lo, hi in nested)
    assert summarize(segments)["reserved_bytes"] == sum(
        s["total_size"] for k, s in enumerate(segments) if k not in hosts
    )


def test_every_source_form_reads_the_same(tmp_path):
    segments = [make_segment(1 << 30, [("inactive", 4096), ("active_allocated", 512)])]
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps({"segments": segments, "device_traces": [[]], "allocator_settings": {}}))
    from_path = load_snapshot(path)
    assert from_path["segments"] == segments and from_path["allocator_settings"] == {}
    assert load_snapshot(str(path))["segments"] == segments
    assert load_snapshot({"segments": segments})["segments"] == segments
    assert load_snapshot(segments) == {"segments": segments}
    assert load_snapshot(tuple(segments))["segments"] == segments


def test_traces_are_required_on_demand_and_checked():
    segments = [make_segment(1 << 30, [("inactive", 4096)])]
    with pytest.raises(SnapshotFormatError, match="_record_memory_history"):
        load_snapshot(segments, need_traces=True)
    with pytest.raises(SnapshotFormatError, match="empty"):
        load_snapshot({"segments": segments, "device_traces": [[]]}, need_traces=True)
    entry = {"action": "alloc", "addr": 1 << 30, "size": 512, "stream": 0}
    assert load_snapshot({"segments": segments, "device_traces": [[entry]]}, need_traces=True)
    for broken, fragment in [
        ({**entry, "size": "512"}, "must be an integer"),
        ({k: v for k, v in entry.items() if k != "addr"}, "lacks 'addr'"),
        ({"size": 1}, "not a trace entry"),
        ({"action": "oom", "size": 512}, "lacks 'device_free'"),
    ]:
        with pytest.raises(SnapshotFormatError, match=fragment):
            load_snapshot({"segments": segments, "device_traces": [[entry, broken]]})
    with pytest.raises(SnapshotFormatError, match="one per device"):
        load_snapshot({"segments": segments, "device_traces": {"0": []}})
    for name in ("borrow_cycles", "graph_ladder", "default_churn"):  # recorded on an H200
        assert load_snapshot(DATA / "traces" / f"{name}.pickle", need_traces=True)


def test_unreadable_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_snapshot(tmp_path / "missing.pickle")
    with pytest.raises(SnapshotFormatError, match="directory"):
        load_snapshot(tmp_path)
    half = tmp_path / "half.pickle"
    half.write_bytes(pickle.dumps({"segments": [make_segment(1 << 30, [("inactive", 4096)])]})[:40])
    with pytest.raises(SnapshotFormatError, match="not a readable snapshot pickle"):
        load_snapshot(half)
    with pytest.raises(SnapshotFormatError, match="expected a list of segment dicts"):
        load_snapshot(42)
    with pytest.raises(SnapshotFormatError, match="'segments' is a dict"):
        load_snapshot({"segments": {"0": {}}})


# ---------------------------------------------------------------- corruptions


def _corrupt(segments, kind, pick, junk):
    """Apply one corruption; return the segment index the error must name (and a message fragment)."""
    i = pick % len(segments)
    seg = segments[i]
    blocks = seg["blocks"]
    j = pick % len(blocks)
    if kind == "negative size":
        blocks[j]["size"] = -blocks[j]["size"]
        return i, "block sizes are positive"
    if kind == "zero size":
        blocks[j]["size"] = 0
        return i, "block sizes are positive"
    if kind == "gap":
        assume(j > 0)
        blocks[j]["address"] += UNIT
        return i, "a gap no block covers"
    if kind == "overlap":
        assume(j > 0)
        blocks[j]["address"] -= UNIT
        return i, "blocks overlap"
    if kind == "moved start":
        blocks[0]["address"] += UNIT
        return i, "not at its segment's address"
    if kind == "sum":
        seg["total_size"] += UNIT
        return i, "but total_size is"
    if kind == "allocated_size":
        seg["allocated_size"] += UNIT
        return i, "allocated_size is"
    if kind == "wrong type":
        target, key = [(seg, "address"), (seg, "total_size"), (blocks[j], "address"), (blocks[j], "size")][pick % 4]
        target[key] = junk
        return i, "must be an integer"
    if kind == "missing key":
        target, key = [(seg, "address"), (seg, "total_size"), (seg, "blocks"), (blocks[j], "size"), (blocks[j], "state")][pick % 5]
        del target[key]
        return i, repr(key)
    if kind == "unknown state":
        blocks[j]["state"] = "free"
        return i, "known states"
    if kind == "block not a dict":
        blocks[j] = (blocks[j]["address"], blocks[j]["size"])
        return i, "not a dict"
    if kind == "segment not a dict":
        segments[i] = list(seg.items())
        return i, "not a dict"
    if kind == "no blocks":
        seg["blocks"] = []
        return i, "non-empty list"
    if kind == "partial overlap":
        assume(seg["total_size"] >= 2 * UNIT)  # so the intruder starts inside and ends outside
        end = seg["address"] + seg["total_size"]
        intruder = make_segment(end - UNIT, [("inactive", 2 * UNIT)])
        segments.append(intruder)
        assume(all(s["address"] >= end + UNIT or s is seg or s is intruder or s["address"] + s["total_size"] <= seg["address"]
                   for s in segments))
        return len(segments) - 1, "overlap"
    raise AssertionError(kind)


CORRUPTIONS = [
    "negative size", "zero size", "gap", "overlap", "moved start", "sum", "allocated_size", "wrong type",
    "missing key", "unknown state", "block not a dict", "segment not a dict", "no blocks", "partial overlap",
]


@given(snapshots(), st.sampled_from(CORRUPTIONS), st.integers(0, 10**6),
       st.sampled_from(["4096", 4096.0, None, True, [4096]]))
def test_every_corruption_is_refused_with_a_message_naming_the_segment(segments, kind, pick, junk):
    outer = [s for k, s in enumerate(segments) if k not in nested_in(segments)]
    assume(outer)
    segments = copy.deepcopy(outer)  # nested segments would make some corruptions ambiguous
    index, fragment = _corrupt(segments, kind, pick, junk)
    with pytest.raises(SnapshotFormatError) as info:
        find_free_runs(segments)
    message = str(info.value)
    assert fragment in message
    assert f"segment {index}" in message


def test_a_segment_nested_over_a_live_block_is_refused():
    host = make_segment(1 << 30, [("active_allocated", 4096), ("inactive", 4096)])
    inner = make_segment(1 << 30, [("inactive", 2048)], pool=(0, 5))
    with pytest.raises(SnapshotFormatError, match="not inside one of its free blocks"):
        find_free_runs([host, inner])
    straddling = make_segment((1 << 30) + 2048, [("inactive", 4096)], pool=(0, 5))
    with pytest.raises(SnapshotFormatError, match="not inside one of its free blocks"):
        find_free_runs([host, straddling])


def test_summary_of_an_empty_and_of_a_small_snapshot():
    assert summarize([]) == {
        "segments": 0, "reserved_bytes": 0, "inactive_bytes": 0, "runs": 0, "run_bytes": 0,
        "largest_run": 0, "whole_segment_runs": 0, "whole_segment_bytes": 0,
    }
    segments = [
        make_segment(1 << 30, [("inactive", 4096), ("active_allocated", 512), ("inactive", 1024)]),
        make_segment(2 << 30, [("inactive", 8192)]),
    ]
    assert summarize(segments) == {
        "segments": 2, "reserved_bytes": 4096 + 512 + 1024 + 8192, "inactive_bytes": 4096 + 1024 + 8192,
        "runs": 3, "run_bytes": 4096 + 1024 + 8192, "largest_run": 8192,
        "whole_segment_runs": 1, "whole_segment_bytes": 8192,
    }


def test_trace_errors_name_the_entry_exactly():
    segments = [make_segment(1 << 30, [("inactive", 4096)])]
    entry = {"action": "alloc", "addr": 1 << 30, "size": 512, "stream": 0}
    with pytest.raises(SnapshotFormatError) as info:
        load_snapshot({"segments": segments, "device_traces": [[entry, {**entry, "stream": None}]]})
    assert str(info.value) == "device_traces[0][1] (alloc): 'stream' is None (NoneType); it must be an integer"
    with pytest.raises(SnapshotFormatError, match="one per device"):
        load_snapshot({"segments": segments, "device_traces": [[entry], {"a": 1}]})
    far = {**entry, "action": "segment_map", "addr": 1 << 70}  # replayed at 0.9983 before, as if mapped
    with pytest.raises(SnapshotFormatError, match=r"device_traces\[0\]\[0\] \(segment_map\): .* runs past the end"):
        load_snapshot({"segments": segments, "device_traces": [[far]]})


def test_of_two_segments_with_the_same_range_the_wholly_free_one_hosts():
    inner = make_segment(1 << 30, [("active_allocated", 512), ("inactive", 512)], pool=(0, 5))
    host = make_segment(1 << 30, [("inactive", 1024)], pool=(0, 1))
    single_live = make_segment(1 << 30, [("active_allocated", 1024)], pool=(0, 5))
    for segments in ([inner, host], [host, inner]):
        hosts = nested_in(segments)
        assert hosts == {segments.index(inner): segments.index(host)}
        assert find_free_runs(segments) == [((1 << 30) + 512, 512)]  # the inner pool's own free block
    assert nested_in([single_live, host]) == {0: 1} and find_free_runs([single_live, host]) == []
    two_free = make_segment(1 << 30, [("inactive", 512), ("inactive", 512)], pool=(0, 5))
    assert nested_in([two_free, host]) == {0: 1}  # one block of the host covers it, not two


def test_segment_and_file_errors_read_exactly():
    with pytest.raises(SnapshotFormatError) as info:
        load_snapshot([["not", "a", "dict"]])
    assert str(info.value) == "segment 0 is a list, not a dict"
    with pytest.raises(SnapshotFormatError) as info:
        load_snapshot([{"address": 1 << 30, "total_size": 512}])
    assert str(info.value) == (
        "segment 0 has no 'blocks'; take the snapshot with torch.cuda.memory_snapshot(), "
        "which lists blocks per segment"
    )
    with pytest.raises(SnapshotFormatError) as info:
        load_snapshot([{"address": 1 << 30, "blocks": []}])
    assert str(info.value) == "segment 0 has no 'total_size'"
    with pytest.raises(SnapshotFormatError) as info:
        load_snapshot([{**make_segment(1 << 30, [("inactive", 512)]), "total_size": 512.0}])
    assert str(info.value) == "segment 0 (address 0x40000000): 'total_size' is 512.0 (float); it must be an integer"
    with pytest.raises(SnapshotFormatError) as info:
        load_snapshot([{**make_segment(1 << 30, [("inactive", 512)]), "address": "0x40000000"}])
    assert str(info.value) == "segment 0: 'address' is '0x40000000' (str); it must be an integer"
    with pytest.raises(SnapshotFormatError) as info:
        load_snapshot([{**make_segment(1 << 30, [("inactive", 512)]), "address": 0}])
    assert str(info.value) == "segment 0: address 0 is not a positive device address"
    with pytest.raises(SnapshotFormatError) as info:
        load_snapshot([{**make_segment(1 << 30, [("inactive", 512)]), "blocks": [["inactive", 512]]}])
    assert str(info.value) == "segment 0 (address 0x40000000) block 0 is a list, not a dict"


def test_a_truncated_pickle_names_the_unpickling_error(tmp_path):
    half = tmp_path / "half.pickle"
    half.write_bytes(pickle.dumps([make_segment(1 << 30, [("inactive", 512)])])[:30])
    with pytest.raises(SnapshotFormatError) as info:
        load_snapshot(half)
    assert "(UnpicklingError: " in str(info.value) or "(EOFError: " in str(info.value)


def test_blocks_without_addresses_follow_each_other_only_on_request(tmp_path):
    """The replay reads hand-built traces whose blocks carry no address: they are taken to
    follow each other, and every other rule still holds. Free-run discovery needs them."""
    host = make_segment(1 << 30, [("active_allocated", 4096), ("inactive", 8192)])
    bare = copy.deepcopy(host)
    for block in bare["blocks"]:
        del block["address"]
    with pytest.raises(SnapshotFormatError, match="block 0 lacks 'address'"):
        load_snapshot([bare])
    assert load_snapshot([bare], block_addresses=False)["segments"] == [bare]
    short = copy.deepcopy(bare)
    short["total_size"] += 512
    with pytest.raises(SnapshotFormatError, match="cover 12288 bytes but total_size is 12800"):
        load_snapshot([short], block_addresses=False)
    # a segment nested in the bare one's free block is found by the blocks' sizes alone
    inner = make_segment((1 << 30) + 4096, [("inactive", 8192)])
    assert nested_in(load_snapshot([bare, inner], block_addresses=False)["segments"]) == {1: 0}
    live = make_segment(1 << 30, [("inactive", 4096)])
    with pytest.raises(SnapshotFormatError, match=r"block at 0x40000000 is active_allocated"):
        load_snapshot([bare, live], block_addresses=False)
    # gzipped pickles, as the trace corpus stores them
    import gzip

    path = tmp_path / "trace.pickle.gz"
    path.write_bytes(gzip.compress(pickle.dumps({"segments": [host], "device_traces": [[]]})))
    assert load_snapshot(path)["segments"] == [host]


def test_partial_overlap_names_both_ranges():
    first = make_segment(1 << 30, [("inactive", 8192)])
    second = make_segment((1 << 30) + 4096, [("inactive", 8192)])
    with pytest.raises(SnapshotFormatError) as info:
        load_snapshot([first, second])
    assert "segment 1 [0x40001000, 0x40003000) and segment 0 [0x40000000, 0x40002000) overlap partly" in str(info.value)


def test_block_and_size_errors_read_exactly():
    where = "segment 0 (address 0x40000000)"
    good = make_segment(1 << 30, [("active_allocated", 512), ("inactive", 1024)])
    bare = copy.deepcopy(good)
    for block in bare["blocks"]:
        del block["address"]
    with pytest.raises(SnapshotFormatError, match=r"block 0 lacks 'address'"):
        check_segments([bare])  # block addresses are required unless asked otherwise
    empty = {**copy.deepcopy(good), "total_size": 0}
    with pytest.raises(SnapshotFormatError) as info:
        check_segments([empty])
    assert str(info.value) == f"{where}: total_size 0 is not positive"
    fractional = copy.deepcopy(good)
    fractional["blocks"][1]["size"] = 1024.0
    with pytest.raises(SnapshotFormatError) as info:
        check_segments([fractional])
    assert str(info.value) == f"{where} block 1: 'size' is 1024.0 (float); it must be an integer"
    gap = copy.deepcopy(good)
    gap["blocks"][1]["address"] += 512
    with pytest.raises(SnapshotFormatError) as info:
        check_segments([gap])
    assert str(info.value) == (
        f"{where} block 1 (address 0x40000400) starts 512 bytes after block 0 ends: a gap no block covers"
    )
    for key in ("allocated_size", "active_size"):
        wrong = {**copy.deepcopy(good), key: 1536}
        with pytest.raises(SnapshotFormatError) as info:
            check_segments([wrong])
        assert str(info.value) == f"{where}: {key} is 1536 but its blocks add up to 512"
    one_byte = make_segment(1 << 30, [("inactive", 1), ("active_allocated", 511)])
    assert check_segments([one_byte]) == [one_byte]  # 1 is a positive size, whatever the allocator rounds to
    cases = [  # (change to the good segment, exact message)
        (lambda g: [g["blocks"][1].pop(k) for k in ("size", "state")],
         f"{where} block 1 lacks 'size', 'state'; every block needs 'address', 'size', 'state'"),
        (lambda g: g["blocks"][1].update(address="0x40000200"),
         f"{where} block 1: 'address' is '0x40000200' (str); it must be an integer"),
        (lambda g: g["blocks"][1].update(size=0), f"{where} block 1 has size 0; block sizes are positive"),
        (lambda g: g["blocks"][1].update(state="busy"),
         f"{where} block 1 has state 'busy'; known states: active_allocated, "
         "active_pending_free, active_awaiting_free, inactive"),
        (lambda g: [b.update(address=b["address"] + 512) for b in g["blocks"]],
         f"{where} block 0 (address 0x40000200) starts at 0x40000200, not at its segment's address"),
        (lambda g: g["blocks"][1].update(address=g["blocks"][1]["address"] - 256),
         f"{where} block 1 (address 0x40000100) starts 256 bytes inside block 0: blocks overlap"),
        (lambda g: g.update(total_size=2048), f"{where}: its blocks cover 1536 bytes but total_size is 2048"),
        (lambda g: g.update(allocated_size="512"), f"{where}: 'allocated_size' is '512' (str); it must be an integer"),
    ]
    for change, message in cases:
        bad = copy.deepcopy(good)
        change(bad)
        with pytest.raises(SnapshotFormatError) as info:
            check_segments([bad])
        assert str(info.value) == message


def test_what_is_not_a_snapshot_is_named_with_its_origin(tmp_path):
    keys = {f"k{i}": i for i in range(10)}
    with pytest.raises(SnapshotFormatError) as info:
        load_snapshot(keys)
    assert str(info.value).startswith(
        "snapshot is a dict with no 'segments' key (keys: ['k0', 'k1', 'k2', 'k3', 'k4', 'k5', 'k6', 'k7']); "
    )
    with pytest.raises(SnapshotFormatError) as info:
        load_snapshot(42)
    assert str(info.value).startswith("snapshot is a int; expected a list of segment dicts or a dict with 'segments'")
    path = tmp_path / "other.pickle"
    path.write_bytes(pickle.dumps({"weights": 1}))
    with pytest.raises(SnapshotFormatError) as info:
        load_snapshot(path)
    assert str(info.value).startswith(f"{path} is a dict with no 'segments' key (keys: ['weights'])")
    with pytest.raises(SnapshotFormatError) as info:
        check_segments("not a list")
    assert str(info.value) == "'segments' is a str; expected a list of segment dicts"


def test_a_segment_listed_twice_in_its_pool_is_refused_and_other_pools_may_share_a_range():
    """The summary had counted the repeated segment's bytes twice."""
    host = make_segment(1 << 30, [("inactive", 1024)], pool=(0, 1))
    with pytest.raises(SnapshotFormatError, match=r"segment 1 repeats segment 0 \[0x40000000, 0x40000400\) in the same pool"):
        check_segments([host, dict(host)])
    assert len(nested_in([make_segment(1 << 30, [("inactive", 1024)], pool=(0, 5)), host])) == 1  # one hosts the other


@pytest.mark.parametrize("pool", [(0, "x"), (0,), "0,1", (0, 1.5), (True, 1)])
def test_a_pool_id_that_is_not_two_integers_is_refused(pool):
    with pytest.raises(SnapshotFormatError, match=r"segment 0 .*segment_pool_id .* is not a pool id; torch writes two integers"):
        check_segments([make_segment(1 << 30, [("inactive", 1024)], pool=pool)])

