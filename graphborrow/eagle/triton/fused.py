"""EAGLE verification at kernel speed: Triton kernels that read the logits directly.

:func:`fused_verify` is :func:`graphborrow.eagle.eagle_verify` (mode ``"standard"``)
without the [bs*D, V] probability matrices; ``eagle_verify`` runs it on CUDA tensors
(``impl="auto"``) through :func:`run_step`. Each row's target distribution is the
formula of :mod:`graphborrow.eagle.probs`, which the reference computes too (its torch
form, :func:`target_probs_reference`, is re-exported here), computed where it is needed. The step is three launches:

1. ``_row_max_kernel`` — per (row, vocabulary slice): the largest logit. It also zeroes
   ``predicts`` and the step's counters, so nothing else runs before it;
2. ``_row_sum_kernel`` — per (row, slice): the fixed-point sum of ``exp(x / t - m)``.
   The last slice of a request to finish (an atomic counter) walks the request's draft
   tree: upstream's acceptance rule, each tried candidate's probability from its logit
   and its row's statistics;
3. ``_residual_kernel`` — per (request, slice): the float64 mass of the final row's
   residual (its rejected children removed unless every depth was accepted); the last
   slice to finish finds the slice where ``coin * mass`` falls and scans only that one.

With top-k / top-p, :func:`graphborrow.eagle.triton.select.select_pivots` finds every row's
pivots and kept sums between 2 and 3 (a sort-free search, a few launches), and the walk
runs in its own launch. Nothing synchronises with the host when ``validate=False``, so
the step can be captured in a CUDA graph. Temporaries grow with bs * D (row statistics,
per-slice partial results), never with V; :func:`fused_workspace` allocates them on any
device, the simulated one included (``launch=False`` records the step's allocations
without running it), so the capacity planner can replay them. Without CUDA the kernels
run in Triton's interpreter (slow, for tests).

The same coins give the reference's tokens: every probability is bitwise the
reference's; the float64 running sums of the residual and of top-k / top-p kept mass are
added in another order than torch's, which matters only when a coin lands within about
1e-16 of a boundary (see :mod:`graphborrow.eagle.triton.probs`).

Chunking: the fused step holds no vocabulary-wide temporary, so it never splits a batch;
``chunk_requests`` is accepted for parity with the reference's chunked mode and the step
still runs as one launch sequence over every request (a per-chunk sequence would only add
launches: the workspace it would bound is a few KiB per request, about 4 KiB more per row
with top-k / top-p).
"""

from __future__ import annotations

import contextlib
import math
from typing import NamedTuple

import torch

from ..draft_tree import DraftTree
from ..step import VerifyStep, draw
from ..validate import expect
from . import select as _select
from .probs import (
    INTERPRETED,
    TRITON_AVAILABLE,
    any_true,
    compile_options,
    per_request,
    sum_bits,
    target_probs_reference,
)
from .select import (
    SPLIT_MAX,
    SelectWorkspace,
    select_pivots,
    select_workspace,
    select_workspace_bytes,
    split_layout,
    top_k_renorm,
    top_p_renorm,
)

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

    from .probs import fixed_point_e, prob, renormed, row_max_y, row_norm
    from .select import arrive

__all__ = [
    "FusedResult",
    "FusedWorkspace",
    "TRITON_AVAILABLE",
    "fused_verify",
    "run_step",
    "fused_workspace",
    "fused_workspace_bytes",
    "fused_token_probs",
    "split_layout",
    "target_probs_reference",
    "top_k_renorm",
    "top_p_renorm",
]

BORROW_USER = "EAGLE verify"
WALK_WARPS = 1
WALK_FIELDS = 4  # final node, its slot, last rejected token, dropped-token count; then the dropped tokens


class FusedResult(NamedTuple):
    """``predicts`` [bs*D] int32, ``accept_index`` [bs, S] int32 (-1 past the path),
    ``accept_length`` [bs] int32 (accepted drafts + 1): as :class:`eagle.VerifyResult`."""

    predicts: torch.Tensor
    accept_index: torch.Tensor
    accept_length: torch.Tensor


