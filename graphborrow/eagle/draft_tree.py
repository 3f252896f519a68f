"""EAGLE draft trees: the candidate tokens a verification step checks.

A tree has ``num_draft_tokens`` nodes per request; node 0 is the root (the last
verified token). It is grown the way EAGLE-2 grows it: the root expands into ``topk``
children, then at every further level each of the ``topk`` best-scoring frontier nodes
expands into ``topk`` children and the best ``topk`` of those become the next frontier.
A node's score is the log-probability of its path under the (here random) draft model.
Finally the best ``num_draft_tokens - 1`` nodes are kept; a parent always scores at
least as well as its children and was created earlier, so the kept set is a tree.

Nodes are numbered in creation order (parents before children); a node's children are
linked first child -> next sibling in that order, i.e. most likely first.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["DraftTree", "build_draft_tree", "max_tree_nodes", "repeat_tree", "tree_depth_for", "tree_from_parents"]


class DraftTree(NamedTuple):
    """Tree tensors in the layout the verification kernel reads (all int64, [bs, D]).

    ``tree_depth`` is the width S of ``accept_index``: the root plus the number of
    draft levels, i.e. the most tokens a request can accept in one step.
    """

    candidates: torch.Tensor
    retrive_index: torch.Tensor
    retrive_next_token: torch.Tensor
    retrive_next_sibling: torch.Tensor
    tree_depth: int


def max_tree_nodes(topk: int, depth: int) -> int:
    """Nodes an EAGLE tree of this shape can hold, root included.

    The root expands into ``topk`` children; each later level expands the ``topk`` best
    nodes of the level before into ``topk`` children each.

    Args:
        topk: children per expanded node.
        depth: draft levels below the root.

    Returns:
        ``1 + topk + (depth - 1) * topk**2``: the largest ``num_draft_tokens`` that
        :func:`build_draft_tree` accepts for this shape.
    """
    return 1 + topk + (depth - 1) * topk * topk


def tree_depth_for(num_draft_tokens: int, branching: int) -> int:
    """The fewest draft levels (at least 1) a tree with ``branching`` children per expanded
    node needs to hold ``num_draft_tokens`` nodes, root included.

    Args:
        num_draft_tokens: nodes per request (D), at least 1.
        branching: children per expanded node (EAGLE's ``topk``), at least 1.

    Returns:
        The depth to pass to :func:`build_draft_tree`.
    """
    for name, value in (("num_draft_tokens", num_draft_tokens), ("branching", branching)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    depth = 1
    while max_tree_nodes(branching, depth) < num_draft_tokens:
        depth += 1
    return depth


def repeat_tree(tree: DraftTree, copies: int) -> DraftTree:
    """``copies`` requests that each carry the first request's tree, as one batch.

    The links (first child, next sibling) are node numbers within a request and are copied
    as they are; ``retrive_index`` holds global output slots (request * D + node) and is
    renumbered, so the copies write to slots of their own. Why: verifying one tree many
    times with independent coins samples the distribution of what it emits.

    Args:
        tree: a :class:`DraftTree`; its request 0 is repeated.
        copies: how many requests the result holds, at least 1.

    Returns:
        A :class:`DraftTree` of ``copies`` requests, on ``tree``'s device.

    Raises:
        ValueError: ``copies`` is not a positive int.
    """
    if isinstance(copies, bool) or not isinstance(copies, int) or copies < 1:
        raise ValueError(f"copies must be a positive int, got {copies!r}")
    d = tree.candidates.shape[1]
    first = [t[:1].expand(copies, d).contiguous() for t in
             (tree.candidates, tree.retrive_next_token, tree.retrive_next_sibling)]
    slots = torch.arange(copies * d, device=tree.retrive_index.device, dtype=tree.retrive_index.dtype).view(copies, d)
    return DraftTree(first[0], slots, first[1], first[2], tree.tree_depth)


def build_draft_tree(
    topk: int,
    depth: int,
    num_draft_tokens: int,
    batch_size: int,
    vocab: int,
    generator: torch.Generator | None = None,
    device="cpu",
) -> DraftTree:
    """Random EAGLE top-k draft trees for ``batch_size`` requests (drawn on CPU, then moved).

    Args:
        topk: children per expanded node (and frontier width).
        depth: draft levels below the root.
        num_draft_tokens: nodes kept per request, root included (D); at most
            :func:`max_tree_nodes` of ``topk`` and ``depth``.
        batch_size: requests (bs).
        vocab: vocabulary size; draft tokens are drawn from ``[0, vocab)``.
        generator: a CPU generator for reproducible trees.
        device: where the tensors go.

    Returns:
        A :class:`DraftTree` with ``tree_depth = depth + 1``.

    Raises:
        ValueError: a shape argument out of range, or a generator that is not on the CPU.
    """
    _check_shape(topk, depth, num_draft_tokens, batch_size, vocab)
    if generator is not None and generator.device.type != "cpu":
        raise ValueError("build_draft_tree draws on the CPU: pass a CPU torch.Generator (or None)")
    g = generator
    bs = batch_size

    root_tokens = torch.randint(vocab, (bs, 1), generator=g)
    tokens, scores, parents = [], [], []  # per recorded node, creation order; ids start at 1

    child_tokens, child_logp = _expand(bs, 1, topk, vocab, g)  # [bs, 1, topk]
    frontier_ids = torch.arange(1, topk + 1).expand(bs, topk)
    frontier_scores = child_logp.reshape(bs, topk)
    tokens.append(child_tokens.reshape(bs, topk))
    scores.append(frontier_scores)
    parents.append(torch.zeros(bs, topk, dtype=torch.long))
    next_id = 1 + topk

    for _level in range(1, depth):
        child_tokens, child_logp = _expand(bs, topk, topk, vocab, g)  # [bs, topk, topk]
        level_scores = (frontier_scores.unsqueeze(2) + child_logp).reshape(bs, topk * topk)
        level_parents = frontier_ids.unsqueeze(2).expand(bs, topk, topk).reshape(bs, topk * topk)
        level_ids = torch.arange(next_id, next_id + topk * topk).expand(bs, topk * topk)
        tokens.append(child_tokens.reshape(bs, topk * topk))
        scores.append(level_scores)
        parents.append(level_parents)
        best = torch.sort(level_scores, dim=1, descending=True, stable=True).indices[:, :topk]
        frontier_ids = level_ids.gather(1, best)
        frontier_scores = level_scores.gather(1, best)
        next_id += topk * topk

    all_tokens = torch.cat(tokens, dim=1)  # [bs, N]; recorded node id = column + 1
    all_scores = torch.cat(scores, dim=1)
    all_parents = torch.cat(parents, dim=1)

    keep = num_draft_tokens - 1
    order = torch.sort(all_scores, dim=1, descending=True, stable=True).indices[:, :keep]
    kept_cols = torch.sort(order, dim=1).values  # creation order: parents first
    # New node index of each recorded id (0 = root; -1 = not kept).
    new_index = torch.full((bs, all_tokens.shape[1] + 1), -1, dtype=torch.long)
    new_index[:, 0] = 0
    new_index.scatter_(1, kept_cols + 1, torch.arange(1, keep + 1).expand(bs, keep))

    candidates = torch.cat([root_tokens, all_tokens.gather(1, kept_cols)], dim=1)
    parent = torch.cat(
        [torch.full((bs, 1), -1, dtype=torch.long), new_index.gather(1, all_parents.gather(1, kept_cols))],
        dim=1,
    )
    if bool((parent[:, 1:] < 0).any()):  # cannot happen for scores from probabilities < 1
        raise RuntimeError("draft tree selection dropped a parent; scores are not monotone")
    next_token, next_sibling = _links_from_parents(parent)
    retrive_index = (torch.arange(bs).unsqueeze(1) * num_draft_tokens + torch.arange(num_draft_tokens)).long()
    return DraftTree(
        candidates=candidates.to(device),
        retrive_index=retrive_index.to(device),
        retrive_next_token=next_token.to(device),
        retrive_next_sibling=next_sibling.to(device),
        tree_depth=depth + 1,
    )


def tree_from_parents(parents, candidates, tree_depth: int | None = None, device="cpu") -> DraftTree:
    """A DraftTree from explicit parent lists (one per request, -1 for the root at node 0).

    Handy for hand-built trees: ``parents=[[-1, 0, 0, 1]]`` is a root with two children,
    the first of which has one child. ``tree_depth`` defaults to the deepest path + 1.

    Args:
        parents: ``[bs, D]`` parent node numbers; node 0 is the root (parent -1) and every
            node n >= 1 has a parent in ``[0, n)``, so nodes are numbered parents first.
        candidates: ``[bs, D]`` token ids, one per node (the root's is its last verified token).
        tree_depth: the width S of the accept index; None for the deepest path + 1.
        device: where the tensors go.

    Returns:
        A :class:`DraftTree` whose ``retrive_index`` numbers the output slots ``request * D + node``.

    Raises:
        ValueError: the shapes differ or are not 2-D, or a parent breaks the numbering rule.
    """
    parent = torch.as_tensor(parents, dtype=torch.long)
    cand = torch.as_tensor(candidates, dtype=torch.long)
    if parent.dim() != 2 or parent.shape != cand.shape:
        raise ValueError(
            f"parents and candidates must both be [bs, D]; got {tuple(parent.shape)} and {tuple(cand.shape)}"
        )
    bs, d = parent.shape
    if bool((parent[:, 0] != -1).any()):
        raise ValueError("node 0 is the root: its parent must be -1")
    child_parents = parent[:, 1:]
    nodes = torch.arange(1, d)
    if bool(((child_parents < 0) | (child_parents >= nodes)).any()):
        raise ValueError("every node n >= 1 needs a parent in [0, n): number nodes parents-first")
    depth_of = torch.zeros(bs, d, dtype=torch.long)
    for n in range(1, d):
        depth_of[:, n] = depth_of.gather(1, parent[:, n:n + 1]).squeeze(1) + 1
    s = int(depth_of.max()) + 1 if tree_depth is None else int(tree_depth)
    next_token, next_sibling = _links_from_parents(parent)
    retrive_index = torch.arange(bs).unsqueeze(1) * d + torch.arange(d)
    return DraftTree(cand.to(device), retrive_index.to(device), next_token.to(device), next_sibling.to(device), s)


def _expand(bs: int, parents: int, topk: int, vocab: int, g):
    """``topk`` distinct tokens per parent with sorted draft log-probabilities."""
    base = torch.randint(vocab, (bs, parents, 1), generator=g)
    stride = max(vocab // topk, 1)
    steps = torch.randint(1, stride + 1, (bs, parents, topk), generator=g)
    steps[:, :, 0] = 0
    tokens = (base + steps.cumsum(dim=2)) % vocab  # distinct: offsets span < vocab
    logits = 2.0 * torch.randn(bs, parents, topk + 1, generator=g)  # last entry: mass off the top-k
    probs = torch.softmax(logits, dim=2)[:, :, :topk]
    logp = torch.sort(probs, dim=2, descending=True).values.clamp(min=1e-30).log()
    return tokens, logp


def _links_from_parents(parent: torch.Tensor):
    """First-child and next-sibling links ([bs, D], -1 = none), children in index order."""
    bs, d = parent.shape
    idx = torch.arange(d)
    is_child = parent.unsqueeze(1) == idx.view(1, d, 1)  # [bs, p, c]: c is a child of p
    big = torch.full((), d, dtype=torch.long)
    first = torch.where(is_child, idx.view(1, 1, d), big).amin(dim=2)
    next_token = torch.where(first < d, first, -1)
    later_sibling = (parent.unsqueeze(2) == parent.unsqueeze(1)) & (idx.view(1, 1, d) > idx.view(1, d, 1))
    later_sibling &= (parent >= 0).unsqueeze(2)
    nxt = torch.where(later_sibling, idx.view(1, 1, d), big).amin(dim=2)
    next_sibling = torch.where(nxt < d, nxt, -1)
    return next_token, next_sibling


def _check_shape(topk, depth, num_draft_tokens, batch_size, vocab) -> None:
    for name, value in (("topk", topk), ("depth", depth), ("num_draft_tokens", num_draft_tokens),
                        ("batch_size", batch_size), ("vocab", vocab)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if topk > vocab:
        raise ValueError(f"topk={topk} exceeds the vocabulary ({vocab}): siblings need distinct tokens")
    most = max_tree_nodes(topk, depth)
    if num_draft_tokens > most:
        raise ValueError(
            f"num_draft_tokens={num_draft_tokens} exceeds the {most} nodes a topk={topk}, depth={depth} "
            "tree can hold; lower num_draft_tokens or raise topk/depth"
        )
