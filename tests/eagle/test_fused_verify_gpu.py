"""The fused verification on a real GPU: exactness at serving shapes, the emitted
distribution (chi-square), CUDA-graph capture and replay, and no host synchronisation.

Run on a CUDA machine: ``pytest -m gpu tests/eagle/test_fused_verify_gpu.py -rA`` (sized to take
under a minute on an H200, most of it the grid's 128k-wide points and their full-matrix references).
The float32 top-p row and the chi-square case are built by test_fused_verify's helpers,
whose interpreter tests run the same cases on CPU.
The reference is the verification over ``target_probs_reference`` (the kernels' formula
in torch ops) with upstream's kernel semantics on full matrices: the same tokens, bit for
bit; and ``eagle_verify(impl="reference")`` (the PyTorch modes, which compute the same
formula) emits them too, while ``impl="auto"`` takes the fused path on CUDA.
A mismatch prints the first differing request: its tree, coins and both outputs.
"""

import math

import pytest
import torch
from test_fused_verify import (  # shared cases
    CHI_RENORMS,
    assert_follows_the_target,
    chi_square_case,
    float32_top_p_case,
)

from graphborrow.eagle import eagle_verify, tree_speculative_sampling_target_only
from graphborrow.eagle.acceptance import emitted_tokens
from graphborrow.eagle.draft_tree import build_draft_tree, repeat_tree
from graphborrow.eagle.probs import target_probs_reference
from graphborrow.eagle.triton import fused as fv
from graphborrow.eagle.triton import fused_renorm as fr
from graphborrow.eagle.triton import launch_config as lc

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run: pytest -m gpu tests/)"),
]

# bs, D, (topk, depth), V, temperature, top_k, top_p, thresholds, ties. Every vocabulary but
# 8192 is off the kernels' tiles (2048 entries streaming, 1024 in the pivot passes); top-k alone
# (4, 9, 12), top-p alone (5, 7, 11), both (2, 6, 10); thresholds other than (1, 1) (3, 6, 9,
# 11); integer-logit ties (4, 7, 9, 10); bs 256 (3, 4, 9, 12); D 32 and 64 (5, 9, 10).
GRID = [
    (1, 4, (1, 3), 128256, 1.0, None, None, (1.0, 1.0), False),
    (32, 8, (4, 3), 128256, 0.8, None, None, (1.0, 1.0), False),
    (16, 16, (4, 5), 128256, 1.0, 50, 0.9, (1.0, 1.0), False),
    (256, 8, (4, 3), 32017, 0.7, None, None, (0.9, 0.5), False),
    (256, 4, (1, 3), 4099, 1.0, 20, None, (1.0, 1.0), True),
    (64, 64, (8, 4), 5003, 1.2, None, 0.8, (1.0, 1.0), False),
    (8, 16, (4, 5), 128256, 0.6, 1000, 0.95, (0.5, 0.9), False),
    (128, 8, (4, 3), 151937, 1.0, None, 0.5, (1.0, 1.0), True),
    (128, 16, (4, 5), 128256, 1.0, None, None, (1.0, 1.0), False),
    (256, 64, (8, 4), 1031, 0.9, 64, None, (0.7, 0.8), True),
    (32, 32, (4, 4), 8192, 1.0, 7, 0.6, (1.0, 1.0), True),
    (64, 8, (4, 3), 50257, 0.8, None, 0.95, (0.6, 0.7), False),
    (256, 16, (4, 5), 2053, 1.0, 100, None, (1.0, 1.0), False),
]
SEEDS = 3  # independent trees, logits and coins per point


def fused_verify(logits, candidates, tree, temperatures, **kw):
    """eagle_verify through the fused kernels."""
    return eagle_verify(logits, candidates, tree, temperatures, impl="fused", **kw)


