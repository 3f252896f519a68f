"""Notebook 06's grid: the planner's answers, checked by running the steps on the simulated device."""

import pytest
import torch
from conftest import _cuda_param

from graphborrow.device import get_backend
from graphborrow.planning.capacity import fit_policy_pool
from graphborrow.studies import capacity as capacity_study
from graphborrow.workloads.ladder import ModelShape, build_ladder


@pytest.fixture(scope="module", params=["sim", _cuda_param()])
def ladder(request):
    """The layout-only simulated device, and the real GPU (marked gpu): the planner must hold on both."""
    backend = get_backend("sim", backed=False) if request.param == "sim" else get_backend("cuda")
    shape = ModelShape(hidden=512, intermediate=1536, layers=2, vocab=8192, dtype=torch.bfloat16)
    yield build_ladder("synthetic", backend, shape=shape, decode_batches=[16, 8, 4, 2, 1], draft_tokens=4,
                       prefill_tokens=1024).capture()
    if request.param == "sim":
        backend.close()


def test_plans_hold_where_they_change(ladder):
    rows = capacity_study.plan_table(ladder.state, [16, 8, 4, 2, 1], [4, 16], 8192)
    assert len(rows) == 5 * 2 * 3
    cells = capacity_study.boundary_cells(rows, 4)
    assert any(c["fits"] for c in cells) and any(not c["fits"] for c in cells)
    for cell in cells:
        ran = capacity_study.run_verify_step(ladder.state, cell["batch_size"], 4, 8192, cell["mode"])
        assert ran == cell["fits"], cell


def test_more_draft_tokens_fit_a_smaller_batch():
    backend = get_backend("sim", backed=False)
    try:
        shape = ModelShape(hidden=512, intermediate=1536, layers=2, vocab=8192, dtype=torch.bfloat16)
        ladder = build_ladder("synthetic", backend, shape=shape, decode_batches=[16, 8, 4, 2, 1], draft_tokens=4,
                              prefill_tokens=1024).capture()
        best = capacity_study.summarize_fit(capacity_study.plan_table(ladder.state, [16, 8, 4, 2, 1], [4, 16], 8192))
        assert 0 < best["standard"][16] < best["standard"][4], "more draft tokens, a smaller largest batch"
        assert all(best["lean"][d] >= best["standard"][d] for d in (4, 16)), "lean holds less, so fits as much"
    finally:
        backend.close()


def test_boundary_cells_pick_the_last_fit_and_the_first_miss():
    rows = [{"batch_size": b, "draft_tokens": 4, "mode": "standard", "fits": b <= 4} for b in (1, 2, 4, 8, 16)]
    assert [(c["batch_size"], c["fits"]) for c in capacity_study.boundary_cells(rows, 4)] == [(4, True), (8, False)]
    assert capacity_study.boundary_cells(rows, 8) == []


def test_the_fit_policy_contrast_is_real():
    backend = get_backend("sim", backed=False)
    try:
        demo = fit_policy_pool(backend)
        found = capacity_study.fit_policy_contrast(demo.state, 8192)
        assert found is not None
        bs, d = found
        outcome = {}
        for best in (True, False):
            demo.state.best_fit = best
            outcome[best] = capacity_study.run_verify_step(demo.state, bs, d, 8192, "standard")
        assert outcome == {True: True, False: False}
        assert demo.state.best_fit is False  # left as the caller set it
    finally:
        backend.close()


@pytest.mark.parametrize("backed", [True, False])
def test_verify_inputs_have_the_step_shapes(backed):
    backend = get_backend("sim", backed=backed)
    try:
        logits, tree = capacity_study.verify_inputs(3, 6, 100, backend=backend)
        assert logits.shape == (18, 100) and logits.dtype == torch.float32
        assert tree.candidates.shape == (3, 6)
        if backed:  # a real tree: the root's first child exists and comes after it
            assert int(tree.retrive_next_token[0, 0].cpu()) == 1
    finally:
        backend.close()


def test_fit_grid_figure_hatches_every_miss():
    rows = [{"batch_size": b, "draft_tokens": d, "mode": m, "fits": b * d <= 8, "peak_bytes": b * d << 20}
            for m in ("standard", "lean") for b in (1, 4) for d in (2, 4)]
    fig = capacity_study.fit_grid_figure(rows)
    assert len([ax for ax in fig.axes if ax.get_label() != "<colorbar>"]) == 2, "one grid per mode, plus one colorbar"
    misses = sum(1 for ax in fig.axes for p in ax.patches if p.get_gid() == "no-fit")
    assert misses == sum(not r["fits"] for r in rows) == 2


@pytest.mark.parametrize("run_mib", [3, 12, 21])
def test_tensor_fits_run_is_what_a_borrow_over_that_run_holds(run_mib):
    """The planner's single-allocation answer against a real borrow (no precarve) over one external
    buffer of the run's size, on the layout-only simulated device: the 1-10 MiB class needs a 20 MiB
    segment, so a 12 MiB run holds 11 MiB and not 4 MiB."""
    from graphborrow.core.borrow import BorrowState

    device = get_backend("sim", backed=False)
    try:
        buffer = device.external_alloc(run_mib * 2**20)
        state = BorrowState(device, precarve=False)
        state.set_static_runs([(buffer.address, buffer.nbytes)])
        sizes = [512 * 1024, 2**20 + 512, 4 << 20, (10 << 20) - 512, 11 << 20, (run_mib << 20) - 512, run_mib << 20,
                 (run_mib << 20) + 512]
        held = {}
        for n in sizes:
            try:
                with state.borrow("probe"):
                    t = torch.empty(n, dtype=torch.uint8, device="cuda")
                    del t
                held[n] = True
            except device.OutOfMemoryError:
                held[n] = False
            finally:
                state.retire()
        assert {n: capacity_study.tensor_fits_run(n, run_mib << 20) for n in sizes} == held
        if run_mib == 12:
            assert held[11 << 20] and not held[4 << 20]
    finally:
        device.close()
