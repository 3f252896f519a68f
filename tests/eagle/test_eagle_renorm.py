"""top_k_renorm_probs / top_p_renorm_probs: flashinfer semantics and edge cases."""

import warnings

import numpy as np
import pytest
import torch

from graphborrow.eagle import renorm
from graphborrow.eagle.renorm import (
    pivot_chunk_rows,
    top_k_renorm_probs,
    top_p_renorm_probs,
)


def t(rows):
    return torch.tensor(rows, dtype=torch.float32)


def reference_top_k(row, k):
    row = np.asarray(row, np.float64)
    pivot = np.sort(row)[::-1][min(k, len(row)) - 1]
    kept = np.where(row >= pivot, row, 0.0)
    return kept / max(kept.sum(), 1e-8)


def reference_top_p(row, p):
    """By definition: keep entries > low, low the largest value with sum(row > low) >= p."""
    row = np.asarray(row, np.float64)
    lows = [v for v in sorted(set(row.tolist()) | {-1.0}, reverse=True) if row[row > v].sum() >= p]
    low = lows[0] if lows else -1.0
    kept = np.where(row > low, row, 0.0)
    return kept / max(kept.sum(), 1e-8)


def quantised_rows(seed, rows, vocab):
    """Normalised rows of multiples of 1/64 (sums are exact), with many ties and zeros."""
    g = torch.Generator().manual_seed(seed)
    draws = torch.multinomial(torch.ones(rows, vocab), 64, replacement=True, generator=g)
    units = torch.zeros(rows, vocab).scatter_add_(1, draws, torch.ones(rows, 64))
    return units / 64


def test_top_k_keeps_the_largest_k():
    out = top_k_renorm_probs(t([[0.1, 0.2, 0.3, 0.4]]), 2)
    torch.testing.assert_close(out, t([[0.0, 0.0, 3 / 7, 4 / 7]]))


def test_top_k_ties_at_the_pivot_all_survive():
    out = top_k_renorm_probs(t([[0.3, 0.1, 0.3, 0.3]]), 2)
    torch.testing.assert_close(out, t([[1 / 3, 0.0, 1 / 3, 1 / 3]]))


@pytest.mark.parametrize("k", [4, 5, 1000])
def test_k_at_least_vocab_only_renormalises(k):
    out = top_k_renorm_probs(t([[1.0, 2.0, 0.0, 5.0]]), k)
    torch.testing.assert_close(out, t([[0.125, 0.25, 0.0, 0.625]]))


def test_top_k_per_row_tensor():
    probs = t([[0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]])
    out = top_k_renorm_probs(probs, torch.tensor([1, 3, 2]))
    torch.testing.assert_close(out, t([[0, 0, 0, 1], [4 / 9, 3 / 9, 2 / 9, 0], [0.25, 0.25, 0.25, 0.25]]))


def test_top_p_keeps_smallest_prefix_reaching_p():
    out = top_p_renorm_probs(t([[0.1, 0.2, 0.3, 0.4]]), 0.5)
    torch.testing.assert_close(out, t([[0.0, 0.0, 3 / 7, 4 / 7]]))


def test_top_p_prefix_exactly_reaching_p_stops_there():
    out = top_p_renorm_probs(t([[0.125, 0.375, 0.5]]), 0.875)
    torch.testing.assert_close(out, t([[0.0, 0.375 / 0.875, 0.5 / 0.875]]))


def test_top_p_boundary_ties_all_survive():
    torch.testing.assert_close(top_p_renorm_probs(t([[0.25] * 4]), 0.3), t([[0.25] * 4]))
    out = top_p_renorm_probs(t([[0.4, 0.2, 0.2, 0.2]]), 0.5)
    torch.testing.assert_close(out, t([[0.4, 0.2, 0.2, 0.2]]))
    out = top_p_renorm_probs(t([[0.5, 0.2, 0.2, 0.1]]), 0.6)
    torch.testing.assert_close(out, t([[5 / 9, 2 / 9, 2 / 9, 0.0]]))


@pytest.mark.parametrize("p", [1.0, 1.5])
def test_p_at_least_one_only_renormalises(p):
    out = top_p_renorm_probs(t([[1.0, 2.0, 0.0, 5.0]]), p)
    torch.testing.assert_close(out, t([[0.125, 0.25, 0.0, 0.625]]))