def gpu_case(seed, bs, d, shape, vocab, ties, temperature=1.0, tree=None):
    """Random logits whose parent rows favour their children: by t*ln(V) + 2/t plus a spread
    of a few nats, so a candidate holds 10-80 % of its row and paths are accepted and
    rejected alike (random logits over a 128k vocabulary would reject almost every draft).
    ``tree``: new logits and coins for that tree instead of a new one."""
    g = torch.Generator().manual_seed(seed)
    if tree is None:
        tree = build_draft_tree(shape[0], shape[1], d, bs, vocab, generator=g, device="cuda")
    gd = torch.Generator(device="cuda").manual_seed(seed)
    if ties:
        logits = torch.randint(-4, 4, (bs * d, vocab), device="cuda", generator=gd).float()
    else:
        logits = 2.0 * torch.randn(bs * d, vocab, device="cuda", generator=gd)
    t = temperature
    centre = t * math.log(vocab) + 2.0 / t
    parent_rows = (torch.arange(bs, device="cuda").unsqueeze(1) * d + torch.arange(d, device="cuda")).reshape(-1)
    for n in range(d):
        child = tree.retrive_next_token[:, n]
        while bool((child >= 0).any()):
            ok = child >= 0
            rows = parent_rows.view(bs, d)[:, n][ok]
            toks = tree.candidates[ok, child[ok]]
            spread = t * (3.5 * torch.rand(rows.shape[0], device="cuda", generator=gd) - 2.5)
            logits[rows, toks] = centre + spread
            child = torch.where(ok, tree.retrive_next_sibling.gather(1, child.clamp(min=0).unsqueeze(1)).squeeze(1), child)
    coins = torch.rand(bs, d, device="cuda", generator=gd)
    coins_final = torch.rand(bs, device="cuda", generator=gd)
    return tree, logits, coins, coins_final


def reference(logits, tree, temp, top_k=None, top_p=None, coins=None, coins_final=None, thr=(1.0, 1.0)):
    """Verification over target_probs_reference with upstream's kernel semantics."""
    bs, d = tree.candidates.shape
    probs = target_probs_reference(logits, temp, top_k, top_p).view(bs, d, -1)
    predicts = torch.zeros(bs * d, dtype=torch.int32, device="cuda")
    accept_index = torch.full((bs, tree.tree_depth), -1, dtype=torch.int32, device="cuda")
    accepted = torch.zeros(bs, dtype=torch.int32, device="cuda")
    tree_speculative_sampling_target_only(predicts, accept_index, accepted, tree.candidates, tree.retrive_index,
                                          tree.retrive_next_token, tree.retrive_next_sibling, coins, coins_final,
                                          probs, torch.zeros_like(probs), thr[0], thr[1])
    return predicts, accept_index, accepted + 1


def differing(expected, got, bs, d):
    differs = ((expected[0].view(bs, d) != got[0].view(bs, d)).any(dim=1)
               | (expected[1] != got[1]).any(dim=1) | (expected[2] != got[2]))
    return differs.nonzero().flatten().tolist()


def diagnose(tree, coins, coins_final, expected, got, bad) -> str:
    b = int(bad[0])
    d = tree.candidates.shape[1]
    return (f"{len(bad)} request(s) differ; first: request {b}\n"
            f"tree next_token {tree.retrive_next_token[b].tolist()}\nnext_sibling {tree.retrive_next_sibling[b].tolist()}\n"
            f"candidates {tree.candidates[b].tolist()}\ncoins {coins[b].tolist()} final {coins_final[b].item()}\n"
            f"reference: predicts {expected[0].view(-1, d)[b].tolist()} accept_index "
            f"{expected[1][b].tolist()} length {expected[2][b].item()}\n"
            f"fused:     predicts {got[0].view(-1, d)[b].tolist()} accept_index {got[1][b].tolist()} "
            f"length {got[2][b].item()}")


@pytest.mark.parametrize("point,seed", [(p, s) for p in range(len(GRID)) for s in range(SEEDS)],
                         ids=[f"{p}-seed{s}" for p in range(len(GRID)) for s in range(SEEDS)])