class FusedWorkspace(NamedTuple):
    """Every temporary of one fused step (outputs excluded), in allocation order.

    Per request: ``temps`` [bs] float32, ``top_k`` [bs] int32 or None, ``top_p`` [bs]
    float32 or None (as the reference takes it). Per row (rows = bs * D) and slice: ``part_max`` float32, ``part_sum``
    int64. Per request: ``walk_state`` [bs, 4 + D] int32 (final node, its slot, last
    rejected token, how many tokens the residual drops, then those tokens), ``res_sum`` [bs, rsplits] float64 and ``res_last``
    [bs, rsplits] int32 (residual mass and last positive index per slice), ``counters``
    [bs] int32. With top-k / top-p: ``pivots`` [rows, 4] float32 and the search's
    :class:`~graphborrow.eagle.triton.select.SelectWorkspace`.
    """

    temps: torch.Tensor
    top_k: torch.Tensor | None
    top_p: torch.Tensor | None
    part_max: torch.Tensor
    part_sum: torch.Tensor
    walk_state: torch.Tensor
    res_sum: torch.Tensor
    res_last: torch.Tensor
    counters: torch.Tensor
    pivots: torch.Tensor | None
    select: SelectWorkspace | None
    splits: int
    chunk: int
    rsplits: int
    rchunk: int


def fused_workspace(like: torch.Tensor, bs: int, d: int, vocab: int, temperatures=1.0, top_ks=None,
                    top_ps=None) -> FusedWorkspace:
    """Allocate (and fill the per-request values of) every temporary of a fused step.

    Runs on any device, the layout-only simulated one included: this is the fused path's
    allocation sequence. ``like`` gives the device (usually the logits).
    """
    rows = bs * d
    splits, chunk = split_layout(rows, vocab)
    rsplits, rchunk = split_layout(bs, vocab)
    temps = per_request(temperatures, bs, "temperatures", like, torch.float32)
    top_k = None if top_ks is None else per_request(top_ks, bs, "top_ks", like, torch.int32)
    top_p = None if top_ps is None else per_request(top_ps, bs, "top_ps", like, torch.float32)
    part_max = like.new_empty((rows, splits), dtype=torch.float32)
    part_sum = like.new_empty((rows, splits), dtype=torch.int64)
    walk_state = like.new_empty((bs, WALK_FIELDS + d), dtype=torch.int32)
    res_sum = like.new_empty((bs, rsplits), dtype=torch.float64)
    res_last = like.new_empty((bs, rsplits), dtype=torch.int32)
    counters = like.new_empty(bs, dtype=torch.int32)  # zeroed by the first kernel
    pivots = select = None
    if top_k is not None or top_p is not None:
        pivots = like.new_empty((rows, 4), dtype=torch.float32)
        select = select_workspace(like, rows, splits, zero_counters=False)
    return FusedWorkspace(temps, top_k, top_p, part_max, part_sum, walk_state, res_sum, res_last, counters,
                          pivots, select, splits, chunk, rsplits, rchunk)


