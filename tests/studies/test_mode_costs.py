"""The H200's per-mode bytes and times, read back from data/eagle_h200*.json."""

import json
from pathlib import Path

import pytest

from graphborrow.studies import measured, mode_costs

DATA = Path(__file__).resolve().parents[2] / "data"


def test_rows_carry_the_file_numbers():
    raw = json.loads((DATA / "eagle_h200.json").read_text())
    rows = mode_costs.mode_costs(measured.load("eagle_h200", DATA))
    everywhere = {(p["bs"], p["draft_tokens"]) for p in raw["points"]}
    ran = {k for k in everywhere
           if all(p["ok"] for p in raw["points"] if (p["bs"], p["draft_tokens"]) == k)}
    assert {(r["batch_size"], r["draft_tokens"]) for r in rows} == ran
    point = next(p for p in raw["points"] if p["bs"] == 32 and p["draft_tokens"] == 8 and p["mode"] == "lean")
    row = next(r for r in rows if r["batch_size"] == 32 and r["draft_tokens"] == 8)
    assert row["lean_bytes"] == point["device_bytes"] and row["lean_ms"] == point["device_ms"]


def test_summary_is_the_median_of_ratios():
    def point(bs, mode, nbytes, ms):
        return {"bs": bs, "draft_tokens": 4, "mode": mode, "ok": True, "device_bytes": nbytes, "device_ms": ms}
    eagle = {"points": [point(b, m, n * b, t) for b in (1, 2, 3)
                        for m, n, t in (("standard", 100, 2.0), ("standard+borrow", 0, 2.2), ("lean", 25, 3.0),
                                        ("chunked+borrow", 0, 4.0))]}
    s = mode_costs.summarize_costs(mode_costs.mode_costs(eagle))
    assert s["points"] == 3 and s["lean_bytes_share"] == pytest.approx(0.25)
    assert s["lean_time_ratio"] == pytest.approx(1.5) and s["chunked+borrow_time_ratio"] == pytest.approx(2.0)


def test_a_file_without_complete_points_is_named():
    with pytest.raises(ValueError, match="no point of this file ran in every mode"):
        mode_costs.mode_costs({"points": [{"bs": 1, "draft_tokens": 4, "mode": "standard", "ok": True}]})


def test_plot_draws_each_mode_in_both_panels():
    fig = mode_costs.plot_mode_costs(mode_costs.mode_costs(measured.load("eagle_h200", DATA)), draft_tokens=8)
    assert len(fig.axes) == 2
    for ax in fig.axes:
        assert [ln.get_label() for ln in ax.get_lines() if not ln.get_label().startswith("_")] == list(mode_costs.MEASURED_VARIANTS)
    with pytest.raises(ValueError, match="no row has draft_tokens=5"):
        mode_costs.plot_mode_costs(mode_costs.mode_costs(measured.load("eagle_h200", DATA)), draft_tokens=5)


def test_the_time_panel_is_the_ratio_to_the_standard_step():
    """Drawn from zero in ms, the modes' times (a few per cent apart) lay on one line; as a ratio to the
    plain standard step of the same point, the standard line is 1 and the others show their difference."""
    rows = mode_costs.mode_costs(measured.load("eagle_h200", DATA))
    fig = mode_costs.plot_mode_costs(rows, draft_tokens=8)
    time = fig.axes[1]
    lines = {line.get_label(): line.get_ydata() for line in time.get_lines() if line.get_label() in mode_costs.MEASURED_VARIANTS}
    mine = sorted((r for r in rows if r["draft_tokens"] == 8), key=lambda r: r["batch_size"])
    assert list(lines["standard"]) == [1.0] * len(mine)
    assert list(lines["lean"]) == [r["lean_ms"] / r["standard_ms"] for r in mine]
    assert time.get_ylim()[0] > 0.5, "the ratio axis is not drawn from zero"
