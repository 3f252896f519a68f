"""tree_speculative_sampling_target_only: hand-built trees with exact outputs, and a
per-request transcription of the kernel's pseudo-code compared on random trees."""

import numpy as np
import pytest
import torch

from graphborrow.eagle import tree_speculative_sampling_target_only as sample_tree
from graphborrow.eagle.draft_tree import build_draft_tree, tree_from_parents

F32 = np.float32


def reference_kernel(cand, ridx, nxt, sib, coins, coins_final, target, draft, s, thr_single, thr_acc,
                     predicts_init=None):
    """One request at a time, line by line after the kernel's pseudo-code (float32 acc)."""
    bs, d = cand.shape
    vocab = target.shape[2]
    cand, ridx, nxt, sib = (t.numpy() for t in (cand, ridx, nxt, sib))
    coins, coins_final = coins.numpy(), coins_final.numpy()
    target, draft = target.numpy(), draft.numpy().copy()
    thr_acc = F32(max(thr_acc, 1e-9))
    thr_single = F32(thr_single)
    predicts = np.zeros(bs * d, np.int32) if predicts_init is None else predicts_init.numpy().copy()
    accept_index = np.full((bs, s), -1, np.int32)
    accept_num = np.zeros(bs, np.int32)
    for b in range(bs):
        parent, row, coin, acc = 0, target[b, 0], coins[b, 0], F32(0)
        last = ridx[b, 0]
        accept_index[b, 0] = last
        n, last_rej = 0, -1
        for _j in range(1, s):
            c = nxt[b, parent]
            while c != -1:
                tok = cand[b, c]
                p = row[tok]
                acc = F32(acc + p)
                if p > 0 and (coin < F32(acc / thr_acc) or p >= thr_single):
                    acc, parent, row, coin = F32(0), c, target[b, c], coins[b, c]
                    predicts[last] = tok
                    n += 1
                    accept_index[b, n] = ridx[b, c]
                    last = ridx[b, c]
                    break
                draft[b, parent, tok] = p
                if p > 0:
                    last_rej = tok
                c = sib[b, c]
            if c == -1:
                break
        accept_num[b] = n
        sub = np.zeros(vocab, F32) if n == s - 1 else draft[b, parent]
        r = np.maximum(row - sub, F32(0)).astype(np.float64)
        cdf = np.cumsum(r)
        u = np.float64(coins_final[b]) * cdf[-1]
        above = np.nonzero(cdf > u)[0]
        if len(above):
            tok = above[0]
        elif (r > 0).any():
            tok = np.nonzero(r > 0)[0][-1]
        else:
            tok = last_rej if last_rej >= 0 else vocab - 1
        predicts[last] = tok
    return predicts, accept_index, accept_num, draft


def run(tree, target, coins, coins_final, s=None, thr=(1.0, 1.0), draft=None):
    bs, d = tree.candidates.shape
    s = tree.tree_depth if s is None else s
    predicts = torch.zeros(bs * d, dtype=torch.int32)
    accept_index = torch.full((bs, s), -1, dtype=torch.int32)
    accept_num = torch.zeros(bs, dtype=torch.int32)
    draft = torch.zeros_like(target) if draft is None else draft
    sample_tree(predicts, accept_index, accept_num, tree.candidates, tree.retrive_index, tree.retrive_next_token,
                tree.retrive_next_sibling, coins, coins_final, target, draft, threshold_single=thr[0],
                threshold_acc=thr[1])
    return predicts, accept_index, accept_num, draft


# A root with two children (tokens 3 and 5); the first child has one child (token 7).
PARENTS = [[-1, 0, 0, 1]]
TOKENS = [[0, 3, 5, 7]]
V = 10


def rows(**per_node):
    """Target rows [1, 4, V]: node -> {token: prob}; unspecified nodes are uniform."""
    t = torch.full((1, 4, V), 1.0 / V)
    for node, probs in per_node.items():
        t[0, int(node[1:])] = 0.0
        for tok, p in probs.items():
            t[0, int(node[1:]), tok] = p
    return t


def coins_of(*values):
    c = torch.zeros(1, 4)
    c[0, : len(values)] = torch.tensor(values)
    return c


