"""The fused kernels (eagle_verify(impl="fused"), their formula, the sort-free renorm) against the PyTorch reference.

On a machine without CUDA the kernels run in Triton's interpreter (numpy, with torch's CPU
exp), so these tests check the kernels' logic on CPU at small shapes:

- the kernels' probabilities are bitwise ``target_probs_reference`` (the formula in torch);
- for the same coins, bitwise the same predicts, accept_index and accept_length as the
  reference verification over ``target_probs_reference`` (upstream's kernel semantics on
  full matrices), and as ``eagle_verify(mode="standard")`` on a few cases;
- the same renormalised rows as ``graphborrow.eagle.renorm``, whatever the pivot search's budget.

Tiles are shrunk to 256 entries so every row spans several vocabulary slices, and the
exact-sort cap to 16 so the pivot search runs several passes (and its single-program
fallback). The GPU twins (serving shapes, chi-square, graph capture, no host sync) are in
test_fused_verify_gpu.py.

The interpreter is slow (numpy, one program at a time): by default each rule is checked
by one case; ``GRAPHBORROW_KERNEL_TESTS=deep`` (``make test-kernels-deep``) runs every
case of each grid.
"""

import math
import os

import pytest
import torch

from graphborrow.eagle import eagle_verify, tree_speculative_sampling_target_only
from graphborrow.eagle import probs as formula
from graphborrow.eagle.acceptance import chi_square, emitted_tokens, tokens_after
from graphborrow.eagle.draft_tree import (
    build_draft_tree,
    repeat_tree,
    tree_from_parents,
)
from graphborrow.eagle.probs import target_probs
from graphborrow.eagle.renorm import top_k_renorm_probs, top_p_renorm_probs
from graphborrow.eagle.step import VerifyStep
from graphborrow.eagle.triton import (
    fused as fv,  # first: it selects Triton's interpreter on a CPU-only machine
)
from graphborrow.eagle.triton import fused_renorm as fr
from graphborrow.eagle.triton import launch_config as lc
from graphborrow.eagle.triton import occupancy
from graphborrow.eagle.triton.runtime import INTERPRETED, TRITON_AVAILABLE
from graphborrow.eagle.triton.workspace import Layout

pytestmark = pytest.mark.slow

DEVICE = "cpu" if INTERPRETED else "cuda"
DEEP = os.environ.get("GRAPHBORROW_KERNEL_TESTS", "") == "deep"


def cases(all_cases, default):
    """Every case with DEEP, else the ``default`` ones (indices): each a rule the others do not check."""
    return list(all_cases) if DEEP else [all_cases[i] for i in default]
assert TRITON_AVAILABLE, "these tests run the kernels: install triton (the 'kernels' extra)"


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    monkeypatch.setattr(lc, "BLOCK", 256)
    monkeypatch.setattr(lc, "SELECT_CAP", 16)


def fused_verify(logits, candidates, tree, temperatures, **kw):
    """eagle_verify through the fused kernels."""
    return eagle_verify(logits, candidates, tree, temperatures, impl="fused", **kw)


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


def reference(logits, tree, temps, top_k=None, top_p=None, coins=None, coins_final=None, thr=(1.0, 1.0)):
    """The reference verification over target_probs_reference: full [bs, D, V] matrices and
    upstream's kernel semantics (what eagle_verify's standard mode does with this formula)."""
    bs, d = tree.candidates.shape

    def per_row(v):
        return v.repeat_interleave(d) if isinstance(v, torch.Tensor) and v.numel() > 1 else v

    probs = formula.target_probs_reference(logits, per_row(temps), per_row(top_k), per_row(top_p)).view(bs, d, -1)
    predicts = torch.zeros(bs * d, dtype=torch.int32)
    accept_index = torch.full((bs, tree.tree_depth), -1, dtype=torch.int32)
    accepted = torch.zeros(bs, dtype=torch.int32)
    tree_speculative_sampling_target_only(predicts, accept_index, accepted, tree.candidates, tree.retrive_index,
                                          tree.retrive_next_token, tree.retrive_next_sibling, coins, coins_final,
                                          probs, torch.zeros_like(probs), thr[0], thr[1])
    return predicts, accept_index, accepted + 1


def on_device(tree, *tensors):
    moved = tree._replace(**{f: getattr(tree, f).to(DEVICE) for f in tree._fields[:4]})
    return (moved, *(t.to(DEVICE) for t in tensors))


def assert_same(expected, got, context):
    for name, a, b in zip(("predicts", "accept_index", "accept_length"), expected, got):
        assert torch.equal(a.cpu(), b.cpu()), f"{name} differs for {context}:\nreference {a}\nfused     {b}"


# ---------------------------------------------------------------------------------
# The probability formula


