"""The fused kernels' side of the target probabilities: Triton helpers and the interpreter.

The formula is stated once, in :mod:`graphborrow.eagle.probs` (its torch form,
:func:`~graphborrow.eagle.probs.target_probs_reference`, is what the reference step
computes); here are the same steps as Triton functions, the compile options that keep
them exact (no fused multiply-add, no denormal flushing), and two patches that make
Triton's interpreter (the CPU tests) run them with torch's CPU ``exp``. Top-k / top-p
kept sums and the residual's running sum are float64 additions whose order the kernels
cannot share with torch, so there agreement is up to the last float64 bit (a token
flips only when a coin lands within about 1e-16 of a boundary).

``m`` needs no division per entry in a kernel: correctly rounded division by t > 0 is
monotone, so ``max(x / t) == max(x) / t``. ``e`` needs none either in the streaming loops
(:func:`exp_y_minus_m`): from ``w = RN(1 / t)``, a product and two multiply-add corrections
give ``RN(x / t)`` (Markstein's theorem: the first correction makes the quotient faithful,
the second, from an exact remainder, rounds it correctly). That holds while nothing
overflows or underflows; a row whose t or m is out of the range that guarantees it
(:func:`multiply_ok`) divides, and the entries of an allowed row outside it get an ``e``
equal to the division's anyway (module notes at :func:`exp_y_minus_m`).

Importing this module on a machine without CUDA selects Triton's interpreter
(``TRITON_INTERPRET=1``), which must happen before anything imports triton.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from ..probs import SUM_CHUNK_ENTRIES, sum_bits, target_probs_reference

if not torch.cuda.is_available():  # run the kernels on CPU tensors in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # the torch formulation and the workspace (on the simulated device) still work
    triton = None

__all__ = ["FMA_ROUNDS_ONCE", "INTERPRETED", "SUM_CHUNK_ENTRIES", "TRITON_AVAILABLE", "sum_bits",
           "target_probs_reference"]

TRITON_AVAILABLE = triton is not None
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


# ---------------------------------------------------------------------------------
# Per-request values, shared by the fused modules


def per_request_value(value, n, name, dtype):
    """A number or an n-value tensor, checked: the number as the kernels take it (int32 top-k
    clamped to 2**31 - 1, which keeps every entry as any larger k does), or the tensor.

    Nothing is allocated and nothing is read on the host. Integer tensors are passed as they
    are: values of 2**31 and more are rejected by the value checks (``validate``), since the
    kernels read k as int32.

    Raises:
        ValueError: a tensor of another length, a float tensor for an integer parameter, or
            something that is neither a number nor a tensor.
    """
    if isinstance(value, torch.Tensor):
        if value.numel() != n and not (value.numel() == 1 and value.dim() == 0):
            raise ValueError(f"{name} must be a number or hold one value per request ({n}), got shape "
                             f"{tuple(value.shape)}")
        if dtype in (torch.int32, torch.int64) and value.is_floating_point():
            raise ValueError(f"{name} must hold integers, got {value.dtype}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number or a tensor of one value per request, got {type(value).__name__}")
    if dtype == torch.int32:
        return min(int(value), 2**31 - 1)
    return float(value)


def any_true(mask: torch.Tensor) -> bool:
    """``mask.any()`` on the host (a synchronisation: for validation only)."""
    return bool(mask.any())


# ---------------------------------------------------------------------------------
# Triton's interpreter (CPU tests): two patches


def _patch_interpreter_scalars() -> None:
    """Triton's interpreter turns one-element scalars into loop bounds with ``int(array)``,
    which NumPy >= 2.4 refuses for 1-d arrays; index the element instead."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_graphborrow", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._graphborrow = True
    interpreter._patch_lang_tensor = patched


def _torch_exp(data: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(data)).exp().numpy()


def _patch_interpreter_exp() -> None:
    """The interpreter's ``tl.exp`` is numpy's, which differs from torch's CPU exp in the last
    bit for about a third of float32 inputs; use torch's, as the CUDA build shares expf with torch."""
    from triton.runtime.interpreter import InterpreterBuilder

    if getattr(InterpreterBuilder.create_exp, "_graphborrow", False):
        return

    def create_exp(self, arg):
        return self.unary_op(arg, _torch_exp)

    create_exp._graphborrow = True
    InterpreterBuilder.create_exp = create_exp


if TRITON_AVAILABLE and INTERPRETED:
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(tl.max, InterpretedFunction):
        raise RuntimeError("triton.language was imported before TRITON_INTERPRET=1 was set, so its library "
                           "functions cannot run in the interpreter; set TRITON_INTERPRET=1 in the environment "
                           "(or import graphborrow.eagle.triton.fused before triton)")
    _patch_interpreter_scalars()
    _patch_interpreter_exp()


def _fma_rounds_once() -> bool:
    """Compiled code's fma rounds once; Triton's interpreter's does from the release whose
    C ``fma_fp32`` it calls (3.9), while earlier ones round twice, which could flip
    :func:`exp_y_minus_m`'s last bit, so there rows divide."""
    if not (TRITON_AVAILABLE and INTERPRETED):
        return TRITON_AVAILABLE
    from triton._C.libtriton import interpreter

    return hasattr(interpreter, "fma_fp32")


FMA_ROUNDS_ONCE = _fma_rounds_once()


def compile_options() -> dict:
    """No denormal flushing in libdevice and no fused multiply-add: torch's kernels use neither."""
    if INTERPRETED:
        return {}
    return {"enable_fp_fusion": False, "enable_reflect_ftz": False}


# ---------------------------------------------------------------------------------
# The same formula as Triton helpers (PRECISE: compiled for CUDA, else the interpreter)

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

        Fast, the quotient is a product and two corrections (module docstring), exact from
        |x| = 2**-100 while x * inv_t stays finite. Below, |x / t| < 2**-80 is under a
        quarter of m's last place, so ``RN(q - m) == -m`` with any such q. Where |x / t|
        reaches 2**128 (and at -inf) the product overflows and the corrections give NaN or
        -inf, while the exact y - m is below -2**100: ``max(., -200)`` turns both into an e
        of 0, which is what expf gives from -104 down, so the clamp changes no other e.
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
