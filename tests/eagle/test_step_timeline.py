"""The traced step's records, decoded (:mod:`graphborrow.eagle.triton.timeline`).

On CPU: a hand-written trace of one request (two rows of one slice, its walk, two residual
slices), whose milestones and item times are known. On a GPU (``pytest -m gpu
tests/eagle/test_step_timeline.py``): a traced launch gives the untraced step's tokens and
a timeline whose milestones come in the step's order.
"""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from graphborrow.eagle.triton.timeline import RESIDUAL_STAGE, StepTimeline

T0 = 1_000_000  # the first program's start (ns on the GPU's clock)


def record(taken, waited, done, moved_on, program, stage, row, last=False, acted=False, sm=0):
    return [T0 + taken, T0 + waited, T0 + done, T0 + moved_on, sm, program, stage, row * 4 + last + 2 * acted]


def one_request_trace():
    """Tickets: the maxima of rows 0 and 1, their sums (row 1's finishes the request and
    walks), two residual slices (the second samples); then two programs' start and exit."""
    tickets = [
        record(100, 100, 1100, 1200, program=0, stage=0, row=0, last=True),
        record(150, 150, 1150, 1300, program=1, stage=0, row=1, last=True),
        record(1250, 1500, 2500, 2600, program=0, stage=1, row=0, last=True),
        record(1350, 1600, 2700, 6700, program=1, stage=1, row=1, last=True, acted=True),
        record(2650, 6900, 7900, 8000, program=0, stage=RESIDUAL_STAGE, row=0),
        record(6750, 7000, 9000, 9100, program=1, stage=RESIDUAL_STAGE, row=0, acted=True),
    ]
    programs = [[T0 + 0, T0 + 8300, 3] + [0] * 5, [T0 + 40, T0 + 9400, 5] + [0] * 5]
    return np.array(tickets + programs, dtype=np.int64)


def config_of(items, programs):
    return SimpleNamespace(groups=[(0, items, 3, True)], programs=[programs])


def test_the_milestones_and_item_times_of_a_known_trace():
    timeline = StepTimeline.of(one_request_trace(), config_of(6, 2))
    assert timeline.milestones == {
        "programs started": 40, "maxima done": 1300, "sums done": 2700, "walks started": 2700,
        "walks done": 6700, "residual seen": 6900, "masses done": 7900, "sampled": 9000, "programs left": 9400}
    items = timeline.items
    assert items["max"] == 1000 and items["sum"] == 1050 and items["sum wait"] == 250
    assert items["walk"] == 4000 and items["publish"] == 100  # (row 0's sum: 2500 -> 2600)
    assert items["residual wait"] == 4250 and items["residual"] == 1000 and items["sample"] == 2000
    # program 0: 1200 -> 1250, 2600 -> 2650; program 1: 1300 -> 1350, 6700 -> 6750
    assert items["ticket"] == 50


def test_an_incomplete_trace_is_refused():
    trace = one_request_trace()
    trace[4, 0] = 0  # a ticket that wrote nothing (launched with another grid, say)
    with pytest.raises(ValueError, match="incomplete"):
        StepTimeline.of(trace, config_of(6, 2))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run: pytest -m gpu tests/)")
@pytest.mark.parametrize("bs, d, shape", [(1, 16, (4, 5)), (1, 8, (4, 3))])
def test_a_traced_step_gives_the_steps_tokens_and_an_ordered_timeline(bs, d, shape):
    from graphborrow.eagle import eagle_verify
    from graphborrow.eagle.draft_tree import build_draft_tree, repeat_tree
    from graphborrow.eagle.step import VerifyStep
    from graphborrow.eagle.triton.timeline import run_traced, traced_config

    vocab = 128256
    g = torch.Generator(device="cuda").manual_seed(bs + d)
    tree = build_draft_tree(*shape, d, bs, vocab, generator=torch.Generator().manual_seed(d), device="cuda")
    logits = 3.0 * torch.randn(bs * d, vocab, device="cuda", generator=g)
    coins, final = torch.rand(bs, d, device="cuda", generator=g), torch.rand(bs, device="cuda", generator=g)
    plain = eagle_verify(logits, None, tree, 0.7, coins=coins, coins_final=final, impl="fused", validate=False)
    step = VerifyStep.of(logits, None, tree, 0.7, coins=coins, coins_final=final)
    config = traced_config(step)
    run_traced(config, step)  # compiles; sizes the grid
    config.trace.zero_()
    out = run_traced(config, step)
    torch.cuda.synchronize()
    for got, want in zip(out, plain):
        assert torch.equal(got, want)
    m = StepTimeline.of(config.trace.cpu().numpy(), config).milestones
    # one request: its walk needs every row's sums, its residual the walk, its sample every residual mass
    order = ["maxima done", "sums done", "walks done", "residual seen", "masses done", "sampled", "programs left"]
    assert [m[k] for k in order] == sorted(m[k] for k in order)
    assert 0 <= m["programs started"] < m["maxima done"] and m["walks started"] < m["walks done"]
    with pytest.raises(ValueError, match="one launch"):
        traced_config(VerifyStep.of(logits.repeat(8, 1), None, repeat_tree(tree, 8), 0.7, 50, 0.9))
