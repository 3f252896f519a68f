"""Bad sampling input gets a specific error (or correct behaviour), and the checks that read
values can be skipped so a step runs without host reads."""

import pytest
import torch

from graphborrow.eagle import (
    MODES,
    eagle_verify,
    top_k_renorm_probs,
    top_p_renorm_probs,
)
from graphborrow.eagle import tree_speculative_sampling_target_only as sample_tree
from graphborrow.eagle.draft_tree import DraftTree, build_draft_tree, tree_from_parents
from graphborrow.sim import SimBackend, SimLayoutOnlyError


def small_case(bs=3, d=4, vocab=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    tree = build_draft_tree(2, 2, d, bs, vocab, generator=g)
    return tree, torch.randn(bs * d, vocab, generator=g)


@pytest.mark.parametrize("poison,row", [(float("nan"), 5), (float("inf"), 0), (None, 11)])
def test_logits_rows_without_a_distribution_are_named(poison, row):
    tree, logits = small_case()
    if poison is None:
        logits[row] = float("-inf")  # a whole row masked
    else:
        logits[row, 7] = poison
    for mode in MODES:
        with pytest.raises(ValueError, match=rf"logits rows \[{row}\] \(request, node \[\({row // 4}, {row % 4}\)\]\)"):
            eagle_verify(logits, None, tree, 0.8, mode=mode)


def test_masked_tokens_are_fine_and_never_emitted():
    tree, logits = small_case(seed=1)
    logits[:, 10:] = float("-inf")  # engines mask tokens this way
    result = eagle_verify(logits, None, tree, 1.0, generator=torch.Generator().manual_seed(0))
    emitted = result.predicts[result.predicts != 0]
    assert bool((emitted < 10).all())


def test_a_temperature_that_overflows_the_logits_is_named():
    tree, logits = small_case()
    logits[2, 3] = 1e30
    with pytest.raises(ValueError, match="overflow once divided by the temperature"):
        eagle_verify(logits, None, tree, 1e-10)


def test_cyclic_and_doubly_linked_trees_are_refused():
    tree = tree_from_parents([[-1, 0, 0, 1]], [[0, 1, 2, 3]])  # root -> 1, 2; 1 -> 3
    logits = torch.randn(4, 10)
    cycle = tree._replace(retrive_next_sibling=torch.tensor([[-1, 2, 1, -1]]))  # siblings 1 -> 2 -> 1
    with pytest.raises(ValueError, match=r"node 1 is linked from 2 places"):
        eagle_verify(logits, None, cycle, 1.0)
    loop = tree._replace(retrive_next_token=torch.tensor([[1, 3, -1, 3]]))  # 3 is its own child
    with pytest.raises(ValueError, match=r"node 3 is linked from 2 places"):
        eagle_verify(logits, None, loop, 1.0)
    closed = tree._replace(retrive_next_token=torch.tensor([[-1, 2, 3, -1]]),
                           retrive_next_sibling=torch.tensor([[-1, -1, -1, 1]]))  # 1 -> 2 -> 3 -> 1, off the root
    with pytest.raises(ValueError, match=r"nodes \[1, 2, 3\] link to each other in a cycle"):
        eagle_verify(logits, None, closed, 1.0)
    rooted = tree._replace(retrive_next_sibling=torch.tensor([[-1, 2, 0, -1]]))
    with pytest.raises(ValueError, match="node 0 .* is linked"):
        eagle_verify(logits, None, rooted, 1.0)


def test_shared_output_slots_are_refused():
    tree, logits = small_case(bs=2, d=3)
    shared = tree._replace(retrive_index=torch.tensor([[0, 1, 2], [3, 2, 5]]))
    with pytest.raises(ValueError, match=r"gives slot 2 to more than one node .*\[\[0, 2\], \[1, 1\]\]"):
        eagle_verify(logits, None, shared, 1.0)
    with pytest.raises(ValueError, match="gives slot 2"):
        sample_tree(torch.zeros(6, dtype=torch.int32), torch.zeros(2, 2, dtype=torch.int32),
                    torch.zeros(2, dtype=torch.int32), shared.candidates, shared.retrive_index,
                    shared.retrive_next_token, shared.retrive_next_sibling, torch.rand(2, 3), torch.rand(2),
                    torch.full((2, 3, 50), 0.02), torch.zeros(2, 3, 50))


@pytest.mark.parametrize("mode", MODES)
def test_an_empty_batch_gives_empty_results(mode):
    empty = torch.empty(0, 4, dtype=torch.long)
    tree = DraftTree(empty, empty, empty, empty, 3)
    result = eagle_verify(torch.empty(0, 100), None, tree, 0.7, mode=mode, top_ks=5)
    assert result.predicts.shape == (0,)
    assert result.accept_index.shape == (0, 3)
    assert result.accept_length.shape == (0,)


def test_renorm_names_negative_rows_as_not_probabilities():
    probs = torch.tensor([[0.5, 0.5], [-1.0, 2.0], [0.2, 0.8]])
    for renorm, arg in ((top_k_renorm_probs, 1), (top_p_renorm_probs, 0.5)):
        with pytest.raises(ValueError, match=r"rows \[1\] hold negative values.*softmax"):
            renorm(probs, arg)
    target = torch.full((1, 4, 10), 0.1)
    target[0, 2, 3] = -0.1
    tree = tree_from_parents([[-1, 0, 1, 2]], [[0, 1, 2, 3]])
    with pytest.raises(ValueError, match="target_probs must hold probabilities"):
        sample_tree(torch.zeros(4, dtype=torch.int32), torch.zeros(1, 4, dtype=torch.int32),
                    torch.zeros(1, dtype=torch.int32), tree.candidates, tree.retrive_index, tree.retrive_next_token,
                    tree.retrive_next_sibling, torch.rand(1, 4), torch.rand(1), target, torch.zeros_like(target))


def test_out_of_range_coins_are_named():
    tree, logits = small_case()
    with pytest.raises(ValueError, match=r"coins must be uniform samples in \[0, 1\)"):
        eagle_verify(logits, None, tree, 1.0, coins=torch.full((3, 4), 1.5), coins_final=torch.rand(3))


@pytest.mark.parametrize("mode", MODES)
def test_skipping_validation_reads_no_value_on_the_host(mode):
    """On a device without values, any host read fails: the unvalidated step must not make one."""
    device = SimBackend(capacity=2**34, backed=False, blas_workspace=0)
    try:
        bs, d, vocab = 4, 5, 70000
        long = torch.empty(bs, d, dtype=torch.long, device="cuda")
        tree = DraftTree(long, long, long, long, 3)
        logits = torch.empty(bs * d, vocab, device="cuda")
        kw = dict(top_ks=torch.empty(bs, dtype=torch.long, device="cuda"), top_ps=0.9, mode=mode,
                  chunk_rows=2 * d if mode == "chunked" else None)
        result = eagle_verify(logits, None, tree, 0.7, validate=False, **kw)
        assert result.accept_index.shape == (bs, 3)
        with pytest.raises(SimLayoutOnlyError):
            eagle_verify(logits, None, tree, 0.7, validate=True, **kw)
    finally:
        device.close()


def test_out_buffers_that_share_memory_with_an_input_or_each_other_are_refused():
    """The kernels read the logits, the tree and the coins while they write the outputs: a byte in
    both would be silently wrong. Slices of one workspace that do not touch are fine."""
    bs, d = 3, 4
    tree, logits = small_case(bs=bs, d=d)
    s = tree.tree_depth
    coins, final = torch.rand(bs, d, generator=torch.Generator().manual_seed(1)), torch.rand(bs)
    expected = eagle_verify(logits, None, tree, 0.7, coins=coins, coins_final=final)
    workspace = torch.full((bs * d + bs * s + bs,), -7, dtype=torch.int32)
    parts = (workspace[:bs * d], workspace[bs * d:bs * d + bs * s].view(bs, s), workspace[bs * d + bs * s:])
    got = eagle_verify(logits, None, tree, 0.7, coins=coins, coins_final=final, out=parts)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    over_logits = logits.view(torch.int32).reshape(-1)[:bs * d]
    over_coins = coins.view(torch.int32).reshape(-1)[:bs]
    for out, message in (((over_logits, parts[1], parts[2]), "out predicts shares memory with logits"),
                         ((parts[0], parts[1], over_coins), "out accept_length shares memory with coins"),
                         ((parts[0], parts[1], parts[0][:bs]), "out accept_length shares memory with out predicts")):
        before = logits.clone()
        with pytest.raises(ValueError, match=message + ".*buffers of their own"):
            eagle_verify(logits, None, tree, 0.7, coins=coins, coins_final=final, out=out)
        assert torch.equal(logits, before)  # refused before any write
