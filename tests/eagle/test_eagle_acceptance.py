"""The acceptance theory of target-only verification, against hand-computed values and the verifier."""

import math

import pytest
import torch

from graphborrow.eagle import eagle_verify
from graphborrow.eagle.acceptance import (
    chi_square,
    children_of,
    emitted_tokens,
    expected_emitted_tokens,
    path_probabilities,
    tokens_after,
)
from graphborrow.eagle.draft_tree import (
    build_draft_tree,
    repeat_tree,
    tree_depth_for,
    tree_from_parents,
)


def test_path_probabilities_by_hand():
    # root (token 0) -> a=1, b=2; a -> c=3
    tree = tree_from_parents([[-1, 0, 0, 1]], [[0, 1, 2, 3]])
    assert children_of(tree, 0) == [1, 2] and children_of(tree, 1) == [3] and children_of(tree, 3) == []
    probs = torch.tensor([[0.1, 0.5, 0.3, 0.1], [0.0, 0.0, 0.0, 1.0], [0.25] * 4, [0.25] * 4])
    assert path_probabilities(tree, probs).tolist() == pytest.approx([1.0, 0.5, 0.3, 0.5 * 1.0])
    assert expected_emitted_tokens(tree, probs) == pytest.approx(1 + 0.5 + 0.3 + 0.5)


@pytest.mark.parametrize("depth_for", [tree_depth_for])
def test_tree_depth_for_holds_the_nodes(depth_for):
    assert depth_for(1, 4) == 1 and depth_for(5, 4) == 1 and depth_for(6, 4) == 2 and depth_for(8, 1) == 7
    with pytest.raises(ValueError, match="branching must be a positive int"):
        depth_for(4, 0)


def test_repeat_tree_gives_each_copy_its_own_slots():
    tree = build_draft_tree(2, 2, 5, 3, 50, generator=torch.Generator().manual_seed(0))
    many = repeat_tree(tree, 4)
    assert many.candidates.shape == (4, 5) and torch.equal(many.candidates[3], tree.candidates[0])
    assert many.retrive_index.flatten().tolist() == list(range(20))
    assert torch.equal(many.retrive_next_token[2], tree.retrive_next_token[0])


def test_the_verifier_follows_the_theory_beyond_the_first_token():
    g = torch.Generator().manual_seed(3)
    vocab, d, copies = 10, 6, 12000
    logits = torch.randn(d, vocab, generator=g) * 2
    probs = torch.softmax(logits, -1)
    tree = build_draft_tree(2, tree_depth_for(d, 2), d, 1, vocab, generator=g)
    result = eagle_verify(logits.repeat(copies, 1), None, repeat_tree(tree, copies), 1.0, generator=g)
    lengths = result.accept_length.double()
    theory = expected_emitted_tokens(tree, probs)
    assert abs(lengths.mean().item() - theory) < 4 * lengths.std().item() / copies ** 0.5
    _, first = emitted_tokens(result, 0)
    stat, df, critical = chi_square(first, probs[0])
    assert stat < critical
    child = int(tree.retrive_next_token[0, 0])
    second = tokens_after(result, int(tree.candidates[0, child]))
    assert len(second) > 500
    stat, df, critical = chi_square(second, probs[child])
    assert stat < critical, "the second token follows the accepted child's row"
    wrong = chi_square(second, probs[0])
    assert wrong[0] > wrong[2], "and not the root's row: the test can tell them apart"


def test_chi_square_names_a_zero_probability_token():
    with pytest.raises(AssertionError, match="zero target probability"):
        chi_square(torch.tensor([0, 1, 1]), torch.tensor([0.5, 0.0, 0.5]))