def test_accept_first_sibling_then_child_then_bonus():
    tree = tree_from_parents(PARENTS, TOKENS)  # tree_depth 3
    target = rows(n0={3: 0.5, 5: 0.25, 9: 0.25}, n1={7: 0.75, 2: 0.25}, n3={4: 1.0})
    predicts, accept_index, n, draft = run(tree, target, coins_of(0.25, 0.5), torch.tensor([0.3]))
    assert n.tolist() == [2]
    assert accept_index.tolist() == [[0, 1, 3]]
    assert predicts.tolist() == [3, 7, 0, 4]  # slot of the root gets 3, node 1 gets 7, bonus 4 at node 3
    assert not draft.any()  # nothing was rejected


def test_reject_first_then_accept_second_then_residual_of_leaf():
    tree = tree_from_parents(PARENTS, TOKENS)
    target = rows(n0={3: 0.5, 5: 0.25, 9: 0.25}, n2={1: 0.5, 8: 0.5})
    # coin 0.625: acc 0.5 rejects token 3; acc 0.75 accepts token 5 (node 2, a leaf)
    predicts, accept_index, n, draft = run(tree, target, coins_of(0.625), torch.tensor([0.75]))
    assert n.tolist() == [1]
    assert accept_index.tolist() == [[0, 2, -1]]
    assert draft[0, 0, 3] == 0.5 and draft.count_nonzero() == 1  # rejected sibling recorded at the parent
    # residual = row of node 2 (its own draft row is empty): u = 0.75 -> token 8
    assert predicts.tolist() == [5, 0, 8, 0]


def test_reject_all_resamples_without_rejected_tokens():
    tree = tree_from_parents(PARENTS, TOKENS)
    target = rows(n0={3: 0.5, 5: 0.25, 9: 0.125, 2: 0.125})
    # coin 0.875 > 0.75 = mass of both children: residual keeps tokens 2 and 9 (0.125 each)
    for u, expected in ((0.25, 2), (0.75, 9)):
        predicts, accept_index, n, draft = run(tree, target, coins_of(0.875), torch.tensor([u]))
        assert n.tolist() == [0]
        assert accept_index.tolist() == [[0, -1, -1]]
        assert predicts.tolist() == [expected, 0, 0, 0]
        assert draft[0, 0, 3] == 0.5 and draft[0, 0, 5] == 0.25


def test_zero_probability_candidate_never_accepted_even_with_coin_zero():
    tree = tree_from_parents(PARENTS, TOKENS)
    target = rows(n0={3: 0.0, 5: 1.0})
    for thr in ((1.0, 1.0), (0.0, 0.0)):
        predicts, accept_index, n, _ = run(tree, target, coins_of(0.0), torch.tensor([0.5]), thr=thr)
        assert accept_index[0, 1].item() == 2, thr  # token 3 (p = 0) skipped, token 5 accepted
        assert predicts[0].item() == 5


def test_coin_equal_to_acc_rejects_strictly():
    tree = tree_from_parents(PARENTS, TOKENS)
    target = rows(n0={3: 0.5, 5: 0.5})
    _, accept_index, _, _ = run(tree, target, coins_of(0.5), torch.tensor([0.0]))
    assert accept_index[0, 1].item() == 2  # coin 0.5 == acc 0.5 rejects token 3, acc 1.0 accepts 5
    _, accept_index, _, _ = run(tree, target, coins_of(0.4999), torch.tensor([0.0]))
    assert accept_index[0, 1].item() == 1


def test_thresholds_zero_accept_first_positive_child_whatever_the_coin():
    tree = tree_from_parents(PARENTS, TOKENS)
    target = rows(n0={3: 0.01, 5: 0.99}, n1={7: 0.001, 0: 0.999})
    _, accept_index, n, _ = run(tree, target, coins_of(0.999, 0.999), torch.tensor([0.0]), thr=(0.0, 0.0))
    assert accept_index.tolist() == [[0, 1, 3]] and n.tolist() == [2]
    _, accept_index, n, _ = run(tree, target, coins_of(0.999, 0.999), torch.tensor([0.0]), thr=(1.0, 1.0))
    assert accept_index.tolist() == [[0, 2, -1]]  # exact sampling: token 3 rejected, acc 1.0 takes token 5


