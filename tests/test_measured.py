"""Reading the H200 measurements committed under data/."""

import pytest

from graphborrow import measured
from graphborrow.sizes import MB


def test_core_measurements_are_complete():
    core = measured.load("core_h200")
    assert core["device"].startswith("NVIDIA") and core["torch"].startswith("2.")
    assert core["probability_set"]["borrowed_device_bytes"] == 0 < core["probability_set"]["plain_device_bytes"]
    rows = measured.pool_rows(core["pool"], core["pool"])
    assert [r[0] for r in rows][:2] == ["pool reserved", "idle bytes in free runs"]
    assert all(r[1] == r[2] for r in rows)


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
