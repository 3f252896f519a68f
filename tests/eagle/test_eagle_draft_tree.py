"""build_draft_tree / tree_from_parents: EAGLE top-k tree structure."""

import pytest
import torch

from graphborrow.eagle.draft_tree import (
    build_draft_tree,
    max_tree_nodes,
    tree_from_parents,
)


def walk(tree, b):
    """{node: (parent, depth)} reached from the root through the links, and sibling lists."""
    seen, siblings = {0: (-1, 0)}, {}
    stack = [0]
    while stack:
        n = stack.pop()
        kids, c = [], int(tree.retrive_next_token[b, n])
        while c != -1:
            assert c not in seen, "a node is reached twice"
            seen[c] = (n, seen[n][1] + 1)
            kids.append(c)
            stack.append(c)
            c = int(tree.retrive_next_sibling[b, c])
        siblings[n] = kids
    return seen, siblings


@pytest.mark.parametrize("topk,depth,num_tokens", [(1, 4, 5), (2, 3, 6), (3, 4, 10), (4, 2, 12), (8, 6, 64), (2, 1, 3)])
def test_trees_are_well_formed(topk, depth, num_tokens):
    bs, vocab = 5, 1000
    tree = build_draft_tree(topk, depth, num_tokens, bs, vocab, generator=torch.Generator().manual_seed(topk))
    assert tree.tree_depth == depth + 1
    for t in tree[:4]:
        assert t.shape == (bs, num_tokens) and t.dtype == torch.int64
    assert torch.equal(tree.retrive_index, torch.arange(bs * num_tokens).view(bs, num_tokens))
    assert ((tree.candidates >= 0) & (tree.candidates < vocab)).all()
    for b in range(bs):
        seen, siblings = walk(tree, b)
        assert sorted(seen) == list(range(num_tokens))  # every node reachable exactly once
        for n, (parent, level) in seen.items():
            assert parent < n  # parents first
            assert level <= depth
        for kids in siblings.values():
            assert len(kids) <= topk
            assert kids == sorted(kids)
            tokens = [int(tree.candidates[b, k]) for k in kids]
            assert len(set(tokens)) == len(tokens)  # siblings draft distinct tokens
    if topk == 1:
        assert (tree.retrive_next_sibling == -1).all()  # a chain


def test_full_tree_uses_every_level_and_seed_reproduces():
    a = build_draft_tree(2, 3, max_tree_nodes(2, 3), 3, 50, generator=torch.Generator().manual_seed(1))
    b = build_draft_tree(2, 3, max_tree_nodes(2, 3), 3, 50, generator=torch.Generator().manual_seed(1))
    for x, y in zip(a[:4], b[:4]):
        assert torch.equal(x, y)
    seen, _ = walk(a, 0)
    assert max(level for _, level in seen.values()) == 3


def test_tree_from_parents_links_children_in_order():
    tree = tree_from_parents([[-1, 0, 0, 1, 1, 2]], [[9, 1, 2, 3, 4, 5]])
    assert tree.retrive_next_token.tolist() == [[1, 3, 5, -1, -1, -1]]
    assert tree.retrive_next_sibling.tolist() == [[-1, 2, -1, 4, -1, -1]]
    assert tree.tree_depth == 3
    with pytest.raises(ValueError, match="parent in"):
        tree_from_parents([[-1, 2, 0]], [[0, 1, 2]])
    with pytest.raises(ValueError, match="root"):
        tree_from_parents([[0, 0]], [[0, 1]])


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="exceeds the 7 nodes"):
        build_draft_tree(2, 2, 8, 1, 100)
    with pytest.raises(ValueError, match="topk=5 exceeds the vocabulary"):
        build_draft_tree(5, 1, 3, 1, 4)
    with pytest.raises(ValueError, match="depth must be a positive int"):
        build_draft_tree(2, 0, 3, 1, 100)
