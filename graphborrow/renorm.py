"""Top-k / top-p renormalisation of probability rows, with flashinfer's semantics.

Both functions keep every entry at or above a per-row pivot (so ties at the pivot
survive and more than k entries can remain), zero the rest and divide by the kept
sum floored at 1e-8. k >= vocab or p >= 1 keeps everything and only renormalises.

Everything is computed row by row: pivots come from an exact selection (top-k or a
sort) and kept sums from a float64 running sum, so a row's result does not depend on
which other rows share the call. The EAGLE verification modes group rows differently
and rely on that to emit identical tokens.

Memory: besides the output, a call holds one boolean mask of the input's size, and
while finding pivots the selection workspace of a few rows at a time (at most about
``PIVOT_CHUNK_BYTES``; see :func:`pivot_chunk_rows`).
"""

from __future__ import annotations

import torch

KEPT_SUM_FLOOR = 1e-8
PIVOT_CHUNK_BYTES = 64 << 20
# Workspace bound per entry of a chunk: sorted (or top-k) values and int64 indices (12 B)
# plus the sort's own scratch (CUDA's segmented sort double-buffers both: about 45 B per
# entry measured on an H200); later the sorted values with their float64 running sum,
# or a float64 copy and a mask.
PIVOT_BYTES_PER_ENTRY = 48
INVALID_MODES = ("raise", "uniform")


