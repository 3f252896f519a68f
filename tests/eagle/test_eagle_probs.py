"""The target probabilities' formula (graphborrow.eagle.probs) against a statement of it
that shares none of its code: numpy float32 arithmetic and Python's integers.

The fused kernels are checked against this module bitwise (test_fused_verify.py), so a
fault here would pass there unnoticed; these tests pin the formula itself, fast enough
for mutation runs (make mutation-sampling).
"""

import math

import numpy as np
import pytest
import torch

from graphborrow.eagle import probs as formula
from graphborrow.eagle.renorm import top_k_renorm_probs, top_p_renorm_probs


def by_the_formula(logits: torch.Tensor, temps) -> np.ndarray:
    """The module docstring's formula, one row at a time: float32 division, max, torch's
    float32 exp (the one function the formula shares with every implementation), the
    fixed-point sum as a Python integer, one float32 division per entry."""
    x = logits.float().numpy()
    rows, vocab = x.shape
    k = 62 - vocab.bit_length()
    out = np.empty_like(x)
    for r in range(rows):
        y = x[r] / np.float32(temps[r])                       # IEEE float32 division
        e = torch.exp(torch.from_numpy(y - y.max())).numpy()  # float32 y - m, then expf
        total = sum(math.floor(float(v) * 2.0**k) for v in e)  # exact: every term an integer
        s = np.float32(float(total)) * np.float32(2.0**-k)     # float32(float64(S)) * 2**-K
        out[r] = e / s
    return out