def fused_workspace_bytes(bs: int, d: int, vocab: int, top_k: bool = False, top_p: bool = False) -> int:
    """Requested bytes of :func:`fused_workspace` (before allocator rounding): it grows
    with bs * D, never with bs * D * V."""
    rows = bs * d
    splits, _ = split_layout(rows, vocab)
    rsplits, _ = split_layout(bs, vocab)
    total = 4 * bs + (4 * bs if top_k else 0) + (4 * bs if top_p else 0)
    total += 12 * rows * splits + 4 * bs * (WALK_FIELDS + d) + 12 * bs * rsplits + 4 * bs
    if top_k or top_p:
        total += 16 * rows + select_workspace_bytes(rows, splits)
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
    coins give the same tokens (see the module docstring).

    Args:
        out: optional ``(predicts, accept_index, accept_length)`` to write into (static
            buffers for graph capture); every entry is rewritten.
        validate: check values on the host (syncs). ``False`` skips every such check, so
            the step can be captured in a CUDA graph; shapes and dtypes are still checked.
        generator: draws missing coins (as eagle_verify does).
        borrow: a borrow state; when enabled, every temporary lives in its borrow scope.
        chunk_requests: accepted (a positive int) for parity with the chunked reference; the
            fused step needs no chunking and runs over every request at once.
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
                           "graphborrow.eagle.triton.fused")

    if out is None:  # filled entirely by the kernels: no fill launches
        predicts = candidates.new_empty(bs * d, dtype=torch.int32)
        accept_index = candidates.new_empty((bs, steps), dtype=torch.int32)
        accept_length = candidates.new_empty(bs, dtype=torch.int32)
        if not launch:
            predicts.zero_()
            accept_index.fill_(-1)
            accept_length.zero_()
    else:
        predicts, accept_index, accept_length = out

    borrowing = borrow is not None and bool(borrow.enabled)
    scope = borrow.borrow(BORROW_USER) if borrowing else contextlib.nullcontext()
    with scope:
        coins = _draw(coins, (bs, d), generator, logits)
        coins_final = _draw(coins_final, (bs,), generator, logits)
        ws = fused_workspace(logits, bs, d, vocab, temperatures, top_ks, top_ps)
        if launch:
            _launch(_Launch(logits, candidates, tree, coins, coins_final, bs, d, vocab, steps, thr_single, thr_acc,
                            predicts, accept_index, accept_length), ws)
        del ws, coins, coins_final
    return FusedResult(predicts, accept_index, accept_length)


def run_step(step: VerifyStep, out, launch: bool = True) -> None:
    """:func:`~graphborrow.eagle.eagle_verify`'s fused body, inside its borrow scope.

    The step was checked (and validated) by the caller; the coins are copied next to the
    logits (or drawn) as the reference does, then :func:`fused_verify` writes ``out``
    (its ``accept_length`` counting the emitted token). With ``launch=False`` nothing
    runs: the capacity planner records this function on the layout-only device, so its
    plan is the allocation sequence of exactly this path.
    """
    coins = draw(step.coins, (step.batch_size, step.draft_tokens), step.generator, step.logits)
    coins_final = draw(step.coins_final, (step.batch_size,), step.generator, step.logits)
    fused_verify(step.logits, step.candidates, step.tree, step.temperatures, top_ks=step.top_ks, top_ps=step.top_ps,
                 coins=coins, coins_final=coins_final, threshold_single=step.threshold_single,
                 threshold_acc=step.threshold_acc, out=tuple(out), validate=False, launch=launch)


class _Launch(NamedTuple):
    """One fused step's checked inputs and its outputs: what the kernels read and write besides the workspace."""

    logits: torch.Tensor
    candidates: torch.Tensor
    tree: DraftTree
    coins: torch.Tensor
    coins_final: torch.Tensor
    bs: int
    d: int
    vocab: int
    steps: int
    thr_single: float
    thr_acc: float
    predicts: torch.Tensor
    accept_index: torch.Tensor
    accept_length: torch.Tensor


