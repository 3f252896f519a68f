"""fused_verify and the sort-free renorm kernels against the PyTorch reference.

On a machine without CUDA the kernels run in Triton's interpreter (numpy), so these
tests check the kernels' logic on CPU at small shapes: bitwise the same predicts,
accept_index and accept_length as ``eagle_verify(mode="standard")`` for the same coins,
and the same renormalised rows as ``graphborrow.renorm``. The GPU twins (exactness grid
at serving shapes, chi-square, graph capture, no host sync) are in test_fused_verify_gpu.py.
"""

import math

import pytest
import torch

from graphborrow import fused_verify as fv  # first: it selects Triton's interpreter on a CPU-only machine
from graphborrow.draft_tree import build_draft_tree, tree_from_parents
from graphborrow.eagle import eagle_verify
from graphborrow.renorm import top_k_renorm_probs, top_p_renorm_probs

DEVICE = "cpu" if fv.INTERPRETED else "cuda"
assert fv.TRITON_AVAILABLE, "these tests run the kernels: install triton (the 'kernels' extra)"


def case(seed, bs, d, vocab, topk=3, depth=3, boost=10.0, ties=False, masked=0):
    """Random trees and logits; the parents' rows favour their children so paths get accepted."""
    g = torch.Generator().manual_seed(seed)
    tree = build_draft_tree(topk, depth, d, bs, vocab, generator=g)
    if ties:  # few distinct values: ties everywhere, at top-k / top-p pivots included
        logits = torch.randint(-3, 3, (bs * d, vocab), generator=g).float()
    else:
        logits = 2.0 * torch.randn(bs * d, vocab, generator=g)
    if masked:
        logits[:, -masked:] = -math.inf
    for b in range(bs):
        for n in range(d):
            c = int(tree.retrive_next_token[b, n])
            while c != -1:
                logits[b * d + n, tree.candidates[b, c]] += boost + 3.0 * float(torch.rand((), generator=g))
                c = int(tree.retrive_next_sibling[b, c])
    coins = torch.rand(bs, d, generator=g)
    coins_final = torch.rand(bs, generator=g)
    return tree, logits, coins, coins_final


def on_device(tree, *tensors):
    moved = tree._replace(**{f: getattr(tree, f).to(DEVICE) for f in tree._fields[:4]})
    return (moved, *(t.to(DEVICE) for t in tensors))


def assert_same(expected, got, context):
    for name, a, b in zip(("predicts", "accept_index", "accept_length"), expected, got):
        assert torch.equal(a.cpu(), b.cpu()), f"{name} differs for {context}:\nreference {a}\nfused     {b}"


GRID = [  # seed, bs, D, V, tree (topk, depth), temperature, top_k, top_p, thresholds, ties, masked
    (1, 3, 8, 1500, (3, 3), 0.8, None, None, (1.0, 1.0), False, 0),
    (2, 2, 6, 777, (2, 3), 1.0, None, None, (0.5, 0.3), False, 100),
    (3, 2, 4, 1030, (1, 3), 0.6, None, None, (0.0, 0.0), False, 0),
    (4, 2, 8, 700, (3, 3), 0.9, 20, None, (1.0, 1.0), False, 0),
    (5, 2, 8, 700, (3, 3), 1.3, None, 0.8, (1.0, 1.0), False, 50),
    (6, 2, 6, 600, (2, 3), 1.0, 30, 0.7, (0.8, 0.6), True, 0),
    (7, 2, 6, 513, (2, 3), 0.7, 600, 1.0, (1.0, 1.0), False, 0),
]


@pytest.mark.parametrize("seed,bs,d,vocab,shape,temp,top_k,top_p,thr,ties,masked", GRID)
def test_same_tokens_as_the_reference(seed, bs, d, vocab, shape, temp, top_k, top_p, thr, ties, masked, monkeypatch):
    monkeypatch.setattr(fv, "SELECT_CAP", 16)  # make the pivot search take several passes
    tree, logits, coins, coins_final = case(seed, bs, d, vocab, *shape, ties=ties, masked=masked)
    kw = dict(top_ks=top_k, top_ps=top_p, threshold_single=thr[0], threshold_acc=thr[1])
    expected = eagle_verify(logits, None, tree, temp, coins=coins, coins_final=coins_final, **kw)
    dtree, dlogits, dcoins, dfinal = on_device(tree, logits, coins, coins_final)
    got = fv.fused_verify(dlogits, None, dtree, temp, coins=dcoins, coins_final=dfinal, **kw)
    assert_same(expected, got, f"seed {seed}")
    if seed == 1:
        assert expected.accept_length.max() >= 3  # the grid walks deep paths too