def test_top_p_per_row_tensor():
    probs = t([[0.1, 0.2, 0.3, 0.4], [0.1, 0.2, 0.3, 0.4]])
    out = top_p_renorm_probs(probs, torch.tensor([0.3, 1.0]))
    torch.testing.assert_close(out, t([[0, 0, 0, 1], [0.1, 0.2, 0.3, 0.4]]))


def test_kept_sum_is_floored():
    out = top_k_renorm_probs(t([[1e-10, 1e-10, 1e-10, 1e-10]]), 10)
    torch.testing.assert_close(out, t([[0.01] * 4]))


@pytest.mark.parametrize("seed", range(4))
def test_matches_the_definitions_on_tied_random_rows(seed):
    probs = quantised_rows(seed, 24, 17)
    g = torch.Generator().manual_seed(100 + seed)
    ks = torch.randint(1, 20, (24,), generator=g)
    ps = torch.randint(1, 70, (24,), generator=g).float() / 64  # some >= 1
    out_k = top_k_renorm_probs(probs, ks)
    out_p = top_p_renorm_probs(probs, ps)
    for i in range(24):
        np.testing.assert_allclose(out_k[i].numpy(), reference_top_k(probs[i].numpy(), int(ks[i])), rtol=1e-6)
        np.testing.assert_allclose(out_p[i].numpy(), reference_top_p(probs[i].numpy(), float(ps[i])), rtol=1e-6)
    for k in (1, 3, 17):
        out = top_k_renorm_probs(probs, k)
        for i in range(24):
            np.testing.assert_allclose(out[i].numpy(), reference_top_k(probs[i].numpy(), k), rtol=1e-6)
    for p in (0.05, 0.5, 0.95):
        out = top_p_renorm_probs(probs, p)
        for i in range(24):
            np.testing.assert_allclose(out[i].numpy(), reference_top_p(probs[i].numpy(), p), rtol=1e-6)


def test_each_row_is_independent_of_its_neighbours_bitwise(monkeypatch):
    """Rows in chunks of two, the last alone: the same rows as one at a time. The last chunk
    takes a view of the workspace's first rows; an output of another size would make torch
    resize it (a warning, and memory beyond the recorded sequence)."""
    vocab = 1000
    monkeypatch.setattr(renorm, "PIVOT_CHUNK_BYTES", 2 * renorm.PIVOT_BYTES_PER_ENTRY * vocab)
    assert pivot_chunk_rows(vocab) == 2
    rows = 7  # spans four pivot chunks
    g = torch.Generator().manual_seed(7)
    probs = torch.softmax(3 * torch.randn(rows, vocab, generator=g), dim=-1)
    ks = torch.tensor([1, 50, 999, vocab, 7, 3, 2000])
    ps = torch.linspace(0.1, 1.0, rows)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        whole_k, whole_p = top_k_renorm_probs(probs, ks), top_p_renorm_probs(probs, ps)
    for i in range(rows):
        assert torch.equal(whole_k[i], top_k_renorm_probs(probs[i:i + 1], ks[i:i + 1])[0])
        assert torch.equal(whole_p[i], top_p_renorm_probs(probs[i:i + 1], ps[i:i + 1])[0])
        np.testing.assert_allclose(whole_k[i].numpy(), reference_top_k(probs[i].numpy(), int(ks[i])), rtol=1e-5)


def test_nan_and_all_zero_rows_raise_naming_the_rows():
    probs = t([[0.5, 0.5], [float("nan"), 1.0], [0.0, 0.0], [0.2, 0.8]])
    with pytest.raises(ValueError, match=r"rows \[1, 2\].*on_invalid='uniform'"):
        top_k_renorm_probs(probs, 1)
    with pytest.raises(ValueError, match=r"rows \[1, 2\]"):
        top_p_renorm_probs(probs, 0.5)
    with pytest.raises(ValueError, match=r"rows \[1, 2\]"):
        top_k_renorm_probs(probs, 5)