@pytest.mark.parametrize("seed,vocab,scale", [(0, 257, 1.0), (1, 1000, 4.0), (2, 3001, 20.0)])
def test_softmax_rows_is_the_formula_bitwise(seed, vocab, scale):
    g = torch.Generator().manual_seed(seed)
    logits = scale * torch.randn(5, vocab, generator=g)
    logits[1, : vocab // 2] = -math.inf  # half the row masked
    logits[2] = logits[2, 0]            # a row of ties
    temps = torch.tensor([0.5, 1.0, 0.7, 2.0, 1.3])
    got = formula.softmax_rows(logits, temps).numpy()
    want = by_the_formula(logits, temps.tolist())
    assert got.dtype == np.float32
    differ = np.argwhere(got.view(np.int32) != want.view(np.int32))
    assert len(differ) == 0, f"{len(differ)} entries differ, first at {differ[:5].tolist()}"


def test_half_logits_are_the_float32_rows():
    """Half logits convert exactly; temperatures stay float32 whatever the logits' dtype
    (float16 would round 0.7 to 0.7002)."""
    g = torch.Generator().manual_seed(3)
    logits = 3.0 * torch.randn(4, 700, generator=g)
    temps = torch.full((4,), 0.7)
    for dtype in (torch.float16, torch.bfloat16):
        half = logits.to(dtype)
        want = formula.softmax_rows(half.float(), temps)
        assert torch.equal(formula.softmax_rows(half, temps), want)
        assert torch.equal(formula.target_probs_reference(half, 0.7), want)
        assert torch.equal(formula.target_probs_reference(half, torch.tensor([0.7] * 4)), want)


def test_target_probs_reference_is_a_softmax():
    """Against float64 softmax of the same float32 exponents z = x / t - m: within a few
    float32 ulps (exp, the fixed-point sum, two roundings), rows summing to 1."""
    g = torch.Generator().manual_seed(5)
    logits = 3.0 * torch.randn(6, 2000, generator=g)
    logits[1, :1000] = -math.inf
    temps = torch.tensor([0.5, 1.0, 1.0, 2.0, 0.9, 1.3])
    probs = formula.target_probs_reference(logits, temps)
    y = logits / temps.unsqueeze(1)
    z = (y - y.amax(dim=1, keepdim=True)).double()
    exact = torch.softmax(z, dim=-1)
    live = exact > 1e-30
    rel = ((probs.double() - exact).abs() / exact)[live]
    assert rel.max() < 5 * 2**-24
    assert torch.equal(probs[~live], torch.zeros_like(probs[~live]))
    assert ((probs.double().sum(dim=1) - 1).abs() < 2000 * 2**-24).all()


def test_summing_a_few_rows_at_a_time_changes_nothing(monkeypatch):
    g = torch.Generator().manual_seed(7)
    logits = 2.0 * torch.randn(9, 1000, generator=g)
    whole = formula.target_probs_reference(logits, 1.1)
    monkeypatch.setattr(formula, "SUM_CHUNK_ENTRIES", 2500)  # two rows per chunk, the last one alone
    calls = []
    real_sum = torch.sum
    monkeypatch.setattr(torch, "sum", lambda *a, **k: calls.append(1) or real_sum(*a, **k))  # counts the chunks
    assert torch.equal(formula.target_probs_reference(logits, 1.1), whole)
    assert len(calls) == 5


def test_the_sum_does_not_depend_on_the_order():
    """The fixed-point sum is exact: permuting a row permutes its probabilities (a float32
    or float64 running sum would round differently for some rows)."""
    g = torch.Generator().manual_seed(6)
    logits = 2.0 * torch.randn(64, 3000, generator=g)
    perm = torch.randperm(3000, generator=g)
    probs = formula.target_probs_reference(logits, 0.9)
    assert torch.equal(formula.target_probs_reference(logits[:, perm], 0.9), probs[:, perm])
    assert torch.equal(formula.target_probs_reference(logits.flip(1), 0.9), probs.flip(1))


def test_sum_bits_keeps_the_sum_in_int64():
    for vocab in (1, 1000, 128256, 151937, 2**20, 2**38 - 1):
        bits = formula.sum_bits(vocab)
        assert vocab * 2**bits < 2**62 <= 2 * vocab * 2**bits, "the most bits that keep the sum in int64"
    assert formula.sum_bits(128256) == 45
    for bad in (0, -3, 2.0, True, "8"):
        with pytest.raises(ValueError, match="vocab must be a positive int"):
            formula.sum_bits(bad)
    with pytest.raises(ValueError, match=r"leaves 23 fraction bits.*2\*\*38 entries"):
        formula.sum_bits(2**38)


def test_temperatures_as_a_number_one_value_or_one_per_row():
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(3, 500, generator=g)
    per_row = formula.target_probs_reference(logits, torch.tensor([0.9, 0.9, 0.9]))
    assert torch.equal(formula.target_probs_reference(logits, 0.9), per_row)
    assert torch.equal(formula.target_probs_reference(logits, torch.tensor(0.9)), per_row)
    assert torch.equal(formula.target_probs_reference(logits, torch.tensor([[0.9]])), per_row)
    mixed = formula.target_probs_reference(logits, torch.tensor([0.5, 1, 2.0], dtype=torch.float64))
    for r, t in enumerate((0.5, 1.0, 2.0)):
        assert torch.equal(mixed[r], formula.target_probs_reference(logits[r:r + 1], t)[0])
    with pytest.raises(ValueError, match=r"one value per row \(3\), got shape \(2,\)"):
        formula.target_probs_reference(logits, torch.tensor([0.9, 0.9]))
    for bad in ("0.9", True, None):
        with pytest.raises(ValueError, match=f"temperatures must be a number or a tensor, got {type(bad).__name__}$"):
            formula.target_probs_reference(logits, bad)
    with pytest.raises(ValueError, match=r"logits must be a floating tensor \[rows, V\]"):
        formula.target_probs_reference(logits[0], 0.9)
    with pytest.raises(ValueError, match="logits must be a floating tensor"):
        formula.target_probs_reference(torch.ones(2, 3, dtype=torch.long), 0.9)


def test_top_k_comes_before_top_p():
    """Top-k first, then top-p over the renormalised rows (the other order keeps other sets)."""
    g = torch.Generator().manual_seed(9)
    logits = 2.0 * torch.randn(4, 400, generator=g)
    plain = formula.softmax_rows(logits, torch.full((4,), 0.7))
    want = top_p_renorm_probs(top_k_renorm_probs(plain, 5), 0.6)
    other_order = top_k_renorm_probs(top_p_renorm_probs(plain, 0.6), 5)
    assert not torch.equal(want, other_order), "the case must tell the orders apart"
    assert torch.equal(formula.target_probs_reference(logits, 0.7, 5, 0.6), want)
    assert torch.equal(formula.target_probs_reference(logits, 0.7, 5), top_k_renorm_probs(plain, 5))
    assert torch.equal(formula.target_probs_reference(logits, 0.7, None, 0.6), top_p_renorm_probs(plain, 0.6))
    ks, ps = torch.tensor([5, 5, 5, 5]), torch.tensor([0.6] * 4)
    assert torch.equal(formula.target_probs(logits, torch.full((4,), 0.7), ks, ps), want)
    assert torch.equal(formula.target_probs(logits, torch.full((4,), 0.7), None, None), plain)
