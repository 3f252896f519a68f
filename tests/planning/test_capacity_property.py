"""plan_verify against the step itself: random graph ladders, random steps, every mode.

The oracle is running the step: ``eagle_verify`` borrowing from the ladder's state on a
layout-only simulated device (exact allocator decisions, no values, so Llama-sized
vocabularies are cheap). For standard and lean, ``plan.fits`` must equal "it ran without
running out of borrowed memory"; chunked steps planned as fitting must run, and when
none fits, one request per group must run out of memory. Between steps the borrow pool
stays built (so later plans restore it), is retired, or changes fit policy and precarve.

Examples per run: ``EXAMPLES`` (several steps each; 20 reach every ladder and mode, steps
that fit and steps that do not, in about 20 s: each step costs about 0.4 s, mostly the
top-k / top-p search on the simulated device); the Hypothesis profile
``GRAPHBORROW_HYPOTHESIS=deep`` (``make deep``) runs many more.
"""

import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphborrow.core.errors import BorrowCapacityError
from graphborrow.device import get_backend
from graphborrow.eagle import MODES, eagle_verify
from graphborrow.eagle.draft_tree import DraftTree
from graphborrow.eagle.plan import plan_verify
from graphborrow.workloads.ladder import GraphLadder, ModelShape

pytestmark = pytest.mark.slow

EXAMPLES = 20
LADDERS = (  # (hidden, intermediate, layers, vocab, decode batches, prefill tokens, draft tokens)
    (128, 256, 2, 32000, (16, 8, 4, 2, 1), 512, 4),
    (512, 1536, 2, 50257, (32, 16, 8, 4, 2, 1), 2048, 8),
    (4096, 14336, 1, 128256, (16, 8, 4, 2, 1), 1024, 4),
    (1024, 4096, 2, 151936, (8, 4, 2, 1), 4096, 2),
)
DRAFTS = (1, 2, 3, 4, 8, 16)
MAX_RENORM_ROWS = 128  # renorm pivots cost ~30 passes per group of rows on the simulated device


@functools.lru_cache(maxsize=None)
def ladder(index: int):
    hidden, intermediate, layers, vocab, batches, prefill, draft = LADDERS[index]
    device = get_backend("sim", backed=False, activate=False)
    with device.activated():
        shape = ModelShape(hidden=hidden, intermediate=intermediate, layers=layers, vocab=vocab, dtype=torch.bfloat16)
        return GraphLadder(device, shape, prefill_tokens=prefill, decode_batches=batches, draft_tokens=draft).capture()


def run(state, device, bs, d, vocab, depth, mode, top_k, top_p, chunk_rows=None) -> bool:
    """Run the step; False when it ran out of borrowed memory."""
    long = torch.empty(bs, d, dtype=torch.long, device="cuda")
    tree = DraftTree(long, long.clone(), long.clone(), long.clone(), depth)
    logits = torch.empty(bs * d, vocab, device="cuda")
    try:
        eagle_verify(logits, None, tree, 0.7, top_ks=50 if top_k else None, top_ps=0.9 if top_p else None,
                     borrow=state, mode=mode, chunk_rows=chunk_rows, validate=False)
        return True
    except device.OutOfMemoryError:
        return False


steps = st.lists(
    st.tuples(
        st.integers(1, 64),           # batch size (capped by the ladder)
        st.sampled_from(DRAFTS),
        st.sampled_from(MODES),
        st.booleans(), st.booleans(),  # top-k, top-p
        st.integers(0, 15),           # tree depth (capped by D)
        st.sampled_from(["keep", "keep", "retire", "first_fit", "best_fit", "no_precarve", "precarve"]),
    ),
    min_size=3, max_size=6,
)


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(index=st.integers(0, len(LADDERS) - 1), steps=steps)
def test_plan_fits_exactly_when_the_step_runs(index, steps):
    lad = ladder(index)
    device, state, vocab = lad.backend, lad.state, lad.shape.vocab
    with device.activated():
        state.retire()
        state.best_fit, state.precarve = True, True
        for bs, d, mode, top_k, top_p, depth, between in steps:
            bs = min(bs, max(lad.decode_batches))
            if (top_k or top_p) and bs * d > MAX_RENORM_ROWS:
                bs = max(1, MAX_RENORM_ROWS // d)
            depth = min(depth, d - 1) + 1
            plan = plan_verify(state, bs, d, vocab, mode, top_k, top_p)
            what = f"bs={bs} D={d} V={vocab} {mode} top_k={top_k} top_p={top_p}: {plan}"
            if mode != "chunked":
                assert run(state, device, bs, d, vocab, depth, mode, top_k, top_p) == plan.fits, what
            elif plan.fits:
                assert run(state, device, bs, d, vocab, depth, mode, top_k, top_p), what
                assert run(state, device, bs, d, vocab, depth, mode, top_k, top_p,
                           chunk_rows=plan.requests_per_chunk * d), what
            else:
                with pytest.raises(BorrowCapacityError, match="cannot run in the borrowed runs"):
                    run(state, device, bs, d, vocab, depth, mode, top_k, top_p)
                assert not run(state, device, bs, d, vocab, depth, mode, top_k, top_p, chunk_rows=d), what
            if between == "retire":
                state.retire()
            elif between in ("first_fit", "best_fit"):
                state.best_fit = between == "best_fit"  # applies when the pool is next built
            elif between in ("no_precarve", "precarve"):
                state.precarve = between == "precarve"


@pytest.mark.parametrize("index", [0, 2])
@pytest.mark.parametrize("mode", ["standard", "lean"])
def test_plans_hold_at_the_batch_boundary(index, mode):
    """Where the planner says the batch stops fitting, the step stops running: both sides checked."""
    lad = ladder(index)
    device, state, vocab = lad.backend, lad.state, lad.shape.vocab
    checked = 0
    with device.activated():
        for d in (4, 16):
            state.retire()
            lo, hi = 0, 2 * max(lad.decode_batches)
            while lo < hi:  # largest batch the plan says fits (searched as if monotone; checked below)
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if plan_verify(state, mid, d, vocab, mode).fits else (lo, mid - 1)
            for bs in (lo, lo + 1):
                if bs:
                    state.retire()
                    expected = plan_verify(state, bs, d, vocab, mode).fits
                    assert run(state, device, bs, d, vocab, d, mode, False, False) == expected, (bs, d, mode)
                    checked += 1
    assert checked >= 3
