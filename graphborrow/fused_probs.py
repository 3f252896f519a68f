"""The target probabilities of the fused verification kernels, stated once, in torch and in Triton.

For one row of logits x (float32; half types convert exactly) and its request's
temperature t > 0, the target distribution is::

    y = x / t                       IEEE float32 division
    m = max(y)
    e = exp(y - m)                  float32 expf
    S = sum(int64(e * 2**K))        an integer sum: exact, whatever the order
    s = float32(float64(S)) * 2**-K
    p = e / s                       IEEE float32 division

with ``K = sum_bits(vocab)`` fraction bits, so that S < 2**62 whatever the row holds.
Every step is exact or a single correctly rounded operation, except ``exp``, which is
the same function on both sides: on CUDA, torch's float32 ``exp`` and Triton's
``libdevice.exp`` are both the CUDA math library's ``expf`` (no fast math, no flush to
zero, kernels compiled without fused multiply-add); in Triton's interpreter (the CPU
tests) the kernels' ``exp`` is torch's CPU ``exp`` (patched in below). So
:func:`target_probs_reference` and the kernels agree bit for bit, on CUDA and on CPU,
and a kernel may sum a row in any order, over any number of slices.

The fixed-point sum drops each term's bits below 2**-K (K = 45 for a 128256-token
vocabulary): s is within V * 2**-K (about 2**-28) of the exact sum of the e's, finer
than float32 resolves. Top-k / top-p then follow :mod:`graphborrow.renorm`
(flashinfer's semantics, float64 kept sums); those sums and the residual sampling's
running sum are float64 additions whose order the kernels cannot share with torch, so
there agreement is up to the last float64 bit (a token flips only when a coin lands
within about 1e-16 of a boundary).

``m`` needs no division per entry in a kernel: correctly rounded division by t > 0 is
monotone, so ``max(x / t) == max(x) / t``.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from .renorm import top_k_renorm_probs, top_p_renorm_probs

if not torch.cuda.is_available():  # run the kernels on CPU tensors in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # the torch formulation and the workspace (on the simulated device) still work
    triton = None

__all__ = ["INTERPRETED", "SUM_CHUNK_ENTRIES", "TRITON_AVAILABLE", "sum_bits", "target_probs_reference"]

TRITON_AVAILABLE = triton is not None
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
SUM_CHUNK_ENTRIES = 1 << 22  # entries whose int64 terms target_probs_reference holds at once (48 MiB)


def sum_bits(vocab: int) -> int:
    """Fraction bits K of the fixed-point softmax sum: vocab * 2**K < 2**62."""
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
        raise ValueError(f"vocab must be a positive int, got {vocab!r}")
    bits = 62 - vocab.bit_length()
    if bits < 24:
        raise ValueError(f"a vocabulary of {vocab} entries leaves {bits} fraction bits for the softmax sum; "
                         "at most 2**38 entries are supported")
    return bits


def target_probs_reference(logits: torch.Tensor, temperatures, top_ks=None, top_ps=None) -> torch.Tensor:
    """The fused kernels' target probabilities, in torch ops (see the module docstring).

    Args:
        logits: [rows, V] float32, float16 or bfloat16.
        temperatures: a number or one value per row ([rows]); > 0.
        top_ks, top_ps: None, a number, or one value per row, as
            :func:`graphborrow.renorm.top_k_renorm_probs` / ``top_p_renorm_probs`` take
            them (top-k first, then top-p).

    Returns:
        [rows, V] float32 probabilities, bitwise what the kernels compute on the same device.
        Besides the result it holds, a few rows at a time, the int64 terms of the sum
        (at most ``SUM_CHUNK_ENTRIES`` entries, 12 bytes each).
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError("logits must be a floating tensor [rows, V]; reshape to (-1, V) first")
    rows, vocab = logits.shape
    scale = 2.0 ** sum_bits(vocab)
    t = _per_row(temperatures, rows, logits.device)
    e = logits.float() / t  # a tensor divisor: IEEE division (torch multiplies by 1/t for a CPU scalar)
    e.sub_(e.amax(dim=1, keepdim=True)).exp_()  # in place: the same kernels as y - m and exp
    total = torch.empty((rows, 1), dtype=torch.int64, device=logits.device)
    step = max(1, SUM_CHUNK_ENTRIES // max(vocab, 1))
    for lo in range(0, rows, step):  # the int64 terms a few rows at a time
        torch.sum((e[lo:lo + step] * scale).to(torch.int64), dim=1, keepdim=True, out=total[lo:lo + step])
    s = total.to(torch.float64).to(torch.float32) * (1.0 / scale)
    probs = e.div_(s)
    if top_ks is not None:
        probs = top_k_renorm_probs(probs, top_ks)
    if top_ps is not None:
        probs = top_p_renorm_probs(probs, top_ps)
    return probs


# ---------------------------------------------------------------------------------
# Per-request values, shared by the fused modules


def per_request(value, n, name, like, dtype) -> torch.Tensor:
    """A number or an n-value tensor as an [n] tensor of ``dtype`` next to ``like`` (no host sync)."""
    if isinstance(value, torch.Tensor):
        if value.numel() == 1 and value.dim() == 0:
            return like.new_empty(n, dtype=dtype).copy_(value.to(dtype).expand(n))
        if value.numel() != n:
            raise ValueError(f"{name} must be a number or hold one value per request ({n}), got shape "
                             f"{tuple(value.shape)}")
        if dtype in (torch.int32, torch.int64) and value.is_floating_point():
            raise ValueError(f"{name} must hold integers, got {value.dtype}")
        if dtype == torch.int32 and value.dtype == torch.int64:
            value = value.clamp(max=2**31 - 1)
        return like.new_empty(n, dtype=dtype).copy_(value.reshape(n))
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number or a tensor of one value per request, got {type(value).__name__}")
    if dtype == torch.int32:
        value = min(int(value), 2**31 - 1)
    return like.new_full((n,), value, dtype=dtype)


def any_true(mask: torch.Tensor) -> bool:
    """``mask.any()`` on the host (a synchronisation: for validation only)."""
    return bool(mask.any())


def _per_row(value, rows: int, device) -> torch.Tensor:
    """Temperatures as a float32 [rows, 1] tensor on ``device``."""
    if isinstance(value, torch.Tensor):
        if value.numel() == 1:
            value = value.reshape(1).expand(rows)
        if value.numel() != rows:
            raise ValueError(f"temperatures must be a number or hold one value per row ({rows}), "
                             f"got shape {tuple(value.shape)}")
        return value.reshape(rows, 1).to(device=device, dtype=torch.float32).contiguous()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"temperatures must be a number or a tensor, got {type(value).__name__}")
    return torch.full((rows, 1), float(value), dtype=torch.float32, device=device)


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
                           "(or import graphborrow.fused_verify before triton)")
    _patch_interpreter_scalars()
    _patch_interpreter_exp()


def compile_options() -> dict:
    """No denormal flushing in libdevice and no fused multiply-add: torch's kernels use neither."""
    if INTERPRETED:
        return {}
    return {"enable_fp_fusion": False, "enable_reflect_ftz": False}


# ---------------------------------------------------------------------------------
# The same formula as Triton helpers (PRECISE: compiled for CUDA, else the interpreter)

if TRITON_AVAILABLE:

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
    def fixed_point_e(x, t, big, scale, PRECISE: tl.constexpr):
        """int64(e * 2**K) of logits x: one row's terms of S."""
        e = exp_f32(tl.math.div_rn(x, t) - big, PRECISE)
        return (e * scale).to(tl.int64)

    @triton.jit
    def prob(x, t, big, total, PRECISE: tl.constexpr):
        """p = exp(x / t - m) / s."""
        return tl.math.div_rn(exp_f32(tl.math.div_rn(x, t) - big, PRECISE), total)

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