PROB_CASES = [  # seed, rows per request, vocab, dtype, temperatures, logit scale, masked tail
    (1, 4, 1500, torch.float32, [0.37, 1.0, 2.5], 2.0, 40),
    (2, 3, 777, torch.bfloat16, [1.0, 0.8], 3.0, 0),
    (3, 2, 1030, torch.float16, [0.6, 1.7], 4.0, 5),
    (4, 2, 600, torch.float32, [1.0, 0.05], 30.0, 0),  # wide rows: most e underflow to 0 or below 2**-K
]


@pytest.mark.parametrize("seed,d,vocab,dtype,temps,scale,masked", PROB_CASES)
def test_kernel_probabilities_are_target_probs_reference_bitwise(seed, d, vocab, dtype, temps, scale, masked):
    g = torch.Generator().manual_seed(seed)
    rows = d * len(temps)
    logits = (scale * torch.randn(rows, vocab, generator=g)).to(dtype)
    if masked:
        logits[:, -masked:] = -math.inf
    logits[0] = logits[0, 0]  # a row of ties
    temps = torch.tensor(temps)
    tokens = torch.arange(vocab).expand(rows, vocab).contiguous()
    kernel = fv.fused_token_probs(logits.to(DEVICE), temps.to(DEVICE), d, tokens.to(DEVICE)).cpu()
    expected = formula.target_probs_reference(logits, temps.repeat_interleave(d))
    differ = (kernel != expected).nonzero().tolist()
    assert not differ, f"{len(differ)} entries differ, first at {differ[:5]}"


# ---------------------------------------------------------------------------------
# The verification step


GRID = [  # seed, bs, D, V, tree (topk, depth), temperature, top_k, top_p, thresholds, ties, masked
    (1, 3, 8, 1500, (3, 3), 0.8, None, None, (1.0, 1.0), False, 0),
    (2, 2, 6, 777, (2, 3), 1.0, None, None, (0.5, 0.3), False, 100),
    (3, 2, 4, 1030, (1, 3), 0.6, None, None, (0.0, 0.0), False, 0),
    (4, 2, 8, 700, (3, 3), 0.9, 20, None, (1.0, 1.0), False, 0),
    (5, 2, 8, 700, (3, 3), 1.3, None, 0.8, (1.0, 1.0), False, 50),
    (6, 2, 6, 600, (2, 3), 1.0, 30, 0.7, (0.8, 0.6), True, 0),
    (7, 2, 6, 513, (2, 3), 0.7, 600, 1.0, (1.0, 1.0), False, 0),
    (8, 2, 6, 900, (2, 3), 1.1, 2000, 0.95, (1.0, 1.0), False, 300),  # k >= V: top-k keeps all, still renormalises
]


# by default: several slices and depths; thresholds with a masked tail; threshold 0 (the bonus path);
# ties at the top-k and top-p pivots; k >= V (keeps all, still renormalises)
@pytest.mark.parametrize("seed,bs,d,vocab,shape,temp,top_k,top_p,thr,ties,masked", cases(GRID, [0, 1, 2, 5, 6]))
def test_same_tokens_as_the_reference(seed, bs, d, vocab, shape, temp, top_k, top_p, thr, ties, masked):
    tree, logits, coins, coins_final = case(seed, bs, d, vocab, *shape, ties=ties, masked=masked)
    expected = reference(logits, tree, temp, top_k, top_p, coins, coins_final, thr)
    dtree, dlogits, dcoins, dfinal = on_device(tree, logits, coins, coins_final)
    got = fused_verify(dlogits, None, dtree, temp, top_ks=top_k, top_ps=top_p, coins=dcoins, coins_final=dfinal,
                          threshold_single=thr[0], threshold_acc=thr[1])
    assert_same(expected, got, f"seed {seed}")
    lengths = got.accept_length.cpu()
    assert lengths.max() >= 2  # paths walked
    if thr[1] > 0:  # (threshold_acc 0 accepts every positive candidate: the bonus path)
        assert lengths.min() < tree.tree_depth  # and rejections' residuals sampled


@pytest.mark.parametrize("passes", cases([0, 1, 3], [0]))  # 0: all of it in the fallback
def test_every_search_budget_gives_the_same_pivots(passes, monkeypatch):
    """Fewer multi-program passes leave more of the top-k / top-p search to the gather
    kernel's single-program fallback: the tokens must not change."""
    monkeypatch.setattr(lc, "SELECT_PASSES", passes)
    tree, logits, coins, coins_final = case(12, 2, 6, 1200, 2, 3)
    expected = reference(logits, tree, 0.9, 40, 0.85, coins, coins_final)
    dtree, dlogits, dcoins, dfinal = on_device(tree, logits, coins, coins_final)
    got = fused_verify(dlogits, None, dtree, 0.9, top_ks=40, top_ps=0.85, coins=dcoins, coins_final=dfinal)
    assert_same(expected, got, f"{passes} passes")