def test_per_request_parameters_and_bfloat16_logits(monkeypatch):
    monkeypatch.setattr(fv, "SELECT_CAP", 32)
    tree, logits, coins, coins_final = case(11, 3, 6, 900, 2, 3)
    logits = logits.bfloat16()
    temps = torch.tensor([0.5, 1.0, 1.7])
    top_ks = torch.tensor([5, 900, 50])
    top_ps = torch.tensor([0.9, 0.5, 1.0])
    kw = dict(top_ks=top_ks, top_ps=top_ps, coins=coins, coins_final=coins_final)
    expected = eagle_verify(logits, None, tree, temps, **kw)
    dtree, dlogits, dtemps, dks, dps, dcoins, dfinal = on_device(tree, logits, temps, top_ks, top_ps, coins,
                                                                  coins_final)
    got = fv.fused_verify(dlogits, None, dtree, dtemps, top_ks=dks, top_ps=dps, coins=dcoins, coins_final=dfinal)
    assert_same(expected, got, "per-request parameters")


def exact_case(coin_root, coin_final, logit_rest=-math.inf):
    """Root with children tokens 3 and 5; node 1 (token 3) has child token 7. Root row:
    tokens 3 and 5 logit 0 (p = 0.5 each, exactly), the rest ``logit_rest``."""
    tree = tree_from_parents([[-1, 0, 0, 1]], [[0, 3, 5, 7]])
    logits = torch.full((4, 10), -math.inf)
    logits[0] = logit_rest
    logits[0, 3] = logits[0, 5] = 0.0
    logits[1, 7] = logits[1, 2] = 0.0  # node 1's row: token 7 at 0.5
    logits[2] = 0.0
    logits[3] = 0.0
    coins = torch.tensor([[coin_root, 0.75, 0.0, 0.0]])
    return tree, logits, coins, torch.tensor([coin_final])


@pytest.mark.parametrize("coin_root,accepted", [(0.49999997, 2), (0.5, 1), (0.99999994, 1)])
def test_strict_less_than_at_an_exact_boundary(coin_root, accepted):
    """acc = 0.5 after token 3: a coin of exactly 0.5 rejects it (strict <), then token 5 is
    accepted with acc = 1.0; node 2 is a leaf, so one draft is accepted either way, but
    which one differs."""
    tree, logits, coins, final = exact_case(coin_root, 0.3)
    expected = eagle_verify(logits, None, tree, 1.0, coins=coins, coins_final=final)
    dtree, dlogits, dcoins, dfinal = on_device(tree, logits, coins, final)
    got = fv.fused_verify(dlogits, None, dtree, 1.0, coins=dcoins, coins_final=dfinal)
    assert_same(expected, got, f"coin {coin_root}")
    assert int(got.accept_index[0, 1]) == (1 if accepted == 2 else 2)


def test_zero_probability_candidate_never_accepted_and_residual_falls_back():
    """Both children have probability 0 in the root row (-inf logits): never accepted, even
    with thresholds 0; the residual then holds only token 9."""
    tree = tree_from_parents([[-1, 0, 0, 1]], [[0, 3, 5, 7]])
    logits = torch.zeros(4, 10)
    logits[0] = -math.inf
    logits[0, 9] = 0.0
    coins = torch.zeros(1, 4)
    for thr in ((1.0, 1.0), (0.0, 0.0)):
        expected = eagle_verify(logits, None, tree, 1.0, coins=coins, coins_final=torch.tensor([0.0]),
                                threshold_single=thr[0], threshold_acc=thr[1])
        dtree, dlogits, dcoins = on_device(tree, logits, coins)
        got = fv.fused_verify(dlogits, None, dtree, 1.0, coins=dcoins, coins_final=torch.zeros(1, device=DEVICE),
                              threshold_single=thr[0], threshold_acc=thr[1])
        assert_same(expected, got, f"thresholds {thr}")
        assert got.accept_length.tolist() == [1] and got.predicts.tolist()[0] == 9


def test_out_buffers_are_refilled_and_chunks_agree(monkeypatch):
    tree, logits, coins, coins_final = case(21, 5, 4, 600, 1, 3)
    expected = eagle_verify(logits, None, tree, 1.0, coins=coins, coins_final=coins_final)
    dtree, dlogits, dcoins, dfinal = on_device(tree, logits, coins, coins_final)
    out = (torch.full((20,), 7, dtype=torch.int32, device=DEVICE),
           torch.full((5, 4), 9, dtype=torch.int32, device=DEVICE),
           torch.zeros(5, dtype=torch.int32, device=DEVICE))
    got = fv.fused_verify(dlogits, None, dtree, 1.0, coins=dcoins, coins_final=dfinal, out=out, chunk_requests=2)
    assert all(a is b for a, b in zip(got, out))
    assert_same(expected, got, "out= and chunk_requests=2")


RENORM_ROWS = 5