def test_fused_emits_the_reference_tokens(point, seed):
    bs, d, shape, vocab, temp, top_k, top_p, thr, ties = GRID[point]
    tree, logits, coins, coins_final = gpu_case(100 + point + 1000 * seed, bs, d, shape, vocab, ties, temp)
    expected = reference(logits, tree, temp, top_k, top_p, coins, coins_final, thr)
    got = fused_verify(logits, None, tree, temp, top_ks=top_k, top_ps=top_p, coins=coins, coins_final=coins_final,
                          threshold_single=thr[0], threshold_acc=thr[1])
    bad = differing(expected, got, bs, d)
    lengths = got.accept_length.float()
    print(f"point {point} seed {seed}: accept length mean {lengths.mean():.2f} (max {tree.tree_depth})")
    assert not bad, diagnose(tree, coins, coins_final, expected, got, bad)
    if seed == 0:  # the public call's two paths, once per point (its reference modes cost most of the time)
        kw = dict(top_ks=top_k, top_ps=top_p, coins=coins, coins_final=coins_final, threshold_single=thr[0],
                  threshold_acc=thr[1])
        reference_path = eagle_verify(logits, None, tree, temp, impl="reference", **kw)
        auto = eagle_verify(logits, None, tree, temp, **kw)
        bad_reference = differing(reference_path, got, bs, d)
        assert not bad_reference, diagnose(tree, coins, coins_final, reference_path, got, bad_reference)
        assert not differing(auto, got, bs, d)  # auto: the fused path on CUDA
    if bs >= 8:  # enough requests that some walk deep and some are rejected early
        assert 1.3 < float(lengths.mean()) and float(lengths.min()) < tree.tree_depth


@pytest.mark.parametrize("vocab", [300, 128256])
def test_top_p_is_float32_when_the_kept_mass_lies_just_under_top_p(vocab):
    """The interpreter test's row (kept mass float32(top_p) exactly, just under top_p; see
    test_fused_verify.float32_top_p_case) repeated over a batch with random coins: the
    candidates have probability 0, so every request emits one of the two kept tokens."""
    one, logits, top_p, kept = float32_top_p_case(vocab)
    bs = 64
    tree = repeat_tree(one, bs)
    tree = tree._replace(**{f: getattr(tree, f).cuda() for f in tree._fields[:4]})
    logits = logits.repeat(bs, 1).cuda()
    g = torch.Generator(device="cuda").manual_seed(vocab)
    coins = torch.rand(bs, 4, device="cuda", generator=g)
    final = torch.rand(bs, device="cuda", generator=g)
    expected = reference(logits, tree, 1.0, None, top_p, coins, final)
    got = fused_verify(logits, None, tree, 1.0, top_ps=top_p, coins=coins, coins_final=final)
    bad = differing(expected, got, bs, 4)
    assert not bad, diagnose(tree, coins, final, expected, got, bad)
    assert not differing(eagle_verify(logits, None, tree, 1.0, top_ps=top_p, coins=coins, coins_final=final,
                                      impl="reference"), got, bs, 4)
    _, first = emitted_tokens(got, 0)
    assert got.accept_length.eq(1).all() and sorted(first.unique().tolist()) == kept  # the residual: both, only them


def test_kernel_probabilities_are_target_probs_reference_bitwise():
    """Every candidate of every row, and every entry of a few whole rows."""
    tree, logits, _, _ = gpu_case(7, 64, 8, (4, 3), 128256, False, 0.8)
    temps = torch.linspace(0.3, 1.9, 64, device="cuda")
    expected = target_probs_reference(logits, temps.repeat_interleave(8))
    toks = tree.candidates.repeat_interleave(8, dim=0)
    kernel_p = fv.fused_token_probs(logits, temps, 8, toks)
    assert torch.equal(kernel_p, expected.gather(1, toks))
    rows = slice(0, 16)  # two requests
    whole = torch.arange(128256, device="cuda").expand(16, 128256).contiguous()
    assert torch.equal(fv.fused_token_probs(logits[rows].contiguous(), temps[:2], 8, whole), expected[rows])
    softmax = torch.softmax(logits / temps.repeat_interleave(8).unsqueeze(1), dim=-1).gather(1, toks)
    print(f"candidate probabilities bitwise equal to torch.softmax's: {(kernel_p == softmax).float().mean():.4f}")