def test_threshold_single_accepts_confident_drafts():
    tree = tree_from_parents(PARENTS, TOKENS)
    target = rows(n0={3: 0.5, 5: 0.5})
    _, accept_index, _, _ = run(tree, target, coins_of(0.9), torch.tensor([0.0]), thr=(0.5, 1.0))
    assert accept_index[0, 1].item() == 1  # p >= threshold_single, coin ignored


def test_depth_limit_gives_bonus_without_subtraction():
    tree = tree_from_parents(PARENTS, TOKENS, tree_depth=2)  # S = 2: one draft level only
    target = rows(n0={3: 1.0}, n1={7: 0.5, 6: 0.5})
    predicts, accept_index, n, draft = run(tree, target, coins_of(0.1, 0.99), torch.tensor([0.2]))
    assert n.tolist() == [1] and accept_index.tolist() == [[0, 1]]
    assert predicts.tolist() == [3, 6, 0, 0]  # node 1's children never tried: u=0.2 picks token 6
    assert not draft.any()


def test_all_mass_on_rejected_falls_back_to_last_rejected_token_with_mass():
    tree = tree_from_parents([[-1, 0, 0, 0]], [[0, 3, 5, 7]], tree_depth=2)
    target = torch.full((1, 4, V), 1.0 / V)
    target[0, 0] = 0.0
    target[0, 0, 3] = 0.5
    target[0, 0, 5] = 0.5  # token 7 (the last sibling) has p = 0
    # coin 1.0 never falls below acc = 1.0 (strict <): every sibling is rejected
    predicts, _, n, _ = run(tree, target, torch.tensor([[1.0, 0.0, 0.0, 0.0]]), torch.tensor([0.5]))
    assert n.tolist() == [0]
    assert predicts[0].item() == 5  # residual all zero: the last rejected token with p > 0


def test_entries_off_the_path_keep_their_values():
    tree = tree_from_parents(PARENTS, TOKENS)
    target = rows(n0={3: 0.5, 5: 0.5})
    bs, d = 1, 4
    predicts = torch.full((bs * d,), 42, dtype=torch.int32)
    accept_index = torch.full((bs, 3), -7, dtype=torch.int32)
    accept_num = torch.zeros(bs, dtype=torch.int32)
    sample_tree(predicts, accept_index, accept_num, tree.candidates, tree.retrive_index, tree.retrive_next_token,
                tree.retrive_next_sibling, coins_of(0.9), torch.tensor([0.0]), target, torch.zeros_like(target))
    assert accept_index.tolist() == [[0, 2, -7]]
    assert predicts.tolist() == [5, 42, 0, 42]


def random_case(seed, topk, depth, num_tokens, bs, vocab, peaked=True):
    g = torch.Generator().manual_seed(seed)
    tree = build_draft_tree(topk, depth, num_tokens, bs, vocab, generator=g)
    logits = torch.randn(bs, num_tokens, vocab, generator=g)
    if peaked:  # push mass onto the children's tokens so that paths get accepted
        parent_bias = torch.rand(bs, num_tokens, vocab, generator=g) < 0.3
        logits += 3.0 * parent_bias
    target = torch.softmax(logits, dim=-1)
    target[torch.rand(target.shape, generator=g) < 0.05] = 0.0  # some zero-probability candidates
    coins = torch.rand(bs, num_tokens, generator=g)
    coins_final = torch.rand(bs, generator=g)
    return tree, target, coins, coins_final


@pytest.mark.parametrize("seed,topk,depth,num_tokens,thr", [
    (0, 1, 5, 6, (1.0, 1.0)),
    (1, 2, 3, 6, (1.0, 1.0)),
    (2, 3, 4, 10, (1.0, 1.0)),
    (3, 4, 2, 8, (0.7, 0.4)),
    (4, 2, 4, 8, (0.0, 0.0)),
    (5, 3, 3, 12, (0.3, 1.0)),
])
def test_matches_reference_on_random_trees(seed, topk, depth, num_tokens, thr):
    tree, target, coins, coins_final = random_case(seed, topk, depth, num_tokens, bs=64, vocab=12)
    got = run(tree, target, coins, coins_final, thr=thr)
    want = reference_kernel(tree.candidates, tree.retrive_index, tree.retrive_next_token,
                            tree.retrive_next_sibling, coins, coins_final, target, torch.zeros_like(target),
                            tree.tree_depth, *thr)
    for g, w, name in zip(got, want, ("predicts", "accept_index", "accept_num", "draft_probs")):
        np.testing.assert_array_equal(g.numpy(), w, err_msg=name)
    assert got[2].max() > 0  # the cases do accept drafts


