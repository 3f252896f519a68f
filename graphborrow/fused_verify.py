"""EAGLE verification at kernel speed: Triton kernels that read the logits directly.

:func:`fused_verify` is :func:`graphborrow.eagle.eagle_verify` (mode ``"standard"``)
without the [bs*D, V] probability matrices. Three kernels do the step:

1. ``_row_stats_kernel`` — for every row, over slices of the vocabulary in parallel, the
   maximum of ``logits / temperature`` and the sum of ``exp(y - max)`` of the slice;
2. ``_renorm_params_kernel`` (only with top-k / top-p) — per row, the top-k and top-p
   pivots and kept sums, found by a k-ary search over the logits' order (no sort), the
   last few hundred candidates sorted exactly;
3. ``_walk_kernel`` — one program per request walks its draft tree, computing the
   probability of each tried candidate on the fly from its logit and its row's
   statistics, then samples the final token from the residual of the last row.

Every probability is the reference's float32 value by construction: the same
``y = x / t`` (IEEE division), ``exp(y - max)`` (the CUDA math library's expf, no flush
to zero, no fused multiply-add) and ``/ sum``. Only the softmax sum is computed in
another order than ``torch.softmax`` (it is accumulated in float64, then rounded), so it
can differ by an ulp or two; a decision flips only when a coin falls within that ulp
of an acceptance boundary. Top-k / top-p masses are float64 sums like the reference's.

Nothing synchronises with the host when ``validate=False``: the step can be captured in
a CUDA graph. Temporaries (all small, none of vocabulary width) are allocated by
:func:`fused_workspace`, which also runs on the simulated device (``launch=False`` on
:func:`fused_verify` allocates them without launching anything), so the capacity
planner can record the fused step's allocation sequence. Without CUDA the kernels run
in Triton's interpreter (set at import when no GPU is present): slow, for tests only.
"""

from __future__ import annotations

import contextlib
import math
import os
from typing import NamedTuple

import torch

if not torch.cuda.is_available():  # run the kernels on CPU tensors with numpy
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # the workspace (and the simulated device) still work
    triton = None

from .draft_tree import DraftTree

__all__ = [
    "FusedResult",
    "FusedWorkspace",
    "TRITON_AVAILABLE",
    "fused_verify",
    "fused_workspace",
    "fused_workspace_bytes",
    "fused_token_probs",
    "top_k_renorm",
    "top_p_renorm",
    "split_count",
]

TRITON_AVAILABLE = triton is not None
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


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


if TRITON_AVAILABLE and INTERPRETED:
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(tl.max, InterpretedFunction):
        raise RuntimeError("triton.language was imported before TRITON_INTERPRET=1 was set, so its library "
                           "functions cannot run in the interpreter; set TRITON_INTERPRET=1 in the environment "
                           "(or import graphborrow.fused_verify before triton)")
    _patch_interpreter_scalars()
BORROW_USER = "EAGLE verify"

BLOCK = 1024          # vocabulary entries per tile
SPLIT_MAX = 64        # most vocabulary slices per row in the statistics kernel
SELECT_CAP = 1024     # candidates sorted exactly once the pivot search has narrowed to them
SELECT_THRESHOLDS = 8  # thresholds tried per pass of the pivot search
SELECT_MAX_PASSES = 24
TARGET_PROGRAMS = 528  # about four per H200 SM: enough slices to fill the GPU at small batches
KEPT_SUM_FLOOR = 1e-8
NUM_WARPS = 8


class FusedResult(NamedTuple):
    """``predicts`` [bs*D] int32, ``accept_index`` [bs, S] int32 (-1 past the path),
    ``accept_length`` [bs] int32 (accepted drafts + 1): as :class:`eagle.VerifyResult`."""

    predicts: torch.Tensor
    accept_index: torch.Tensor
    accept_length: torch.Tensor


class FusedWorkspace(NamedTuple):
    """Every temporary of one fused step (outputs excluded), in allocation order.

    ``temps`` [bs] float32, ``top_k`` [bs] int32 or None, ``top_p`` [bs] float64 or None;
    per chunk of ``chunk_requests`` requests: ``part_max`` [rows, splits] float32,
    ``part_sum`` [rows, splits] float64, and with renorm ``params`` [rows, 4] float32 and
    ``scratch`` [rows, SELECT_CAP] int32 (rows = chunk_requests * D).
    """

    temps: torch.Tensor
    top_k: torch.Tensor | None
    top_p: torch.Tensor | None
    part_max: torch.Tensor
    part_sum: torch.Tensor
    params: torch.Tensor | None
    scratch: torch.Tensor | None
    splits: int
    chunk_requests: int


