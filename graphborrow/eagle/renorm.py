"""Top-k / top-p renormalisation of probability rows, with flashinfer's semantics.

Both functions keep every entry at or above a per-row pivot (so ties at the pivot
survive and more than k entries can remain), zero the rest and divide by the kept
sum floored at 1e-8. k >= vocab or p >= 1 keeps everything and only renormalises.

Pivots are found by bisection over the bit patterns of the (non-negative) values: for
top-k the largest pattern with at least k entries at or above it (the k-th largest
value, exactly), for top-p the largest with a kept float64 mass of at least p. That
takes only elementwise ops and row sums, so:

- a row's result does not depend on which other rows share the call (the EAGLE
  verification modes group rows differently and rely on that to emit identical tokens);
- the memory a call takes depends on the shape alone, never on k, p or the values, and
  every temporary is an op's visible output (no sort or top-k workspace hidden inside a
  library call), which is what lets the capacity planner record it exactly;
- nothing reads a value on the host unless invalid rows are checked (``on_invalid``).

Memory: besides the output, a call holds the pivot search's workspace for a few rows
at a time (a mask and a masked copy, allocated once and reused by every pass: at most
about ``PIVOT_CHUNK_BYTES``; see :func:`pivot_chunk_rows`), then one mask of the
input's size while keeping entries.
"""

from __future__ import annotations

import torch

__all__ = [
    "INVALID_MODES",
    "KEPT_SUM_FLOOR",
    "PIVOT_BYTES_PER_ENTRY",
    "PIVOT_CHUNK_BYTES",
    "pivot_chunk_rows",
    "top_k_renorm_probs",
    "top_p_renorm_probs",
]

KEPT_SUM_FLOOR = 1e-8
PIVOT_CHUNK_BYTES = 64 << 20
# Bytes per entry the pivot search of one chunk holds at once: a comparison mask (1 B)
# and the masked values it sums (the input's width, at most 8 B).
PIVOT_BYTES_PER_ENTRY = 9
# "raise": name invalid rows (reads values on the host); "uniform": make them uniform;
# "unchecked": do not look (no host read; for inputs already validated, e.g. in a CUDA graph).
INVALID_MODES = ("raise", "uniform", "unchecked")
_BITS = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32, torch.float64: torch.int64}