def pivot_chunk_rows(vocab: int) -> int:
    """How many rows share one pivot search (bounds the selection workspace)."""
    return max(1, PIVOT_CHUNK_BYTES // (PIVOT_BYTES_PER_ENTRY * max(vocab, 1)))


def top_k_renorm_probs(probs: torch.Tensor, top_k, on_invalid: str = "raise") -> torch.Tensor:
    """Keep the entries >= the k-th largest of each row, and renormalise.

    ``top_k``: an int, or an integer tensor with one value per row; k >= vocab keeps all.
    Rows whose kept sum is not finite and positive (a NaN or inf entry, or all zeros)
    raise ``ValueError`` naming them, or become uniform with ``on_invalid="uniform"``.
    """
    _check_probs(probs, on_invalid, "top_k_renorm_probs")
    vocab = probs.shape[1]
    k = _scalar_or_rows(top_k, probs.shape[0], "top_k", integer=True)
    if _bad(k, _below_one):
        raise ValueError(f"top_k must be >= 1 (a value >= the vocabulary {vocab} keeps all), got {_show(k, _below_one)}")
    if isinstance(k, int):
        k = min(k, vocab)
        pick = None if k == vocab else (lambda chunk, lo: _kth_largest(chunk, k))
    else:
        k = k.clamp(max=vocab)
        k_max = int(k.max())

        def pick(chunk: torch.Tensor, lo: int) -> torch.Tensor:
            values = torch.topk(chunk, k_max, dim=-1).values
            return values.gather(1, k[lo:lo + chunk.shape[0]].unsqueeze(1) - 1).squeeze(1)

    return _keep_and_renormalise(probs, pick, on_invalid, "top_k_renorm_probs", top_k)


def top_p_renorm_probs(probs: torch.Tensor, top_p, on_invalid: str = "raise") -> torch.Tensor:
    """Keep the smallest tie-closed set of largest entries whose mass reaches top_p.

    Equivalently: keep the entries > low, where low is the largest value with
    sum(p > low) >= top_p, so entries tied at the boundary all survive.
    ``top_p``: a float or a tensor with one value per row, in (0, 1]; p >= 1 keeps all.
    Invalid rows are handled as in :func:`top_k_renorm_probs`.
    """
    _check_probs(probs, on_invalid, "top_p_renorm_probs")
    p = _scalar_or_rows(top_p, probs.shape[0], "top_p", integer=False)
    if _bad(p, _not_positive):
        raise ValueError(f"top_p must be in (0, 1] (1 keeps all), got {_show(p, _not_positive)}")
    if isinstance(p, float) and p >= 1:
        pick = None
    else:
        def pick(chunk: torch.Tensor, lo: int) -> torch.Tensor:
            ordered = torch.sort(chunk, dim=-1, descending=True).values
            mass = ordered.to(torch.float64).cumsum_(dim=-1)
            if isinstance(p, float):
                target = mass.new_full((chunk.shape[0], 1), p)
            else:
                target = p[lo:lo + chunk.shape[0]].to(torch.float64).unsqueeze(1)
            first = torch.searchsorted(mass, target).clamp(max=chunk.shape[1] - 1)
            pivot = ordered.gather(1, first).squeeze(1)
            reached = mass.gather(1, first).squeeze(1) >= target.squeeze(1)
            return torch.where(reached & (target.squeeze(1) < 1), pivot, 0.0)  # 0 keeps all

    return _keep_and_renormalise(probs, pick, on_invalid, "top_p_renorm_probs", top_p)


def _keep_and_renormalise(probs, pick, on_invalid, name, arg):
    """Zero entries below each row's pivot (``pick`` gives them; None keeps all) and renormalise."""
    rows, vocab = probs.shape
    pivot, kept_sum = _pivots_and_kept_sums(probs, pick)
    bad = ~(torch.isfinite(kept_sum) & (kept_sum > 0))
    if bool(bad.any()):
        rows_bad = bad.nonzero().flatten().tolist()
        if on_invalid == "raise":
            shown = rows_bad[:10] + (["..."] if len(rows_bad) > 10 else [])
            raise ValueError(
                f"{name}: rows {shown} are NaN/inf or all zero, so they hold no distribution; "
                "fix the logits upstream, or pass on_invalid='uniform' to make those rows uniform"
            )
        cleaned = torch.where(bad.unsqueeze(1), 1.0, probs)
        if name == "top_k_renorm_probs":
            return top_k_renorm_probs(cleaned, arg, on_invalid="raise")
        return top_p_renorm_probs(cleaned, arg, on_invalid="raise")
    kept = probs.clone() if pick is None else torch.where(probs >= pivot.unsqueeze(1), probs, 0.0)
    return kept.div_(kept_sum.clamp(min=KEPT_SUM_FLOOR).to(kept.dtype).unsqueeze(1))


def _pivots_and_kept_sums(probs: torch.Tensor, pick):
    """Per-row pivot and the float64 running sum of the entries >= it, a few rows at a time."""
    rows, vocab = probs.shape
    step = pivot_chunk_rows(vocab)
    pivots, sums = [], []
    for lo in range(0, rows, step):
        chunk = probs[lo:lo + step]
        pivot = chunk.new_zeros(chunk.shape[0]) if pick is None else pick(chunk, lo)
        kept = chunk.to(torch.float64)
        if pick is not None:
            kept.masked_fill_(chunk < pivot.unsqueeze(1), 0.0)
        pivots.append(pivot)
        sums.append(kept.cumsum_(dim=-1)[:, -1].clone())
        del kept
    if len(pivots) == 1:
        return pivots[0], sums[0]
    return torch.cat(pivots), torch.cat(sums)


def _kth_largest(chunk: torch.Tensor, k: int) -> torch.Tensor:
    return torch.topk(chunk, k, dim=-1).values[:, -1]


def _check_probs(probs, on_invalid: str, name: str) -> None:
    if on_invalid not in INVALID_MODES:
        raise ValueError(f"on_invalid must be one of {INVALID_MODES}, got {on_invalid!r}")
    if not isinstance(probs, torch.Tensor) or probs.dim() != 2 or not probs.is_floating_point():
        raise ValueError(
            f"{name} expects a 2-D floating tensor [rows, vocab] of probabilities, got "
            f"{tuple(probs.shape) if isinstance(probs, torch.Tensor) else type(probs).__name__}; "
            "reshape to (-1, vocab) first"
        )
    if probs.shape[1] == 0:
        raise ValueError(f"{name}: the vocabulary dimension is empty")


def _scalar_or_rows(value, rows: int, name: str, integer: bool):
    """A python number stays a number; a tensor must hold one value per row."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            value = value.item()
        elif value.numel() != rows:
            raise ValueError(
                f"{name} must be a number or hold one value per row ({rows}), got shape {tuple(value.shape)}"
            )
        elif integer and value.is_floating_point():
            raise ValueError(f"{name} must hold integers, got dtype {value.dtype}")
        else:
            return value.reshape(rows).long() if integer else value.reshape(rows).float()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number or a tensor, got {type(value).__name__}")
    if integer:
        if isinstance(value, float) and not value.is_integer():
            raise ValueError(f"{name} must be an integer, got {value}")
        return int(value)
    return float(value)


def _bad(value, is_bad) -> bool:
    """Whether a number, or any entry of a per-row tensor, fails a check."""
    result = is_bad(value)
    return bool(result.any()) if isinstance(result, torch.Tensor) else bool(result)


def _show(value, is_bad) -> str:
    if isinstance(value, torch.Tensor):
        return f"rows {is_bad(value).nonzero().flatten().tolist()[:10]}"
    return repr(value)


def _below_one(v):
    return v < 1


def _not_positive(v):
    return ~(v > 0) if isinstance(v, torch.Tensor) else not v > 0  # NaN counts as not positive
