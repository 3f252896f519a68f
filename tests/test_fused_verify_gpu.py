"""The fused verification on a real GPU: exactness at serving shapes, the emitted
distribution (chi-square), CUDA-graph capture and replay, and no host synchronisation.

Run on a CUDA machine: ``pytest -m gpu tests/test_fused_verify_gpu.py -rA``.
The reference is the verification over ``target_probs_reference`` (the kernels' formula
in torch ops) with upstream's kernel semantics on full matrices: the same tokens, bit for
bit; and ``eagle_verify(impl="reference")`` (the PyTorch modes, which compute the same
formula) emits them too, while ``impl="auto"`` takes the fused path on CUDA.
A mismatch prints the first differing request: its tree, coins and both outputs.
"""

import math

import pytest
import torch

from graphborrow.eagle import fused as fv
from graphborrow.draft_tree import build_draft_tree, tree_from_parents
from graphborrow.eagle import eagle_verify, tree_speculative_sampling_target_only

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run: pytest -m gpu tests/)"),
]

# bs, D, (topk, depth), V, temperature, top_k, top_p, thresholds, ties
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
]


def gpu_case(seed, bs, d, shape, vocab, ties, temperature=1.0):
    """Random logits whose parent rows favour their children: by t*ln(V) + 2/t plus a spread
    of a few nats, so a candidate holds 10-80 % of its row and paths are accepted and
    rejected alike (random logits over a 128k vocabulary would reject almost every draft)."""
    g = torch.Generator().manual_seed(seed)
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
    probs = fv.target_probs_reference(logits, temp, top_k, top_p).view(bs, d, -1)
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


@pytest.mark.parametrize("point", range(len(GRID)))
def test_fused_emits_the_reference_tokens(point):
    bs, d, shape, vocab, temp, top_k, top_p, thr, ties = GRID[point]
    tree, logits, coins, coins_final = gpu_case(100 + point, bs, d, shape, vocab, ties, temp)
    expected = reference(logits, tree, temp, top_k, top_p, coins, coins_final, thr)
    got = fv.fused_verify(logits, None, tree, temp, top_ks=top_k, top_ps=top_p, coins=coins, coins_final=coins_final,
                          threshold_single=thr[0], threshold_acc=thr[1])
    bad = differing(expected, got, bs, d)
    kw = dict(top_ks=top_k, top_ps=top_p, coins=coins, coins_final=coins_final, threshold_single=thr[0],
              threshold_acc=thr[1])
    reference_path = eagle_verify(logits, None, tree, temp, impl="reference", **kw)
    auto = eagle_verify(logits, None, tree, temp, **kw)
    lengths = got.accept_length.float()
    print(f"point {point}: accept length mean {lengths.mean():.2f} (max {tree.tree_depth})")
    assert not bad, diagnose(tree, coins, coins_final, expected, got, bad)
    bad_reference = differing(reference_path, got, bs, d)
    assert not bad_reference, diagnose(tree, coins, coins_final, reference_path, got, bad_reference)
    assert not differing(auto, got, bs, d)  # auto: the fused path on CUDA
    if bs >= 8:  # enough requests that some walk deep and some are rejected early
        assert 1.3 < float(lengths.mean()) and float(lengths.min()) < tree.tree_depth


def test_kernel_probabilities_are_target_probs_reference_bitwise():
    """Every candidate of every row, and every entry of a few whole rows."""
    tree, logits, _, _ = gpu_case(7, 64, 8, (4, 3), 128256, False, 0.8)
    temps = torch.linspace(0.3, 1.9, 64, device="cuda")
    expected = fv.target_probs_reference(logits, temps.repeat_interleave(8))
    toks = tree.candidates.repeat_interleave(8, dim=0)
    kernel_p = fv.fused_token_probs(logits, temps, 8, toks)
    assert torch.equal(kernel_p, expected.gather(1, toks))
    rows = slice(0, 16)  # two requests
    whole = torch.arange(128256, device="cuda").expand(16, 128256).contiguous()
    assert torch.equal(fv.fused_token_probs(logits[rows].contiguous(), temps[:2], 8, whole), expected[rows])
    softmax = torch.softmax(logits / temps.repeat_interleave(8).unsqueeze(1), dim=-1).gather(1, toks)
    print(f"candidate probabilities bitwise equal to torch.softmax's: {(kernel_p == softmax).float().mean():.4f}")