@pytest.mark.parametrize("s", [1, 2, 7])
def test_matches_reference_for_other_accept_widths(s):
    tree, target, coins, coins_final = random_case(11, 2, 3, 7, bs=48, vocab=9)
    got = run(tree, target, coins, coins_final, s=s)
    want = reference_kernel(tree.candidates, tree.retrive_index, tree.retrive_next_token,
                            tree.retrive_next_sibling, coins, coins_final, target, torch.zeros_like(target), s,
                            1.0, 1.0)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.numpy(), w)


def test_matches_reference_with_duplicate_sibling_tokens_and_nonzero_draft():
    g = torch.Generator().manual_seed(3)
    parents = [[-1, 0, 0, 0, 1, 1]] * 32
    tokens = [[0, 2, 2, 4, 1, 1]] * 32  # repeated tokens among siblings
    tree = tree_from_parents(parents, tokens)
    target = torch.softmax(2 * torch.randn(32, 6, 6, generator=g), dim=-1)
    draft = torch.rand(32, 6, 6, generator=g) * 0.1  # the kernel subtracts the whole draft row
    coins = torch.rand(32, 6, generator=g)
    coins_final = torch.rand(32, generator=g)
    got = run(tree, target, coins, coins_final, draft=draft.clone())
    want = reference_kernel(tree.candidates, tree.retrive_index, tree.retrive_next_token,
                            tree.retrive_next_sibling, coins, coins_final, target, draft, tree.tree_depth, 1.0, 1.0)
    for g_, w in zip(got, want):
        np.testing.assert_array_equal(g_.numpy(), w)


