"""Bring your own snapshot: the H200's recorded pools read back, checked against what the GPU measured."""

import json
import pickle
from pathlib import Path

import pytest

from graphborrow.__main__ import main
from graphborrow.core.errors import SnapshotFormatError
from graphborrow.studies.inspection import (
    format_report,
    inspect_snapshot,
    plot_report,
    read_snapshot,
)

DATA = Path(__file__).resolve().parents[2] / "data"
H200_LADDER = DATA / "h200_ladder_segments.pickle"  # the Llama-3-8B-shaped ladder pool of the H200 runs
TRACE_LADDER = DATA / "traces" / "graph_ladder.pickle"  # a full _snapshot(): default pool and a graph pool


def test_h200_pool_runs_match_what_the_gpu_reported():
    """Run totals under both rules equal the numbers core_gpu.py printed on the H200 for the same pool."""
    gpu = json.loads((DATA / "core_h200.json").read_text())
    report = inspect_snapshot(H200_LADDER, batches=(1,), draft_tokens=(1,), modes=("lean",), vocab=16)
    assert report.planned_pool == (0, 1)
    pool = report.pool((0, 1))
    assert pool.reserved_bytes == gpu["pool"]["reserved_bytes"]
    assert pool.inactive_bytes == gpu["pool"]["inactive_bytes"]
    assert [n for _, n in pool.runs] == gpu["runs_by_policy"]["runs"]
    assert [n for _, n in pool.whole_segment_runs] == gpu["runs_by_policy"]["whole_segments"]


def test_h200_fit_agrees_with_the_steps_that_ran_on_the_gpu():
    """Standard verification at 8 drafts, V=128256: bs=32 ran in the borrowed runs on the H200, bs=64 ran out."""
    eagle = json.loads((DATA / "eagle_h200.json").read_text())
    ran = {p["bs"]: p["ok"] for p in eagle["points"] if p["draft_tokens"] == 8 and p["mode"] == "standard+borrow"}
    assert ran[32] is True and ran[64] is False
    report = inspect_snapshot(H200_LADDER, batches=(32, 64), draft_tokens=(8,), modes=("standard",))
    assert {r["batch_size"]: r["fits"] for r in report.fit} == {32: True, 64: False}
    assert report.largest_fitting_batch(8) == 32
    text = format_report(report)
    assert "largest batch that fits at 8 draft tokens: standard 32" in text
    assert "why bs=64 x 8 standard does not fit" in text


def test_a_full_snapshot_lists_every_pool_and_borrows_from_the_graph_pool():
    with open(TRACE_LADDER, "rb") as f:
        raw = pickle.load(f)
    report = inspect_snapshot(TRACE_LADDER, batches=(1,), draft_tokens=(4,), modes=("standard",), vocab=32000)
    ids = {tuple(s["segment_pool_id"]) for s in raw["segments"]}
    assert {p.pool_id for p in report.pools} == ids == {(0, 0), (0, 1)}
    assert report.planned_pool == (0, 1) and report.pools[0].pool_id == (0, 1)
    for p in report.pools:
        segs = [s for s in raw["segments"] if tuple(s["segment_pool_id"]) == p.pool_id]
        assert p.reserved_bytes == sum(s["total_size"] for s in segs)
        assert p.allocated_bytes == sum(s["allocated_size"] for s in segs)
    assert any("allocator_settings" in n for n in report.notes)
    default = inspect_snapshot(TRACE_LADDER, batches=(1,), draft_tokens=(4,), modes=("lean",), pool_id=(0, 0))
    assert default.planned_pool == (0, 0)


def test_a_segment_list_without_pool_ids_is_planned_against_the_default_pool():
    with open(H200_LADDER, "rb") as f:
        segments = pickle.load(f)["segments"]
    bare = [{k: v for k, v in s.items() if k != "segment_pool_id"} for s in segments]
    report = inspect_snapshot(bare, batches=(32,), draft_tokens=(8,), modes=("standard",))
    assert report.planned_pool == (0, 0) and report.fit[0]["fits"]
    assert any("no private pool" in n for n in report.notes)


def test_the_memory_map_outlines_every_run_of_the_pool():
    report = inspect_snapshot(H200_LADDER, batches=(1,), draft_tokens=(1,), modes=("lean",), vocab=16)
    fig = plot_report(report)
    outlined = [p for p in fig.axes[0].patches if (p.get_gid() or "").startswith("run")]
    assert len(outlined) == len(report.pool((0, 1)).runs) == 9
    assert "1010.9 MiB in 9 free runs" in fig.axes[0].get_title()


@pytest.mark.parametrize("content, message", [
    (b"not a pickle", "is not a readable snapshot pickle"),
    (pickle.dumps(42), "expected a list of segment dicts or a dict with 'segments'"),
    (pickle.dumps({"segments": []}), "holds no segments"),
    (pickle.dumps({"segments": [{"address": 0}]}), "segment 0 has no 'total_size'"),
    (pickle.dumps({"segments": "x"}), "'segments' is a str; expected a list of segment dicts"),
])
def test_malformed_files_are_named(tmp_path, content, message):
    path = tmp_path / "s.pickle"
    path.write_bytes(content)
    with pytest.raises(SnapshotFormatError, match=message):
        read_snapshot(path)


def test_an_unknown_pool_is_named():
    with pytest.raises(SnapshotFormatError, match=r"has no pool \(0, 7\); its pools are \[\(0, 1\)\]"):
        inspect_snapshot(H200_LADDER, pool_id=(0, 7), batches=(1,), draft_tokens=(1,))


def test_cli_prints_the_report_and_writes_the_map_and_table(tmp_path, capsys):
    code = main(["inspect", str(H200_LADDER), "--batches", "32,64", "--draft-tokens", "8", "--modes", "standard",
                 "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0
    assert "wholly free segments only: 5, 900.0 MiB" in out
    png = tmp_path / "h200_ladder_segments_memory_map.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = json.loads((tmp_path / "h200_ladder_segments_fit.json").read_text())
    assert [(r["batch_size"], r["fits"]) for r in table["fit"]] == [(32, True), (64, False)]


@pytest.mark.parametrize("args, message", [
    (["--batches", "0"], "must be 1 or more"),
    (["--modes", "greedy"], "unknown mode 'greedy'"),
    (["--pool", "1"], "is not a pool id"),
])
def test_cli_refuses_bad_arguments(args, message, capsys, tmp_path):
    try:
        code = main(["inspect", str(H200_LADDER), "--out", str(tmp_path), *args])
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err


def test_cli_names_a_malformed_file(tmp_path, capsys):
    bad = tmp_path / "bad.pickle"
    bad.write_bytes(pickle.dumps([{"address": 1}]))
    assert main(["inspect", str(bad), "--out", str(tmp_path)]) == 2
    assert "segment 0 has no 'total_size'" in capsys.readouterr().err