@pytest.mark.parametrize("renorm", [None, (3, None)])
def test_emitted_first_token_follows_the_target_distribution(renorm):
    """Chi-square over 6 tokens of the root row: the first emitted token (accepted draft
    or residual sample) must be distributed as the (renormalised) target."""
    vocab, reps = 64, 40
    bs, d = 8192, 4
    root_logits = torch.full((vocab,), -math.inf)
    support = [3, 5, 9, 17, 33, 60]
    root_logits[support] = torch.tensor([1.0, 0.5, 0.0, -0.3, -1.0, 0.2])
    tree = tree_from_parents([[-1, 0, 0, 1]] * bs, [[0, 3, 9, 5]] * bs, device="cuda")
    logits = torch.zeros(bs * d, vocab)
    logits.view(bs, d, vocab)[:, 0] = root_logits
    logits = logits.cuda()
    target = torch.softmax(root_logits, dim=0)
    if renorm is not None:  # top-3 keeps tokens 3, 5 and 60
        kept = torch.zeros(vocab, dtype=torch.bool)
        kept[torch.topk(target, renorm[0]).indices] = True
        target = torch.where(kept, target, 0.0)
        target = target / target.sum()
    counts = torch.zeros(vocab, dtype=torch.float64)
    g = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(reps):
        coins = torch.rand(bs, d, device="cuda", generator=g)
        final = torch.rand(bs, device="cuda", generator=g)
        out = fv.fused_verify(logits, None, tree, 1.0, top_ks=None if renorm is None else renorm[0],
                              coins=coins, coins_final=final, validate=False)
        first = out.predicts.view(bs, d)[:, 0].cpu()
        counts += torch.bincount(first, minlength=vocab).double()
    n = bs * reps
    expected = target.double() * n
    assert counts[expected == 0].sum() == 0, "a token with zero target probability was emitted"
    live = expected > 0
    chi2 = float(((counts[live] - expected[live]) ** 2 / expected[live]).sum())
    df = int(live.sum()) - 1
    critical = {2: 18.42, 5: 25.74}[df]  # chi-square quantiles at p = 1e-4
    print(f"chi-square {chi2:.2f} with {df} degrees of freedom over {n} samples (critical {critical})")
    assert chi2 < critical


@pytest.mark.parametrize("renorm", [dict(), dict(top_ks=40, top_ps=0.9)])
def test_a_verification_step_is_captured_in_a_cuda_graph_and_replays(renorm):
    bs, d, vocab = 16, 8, 128256
    tree, logits, coins, coins_final = gpu_case(3, bs, d, (4, 3), vocab, False, 0.9)
    static_logits, static_coins, static_final = logits.clone(), coins.clone(), coins_final.clone()
    out = (torch.zeros(bs * d, dtype=torch.int32, device="cuda"),
           torch.zeros(bs, tree.tree_depth, dtype=torch.int32, device="cuda"),
           torch.zeros(bs, dtype=torch.int32, device="cuda"))

    def step():
        return fv.fused_verify(static_logits, None, tree, 0.9, coins=static_coins, coins_final=static_final,
                               out=out, validate=False, **renorm)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed in (11, 12):
        _, new_logits, new_coins, new_final = gpu_case(seed, bs, d, (4, 3), vocab, False, 0.9)
        static_logits.copy_(new_logits)
        static_coins.copy_(new_coins)
        static_final.copy_(new_final)
        graph.replay()
        torch.cuda.synchronize()
        replayed = [t.clone() for t in out]
        eager = fv.fused_verify(new_logits, None, tree, 0.9, coins=new_coins, coins_final=new_final, **renorm)
        expected = reference(new_logits, tree, 0.9, renorm.get("top_ks"), renorm.get("top_ps"), new_coins, new_final)
        for a, b, c in zip(replayed, eager, expected):
            assert torch.equal(a, b) and torch.equal(b, c)


@pytest.mark.parametrize("renorm", [dict(), dict(top_ks=40, top_ps=0.9)])
def test_no_host_synchronisation_with_validate_off(renorm):
    tree, logits, coins, coins_final = gpu_case(5, 8, 8, (4, 3), 32000, False)
    kw = dict(coins=coins, coins_final=coins_final, validate=False, **renorm)
    fv.fused_verify(logits, None, tree, 1.0, **kw)  # compile first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fv.fused_verify(logits, None, tree, 1.0, **kw)
        fv.fused_verify(logits, None, tree, 1.0, chunk_requests=3, **kw)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


def test_standalone_top_p_renorm_matches_the_reference_on_the_gpu():
    from graphborrow.eagle.renorm import top_k_renorm_probs, top_p_renorm_probs

    g = torch.Generator(device="cuda").manual_seed(1)
    probs = torch.softmax(3.0 * torch.randn(32, 128256, device="cuda", generator=g), dim=-1)
    assert torch.equal(fv.top_p_renorm(probs, 0.9), top_p_renorm_probs(probs, 0.9))
    assert torch.equal(fv.top_k_renorm(probs, 50), top_k_renorm_probs(probs, 50))
