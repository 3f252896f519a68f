"""The library functions behind the notebooks' heavy cells, against oracles of their own."""

import pytest
import torch
from matplotlib.figure import Figure

from graphborrow.core.sizes import MB
from graphborrow.studies import capture_order, deferred, plots, sampling, writes


class _Graph:
    def __init__(self, ranges):
        self._ranges = ranges

    def written_ranges(self):
        return self._ranges


def test_writes_are_merged_and_counted_once():
    graphs = [_Graph([(100, 50), (300, 10)]), _Graph([(120, 100)])]
    assert writes.merged_writes(graphs) == [(100, 120), (300, 10)]
    assert writes.overlap_bytes([(90, 40)], writes.merged_writes(graphs)) == 30
    assert writes.covered_fraction((200, 200), graphs) == (20 + 10) / 200


def test_pooled_chi_square_runs_where_the_plain_test_has_too_few_samples():
    gen = torch.Generator().manual_seed(0)
    probs = torch.tensor([0.5, 0.3, 0.17, 0.02, 0.01])
    tokens = torch.multinomial(probs, 200, replacement=True, generator=gen)
    stat, df, critical = sampling.pooled_chi_square(tokens, probs)
    assert df == 3 and stat < critical, "the two rare words are pooled into one category"
    wrong = torch.zeros(200, dtype=torch.long)  # every copy emitted word 0
    stat, _, critical = sampling.pooled_chi_square(wrong, probs)
    assert stat > critical


def test_acceptance_study_tests_the_second_token_at_the_notebook_defaults():
    report = sampling.acceptance_study(draft_tokens=8, branching=2, temperature=0.1, samples=16000, seed=1)
    assert abs(report.mean_tokens - report.theory_tokens) <= 4 * report.standard_error
    assert report.first_test[0] < report.first_test[2]
    assert report.second_test is not None and report.second_test[0] < report.second_test[2]


def test_a_count_every_copy_shares_still_has_a_standard_error():
    # 12 children cover the 12-word vocabulary: a child is accepted with probability 1 - 1.5e-8
    # (float32), so every copy emits 2 tokens while the theory says 1.99999999
    report = sampling.acceptance_study(draft_tokens=13, branching=12, temperature=1.035536, samples=4233, seed=1)
    assert report.mean_tokens == 2.0 and report.theory_tokens != 2.0
    assert report.standard_error == 1 / 4233, "a zero spread is floored at one copy's weight"
    assert abs(report.mean_tokens - report.theory_tokens) <= 4 * report.standard_error


def test_modes_that_do_not_fit_are_run_and_refused_by_the_borrow(backend):
    from graphborrow.eagle import MODES
    from graphborrow.studies.capacity import verify_inputs
    from graphborrow.workloads.ladder import GraphLadder, ModelShape

    with backend.activated():
        # a pool with no run of 2 MiB (not even lean's bytes find a small-pool segment), then a roomy one
        for width, prefill, fitting in ((16, 1, []), (512, 2048, list(MODES))):
            shape = ModelShape(hidden=width, intermediate=3 * width, layers=1, vocab=16, dtype=torch.float32)
            lad = GraphLadder(backend, shape, prefill_tokens=prefill, decode_batches=(1,), draft_tokens=1).capture()
            logits, tree = verify_inputs(1, 1, 16, backend=backend)
            coins = torch.rand(1, 1).to(backend.device)
            modes = sampling.modes_in_borrow(lad.state, logits, tree, 1.0, coins, coins[:, 0])
            if backend.name == "sim" or fitting:  # (a GPU's libraries may leave the tiny pool other runs)
                assert modes.fitting == fitting, {m: p.reason for m, p in modes.plans.items()}
            assert modes.refused == {m: True for m in MODES if m not in modes.fitting}, "the borrow ran a step the planner refused"
            assert modes.device_bytes == 0
            del lad, logits, tree


def test_the_order_verdict_says_which_order_reserved_less():
    assert "**2.0 MiB more**" in capture_order.order_verdict(10 * MB, 12 * MB, 80 << 30)
    assert "**2.0 MiB less**" in capture_order.order_verdict(12 * MB, 10 * MB, 80 << 30)
    assert "same 10.0 MiB" in capture_order.order_verdict(10 * MB, 10 * MB, 80 << 30)
    assert "ran out of the device's 80 GiB" in capture_order.order_verdict(10 * MB, None, 80 << 30)