def _launch(step: _Launch, ws: FusedWorkspace) -> None:
    (logits, candidates, tree, coins, coins_final, bs, d, vocab, steps, thr_single, thr_acc,
     predicts, accept_index, accept_length) = step
    rows = bs * d
    bits = sum_bits(vocab)
    scale, unscale = 2.0 ** bits, 2.0 ** -bits
    opts = dict(PRECISE=not INTERPRETED, SPLIT_BLOCK=SPLIT_MAX, **compile_options())
    renorm = ws.pivots is not None
    has_k, has_p = ws.top_k is not None, ws.top_p is not None
    pivots = ws.pivots if renorm else ws.part_max  # an unused pointer without renorm
    _row_max_kernel[(rows, ws.splits)](
        logits, ws.part_max, predicts, ws.counters, ws.select.counters if renorm else ws.counters,
        bs, vocab, ws.splits, ws.chunk, ZERO_SELECT=renorm, BLOCK=_select.BLOCK, num_warps=_select.STREAM_WARPS,
        **compile_options())
    walk_args = (pivots, candidates, tree.retrive_index, tree.retrive_next_token, tree.retrive_next_sibling,
                 coins, predicts, accept_index, accept_length, ws.walk_state)
    _row_sum_kernel[(rows, ws.splits)](
        logits, ws.temps, ws.part_max, ws.part_sum, ws.counters, *walk_args,
        d, vocab, ws.splits, ws.chunk, steps, scale, unscale, thr_single, thr_acc,
        WALK=not renorm, HAS_TOPK=False, HAS_TOPP=False, BLOCK=_select.BLOCK, num_warps=_select.STREAM_WARPS, **opts)
    if renorm:
        select_pivots(logits, ws.pivots, ws.select, ws.top_k, ws.top_p, d, ws.splits, ws.chunk,
                      stats=(ws.temps, ws.part_max, ws.part_sum, unscale))
        _walk_kernel[(bs,)](
            logits, ws.temps, ws.part_max, ws.part_sum, *walk_args,
            d, vocab, ws.splits, steps, unscale, thr_single, thr_acc,
            HAS_TOPK=has_k, HAS_TOPP=has_p, num_warps=WALK_WARPS, **opts)
    _residual_kernel[(bs, ws.rsplits)](
        logits, ws.temps, ws.part_max, ws.part_sum, pivots, ws.walk_state, coins_final, ws.res_sum, ws.res_last,
        ws.counters, predicts, d, vocab, ws.splits, ws.rsplits, ws.rchunk, unscale,
        HAS_TOPK=has_k, HAS_TOPP=has_p, D_BLOCK=triton.next_power_of_2(d), BLOCK=_select.BLOCK,
        num_warps=_select.STREAM_WARPS, **opts)


def fused_token_probs(logits: torch.Tensor, temperatures, d: int, tokens: torch.Tensor) -> torch.Tensor:
    """The fused path's target probabilities at ``tokens`` [rows, K] (int64), per row.

    For checking: they equal ``target_probs_reference(logits, temperatures per row)``
    gathered at ``tokens``, bit for bit. ``temperatures``: a number or one per request (rows / d).
    """
    rows, vocab = logits.shape
    if tokens.dim() != 2 or tokens.shape[0] != rows or tokens.dtype != torch.int64:
        raise ValueError(f"tokens must be int64 [rows={rows}, K]")
    if rows % d:
        raise ValueError(f"logits hold {rows} rows, not a whole number of requests of d={d} rows")
    bs = rows // d
    ws = fused_workspace(logits, bs, d, vocab, temperatures)
    bits = sum_bits(vocab)
    opts = dict(PRECISE=not INTERPRETED, SPLIT_BLOCK=SPLIT_MAX, **compile_options())
    predicts = logits.new_empty(rows, dtype=torch.int32)
    _row_max_kernel[(rows, ws.splits)](logits, ws.part_max, predicts, ws.counters, ws.counters, bs, vocab, ws.splits,
                                       ws.chunk, ZERO_SELECT=False, BLOCK=_select.BLOCK, num_warps=_select.STREAM_WARPS,
                                       **compile_options())
    none = ws.part_max
    _row_sum_kernel[(rows, ws.splits)](
        logits, ws.temps, ws.part_max, ws.part_sum, ws.counters, none, none, none, none, none, none, none, none,
        none, none, d, vocab, ws.splits, ws.chunk, 1, 2.0 ** bits, 2.0 ** -bits, 1.0, 1.0,
        WALK=False, HAS_TOPK=False, HAS_TOPP=False, BLOCK=_select.BLOCK, num_warps=_select.STREAM_WARPS, **opts)
    tokens = tokens.contiguous()
    out = logits.new_empty(tokens.shape, dtype=torch.float32)
    _token_prob_kernel[(rows,)](logits, ws.temps, ws.part_max, ws.part_sum, tokens, out, d, vocab, ws.splits,
                                tokens.shape[1], 2.0 ** -bits, BLOCK=256, num_warps=4, **opts)
    return out