def test_invalid_rows_become_uniform_on_request():
    probs = t([[0.25, 0.75, 0.0], [float("nan"), 1.0, 0.0], [0.0, 0.0, 0.0]])
    out = top_k_renorm_probs(probs, 1, on_invalid="uniform")
    torch.testing.assert_close(out, t([[0, 1, 0], [1 / 3] * 3, [1 / 3] * 3]))
    out = top_p_renorm_probs(probs, 0.5, on_invalid="uniform")
    torch.testing.assert_close(out, t([[0, 1, 0], [1 / 3] * 3, [1 / 3] * 3]))


def test_bad_arguments_are_named():
    probs = t([[0.5, 0.5]])
    with pytest.raises(ValueError, match="top_k must be >= 1"):
        top_k_renorm_probs(probs, 0)
    with pytest.raises(ValueError, match="top_k must be >= 1"):
        top_k_renorm_probs(probs, torch.tensor([0]))
    with pytest.raises(ValueError, match="top_k must be an integer"):
        top_k_renorm_probs(probs, 1.5)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        top_p_renorm_probs(probs, 0.0)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        top_p_renorm_probs(probs, torch.tensor([float("nan")]))
    with pytest.raises(ValueError, match="one value per row"):
        top_p_renorm_probs(probs, torch.tensor([0.5, 0.5]))
    with pytest.raises(ValueError, match="2-D floating tensor"):
        top_k_renorm_probs(torch.tensor([0.5, 0.5]), 1)
    with pytest.raises(ValueError, match="on_invalid"):
        top_k_renorm_probs(probs, 1, on_invalid="zero")


def test_input_is_not_modified():
    probs = t([[0.1, 0.2, 0.3, 0.4]])
    before = probs.clone()
    top_k_renorm_probs(probs, 2)
    top_p_renorm_probs(probs, 0.5)
    top_k_renorm_probs(probs, 10)
    assert torch.equal(probs, before)


def test_messages_name_the_function_the_argument_and_what_came():
    probs = t([[0.5, 0.5], [0.25, 0.75], [1.0, 0.0]])
    with pytest.raises(ValueError, match=r"^top_k_renorm_probs expects a 2-D .* got \(2,\) of torch.float32; reshape"):
        top_k_renorm_probs(torch.tensor([0.5, 0.5]), 1)
    with pytest.raises(ValueError, match=r"^top_p_renorm_probs expects a 2-D .* got list; reshape"):
        top_p_renorm_probs([[0.5, 0.5]], 0.5)
    with pytest.raises(ValueError, match=r"^top_k_renorm_probs: the vocabulary dimension is empty"):
        top_k_renorm_probs(torch.zeros(2, 0), 1)
    with pytest.raises(ValueError, match=r"^top_p_renorm_probs: rows \[1\] are NaN"):
        top_p_renorm_probs(t([[0.5, 0.5], [0.0, 0.0]]), 0.5)
    with pytest.raises(ValueError, match=r"^top_k_renorm_probs: rows \[0\] are NaN"):
        top_k_renorm_probs(t([[0.0, 0.0], [0.5, 0.5]]), 1)
    with pytest.raises(ValueError, match=r"^top_k must be a number or a tensor, got str"):
        top_k_renorm_probs(probs, "2")
    with pytest.raises(ValueError, match=r"^top_p must be a number or a tensor, got bool"):
        top_p_renorm_probs(probs, True)
    with pytest.raises(ValueError, match=r"^top_k must hold integers, got dtype torch.float32"):
        top_k_renorm_probs(probs, torch.tensor([1.0, 2.0, 1.0]))
    # the bad value itself when every row has it, else the rows that do
    with pytest.raises(ValueError, match=r"top_k must be >= 1 .*, got 0$"):
        top_k_renorm_probs(probs, torch.tensor([0, 0, 0]))
    with pytest.raises(ValueError, match=r"top_k must be >= 1 .*, got rows \[1\]$"):
        top_k_renorm_probs(probs, torch.tensor([1, 0, 2]))
    with pytest.raises(ValueError, match=r"top_k must be >= 1 .*, got rows \[1\]$"):
        top_k_renorm_probs(probs[:2], torch.tensor([1, 0]))
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\] .*, got rows \[0, 2\]$"):
        top_p_renorm_probs(probs, torch.tensor([-1.0, 0.5, 0.0]))
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\] .*, got -0.5$"):
        top_p_renorm_probs(probs[:1], torch.tensor([-0.5]))
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\] .*, got rows \[0, 1, 2, 3, 4, 5, 6, 7, 8, 9\]$"):
        top_p_renorm_probs(torch.full((25, 2), 0.5), torch.tensor([0.0] * 24 + [0.5]))  # 24 bad: ten shown