def renorm_rows(seed, vocab, ties):
    g = torch.Generator().manual_seed(seed)
    if ties:  # multiples of 1/64: sums are exact, so the top-p boundary is hit exactly
        draws = torch.multinomial(torch.ones(RENORM_ROWS, vocab), 64, replacement=True, generator=g)
        return torch.zeros(RENORM_ROWS, vocab).scatter_add_(1, draws, torch.ones(RENORM_ROWS, 64)) / 64
    return torch.softmax(3.0 * torch.randn(RENORM_ROWS, vocab, generator=g), dim=-1)


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("cap", [16, 64])  # the serving cap (1024) sorts slowly in the interpreter
def test_standalone_renorm_matches_the_reference_bitwise(ties, cap, monkeypatch):
    monkeypatch.setattr(fv, "SELECT_CAP", cap)
    probs = renorm_rows(3, 1100, ties)
    dprobs = probs.to(DEVICE)
    for k in (1, 7, 64, 1099, 5000, torch.tensor([1, 2, 50, 1100, 3])):
        kd = k.to(DEVICE) if isinstance(k, torch.Tensor) else k
        assert torch.equal(fv.top_k_renorm(dprobs, kd).cpu(), top_k_renorm_probs(probs, k)), f"top_k={k}"
    for p in (0.25, 0.5, 0.9, 1.0, torch.tensor([0.1, 0.3, 0.75, 0.999, 1.0])):
        pd = p.to(DEVICE) if isinstance(p, torch.Tensor) else p
        assert torch.equal(fv.top_p_renorm(dprobs, pd).cpu(), top_p_renorm_probs(probs, p)), f"top_p={p}"


def test_renorm_rejects_bad_arguments():
    probs = torch.full((2, 8), 0.125, device=DEVICE)
    with pytest.raises(ValueError, match="top_k must be >= 1"):
        fv.top_k_renorm(probs, 0)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        fv.top_p_renorm(probs, 0.0)
    with pytest.raises(ValueError, match="float32 tensor"):
        fv.top_k_renorm(probs.double(), 2)


def test_bad_arguments_name_the_problem():
    tree, logits, coins, coins_final = case(31, 2, 4, 300, 1, 3)
    dtree, dlogits, dcoins, dfinal = on_device(tree, logits, coins, coins_final)
    with pytest.raises(ValueError, match=r"logits must be \[bs\*D, V\]"):
        fv.fused_verify(dlogits[:-1], None, dtree, 1.0)
    with pytest.raises(ValueError, match="coins must have shape"):
        fv.fused_verify(dlogits, None, dtree, 1.0, coins=dcoins[:, :2])
    with pytest.raises(ValueError, match="candidates must be token ids"):
        fv.fused_verify(dlogits, dtree.candidates + 1000, dtree, 1.0)
    with pytest.raises(ValueError, match="temperatures must be finite and > 0"):
        fv.fused_verify(dlogits, None, dtree, 0.0)
    bad = dlogits.clone()
    bad[3, 5] = math.nan
    with pytest.raises(ValueError, match="NaN"):
        fv.fused_verify(bad, None, dtree, 1.0)
    with pytest.raises(ValueError, match="chunk_requests"):
        fv.fused_verify(dlogits, None, dtree, 1.0, chunk_requests=0)
    with pytest.raises(ValueError, match="threshold_acc"):
        fv.fused_verify(dlogits, None, dtree, 1.0, threshold_acc=1.5)


# ---------------------------------------------------------------------------------
# The workspace: every temporary, recorded on the layout-only simulated device


@pytest.mark.parametrize("top_k,top_p", [(None, None), (50, 0.9)])
def test_workspace_on_the_simulated_device_has_no_vocabulary_wide_temporary(top_k, top_p):
    from graphborrow.sim import SimBackend

    bs, d, vocab = 64, 8, 128256
    backend = SimBackend(capacity=8 * 2**30, backed=False)
    try:
        tree = build_draft_tree(4, 3, d, bs, vocab, generator=torch.Generator().manual_seed(0), device="cuda")
        logits = torch.empty(bs * d, vocab, device="cuda")
        before = backend.memory_allocated()
        backend.record_memory_history(max_entries=100_000)
        result = fv.fused_verify(logits, None, tree, 1.0, top_ks=top_k, top_ps=top_p, validate=False, launch=False)
        trace = backend.full_snapshot()["device_traces"][0]
        backend.record_memory_history(False)
        # every temporary died inside the step: only the outputs remain
        assert backend.memory_allocated() - before == sum(fv_round(t) for t in result)
        allocs = [e["size"] for e in trace if e["action"] == "alloc"]
        frees = [e["size"] for e in trace if e["action"] == "free_requested"]
        assert len(allocs) - len(frees) == 3  # predicts, accept_index, accept_length stay
        assert max(allocs) < bs * d * vocab * 4 // 16  # nothing near the [bs*D, V] matrix
        requested = fv.fused_workspace_bytes(bs, d, vocab, top_k is not None, top_p is not None)
        temporaries = sum(allocs) - sum(fv_round(t) for t in result) - 4 * bs * d * 2  # minus outputs and coins
        assert temporaries <= requested + 512 * len(allocs)
    finally:
        backend.close()


def fv_round(t):
    return -(-t.numel() * t.element_size() // 512) * 512


def test_workspace_bytes_grow_with_rows_not_vocabulary():
    small = fv.fused_workspace_bytes(32, 8, 32000, top_k=True, top_p=True)
    wide = fv.fused_workspace_bytes(32, 8, 128256, top_k=True, top_p=True)
    assert wide < 2 * small  # at most the split count changes with V
    assert fv.fused_workspace_bytes(128, 16, 128256) < 128 * 16 * 128256 * 4 / 1000
