"""At thresholds (1, 1) verification is exact sampling from the target: chi-square tests
on many copies of one request, for several tree shapes, with and without renorm."""

import math

import numpy as np
import pytest
import torch

from graphborrow.eagle import eagle_verify
from graphborrow.eagle.draft_tree import build_draft_tree, tree_from_parents

pytestmark = pytest.mark.slow

COPIES = 20000
VOCAB = 10
ALPHA_Z = 3.0902  # one-sided normal quantile for alpha = 0.001


def chi2_critical(df: int, z: float = ALPHA_Z) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile."""
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + z * math.sqrt(h)) ** 3


def expected_row(logits_row, temperature, top_k=None, top_p=None):
    """Target distribution of one row, written out independently in float64."""
    x = np.asarray(logits_row, np.float64) / temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    if top_k is not None:
        pivot = np.sort(p)[::-1][min(top_k, len(p)) - 1]
        p = np.where(p >= pivot, p, 0.0)
        p /= p.sum()
    if top_p is not None and top_p < 1:
        order = np.sort(p)[::-1]
        pivot = order[np.searchsorted(np.cumsum(order), top_p)]
        p = np.where(p >= pivot, p, 0.0)
        p /= p.sum()
    return p


def chi_square(tokens, probs):
    observed = np.bincount(np.asarray(tokens), minlength=len(probs))
    support = probs > 0
    assert observed[~support].sum() == 0, "a zero-probability token was emitted"
    expected = probs[support] * len(tokens)
    stat = float(((observed[support] - expected) ** 2 / expected).sum())
    return stat, int(support.sum()) - 1


def assert_follows(tokens, probs, what):
    assert len(tokens) > 500, f"too few samples for {what}"
    stat, df = chi_square(tokens, probs)
    if df == 0:
        return
    assert stat < chi2_critical(df), f"{what}: chi2={stat:.1f} >= {chi2_critical(df):.1f} (df={df})"


def one_request(kind, seed):
    """A single request's tree and logits (rows favour drafted tokens somewhat)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "chain":
        tree = tree_from_parents([[-1, 0, 1, 2]], [[0, 1, 2, 3]])
    elif kind == "wide":
        tree = tree_from_parents([[-1, 0, 0, 0, 0]], [[0, 4, 1, 7, 2]])
    else:
        tree = build_draft_tree(topk=2, depth=3, num_draft_tokens=7, batch_size=1, vocab=VOCAB, generator=g)
    d = tree.candidates.shape[1]
    logits = torch.randn(d, VOCAB, generator=g)
    for c in range(1, d):
        parent = [n for n in range(d) if _children(tree, n).count(c)][0]
        logits[parent, tree.candidates[0, c]] += 2.0
    return tree, logits


def _children(tree, n):
    out, c = [], int(tree.retrive_next_token[0, n])
    while c != -1:
        out.append(c)
        c = int(tree.retrive_next_sibling[0, c])
    return out


def replicate(tree, logits, copies):
    d = tree.candidates.shape[1]
    rep = lambda t: t.repeat(copies, 1)  # noqa: E731
    return tree._replace(
        candidates=rep(tree.candidates),
        retrive_index=torch.arange(copies * d).view(copies, d),
        retrive_next_token=rep(tree.retrive_next_token),
        retrive_next_sibling=rep(tree.retrive_next_sibling),
    ), logits.repeat(copies, 1)


@pytest.mark.parametrize("kind", ["chain", "wide", "eagle"])
@pytest.mark.parametrize("renorm", [dict(), dict(top_k=5, top_p=0.8)])
def test_emitted_tokens_follow_the_target(kind, renorm):
    seed = {"chain": 1, "wide": 2, "eagle": 3}[kind] + 10 * len(renorm)
    tree, logits = one_request(kind, seed)
    d = tree.candidates.shape[1]
    temperature = 0.8
    many, many_logits = replicate(tree, logits, COPIES)
    result = eagle_verify(many_logits, None, many, temperature, top_ks=renorm.get("top_k"), top_ps=renorm.get("top_p"),
                          generator=torch.Generator().manual_seed(seed))
    predicts = result.predicts.view(COPIES, d).numpy()
    accept_index = result.accept_index.numpy()
    rows = [expected_row(logits[n].numpy(), temperature, **renorm) for n in range(d)]

    assert_follows(predicts[:, 0], rows[0], f"{kind}: first token")
    accepted_somewhere = 0
    for c in _children(tree, 0):
        took_c = accept_index[:, 1] == (np.arange(COPIES) * d + c)
        accepted_somewhere += took_c.sum()
        if took_c.sum() > 500:
            assert_follows(predicts[took_c, c], rows[c], f"{kind}: token after accepting node {c}")
    assert accepted_somewhere > COPIES // 10  # drafts are often right: both paths are exercised


def test_thresholds_zero_do_not_follow_the_target():
    """Negative control: greedy-ish acceptance distorts the first token, and the test sees it."""
    tree, logits = one_request("wide", 2)
    d = tree.candidates.shape[1]
    many, many_logits = replicate(tree, logits, COPIES)
    result = eagle_verify(many_logits, None, many, 0.8, threshold_single=0.0, threshold_acc=0.0,
                          generator=torch.Generator().manual_seed(0))
    stat, df = chi_square(result.predicts.view(COPIES, d)[:, 0].numpy(), expected_row(logits[0].numpy(), 0.8))
    assert stat > 10 * chi2_critical(df)


def test_lean_mode_follows_the_target_too():
    tree, logits = one_request("eagle", 5)
    d = tree.candidates.shape[1]
    many, many_logits = replicate(tree, logits, COPIES)
    result = eagle_verify(many_logits, None, many, 1.2, top_ps=0.9, mode="lean",
                          generator=torch.Generator().manual_seed(5))
    assert_follows(result.predicts.view(COPIES, d)[:, 0].numpy(), expected_row(logits[0].numpy(), 1.2, top_p=0.9),
                   "lean: first token")


def test_critical_values_match_the_table():
    # chi-square 0.999 quantiles from standard tables
    for df, table in ((1, 10.83), (5, 20.52), (9, 27.88), (20, 45.31)):
        assert abs(chi2_critical(df) - table) / table < 0.035
