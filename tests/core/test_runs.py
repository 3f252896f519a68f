"""Free-run discovery over torch-format segment lists."""

import json
import pickle
from pathlib import Path

import pytest

from graphborrow.core.errors import SnapshotFormatError
from graphborrow.core.runs import find_free_runs, load_snapshot, summarize

MiB = 1 << 20


def segment(address, blocks):
    out, at = [], address
    for state, size in blocks:
        out.append({"address": at, "size": size, "state": state, "requested_size": 0, "frames": []})
        at += size
    return {
        "address": address,
        "total_size": at - address,
        "allocated_size": sum(s for st, s in blocks if st == "active_allocated"),
        "stream": 0,
        "segment_type": "large",
        "segment_pool_id": (0, 1),
        "blocks": out,
    }


MIXED = [
    segment(0x1000_0000, [("inactive", 4 * MiB), ("inactive", 2 * MiB), ("active_allocated", MiB), ("inactive", 3 * MiB)]),
    segment(0x2000_0000, [("inactive", 20 * MiB)]),
    segment(0x2000_0000 + 20 * MiB, [("inactive", 8 * MiB)]),  # adjacent, but another segment
    segment(0x3000_0000, [("active_pending_free", 5 * MiB), ("inactive", MiB)]),
]


def test_runs_merge_inactive_blocks_and_stop_at_live_ones():
    runs = find_free_runs(MIXED)
    assert runs == [
        (0x2000_0000, 20 * MiB),
        (0x2000_0000 + 20 * MiB, 8 * MiB),  # never merged across segments
        (0x1000_0000, 6 * MiB),
        (0x1000_0000 + 7 * MiB, 3 * MiB),
        (0x3000_0000 + 5 * MiB, MiB),  # pending-free blocks are not free yet
    ]


def test_whole_segment_policy_skips_mixed_segments():
    runs = find_free_runs(MIXED, policy="whole_segments")
    assert runs == [(0x2000_0000, 20 * MiB), (0x2000_0000 + 20 * MiB, 8 * MiB)]


def test_ties_sort_by_address():
    segs = [segment(0x5000_0000, [("inactive", MiB)]), segment(0x4000_0000, [("inactive", MiB)])]
    assert find_free_runs(segs) == [(0x4000_0000, MiB), (0x5000_0000, MiB)]


def test_summary_counts_both_policies():
    s = summarize(MIXED)
    assert s["segments"] == 4
    assert s["run_bytes"] == 38 * MiB and s["runs"] == 5
    assert s["whole_segment_bytes"] == 28 * MiB
    assert s["largest_run"] == 20 * MiB
    assert s["reserved_bytes"] == 44 * MiB


def test_full_snapshot_dict_and_pickle_file_are_accepted(tmp_path):
    path = tmp_path / "snap.pickle"
    with open(path, "wb") as f:
        pickle.dump({"segments": MIXED, "device_traces": [[]]}, f)
    assert find_free_runs(path) == find_free_runs(MIXED)
    assert find_free_runs({"segments": MIXED}) == find_free_runs(MIXED)


@pytest.mark.parametrize(
    "segments, fragment",
    [
        ([{"address": 1, "total_size": 1}], "no 'blocks'"),
        ([{"address": 1, "blocks": []}], "no 'total_size'"),
        ([{"address": 1, "total_size": 1, "blocks": [{"size": 1, "address": 1}]}], "'state'"),
        ([{"address": 1, "total_size": 1, "blocks": [{"state": "inactive", "address": 1}]}], "'size'"),
        ([{"address": 1, "total_size": 1, "blocks": [{"state": "inactive", "size": 1}]}], "'address'"),
        ({"device_traces": []}, "no 'segments'"),
        (42, "list of segment dicts"),
    ],
)
def test_malformed_snapshots_name_what_is_missing(segments, fragment):
    with pytest.raises(SnapshotFormatError, match=fragment):
        find_free_runs(segments)


def test_malformed_files_raise_a_clear_error(tmp_path):
    bad = tmp_path / "bad.pickle"
    bad.write_bytes(b"not a pickle")
    with pytest.raises(SnapshotFormatError, match="not a readable snapshot"):
        load_snapshot(bad)
    empty = tmp_path / "empty.pickle"
    with open(empty, "wb") as f:
        pickle.dump({"traces": []}, f)
    with pytest.raises(SnapshotFormatError, match="no 'segments'"):
        load_snapshot(empty)


def test_unknown_policy():
    with pytest.raises(ValueError, match="policy must be one of"):
        find_free_runs(MIXED, policy="largest")


DATA = Path(__file__).resolve().parents[2] / "data"


def test_runs_on_the_h200_ladder_snapshot_match_what_was_measured_there():
    """A snapshot recorded on an H200 (Llama-3-8B-shaped ladder) and the run sizes the
    same code found on that machine (data/core_h200.json)."""
    snapshot = load_snapshot(DATA / "h200_ladder_segments.pickle")
    measured = json.loads((DATA / "core_h200.json").read_text())
    segments = snapshot["segments"]
    for policy in ("runs", "whole_segments"):
        assert [n for _, n in find_free_runs(segments, policy)] == measured["runs_by_policy"][policy]
    runs = find_free_runs(segments)
    inactive = sum(b["size"] for s in segments for b in s["blocks"] if b["state"] == "inactive")
    assert sum(n for _, n in runs) == inactive
    for address, nbytes in runs:  # each run lies in one segment and covers only free blocks
        seg = [s for s in segments if s["address"] <= address < s["address"] + s["total_size"]]
        assert len(seg) == 1 and address + nbytes <= seg[0]["address"] + seg[0]["total_size"]
        covered = [b for b in seg[0]["blocks"] if address <= b["address"] < address + nbytes]
        assert covered and all(b["state"] == "inactive" for b in covered)
    assert summarize(segments)["whole_segment_bytes"] < summarize(segments)["run_bytes"]
