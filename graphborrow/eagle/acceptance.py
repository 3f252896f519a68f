"""What target-only verification should emit, written out from its acceptance rule.

The rule (SGLang's ``tree_speculative_sampling_target_only`` at thresholds (1, 1)): the
draft counts as q = 1, so a candidate is judged by the target alone. At each depth one
coin ``u`` is drawn for the node just accepted (its row ``p`` of target probabilities)
and reused across its children, tried in sibling order with a running sum: child ``j``
is accepted when ``u < p(t_1) + ... + p(t_j)``, so with distinct tokens it is accepted
with probability ``p(t_j)``. When every child is rejected, the step ends with a token
drawn from the residual: the row with the rejected siblings' tokens removed,
renormalised. Either way the emitted token follows ``p`` exactly; the next token then
follows the accepted child's row. These functions compute the theory and read what a
batch of verifications emitted, so notebook 05 can compare the two.
"""

from __future__ import annotations

import math

import torch

from .draft_tree import DraftTree, repeat_tree
from .step import VerifyResult
from .verify import eagle_verify

__all__ = ["children_of", "chi_square", "emitted_tokens", "expected_emitted_tokens", "path_probabilities",
           "sample_copies", "tokens_after"]


def path_probabilities(tree: DraftTree, probs: torch.Tensor, request: int = 0) -> torch.Tensor:
    """Probability that each node of one request's tree is accepted: the product of the
    target probabilities of the candidates on its path (the root: 1).

    Args:
        tree: the draft tree (parents before children, as
            :func:`~graphborrow.eagle.draft_tree.build_draft_tree` numbers them).
        probs: ``[D, V]`` target probabilities of that request, row n = the distribution after node n.
        request: which request of the tree.

    Returns:
        ``[D]`` float64.
    """
    cand = tree.candidates[request].tolist()
    first, sibling = tree.retrive_next_token[request].tolist(), tree.retrive_next_sibling[request].tolist()
    rows = probs.double().cpu()
    reach = [0.0] * len(cand)
    reach[0] = 1.0
    for parent in range(len(cand)):
        child = first[parent]
        while child != -1:
            if child <= parent:
                raise ValueError(f"node {child} is a child of node {parent} but does not come after it")
            reach[child] = reach[parent] * float(rows[parent, cand[child]])
            child = sibling[child]
    return torch.tensor(reach, dtype=torch.float64)


def expected_emitted_tokens(tree: DraftTree, probs: torch.Tensor, request: int = 0) -> float:
    """Expected tokens one verification step emits for that request: accepted drafts + 1.

    Each accepted node contributes one token; the bonus (or residual) token always comes.
    Exact when the tree's depth does not cut any path short (it never does: every kept
    node is reachable within ``tree.tree_depth`` levels).
    """
    return float(path_probabilities(tree, probs, request).sum())


def emitted_tokens(result, position: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``position``-th emitted token of every request (0: the first), where there is one.

    Args:
        result: a :class:`~graphborrow.eagle.VerifyResult`.
        position: 0 for the first token, 1 for the second ...

    Returns:
        ``(requests, tokens)``: which requests emitted that many tokens, and the token.
    """
    lengths = result.accept_length.long().cpu()
    index = result.accept_index.long().cpu()
    predicts = result.predicts.long().cpu()
    requests = torch.nonzero(lengths > position).flatten()
    return requests, predicts[index[requests, position]]


def chi_square(tokens: torch.Tensor, probs: torch.Tensor, z: float = 3.0902) -> tuple[float, int, float]:
    """Pearson's chi-square of emitted ``tokens`` against the distribution ``probs``.

    Tokens of zero probability are an error (exact sampling never emits them). The
    critical value is the Wilson-Hilferty approximation at one-sided normal quantile
    ``z`` (3.0902: alpha = 0.001).

    Returns:
        ``(statistic, degrees of freedom, critical value)``; the test passes when the
        statistic is below the critical value.
    """
    probs = probs.double().cpu()
    observed = torch.bincount(tokens.long().cpu(), minlength=probs.numel()).double()
    support = probs > 0
    if observed[~support].sum() > 0:
        bad = torch.nonzero((observed > 0) & ~support).flatten().tolist()
        raise AssertionError(f"tokens {bad[:5]} of zero target probability were emitted")
    expected = probs[support] * len(tokens)
    stat = float(((observed[support] - expected) ** 2 / expected).sum())
    df = int(support.sum()) - 1
    if df <= 0:
        return stat, df, math.inf
    h = 2.0 / (9.0 * df)
    return stat, df, df * (1.0 - h + z * math.sqrt(h)) ** 3


def tokens_after(result, first_token: int) -> torch.Tensor:
    """Second emitted tokens of the requests whose first emitted token is ``first_token``.

    When ``first_token`` is a child of the root, those requests accepted that child, so
    their second token must follow the child's row of target probabilities: exactness
    beyond the first token.
    """
    requests, second = emitted_tokens(result, 1)
    first = result.predicts.long().cpu()[result.accept_index.long().cpu()[requests, 0]]
    return second[first == first_token]


def children_of(tree: DraftTree, node: int = 0, request: int = 0) -> list[int]:
    """The children of ``node`` in one request's tree, in sibling order (the order they are tried)."""
    out, child = [], int(tree.retrive_next_token[request, node])
    while child != -1:
        out.append(child)
        child = int(tree.retrive_next_sibling[request, child])
    return out


def sample_copies(tree: DraftTree, row_logits: torch.Tensor, temperature: float, samples: int,
                  generator: torch.Generator | None = None, copies_per_batch: int = 8192):
    """Verify ``samples`` copies of request 0 of ``tree`` with independent coins, on the CPU.

    The copies run in batches of ``copies_per_batch`` (so a million samples of a deep tree need
    memory for one batch, not for all of them) and come back as one
    :class:`~graphborrow.eagle.VerifyResult`, with ``accept_index`` renumbered to the joined
    ``predicts``: the same result one batch of ``samples`` copies would give.

    Args:
        tree: a :class:`DraftTree`; its request 0 is sampled.
        row_logits: [D, V] target logits of that request.
        temperature: the sampling temperature.
        samples: how many copies, at least 1.
        generator: the coins' random source.
        copies_per_batch: copies verified at once.
    """
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ValueError(f"samples={samples!r} must be a positive integer")
    d = row_logits.shape[0]
    parts = []
    for start in range(0, samples, copies_per_batch):
        n = min(copies_per_batch, samples - start)
        res = eagle_verify(row_logits.repeat(n, 1), None, repeat_tree(tree, n), temperature, generator=generator)
        index = res.accept_index.long()
        parts.append((res.predicts, torch.where(index >= 0, index + start * d, index).to(res.accept_index.dtype),
                      res.accept_length))
    return VerifyResult(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]),
                        torch.cat([p[2] for p in parts]))