@pytest.mark.parametrize("passes", cases([0, 2], [1]))  # (0 passes in one launch: the search budget test)
def test_one_launch_per_kind_of_item_gives_the_same_tokens(passes, monkeypatch):
    """With top-k and top-p a step of many rows runs as one launch per kind of item (here
    every step, SPLIT_ROWS shrunk to 1): the same tokens as one launch of everything, the
    reference's; with no passes too (their launch left out). Every launch leaves the
    counters at zero."""
    monkeypatch.setattr(lc, "SELECT_PASSES", passes)
    tree, logits, coins, coins_final = case(13, 2, 6, 1100, 2, 3)
    expected = reference(logits, tree, 0.8, 25, 0.8, coins, coins_final)
    dtree, dlogits, dcoins, dfinal = on_device(tree, logits, coins, coins_final)
    for split_rows, launches in ((1000, 1), (1, 2 + 5 * 2 - 2 * (passes == 0))):
        monkeypatch.setattr(lc, "SPLIT_ROWS", split_rows)
        got = fused_verify(dlogits, None, dtree, 0.8, top_ks=25, top_ps=0.8, coins=dcoins, coins_final=dfinal)
        assert_same(expected, got, f"split at {split_rows} rows")
        step = VerifyStep.of(dlogits, None, dtree, 0.8, 25, 0.8, dcoins, dfinal)
        config = lc.step_config(step)
        assert len(config.groups) == launches and config.split == (split_rows == 1)
        assert not any(bool(entry.views.sync.any()) for entry in config.cached.values())


def test_the_counters_end_at_zero_whatever_the_grid(monkeypatch):
    """The persistent kernel's work queue, ticket and flags start at zero and end at zero:
    call after call on the configuration's cached workspace, at one program and at several (in the
    interpreter program 0 takes every ticket; the others find the queue empty)."""
    monkeypatch.setattr(occupancy, "INTERPRETED_PROGRAMS", 1)
    tree, logits, coins, coins_final = case(14, 2, 4, 900, 1, 3)
    expected = reference(logits, tree, 1.1, None, None, coins, coins_final)
    dtree, dlogits, dcoins, dfinal = on_device(tree, logits, coins, coins_final)
    for programs in (1, 1, 4, 4):
        step = VerifyStep.of(dlogits, None, dtree, 1.1, None, None, dcoins, dfinal)
        config = lc.step_config(step)
        config.set_programs(programs)
        assert_same(expected, fv.verify(step), f"{programs} programs")
        (entry,) = config.cached.values()
        assert not bool(entry.views.sync.any())


def test_counters_of_the_callers_stand_in_for_the_workspaces(monkeypatch):
    """run_step with counters of the caller's (what a graph's owner keeps, so the captured
    step needs no zeroing node) uses them and not the workspace's: with every workspace
    byte nonzero, the step still gives the reference's tokens, call after call on the same
    counters, and leaves them at zero. Without them, the workspace's counters are zeroed
    first, so the same garbage is harmless too."""
    tree, logits, coins, coins_final = case(16, 2, 4, 900, 1, 3)
    expected = reference(logits, tree, 0.9, None, None, coins, coins_final)
    dtree, dlogits, dcoins, dfinal = on_device(tree, logits, coins, coins_final)
    monkeypatch.setattr(Layout, "allocate", lambda self, like: like.new_full((self.nbytes,), 7, dtype=torch.uint8))
    step = VerifyStep.of(dlogits, None, dtree, 0.9, None, None, dcoins, dfinal)
    counters = fv.step_counters(step)
    assert counters.shape == (lc.sync_words(2, 4),) and not bool(counters.any())
    for given in (counters, counters, None):
        out = fv.allocate_outputs(step)
        fv.run_step(step, out, counters=given)
        assert_same(expected, out, "own counters" if given is not None else "the workspace's, zeroed")
        assert not bool(counters.any())


@pytest.mark.parametrize("lag_bytes, lag", cases([(1, 4), (10 * 4 * 256, 10), (1 << 30, 32)], [0]))
def test_sums_trailing_the_maxima_give_the_same_tokens(lag_bytes, lag, monkeypatch):
    """On large steps the sums trail the maxima by ``lag`` items (so a row's logits are still
    in L2 when its sums read them again): by one row's slices (the least), by a count that
    ends mid-row, and not at all (every maximum first). The same tokens as the reference,
    with and without top-k / top-p, and the counters end at zero (the outputs are zeroed by
    ticket 0, so no walk waits on a maximum not yet taken)."""
    monkeypatch.setattr(lc, "SUM_LAG_BYTES", lag_bytes)
    tree, logits, coins, coins_final = case(15, 2, 4, 900, 2, 3)
    dtree, dlogits, dcoins, dfinal = on_device(tree, logits, coins, coins_final)
    for top_k, top_p in ((None, None), (30, 0.8)):
        expected = reference(logits, tree, 0.9, top_k, top_p, coins, coins_final)
        step = VerifyStep.of(dlogits, None, dtree, 0.9, top_k, top_p, dcoins, dfinal)
        config = lc.step_config(step)
        assert (config.splits, config.chunk, config.lag) == (4, 256, lag)
        assert_same(expected, fv.verify(step), f"lag {lag}, top-k {top_k}")
        assert not any(bool(entry.views.sync.any()) for entry in config.cached.values())


