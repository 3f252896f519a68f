"""Arguments outside what a verification step can be: refused with the reason, before any work."""

import pytest
import torch

from graphborrow.core.borrow import BorrowState
from graphborrow.eagle import build_draft_tree, eagle_verify
from graphborrow.eagle.plan import MAX_STEP_BYTES, plan_verify


@pytest.mark.parametrize("batch_size", [2**40, 2**30, MAX_STEP_BYTES // (4 * 4 * 128256) + 1])
def test_a_step_no_device_could_hold_is_refused_before_it_is_recorded(sim, batch_size):
    state = BorrowState(sim)
    buffer = sim.external_alloc(64 << 20)
    state.set_static_runs([(buffer.address, buffer.nbytes)])
    with pytest.raises(ValueError, match=rf"batch_size={batch_size} x draft_tokens=4 x vocab=128256: .* TiB, "
                                         "more than any GPU holds"):
        plan_verify(state, batch_size, 4, 128256)


@pytest.mark.parametrize("top_p", [1.5, 2.0, float("inf"), float("nan"), 0.0, -0.1])
def test_top_p_outside_zero_to_one_is_refused(top_p):
    logits = torch.randn(2 * 4, 64)
    tree = build_draft_tree(2, 2, 4, 2, 64, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        eagle_verify(logits, None, tree, 1.0, top_ps=top_p, generator=torch.Generator().manual_seed(1))
    eagle_verify(logits, None, tree, 1.0, top_ps=1.0, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("name, value", [("validate", "no"), ("validate", 0), ("graph", "yes"), ("graph", None)])
def test_the_flags_take_a_bool_only(name, value):
    """validate='no' had read as true: the checks ran that the caller meant to skip."""
    logits = torch.randn(2 * 4, 64)
    tree = build_draft_tree(2, 2, 4, 2, 64, generator=torch.Generator().manual_seed(0))
    with pytest.raises(TypeError, match=name):
        eagle_verify(logits, None, tree, 1.0, generator=torch.Generator().manual_seed(1), **{name: value})


def test_candidates_of_another_shape_than_the_tree_name_both():
    """The logits check came first and blamed the logits, which matched the tree."""
    logits = torch.randn(2 * 4, 64)
    tree = build_draft_tree(2, 2, 4, 2, 64, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"candidates are \[2, 5\] but the tree's tables are \[2, 4\]"):
        eagle_verify(logits, torch.zeros(2, 5, dtype=torch.int64), tree, 1.0)


def test_a_tree_on_another_device_than_the_logits_is_named():
    """torch's own 'Expected all tensors to be on the same device' came from inside the walk."""
    from graphborrow import use_device
    from graphborrow.sim import cuda_api

    use_device("sim")
    try:
        tree = build_draft_tree(2, 2, 4, 2, 64, generator=torch.Generator().manual_seed(0), device="cuda")
        with pytest.raises(ValueError, match=r"candidates on cuda:0 and the logits on cpu: .* \.to\(logits\.device\)"):
            eagle_verify(torch.randn(2 * 4, 64), None, tree, 1.0)
    finally:
        cuda_api.uninstall(cuda_api.installed())
