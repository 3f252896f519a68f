"""The upstream kernel's semantics: tree speculative sampling in the target-only form.

:func:`tree_speculative_sampling_target_only` takes the newest upstream kernel's
arguments, writes its outputs in place and follows its acceptance rule, in pure PyTorch
vectorised over the batch. Its pieces (:class:`TreeTables`, :func:`walk_tree`,
:func:`sample_final_token`) are what every verification mode is built from.

Shape, not values, decides every allocation here: the walk always takes one pass per
possible tree level (``D - 1``), masking the levels past the accept width. So a step's
allocation sequence can be recorded on a device without values (the capacity planner
does), and nothing here reads a value on the host (a CUDA graph could capture it).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .validate import check_kernel_args, check_thresholds

__all__ = ["tree_speculative_sampling_target_only"]


def tree_speculative_sampling_target_only(
    predicts,
    accept_index,
    accept_token_num,
    candidates,
    retrive_index,
    retrive_next_token,
    retrive_next_sibling,
    uniform_samples,
    uniform_samples_for_final_sampling,
    target_probs,
    draft_probs,
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
    deterministic: bool = True,
) -> None:
    """Walk each request's draft tree, accepting drafts against the target distribution.

    At each depth the children of the last accepted node are tried in sibling order;
    child ``c`` with target probability p (of the parent's row) is accepted when
    ``p > 0 and (coin < acc / threshold_acc or p >= threshold_single)``, where ``acc``
    sums p over the siblings tried so far at this depth and ``coin`` is the parent's
    uniform sample. Rejected siblings are written to ``draft_probs[b, parent, tok]``.
    The last token is drawn from ``relu(row - draft_probs[b, parent])`` of the last
    accepted node (without the subtraction when all S-1 depths were accepted), by
    inverse CDF with ``u = uniform_samples_for_final_sampling * sum``.

    Writes ``predicts`` [bs*D] (at the slots of accepted nodes), ``accept_index``
    [bs, S] (columns 0..n), ``accept_token_num`` [bs] and ``draft_probs``; entries off
    the accepted path keep their values. ``deterministic`` exists for signature parity:
    the PyTorch operations used here are deterministic. Arguments are checked first
    (shapes, dtypes, a well-formed tree, probabilities that are finite and >= 0).

    The signature is the upstream kernel's, argument for argument, so this function is its
    executable specification: the fused kernels are checked against it token for token.

    Args:
        predicts: [bs*D] int32 output: the emitted token at each accepted node's slot.
        accept_index: [bs, S] int32 output: the slots of the accepted path, root first.
        accept_token_num: [bs] int32 output: drafts accepted per request (emitted tokens - 1).
        candidates: [bs, D] int64 draft tokens; node 0 is the root.
        retrive_index: [bs, D] int64 output slot of each node (``request * D + node``).
        retrive_next_token: [bs, D] int64 first child of each node, -1 for none.
        retrive_next_sibling: [bs, D] int64 next sibling of each node, -1 for none.
        uniform_samples: [bs, D] float32 coins, one per node, for the acceptance tests.
        uniform_samples_for_final_sampling: [bs] float32 coins for the final sample.
        target_probs: [bs, D, V] float32 target probabilities, one row per node (after
            temperature and renorms).
        draft_probs: [bs, D, V] float32, in and out: rejected siblings' target
            probabilities are written here (the target-only form starts from zeros).
        threshold_single: a child with target probability at least this is accepted
            outright (1.0: exact sampling).
        threshold_acc: ``acc`` is divided by this before the coin test (1.0: exact sampling).
        deterministic: accepted for signature parity; the result is deterministic either way.

    Raises:
        ValueError: an argument of the wrong shape or dtype, a malformed tree, or
            probabilities that are not finite and >= 0.
    """
    bs, _ = check_kernel_args(
        predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
        retrive_next_sibling, uniform_samples, uniform_samples_for_final_sampling, target_probs,
        draft_probs, deterministic,
    )
    thr_single, thr_acc = check_thresholds(threshold_single, threshold_acc)
    if bs == 0:
        return
    tables = TreeTables.build(candidates, retrive_next_token, retrive_next_sibling)
    child_probs = target_probs.gather(2, tables.child_tokens)
    walk = walk_tree(tables, child_probs, candidates, retrive_index, uniform_samples, thr_single, thr_acc,
                     predicts, accept_index, accept_token_num, draft_probs)
    del child_probs
    rows = arange_like(bs, retrive_index)
    residual = target_probs[rows, walk.final_node]
    subtract = draft_probs[rows, walk.final_node]
    subtract_draft(residual, subtract, walk.bonus)
    del subtract
    cdf = residual.to(torch.float64)
    del residual
    sample_final_token(cdf, uniform_samples_for_final_sampling, walk, retrive_index, predicts)


class TreeTables(NamedTuple):
    """Each node's children in sibling order, padded with -1: [bs, D, K], K = max(D-1, 1)."""

    children: torch.Tensor
    valid: torch.Tensor
    child_tokens: torch.Tensor

    @staticmethod
    def build(candidates, next_token, next_sibling) -> "TreeTables":
        bs, d = next_token.shape
        cur = next_token
        columns = []
        for _k in range(max(d - 1, 1)):
            columns.append(cur)
            cur = torch.where(cur >= 0, next_sibling.gather(1, cur.clamp(min=0)), cur)
        children = torch.stack(columns, dim=2)
        valid = children >= 0
        child_tokens = candidates.gather(1, children.clamp(min=0).reshape(bs, -1)).reshape(children.shape)
        return TreeTables(children, valid, child_tokens)

    def rows(self, lo: int, hi: int) -> "TreeTables":
        """The tables of requests lo..hi-1 (views)."""
        return TreeTables(self.children[lo:hi], self.valid[lo:hi], self.child_tokens[lo:hi])


class Walk(NamedTuple):
    final_node: torch.Tensor      # [bs] last accepted node (0 = root)
    bonus: torch.Tensor           # [bs] every depth accepted: sample without subtraction
    final_rejected: torch.Tensor  # [bs, K] rejected children of final_node (lean residual)
    final_tokens: torch.Tensor    # [bs, K] their tokens
    last_rejected: torch.Tensor   # [bs] last rejected token with p > 0, or -1


def walk_tree(tables, child_probs, candidates, retrive_index, coins, thr_single, thr_acc,
              predicts, accept_index, accept_token_num, draft_probs) -> Walk:
    """Acceptance decisions for every node at once, then the path, one depth at a time.

    Takes D - 1 passes whatever the accept width S: passes past depth S - 1 accept
    nothing, so every step of one shape allocates the same sequence.
    """
    bs, d, k_max = tables.children.shape
    steps = accept_index.shape[1]
    p = torch.where(tables.valid, child_probs, 0.0)
    acc = torch.zeros_like(p[:, :, 0])
    accepted = []
    for k in range(k_max):  # acc += p in sibling order, as the kernel does; coins[b, n] decides n's children
        pk = p[:, :, k]
        acc = acc + pk
        ok = (pk > 0) & ((coins < acc / thr_acc) | (pk >= thr_single))
        accepted.append(ok & tables.valid[:, :, k])
    accepted = torch.stack(accepted, dim=2)
    k_index = arange_like(k_max, tables.children)
    first_ok = torch.where(accepted, k_index, k_max).amin(dim=2)  # [bs, D]; k_max = none

    rows = arange_like(bs, tables.children)
    node = torch.zeros_like(rows)
    alive = torch.ones_like(rows, dtype=torch.bool)
    accept_index[:, 0] = retrive_index[:, 0].to(accept_index.dtype)
    accepted_count = torch.zeros_like(rows)
    last_rejected = torch.full_like(rows, -1)
    final_rejected = torch.zeros_like(tables.valid[:, 0])
    final_tokens = tables.child_tokens[:, 0]
    for j in range(1, d):
        if j >= steps:
            alive.zero_()  # past the accept width: this pass only keeps the allocation sequence
        k_ok = first_ok[rows, node]
        tokens = tables.child_tokens[rows, node]
        probs = child_probs[rows, node]
        rejected = tables.valid[rows, node] & (k_index < k_ok.unsqueeze(1)) & alive.unsqueeze(1)
        if draft_probs is not None:
            record_rejected(draft_probs, rows, node, tokens, probs, rejected)
        positive = torch.where(rejected & (probs > 0), k_index, -1).amax(dim=1)
        last_rejected = torch.where(positive >= 0, tokens.gather(1, positive.clamp(min=0).unsqueeze(1)).squeeze(1),
                                    last_rejected)
        final_rejected = torch.where(alive.unsqueeze(1), rejected, final_rejected)
        final_tokens = torch.where(alive.unsqueeze(1), tokens, final_tokens)

        step = alive & (k_ok < k_max)
        child = tables.children[rows, node, k_ok.clamp(max=k_max - 1)].clamp(min=0)
        slot = retrive_index[rows, node]
        predicts[slot] = torch.where(step, candidates[rows, child].to(predicts.dtype), predicts[slot])
        column = min(j, steps - 1)
        accept_index[:, column] = torch.where(step, retrive_index[rows, child].to(accept_index.dtype),
                                              accept_index[:, column])
        accepted_count += step
        node = torch.where(step, child, node)
        alive = step
    accept_token_num.copy_(accepted_count)
    bonus = accepted_count == steps - 1
    final_rejected = final_rejected & ~bonus.unsqueeze(1)
    return Walk(node, bonus, final_rejected, final_tokens, last_rejected)


def record_rejected(draft_probs, rows, node, tokens, probs, rejected) -> None:
    """draft_probs[b, node, tok] = p for rejected children; every write to one entry agrees."""
    same_token = tokens.unsqueeze(2) == tokens.unsqueeze(1)
    hit = (same_token & rejected.unsqueeze(1)).any(dim=2)
    b = rows.unsqueeze(1)
    n = node.unsqueeze(1)
    draft_probs[b, n, tokens] = torch.where(hit, probs, draft_probs[b, n, tokens])


def subtract_draft(residual, subtract, bonus) -> None:
    """residual = relu(residual - subtract), leaving bonus rows (all depths accepted) whole."""
    residual.sub_(subtract.masked_fill_(bonus.unsqueeze(1), 0.0)).clamp_(min=0.0)


def sample_final_token(cdf, coins_final, walk, retrive_index, predicts) -> None:
    """Write the sampled last token at the final node's slot (``cdf``: float64 residual, consumed)."""
    rows = arange_like(cdf.shape[0], retrive_index)
    token = inverse_cdf(cdf, coins_final, walk.last_rejected)
    predicts[retrive_index[rows, walk.final_node]] = token.to(predicts.dtype)


def inverse_cdf(cdf: torch.Tensor, coins: torch.Tensor, last_rejected: torch.Tensor) -> torch.Tensor:
    """First index whose running sum exceeds ``coin * sum`` of the residual rows.

    ``cdf`` holds the residual in float64 and is turned into its running sum in place.
    Fallbacks as in the kernel: the last index with positive mass, then the last
    rejected token with p > 0, then V-1.
    """
    vocab = cdf.shape[1]
    positive = cdf > 0
    any_positive = positive.any(dim=1)
    last_positive = (vocab - 1) - positive.flip(1).to(torch.uint8).argmax(dim=1)
    del positive
    cdf.cumsum_(dim=1)
    u = coins.to(torch.float64) * cdf[:, -1]
    first = torch.searchsorted(cdf, u.unsqueeze(1), right=True).squeeze(1)
    fallback = torch.where(last_rejected >= 0, last_rejected, vocab - 1)
    fallback = torch.where(any_positive, last_positive, fallback)
    return torch.where(first < vocab, first, fallback)


def arange_like(n: int, like: torch.Tensor) -> torch.Tensor:
    """0..n-1 (int64) next to ``like``, without naming a device (works on the simulated one)."""
    return torch.arange(n, out=like.new_empty(n, dtype=torch.long))