def pivot_chunk_rows(vocab: int) -> int:
    """How many rows share one pivot search (bounds its workspace).

    Args:
        vocab: entries per row.

    Returns:
        Rows per search, at least 1, so the search's workspace stays near
        ``PIVOT_CHUNK_BYTES`` whatever the vocabulary.
    """
    return max(1, PIVOT_CHUNK_BYTES // (PIVOT_BYTES_PER_ENTRY * max(vocab, 1)))


def top_k_renorm_probs(probs: torch.Tensor, top_k, on_invalid: str = "raise") -> torch.Tensor:
    """Keep the entries >= the k-th largest of each row, and renormalise.

    Args:
        probs: [rows, vocab] non-negative probabilities (float16, bfloat16, float32 or float64).
        top_k: an int, or an integer tensor with one value per row; k >= vocab keeps all.
        on_invalid: what to do with rows that hold no distribution (a NaN, inf or negative
            entry, or all zeros): ``"raise"`` a ``ValueError`` naming them, make them
            ``"uniform"``, or leave them ``"unchecked"`` (no host read; garbage in, garbage out).

    Returns:
        A new tensor like ``probs``: kept entries divided by their row's kept sum.
    """
    rows, vocab = _check_probs(probs, on_invalid, "top_k_renorm_probs")
    k = _per_row(top_k, rows, "top_k", integer=True, like=probs)
    if _bad(k, _below_one):
        raise ValueError(f"top_k must be >= 1 (a value >= the vocabulary {vocab} keeps all), got {_show(k, _below_one)}")
    return _keep_and_renormalise(probs, k, _count_reaches, on_invalid, "top_k_renorm_probs")


def top_p_renorm_probs(probs: torch.Tensor, top_p, on_invalid: str = "raise") -> torch.Tensor:
    """Keep the smallest tie-closed set of largest entries whose mass reaches top_p.

    Equivalently: keep the entries > low, where low is the largest value with
    sum(p > low) >= top_p, so entries tied at the boundary all survive.

    Args:
        probs: [rows, vocab] non-negative probabilities.
        top_p: a float or a tensor with one value per row, in (0, 1]; p >= 1 keeps all.
        on_invalid: as in :func:`top_k_renorm_probs`.

    Returns:
        A new tensor like ``probs``, renormalised over the kept entries.
    """
    rows, _ = _check_probs(probs, on_invalid, "top_p_renorm_probs")
    p = _per_row(top_p, rows, "top_p", integer=False, like=probs)
    if _bad(p, _not_positive):
        raise ValueError(f"top_p must be in (0, 1] (1 keeps all), got {_show(p, _not_positive)}")
    return _keep_and_renormalise(probs, p, _mass_reaches, on_invalid, "top_p_renorm_probs")


def renorm_rows(probs: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Top-k then top-p over rows already known to be valid, with per-row tensors (no host read).

    What a verification step calls: its memory depends on the shape alone.
    """
    if top_k is not None:
        probs = _keep_and_renormalise(probs, top_k, _count_reaches, "unchecked", "top_k")
    if top_p is not None:
        probs = _keep_and_renormalise(probs, top_p, _mass_reaches, "unchecked", "top_p")
    return probs


def _keep_and_renormalise(probs, arg, enough, on_invalid, name):
    """Zero entries below each row's pivot and divide by the kept sum."""
    if on_invalid != "unchecked":
        bad = _invalid_rows(probs)
        if bool(bad.any()):
            rows_bad = bad.nonzero().flatten().tolist()
            if on_invalid == "raise":
                raise ValueError(_invalid_message(probs, rows_bad, name))
            probs = torch.where(bad.unsqueeze(1), 1.0, probs)
    if enough is _count_reaches:
        arg = arg.clamp(max=probs.shape[1])  # k >= V keeps all
    pivot, kept_sum = _pivots_and_kept_sums(probs, arg, enough)
    kept = torch.where(probs >= pivot.unsqueeze(1), probs, 0.0)
    return kept.div_(kept_sum.clamp_(min=KEPT_SUM_FLOOR).to(kept.dtype).unsqueeze(1))


class _Workspace:
    """The pivot search's buffers for up to ``rows`` rows, reused by every pass and chunk."""

    def __init__(self, probs: torch.Tensor, rows: int) -> None:
        vocab = probs.shape[1]
        bits = _BITS[probs.dtype]
        self.mask = probs.new_empty((rows, vocab), dtype=torch.bool)  # entries at or above a trial
        self.masked = probs.new_empty((rows, vocab))                   # their values, zeros elsewhere
        self.trial = probs.new_empty(rows, dtype=bits)
        self.count = probs.new_empty(rows, dtype=torch.long)
        self.mass = probs.new_empty(rows, dtype=torch.float64)
        self.ok = probs.new_empty(rows, dtype=torch.bool)

    def rows(self, n: int) -> "_Workspace":
        view = object.__new__(_Workspace)
        for name, t in vars(self).items():
            setattr(view, name, t[:n])
        return view


def _pivots_and_kept_sums(probs: torch.Tensor, arg: torch.Tensor, enough):
    """Per-row pivot and the float64 sum of the entries >= it, a few rows at a time.

    The pivot is the largest bit pattern t with ``enough`` entries at or above it:
    non-negative floats order like their bit patterns read as integers, so setting bits
    from the top down while ``enough`` still holds finds it exactly.
    """
    rows, vocab = probs.shape
    step = min(pivot_chunk_rows(vocab), rows)
    work = _Workspace(probs, step)
    pivots = probs.new_empty(rows)
    sums = probs.new_empty(rows, dtype=torch.float64)
    for lo in range(0, rows, step):
        hi = min(lo + step, rows)
        chunk, w, target = probs[lo:hi], work.rows(hi - lo), arg[lo:hi]
        bits = chunk.view(_BITS[chunk.dtype])
        found = pivots[lo:hi].view(bits.dtype)
        found.zero_()
        for bit in reversed(range(bits.element_size() * 8 - 1)):
            torch.bitwise_or(found, 1 << bit, out=w.trial)
            torch.ge(bits, w.trial.unsqueeze(1), out=w.mask)
            enough(chunk, target, w)
            torch.where(w.ok, w.trial, found, out=found)
        if enough is _mass_reaches:
            pivots[lo:hi].masked_fill_(target >= 1, 0.0)  # p >= 1 keeps all
        torch.ge(chunk, pivots[lo:hi].unsqueeze(1), out=w.mask)
        torch.mul(chunk, w.mask, out=w.masked)
        torch.sum(w.masked, 1, dtype=torch.float64, out=sums[lo:hi])
    return pivots, sums


def _count_reaches(chunk, k, w) -> None:
    """At least k entries at or above the trial."""
    torch.sum(w.mask, 1, out=w.count)
    torch.ge(w.count, k, out=w.ok)


def _mass_reaches(chunk, p, w) -> None:
    """The entries at or above the trial hold a float64 mass of at least p."""
    torch.mul(chunk, w.mask, out=w.masked)
    torch.sum(w.masked, 1, dtype=torch.float64, out=w.mass)
    torch.ge(w.mass, p, out=w.ok)


def _invalid_rows(probs: torch.Tensor) -> torch.Tensor:
    """Rows holding a NaN, an inf or a negative entry, or nothing but zeros."""
    low, high = probs.amin(dim=1), probs.amax(dim=1)  # both NaN when the row holds one
    return ~((low >= 0) & torch.isfinite(high) & (high > 0))


def _invalid_message(probs: torch.Tensor, rows_bad: list, name: str) -> str:
    shown = rows_bad[:10] + (["..."] if len(rows_bad) > 10 else [])
    negative = (probs[rows_bad].amin(dim=1) < 0).nonzero().flatten().tolist()
    if negative:
        negative_rows = [rows_bad[i] for i in negative][:10]
        return (
            f"{name}: rows {negative_rows} hold negative values, so they are not probabilities "
            "(logits? apply torch.softmax first); invalid rows in all: "
            f"{shown}; or pass on_invalid='uniform' to make invalid rows uniform"
        )
    return (
        f"{name}: rows {shown} are NaN/inf or all zero, so they hold no distribution; "
        "fix the logits upstream, or pass on_invalid='uniform' to make those rows uniform"
    )


def _check_probs(probs, on_invalid: str, name: str) -> tuple[int, int]:
    if on_invalid not in INVALID_MODES:
        raise ValueError(f"on_invalid must be one of {INVALID_MODES}, got {on_invalid!r}")
    if not isinstance(probs, torch.Tensor) or probs.dim() != 2 or probs.dtype not in _BITS:
        raise ValueError(
            f"{name} expects a 2-D floating tensor [rows, vocab] of probabilities, got "
            f"{tuple(probs.shape) if isinstance(probs, torch.Tensor) else type(probs).__name__}"
            f"{' of ' + str(probs.dtype) if isinstance(probs, torch.Tensor) else ''}; reshape to (-1, vocab) first"
        )
    if probs.shape[1] == 0:
        raise ValueError(f"{name}: the vocabulary dimension is empty")
    return probs.shape


def _per_row(value, rows: int, name: str, integer: bool, like: torch.Tensor) -> torch.Tensor:
    """A number or a tensor of one value per row, as a per-row tensor next to ``like``."""
    dtype = torch.long if integer else torch.float32
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            value = value.reshape(1).expand(rows)
        elif value.numel() != rows:
            raise ValueError(
                f"{name} must be a number or hold one value per row ({rows}), got shape {tuple(value.shape)}"
            )
        if integer and value.is_floating_point():
            raise ValueError(f"{name} must hold integers, got dtype {value.dtype}")
        return like.new_empty(rows, dtype=dtype).copy_(value.reshape(rows))
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number or a tensor, got {type(value).__name__}")
    if integer and isinstance(value, float) and not value.is_integer():
        raise ValueError(f"{name} must be an integer, got {value}")
    return like.new_full((rows,), value, dtype=dtype)


def _bad(value: torch.Tensor, is_bad) -> bool:
    return bool(is_bad(value).any())


def _show(value: torch.Tensor, is_bad) -> str:
    bad = is_bad(value).nonzero().flatten()
    if value.numel() == 1 or bool((value == value[0]).all()):
        return repr(value[0].item())
    return f"rows {bad.tolist()[:10]}"


def _below_one(v):
    return v < 1


def _not_positive(v):
    return ~(v > 0)  # NaN counts as not positive