def test_the_block_is_allocated_until_the_drop_and_pending_until_the_side_stream_is_done():
    lanes, marks = deferred.deferred_free_lanes({"side_busy": 50.0, "side_used": 50.5, "main_busy": 16.7,
                                                 "dropped": 16.8})
    alive, pending, free = lanes["t's block"]
    assert alive == (0.0, 16.8, "active_allocated"), "alive from the write until Python drops it"
    assert pending[:2] == (16.8, 50.5) and pending[2] == "active_pending_free", "pending until the side stream's use ends"
    assert free[2] == "inactive" and free[0] == 50.5
    assert marks == [(16.8, "del t"), (50.5, "side stream's event completes")]
    fig = plots.stream_timeline(lanes, marks)
    assert isinstance(fig, Figure) and fig.axes[0].get_xlim()[0] == 0
    with pytest.raises(ValueError, match="missing"):
        deferred.deferred_free_lanes({"side_busy": 1.0})
    with pytest.raises(ValueError, match="out of order"):
        deferred.deferred_free_lanes({"side_busy": 5.0, "side_used": 4.0, "main_busy": 1.0, "dropped": 1.0})


def test_grids_of_one_figure_share_one_colour_scale():
    from graphborrow.studies.capacity import fit_grid_figure

    rows = [{"mode": m, "batch_size": b, "draft_tokens": 4, "peak_bytes": b * k * MB, "fits": True}
            for m, k in (("standard", 10), ("lean", 1)) for b in (1, 2)]
    fig = fit_grid_figure(rows)
    colours = {(ax.get_title(), round(p.get_facecolor()[0], 4)) for ax in fig.axes for p in ax.patches}
    lean = {c for t, c in colours if t == "lean"}
    standard = {c for t, c in colours if t == "standard"}
    assert lean.isdisjoint(standard), "a 1 MiB lean cell and a 10 MiB standard cell do not get the same colour"
    assert sum(ax.get_label() == "<colorbar>" for ax in fig.axes) == 1, "one colorbar for the whole figure"


def test_sweep_plot_speaks_mib_and_starts_at_zero():
    rows = [{"status": "ok", "VOCAB": v, "MODE": "lean", "y": 4 * MB * i} for i, v in enumerate((32000, 128256), 1)]
    ax = plots.sweep_plot(rows, x="VOCAB", y="y", hue="MODE", scale=MB, ylabel="MiB").axes[0]
    assert list(ax.lines[0].get_ydata()) == [4, 8] and ax.get_ylim()[0] == 0 and ax.get_ylabel() == "MiB"


def test_written_ranges_are_drawn_inside_each_segment_they_cross():
    base = 1 << 30
    segments = [{"address": base + a, "total_size": n, "blocks": [{"address": base + a, "size": n, "state": "inactive"}]}
                for a, n in ((0, 2 * MB), (2 * MB, 4 * MB))]
    fig = plots.memory_map(segments, written=[(base + MB, 3 * MB)])
    strips = sorted((p.get_y(), p.get_x(), p.get_width()) for p in fig.axes[0].patches if p.get_gid() == "written")
    assert strips == [(-0.45, 1.0, 1.0), (0.55, 0.0, 2.0)], "1 MiB in the first segment, 2 MiB in the second"


def test_a_drafted_tree_without_noise_draws_its_first_child_from_the_target():
    """Noise 0: the draft is the target, so each node's first child is one draw from the target's
    row (Gumbel-max), checked by chi-square against softmax(logits / T) itself."""
    from graphborrow.eagle.acceptance import chi_square

    logits = torch.randn(1, 6, generator=torch.Generator().manual_seed(3))
    rows = logits.repeat(8000, 1)  # 4000 requests x D = 2 (a root and its one child), the same row each
    tree = sampling.drafted_tree(rows, 2, 1, 0.7, 0.0, torch.Generator().manual_seed(4))
    stat, df, critical = chi_square(tree.candidates[:, 1], torch.softmax(logits[0] / 0.7, -1))
    assert stat < critical, f"the first child does not follow the target row (chi-square {stat:.1f} > {critical:.1f})"
    assert sampling.breadth_first_parents(8, 2) == [-1, 0, 0, 1, 1, 2, 2, 3]
    wide = sampling.drafted_tree(rows[:16], 2, 1, 0.7, 0.0, torch.Generator().manual_seed(4))
    assert wide.candidates.shape == (8, 2)


def test_siblings_are_distinct_and_a_far_draft_is_accepted_less():
    from graphborrow.eagle import eagle_verify

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64 * 8, 500, generator=g)
    lengths = {}
    for noise in (0.0, 50.0):
        tree = sampling.drafted_tree(logits, 8, 2, 0.1, noise, torch.Generator().manual_seed(1))
        pairs = tree.candidates[:, [1, 3, 5]], tree.candidates[:, [2, 4, 6]]  # nodes 1-2, 3-4, 5-6 share a parent
        assert (pairs[0] != pairs[1]).all(), "siblings are drawn without replacement"
        coins = torch.rand(64, 8, generator=torch.Generator().manual_seed(2))
        final = torch.rand(64, generator=torch.Generator().manual_seed(3))
        res = eagle_verify(logits, None, tree, 0.1, coins=coins, coins_final=final, impl="reference")
        lengths[noise] = res.accept_length.double().mean().item()
    assert lengths[0.0] > 1.5 > lengths[50.0], f"tokens per request, draft near and far: {lengths}"