def test_rejects_bad_arguments():
    tree = tree_from_parents(PARENTS, TOKENS)
    target = rows()
    ok = dict(coins=coins_of(0.5), coins_final=torch.tensor([0.5]))
    with pytest.raises(ValueError, match="threshold_single"):
        run(tree, target, **ok, thr=(1.5, 1.0))
    with pytest.raises(ValueError, match="threshold_acc"):
        run(tree, target, **ok, thr=(1.0, -0.1))
    with pytest.raises(ValueError, match="target_probs must be torch.float32"):
        run(tree, target.double(), **ok, draft=torch.zeros_like(target.double()))
    with pytest.raises(ValueError, match="uniform_samples must have shape"):
        run(tree, target, coins_of(0.5)[:, :3], torch.tensor([0.5]))
    bad = tree._replace(retrive_next_token=torch.tensor([[1, 9, -1, -1]]))
    with pytest.raises(ValueError, match="retrive_next_token"):
        run(bad, target, **ok)
    predicts = torch.zeros(4, dtype=torch.int64)
    with pytest.raises(ValueError, match="predicts must be torch.int32"):
        sample_tree(predicts, torch.zeros(1, 3, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                    tree.candidates, tree.retrive_index, tree.retrive_next_token, tree.retrive_next_sibling,
                    coins_of(0.5), torch.tensor([0.5]), target, torch.zeros_like(target))


def test_the_residual_is_summed_in_float64():
    """A coin that lands between the float32 and the float64 running sums of a long row:
    the token is the float64 sum's (a float32 cumsum drifts by many ulps over 60000 terms)."""
    tree = tree_from_parents([[-1, 0]], [[0, 3]], tree_depth=2)  # accept node 1, then its bonus token
    vocab = 60000
    row = torch.rand(vocab, generator=torch.Generator().manual_seed(1))
    cdf64 = np.cumsum(row.numpy().astype(np.float64))
    cdf32 = torch.cumsum(row, 0).numpy()
    for i in np.argsort(-np.abs(cdf64 - cdf32.astype(np.float64)))[:50]:
        coin = F32((cdf64[i] + float(cdf32[i])) / 2 / cdf64[-1])
        by64 = int(np.searchsorted(cdf64, np.float64(coin) * cdf64[-1], side="right"))
        by32 = int(np.searchsorted(cdf32.astype(np.float64), np.float64(coin) * float(cdf32[-1]), side="right"))
        if by64 != by32:
            break
    else:
        raise AssertionError("no coin tells the two sums apart")
    target = torch.zeros(1, 2, vocab)
    target[0, 0, 3] = 1.0
    target[0, 1] = row
    predicts, _, n, _ = run(tree, target, torch.tensor([[0.5, 0.0]]), torch.tensor([float(coin)]))
    assert n.tolist() == [1] and predicts.tolist() == [3, by64]


def test_a_coin_of_one_takes_the_last_token_with_mass():
    """u * sum reaches the whole sum (coin 1.0, or a coin just below it rounded up): the
    last index with positive residual mass, not V - 1."""
    tree = tree_from_parents(PARENTS, TOKENS, tree_depth=2)
    target = rows(n0={3: 1.0}, n1={2: 0.5, 6: 0.5})
    predicts, _, n, _ = run(tree, target, coins_of(0.1, 0.5), torch.tensor([1.0]))
    assert n.tolist() == [1] and predicts.tolist() == [3, 6, 0, 0]


def test_the_last_rejected_token_with_mass_may_be_the_first_sibling_and_token_0():
    """Rows need not sum to 1: root row {0: 0.5}; its first child (token 0) is rejected
    with mass, the second (token 5) without; the residual is empty, so the step emits 0."""
    tree = tree_from_parents([[-1, 0, 0]], [[9, 0, 5]], tree_depth=2)
    target = torch.zeros(1, 3, V)
    target[0, 0, 0] = 0.5
    predicts, _, n, _ = run(tree, target, torch.tensor([[0.9, 0.0, 0.0]]), torch.tensor([0.5]))
    assert n.tolist() == [0] and predicts[0].item() == 0
    expected = reference_kernel(tree.candidates, tree.retrive_index, tree.retrive_next_token,
                                tree.retrive_next_sibling, torch.tensor([[0.9, 0.0, 0.0]]), torch.tensor([0.5]),
                                target, torch.zeros_like(target), 2, 1.0, 1.0)
    assert predicts.tolist() == expected[0].tolist()


def test_no_mass_anywhere_emits_the_last_token_of_the_vocabulary():
    tree = tree_from_parents([[-1, 0, 0]], [[9, 1, 5]], tree_depth=2)
    target = torch.zeros(1, 3, V)  # nothing has mass: no child accepted, none rejected with mass
    predicts, _, n, _ = run(tree, target, torch.tensor([[0.3, 0.0, 0.0]]), torch.tensor([0.5]))
    assert n.tolist() == [0] and predicts[0].item() == V - 1


def test_no_drafts_samples_the_root_row():
    tree = tree_from_parents([[-1]], [[4]], tree_depth=1)
    target = rows(n0={2: 0.25, 7: 0.75})[:, :1]
    for coin, token in ((0.2, 2), (0.3, 7)):
        predicts, accept_index, n, _ = run(tree, target, torch.zeros(1, 1), torch.tensor([coin]))
        assert n.tolist() == [0] and accept_index.tolist() == [[0]] and predicts.tolist() == [token]


def test_a_node_with_fewer_children_than_another_falls_back_to_its_own_rejected_token():
    """The root has three children, node 1 two: node 1's table row is padded. Both of node
    1's children are rejected with all of its mass, so the step emits its last one (8)."""
    tree = tree_from_parents([[-1, 0, 0, 0, 1, 1]], [[0, 3, 4, 5, 7, 8]], tree_depth=3)
    target = torch.zeros(1, 6, V)
    target[0, 0, 3] = 1.0
    target[0, 1, 7] = 0.5
    target[0, 1, 8] = 0.5
    coins = torch.tensor([[0.5, 1.0, 0.0, 0.0, 0.0, 0.0]])
    predicts, accept_index, n, _ = run(tree, target, coins, torch.tensor([0.5]))
    assert n.tolist() == [1] and accept_index.tolist() == [[0, 1, -1]]
    assert predicts[:2].tolist() == [3, 8]