@pytest.mark.parametrize("top_k,top_p", CHI_RENORMS, ids=["plain", "top-k", "top-p", "top-k+top-p"])
def test_emitted_tokens_follow_the_target_distribution(top_k, top_p):
    """Chi-square (graphborrow.eagle.acceptance's, as the CPU tests) over 8192 x 40 samples of
    test_fused_verify.chi_square_case: the first emitted token (accepted draft or residual
    sample) follows the (renormalised) root row; among the requests that accepted node 1,
    the second follows node 1's row, and not the root's."""
    def verify(logits, tree, coins, final, k, p):
        return fused_verify(logits, None, tree, 1.0, top_ks=k, top_ps=p, coins=coins, coins_final=final,
                               validate=False)

    assert_follows_the_target(chi_square_case(verify, top_k, top_p, 8192, 40, "cuda"), min_second=10_000)


def warmed_up_and_captured(step):
    """Run ``step`` once on a side stream (compiling and warming up outside the capture), then
    capture one call of it: the graph, and what the captured call returned."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    return graph, captured


@pytest.mark.parametrize("renorm", [dict(), dict(top_ks=40, top_ps=0.9)])
def test_a_verification_step_is_captured_in_a_cuda_graph_and_replays(renorm):
    bs, d, vocab = 16, 8, 128256
    tree, logits, coins, coins_final = gpu_case(3, bs, d, (4, 3), vocab, False, 0.9)
    static_logits, static_coins, static_final = logits.clone(), coins.clone(), coins_final.clone()
    out = (torch.zeros(bs * d, dtype=torch.int32, device="cuda"),
           torch.zeros(bs, tree.tree_depth, dtype=torch.int32, device="cuda"),
           torch.zeros(bs, dtype=torch.int32, device="cuda"))

    def step():
        return fused_verify(static_logits, None, tree, 0.9, coins=static_coins, coins_final=static_final,
                               out=out, validate=False, **renorm)

    graph, _ = warmed_up_and_captured(step)
    for seed in (11, 12):
        _, new_logits, new_coins, new_final = gpu_case(seed, bs, d, (4, 3), vocab, False, 0.9)
        static_logits.copy_(new_logits)
        static_coins.copy_(new_coins)
        static_final.copy_(new_final)
        graph.replay()
        torch.cuda.synchronize()
        replayed = [t.clone() for t in out]
        eager = fused_verify(new_logits, None, tree, 0.9, coins=new_coins, coins_final=new_final, **renorm)
        expected = reference(new_logits, tree, 0.9, renorm.get("top_ks"), renorm.get("top_ps"), new_coins, new_final)
        for a, b, c in zip(replayed, eager, expected):
            assert torch.equal(a, b) and torch.equal(b, c)


@pytest.mark.parametrize("renorm", [dict(), dict(top_ks=40, top_ps=0.9)])
def test_the_public_call_is_captured_in_a_cuda_graph_and_replays(renorm):
    """eagle_verify(impl="auto", validate=False) as a serving engine captures it: static
    logits and coins, the outputs allocated inside the capture (in the graph's pool) and
    rewritten by each replay; after new logits and coins are copied in, a replay gives what
    an eager call and the reference give for them."""
    bs, d, vocab, temp = 16, 8, 128256, 0.9
    tree, logits, coins, coins_final = gpu_case(4, bs, d, (4, 3), vocab, False, temp)
    static_logits, static_coins, static_final = logits.clone(), coins.clone(), coins_final.clone()

    def step():
        return eagle_verify(static_logits, None, tree, temp, coins=static_coins, coins_final=static_final,
                            impl="auto", validate=False, **renorm)

    graph, captured = warmed_up_and_captured(step)
    seen = []
    for seed in (13, 14):
        _, new_logits, new_coins, new_final = gpu_case(seed, bs, d, (4, 3), vocab, False, temp, tree=tree)
        static_logits.copy_(new_logits)
        static_coins.copy_(new_coins)
        static_final.copy_(new_final)
        graph.replay()
        torch.cuda.synchronize()
        replayed = [t.clone() for t in captured]
        eager = eagle_verify(new_logits, None, tree, temp, coins=new_coins, coins_final=new_final, impl="auto",
                             **renorm)
        expected = reference(new_logits, tree, temp, renorm.get("top_ks"), renorm.get("top_ps"), new_coins, new_final)
        for name, a, b, c in zip(("predicts", "accept_index", "accept_length"), replayed, eager, expected):
            assert torch.equal(a, b), f"replayed {name} differs from the eager call's"
            assert torch.equal(b, c), f"eager {name} differs from the reference's"
        assert int(replayed[2].max()) >= 2  # paths walked, not only residuals
        seen.append(replayed)
    assert any(not torch.equal(a, b) for a, b in zip(*seen)), "two replays on other inputs gave the same outputs"


@pytest.mark.parametrize("renorm", [dict(), dict(top_ks=40, top_ps=0.9)])
def test_no_host_synchronisation_with_validate_off(renorm):
    tree, logits, coins, coins_final = gpu_case(5, 8, 8, (4, 3), 32000, False)
    kw = dict(coins=coins, coins_final=coins_final, validate=False, **renorm)
    fused_verify(logits, None, tree, 1.0, **kw)  # compile first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fused_verify(logits, None, tree, 1.0, **kw)
        eagle_verify(logits, None, tree, 1.0, impl="fused", mode="chunked", chunk_rows=24, **kw)
        eagle_verify(logits, None, tree, 1.0, impl="auto", **kw)  # the public call too
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


def test_standalone_top_p_renorm_matches_the_reference_on_the_gpu():
    from graphborrow.eagle.renorm import top_k_renorm_probs, top_p_renorm_probs

    g = torch.Generator(device="cuda").manual_seed(1)
    probs = torch.softmax(3.0 * torch.randn(32, 128256, device="cuda", generator=g), dim=-1)
    assert torch.equal(fr.top_p_renorm(probs, 0.9), top_p_renorm_probs(probs, 0.9))
    assert torch.equal(fr.top_k_renorm(probs, 50), top_k_renorm_probs(probs, 50))


def test_standalone_renorm_in_a_graph_and_on_two_streams():
    """Eager calls reuse a workspace per stream (its counters left at zero, its parameter
    slot refilled only when the number changes); a captured call gets a workspace of its
    own inside the graph. Replays, and eager calls on two streams in between, all give the
    reference's values."""
    from graphborrow.eagle.renorm import top_k_renorm_probs, top_p_renorm_probs

    lc.clear_configs()
    g = torch.Generator(device="cuda").manual_seed(2)
    probs = torch.softmax(3.0 * torch.randn(16, 128256, device="cuda", generator=g), dim=-1)
    expected = {0.9: top_p_renorm_probs(probs, 0.9), 0.5: top_p_renorm_probs(probs, 0.5)}
    assert torch.equal(fr.top_p_renorm(probs, 0.9, validate=False), expected[0.9])  # (compiles)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        on_side = [fr.top_p_renorm(probs, p, validate=False) for p in (0.5, 0.9, 0.5)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = fr.top_p_renorm(probs, 0.9, validate=False)
    for p in (0.9, 0.5, 0.5, 0.9):
        graph.replay()
        assert torch.equal(fr.top_p_renorm(probs, p, validate=False), expected[p])
        assert torch.equal(static, expected[0.9])
    torch.cuda.current_stream().wait_stream(side)
    assert all(torch.equal(t, expected[p]) for t, p in zip(on_side, (0.5, 0.9, 0.5)))
    (config,) = lc.RENORM_CONFIGS.configs.values()
    assert len(config.cached) == 2  # the two streams'; the graph's workspace is its own
    assert all(int(entry.views.select_counters.abs().sum()) == 0 for entry in config.cached.values())
    k = torch.tensor([1, 50, 128256, 7] * 4, device="cuda")
    assert torch.equal(fr.top_k_renorm(probs, k, validate=False), top_k_renorm_probs(probs, k))
