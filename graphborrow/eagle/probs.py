"""The target probabilities of a verification step, stated once, exactly reproducible.

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
the same function everywhere it runs: on CUDA, torch's float32 ``exp`` and Triton's
``libdevice.exp`` are both the CUDA math library's ``expf`` (no fast math, no flush to
zero, kernels compiled without fused multiply-add); in Triton's interpreter (the CPU
tests) the kernels' ``exp`` is torch's CPU ``exp``. So the reference verification
(:mod:`.modes`, which calls :func:`softmax_rows`) and the fused kernels
(:mod:`graphborrow.eagle.triton.fused`) agree bit for bit, and a kernel may sum a row in any
order, over any number of slices. A plain ``torch.softmax`` sums in float32 in an order of
its own, which no kernel that splits a row can reproduce.

The fixed-point sum drops each term's bits below 2**-K (K = 45 for a 128256-token
vocabulary): s is within V * 2**-K (about 2**-28) of the exact sum of the e's, finer
than float32 resolves. Top-k / top-p then follow :mod:`.renorm` (flashinfer's
semantics, float64 kept sums).

This module needs torch alone (no Triton): the reference runs on CPU, on the simulated
device and on CUDA.
"""

from __future__ import annotations

import torch

from .renorm import renorm_rows, top_k_renorm_probs, top_p_renorm_probs

__all__ = ["SUM_CHUNK_ENTRIES", "softmax_rows", "sum_bits", "target_probs_reference"]

SUM_CHUNK_ENTRIES = 1 << 22  # entries whose int64 terms softmax_rows holds at once (32 MiB)


def sum_bits(vocab: int) -> int:
    """Fraction bits K of the fixed-point softmax sum: vocab * 2**K < 2**62."""
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
        raise ValueError(f"vocab must be a positive int, got {vocab!r}")
    bits = 62 - vocab.bit_length()
    if bits < 24:
        raise ValueError(f"a vocabulary of {vocab} entries leaves {bits} fraction bits for the softmax sum; "
                         "at most 2**38 entries are supported")
    return bits


def softmax_rows(logits: torch.Tensor, temps: torch.Tensor) -> torch.Tensor:
    """softmax(logits / t) per row by the fixed-point formula (the module docstring).

    Args:
        logits: [rows, V] float32, float16 or bfloat16.
        temps: [rows] float32 temperatures next to the logits (> 0; not checked here).

    Returns:
        A new [rows, V] float32 tensor. Besides it, the call holds the int64 terms of
        the sum a few rows at a time (at most ``SUM_CHUNK_ENTRIES`` entries, 32 MiB).
    """
    rows, vocab = logits.shape
    scale = 2.0 ** sum_bits(vocab)
    e = logits.float() / temps.unsqueeze(1)  # a tensor divisor: IEEE division (a CPU scalar multiplies by 1/t)
    e.sub_(e.amax(dim=1, keepdim=True)).exp_().mul_(scale)  # in place: y - m, exp, then e * 2**K (exact)
    total = e.new_empty((rows, 1), dtype=torch.int64)
    step = max(1, SUM_CHUNK_ENTRIES // max(vocab, 1))
    for lo in range(0, rows, step):  # the int64 terms a few rows at a time
        torch.sum(e[lo:lo + step].to(torch.int64), dim=1, keepdim=True, out=total[lo:lo + step])
    # (e * 2**K) / float32(S) is e / s exactly: both sides scaled by the same power of two
    return e.div_(total.to(torch.float64).to(torch.float32))


def target_probs(logits: torch.Tensor, temps: torch.Tensor, top_k, top_p) -> torch.Tensor:
    """A step's target rows: :func:`softmax_rows`, then top-k and top-p with per-row tensors
    (no host read: the rows are already validated)."""
    return renorm_rows(softmax_rows(logits, temps), top_k, top_p)


def target_probs_reference(logits: torch.Tensor, temperatures, top_ks=None, top_ps=None) -> torch.Tensor:
    """The target probabilities both verification paths compute, for readers and tests.

    Args:
        logits: [rows, V] float32, float16 or bfloat16.
        temperatures: a number or one value per row ([rows]); > 0.
        top_ks, top_ps: None, a number, or one value per row, as
            :func:`~graphborrow.eagle.renorm.top_k_renorm_probs` / ``top_p_renorm_probs``
            take them (top-k first, then top-p).

    Returns:
        [rows, V] float32 probabilities: bitwise what the reference step and the fused
        kernels compute on the same device.
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError("logits must be a floating tensor [rows, V]; reshape to (-1, V) first")
    probs = softmax_rows(logits, _per_row(temperatures, logits.shape[0], logits))
    if top_ks is not None:
        probs = top_k_renorm_probs(probs, top_ks)
    if top_ps is not None:
        probs = top_p_renorm_probs(probs, top_ps)
    return probs


def _per_row(value, rows: int, like: torch.Tensor) -> torch.Tensor:
    """Temperatures as a float32 [rows] tensor next to ``like``."""
    if isinstance(value, torch.Tensor):
        if value.numel() == 1:
            value = value.reshape(1).expand(rows)
        if value.numel() != rows:
            raise ValueError(f"temperatures must be a number or hold one value per row ({rows}), "
                             f"got shape {tuple(value.shape)}")
        return like.new_empty(rows, dtype=torch.float32).copy_(value.reshape(rows))
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"temperatures must be a number or a tensor, got {type(value).__name__}")
    return like.new_full((rows,), float(value), dtype=torch.float32)