def test_invalid_rows_are_listed_ten_at_most_and_negative_ones_named():
    probs = torch.full((14, 3), 1 / 3)
    probs[:11] = 0.0  # eleven empty rows
    with pytest.raises(ValueError, match=r"rows \[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, '\.\.\.'\] are NaN"):
        top_k_renorm_probs(probs, 1)
    probs[10] = 1 / 3  # ten
    with pytest.raises(ValueError, match=r"rows \[0, 1, 2, 3, 4, 5, 6, 7, 8, 9\] are NaN"):
        top_k_renorm_probs(probs, 1)
    negative = torch.full((13, 2), 0.5)
    negative[1:13, 0] = -0.5  # twelve rows with a negative entry, one empty row before them
    negative[0] = 0.0
    with pytest.raises(ValueError, match=r"rows \[1, 2, 3, 4, 5, 6, 7, 8, 9, 10\] hold negative values, .*apply "
                                         r"torch.softmax first\); invalid rows in all: \[0, 1, .*, 9, '\.\.\.'\]"):
        top_p_renorm_probs(negative, 0.5)


def test_one_value_as_a_zero_dim_tensor():
    probs = quantised_rows(5, 4, 9)
    assert torch.equal(top_k_renorm_probs(probs, torch.tensor(2)), top_k_renorm_probs(probs, 2))
    assert torch.equal(top_p_renorm_probs(probs, torch.tensor(0.4)), top_p_renorm_probs(probs, 0.4))


def test_a_vocabulary_of_one():
    assert torch.equal(top_k_renorm_probs(t([[0.25], [1.0]]), 1), t([[1.0], [1.0]]))
    assert torch.equal(top_p_renorm_probs(t([[0.25], [1.0]]), 0.5), t([[1.0], [1.0]]))


def test_k_and_p_keep_their_precision_over_half_rows():
    """k is an integer and p a float32 whatever the rows' dtype: float16 cannot hold 2049,
    and rounds 0.9 down to 0.8999."""
    row = torch.arange(1000, 4000, dtype=torch.int16).view(torch.float16)  # 3000 distinct positive halves
    probs = row[torch.randperm(3000, generator=torch.Generator().manual_seed(0))][None]
    assert int((top_k_renorm_probs(probs, 2049) > 0).sum()) == 2049
    assert int((top_k_renorm_probs(probs, torch.tensor([2049])) > 0).sum()) == 2049
    pair = torch.tensor([[0.8999, 0.1001]], dtype=torch.float16)  # the first is float16(0.9)
    assert float(pair[0, 0]) == float(torch.tensor(0.9, dtype=torch.float16))
    for p in (0.9, torch.tensor([0.9])):
        assert int((top_p_renorm_probs(pair, p) > 0).sum()) == 2, "0.8999 does not reach 0.9"


def test_the_pivot_search_holds_about_its_budget():
    for vocab in (1, 2, 1000, 128256, renorm.PIVOT_CHUNK_BYTES // renorm.PIVOT_BYTES_PER_ENTRY):
        rows = pivot_chunk_rows(vocab)
        assert rows * renorm.PIVOT_BYTES_PER_ENTRY * vocab <= renorm.PIVOT_CHUNK_BYTES
        assert (rows + 1) * renorm.PIVOT_BYTES_PER_ENTRY * vocab > renorm.PIVOT_CHUNK_BYTES, "as many rows as fit"
    assert pivot_chunk_rows(renorm.PIVOT_CHUNK_BYTES) == 1, "at least one row, however wide"


def test_weights_above_one_are_renormalised_too():
    """Rows need not be normalised (counts, unnormalised weights): the pivot search covers
    every exponent bit, so k = 1 keeps 3.0 alone and not the 2.5 below it."""
    assert torch.equal(top_k_renorm_probs(t([[3.0, 2.5, 0.5]]), 1), t([[1.0, 0.0, 0.0]]))
    assert torch.equal(top_p_renorm_probs(t([[3.0, 2.5, 0.5]]), 0.5), t([[1.0, 0.0, 0.0]]))