# ---------------------------------------------------------------------------------
# Kernels

if TRITON_AVAILABLE:
    WALK_FIELDS_C = tl.constexpr(WALK_FIELDS)

    @triton.jit(do_not_specialize=["bs", "splits"])
    def _row_max_kernel(logits, part_max, predicts, counters, select_counters, bs, vocab, splits, chunk,
                        ZERO_SELECT: tl.constexpr, BLOCK: tl.constexpr):
        """Largest logit per (row, slice): m = max(x) / t later, as division by t > 0 is monotone."""
        row = tl.program_id(0)
        c = tl.program_id(1)
        base = logits + row.to(tl.int64) * vocab
        lo = c * chunk
        hi = tl.minimum(lo + chunk, vocab)
        offs = tl.arange(0, BLOCK)
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        for start in range(lo, hi, BLOCK):
            idx = start + offs
            m = tl.maximum(m, tl.load(base + idx, mask=idx < hi, other=float("-inf")).to(tl.float32))
        tl.store(part_max + row.to(tl.int64) * splits + c, tl.max(m, axis=0))
        if c == 0:
            tl.store(predicts + row, 0)
            if row < bs:
                tl.store(counters + row, 0)
            if ZERO_SELECT:
                tl.store(select_counters + row, 0)

    @triton.jit(do_not_specialize=["d", "splits", "steps"])
    def _row_sum_kernel(logits, temps, part_max, part_sum, counters,
                        pivots, candidates, retrive_index, next_token, next_sibling, coins, predicts, accept_index,
                        accept_length, walk_state,
                        d, vocab, splits, chunk, steps, scale, unscale, thr_single, thr_acc,
                        WALK: tl.constexpr, HAS_TOPK: tl.constexpr, HAS_TOPP: tl.constexpr, BLOCK: tl.constexpr,
                        SPLIT_BLOCK: tl.constexpr, PRECISE: tl.constexpr):
        """Fixed-point sum of e per (row, slice); with WALK, a request's last slice walks its tree."""
        row = tl.program_id(0)
        c = tl.program_id(1)
        req = row // d
        t = tl.load(temps + req)
        big = row_max_y(part_max, row, splits, t, SPLIT_BLOCK)
        base = logits + row.to(tl.int64) * vocab
        lo = c * chunk
        hi = tl.minimum(lo + chunk, vocab)
        offs = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], tl.int64)
        for start in range(lo, hi, BLOCK):
            idx = start + offs
            x = tl.load(base + idx, mask=idx < hi, other=float("-inf")).to(tl.float32)
            acc += fixed_point_e(x, t, big, scale, PRECISE)
        tl.store(part_sum + row.to(tl.int64) * splits + c, tl.sum(acc, axis=0))
        if WALK:
            if arrive(counters, req, d * splits):
                _walk(req, logits, temps, part_max, part_sum, pivots, candidates, retrive_index, next_token,
                      next_sibling, coins, predicts, accept_index, accept_length, walk_state,
                      d, vocab, steps, splits, unscale, thr_single, thr_acc,
                      HAS_TOPK, HAS_TOPP, SPLIT_BLOCK, PRECISE)

    @triton.jit(do_not_specialize=["d", "splits", "steps"])
    def _walk_kernel(logits, temps, part_max, part_sum,
                     pivots, candidates, retrive_index, next_token, next_sibling, coins, predicts, accept_index,
                     accept_length, walk_state,
                     d, vocab, splits, steps, unscale, thr_single, thr_acc,
                     HAS_TOPK: tl.constexpr, HAS_TOPP: tl.constexpr, SPLIT_BLOCK: tl.constexpr,
                     PRECISE: tl.constexpr):
        """One request's walk (with top-k / top-p, once every row's pivots are known)."""
        _walk(tl.program_id(0), logits, temps, part_max, part_sum, pivots, candidates, retrive_index, next_token,
              next_sibling, coins, predicts, accept_index, accept_length, walk_state,
              d, vocab, steps, splits, unscale, thr_single, thr_acc,
              HAS_TOPK, HAS_TOPP, SPLIT_BLOCK, PRECISE)

    @triton.jit
    def _pivots_of(pivots, row, HAS_TOPK: tl.constexpr, HAS_TOPP: tl.constexpr):
        pk = 0.0
        sk = 1.0
        pp = 0.0
        sp = 1.0
        if HAS_TOPK:
            pk = tl.load(pivots + row * 4 + 0)
            sk = tl.load(pivots + row * 4 + 1)
        if HAS_TOPP:
            pp = tl.load(pivots + row * 4 + 2)
            sp = tl.load(pivots + row * 4 + 3)
        return pk, sk, pp, sp

    @triton.jit
    def _walk(b, logits, temps, part_max, part_sum, pivots, candidates, retrive_index, next_token, next_sibling,
              coins, predicts, accept_index, accept_length, walk_state,
              d, vocab, steps, splits, unscale, thr_single, thr_acc,
              HAS_TOPK: tl.constexpr, HAS_TOPP: tl.constexpr, SPLIT_BLOCK: tl.constexpr, PRECISE: tl.constexpr):
        """Upstream's acceptance rule down one request's tree; records where the walk ended."""
        node0 = b * d
        state = walk_state + b * (WALK_FIELDS_C + d)
        t = tl.load(temps + b)
        node = 0
        coin = tl.load(coins + node0)
        tried = 0
        last = tl.load(retrive_index + node0).to(tl.int32)
        tl.store(accept_index + b * steps, last)
        accepted = 0
        last_rej = -1
        alive = 1
        j = 1
        while (j < steps) & (alive != 0):
            row = node0 + node
            big, total = row_norm(part_max, part_sum, row, splits, t, unscale, SPLIT_BLOCK)
            pk, sk, pp, sp = _pivots_of(pivots, row, HAS_TOPK, HAS_TOPP)
            child = tl.load(next_token + row).to(tl.int32)
            chosen = -1
            acc = 0.0
            tried = 0
            while (child != -1) & (chosen == -1):
                tok = tl.load(candidates + node0 + child).to(tl.int32)
                tl.store(state + WALK_FIELDS_C + tried, tok)  # the residual drops this depth's tried tokens
                tried += 1
                x = tl.load(logits + row.to(tl.int64) * vocab + tok).to(tl.float32)
                p = renormed(prob(x, t, big, total, PRECISE), pk, sk, pp, sp, HAS_TOPK, HAS_TOPP)
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
        tl.store(state + 0, node)
        tl.store(state + 1, last)
        tl.store(state + 2, last_rej)
        # every child of the final node was tried and rejected, unless every depth was accepted
        tl.store(state + 3, tl.where(accepted == steps - 1, 0, tried))

    @triton.jit
    def _residual_tile(base, idx, hi, start, t, big, total, pk, sk, pp, sp, dropped, D_BLOCK: tl.constexpr,
                       BLOCK: tl.constexpr, HAS_TOPK: tl.constexpr, HAS_TOPP: tl.constexpr, PRECISE: tl.constexpr):
        """One tile of the final row's probabilities with the rejected children's tokens
        (``dropped``, -1 padded) zeroed: relu(p - p) = 0 where upstream subtracts the draft."""
        valid = idx < hi
        x = tl.load(base + idx, mask=valid, other=float("-inf")).to(tl.float32)
        r = tl.where(valid, renormed(prob(x, t, big, total, PRECISE), pk, sk, pp, sp, HAS_TOPK, HAS_TOPP), 0.0)
        here = (dropped >= start) & (dropped < start + BLOCK)
        if tl.sum(here.to(tl.int32), axis=0) > 0:  # few tiles hold one
            k = tl.arange(0, D_BLOCK)
            for i in range(0, D_BLOCK):
                tok = tl.max(tl.where((k == i) & here, dropped, -1), axis=0)  # -1: none
                r = tl.where(idx == tok, 0.0, r)
        return r

    @triton.jit(do_not_specialize=["d", "splits", "rsplits"])
    def _residual_kernel(logits, temps, part_max, part_sum, pivots, walk_state, coins_final, res_sum, res_last,
                         counters, predicts, d, vocab, splits, rsplits, rchunk, unscale,
                         HAS_TOPK: tl.constexpr, HAS_TOPP: tl.constexpr, D_BLOCK: tl.constexpr, BLOCK: tl.constexpr,
                         SPLIT_BLOCK: tl.constexpr, PRECISE: tl.constexpr):
        """Residual mass per (request, slice); the request's last slice samples the final token."""
        b = tl.program_id(0)
        c = tl.program_id(1)
        state = walk_state + b * (WALK_FIELDS_C + d)
        row = b * d + tl.load(state + 0)
        t = tl.load(temps + b)
        big, total = row_norm(part_max, part_sum, row, splits, t, unscale, SPLIT_BLOCK)
        pk, sk, pp, sp = _pivots_of(pivots, row, HAS_TOPK, HAS_TOPP)
        k = tl.arange(0, D_BLOCK)
        dropped = tl.load(state + WALK_FIELDS_C + k, mask=k < tl.load(state + 3), other=-1)
        base = logits + row.to(tl.int64) * vocab
        offs = tl.arange(0, BLOCK)
        lo = c * rchunk
        hi = tl.minimum(lo + rchunk, vocab)
        mass = tl.zeros([BLOCK], tl.float64)
        last_pos = tl.full([BLOCK], -1, tl.int32)
        for start in range(lo, hi, BLOCK):
            idx = start + offs
            r = _residual_tile(base, idx, hi, start, t, big, total, pk, sk, pp, sp, dropped, D_BLOCK, BLOCK,
                               HAS_TOPK, HAS_TOPP, PRECISE)
            mass += r.to(tl.float64)
            last_pos = tl.maximum(last_pos, tl.where(r > 0, idx, -1))
        tl.store(res_sum + b * rsplits + c, tl.sum(mass, axis=0))
        tl.store(res_last + b * rsplits + c, tl.max(last_pos, axis=0))
        if arrive(counters, b, rsplits):
            # u = coin * total mass; find the slice where the running sum crosses u, then
            # scan it from the running sum before it (<= u, so no zero entry can be picked)
            slots = tl.arange(0, SPLIT_BLOCK)
            inside = slots < rsplits
            running = tl.cumsum(tl.load(res_sum + b * rsplits + slots, mask=inside, other=0.0, cache_modifier=".cg"),
                                axis=0)
            u = tl.load(coins_final + b).to(tl.float64) * tl.max(running, axis=0)
            first = tl.min(tl.where((running > u) & inside, slots, SPLIT_BLOCK), axis=0)
            token = -1
            if first < rsplits:  # (rounding may carry the crossing past that slice's end)
                cum = tl.sum(tl.where(slots == first - 1, running, 0.0), axis=0)
                pos = first * rchunk
                while (pos < vocab) & (token == -1):
                    sidx = pos + offs
                    sr = _residual_tile(base, sidx, vocab, pos, t, big, total, pk, sk, pp, sp, dropped, D_BLOCK, BLOCK,
                                        HAS_TOPK, HAS_TOPP, PRECISE)
                    cdf = cum + tl.cumsum(sr.to(tl.float64), axis=0)
                    at = tl.min(tl.where((cdf > u) & (sidx < vocab), sidx, vocab), axis=0)
                    token = tl.where(at < vocab, at, -1)
                    cum = tl.max(cdf, axis=0)
                    pos += BLOCK
            if token == -1:  # the reference's fallbacks: last positive index, last rejected token, V - 1
                positive = tl.max(tl.load(res_last + b * rsplits + slots, mask=inside, other=-1,
                                          cache_modifier=".cg"), axis=0)
                last_rej = tl.load(state + 2)
                token = tl.where(positive >= 0, positive, tl.where(last_rej >= 0, last_rej, vocab - 1))
            tl.store(predicts + tl.load(state + 1), token)

    @triton.jit(do_not_specialize=["d", "splits", "k"])
    def _token_prob_kernel(logits, temps, part_max, part_sum, tokens, out, d, vocab, splits, k, unscale,
                           BLOCK: tl.constexpr, SPLIT_BLOCK: tl.constexpr, PRECISE: tl.constexpr):
        row = tl.program_id(0)
        t = tl.load(temps + row // d)
        big, total = row_norm(part_max, part_sum, row, splits, t, unscale, SPLIT_BLOCK)
        offs = tl.arange(0, BLOCK)
        for start in range(0, k, BLOCK):
            i = start + offs
            tok = tl.load(tokens + row.to(tl.int64) * k + i, mask=i < k, other=0)
            x = tl.load(logits + row.to(tl.int64) * vocab + tok, mask=i < k, other=0.0).to(tl.float32)
            tl.store(out + row.to(tl.int64) * k + i, prob(x, t, big, total, PRECISE), mask=i < k)


# ---------------------------------------------------------------------------------
# Arguments


def _draw(given, shape, generator, like) -> torch.Tensor:
    if given is not None:
        return given
    out = like.new_empty(shape, dtype=torch.float32)
    if generator is None:
        return out.uniform_()
    if generator.device.type == "cpu":
        return out.copy_(torch.rand(shape, generator=generator))
    return out.uniform_(generator=generator)


def _expect(t, name, shape, dtype) -> None:
    """As the reference checks its inputs, and contiguous: the kernels index raw memory."""
    expect(t, name, shape, dtype)
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
        if any_true((t < -1) | (t >= d)):
            raise ValueError(f"tree.{name} values must be -1 (none) or a node index in [0, {d})")
    if any_true((tree.retrive_index < 0) | (tree.retrive_index >= bs * d)):
        raise ValueError(f"tree.retrive_index values must be slots in [0, {bs * d}) of predicts")
    if any_true((candidates < 0) | (candidates >= vocab)):
        raise ValueError(f"candidates must be token ids in [0, {vocab})")
    temps = per_request(temperatures, bs, "temperatures", logits, torch.float32)
    if any_true(~(temps > 0) | ~torch.isfinite(temps)):
        raise ValueError("temperatures must be finite and > 0 (greedy requests take the argmax path instead)")
    if top_ks is not None and any_true(per_request(top_ks, bs, "top_ks", logits, torch.int64) < 1):
        raise ValueError(f"top_ks must be >= 1 (a value >= the vocabulary {vocab} keeps all)")
    if isinstance(top_ks, torch.Tensor) and any_true(top_ks >= 2**31):
        raise ValueError(f"top_ks must be < 2**31 (the kernels read int32; pass the vocabulary {vocab} to keep all)")
    if top_ps is not None:
        p = per_request(top_ps, bs, "top_ps", logits, torch.float32)
        if any_true(~(p > 0) | (p > 1)):
            raise ValueError("top_ps must be in (0, 1] (1 keeps all)")
    for name, c in (("coins", coins), ("coins_final", coins_final)):
        if c is not None and any_true(~((c >= 0) & (c <= 1))):
            raise ValueError(f"{name} must be uniform samples in [0, 1]")
    if any_true(torch.isnan(logits)) or any_true(logits == math.inf):
        raise ValueError("logits hold NaN or +inf; fix them upstream (-inf masks a token and is fine)")
    if any_true((logits == -math.inf).all(dim=1)):
        raise ValueError("a logits row is -inf everywhere: it holds no distribution")
