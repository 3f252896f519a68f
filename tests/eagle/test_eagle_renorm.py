"""top_k_renorm_probs / top_p_renorm_probs: flashinfer semantics and edge cases."""

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
    vocab = 1000
    monkeypatch.setattr(renorm, "PIVOT_CHUNK_BYTES", 2 * renorm.PIVOT_BYTES_PER_ENTRY * vocab)
    assert pivot_chunk_rows(vocab) == 2
    rows = 7  # spans four pivot chunks
    g = torch.Generator().manual_seed(7)
    probs = torch.softmax(3 * torch.randn(rows, vocab, generator=g), dim=-1)
    ks = torch.tensor([1, 50, 999, vocab, 7, 3, 2000])
    ps = torch.linspace(0.1, 1.0, rows)
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
