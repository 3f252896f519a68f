"""The streaming loops' e = exp(x / t - m) by multiplication, bitwise the division's.

The sums and the residual divide by t once per row and multiply per entry
(:func:`graphborrow.eagle.triton.formula.exp_y_minus_m`). Checked against torch's own
division and exp on the same device, for every entry a row can hold (x / t <= m, x not
NaN): in Triton's interpreter on entries of every exponent (its fma rounds once, as the
GPU's does, from Triton 3.9; with an older one the rows divide, which the same tests check),
and on a GPU on every float32, 2**32 entries per (t, m)::

    pytest -m gpu tests/eagle/test_exact_quotient.py -rA
"""

import pytest
import torch

from graphborrow.eagle.triton import formula, runtime

if not runtime.TRITON_AVAILABLE:
    pytest.skip("these tests run a Triton kernel: install triton (the 'kernels' extra)", allow_module_level=True)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

DEVICE = "cpu" if runtime.INTERPRETED else "cuda"
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # (the interpreter's numpy)

# (t, m) within multiply_ok's range: everyday temperatures, t = 1, the range's ends, one ulp
# off a power of two, and m of both signs from the smallest allowed to the largest
INSIDE = [(0.7, 1.5), (1.0, 12.25), (0.3, -3.0), (1.7, 2.0**-30), (2.0**-20, 2.0**20), (2.0**20, -2.0**-30),
          (0.99999994, 33.5), (3.0000002, -2.0**20), (0.05, 731.0)]
# and outside it: each bound crossed, a NaN maximum
OUTSIDE = [(2.0**-21, 1.0), (2.0**21, 1.0), (0.7, 2.0**-31), (0.7, 2.0**21), (0.7, float("nan"))]


@triton.jit
def _e_kernel(x_ptr, out, fast_out, t, big, n, BLOCK: tl.constexpr, PRECISE: tl.constexpr):
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + idx, mask=idx < n, other=0.0)
    fast = formula.multiply_ok(t, big)
    e = formula.exp_y_minus_m(x, t, tl.math.div_rn(1.0, t), big, fast, PRECISE)
    tl.store(out + idx, e, mask=idx < n)
    if tl.program_id(0) == 0:
        tl.store(fast_out, fast.to(tl.int32))


def kernel_e(x: torch.Tensor, t: float, big: float) -> tuple:
    """(e of every entry, whether the row took the multiplications)."""
    out = torch.empty_like(x)
    fast = torch.zeros(1, dtype=torch.int32, device=x.device)
    block = 1024
    _e_kernel[(triton.cdiv(x.numel(), block),)](x, out, fast, t, big, x.numel(), BLOCK=block,
                                                 PRECISE=not runtime.INTERPRETED, **runtime.compile_options())
    return out, bool(fast.item())


def torch_e(x: torch.Tensor, t: float, big: float) -> tuple:
    """(exp(x / t - m) as the reference computes it, whether a row whose m this is can hold
    the entry: x / t <= m, x not NaN)."""
    t_, m_ = (torch.tensor([v], dtype=torch.float32, device=x.device) for v in (t, big))
    z = x / t_ - m_  # tensor operands: IEEE division, as target_probs_reference divides
    return z.exp(), (x / t_ <= m_) & ~x.isnan()


def every_exponent(n_per_exponent: int, seed: int) -> torch.Tensor:
    """float32 entries of both signs at every exponent (subnormals and zeros included),
    random mantissas, plus the infinities and the largest finite values."""
    g = torch.Generator().manual_seed(seed)
    exponents = torch.arange(0, 255, dtype=torch.int32).repeat_interleave(n_per_exponent)
    mantissas = torch.randint(0, 1 << 23, exponents.shape, generator=g, dtype=torch.int32)
    signs = torch.randint(0, 2, exponents.shape, generator=g, dtype=torch.int32)
    bits = (signs << 31) | (exponents << 23) | mantissas
    edges = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 3.4028235e38, -3.4028235e38, 1e-45, -1e-45])
    return torch.cat([bits.view(torch.float32), edges])


def assert_same_e(x, t, big):
    got, fast = kernel_e(x, t, big)
    expected, allowed = torch_e(x, t, big)
    differ = allowed & (got.view(torch.int32) != expected.view(torch.int32))
    assert not bool(differ.any()), (f"t={t}, m={big}: {int(differ.sum())} entries differ, first x "
                                    f"{x[differ][:4].tolist()}: {got[differ][:4].tolist()} against "
                                    f"{expected[differ][:4].tolist()}")
    return fast, int(allowed.sum())


@pytest.mark.parametrize("t,big", INSIDE)
def test_the_multiplications_give_the_divisions_e_at_every_exponent(t, big):
    x = every_exponent(24, seed=7).to(DEVICE)
    fast, checked = assert_same_e(x, t, big)
    assert fast is runtime.FMA_ROUNDS_ONCE, f"multiply_ok: {fast} for t={t}, m={big}, inside its range"
    assert checked > len(x) // 8  # (x / t <= m for over an eighth of the entries at each (t, m) here)


@pytest.mark.parametrize("t,big", OUTSIDE)
def test_rows_outside_the_range_divide(t, big):
    x = every_exponent(4, seed=8).to(DEVICE)
    fast, _ = assert_same_e(x, t, big)
    assert not fast, f"multiply_ok allowed t={t}, m={big}, outside its range"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run: pytest -m gpu tests/)")
@pytest.mark.parametrize("t,big", INSIDE[:6])
def test_every_float32_gives_the_divisions_e_on_the_gpu(t, big):
    checked = 0
    step = 1 << 28
    for lo in range(-(1 << 31), 1 << 31, step):
        x = torch.arange(lo, lo + step, dtype=torch.int64, device="cuda").to(torch.int32).view(torch.float32)
        fast, n = assert_same_e(x, t, big)
        assert fast
        checked += n
        del x
    print(f"t={t} m={big}: {checked} entries checked, all equal")
    assert checked > 1 << 30  # (x / t <= m: from a quarter of them, m < 0, to three quarters)
