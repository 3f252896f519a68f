"""The target probabilities' formula as Triton functions, shared by every fused kernel.

The formula is stated once, in :mod:`graphborrow.eagle.probs` (its torch form,
:func:`~graphborrow.eagle.probs.target_probs_reference`, is what the reference step
computes); these are the same steps in device code, exact when compiled with
:func:`~graphborrow.eagle.triton.runtime.compile_options` (no fused multiply-add, no
denormal flushing). ``PRECISE``: compiled for CUDA (libdevice's expf), else the
interpreter (torch's CPU exp). Why ``m`` and ``e`` need no division per entry, and why
the multiplications give the division's bits: ``docs/kernels.md``, "One division per row".
"""

from __future__ import annotations

from .runtime import FMA_ROUNDS_ONCE, TRITON_AVAILABLE

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

__all__: list[str] = []  # device functions, imported by the kernel modules by name

if TRITON_AVAILABLE:
    # multiply_ok's bounds: powers of two, so they compare exactly
    T_LOW, T_HIGH = tl.constexpr(2.0**-20), tl.constexpr(2.0**20)
    M_LOW, M_HIGH = tl.constexpr(2.0**-30), tl.constexpr(2.0**20)
    FMA_ONCE = tl.constexpr(FMA_ROUNDS_ONCE)

    @triton.jit
    def exp_f32(x, PRECISE: tl.constexpr):
        """expf: the CUDA math library's when compiled, torch's CPU exp in the interpreter."""
        if PRECISE:
            return libdevice.exp(x)
        else:
            return tl.exp(x)

    @triton.jit
    def row_max_y(part_max, row, splits, t, SPLIT_BLOCK: tl.constexpr):
        """m = max(x) / t from the row's per-slice maxima of x."""
        c = tl.arange(0, SPLIT_BLOCK)
        m = tl.load(part_max + row.to(tl.int64) * splits + c, mask=c < splits, other=float("-inf"),
                    cache_modifier=".cg")
        return tl.math.div_rn(tl.max(m, axis=0), t)

    @triton.jit
    def row_norm(part_max, part_sum, row, splits, t, unscale, SPLIT_BLOCK: tl.constexpr):
        """(m, s) of a row from its slices: the maximum of y and the fixed-point sum of e."""
        big = row_max_y(part_max, row, splits, t, SPLIT_BLOCK)
        c = tl.arange(0, SPLIT_BLOCK)
        parts = tl.load(part_sum + row.to(tl.int64) * splits + c, mask=c < splits, other=0, cache_modifier=".cg")
        total = tl.sum(parts, axis=0).to(tl.float64).to(tl.float32) * unscale
        return big, total

    @triton.jit
    def multiply_ok(t, big):
        """Whether a row's entries may take :func:`exp_y_minus_m`'s multiplications:
        t in [2**-20, 2**20] and |m| in [2**-30, 2**20] (False for a NaN), and an fma
        that rounds once (``FMA_ROUNDS_ONCE``)."""
        a = tl.abs(big)
        return (t >= T_LOW) & (t <= T_HIGH) & (a >= M_LOW) & (a <= M_HIGH) & FMA_ONCE

    @triton.jit
    def exp_y_minus_m(x, t, inv_t, big, fast, PRECISE: tl.constexpr):
        """e = exp(RN(x / t) - m), bitwise; ``inv_t = RN(1 / t)``, ``fast = multiply_ok(t, m)``.

        Fast, the quotient is a product and two corrections (Markstein: the first makes it
        faithful, the second rounds it), exact from |x| = 2**-100 while x * inv_t stays
        finite. Below, |x / t| < 2**-80 is under a quarter of m's last place, so
        ``RN(q - m) == -m`` with any such q. Where |x / t| reaches 2**128 (and at -inf) the
        product overflows and the corrections give NaN or -inf, while the exact y - m is below
        -2**100: ``max(., -200)`` turns both into an e of 0, which is what expf gives from -104
        down, so the clamp changes no other e.
        (x <= max(x) keeps x / t below 2**20; a NaN x, refused by validation, gives 0 here
        and NaN by division.)
        """
        if fast:
            q = x * inv_t
            q = tl.fma(tl.fma(-q, t, x), inv_t, q)
            q = tl.fma(tl.fma(-q, t, x), inv_t, q)
            z = tl.maximum(q - big, -200.0)
        else:
            z = tl.math.div_rn(x, t) - big
        return exp_f32(z, PRECISE)

    @triton.jit
    def fixed_point_e(x, t, inv_t, big, fast, scale, PRECISE: tl.constexpr):
        """int64(e * 2**K) of logits x: one row's terms of S."""
        return (exp_y_minus_m(x, t, inv_t, big, fast, PRECISE) * scale).to(tl.int64)

    @triton.jit
    def prob(x, t, big, total, PRECISE: tl.constexpr):
        """p = exp(x / t - m) / s."""
        return tl.math.div_rn(exp_f32(tl.math.div_rn(x, t) - big, PRECISE), total)

    @triton.jit
    def prob_by_product(x, t, inv_t, big, total, fast, PRECISE: tl.constexpr):
        """:func:`prob` with :func:`exp_y_minus_m`'s quotient (the same bits)."""
        return tl.math.div_rn(exp_y_minus_m(x, t, inv_t, big, fast, PRECISE), total)

    @triton.jit
    def renormed(p, pk, sk, pp, sp, HAS_TOPK: tl.constexpr, HAS_TOPP: tl.constexpr):
        """Top-k then top-p renormalisation of p, given each pivot and its kept sum."""
        if HAS_TOPK:
            p = tl.where(p >= pk, tl.math.div_rn(p, sk), 0.0)
        if HAS_TOPP:
            p = tl.where(p >= pp, tl.math.div_rn(p, sp), 0.0)
        return p

    @triton.jit
    def float_key(x):
        """float32 -> int32 whose signed order is the float order (-0 just below +0)."""
        bits = x.to(tl.int32, bitcast=True)
        return bits ^ ((bits >> 31) & 0x7FFFFFFF)

    @triton.jit
    def key_float(k):
        return (k ^ ((k >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