@pytest.mark.parametrize("vocab", [128256, 152064, 32000, 900])
def test_a_small_plain_step_splits_its_rows_for_one_round_of_programs(vocab):
    """Up to ONE_ROUND_ROWS rows the plain step's maxima and sums fit one round of
    ONE_ROUND_PROGRAMS programs (one item each), in as many slices as that allows; with
    top-k / top-p, and above it, the split aims at TARGET_PROGRAMS as before. Every
    slice whole tiles, none empty."""
    tiles = -(-vocab // lc.BLOCK)
    for rows in range(1, 2 * lc.ONE_ROUND_ROWS + 1):
        for renorm in (False, True):
            splits, chunk = lc.row_layout(rows, vocab, renorm)
            assert chunk % lc.BLOCK == 0 and (splits - 1) * chunk < vocab <= splits * chunk
            if rows <= lc.ONE_ROUND_ROWS and not renorm:
                assert rows * splits <= lc.ONE_ROUND_PROGRAMS
                finer = -(-tiles // (chunk // lc.BLOCK - 1)) if chunk > lc.BLOCK else None
                assert finer is None or rows * finer > lc.ONE_ROUND_PROGRAMS or finer > lc.SPLIT_MAX
            else:
                assert (splits, chunk) == lc.split_layout(rows, vocab)
    assert lc.row_layout(16, 128256) == (32, 4096) and lc.row_layout(32, 128256) == (16, 8192)


def test_eagle_verify_reference_and_fused_agree_bitwise():
    """eagle_verify's two implementations: the reference modes compute the kernels' formula
    (target_probs_reference), so for the same coins they emit the same predicts,
    accept_index and accept_length, and the candidates' probabilities are equal bit for bit."""
    for seed, temps, kw in ((21, 0.8, {}), (22, torch.tensor([0.6, 1.3]), dict(top_ks=25, top_ps=0.8))):
        tree, logits, coins, coins_final = case(seed, 2, 6, 800, 2, 3)
        dtree, dlogits, dcoins, dfinal, dtemps = on_device(tree, logits, coins, coins_final, torch.as_tensor(temps))
        got = eagle_verify(dlogits, None, dtree, dtemps, coins=dcoins, coins_final=dfinal, impl="fused", **kw)
        for mode in ("standard", "lean", "chunked"):
            expected = eagle_verify(logits, None, tree, temps, coins=coins, coins_final=coins_final, mode=mode,
                                    chunk_rows=6 if mode == "chunked" else None, impl="reference", **kw)
            assert_same(expected, got, f"seed {seed}, {mode}")
    d = 6
    rows = torch.as_tensor(temps).repeat_interleave(d)
    tokens = tree.candidates.repeat_interleave(d, dim=0)  # every row at its request's candidates
    kernel = fv.fused_token_probs(dlogits, dtemps, d, tokens.to(DEVICE)).cpu()
    reference_rows = target_probs(logits, rows, None, None).gather(1, tokens)
    assert torch.equal(kernel, reference_rows)


def test_per_request_parameters_and_bfloat16_logits():
    tree, logits, coins, coins_final = case(11, 3, 6, 900, 2, 3)
    logits = logits.bfloat16()
    temps = torch.tensor([0.5, 1.0, 1.7])
    top_ks = torch.tensor([5, 900, 50])
    top_ps = torch.tensor([0.9, 0.5, 1.0])
    expected = reference(logits, tree, temps, top_ks, top_ps, coins, coins_final)
    dtree, dlogits, dtemps, dks, dps, dcoins, dfinal = on_device(tree, logits, temps, top_ks, top_ps, coins,
                                                                  coins_final)
    got = fused_verify(dlogits, None, dtree, dtemps, top_ks=dks, top_ps=dps, coins=dcoins, coins_final=dfinal)
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
    got = fused_verify(dlogits, None, dtree, 1.0, coins=dcoins, coins_final=dfinal)
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
        got = fused_verify(dlogits, None, dtree, 1.0, coins=dcoins, coins_final=torch.zeros(1, device=DEVICE),
                              threshold_single=thr[0], threshold_acc=thr[1])
        assert_same(expected, got, f"thresholds {thr}")
        assert got.accept_length.tolist() == [1] and got.predicts.tolist()[0] == 9


@pytest.mark.parametrize("children", [[0, 5], [5, 0, 0]])
def test_rejected_children_leave_the_residual(children):
    """Root row: tokens 0, 5, 7 and 8 at p = 1/4 each; a coin of 0.99 rejects every child
    (their mass is at most 3/4), so the residual holds tokens 7 and 8 and a final coin of 0
    must pick 7, not 0 (a child's token 0, duplicated or not, is dropped like any other)."""
    n = len(children) + 1
    tree = tree_from_parents([[-1] + [0] * len(children)], [[9] + children])
    logits = torch.full((n, 10), -math.inf)
    logits[0, [0, 5, 7, 8]] = 0.0
    logits[1:] = 0.0
    coins = torch.full((1, n), 0.99)
    expected = reference(logits, tree, 1.0, coins=coins, coins_final=torch.zeros(1))
    dtree, dlogits, dcoins = on_device(tree, logits, coins)
    got = fused_verify(dlogits, None, dtree, 1.0, coins=dcoins, coins_final=torch.zeros(1, device=DEVICE))
    assert_same(expected, got, f"children {children}")
    assert got.accept_length.tolist() == [1] and got.predicts.tolist()[0] == 7


def test_out_buffers_are_rewritten_and_chunking_changes_nothing():
    tree, logits, coins, coins_final = case(21, 5, 4, 600, 1, 3)
    expected = reference(logits, tree, 1.0, coins=coins, coins_final=coins_final)
    dtree, dlogits, dcoins, dfinal = on_device(tree, logits, coins, coins_final)
    out = (torch.full((20,), 7, dtype=torch.int32, device=DEVICE),
           torch.full((5, 4), 9, dtype=torch.int32, device=DEVICE),
           torch.zeros(5, dtype=torch.int32, device=DEVICE))
    for chunk in (None, 2):  # twice into the same buffers: every entry rewritten
        got = fused_verify(dlogits, None, dtree, 1.0, coins=dcoins, coins_final=dfinal, out=out,
                           mode="standard" if chunk is None else "chunked", chunk_rows=chunk and 4 * chunk)
        assert all(a is b for a, b in zip(got, out))
        assert_same(expected, got, f"out= and chunk_rows={chunk and 4 * chunk}")
        out[0].fill_(7)
        out[1].fill_(9)


def test_eagle_verify_writes_into_the_callers_outputs_on_both_paths():
    """eagle_verify(out=...): both implementations rewrite every entry of the caller's
    buffers (filled with garbage first) and return them, with the tokens of a call without
    out=; buffers of the wrong dtype, shape, layout or count are refused by name, and so is
    out= with graph=True (its entries own their outputs)."""
    tree, logits, coins, coins_final = case(23, 3, 4, 500, 2, 3)
    dtree, dlogits, dcoins, dfinal = on_device(tree, logits, coins, coins_final)
    kw = dict(coins=dcoins, coins_final=dfinal, top_ks=30, top_ps=0.9)
    for impl in ("fused", "reference"):
        expected = eagle_verify(dlogits, None, dtree, 0.8, impl=impl, **kw)
        out = tuple(torch.full_like(t, 5) for t in expected)
        got = eagle_verify(dlogits, None, dtree, 0.8, impl=impl, out=out, **kw)
        assert all(a is b for a, b in zip(got, out))
        assert_same(expected, got, f"{impl}, out=")
    good = [torch.zeros(12, dtype=torch.int32, device=DEVICE), torch.zeros(3, dtree.tree_depth, dtype=torch.int32,
                                                                            device=DEVICE),
            torch.zeros(3, dtype=torch.int32, device=DEVICE)]
    bad = {"dtype": (good[0].long(), *good[1:]), "shape": (good[0][:6], *good[1:]),
           "contiguous": (good[0], good[1].t().contiguous().t(), good[2]), "count": tuple(good[:2])}
    messages = {"dtype": "out predicts must be torch.int32", "shape": "out predicts must have shape (12,)",
                "contiguous": "out accept_index must be contiguous", "count": "out must be (predicts"}
    for impl in ("fused", "reference"):
        for name, out in bad.items():
            with pytest.raises(ValueError, match=messages[name].replace("(", r"\(").replace(")", r"\)")):
                eagle_verify(dlogits, None, dtree, 0.8, impl=impl, out=out, **kw)
    with pytest.raises(ValueError, match="graph=True returns its captured step's own outputs"):
        eagle_verify(dlogits, None, dtree, 0.8, graph=True, out=good, **kw)


RENORM_ROWS = 5


def renorm_rows(seed, vocab, ties):
    g = torch.Generator().manual_seed(seed)
    if ties:  # multiples of 1/64: sums are exact, so the top-p boundary is hit exactly
        draws = torch.multinomial(torch.ones(RENORM_ROWS, vocab), 64, replacement=True, generator=g)
        return torch.zeros(RENORM_ROWS, vocab).scatter_add_(1, draws, torch.ones(RENORM_ROWS, 64)) / 64
    return torch.softmax(3.0 * torch.randn(RENORM_ROWS, vocab, generator=g), dim=-1)


@pytest.mark.parametrize("ties,cap,passes", cases([(False, 16, 3), (True, 16, 3), (False, 64, 1), (True, 16, 0)], [1]))
def test_standalone_renorm_matches_the_reference_bitwise(ties, cap, passes, monkeypatch):
    """Multi-program passes, then the single-program fallback (passes=0 leaves it all to it);
    the serving cap (1024) would sort slowly in the interpreter."""
    monkeypatch.setattr(lc, "SELECT_CAP", cap)
    monkeypatch.setattr(lc, "SELECT_PASSES", passes)
    probs = renorm_rows(3, 1100, ties)
    dprobs = probs.to(DEVICE)
    for k in (1, 64, 5000, torch.tensor([1, 2, 50, 1100, 3])):
        kd = k.to(DEVICE) if isinstance(k, torch.Tensor) else k
        assert torch.equal(fr.top_k_renorm(dprobs, kd).cpu(), top_k_renorm_probs(probs, k)), f"top_k={k}"
    for p in (0.5, 0.9, torch.tensor([0.1, 0.3, 0.75, 0.999, 1.0])):
        pd = p.to(DEVICE) if isinstance(p, torch.Tensor) else p
        assert torch.equal(fr.top_p_renorm(dprobs, pd).cpu(), top_p_renorm_probs(probs, p)), f"top_p={p}"


def test_standalone_renorm_reuses_its_workspace_and_refills_changed_parameters(monkeypatch):
    """Eager calls of one shape share one workspace (the search leaves its counters at zero)
    and refill a parameter slot only when the value changed: a number, then per-row values,
    then the first number again must each give the reference's result."""
    monkeypatch.setattr(lc, "SELECT_CAP", 16)
    monkeypatch.setattr(lc, "SELECT_PASSES", 1)
    lc.clear_configs()
    probs = renorm_rows(4, 1100, ties=False)
    dprobs = probs.to(DEVICE)
    per_row = torch.tensor([0.2, 0.95, 0.5, 0.7, 1.0])
    for p in (0.5, 0.5, per_row, 0.5):
        pd = p.to(DEVICE) if isinstance(p, torch.Tensor) else p
        assert torch.equal(fr.top_p_renorm(dprobs, pd).cpu(), top_p_renorm_probs(probs, p)), f"top_p={p}"
    (config,) = lc.RENORM_CONFIGS.configs.values()
    (entry,) = config.cached.values()
    assert int(entry.views.select_counters.abs().sum()) == 0


def test_top_p_is_float32_on_both_paths_standalone():
    """A row whose mass above a value is float32(0.9) exactly, just under 0.9: with top_p
    0.9 taken as float32 (as the reference, torch and flashinfer take it) that value is the
    pivot; taken as float64 the kernel would keep the next value too."""
    probs = torch.zeros(2, 1100)
    f32_09 = float(torch.tensor(0.9, dtype=torch.float32))
    probs[:, 700] = 0.5
    probs[:, 100] = f32_09 - 0.5  # 0.39999997615814209: exact in float32
    probs[:, 1050] = 0.0625
    probs[:, 400] = 0.03125
    probs[1, 900] = 0.25  # a second row whose pivot is elsewhere
    assert f32_09 <= float(probs[0].double()[[700, 100]].sum()) < 0.9
    expected = top_p_renorm_probs(probs, 0.9)
    assert int((expected[0] > 0).sum()) == 2, "the reference keeps the two entries whose mass is float32(0.9)"
    assert torch.equal(fr.top_p_renorm(probs.to(DEVICE), 0.9).cpu(), expected)


def float32_top_p_case(vocab=300):
    """One request (root with children tokens 3 and 5; token 7 under 3) whose root row keeps
    two tokens (logit 0) with float64 mass float32(top_p) exactly, just under top_p; its
    candidates and one more token have logit -1, the rest -inf.

    Returns:
        ``(tree, logits [4, vocab], top_p, kept tokens)`` on the CPU.
    """
    tree = tree_from_parents([[-1, 0, 0, 1]], [[0, 3, 5, 7]])
    kept = [100, vocab - 20]
    row = torch.full((vocab,), -math.inf)
    row[kept] = 0.0
    row[[3, 5, 2 * vocab // 3]] = -1.0
    p_top = formula.softmax_rows(row[None], torch.ones(1))[0, kept[0]]
    top_p = 2 * float(p_top) + 2.0 ** -40  # float32(top_p) == 2 * p_top < top_p
    assert float(torch.tensor(top_p, dtype=torch.float32)) == 2 * float(p_top) < top_p
    return tree, row.repeat(4, 1), top_p, kept


def test_top_p_is_float32_on_both_paths_in_verification():
    """Inside verification: the root row keeps two tokens whose float64 mass is
    float32(top_p) exactly, just under top_p, so its candidates (logit -1) get probability 0
    and are rejected even with a zero coin; a float64 top_p in the kernels would keep them."""
    tree, logits, top_p, kept = float32_top_p_case()
    coins, final = torch.zeros(1, 4), torch.tensor([0.7])
    expected = eagle_verify(logits, None, tree, 1.0, top_ps=top_p, coins=coins, coins_final=final)
    assert expected.accept_length.tolist() == [1] and expected.predicts.tolist()[0] in kept
    dtree, dlogits, dcoins, dfinal = on_device(tree, logits, coins, final)
    got = fused_verify(dlogits, None, dtree, 1.0, top_ps=top_p, coins=dcoins, coins_final=dfinal)
    assert_same(expected, got, f"top_p {top_p!r}")


def test_renorm_rejects_bad_arguments():
    probs = torch.full((2, 8), 0.125, device=DEVICE)
    with pytest.raises(ValueError, match="top_k must be >= 1"):
        fr.top_k_renorm(probs, 0)
    with pytest.raises(ValueError, match=r"and < 2\*\*31"):  # the kernels read k as int32: no wrap-around
        fr.top_k_renorm(probs, torch.tensor([3, 2**32 + 3], device=DEVICE))
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        fr.top_p_renorm(probs, 0.0)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        fr.top_p_renorm(probs, torch.tensor([0.5, 1.5], device=DEVICE))
    with pytest.raises(ValueError, match="one value per request"):
        fr.top_p_renorm(probs, torch.tensor([0.5, 0.5, 0.5], device=DEVICE))
    with pytest.raises(ValueError, match="float32 tensor"):
        fr.top_k_renorm(probs.double(), 2)


def test_bad_arguments_name_the_problem():
    tree, logits, coins, coins_final = case(31, 2, 4, 300, 1, 3)
    dtree, dlogits, dcoins, dfinal = on_device(tree, logits, coins, coins_final)
    with pytest.raises(ValueError, match=r"logits must be \[bs\*D, V\]"):
        fused_verify(dlogits[:-1], None, dtree, 1.0)
    with pytest.raises(ValueError, match="coins must have shape"):
        fused_verify(dlogits, None, dtree, 1.0, coins=dcoins[:, :2])
    with pytest.raises(ValueError, match="candidates must be token ids"):
        fused_verify(dlogits, dtree.candidates + 1000, dtree, 1.0)
    with pytest.raises(ValueError, match="temperatures must be finite and > 0"):
        fused_verify(dlogits, None, dtree, 0.0)
    bad = dlogits.clone()
    bad[3, 5] = math.nan
    with pytest.raises(ValueError, match="NaN"):
        fused_verify(bad, None, dtree, 1.0)
    with pytest.raises(ValueError, match="threshold_acc"):
        fused_verify(dlogits, None, dtree, 1.0, threshold_acc=1.5)


# ---------------------------------------------------------------------------------
# The emitted distribution (the GPU file runs the same case at 8192 x 40 samples)


CHI_SUPPORT = [3, 5, 9, 17, 33, 60]  # the only finite logits of the two sampled rows (V = 64)


def chi_square_case(verify, top_k, top_p, bs, reps, device, seed=0):
    """``bs`` copies of one request (root -> tokens 3, 9; 3 -> 5) verified ``reps`` times
    with fresh coins by ``verify(logits, tree, coins, coins_final, top_k, top_p)``; the root's
    and node 1's rows are two orders of the same six logits, the other rows uniform.

    Returns:
        ``{"first": (statistic, df, critical, samples), "second": ..., "second_vs_root": ...}``:
        Pearson's chi-square (alpha 1e-4) of the first emitted token against the root's
        target row, of the second (requests that accepted token 3) against node 1's row,
        and of the second against the root's row (None where the second emitted a token the
        root's row cannot, which tells the rows apart already).
    """
    vocab, d = 64, 4
    rows = torch.full((2, vocab), -math.inf)
    rows[0, CHI_SUPPORT] = torch.tensor([1.0, 0.5, 0.0, -0.3, -1.0, 0.2])
    rows[1, CHI_SUPPORT] = torch.tensor([-1.0, 0.8, 0.3, 1.2, 0.0, -0.5])
    tree = repeat_tree(tree_from_parents([[-1, 0, 0, 1]], [[0, 3, 9, 5]]), bs)
    tree = tree._replace(**{f: getattr(tree, f).to(device) for f in tree._fields[:4]})
    one = torch.zeros(d, vocab)
    one[:2] = rows
    logits = one.repeat(bs, 1).to(device)
    target = formula.target_probs_reference(rows, 1.0, top_k, top_p)
    assert int((target[0] > 0).sum()) >= 3 and int((target[1] > 0).sum()) >= 3, "too little support to test"
    g = torch.Generator(device=device).manual_seed(seed)
    firsts, seconds = [], []
    for _ in range(reps):
        coins = torch.rand(bs, d, device=device, generator=g)
        final = torch.rand(bs, device=device, generator=g)
        out = verify(logits, tree, coins, final, top_k, top_p)
        firsts.append(emitted_tokens(out, 0)[1])
        seconds.append(tokens_after(out, 3))
    first, second = torch.cat(firsts), torch.cat(seconds)
    result = {"first": (*chi_square(first, target[0], z=3.719), len(first)),
              "second": (*chi_square(second, target[1], z=3.719), len(second)), "second_vs_root": None}
    if bool((second.bincount(minlength=vocab)[target[0] <= 0] == 0).all()):
        result["second_vs_root"] = (*chi_square(second, target[0], z=3.719), len(second))
    return result


def assert_follows_the_target(result, min_second):
    for name in ("first", "second"):
        stat, df, critical, n = result[name]
        print(f"{name} token: chi-square {stat:.2f} with {df} degrees of freedom over {n} samples "
              f"(critical {critical:.2f})")
        assert stat < critical, f"the {name} emitted token does not follow its target row"
    assert result["second"][3] >= min_second
    wrong = result["second_vs_root"]
    assert wrong is None or wrong[0] > wrong[2], "the second token follows node 1's row, not the root's"


CHI_RENORMS = [(None, None), (3, None), (None, 0.8), (5, 0.8)]  # (5, 0.8): top-k and top-p both cut


@pytest.mark.parametrize("top_k,top_p", CHI_RENORMS, ids=["plain", "top-k", "top-p", "top-k+top-p"])
def test_reference_emits_the_target_distribution_at_the_gpu_case(top_k, top_p):
    """The GPU chi-square's case on the reference path (bitwise the fused path's tokens)."""
    def verify(logits, tree, coins, final, k, p):
        return eagle_verify(logits, None, tree, 1.0, top_ks=k, top_ps=p, coins=coins, coins_final=final,
                            impl="reference")

    assert_follows_the_target(chi_square_case(verify, top_k, top_p, 8192, 3, "cpu"), min_second=5000)


@pytest.mark.parametrize("top_k,top_p", cases(CHI_RENORMS, [0]))
def test_fused_emits_the_target_distribution_in_the_interpreter(top_k, top_p):
    """The same through the kernels in Triton's interpreter: 64 samples (1024 deep), a weak
    statistic by default, but a zero-probability token or a wrong row fails it."""
    def verify(logits, tree, coins, final, k, p):
        return fused_verify(logits, None, tree, 1.0, top_ks=k, top_ps=p, coins=coins, coins_final=final)

    bs, reps = (512, 2) if DEEP else (64, 1)
    assert_follows_the_target(chi_square_case(verify, top_k, top_p, bs, reps, DEVICE), min_second=bs * reps // 5)


# ---------------------------------------------------------------------------------
# The workspace: every temporary, recorded on the layout-only simulated device


@pytest.mark.parametrize("top_k,top_p", [(None, None), (50, 0.9)])
def test_workspace_on_the_simulated_device_has_no_vocabulary_wide_temporary(top_k, top_p):
    """A dry run (run_step with launch=False, what the planner records) allocates the step's
    outputs (one int32 buffer, kept), then its workspace (workspace_bytes: plain 41 KiB, with
    top-k / top-p 258 KiB), freed when the step ends. (An eager call that launches reuses the
    configuration's workspace for its stream instead, allocating its outputs only.) Nothing
    comes near [bs*D, V]."""
    from graphborrow.sim import SimBackend

    bs, d, vocab = 64, 8, 128256
    backend = SimBackend(capacity=8 * 2**30, backed=False)
    try:
        tree = build_draft_tree(4, 3, d, bs, vocab, generator=torch.Generator().manual_seed(0), device="cuda")
        logits = torch.empty(bs * d, vocab, device="cuda")
        before = backend.memory_allocated()
        backend.record_memory_history(max_entries=100_000)
        step = VerifyStep.of(logits, None, tree, 1.0, top_k, top_p)
        result = fv.allocate_outputs(step)
        fv.run_step(step, result, launch=False)
        trace = backend.full_snapshot()["device_traces"][0]
        backend.record_memory_history(False)
        allocs = [e["size"] for e in trace if e["action"] == "alloc"]
        frees = [e["size"] for e in trace if e["action"] == "free_requested"]
        outputs = 4 * (bs * d + bs * tree.tree_depth + bs)  # predicts, accept_index, accept_length (no padding here)
        workspace = lc.workspace_bytes(bs, d, vocab, top_k is not None, top_p is not None)
        assert allocs == [outputs, workspace] and frees == [workspace]
        assert backend.memory_allocated() - before == fv_round(allocs[0])
        assert max(allocs) < bs * d * vocab * 4 // 16  # nothing near the [bs*D, V] matrix
        del result
    finally:
        backend.close()


def fv_round(nbytes):
    return -(-nbytes // 512) * 512


def test_workspace_bytes_grow_with_rows_not_vocabulary():
    small = lc.workspace_bytes(32, 8, 32000, top_k=True, top_p=True)
    wide = lc.workspace_bytes(32, 8, 128256, top_k=True, top_p=True)
    assert wide < 2 * small  # at most the split count changes with V
    assert lc.workspace_bytes(128, 16, 128256) < 128 * 16 * 128256 * 4 / 1000
