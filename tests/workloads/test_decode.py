"""The speculative decoding loop: what it emits, what it accepts, what it holds, what it refuses.

Oracles that share none of the loop's code: transformers' own greedy decoding (full forwards,
its own causal mask, no cache) for the tokens; the capacity planner for which modes may borrow;
``mem_get_info`` for what a step really added to the device.
"""

import math

import pytest
import torch

from graphborrow.core.errors import BorrowCapacityError, ParameterError
from graphborrow.device import get_backend
from graphborrow.workloads.decode import BORROW_MODES, DecodeLoop, tree_shape
from graphborrow.workloads.decode_grid import GridSpec, run_grid

pytestmark = pytest.mark.slow

transformers = pytest.importorskip("transformers")

SMALL = dict(hidden=128, intermediate=256, vocab=8192, layers=2, prompt_tokens=8, dtype=torch.float32)
GREEDY = 1e-3  # temperature: each row's top token holds all the probability


@pytest.fixture(scope="module")
def chain():
    """D = 4 drafts in a chain (top-1), a ladder of 16 and 4; the draft is the target itself."""
    backend = get_backend("sim", backed=True)
    loop = DecodeLoop(backend, batches=(16, 4), draft_tokens=4, max_new_tokens=10, agreement=1.0, **SMALL).capture()
    yield loop
    backend.close()


def greedy_reference(loop, prompts, new_tokens):
    """Greedy decoding of the target by transformers itself, on the CPU: a full forward per token."""
    model = transformers.LlamaForCausalLM(loop.config).eval()
    model.load_state_dict({k: v.cpu() for k, v in loop.target.state_dict().items()})
    ids = torch.tensor(prompts)
    with torch.inference_mode():
        for _ in range(new_tokens):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[:, len(prompts[0]):].tolist()


def test_tree_shapes_follow_the_measured_upstream_trees():
    assert tree_shape(4) == (1, 3) and tree_shape(8) == (4, 3) and tree_shape(2) == (1, 1) == tree_shape(1)
    topk, depth = tree_shape(40)
    assert 1 + topk + (depth - 1) * topk ** 2 >= 40


def test_greedy_sampling_emits_transformers_greedy_tokens_and_accepts_every_draft(chain):
    # batch 3 runs the batch-4 graph with a padded row
    result = chain.run(3, "plain", new_tokens=10, temperature=GREEDY)
    assert result.tokens == greedy_reference(chain, result.prompts, 10)
    width = chain.depth + 1
    for step in result.accept_lengths[:-1]:  # a draft identical to the target: every level accepted
        assert step == [width] * 3, result.accept_lengths
    assert result.steps == math.ceil((10 - 1) / width)


@pytest.mark.parametrize("agreement", [1.0, 0.5])
def test_tree_drafts_change_speed_not_tokens(agreement):
    """A tree keeps several children per level, so an accepted path's nodes are not the next
    positions: their keys and values must move there (agreement 1 accepts deep paths)."""
    backend = get_backend("sim", backed=True)
    try:
        loop = DecodeLoop(backend, batches=(4,), draft_tokens=8, max_new_tokens=8, agreement=agreement,
                          **SMALL).capture()
        result = loop.run(4, "plain", new_tokens=8, temperature=GREEDY)
        assert (loop.topk, loop.depth) == (4, 3)
        assert result.tokens == greedy_reference(loop, result.prompts, 8)
        if agreement == 1.0:
            assert result.mean_accept_length > 2.5, result.accept_lengths
    finally:
        backend.close()


@pytest.mark.parametrize("batch, modes", [(16, ("lean", "chunked")), (4, ("standard",))])
def test_every_mode_emits_the_same_tokens_and_borrowing_adds_no_device_memory(chain, batch, modes):
    plain = chain.run(batch, "plain", new_tokens=6, top_k=50, top_p=0.9)
    if batch == 16:  # two [64, 8192] float32 matrices: a new 20 MiB segment
        assert plain.device_added > 0 and plain.borrow_pool_bytes == 0
    for mode in modes:
        r = chain.run(batch, mode, new_tokens=6, top_k=50, top_p=0.9)
        assert r.tokens == plain.tokens and r.accept_lengths == plain.accept_lengths, mode
        assert r.device_added == 0 and r.borrow_pool_bytes > 0, (mode, r.row())
        assert r.allocated_after == r.allocated_before  # nothing the run made outlives it


