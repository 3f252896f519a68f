"""The standalone top-k / top-p renorm on the GPU: probabilities in, probabilities out, without a sort.

:func:`top_k_renorm` and :func:`top_p_renorm` give the values of
:func:`graphborrow.eagle.renorm.top_k_renorm_probs` / ``top_p_renorm_probs``, bit for bit,
by the sort-free pivot search of :mod:`.pivot_search` followed by one apply kernel: nine
launches through Triton's launcher. An eager call reuses its configuration's workspace for
the current stream (:class:`~graphborrow.eagle.triton.launch_config.RenormConfig`; the
search leaves its counters at zero) and fills the parameter slots only when the number
differs from the last call's, so it allocates its output alone.
"""

from __future__ import annotations

from functools import partial

import torch

from . import launch_config as lc
from .launch_config import RENORM_CONFIGS, Workspace
from .runtime import INTERPRETED, TRITON_AVAILABLE, capturing_now

if TRITON_AVAILABLE:
    from .pivot_search import apply_kernel, gather_kernel, init_kernel, kept_kernel, pass_kernel, resolve_kernel

__all__ = ["top_k_renorm", "top_p_renorm"]

INT32_MAX = 2**31 - 1  # the kernels read top-k as int32


def top_k_renorm(probs: torch.Tensor, top_k, validate: bool = True) -> torch.Tensor:
    """Keep each row's entries >= its k-th largest (ties kept), divided by their float64 sum.

    Same values as :func:`graphborrow.eagle.renorm.top_k_renorm_probs`, found without a sort.

    Args:
        probs: [rows, V] float32 probabilities, contiguous.
        top_k: a number or one value per row (>= 1).
        validate: check values on the host (syncs); False for graph capture.

    Returns:
        A new [rows, V] float32 tensor.

    Raises:
        ValueError: a bad argument, named.
    """
    return _renorm(probs, top_k, None, validate)


def top_p_renorm(probs: torch.Tensor, top_p, validate: bool = True) -> torch.Tensor:
    """Keep each row's smallest tie-closed set of largest entries reaching top_p, renormalised.

    Same values as :func:`graphborrow.eagle.renorm.top_p_renorm_probs`, found without a sort.

    Args:
        probs: [rows, V] float32 probabilities, contiguous.
        top_p: a number or one value per row, in (0, 1].
        validate: check values on the host (syncs); False for graph capture.

    Returns:
        A new [rows, V] float32 tensor.

    Raises:
        ValueError: a bad argument, named.
    """
    return _renorm(probs, None, top_p, validate)


def _tails(config, w: Workspace) -> list:
    """The renorm's nine launches for workspace ``w``, ``(launch, tail)`` each: the search's
    (per top-k / top-p: bracket, passes, gather, resolve, kept sums) called as
    ``launch(probs, *tail)``, the apply kernel's (the last) as ``launch(probs, pivots, out, *tail)``.

    The search's ``top_p`` slot is float32 as the reference takes it (and torch and flashinfer
    do), widened to float64 to compare with the kept mass: a float64 top_p would move the
    pivot of any row whose kept mass lies in [float32(top_p), top_p).
    """
    v = w.views
    grid, per_row = (config.rows, config.splits, 1), (config.rows, 1, 1)
    tails = []
    for topp, param in ((False, v.top_k if config.has_k else None), (True, v.top_p if config.has_p else None)):
        if param is None:
            continue
        # (the search reads probabilities: the logits' statistics are not read, the pivots stand in)
        args = (v.pivots, v.pivots, v.pivots, param, v.pivots, v.state_i, v.state_f, v.part_w, v.part_c, v.scratch,
                v.select_counters, 1, config.vocab, config.splits, config.chunk, 1.0, False, topp, config.has_k,
                lc.SELECT_THRESHOLDS, lc.SELECT_CAP, lc.SELECT_BLOCK, lc.BLOCK, lc.SPLIT_MAX, not INTERPRETED)
        kernels = [(init_kernel, grid)] + [(pass_kernel, grid)] * lc.SELECT_PASSES + [
            (gather_kernel, grid), (resolve_kernel, per_row), (kept_kernel, grid)]
        tails += [(partial(_launch, kernel[g], options=config.search_options), args) for kernel, g in kernels]
    apply = (config.vocab, config.chunk, config.has_k, config.has_p, lc.BLOCK)
    return tails + [(partial(_launch, apply_kernel[grid], options=config.apply_options), apply)]


def _launch(launch, *args, options: dict):
    """``launch(*args)`` (a kernel with its grid) with its compile options."""
    return launch(*args, **options)


def _renorm(probs, top_k, top_p, validate):
    """Checks, then the search and the apply kernel into a new tensor."""
    if not isinstance(probs, torch.Tensor) or probs.dim() != 2 or probs.dtype != torch.float32:
        raise ValueError("probs must be a float32 tensor [rows, vocab]; convert with .float() and reshape first")
    if not probs.is_contiguous():
        raise ValueError("probs must be contiguous; call .contiguous() first")
    if not TRITON_AVAILABLE:
        raise RuntimeError("top_k_renorm / top_p_renorm need triton (the 'kernels' extra)")
    rows, vocab = probs.shape
    k = None if top_k is None else _per_row(top_k, rows, "top_k", torch.int32)
    p = None if top_p is None else _per_row(top_p, rows, "top_p", torch.float32)
    if validate:
        if k is not None and (_any((k < 1) | (k > INT32_MAX)) if isinstance(k, torch.Tensor) else k < 1):
            raise ValueError(f"top_k must be >= 1 and < 2**31 (a value >= the vocabulary {vocab} keeps all)")
        if p is not None and (_any(~(p > 0) | (p > 1)) if isinstance(p, torch.Tensor) else not 0 < p <= 1):
            raise ValueError("top_p must be in (0, 1] (1 keeps all)")
        if _any(~torch.isfinite(probs)) or _any(probs < 0):
            raise ValueError("probs must be finite and >= 0")
    device = probs.get_device()
    config = RENORM_CONFIGS.get((rows, vocab, k is not None, p is not None, device, lc.tunables()),
                                rows, vocab, k is not None, p is not None, device)
    if probs.is_cuda and capturing_now():  # a fresh workspace, its counters zeroed, inside the graph
        w = config.fresh_workspace(probs)
        w.views.select_counters.zero_()
    else:
        w = config.workspace(probs)
    for i, (name, value) in enumerate((("top_k", k), ("top_p", p))):
        if isinstance(value, torch.Tensor):
            getattr(w.views, name).copy_(value.reshape(-1).expand(rows))
            w.numbers[i] = None
        elif value is not None and w.numbers[i] != value:
            getattr(w.views, name).fill_(value)
            w.numbers[i] = value
    out = torch.empty_like(probs)
    tails = w.tails
    if tails is None:
        tails = w.tails = _tails(config, w)
    *search, (apply, rest) = tails
    for launch, tail in search:
        launch(probs, *tail)
    apply(probs, w.views.pivots, out, *rest)
    return out


def _per_row(value, n, name, dtype):
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
        return min(int(value), INT32_MAX)
    return float(value)


def _any(mask: torch.Tensor) -> bool:
    """``mask.any()`` on the host (a synchronisation: for validation only)."""
    return bool(mask.any())
