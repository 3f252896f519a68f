"""Reading the H200 measurements committed under data/."""

from pathlib import Path

import pytest

from graphborrow.core.runs import summarize
from graphborrow.core.sizes import MB
from graphborrow.studies import measured
from graphborrow.studies.shipped import data_dir as shipped_data_dir


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


def test_fused_kernel_table_reads_every_point_and_its_goals():
    verify = measured.load("verify_kernels_h200")
    assert verify["device"].startswith("NVIDIA") and verify["torch"].startswith("2.")
    table = measured.fused_kernel_table(verify)
    assert {(r["batch_size"], r["draft_tokens"]) for r in table} == {
        (bs, d) for bs in (1, 4, 16, 32, 64, 128) for d in (4, 8, 16)}
    for r in table:
        # equal within the events' noise where the kernel is all (at 128 x 16 the replay, a memset node
        # and the kernel, measured 669 us against the eager launch's 665)
        assert r["replayed_us"] <= 1.05 * r["eager_us"]
        for launch, upstream in (("replayed", r["upstream_replayed_us"]), ("eager", r["upstream_us"])):
            us = r[f"{launch}_us"]
            expected = [goal for goal, ok in zip(measured.FUSED_GOALS, (us <= upstream, us <= 3 * r["softmax_us"],
                                                                       True)) if not ok]
            assert r[f"goals_missed_{launch}"] == expected
        assert r["renorm_us"] > r["replayed_us"]
    # as recorded: every goal at every point, replayed and (one persistent launch per step) eager too
    assert sum(not r["goals_missed_replayed"] for r in table) == 18
    assert sum(not r["goals_missed_eager"] for r in table) == 18


def made_up_point(eager_us, replayed_us, upstream_us=95.0, softmax_us=40.0, wide=False):
    return {"rows": [{"bs": 1, "draft_tokens": 4, "impl": "fused", "ok": True, "device_us": eager_us,
                      "graph_us": replayed_us, "softmax_us": softmax_us, "agrees": True, "temporary_bytes": 5632,
                      "full_vocab_temporaries": wide},
                     {"bs": 1, "draft_tokens": 4, "impl": "upstream", "device_us": upstream_us}]}


def test_fused_goals_are_judged_for_each_launch_on_its_own_time():
    (row,) = measured.fused_kernel_table(made_up_point(eager_us=300.0, replayed_us=90.0))
    assert row["replayed_us"] == 90.0 and row["eager_us"] == 300.0
    assert row["vs_softmax"] == 90.0 / 40.0 and row["eager_vs_softmax"] == 300.0 / 40.0
    assert row["goals_missed_replayed"] == []
    assert row["goals_missed_eager"] == ["<= upstream", "<= 3x softmax"]
    (row,) = measured.fused_kernel_table(made_up_point(eager_us=110.0, replayed_us=100.0))  # above upstream only
    assert row["goals_missed_replayed"] == row["goals_missed_eager"] == ["<= upstream"]
    (row,) = measured.fused_kernel_table(made_up_point(eager_us=94.0, replayed_us=90.0, upstream_us=500.0))
    assert row["goals_missed_eager"] == []
    (row,) = measured.fused_kernel_table(made_up_point(eager_us=130.0, replayed_us=90.0, upstream_us=500.0))
    assert row["goals_missed_eager"] == ["<= 3x softmax"] and row["goals_missed_replayed"] == []
    (row,) = measured.fused_kernel_table(made_up_point(eager_us=60.0, replayed_us=50.0, wide=True))
    assert row["goals_missed_replayed"] == ["no [bs*D, V] temporaries"]
    no_upstream = made_up_point(eager_us=60.0, replayed_us=50.0)
    no_upstream["rows"].pop()
    assert measured.fused_kernel_table(no_upstream)[0]["goals_missed_replayed"] == ["<= upstream"]


def test_fused_kernel_markdown_is_the_kernels_page_table():
    """docs/kernels.md's table is this function's output for the shipped data, line for line."""
    text = measured.fused_kernel_markdown(measured.fused_kernel_table(measured.load("verify_kernels_h200")))
    lines = text.splitlines()
    assert "goals (replayed)" in lines[0] and "goals (eager)" in lines[0] and len(lines) == 2 + 18
    assert lines[2].startswith("| 1 | 4 | 26 | 42 |") and "| met | met |" in lines[2]
    page = (Path(__file__).resolve().parents[2] / "docs" / "kernels.md").read_text()
    assert text in page, "docs/kernels.md's fused-kernel table is stale: paste measured.fused_kernel_markdown's output"


def test_fused_summary_reports_the_renorm_against_its_goal():
    verify = measured.load("verify_kernels_h200")
    summary = measured.fused_summary(verify)
    assert (summary["points"], summary["goals_met_replayed"], summary["goals_met_eager"]) == (18, 18, 18)
    fused = [r for r in verify["rows"] if r["impl"] == "fused"]
    assert summary["max_temporary_bytes"] == max(max(r["temporary_bytes"], r["workspace_bytes"]) for r in fused)
    assert summary["max_temporary_bytes"] < 256 * 1024  # (the workspace: KiB, growing with bs * D * D, never with V)
    renorm = summary["renorm"]
    assert (renorm["rows"], renorm["vocab"]) == (32, 128256)
    assert renorm["replayed_us"] == verify["top_p_renorm"]["fused_graph_us"]
    assert renorm["meets_goal"] is (renorm["replayed_us"] <= renorm["goal_us"]) is True  # as recorded: 138 <= 147 us
    missed = dict(verify, top_p_renorm=dict(verify["top_p_renorm"], fused_graph_us=200.0))
    assert measured.fused_summary(missed)["renorm"]["meets_goal"] is False
    assert measured.fused_summary(dict(verify, top_p_renorm={"ok": False, "error": "x"}))["renorm"] is None


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


def test_fused_summary_text_states_the_recorded_numbers():
    summary = measured.fused_summary(measured.load("verify_kernels_h200"))
    text = measured.fused_summary_text(summary)
    assert "18 of 18 points replayed" in text and "18 of 18 launched eagerly" in text
    assert "32 x 128256 (top-p 0.9): 138 us replayed against a goal of 147 us (met)" in text
    assert "at most 218.1 KiB of temporaries" in text
    slower = dict(summary, renorm=dict(summary["renorm"], replayed_us=202.0, meets_goal=False))
    assert "202 us replayed against a goal of 147 us (missed)" in measured.fused_summary_text(slower)
    assert "renorm: not recorded" in measured.fused_summary_text(dict(summary, renorm=None))