def test_upstream_s_step_emits_the_greedy_tokens_too(chain):
    upstream = chain.run(4, "upstream", new_tokens=6, temperature=GREEDY)
    assert upstream.tokens == greedy_reference(chain, upstream.prompts, 6)


def test_acceptance_is_measured_across_draft_agreement(chain):
    means = {}
    for agreement in (0.0, 1.0):
        chain.set_agreement(agreement)
        means[agreement] = chain.run(4, "plain", new_tokens=10).mean_accept_length
    chain.set_agreement(1.0)
    assert means[0.0] < 1.3 < 2.0 < means[1.0], means  # an unrelated draft is rejected, the target's own accepted


@pytest.mark.parametrize("agreement", [-0.1, 1.5, True, "0.5", float("nan")])
def test_agreement_outside_0_1_is_refused_before_anything_is_built(agreement):
    backend = get_backend("sim", backed=False)
    try:
        with pytest.raises(ParameterError, match=r"agreement must be a number in \[0, 1\]"):
            DecodeLoop(backend, agreement=agreement, **SMALL)
        assert backend.memory_allocated() == 0
    finally:
        backend.close()


def _allocations(backend) -> int:
    return int(backend.memory_stats().get("allocation.all.allocated", 0))


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(batch=17), ParameterError, "exceeds the largest captured batch 16"),
    (dict(batch=4, new_tokens=11), ParameterError, "sized for 10 new tokens"),
    (dict(batch=4, mode="eager"), ParameterError, "mode must be one of"),
    (dict(batch=4, mode="fused"), ParameterError, "need a GPU"),
    (dict(batch=16, mode="standard"), BorrowCapacityError, "does not fit the graph pool's idle runs: the step's"),
])
def test_a_run_that_cannot_go_is_refused_before_any_work(chain, kwargs, error, message):
    before = _allocations(chain.backend)
    with pytest.raises(error, match=message):
        chain.run(**kwargs)
    assert _allocations(chain.backend) == before


def test_a_layout_only_device_needs_the_number_of_steps():
    backend = get_backend("sim", backed=False)
    try:
        loop = DecodeLoop(backend, batches=(4,), draft_tokens=4, max_new_tokens=4, **SMALL).capture()
        with pytest.raises(ParameterError, match="give steps"):
            loop.run(4)
        assert loop.run(4, steps=2).tokens is None
    finally:
        backend.close()


def test_at_h200_shapes_layout_only_plain_takes_the_probabilities_and_a_borrow_takes_nothing():
    backend = get_backend("sim", backed=False)
    try:
        loop = DecodeLoop(backend, batches=(32,), draft_tokens=8, max_new_tokens=8).capture()
        assert loop.vocab == 128256 and loop.dtype == torch.bfloat16
        plain = loop.run(32, "plain", steps=1)
        chunked = loop.run(32, "chunked", steps=1)
        assert plain.device_added >= 2 * 32 * 8 * 128256 * 4  # the standard step's two [bs*D, V] float32 matrices
        assert chunked.device_added == 0 and chunked.borrow_pool_bytes > 0
        assert chunked.graph_pool_bytes == plain.graph_pool_bytes > 0
    finally:
        backend.close()


def test_a_sweep_records_a_failing_point_and_finishes_the_others():
    backend = get_backend("sim", backed=False)
    try:
        spec = GridSpec(draft_tokens=4, batches=(4, 1), modes=("plain", "standard", "fused"), new_tokens=4,
                        prompt_tokens=8, repeats=0, hidden=128, intermediate=256, vocab=8192, dtype="float32")
        out = run_grid(backend, spec, steps={(b, m): 1 for b in (4, 1) for m in spec.modes})
        status = {(r["batch"], r["mode"]): r["status"] for r in out["points"]}
        assert status[(4, "fused")] == status[(1, "fused")] == "failed"
        assert status[(4, "plain")] == status[(1, "plain")] == "ok"
        assert [r["mode"] for r in out["points"]][-2:] == ["fused", "fused"]  # state-leaving modes run last
        fused = next(r for r in out["points"] if r["mode"] == "fused")
        assert "need a GPU" in fused["error"]
    finally:
        backend.close()
