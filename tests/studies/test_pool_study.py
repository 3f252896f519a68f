"""Tables and figures of the free-runs notebook's real-model section, on the simulated device."""

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from graphborrow.core.errors import ParameterError  # noqa: E402
from graphborrow.core.runs import find_free_runs  # noqa: E402
from graphborrow.sim import SimBackend  # noqa: E402
from graphborrow.studies.model_pools import (  # noqa: E402
    MiB,
    borrow_saving,
    build_workload,
    check_boundaries,
    plot_workloads,
    prefill_table,
    study,
    verify_fit,
    workload_table,
)


@pytest.fixture
def layout():
    b = SimBackend(backed=False)
    yield b
    b.close()


def _ladder(backend, model="llama-3-8b", **kw):
    params = dict(decode_batches=(64, 8, 1), draft_tokens=8)
    if model != "synthetic":
        params.update(layers=1, context=1024)
    params.update(kw)
    return build_workload(model, backend, **params).capture()


def test_study_reads_the_pool_it_was_given(layout):
    ladder = _ladder(layout)
    s = study(ladder, measure_saving=False)
    segments = ladder.snapshot()
    assert s["workload"] == "llama-3-8b"
    assert s["pool"]["reserved_bytes"] == sum(seg["total_size"] for seg in segments)
    assert s["runs_by_rule"]["runs"] == [n for _, n in find_free_runs(segments, "runs")]
    assert sum(s["runs_by_rule"]["whole_segments"]) <= sum(s["runs_by_rule"]["runs"])
    assert sorted({r["batch"] for r in s["verify_fit"]}) == [1, 8, 64]


def test_verify_fit_answers_for_every_batch(layout):
    ladder = _ladder(layout)
    rows = verify_fit(ladder.state, [1, 8, 4096], 8, 128256)
    by_batch = {r["batch"]: r for r in rows if r["mode"] == "standard"}
    assert by_batch[1]["fits"] is True
    assert by_batch[4096]["fits"] is False  # 4096 x 8 x 128256 fp32 is 16 GiB
    assert all(r["answered_by"] for r in rows) and all(r["reason"] is not None for r in rows)


def test_the_planner_s_boundary_steps_run_as_planned_on_both_sides(layout):
    ladder = _ladder(layout, "synthetic", prefill_tokens=1024, layers=1)
    s = study(ladder, measure_saving=False)
    runs = {(r["mode"], r["batch"]): r for r in s["planner_checked"]}
    # standard and lean: the largest batch planned to fit ran, the smallest planned not to ran out
    assert runs[("standard", 8)]["planned"] and runs[("standard", 8)]["ran"]
    assert not runs[("standard", 64)]["planned"] and not runs[("standard", 64)]["ran"]
    assert not runs[("lean", 64)]["ran"] and runs[("chunked", 64)]["ran"]
    assert all(r["agrees"] for r in runs.values())


def test_a_wrong_plan_is_caught_by_running_its_step(layout):
    ladder = _ladder(layout, "synthetic", prefill_tokens=1024, layers=1)
    fit = verify_fit(ladder.state, [8, 64], 8, 128256, modes=("standard",))
    wrong = [dict(r, fits=not r["fits"]) if r["batch"] == 64 else r for r in fit]  # "64 fits"
    runs = check_boundaries(ladder.state, wrong)
    assert [(r["batch"], r["planned"], r["ran"], r["agrees"]) for r in runs] == [(64, True, False, False)]


def test_a_borrowed_probability_set_takes_no_device_memory(layout):
    ladder = _ladder(layout)
    logits = ladder.decode(8)
    saving = borrow_saving(ladder.state, logits, layout)
    assert saving["rows"] == 64 and saving["vocab"] == 128256
    assert saving["plain_device_bytes"] >= saving["tensor_bytes"]
    assert saving["borrowed_device_bytes"] == 0
    assert saving["saved_bytes"] == saving["plain_device_bytes"]


def test_a_set_that_fits_no_run_saves_nothing_and_says_why(layout):
    ladder = _ladder(layout, "synthetic", decode_batches=(64,), prefill_tokens=0, layers=1)
    saving = borrow_saving(ladder.state, ladder.decode(64), layout)  # 2 x 252 MiB against smaller runs
    assert saving["borrowed_device_bytes"] is None and saving["saved_bytes"] == 0
    assert "out of memory" in saving["error"].lower()


def test_study_measures_the_largest_batch_that_really_borrows(layout):
    ladder = _ladder(layout)
    s = study(ladder)
    saving = s["borrow_saving"]
    assert saving["borrowed_device_bytes"] == 0 and saving["saved_bytes"] > 0
    assert saving["batch"] in (1, 8, 64)


def test_tables_compare_workloads_side_by_side(layout):
    synthetic = study(_ladder(layout, "synthetic", prefill_tokens=1024, layers=1), label="synthetic",
                      measure_saving=False)
    other = SimBackend(backed=False)
    try:
        real = study(_ladder(other), measure_saving=False)
    finally:
        other.close()
    rows = workload_table([synthetic, real])
    assert [r["workload"] for r in rows] == ["synthetic", "llama-3-8b"]
    for r, s in zip(rows, (synthetic, real)):
        assert r["reserved MiB"] == round(s["pool"]["reserved_bytes"] / MiB, 1)
        assert r["idle MiB"] <= r["reserved MiB"]
        assert r["whole-segment rule MiB"] <= r["idle MiB"]
    ax = plot_workloads(rows)
    assert len(ax.patches) == 4 and [t.get_text() for t in ax.get_xticklabels()] == ["synthetic", "llama-3-8b"]
    with pytest.raises(ParameterError):
        plot_workloads([])


def test_capturing_prefill_grows_the_pool_and_its_idle_runs():
    rows = prefill_table("llama-3-8b", make_backend=lambda: SimBackend(backed=False), decode_batches=(4, 1), layers=1,
                         context=1024)
    none, graph, pieces = rows
    assert [r["workload"] for r in rows] == ["llama-3-8b, prefill none", "llama-3-8b, prefill graph",
                                             "llama-3-8b, prefill piecewise"]
    assert graph["reserved MiB"] > none["reserved MiB"] and graph["idle MiB"] > none["idle MiB"]
    assert pieces["reserved MiB"] > none["reserved MiB"]