def split_count(rows: int, vocab: int) -> int:
    """Vocabulary slices per row for the statistics kernel: enough programs to fill the GPU."""
    tiles = max(1, -(-vocab // BLOCK))
    want = max(1, -(-TARGET_PROGRAMS // max(rows, 1)))
    return int(min(SPLIT_MAX, tiles, want))


def fused_workspace(like: torch.Tensor, bs: int, d: int, vocab: int, temperatures=1.0, top_ks=None,
                    top_ps=None, chunk_requests: int | None = None) -> FusedWorkspace:
    """Allocate (and fill the per-request values of) every temporary of a fused step.

    Runs on any device, the layout-only simulated one included: this is the fused path's
    allocation sequence. ``like`` gives the device (usually the logits).

    Returns:
        a :class:`FusedWorkspace`; the per-chunk tensors are reused by every chunk.
    """
    per = bs if chunk_requests is None else max(1, min(int(chunk_requests), bs))
    rows = per * d
    splits = split_count(rows, vocab)
    temps = _per_request(temperatures, bs, "temperatures", like, torch.float32)
    top_k = None if top_ks is None else _per_request(top_ks, bs, "top_ks", like, torch.int32)
    top_p = None if top_ps is None else _per_request(top_ps, bs, "top_ps", like, torch.float64)
    part_max = like.new_empty((rows, splits), dtype=torch.float32)
    part_sum = like.new_empty((rows, splits), dtype=torch.float64)
    renorm = top_k is not None or top_p is not None
    params = like.new_empty((rows, 4), dtype=torch.float32) if renorm else None
    scratch = like.new_empty((rows, SELECT_CAP), dtype=torch.int32) if renorm else None
    return FusedWorkspace(temps, top_k, top_p, part_max, part_sum, params, scratch, splits, per)


def fused_workspace_bytes(bs: int, d: int, vocab: int, top_k: bool = False, top_p: bool = False,
                          chunk_requests: int | None = None) -> int:
    """Requested bytes of :func:`fused_workspace` (before allocator rounding): it grows
    with bs * D, never with bs * D * V."""
    per = bs if chunk_requests is None else max(1, min(chunk_requests, bs))
    rows = per * d
    splits = split_count(rows, vocab)
    total = 4 * bs + (4 * bs if top_k else 0) + (8 * bs if top_p else 0) + 12 * rows * splits
    if top_k or top_p:
        total += rows * (16 + 4 * SELECT_CAP)
    return total


def fused_verify(
    logits: torch.Tensor,
    candidates: torch.Tensor | None,
    tree: DraftTree,
    temperatures,
    top_ks=None,
    top_ps=None,
    coins: torch.Tensor | None = None,
    coins_final: torch.Tensor | None = None,
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
    out: tuple | None = None,
    validate: bool = True,
    generator: torch.Generator | None = None,
    borrow=None,
    chunk_requests: int | None = None,
    launch: bool = True,
) -> FusedResult:
    """Non-greedy EAGLE verification of ``tree`` against ``logits`` [bs*D, V], fused.

    Arguments mean what they mean for :func:`graphborrow.eagle.eagle_verify`; the same
    coins give the same tokens (see the module docstring for the one rounding caveat).

    Args:
        out: optional ``(predicts, accept_index, accept_length)`` to write into (static
            buffers for graph capture); predicts is zeroed, accept_index refilled.
        validate: check values on the host (syncs). ``False`` skips every such check, so
            the step can be captured in a CUDA graph; shapes and dtypes are still checked.
        generator: draws missing coins (as eagle_verify does).
        borrow: a borrow state; when enabled, every temporary lives in its borrow scope.
        chunk_requests: verify this many requests at a time (temporaries sized to one chunk).
        launch: ``False`` allocates the workspace and outputs and returns without running a
            kernel — the allocation sequence, for the capacity planner and the simulated device.

    Returns:
        a :class:`FusedResult` (predicts, accept_index, accept_length).
    """
    candidates = tree.candidates if candidates is None else candidates
    bs, d, vocab = _check_shapes(logits, candidates, tree, coins, coins_final, out)
    thr_single, thr_acc = _check_thresholds(threshold_single, threshold_acc)
    steps = int(tree.tree_depth)
    if steps < 1:
        raise ValueError(f"tree.tree_depth must be >= 1, got {steps}")
    if chunk_requests is not None and (isinstance(chunk_requests, bool) or not isinstance(chunk_requests, int)
                                       or chunk_requests < 1):
        raise ValueError(f"chunk_requests must be a positive int (requests per chunk), got {chunk_requests!r}")
    if validate:
        _check_values(logits, candidates, tree, temperatures, top_ks, top_ps, coins, coins_final)
    if launch and not TRITON_AVAILABLE:
        raise RuntimeError("fused_verify needs triton (pip install triton, or the 'kernels' extra); "
                           "launch=False records the allocations without it")
    if launch and logits.device.type not in ("cuda", "cpu"):
        raise ValueError(f"fused_verify launches on CUDA (or CPU tensors in Triton's interpreter), "
                         f"got {logits.device}; pass launch=False to record allocations only")
    if launch and logits.device.type == "cpu" and not INTERPRETED:
        raise RuntimeError("CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1 before importing "
                           "graphborrow.fused_verify")

    if out is None:
        predicts = candidates.new_zeros(bs * d, dtype=torch.int32)
        accept_index = candidates.new_full((bs, steps), -1, dtype=torch.int32)
        accept_length = candidates.new_zeros(bs, dtype=torch.int32)
    else:
        predicts, accept_index, accept_length = out
        predicts.zero_()

    borrowing = borrow is not None and bool(borrow.enabled)
    scope = borrow.borrow(BORROW_USER) if borrowing else contextlib.nullcontext()
    with scope:
        coins = _draw(coins, (bs, d), generator, logits)
        coins_final = _draw(coins_final, (bs,), generator, logits)
        ws = fused_workspace(logits, bs, d, vocab, temperatures, top_ks, top_ps, chunk_requests)
        if launch:
            for lo in range(0, bs, ws.chunk_requests):
                n = min(ws.chunk_requests, bs - lo)
                _launch_chunk(logits, candidates, tree, coins, coins_final, ws, lo, n, d, vocab, steps,
                              thr_single, thr_acc, predicts, accept_index, accept_length)
        del ws, coins, coins_final
    return FusedResult(predicts, accept_index, accept_length)


def _launch_chunk(logits, candidates, tree, coins, coins_final, ws, lo, n, d, vocab, steps, thr_single,
                  thr_acc, predicts, accept_index, accept_length) -> None:
    rows = n * d
    splits = ws.splits
    chunk = -(-(-(-vocab // splits)) // BLOCK) * BLOCK
    opts = _compile_options()
    _row_stats_kernel[(rows, splits)](
        logits, ws.temps, ws.part_max, ws.part_sum, lo * d, d, vocab, splits, chunk,
        BLOCK=BLOCK, PRECISE=not INTERPRETED, **opts)
    has_k, has_p = ws.top_k is not None, ws.top_p is not None
    params = ws.params if ws.params is not None else ws.part_max  # unused placeholder pointer
    if has_k or has_p:
        _renorm_params_kernel[(rows,)](
            logits, ws.temps, ws.part_max, ws.part_sum,
            ws.top_k if has_k else ws.temps, ws.top_p if has_p else ws.temps,
            ws.params, ws.scratch, lo * d, d, vocab, splits,
            FROM_LOGITS=True, HAS_TOPK=has_k, HAS_TOPP=has_p, BLOCK=BLOCK, SPLIT_BLOCK=SPLIT_MAX,
            CAP=SELECT_CAP, NT=SELECT_THRESHOLDS, MAX_PASSES=SELECT_MAX_PASSES, PRECISE=not INTERPRETED,
            num_warps=NUM_WARPS, **opts)
    _walk_kernel[(n,)](
        logits, ws.temps, ws.part_max, ws.part_sum, params,
        candidates, tree.retrive_index, tree.retrive_next_token, tree.retrive_next_sibling,
        coins, coins_final, predicts, accept_index, accept_length,
        lo, d, vocab, steps, splits, thr_single, thr_acc,
        HAS_TOPK=has_k, HAS_TOPP=has_p, BLOCK=BLOCK, SPLIT_BLOCK=SPLIT_MAX, PRECISE=not INTERPRETED,
        num_warps=NUM_WARPS, **opts)


def fused_token_probs(logits: torch.Tensor, temperatures, d: int, tokens: torch.Tensor) -> torch.Tensor:
    """The fused path's softmax(logits / t) at ``tokens`` [rows, K] (int64), per row.

    For diagnosis: compare with ``torch.softmax`` bitwise to see how often the two sums
    round differently (see the module docstring). ``temperatures``: per request (rows / d).
    """
    rows, vocab = logits.shape
    if tokens.dim() != 2 or tokens.shape[0] != rows or tokens.dtype != torch.int64:
        raise ValueError(f"tokens must be int64 [rows={rows}, K]")
    ws = fused_workspace(logits, rows // d, d, vocab, temperatures)
    chunk = -(-(-(-vocab // ws.splits)) // BLOCK) * BLOCK
    opts = _compile_options()
    _row_stats_kernel[(rows, ws.splits)](logits, ws.temps, ws.part_max, ws.part_sum, 0, d, vocab, ws.splits, chunk,
                                         BLOCK=BLOCK, PRECISE=not INTERPRETED, **opts)
    tokens = tokens.contiguous()
    out = logits.new_empty(tokens.shape, dtype=torch.float32)
    _token_prob_kernel[(rows,)](logits, ws.temps, ws.part_max, ws.part_sum, tokens, out, d, vocab, ws.splits,
                                tokens.shape[1], SPLIT_BLOCK=SPLIT_MAX, PRECISE=not INTERPRETED, **opts)
    return out


# ---------------------------------------------------------------------------------
# Standalone renorm (probabilities in, probabilities out), for benchmarks and reuse


def top_k_renorm(probs: torch.Tensor, top_k, validate: bool = True) -> torch.Tensor:
    """Keep each row's entries >= its k-th largest (ties kept), divided by their float64 sum.

    Same values as :func:`graphborrow.renorm.top_k_renorm_probs`, found without a sort.
    """
    return _renorm(probs, top_k, None, validate)


def top_p_renorm(probs: torch.Tensor, top_p, validate: bool = True) -> torch.Tensor:
    """Keep each row's smallest tie-closed set of largest entries reaching top_p, renormalised.

    Same values as :func:`graphborrow.renorm.top_p_renorm_probs`, found without a sort.
    """
    return _renorm(probs, None, top_p, validate)


def _renorm(probs, top_k, top_p, validate):
    if not isinstance(probs, torch.Tensor) or probs.dim() != 2 or probs.dtype != torch.float32:
        raise ValueError("probs must be a float32 tensor [rows, vocab]; convert with .float() and reshape first")
    if not probs.is_contiguous():
        raise ValueError("probs must be contiguous; call .contiguous() first")
    if not TRITON_AVAILABLE:
        raise RuntimeError("top_k_renorm / top_p_renorm need triton (the 'kernels' extra)")
    rows, vocab = probs.shape
    if validate:
        if top_k is not None and _any(_per_request(top_k, rows, "top_k", probs, torch.int64) < 1):
            raise ValueError(f"top_k must be >= 1 (a value >= the vocabulary {vocab} keeps all)")
        if top_p is not None and _any(~(_per_request(top_p, rows, "top_p", probs, torch.float64) > 0)):
            raise ValueError("top_p must be in (0, 1] (1 keeps all)")
        if _any(~torch.isfinite(probs)) or _any(probs < 0):
            raise ValueError("probs must be finite and >= 0")
    ones = probs.new_ones(rows)
    k = None if top_k is None else _per_request(top_k, rows, "top_k", probs, torch.int32)
    p = None if top_p is None else _per_request(top_p, rows, "top_p", probs, torch.float64)
    params = probs.new_empty((rows, 4))
    scratch = probs.new_empty((rows, SELECT_CAP), dtype=torch.int32)
    opts = _compile_options()
    _renorm_params_kernel[(rows,)](
        probs, ones, ones, ones, k if k is not None else ones, p if p is not None else ones,
        params, scratch, 0, 1, vocab, 1,
        FROM_LOGITS=False, HAS_TOPK=k is not None, HAS_TOPP=p is not None, BLOCK=BLOCK,
        SPLIT_BLOCK=SPLIT_MAX, CAP=SELECT_CAP, NT=SELECT_THRESHOLDS, MAX_PASSES=SELECT_MAX_PASSES,
        PRECISE=not INTERPRETED, num_warps=NUM_WARPS, **opts)
    out = torch.empty_like(probs)
    splits = split_count(rows, vocab)
    chunk = -(-(-(-vocab // splits)) // BLOCK) * BLOCK
    _apply_renorm_kernel[(rows, splits)](probs, params, out, vocab, chunk, HAS_TOPK=k is not None,
                                         HAS_TOPP=p is not None, BLOCK=BLOCK, **opts)
    return out


# ---------------------------------------------------------------------------------
# Kernels

if TRITON_AVAILABLE:
    _FLOOR = tl.constexpr(KEPT_SUM_FLOOR)  # jitted code reads only constexpr globals

    @triton.jit
    def _exp(x, PRECISE: tl.constexpr):
        """expf as the CUDA math library computes it (torch's softmax uses it); numpy's in the interpreter."""
        if PRECISE:
            return libdevice.exp(x)
        else:
            return tl.exp(x)

    @triton.jit
    def _exp64(x, PRECISE: tl.constexpr):
        if PRECISE:
            return libdevice.exp(x)
        else:
            return tl.exp(x)

    @triton.jit
    def _key(x):
        """float32 -> int32 whose signed order is the float order (-0 just below +0)."""
        bits = x.to(tl.int32, bitcast=True)
        return bits ^ ((bits >> 31) & 0x7FFFFFFF)

    @triton.jit
    def _unkey(k):
        return (k ^ ((k >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)

    @triton.jit
    def _row_norm(part_max, part_sum, lrow, splits, SPLIT_BLOCK: tl.constexpr, PRECISE: tl.constexpr):
        """(max, sum) of a row's softmax from its slices: sum_c s_c * exp(m_c - max) in float64."""
        c = tl.arange(0, SPLIT_BLOCK)
        m = tl.load(part_max + lrow * splits + c, mask=c < splits, other=float("-inf"))
        s = tl.load(part_sum + lrow * splits + c, mask=c < splits, other=0.0)
        big = tl.max(m, axis=0)
        scale = _exp64(m.to(tl.float64) - big.to(tl.float64), PRECISE)
        total = tl.sum(tl.where(c < splits, s * scale, 0.0), axis=0)
        return big, total.to(tl.float32)

    @triton.jit
    def _prob(x, t, big, total, FROM_LOGITS: tl.constexpr, PRECISE: tl.constexpr):
        """softmax(x / t) entry as torch computes it: exp(x/t - max) / sum, every step rounded."""
        if FROM_LOGITS:
            y = tl.math.div_rn(x.to(tl.float32), t)
            return tl.math.div_rn(_exp(y - big, PRECISE), total)
        else:
            return x.to(tl.float32)

    @triton.jit
    def _renormed(p, pk, sk, pp, sp, HAS_TOPK: tl.constexpr, HAS_TOPP: tl.constexpr):
        """Top-k then top-p renormalisation of probabilities p (pivots and kept sums given)."""
        if HAS_TOPK:
            p = tl.where(p >= pk, tl.math.div_rn(p, sk), 0.0)
        if HAS_TOPP:
            p = tl.where(p >= pp, tl.math.div_rn(p, sp), 0.0)
        return p

    @triton.jit(do_not_specialize=["row0", "d", "vocab", "splits", "chunk"])
    def _row_stats_kernel(logits, temps, part_max, part_sum, row0, d, vocab, splits, chunk,
                          BLOCK: tl.constexpr, PRECISE: tl.constexpr):
        """Slice max of y = x / t and sum of exp(y - slice max) (float64), per (row, slice)."""
        lrow = tl.program_id(0)
        c = tl.program_id(1)
        row = row0 + lrow
        t = tl.load(temps + row // d)
        base = logits + row.to(tl.int64) * vocab
        lo = c * chunk
        hi = lo + chunk
        offs = tl.arange(0, BLOCK)
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        for start in range(lo, hi, BLOCK):
            idx = start + offs
            x = tl.load(base + idx, mask=(idx < hi) & (idx < vocab), other=float("-inf")).to(tl.float32)
            m = tl.maximum(m, tl.math.div_rn(x, t))
        big = tl.max(m, axis=0)
        acc = tl.zeros([BLOCK], tl.float64)
        for start in range(lo, hi, BLOCK):
            idx = start + offs
            x = tl.load(base + idx, mask=(idx < hi) & (idx < vocab), other=float("-inf")).to(tl.float32)
            e = _exp(tl.math.div_rn(x, t) - big, PRECISE)
            acc += tl.where((idx < hi) & (e == e), e, 0.0).to(tl.float64)  # NaN: a slice of -inf only
        tl.store(part_max + lrow * splits + c, big)
        tl.store(part_sum + lrow * splits + c, tl.sum(acc, axis=0))

    @triton.jit
    def _weights_at(src, row, vocab, lo_key, hi_key, use_value, t, big, total, pk, sk,
                    BY_MASS: tl.constexpr, FROM_LOGITS: tl.constexpr, HAS_TOPK: tl.constexpr,
                    BLOCK: tl.constexpr, NT: tl.constexpr, PRECISE: tl.constexpr):
        """One pass: NT thresholds strictly inside (lo_key, hi_key), spread by value or by key,
        and for each the weight (count, or float64 probability mass) and the count of
        entries at or above it."""
        j = tl.arange(0, NT)
        flo = _unkey(lo_key)
        fhi = _unkey(hi_key - 1)
        k_value = _key(flo + (fhi - flo) * ((j + 1).to(tl.float32) / (NT + 1)))
        width = (hi_key - lo_key).to(tl.int64)
        k_span = (lo_key.to(tl.int64) + (width * (j + 1).to(tl.int64)) // (NT + 1)).to(tl.int32)
        thr = tl.where(use_value, k_value, k_span)
        thr = tl.minimum(tl.maximum(thr, lo_key + 1), hi_key - 1)
        base = src + row.to(tl.int64) * vocab
        offs = tl.arange(0, BLOCK)
        w_acc = tl.zeros([NT], tl.float64)
        c_acc = tl.zeros([NT], tl.int32)
        for start in range(0, vocab, BLOCK):
            idx = start + offs
            valid = idx < vocab
            x = tl.load(base + idx, mask=valid, other=0.0).to(tl.float32)
            key = _key(x)
            above = (key[:, None] >= thr[None, :]) & valid[:, None]
            c_acc += tl.sum(above.to(tl.int32), axis=0)
            if BY_MASS:
                q = _renormed(_prob(x, t, big, total, FROM_LOGITS, PRECISE), pk, sk, 0.0, 1.0, HAS_TOPK, False)
                w_acc += tl.sum(tl.where(above, q.to(tl.float64)[:, None], 0.0), axis=0)
        if not BY_MASS:
            w_acc = c_acc.to(tl.float64)
        return thr, w_acc, c_acc

    @triton.jit
    def _select(src, scratch, lrow, row, vocab, target, t, big, total, pk, sk,
                BY_MASS: tl.constexpr, FROM_LOGITS: tl.constexpr, HAS_TOPK: tl.constexpr,
                BLOCK: tl.constexpr, CAP: tl.constexpr, NT: tl.constexpr, MAX_PASSES: tl.constexpr,
                PRECISE: tl.constexpr):
        """The largest present x with W(x) = sum of weights of entries >= x reaching ``target``.

        W is a count (top-k: the k-th largest) or the (renormalised) probability mass
        (top-p); the caller makes sure W(min x) >= target. A k-ary search narrows a key
        bracket [lo, hi) with W(lo) >= target > W(hi), alternating thresholds spread by
        value and by key, until one key is left or at most CAP entries lie inside; those
        are gathered, sorted, and walked down exactly.
        """
        base = src + row.to(tl.int64) * vocab
        offs = tl.arange(0, BLOCK)
        kmin = tl.full([BLOCK], 0x7FFFFFFF, tl.int32)
        kmax = tl.full([BLOCK], -0x7FFFFFFF - 1, tl.int32)
        for start in range(0, vocab, BLOCK):
            idx = start + offs
            key = _key(tl.load(base + idx, mask=idx < vocab, other=0.0).to(tl.float32))
            kmin = tl.minimum(kmin, tl.where(idx < vocab, key, 0x7FFFFFFF))
            kmax = tl.maximum(kmax, tl.where(idx < vocab, key, -0x7FFFFFFF - 1))
        lo = tl.min(kmin, axis=0)
        hi = tl.max(kmax, axis=0) + 1
        w_hi = tl.zeros([], tl.float64)
        c_lo = vocab
        c_hi = 0
        passes = 0
        while (hi.to(tl.int64) - lo > 1) & (c_lo - c_hi > CAP) & (passes < MAX_PASSES):
            flo = _unkey(lo)
            fhi = _unkey(hi - 1)
            finite = (tl.abs(flo) < float("inf")) & (tl.abs(fhi) < float("inf"))
            use_value = ((passes % 2) == 0) & finite
            thr, w, c = _weights_at(src, row, vocab, lo, hi, use_value, t, big, total, pk, sk,
                                    BY_MASS, FROM_LOGITS, HAS_TOPK, BLOCK, NT, PRECISE)
            ok = w >= target
            new_lo = tl.max(tl.where(ok, thr, lo), axis=0)
            new_hi = tl.min(tl.where(ok, hi, thr), axis=0)
            c_lo = tl.where(new_lo == lo, c_lo, tl.max(tl.where(thr == new_lo, c, -1), axis=0))
            c_hi = tl.where(new_hi == hi, c_hi, tl.max(tl.where(thr == new_hi, c, -1), axis=0))
            w_hi = tl.where(new_hi == hi, w_hi, tl.max(tl.where(thr == new_hi, w, -1.0), axis=0))
            lo = new_lo
            hi = new_hi
            passes += 1
        answer = _unkey(lo)
        if hi.to(tl.int64) - lo > 1:  # (int64: a key span can exceed int32)
            # Gather the entries with lo <= key < hi (at most CAP), sort them, walk down.
            out = scratch + lrow.to(tl.int64) * CAP
            cap_offs = tl.arange(0, CAP)
            tl.store(out + cap_offs, tl.full([CAP], -0x7FFFFFFF - 1, tl.int32))
            tl.debug_barrier()
            written = 0
            for start in range(0, vocab, BLOCK):
                idx = start + offs
                key = _key(tl.load(base + idx, mask=idx < vocab, other=0.0).to(tl.float32))
                inside = (key >= lo) & (key < hi) & (idx < vocab)
                pos = written + tl.cumsum(inside.to(tl.int32), axis=0) - 1
                tl.store(out + pos, key, mask=inside & (pos < CAP))
                written += tl.sum(inside.to(tl.int32), axis=0)
            tl.debug_barrier()
            keys = tl.sort(tl.load(out + cap_offs), descending=True)
            n_in = tl.minimum(written, CAP)
            x = _unkey(keys)
            if BY_MASS:
                q = _renormed(_prob(x, t, big, total, FROM_LOGITS, PRECISE), pk, sk, 0.0, 1.0, HAS_TOPK, False)
                wts = tl.where(cap_offs < n_in, q.to(tl.float64), 0.0)
            else:
                wts = tl.where(cap_offs < n_in, 1.0, 0.0).to(tl.float64)
            reach = (w_hi + tl.cumsum(wts, axis=0) >= target) & (cap_offs < n_in)
            first = tl.min(tl.where(reach, cap_offs, CAP), axis=0)
            answer = tl.where(first < CAP, tl.sum(tl.where(cap_offs == first, x, 0.0), axis=0), answer)
        return answer

    @triton.jit
    def _kept_sum(src, row, vocab, pivot, t, big, total, pk, sk, pp, sp,
                  FROM_LOGITS: tl.constexpr, HAS_TOPK: tl.constexpr, HAS_TOPP: tl.constexpr,
                  BLOCK: tl.constexpr, PRECISE: tl.constexpr):
        """float64 sum of the (renormalised-so-far) probabilities >= pivot."""
        base = src + row.to(tl.int64) * vocab
        offs = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], tl.float64)
        for start in range(0, vocab, BLOCK):
            idx = start + offs
            x = tl.load(base + idx, mask=idx < vocab, other=0.0).to(tl.float32)
            q = _renormed(_prob(x, t, big, total, FROM_LOGITS, PRECISE), pk, sk, pp, sp, HAS_TOPK, HAS_TOPP)
            acc += tl.where((idx < vocab) & (q >= pivot), q, 0.0).to(tl.float64)
        return tl.sum(acc, axis=0)

    @triton.jit(do_not_specialize=["row0", "d", "vocab", "splits"])
    def _renorm_params_kernel(src, temps, part_max, part_sum, top_k, top_p, pivots, scratch,
                              row0, d, vocab, splits,
                              FROM_LOGITS: tl.constexpr, HAS_TOPK: tl.constexpr, HAS_TOPP: tl.constexpr,
                              BLOCK: tl.constexpr, SPLIT_BLOCK: tl.constexpr, CAP: tl.constexpr,
                              NT: tl.constexpr, MAX_PASSES: tl.constexpr, PRECISE: tl.constexpr):
        """Per row: top-k pivot and kept sum, then top-p pivot and kept sum (flashinfer order)."""
        lrow = tl.program_id(0)
        row = row0 + lrow
        req = row // d
        t = 1.0
        big = 0.0
        total = 1.0
        if FROM_LOGITS:
            t = tl.load(temps + req)
            big, total = _row_norm(part_max, part_sum, lrow, splits, SPLIT_BLOCK, PRECISE)
        pk = 0.0
        sk = 1.0
        if HAS_TOPK:
            k = tl.load(top_k + req)
            if k < vocab:
                xk = _select(src, scratch, lrow, row, vocab, k.to(tl.float64), t, big, total, 0.0, 1.0,
                             False, FROM_LOGITS, False, BLOCK, CAP, NT, MAX_PASSES, PRECISE)
                pk = _prob(xk, t, big, total, FROM_LOGITS, PRECISE)
            kept = _kept_sum(src, row, vocab, pk, t, big, total, 0.0, 1.0, 0.0, 1.0,
                             FROM_LOGITS, False, False, BLOCK, PRECISE)
            sk = tl.maximum(kept, _FLOOR).to(tl.float32)
        pp = 0.0
        sp = 1.0
        if HAS_TOPP:
            target = tl.load(top_p + req)
            whole = _kept_sum(src, row, vocab, 0.0, t, big, total, pk, sk, 0.0, 1.0,
                              FROM_LOGITS, HAS_TOPK, False, BLOCK, PRECISE)
            if (target < 1.0) & (whole >= target):
                xp = _select(src, scratch, lrow, row, vocab, target, t, big, total, pk, sk,
                             True, FROM_LOGITS, HAS_TOPK, BLOCK, CAP, NT, MAX_PASSES, PRECISE)
                pp = _renormed(_prob(xp, t, big, total, FROM_LOGITS, PRECISE), pk, sk, 0.0, 1.0, HAS_TOPK, False)
                kept = _kept_sum(src, row, vocab, pp, t, big, total, pk, sk, 0.0, 1.0,
                                 FROM_LOGITS, HAS_TOPK, False, BLOCK, PRECISE)
            else:
                kept = whole
            sp = tl.maximum(kept, _FLOOR).to(tl.float32)
        tl.store(pivots + lrow * 4 + 0, pk)
        tl.store(pivots + lrow * 4 + 1, sk)
        tl.store(pivots + lrow * 4 + 2, pp)
        tl.store(pivots + lrow * 4 + 3, sp)

    @triton.jit(do_not_specialize=["vocab", "chunk"])
    def _apply_renorm_kernel(probs, pivots, out, vocab, chunk, HAS_TOPK: tl.constexpr, HAS_TOPP: tl.constexpr,
                             BLOCK: tl.constexpr):
        row = tl.program_id(0)
        c = tl.program_id(1)
        pk = tl.load(pivots + row * 4 + 0)
        sk = tl.load(pivots + row * 4 + 1)
        pp = tl.load(pivots + row * 4 + 2)
        sp = tl.load(pivots + row * 4 + 3)
        offs = tl.arange(0, BLOCK)
        lo = c * chunk
        base = row.to(tl.int64) * vocab
        for start in range(lo, lo + chunk, BLOCK):
            idx = start + offs
            inside = (idx < lo + chunk) & (idx < vocab)
            p = tl.load(probs + base + idx, mask=inside, other=0.0)
            tl.store(out + base + idx, _renormed(p, pk, sk, pp, sp, HAS_TOPK, HAS_TOPP), mask=inside)

    @triton.jit
    def _node_prob(logits, part_max, part_sum, pivots, row, lrow, tok, t, vocab, splits,
                   HAS_TOPK: tl.constexpr, HAS_TOPP: tl.constexpr, SPLIT_BLOCK: tl.constexpr,
                   PRECISE: tl.constexpr):
        """Target probability of token ``tok`` in row ``row`` (renormalised if asked)."""
        big, total = _row_norm(part_max, part_sum, lrow, splits, SPLIT_BLOCK, PRECISE)
        x = tl.load(logits + row.to(tl.int64) * vocab + tok)
        p = _prob(x, t, big, total, True, PRECISE)
        if HAS_TOPK or HAS_TOPP:
            p = _renormed(p, tl.load(pivots + lrow * 4 + 0), tl.load(pivots + lrow * 4 + 1),
                          tl.load(pivots + lrow * 4 + 2), tl.load(pivots + lrow * 4 + 3), HAS_TOPK, HAS_TOPP)
        return p

    @triton.jit(do_not_specialize=["d", "vocab", "splits", "k"])
    def _token_prob_kernel(logits, temps, part_max, part_sum, tokens, out, d, vocab, splits, k,
                           SPLIT_BLOCK: tl.constexpr, PRECISE: tl.constexpr):
        row = tl.program_id(0)
        t = tl.load(temps + row // d)
        for i in range(0, k):
            tok = tl.load(tokens + row * k + i)
            p = _node_prob(logits, part_max, part_sum, part_max, row, row, tok, t, vocab, splits,
                           False, False, SPLIT_BLOCK, PRECISE)
            tl.store(out + row * k + i, p)

    @triton.jit(do_not_specialize=["req0", "d", "vocab", "steps", "splits"])
    def _walk_kernel(logits, temps, part_max, part_sum, pivots,
                     candidates, retrive_index, next_token, next_sibling, coins, coins_final,
                     predicts, accept_index, accept_length,
                     req0, d, vocab, steps, splits, thr_single, thr_acc,
                     HAS_TOPK: tl.constexpr, HAS_TOPP: tl.constexpr, BLOCK: tl.constexpr,
                     SPLIT_BLOCK: tl.constexpr, PRECISE: tl.constexpr):
        """One request: walk the tree (upstream acceptance rule), then sample the last token."""
        local = tl.program_id(0)
        b = req0 + local
        node0 = b * d
        t = tl.load(temps + b)
        node = 0
        coin = tl.load(coins + node0)
        last = tl.load(retrive_index + node0).to(tl.int32)
        tl.store(accept_index + b * steps, last)
        accepted = 0
        last_rej = -1
        alive = 1
        j = 1
        while (j < steps) & (alive != 0):
            child = tl.load(next_token + node0 + node).to(tl.int32)
            chosen = -1
            acc = 0.0
            while (child != -1) & (chosen == -1):
                tok = tl.load(candidates + node0 + child).to(tl.int32)
                p = _node_prob(logits, part_max, part_sum, pivots, node0 + node, local * d + node, tok, t,
                               vocab, splits, HAS_TOPK, HAS_TOPP, SPLIT_BLOCK, PRECISE)
                acc = acc + p
                ok = (p > 0) & ((coin < tl.math.div_rn(acc, thr_acc)) | (p >= thr_single))
                last_rej = tl.where((~ok) & (p > 0), tok, last_rej)
                chosen = tl.where(ok, child, -1)
                nxt = tl.load(next_sibling + node0 + child).to(tl.int32)
                child = tl.where(ok, child, nxt)
            if chosen >= 0:
                tl.store(predicts + last, tl.load(candidates + node0 + chosen).to(tl.int32))
                accepted += 1
                last = tl.load(retrive_index + node0 + chosen).to(tl.int32)
                tl.store(accept_index + b * steps + accepted, last)
                node = chosen
                coin = tl.load(coins + node0 + node)
            else:
                alive = 0
            j += 1
        for col in range(accepted + 1, steps):
            tl.store(accept_index + b * steps + col, -1)
        tl.store(accept_length + b, accepted + 1)

        # Residual of the final node's row: its rejected children removed unless every depth was accepted.
        bonus = accepted == steps - 1
        row = node0 + node
        lrow = local * d + node
        big, total = _row_norm(part_max, part_sum, lrow, splits, SPLIT_BLOCK, PRECISE)
        pk = 0.0
        sk = 1.0
        pp = 0.0
        sp = 1.0
        if HAS_TOPK or HAS_TOPP:
            pk = tl.load(pivots + lrow * 4 + 0)
            sk = tl.load(pivots + lrow * 4 + 1)
            pp = tl.load(pivots + lrow * 4 + 2)
            sp = tl.load(pivots + lrow * 4 + 3)
        first_child = tl.load(next_token + node0 + node).to(tl.int32)
        first_child = tl.where(bonus, -1, first_child)
        base = logits + row.to(tl.int64) * vocab
        offs = tl.arange(0, BLOCK)
        mass = tl.zeros([], tl.float64)
        last_pos = tl.full([BLOCK], -1, tl.int32)
        for start in range(0, vocab, BLOCK):
            idx = start + offs
            r = _residual(base, idx, vocab, t, big, total, pk, sk, pp, sp, candidates, next_sibling, node0,
                          first_child, HAS_TOPK, HAS_TOPP, PRECISE)
            cdf = mass + tl.cumsum(r.to(tl.float64), axis=0)
            mass = tl.max(tl.where(offs == BLOCK - 1, cdf, float("-inf")), axis=0)
            last_pos = tl.maximum(last_pos, tl.where(r > 0, idx, -1))
        last_positive = tl.max(last_pos, axis=0)
        u = tl.load(coins_final + b).to(tl.float64) * mass
        running = tl.zeros([], tl.float64)
        found = -1
        start = 0
        while (start < vocab) & (found == -1):
            idx = start + offs
            r = _residual(base, idx, vocab, t, big, total, pk, sk, pp, sp, candidates, next_sibling, node0,
                          first_child, HAS_TOPK, HAS_TOPP, PRECISE)
            cdf = running + tl.cumsum(r.to(tl.float64), axis=0)
            hit = tl.min(tl.where((cdf > u) & (idx < vocab), idx, vocab), axis=0)
            found = tl.where(hit < vocab, hit, -1)
            running = tl.max(tl.where(offs == BLOCK - 1, cdf, float("-inf")), axis=0)
            start += BLOCK
        fallback = tl.where(last_positive >= 0, last_positive, tl.where(last_rej >= 0, last_rej, vocab - 1))
        token = tl.where(found >= 0, found, fallback)
        tl.store(predicts + last, token)

    @triton.jit
    def _residual(base, idx, vocab, t, big, total, pk, sk, pp, sp, candidates, next_sibling, node0, first_child,
                  HAS_TOPK: tl.constexpr, HAS_TOPP: tl.constexpr, PRECISE: tl.constexpr):
        """One tile of the final row's probabilities with the rejected children's tokens zeroed."""
        x = tl.load(base + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32)
        r = _renormed(_prob(x, t, big, total, True, PRECISE), pk, sk, pp, sp, HAS_TOPK, HAS_TOPP)
        r = tl.where(idx < vocab, r, 0.0)
        child = first_child
        while child != -1:
            tok = tl.load(candidates + node0 + child).to(tl.int32)
            r = tl.where(idx == tok, 0.0, r)
            child = tl.load(next_sibling + node0 + child).to(tl.int32)
        return r


def _compile_options() -> dict:
    """No denormal flushing in libdevice and no fused multiply-add: torch's kernels use neither."""
    if INTERPRETED:
        return {}
    return {"enable_fp_fusion": False, "enable_reflect_ftz": False}


# ---------------------------------------------------------------------------------
# Arguments


def _per_request(value, n, name, like, dtype) -> torch.Tensor:
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


def _draw(given, shape, generator, like) -> torch.Tensor:
    if given is not None:
        return given
    out = like.new_empty(shape, dtype=torch.float32)
    if generator is None:
        return out.uniform_()
    if generator.device.type == "cpu":
        return out.copy_(torch.rand(shape, generator=generator))
    return out.uniform_(generator=generator)


def _any(mask: torch.Tensor) -> bool:
    return bool(mask.any())


def _expect(t, name, shape, dtype) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}; convert with .to({dtype})")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous; call .contiguous() first")


def _check_thresholds(threshold_single, threshold_acc):
    for name, value in (("threshold_single", threshold_single), ("threshold_acc", threshold_acc)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be a number in [0, 1] (1 is exact target sampling), got {value!r}")
    return float(threshold_single), max(float(threshold_acc), 1e-9)


def _check_shapes(logits, candidates, tree, coins, coins_final, out):
    if not isinstance(tree, DraftTree) and not hasattr(tree, "retrive_next_token"):
        raise ValueError("tree must be a DraftTree (see build_draft_tree / tree_from_parents)")
    if not isinstance(candidates, torch.Tensor) or candidates.dim() != 2 or candidates.dtype != torch.int64:
        raise ValueError("candidates must be an int64 tensor [bs, D] (draft tokens, node 0 = root)")
    bs, d = candidates.shape
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.shape[0] != bs * d:
        raise ValueError(
            f"logits must be [bs*D, V] = [{bs * d}, V] (one row per tree node), got "
            f"{tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__}")
    if logits.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"logits must be float32, float16 or bfloat16, got {logits.dtype}")
    if not logits.is_contiguous():
        raise ValueError("logits must be contiguous; call .contiguous() first")
    vocab = logits.shape[1]
    if vocab < 1:
        raise ValueError("logits have an empty vocabulary dimension")
    _expect(candidates, "candidates", (bs, d), torch.int64)
    for name in ("retrive_index", "retrive_next_token", "retrive_next_sibling"):
        _expect(getattr(tree, name), f"tree.{name}", (bs, d), torch.int64)
    if coins is not None:
        _expect(coins, "coins", (bs, d), torch.float32)
    if coins_final is not None:
        _expect(coins_final, "coins_final", (bs,), torch.float32)
    if out is not None:
        if not isinstance(out, (tuple, list)) or len(out) != 3:
            raise ValueError("out must be (predicts [bs*D] int32, accept_index [bs, S] int32, accept_length [bs] int32)")
        _expect(out[0], "out predicts", (bs * d,), torch.int32)
        _expect(out[1], "out accept_index", (bs, int(tree.tree_depth)), torch.int32)
        _expect(out[2], "out accept_length", (bs,), torch.int32)
    return bs, d, vocab


def _check_values(logits, candidates, tree, temperatures, top_ks, top_ps, coins, coins_final) -> None:
    """Host-side value checks (each syncs): what a kernel cannot report."""
    bs, d = candidates.shape
    vocab = logits.shape[1]
    for name, t in (("retrive_next_token", tree.retrive_next_token), ("retrive_next_sibling", tree.retrive_next_sibling)):
        if _any((t < -1) | (t >= d)):
            raise ValueError(f"tree.{name} values must be -1 (none) or a node index in [0, {d})")
    if _any((tree.retrive_index < 0) | (tree.retrive_index >= bs * d)):
        raise ValueError(f"tree.retrive_index values must be slots in [0, {bs * d}) of predicts")
    if _any((candidates < 0) | (candidates >= vocab)):
        raise ValueError(f"candidates must be token ids in [0, {vocab})")
    temps = _per_request(temperatures, bs, "temperatures", logits, torch.float32)
    if _any(~(temps > 0) | ~torch.isfinite(temps)):
        raise ValueError("temperatures must be finite and > 0 (greedy requests take the argmax path instead)")
    if top_ks is not None and _any(_per_request(top_ks, bs, "top_ks", logits, torch.int64) < 1):
        raise ValueError(f"top_ks must be >= 1 (a value >= the vocabulary {vocab} keeps all)")
    if top_ps is not None:
        p = _per_request(top_ps, bs, "top_ps", logits, torch.float64)
        if _any(~(p > 0) | (p > 1)):
            raise ValueError("top_ps must be in (0, 1] (1 keeps all)")
    for name, c in (("coins", coins), ("coins_final", coins_final)):
        if c is not None and _any(~((c >= 0) & (c <= 1))):
            raise ValueError(f"{name} must be uniform samples in [0, 1]")
    if _any(torch.isnan(logits)) or _any(logits == math.inf):
        raise ValueError("logits hold NaN or +inf; fix them upstream (-inf masks a token and is fine)")
    if _any((logits == -math.inf).all(dim=1)):
        raise ValueError("a logits row is -inf everywhere: it holds no distribution")