def test_sampling_in_batches_is_one_batch_joined():
    """Copies verified in batches come back as the single batch would: same coins, same result."""
    from graphborrow.eagle import eagle_verify
    from graphborrow.eagle.acceptance import sample_copies
    from graphborrow.eagle.draft_tree import build_draft_tree, repeat_tree

    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 10, generator=gen)
    tree = build_draft_tree(2, 2, 6, 1, 10, generator=gen)
    joined = sample_copies(tree, logits, 0.8, 50, generator=torch.Generator().manual_seed(9), copies_per_batch=7)
    whole = eagle_verify(logits.repeat(50, 1), None, repeat_tree(tree, 50), 0.8,
                         generator=torch.Generator().manual_seed(9))
    one_batch = sample_copies(tree, logits, 0.8, 50, generator=torch.Generator().manual_seed(9), copies_per_batch=64)
    for field in ("predicts", "accept_index", "accept_length"):
        assert torch.equal(getattr(one_batch, field), getattr(whole, field)), f"one batch must be eagle_verify's {field}"
    assert joined.predicts.shape == whole.predicts.shape and joined.accept_index.shape == whole.accept_index.shape
    # every accepted slot points into its own copy's slots of the joined predicts
    for copy in range(50):
        slots = joined.accept_index[copy][: joined.accept_length[copy]]
        assert ((slots // 6) == copy).all(), f"copy {copy} reads another copy's slots: {slots.tolist()}"


def test_path_probabilities_are_float64_products_per_request():
    """Each request reads its own rows; a node no link reaches is never accepted; the
    products are float64 (float32 would round 0.3 * 0.5 * 0.3 differently)."""
    from graphborrow.eagle.draft_tree import DraftTree

    tree = tree_from_parents([[-1, 0, 0, 1], [-1, 0, 1, 2]], [[0, 1, 2, 3], [0, 2, 1, 3]])
    probs = torch.tensor([[0.1, 0.1, 0.3, 0.5], [0.0, 0.0, 0.0, 1.0], [0.25] * 4, [0.25] * 4], dtype=torch.float64)
    second = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.0, 0.5, 0.0, 0.5], [0.0, 0.0, 0.0, 0.3], [0.25] * 4])
    reach = path_probabilities(tree, second, request=1)
    assert reach.dtype == torch.float64
    assert reach.tolist() == [1.0, float(torch.tensor(0.3)), float(torch.tensor(0.3)) * 0.5,
                              float(torch.tensor(0.3)) * 0.5 * float(torch.tensor(0.3))]
    assert expected_emitted_tokens(tree, second, request=1) == pytest.approx(sum(reach.tolist()))
    assert expected_emitted_tokens(tree, probs) == pytest.approx(1 + 0.1 + 0.3 + 0.1 * 1.0)
    # node 3 of a hand-made tree hangs from no link: it can never be accepted
    detached = DraftTree(torch.tensor([[0, 1, 2, 3]]), torch.arange(4)[None], torch.tensor([[1, -1, -1, -1]]),
                         torch.tensor([[-1, 2, -1, -1]]), 3)
    assert path_probabilities(detached, probs).tolist()[3] == 0.0
    loop = DraftTree(torch.tensor([[0, 1]]), torch.arange(2)[None], torch.tensor([[1, 1]]),
                     torch.tensor([[-1, -1]]), 2)
    with pytest.raises(ValueError, match="node 1 is a child of node 1 but does not come after it"):
        path_probabilities(loop, probs[:2])


def test_children_of_starts_at_the_root():
    tree = tree_from_parents([[-1, 0, 0, 1]], [[0, 1, 2, 3]])
    assert children_of(tree) == [1, 2]


def test_emitted_tokens_at_a_position_come_from_requests_that_long():
    from graphborrow.eagle.step import VerifyResult

    result = VerifyResult(torch.tensor([5, 6, 7, 8, 9, 4], dtype=torch.int32),
                          torch.tensor([[0, 1, -1], [3, -1, -1]], dtype=torch.int32),
                          torch.tensor([2, 1], dtype=torch.int32))
    requests, tokens = emitted_tokens(result, 1)
    assert requests.tolist() == [0] and tokens.tolist() == [6], "request 1 emitted one token only"
    requests, tokens = emitted_tokens(result, 0)
    assert requests.tolist() == [0, 1] and tokens.tolist() == [5, 8]


def test_chi_square_by_hand():
    """Pearson's statistic and degrees of freedom by hand; the critical value against the
    tabulated 0.999 quantiles of chi-square (Wilson-Hilferty is within 3.5 % at one degree
    of freedom and within 0.01 % from a thousand)."""
    probs = torch.tensor([0.5, 0.0, 0.25, 0.25])
    tokens = torch.tensor([0] * 10 + [2] * 2 + [3] * 8)
    stat, df, critical = chi_square(tokens, probs)
    assert df == 2
    assert stat == pytest.approx((10 - 10) ** 2 / 10 + (2 - 5) ** 2 / 5 + (8 - 5) ** 2 / 5)
    for df, tabulated, within in ((1, 10.828, 0.035), (2, 13.816, 0.025), (10, 29.588, 0.007),
                                  (100, 149.449, 1e-3), (1000, 1143.917, 1e-4)):
        _, got_df, critical = chi_square(torch.arange(df + 1), torch.full((df + 1,), 1.0 / (df + 1)))
        assert got_df == df
        assert critical == pytest.approx(tabulated, rel=within), f"{df} degrees of freedom"
    assert chi_square(torch.zeros(5, dtype=torch.long), torch.tensor([1.0, 0.0]))[1:] == (0, math.inf)


def test_chi_square_names_every_zero_probability_token_once():
    probs = torch.tensor([0.5] + [0.0] * 8 + [0.5])
    with pytest.raises(AssertionError, match=r"tokens \[4\] of zero target probability"):
        chi_square(torch.tensor([0, 4, 9, 9]), probs)
    with pytest.raises(AssertionError, match=r"tokens \[1, 2, 3, 4, 5\] of zero"):
        chi_square(torch.tensor([0, 1, 2, 3, 4, 5, 6, 7]), probs)


def test_sample_copies_takes_a_positive_integer_and_keeps_the_index_dtype():
    from graphborrow.eagle.acceptance import sample_copies

    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 8, generator=gen)
    tree = build_draft_tree(2, 1, 3, 1, 8, generator=gen)
    one = sample_copies(tree, logits, 1.0, 1, generator=gen)
    assert one.accept_length.shape == (1,) and one.accept_index.dtype == torch.int32
    for bad in (0, -1, True, 2.0, "3"):
        with pytest.raises(ValueError, match=r"samples=.* must be a positive integer"):
            sample_copies(tree, logits, 1.0, bad, generator=gen)
