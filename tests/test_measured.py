"""Reading the H200 measurements committed under data/."""

import pytest

from graphborrow import measured
from graphborrow.package_data import data_dir as shipped_data_dir
from graphborrow.runs import summarize
from graphborrow.sizes import MB


def test_core_measurements_are_complete():
    core = measured.load("core_h200")
    assert core["device"].startswith("NVIDIA") and core["torch"].startswith("2.")
    assert core["probability_set"]["borrowed_device_bytes"] == 0 < core["probability_set"]["plain_device_bytes"]


def test_pool_rows_set_the_h200_beside_this_run():
    core = measured.load("core_h200")
    # the snapshot recorded in the same H200 run, summarised here: it must agree with the JSON
    recorded = summarize(shipped_data_dir() / "h200_ladder_segments.pickle")
    rows = measured.pool_rows(core["pool"], recorded)
    assert [r[0] for r in rows][:2] == ["pool reserved", "idle bytes in free runs"]
    assert rows[1][1] == rows[1][2] == "1010.9 MiB"
    here = dict(recorded, reserved_bytes=recorded["reserved_bytes"] // 2, runs=3)
    rows = measured.pool_rows(core["pool"], here)
    assert rows[0][1] != rows[0][2] and rows[0][2] == f"{here['reserved_bytes'] / MB:.1f} MiB"
    assert (rows[2][1], rows[2][2]) == ("9", "3")


def test_eagle_headline_and_savings_agree_with_the_points():
    eagle = measured.load("eagle_h200")
    head = measured.eagle_headline(eagle)
    table = measured.savings_table(eagle)
    assert max(r["saved_bytes"] for r in table) == head["max_saved_bytes"]
    best = max(table, key=lambda r: r["saved_bytes"])
    assert (best["batch_size"], best["draft_tokens"]) == head["max_saved_at"]
    assert head["largest_batch_chunked_borrow"] == max(r["batch_size"] for r in table)
    assert all(r["bytes"] <= 2 * MB for r in table)  # borrowed steps take at most a small segment
    assert set(head["largest_batch_standard_borrow"]) == {4, 8, 16}


def test_missing_files_say_how_they_are_made(tmp_path):
    with pytest.raises(FileNotFoundError, match="produced on a GPU"):
        measured.load("core_h200", tmp_path)


def test_markdown_table():
    text = measured.markdown_table([("a", 1, 2)], ("", "x", "y"))
    assert text.splitlines() == ["|  | x | y |", "|---|---|---|", "| a | 1 | 2 |"]


def test_planned_capacity_of_the_h200_pool():
    """The planner's table for the H200 ladder pool, beside what the H200 benchmark ran."""
    rows = measured.planned_capacity(shipped_data_dir() / "h200_ladder_segments.pickle", batches=(16, 32, 64, 128),
                                     draft_tokens=(8,), modes=("standard", "chunked"))
    assert measured.largest_fitting_batches(rows) == {8: 32}
    chunked = {r["batch_size"]: r for r in rows if r["mode"] == "chunked"}
    assert all(r["fits"] for r in chunked.values()) and chunked[128]["requests_per_chunk"] < 128
    side = measured.capacity_against_measured(rows, measured.load("eagle_h200"))
    assert len(side) == 8 and all(r["planned"] == r["ran"] for r in side)
    assert "float32 matrix" in next(r["reason"] for r in rows if not r["fits"])
