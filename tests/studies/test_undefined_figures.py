"""A figure computed from no case is undefined (None, "n/a" in words), never 0 or 1."""

import pytest

from graphborrow.studies import measured, mode_costs, sampling, writes
from graphborrow.studies.text import share_text


def test_a_share_of_nothing_is_no_percentage():
    assert share_text(1, 4) == "25 %"
    assert share_text(0, 0) == "n/a: nothing to compare"


def cost_row(standard_ms, lean_ms=1.0, standard_bytes=100, lean_bytes=10):
    row = {"standard_bytes": standard_bytes, "lean_bytes": lean_bytes}
    for m in mode_costs.MEASURED_VARIANTS:
        row[f"{m}_bytes"] = row.get(f"{m}_bytes", 1)
        row[f"{m}_ms"] = standard_ms if m == "standard" else lean_ms
    return row


def test_cost_medians_over_no_comparable_point_are_none():
    assert all(v is None for k, v in mode_costs.summarize_costs([]).items() if k != "points")
    zero = mode_costs.summarize_costs([cost_row(standard_ms=0.0, standard_bytes=0)])
    assert zero["points"] == 1 and zero["lean_bytes_share"] is None
    assert all(zero[f"{m}_time_ratio"] is None for m in mode_costs.MEASURED_VARIANTS[1:])
    one = mode_costs.summarize_costs([cost_row(standard_ms=2.0), cost_row(standard_ms=0.0)])
    assert one["lean_bytes_share"] == 0.1 and one["lean_time_ratio"] == 0.5  # the zero-time point is left out


def test_a_span_of_no_bytes_has_no_covered_fraction():
    assert writes.covered_fraction((4096, 0), []) is None
    assert writes.covered_fraction((4096, 512), []) == 0.0


def test_the_fused_summary_of_a_record_without_fused_points_claims_no_goal():
    summary = measured.fused_summary({"rows": [{"bs": 1, "draft_tokens": 4, "impl": "fused", "ok": False}]})
    assert (summary["points"], summary["max_temporary_bytes"]) == (0, None)
    text = measured.fused_summary_text(summary)
    assert "n/a, no point of the record ran the fused step" in text
    assert "0 of 0" not in text and "KiB of temporaries" not in text


@pytest.mark.parametrize("samples", [0, -1, 1.5, True])
def test_an_acceptance_study_of_no_copies_is_refused(samples):
    with pytest.raises(ValueError, match="samples must be a whole number of 1 or more"):
        sampling.acceptance_study(4, 2, 1.0, samples)


def test_the_largest_fitting_batch_of_a_table_where_none_fits_is_none():
    from graphborrow.studies import capacity
    from graphborrow.studies.inspection import SnapshotReport

    rows = [{"mode": "standard", "draft_tokens": 4, "batch_size": b, "fits": b <= 2} for b in (1, 2, 4)]
    rows += [{"mode": "standard", "draft_tokens": 8, "batch_size": b, "fits": False} for b in (1, 2, 4)]
    assert capacity.summarize_fit(rows) == {"standard": {4: 2, 8: None}}
    assert measured.largest_fitting_batches(rows) == {4: 2, 8: None}
    report = SnapshotReport("s", [], (), (0, 1), 32000, rows)
    assert (report.largest_fitting_batch(4), report.largest_fitting_batch(8)) == (2, None)


def test_the_mean_accept_length_of_no_emitting_step_is_none():
    import dataclasses

    from graphborrow.workloads.decode import LoopResult

    counts = dict.fromkeys([f.name for f in dataclasses.fields(LoopResult)], 0)
    run = LoopResult(**dict(counts, mode="plain", prompts=[], tokens=[], memory=[], accept_lengths=[[3, 1], [2, 0]]))
    assert run.mean_accept_length == 2.0  # the request already done (0) is left out
    assert dataclasses.replace(run, accept_lengths=[[0, 0]]).mean_accept_length is None
    assert dataclasses.replace(run, accept_lengths=[]).mean_accept_length is None
    assert dataclasses.replace(run, accept_lengths=None).mean_accept_length is None
