"""Top-k / top-p pivots without a sort: a k-ary search over float keys, parallel over vocabulary slices.

flashinfer's renormalisation (see :mod:`graphborrow.eagle.renorm`) keeps each row's entries at
or above a pivot: the k-th largest probability (top-k), or the largest value v whose
mass ``W(v) = sum(p >= v)`` reaches top_p (top-p). Both are "the largest key whose
weight W reaches a target", W a count or a float64 mass. The search narrows a bracket
[lo, hi) of float keys with ``W(lo) >= target > W(hi)``:

1. ``_init_kernel`` — per slice of each row: the smallest and largest key in play and
   the total weight; the row's last slice to finish sets the bracket;
2. ``_pass_kernel`` (``SELECT_PASSES`` launches) — per slice: the weight at or above
   ``SELECT_THRESHOLDS`` thresholds spread inside the bracket (alternately by value and
   by key); the last slice sums the slices in a fixed order and narrows the bracket;
3. ``_gather_kernel`` — once at most ``SELECT_CAP`` entries lie inside, every slice
   copies its entries there into a scratch row (at slots reserved with an atomic);
4. ``_resolve_kernel`` — one program per row sorts them and walks down exactly. A row the
   passes did not narrow enough is finished there alone, pass after pass over the whole
   row (slow, always exact);
5. ``_kept_kernel`` — the float64 sum of the kept probabilities, floored at 1e-8.

"The last slice to finish" is an atomic counter per row: each program stores its
partial result, then increments; the one that sees ``splits - 1`` reads them all,
acts for the row and resets the counter. Nothing synchronises with the host.

The kernels read either probabilities (the standalone :func:`top_k_renorm` /
:func:`top_p_renorm`) or logits with their row statistics (the fused verification,
``FROM_LOGITS``), where p is computed on the fly by the formula of
:mod:`graphborrow.eagle.triton.probs`. p is a non-decreasing function of the logit, so the
search runs on logit keys: the k-th largest p is p of the k-th largest logit, and
top-p's pivot is p of the largest logit whose mass reaches the target.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .direct import kernel_launch
from .launch import Launcher, PlanCache, aligned, bound_call, capturing_now, current_stream, direct_disabled
from .probs import INTERPRETED, TRITON_AVAILABLE, any_true, compile_options, per_request_value
from .workspace import Layout

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

    from .probs import float_key, key_float, prob, renormed, row_norm

__all__ = ["SelectWorkspace", "clear_plans", "select_launches", "select_slots", "split_layout", "top_k_renorm", "top_p_renorm",
           "tunables"]

BLOCK = 2048            # vocabulary entries per tile in the streaming kernels
SPLIT_MAX = 64          # most vocabulary slices per row
TARGET_PROGRAMS = 1056  # eight per H200 SM: slices enough to fill the GPU at small batches
SELECT_BLOCK = 1024     # entries per tile in the threshold passes
SELECT_RUN = 4          # coalesced runs per tile: each thread takes one entry of each
SELECT_THRESHOLDS = 8   # thresholds per pass: the bracket shrinks ~9-fold per pass
SELECT_PASSES = 4       # multi-program passes launched before the gather
SELECT_CAP = 1024       # entries gathered and sorted exactly once the bracket holds no more
SELECT_WARPS = 8
STREAM_WARPS = 8
KEPT_SUM_FLOOR = 1e-8
STATE_INTS = 8          # lo, hi, count >= lo, count >= hi, passes, active, gathered, (spare)
STATE_FLOATS = 4        # weight >= hi, total weight, target, (spare)
INT32_MAX = 2**31 - 1   # the kernels read top-k as int32


class SelectWorkspace(NamedTuple):
    """Per-row search state and per-slice partial results (see the module docstring):
    ``state_i`` [rows, 8] int32, ``state_f`` [rows, 4] float64, ``part_w`` [rows, splits,
    T] float64, ``part_c`` [rows, splits, T] int32, ``scratch`` [rows, CAP] int32,
    ``counters`` [rows] int32 (zero before the first kernel). Device addresses or tensors
    (:mod:`.launch`)."""

    state_i: object
    state_f: object
    part_w: object
    part_c: object
    scratch: object
    counters: object


def split_layout(rows: int, vocab: int, want: int | None = None) -> tuple[int, int]:
    """(slices per row, entries per slice) for the [rows, slices] kernels: ``want`` slices
    per row or fewer (by default enough for ``TARGET_PROGRAMS`` items, to fill the GPU),
    every slice a whole number of tiles and none empty."""
    tiles = max(1, -(-vocab // BLOCK))
    if want is None:
        want = -(-TARGET_PROGRAMS // max(rows, 1))
    splits = int(min(SPLIT_MAX, tiles, max(1, want)))
    per = -(-tiles // splits)
    return -(-tiles // per), per * BLOCK


def tunables() -> tuple:
    """The module's sizes as they are now (tests shrink them): part of every plan's key."""
    return (BLOCK, SPLIT_MAX, TARGET_PROGRAMS, SELECT_BLOCK, SELECT_THRESHOLDS, SELECT_PASSES, SELECT_CAP,
            SELECT_WARPS, STREAM_WARPS)


def select_slots(rows: int, splits: int, counters: bool = True) -> list:
    """The search's workspace slots, ``(name, dtype, shape)``, named as :class:`SelectWorkspace`'s
    fields (``counters`` as ``select_counters``; ``counters=False`` leaves them out, for a
    caller whose per-row counters live elsewhere)."""
    t = SELECT_THRESHOLDS
    slots = [("state_i", torch.int32, (rows, STATE_INTS)), ("state_f", torch.float64, (rows, STATE_FLOATS)),
             ("part_w", torch.float64, (rows, splits, t)), ("part_c", torch.int32, (rows, splits, t)),
             ("scratch", torch.int32, (rows, SELECT_CAP))]
    return slots + [("select_counters", torch.int32, (rows,))] if counters else slots


def select_launches(rows: int, vocab: int, src, pivots, ws: SelectWorkspace, top_k, top_p, d: int, splits: int,
                    chunk: int, stats=None) -> list:
    """The launches of the search that fills ``pivots`` [rows, 4] float32 with (top-k pivot,
    kept sum, top-p pivot, kept sum), as :meth:`~graphborrow.eagle.triton.launch.Launcher.run`
    takes them. Pointer arguments are device addresses or tensors alike (:mod:`.launch`).

    Args:
        rows, vocab: the source's shape.
        src: [rows, V] probabilities, or logits when ``stats`` is given.
        top_k: [rows / d] int32 or None; top_p: [rows / d] float32 or None (one per request).
            top_p is float32 as the reference takes it (and torch and flashinfer do), widened
            to float64 to compare with the kept mass: a float64 top_p would move the pivot of
            any row whose kept mass lies in [float32(top_p), top_p).
        d: rows per request.
        stats: ``(temps, part_max, part_sum, unscale)`` of the logits (see
            :mod:`graphborrow.eagle.triton.fused`), or None for probabilities.

    Returns:
        A list of ``(kernel, grid, args, options)``.
    """
    from_logits = stats is not None
    temps, part_max, part_sum, unscale = stats if from_logits else (pivots, pivots, pivots, 1.0)
    options = dict(num_warps=SELECT_WARPS, **compile_options())
    grid, per_row = (rows, splits, 1), (rows, 1, 1)
    launches = []
    for topp, param in ((False, top_k), (True, top_p)):
        if param is None:
            continue
        args = (src, temps, part_max, part_sum, param, pivots, *ws, d, vocab, splits, chunk, unscale,
                from_logits, topp, top_k is not None, SELECT_THRESHOLDS, SELECT_CAP, SELECT_BLOCK, BLOCK, SPLIT_MAX,
                not INTERPRETED)
        launches.append((_init_kernel, grid, args, options))
        launches += [(_pass_kernel, grid, args, options)] * SELECT_PASSES
        launches += [(_gather_kernel, grid, args, options), (_resolve_kernel, per_row, args, options),
                     (_kept_kernel, grid, args, options)]
    return launches


# ---------------------------------------------------------------------------------
# Standalone renorm (probabilities in, probabilities out)


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


class _RenormWorkspace:
    """A standalone renorm's workspace for eager calls on one stream: made (its counters
    zeroed) on first use; the search leaves its counters zeroed, so the next call reuses it
    as it is. ``numbers``: the top-k and top-p numbers its parameter slots hold (None: not
    known, e.g. a tensor's values), so a call with the same number fills nothing;
    ``launches``: the direct launches' fixed arguments, ``(call, head, tail)`` per kernel."""

    __slots__ = ("buffer", "views", "pointers", "numbers", "launches")

    def __init__(self, buffer: torch.Tensor, layout: Layout):
        self.buffer = buffer
        self.views = layout.views(buffer)
        self.pointers = layout.pointers(buffer)
        self.numbers = [None, None]
        self.launches = None


class _RenormPlan:
    """What the standalone renorm of one shape computes once: the split, the workspace's
    layout (the pivots, the search's slots, top-k and top-p per row), the compiled kernels,
    and the eager calls' workspaces by stream (``cached``)."""

    def __init__(self, rows: int, vocab: int, has_k: bool, has_p: bool):
        self.rows, self.vocab, self.has_k, self.has_p = rows, vocab, has_k, has_p
        self.splits, self.chunk = split_layout(rows, vocab)
        # the parameter slots go last: placed before the search's slots they moved its state by
        # 128 bytes, and on the H200 the passes of an 8-row renorm took 39 % longer (docs/kernels.md)
        self.layout = Layout([("pivots", torch.float32, (rows, 4))] + select_slots(rows, self.splits)
                             + [("top_k", torch.int32, (rows if has_k else 0,)),
                                ("top_p", torch.float32, (rows if has_p else 0,))])
        self.launcher = Launcher()
        self.cached: dict = {}

    def workspace(self, like: torch.Tensor, stream: int) -> _RenormWorkspace:
        """The workspace eager calls on ``stream`` share (calls on one stream run one after
        another). Never used while a graph is captured: a graph would keep its address and
        could replay on another stream. :func:`clear_plans` drops it."""
        entry = self.cached.get(stream)
        if entry is None:
            buffer = self.layout.allocate(like)
            self.layout.view(buffer, "select_counters").zero_()
            entry = self.cached[stream] = _RenormWorkspace(buffer, self.layout)
        return entry

    def launches(self, src, dst, w) -> list:
        """The renorm's launches, ``(kernel, grid, args, options)`` each (pointers or tensors)."""
        search = SelectWorkspace(w.state_i, w.state_f, w.part_w, w.part_c, w.scratch, w.select_counters)
        launches = select_launches(self.rows, self.vocab, src, w.pivots, search, w.top_k if self.has_k else None,
                                   w.top_p if self.has_p else None, 1, self.splits, self.chunk)
        launches.append((_apply_kernel, (self.rows, self.splits, 1),
                         (src, w.pivots, dst, self.vocab, self.chunk, self.has_k, self.has_p, BLOCK),
                         dict(num_warps=STREAM_WARPS, **compile_options())))
        return launches

    def direct_launches(self, entry: _RenormWorkspace, device: int) -> list:
        """``entry``'s direct launches, made once, ``(call, leading, trailing)`` each: the
        search's launched as ``call(*leading, src, *trailing)``, the apply kernel's (the last)
        as ``call(*leading, src, pivots, dst, *trailing)``. Every other argument is fixed by
        the plan and workspace: packed once into a
        :class:`~graphborrow.eagle.triton.direct.KernelLaunch` where the direct module
        applies, else passed to the compiled kernel's C launcher with its grid, stream and
        handles before them."""
        if entry.launches is None:
            stream = current_stream(device)
            compiled = self.launcher.compiled
            entry.launches = []
            for i, (kernel, (_, grid, args, _)) in enumerate(zip(compiled, self.launches(0, 0, entry.pointers))):
                per_call = 3 if i == len(compiled) - 1 else 1  # (the apply kernel: source, pivots, output)
                packed = None
                if not direct_disabled():
                    packed = kernel_launch(kernel, device, tuple(grid), stream, per_call, tuple(args[per_call:]))
                if packed is not None:
                    entry.launches.append((packed.launch, (), ()))
                else:
                    call, leading = bound_call(kernel)
                    entry.launches.append((call, (*grid, stream, *leading), tuple(args[per_call:])))
        return entry.launches


_RENORM_PLANS = PlanCache(_RenormPlan)


def clear_plans() -> None:
    """Forget the standalone renorm's cached plans (their compiled-kernel handles and cached workspaces)."""
    _RENORM_PLANS.clear()


def _renorm(probs, top_k, top_p, validate):
    """Checks, then the search and the apply kernel. An eager call on CUDA reuses its plan's
    workspace for the current stream (and its parameter slots when the number is the same as
    last time) and, once the kernels are compiled, launches them directly: it allocates the
    output only, and its host time is the launches'."""
    if not isinstance(probs, torch.Tensor) or probs.dim() != 2 or probs.dtype != torch.float32:
        raise ValueError("probs must be a float32 tensor [rows, vocab]; convert with .float() and reshape first")
    if not probs.is_contiguous():
        raise ValueError("probs must be contiguous; call .contiguous() first")
    if not TRITON_AVAILABLE:
        raise RuntimeError("top_k_renorm / top_p_renorm need triton (the 'kernels' extra)")
    rows, vocab = probs.shape
    k = None if top_k is None else per_request_value(top_k, rows, "top_k", torch.int32)
    p = None if top_p is None else per_request_value(top_p, rows, "top_p", torch.float32)
    if validate:
        if k is not None and (any_true((k < 1) | (k > INT32_MAX)) if isinstance(k, torch.Tensor) else k < 1):
            raise ValueError(f"top_k must be >= 1 and < 2**31 (a value >= the vocabulary {vocab} keeps all)")
        if p is not None and (any_true(~(p > 0) | (p > 1)) if isinstance(p, torch.Tensor) else not 0 < p <= 1):
            raise ValueError("top_p must be in (0, 1] (1 keeps all)")
        if any_true(~torch.isfinite(probs)) or any_true(probs < 0):
            raise ValueError("probs must be finite and >= 0")
    device = probs.get_device()
    plan = _RENORM_PLANS.get((rows, vocab, k is not None, p is not None, device, tunables()),
                             rows, vocab, k is not None, p is not None)
    if probs.is_cuda and capturing_now():  # a fresh workspace, its counters zeroed, inside the graph
        entry = _RenormWorkspace(plan.layout.allocate(probs), plan.layout)
        entry.views.select_counters.zero_()
    else:
        entry = plan.workspace(probs, 0 if INTERPRETED else current_stream(device))
    for i, (name, value) in enumerate((("top_k", k), ("top_p", p))):
        if isinstance(value, torch.Tensor):
            getattr(entry.views, name).copy_(value.reshape(-1).expand(rows))
            entry.numbers[i] = None
        elif value is not None and entry.numbers[i] != value:
            getattr(entry.views, name).fill_(value)
            entry.numbers[i] = value
    out = torch.empty_like(probs)
    launcher = plan.launcher
    src, dst = probs.data_ptr(), out.data_ptr()
    if launcher.direct(device, aligned(src, dst)):
        *search, (apply, head, tail) = plan.direct_launches(entry, device)
        for call, lead, rest in search:
            call(*lead, src, *rest)
        apply(*head, src, entry.pointers.pivots, dst, *tail)
    else:
        launcher.run(plan.launches(probs, out, entry.views))
    return out


# ---------------------------------------------------------------------------------
# Kernels

if TRITON_AVAILABLE:
    _FLOOR = tl.constexpr(KEPT_SUM_FLOOR)  # jitted code reads only constexpr globals
    _KEY_MIN = tl.constexpr(-0x7FFFFFFF - 1)
    _KEY_MAX = tl.constexpr(0x7FFFFFFF)
    _NI = tl.constexpr(STATE_INTS)
    _NF = tl.constexpr(STATE_FLOATS)
    RUN = tl.constexpr(SELECT_RUN)

    @triton.jit
    def _context(temps, part_max, part_sum, pivots, row, d, splits, unscale,
                 FROM_LOGITS: tl.constexpr, TOPP: tl.constexpr, HAS_TOPK: tl.constexpr, SPLIT_BLOCK: tl.constexpr):
        """What turns a row's source values into the values being selected on."""
        t = 1.0
        big = 0.0
        total = 1.0
        pk = 0.0
        sk = 1.0
        if FROM_LOGITS:
            t = tl.load(temps + row // d, cache_modifier=".cg")
            big, total = row_norm(part_max, part_sum, row, splits, t, unscale, SPLIT_BLOCK)
        if TOPP and HAS_TOPK:
            pk = tl.load(pivots + row * 4 + 0, cache_modifier=".cg")
            sk = tl.load(pivots + row * 4 + 1, cache_modifier=".cg")
        return t, big, total, pk, sk

    @triton.jit
    def _value(x, t, big, total, pk, sk, FROM_LOGITS: tl.constexpr, TOPP: tl.constexpr, HAS_TOPK: tl.constexpr,
               PRECISE: tl.constexpr):
        """The probability being selected on: p (top-k), or p after top-k (top-p)."""
        if FROM_LOGITS:
            v = prob(x, t, big, total, PRECISE)
        else:
            v = x
        if TOPP:
            v = renormed(v, pk, sk, 0.0, 1.0, HAS_TOPK, False)
        return v

    @triton.jit
    def _thresholds(lo, hi, by_value, NT: tl.constexpr):
        """NT keys strictly inside (lo, hi): evenly spread by float value, or by key."""
        j = tl.arange(0, NT)
        flo = key_float(lo)
        fhi = key_float(hi - 1)
        span = fhi - flo
        k_value = float_key(flo + span * ((j + 1).to(tl.float32) / (NT + 1)))
        width = hi.to(tl.int64) - lo.to(tl.int64)
        k_span = (lo.to(tl.int64) + (width * (j + 1).to(tl.int64)) // (NT + 1)).to(tl.int32)
        finite = tl.abs(span) < float("inf")
        thr = tl.where(by_value & finite, k_value, k_span)
        return tl.minimum(tl.maximum(thr, lo + 1), hi - 1)

    @triton.jit
    def _weights_at(base, lo_idx, hi_idx, thr, t, big, total, pk, sk,
                    FROM_LOGITS: tl.constexpr, TOPP: tl.constexpr, HAS_TOPK: tl.constexpr, NT: tl.constexpr,
                    BLOCK_S: tl.constexpr, PRECISE: tl.constexpr):
        """Weight (count, or float64 mass for top-p) and count of the entries in
        [lo_idx, hi_idx) whose key is >= each threshold.

        Each thread keeps its own NT partial sums over the entries it visits (a tile is RUN
        coalesced runs of BLOCK_S / RUN entries, one entry per thread in each run), so the
        sums cross threads once per call, not once per tile."""
        lanes = tl.arange(0, BLOCK_S // RUN)
        thr2 = thr[:, None]
        part_w = tl.zeros([NT, BLOCK_S // RUN], tl.float64)
        part_c = tl.zeros([NT, BLOCK_S // RUN], tl.int32)
        for start in range(lo_idx, hi_idx, BLOCK_S):
            for run in tl.static_range(RUN):
                idx = start + run * (BLOCK_S // RUN) + lanes
                valid = idx < hi_idx
                x = tl.load(base + idx, mask=valid, other=0.0).to(tl.float32)
                key = tl.where(valid, float_key(x), _KEY_MIN)  # thresholds exceed lo >= _KEY_MIN: never above
                above = key[None, :] >= thr2
                part_c += above.to(tl.int32)
                if TOPP:
                    v = _value(x, t, big, total, pk, sk, FROM_LOGITS, TOPP, HAS_TOPK, PRECISE)
                    part_w += tl.where(above, v.to(tl.float64)[None, :], 0.0)
        counts = tl.sum(part_c, axis=1)
        if TOPP:
            weights = tl.sum(part_w, axis=1)
        else:
            weights = counts.to(tl.float64)
        return weights, counts

    @triton.jit
    def _narrow(lo, hi, c_lo, c_hi, w_hi, thr, w, c, target):
        """The bracket after one pass: W(lo) >= target > W(hi) still holds."""
        ok = w >= target
        new_lo = tl.max(tl.where(ok, thr, lo), axis=0)
        new_hi = tl.min(tl.where(ok, hi, thr), axis=0)
        c_lo = tl.where(new_lo == lo, c_lo, tl.max(tl.where(thr == new_lo, c, -1), axis=0))
        c_hi = tl.where(new_hi == hi, c_hi, tl.max(tl.where(thr == new_hi, c, -1), axis=0))
        w_hi = tl.where(new_hi == hi, w_hi, tl.max(tl.where(thr == new_hi, w, -1.0), axis=0))
        return new_lo, new_hi, c_lo, c_hi, w_hi

    @triton.jit
    def _gather(base, lo_idx, hi_idx, lo, hi, out, slot_counter, ATOMIC: tl.constexpr,
                BLOCK_S: tl.constexpr, CAP: tl.constexpr):
        """Copy the keys in [lo, hi) of entries [lo_idx, hi_idx) to ``out`` (at most CAP): at
        slots reserved with an atomic (many programs), or from the start (one program)."""
        offs = tl.arange(0, BLOCK_S)
        written = tl.zeros([], tl.int32)
        for start in range(lo_idx, hi_idx, BLOCK_S):
            idx = start + offs
            valid = idx < hi_idx
            key = float_key(tl.load(base + idx, mask=valid, other=0.0).to(tl.float32))
            inside = (key >= lo) & (key < hi) & valid
            n = tl.sum(inside.to(tl.int32), axis=0)
            if n > 0:
                if ATOMIC:
                    first = tl.atomic_add(slot_counter, n, sem="relaxed")
                else:
                    first = written
                pos = first + tl.cumsum(inside.to(tl.int32), axis=0) - 1
                tl.store(out + pos, key, mask=inside & (pos < CAP))
                written += n

    @triton.jit
    def _pick(out, n, lo, w_hi, target, t, big, total, pk, sk,
              FROM_LOGITS: tl.constexpr, TOPP: tl.constexpr, HAS_TOPK: tl.constexpr, CAP: tl.constexpr,
              PRECISE: tl.constexpr):
        """Sort the n gathered keys, walk down from W(hi) and return the first key reaching target."""
        cap_offs = tl.arange(0, CAP)
        inside = cap_offs < n
        keys = tl.sort(tl.load(out + cap_offs, mask=inside, other=_KEY_MIN, cache_modifier=".cg"), descending=True)
        if TOPP:
            v = _value(key_float(keys), t, big, total, pk, sk, FROM_LOGITS, TOPP, HAS_TOPK, PRECISE)
            wts = tl.where(inside, v.to(tl.float64), 0.0)
        else:
            wts = tl.where(inside, 1.0, 0.0).to(tl.float64)
        reach = (w_hi + tl.cumsum(wts, axis=0) >= target) & inside
        first = tl.min(tl.where(reach, cap_offs, CAP), axis=0)
        return tl.where(first < CAP, tl.sum(tl.where(cap_offs == first, keys, 0), axis=0), lo)

    @triton.jit
    def arrive(counters, row, splits):
        """Count this program in; True for the row's last one (which resets the counter)."""
        tl.debug_barrier()
        done = tl.atomic_add(counters + row, 1, sem="acq_rel")
        last = done == splits - 1
        if last:
            tl.store(counters + row, 0)
        return last

    # Each step of the search is an *item* function of one (row, slice) (``resolve_item``: of
    # one row) returning whether this program was the row's last to arrive (and so acted for
    # it): the kernels below run one item per program; the fused verification's persistent
    # kernel (:mod:`.fused`) runs them as the items of its work queue. Every load of state
    # another program wrote bypasses L1 (``.cg``): within one persistent launch an SM may
    # hold an older copy of it.

    @triton.jit
    def init_item(row, c, src, temps, part_max, part_sum, param, pivots, state_i, state_f, part_w, part_c, scratch,
                  counters, d, vocab, splits, chunk, unscale,
                  FROM_LOGITS: tl.constexpr, TOPP: tl.constexpr, HAS_TOPK: tl.constexpr, NT: tl.constexpr,
                  CAP: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK: tl.constexpr, SPLIT_BLOCK: tl.constexpr,
                  PRECISE: tl.constexpr):
        """Per slice: smallest and largest key in play, their count and total weight; then the bracket."""
        t, big, total, pk, sk = _context(temps, part_max, part_sum, pivots, row, d, splits, unscale,
                                         FROM_LOGITS, TOPP, HAS_TOPK, SPLIT_BLOCK)
        base = src + row.to(tl.int64) * vocab
        lo_idx = c * chunk
        hi_idx = tl.minimum(lo_idx + chunk, vocab)
        offs = tl.arange(0, BLOCK)
        kmin = tl.full([BLOCK], _KEY_MAX, tl.int32)
        kmax = tl.full([BLOCK], _KEY_MIN, tl.int32)
        n = tl.zeros([BLOCK], tl.int32)
        w = tl.zeros([BLOCK], tl.float64)
        for start in range(lo_idx, hi_idx, BLOCK):
            idx = start + offs
            valid = idx < hi_idx
            x = tl.load(base + idx, mask=valid, other=0.0).to(tl.float32)
            key = float_key(x)
            if TOPP:  # in play: positive weight (an upper set of keys: p is monotone in x)
                v = _value(x, t, big, total, pk, sk, FROM_LOGITS, TOPP, HAS_TOPK, PRECISE)
                play = valid & (v > 0)
                w += tl.where(play, v.to(tl.float64), 0.0)
            else:
                play = valid
                w += play.to(tl.float64)
            kmin = tl.minimum(kmin, tl.where(play, key, _KEY_MAX))
            kmax = tl.maximum(kmax, tl.where(play, key, _KEY_MIN))
            n += play.to(tl.int32)
        part = (row.to(tl.int64) * splits + c) * NT
        tl.store(part_c + part + 0, tl.min(kmin, axis=0))
        tl.store(part_c + part + 1, tl.max(kmax, axis=0))
        tl.store(part_c + part + 2, tl.sum(n, axis=0))
        tl.store(part_w + part + 0, tl.sum(w, axis=0))
        last = arrive(counters, row, splits)
        if last:
            s = tl.arange(0, SPLIT_BLOCK)
            parts = (row.to(tl.int64) * splits + s) * NT
            ok = s < splits
            lo = tl.min(tl.load(part_c + parts + 0, mask=ok, other=_KEY_MAX, cache_modifier=".cg"), axis=0)
            hi = tl.max(tl.load(part_c + parts + 1, mask=ok, other=_KEY_MIN, cache_modifier=".cg"), axis=0) + 1
            count = tl.sum(tl.load(part_c + parts + 2, mask=ok, other=0, cache_modifier=".cg"), axis=0)
            whole = tl.sum(tl.load(part_w + parts + 0, mask=ok, other=0.0, cache_modifier=".cg"), axis=0)
            target = tl.load(param + row // d, cache_modifier=".cg").to(tl.float64)
            if TOPP:
                active = (target < 1.0) & (whole >= target) & (count > 0)
            else:
                active = target < vocab
            si = state_i + row * _NI
            tl.store(si + 0, lo)
            tl.store(si + 1, hi)
            tl.store(si + 2, count)
            tl.store(si + 3, 0)
            tl.store(si + 4, 0)
            tl.store(si + 5, active.to(tl.int32))
            tl.store(si + 6, 0)
            sf = state_f + row * _NF
            tl.store(sf + 0, 0.0)
            tl.store(sf + 1, whole)
            tl.store(sf + 2, target)
        return last

    @triton.jit
    def pass_item(row, c, src, temps, part_max, part_sum, param, pivots, state_i, state_f, part_w, part_c, scratch,
                  counters, d, vocab, splits, chunk, unscale,
                  FROM_LOGITS: tl.constexpr, TOPP: tl.constexpr, HAS_TOPK: tl.constexpr, NT: tl.constexpr,
                  CAP: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK: tl.constexpr, SPLIT_BLOCK: tl.constexpr,
                  PRECISE: tl.constexpr):
        """One k-ary step of the search over this slice; the row's last narrows the bracket.
        (A row already narrowed enough, or inactive, only counts its programs in.)"""
        si = state_i + row * _NI
        lo = tl.load(si + 0, cache_modifier=".cg")
        hi = tl.load(si + 1, cache_modifier=".cg")
        c_lo = tl.load(si + 2, cache_modifier=".cg")
        c_hi = tl.load(si + 3, cache_modifier=".cg")
        passes = tl.load(si + 4, cache_modifier=".cg")
        active = tl.load(si + 5, cache_modifier=".cg")
        work = (active != 0) & (hi.to(tl.int64) - lo > 1) & (c_lo - c_hi > CAP)
        by_value = (passes % 2) == (1 if TOPP else 0)  # top-p starts by key (masses span octaves)
        thr = _thresholds(lo, hi, by_value, NT)
        j = tl.arange(0, NT)
        if work:
            t, big, total, pk, sk = _context(temps, part_max, part_sum, pivots, row, d, splits, unscale,
                                             FROM_LOGITS, TOPP, HAS_TOPK, SPLIT_BLOCK)
            lo_idx = c * chunk
            w, cnt = _weights_at(src + row.to(tl.int64) * vocab, lo_idx, tl.minimum(lo_idx + chunk, vocab), thr,
                                 t, big, total, pk, sk, FROM_LOGITS, TOPP, HAS_TOPK, NT, BLOCK_S, PRECISE)
            part = (row.to(tl.int64) * splits + c) * NT
            tl.store(part_w + part + j, w)
            tl.store(part_c + part + j, cnt)
        last = arrive(counters, row, splits)
        if last & work:
            s = tl.arange(0, SPLIT_BLOCK)
            grid = (row.to(tl.int64) * splits + s)[:, None] * NT + j[None, :]
            ok = (s < splits)[:, None]
            w = tl.sum(tl.load(part_w + grid, mask=ok, other=0.0, cache_modifier=".cg"), axis=0)
            cnt = tl.sum(tl.load(part_c + grid, mask=ok, other=0, cache_modifier=".cg"), axis=0)
            sf = state_f + row * _NF
            lo, hi, c_lo, c_hi, w_hi = _narrow(lo, hi, c_lo, c_hi, tl.load(sf + 0, cache_modifier=".cg"), thr, w,
                                               cnt, tl.load(sf + 2, cache_modifier=".cg"))
            tl.store(si + 0, lo)
            tl.store(si + 1, hi)
            tl.store(si + 2, c_lo)
            tl.store(si + 3, c_hi)
            tl.store(si + 4, passes + 1)
            tl.store(sf + 0, w_hi)
        return last

    @triton.jit
    def gather_item(row, c, src, temps, part_max, part_sum, param, pivots, state_i, state_f, part_w, part_c, scratch,
                    counters, d, vocab, splits, chunk, unscale,
                    FROM_LOGITS: tl.constexpr, TOPP: tl.constexpr, HAS_TOPK: tl.constexpr, NT: tl.constexpr,
                    CAP: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK: tl.constexpr, SPLIT_BLOCK: tl.constexpr,
                    PRECISE: tl.constexpr):
        """Copy the bracket's entries in this slice into the row's scratch (rows the passes
        narrowed enough)."""
        si = state_i + row * _NI
        lo = tl.load(si + 0, cache_modifier=".cg")
        hi = tl.load(si + 1, cache_modifier=".cg")
        c_lo = tl.load(si + 2, cache_modifier=".cg")
        c_hi = tl.load(si + 3, cache_modifier=".cg")
        active = tl.load(si + 5, cache_modifier=".cg")
        if (active != 0) & (hi.to(tl.int64) - lo > 1) & (c_lo - c_hi <= CAP):
            lo_idx = c * chunk
            _gather(src + row.to(tl.int64) * vocab, lo_idx, tl.minimum(lo_idx + chunk, vocab), lo, hi,
                    scratch + row.to(tl.int64) * CAP, si + 6, True, BLOCK, CAP)
        return arrive(counters, row, splits)

    @triton.jit
    def resolve_item(row, src, temps, part_max, part_sum, param, pivots, state_i, state_f, part_w, part_c, scratch,
                     counters, d, vocab, splits, chunk, unscale,
                     FROM_LOGITS: tl.constexpr, TOPP: tl.constexpr, HAS_TOPK: tl.constexpr, NT: tl.constexpr,
                     CAP: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK: tl.constexpr, SPLIT_BLOCK: tl.constexpr,
                     PRECISE: tl.constexpr):
        """One row: sort the gathered entries and store the pivot (finishing the search first
        where the passes left more than CAP entries in the bracket)."""
        si = state_i + row * _NI
        sf = state_f + row * _NF
        lo = tl.load(si + 0, cache_modifier=".cg")
        hi = tl.load(si + 1, cache_modifier=".cg")
        c_lo = tl.load(si + 2, cache_modifier=".cg")
        c_hi = tl.load(si + 3, cache_modifier=".cg")
        passes = tl.load(si + 4, cache_modifier=".cg")
        active = tl.load(si + 5, cache_modifier=".cg")
        w_hi = tl.load(sf + 0, cache_modifier=".cg")
        target = tl.load(sf + 2, cache_modifier=".cg")
        base = src + row.to(tl.int64) * vocab
        out = scratch + row.to(tl.int64) * CAP
        pivot = 0.0  # inactive: keep everything
        if active != 0:
            t, big, total, pk, sk = _context(temps, part_max, part_sum, pivots, row, d, splits, unscale,
                                             FROM_LOGITS, TOPP, HAS_TOPK, SPLIT_BLOCK)
            if (hi.to(tl.int64) - lo > 1) & (c_lo - c_hi > CAP):
                while (hi.to(tl.int64) - lo > 1) & (c_lo - c_hi > CAP):
                    thr = _thresholds(lo, hi, (passes % 2) == (1 if TOPP else 0), NT)
                    w, cnt = _weights_at(base, 0, vocab, thr, t, big, total, pk, sk,
                                         FROM_LOGITS, TOPP, HAS_TOPK, NT, BLOCK_S, PRECISE)
                    lo, hi, c_lo, c_hi, w_hi = _narrow(lo, hi, c_lo, c_hi, w_hi, thr, w, cnt, target)
                    passes += 1
                if hi.to(tl.int64) - lo > 1:
                    _gather(base, 0, vocab, lo, hi, out, si + 6, False, BLOCK, CAP)
                    tl.debug_barrier()
            key = lo
            if hi.to(tl.int64) - lo > 1:
                key = _pick(out, c_lo - c_hi, lo, w_hi, target, t, big, total, pk, sk,
                            FROM_LOGITS, TOPP, HAS_TOPK, CAP, PRECISE)
            pivot = _value(key_float(key), t, big, total, pk, sk, FROM_LOGITS, TOPP, HAS_TOPK, PRECISE)
        tl.store(pivots + row * 4 + (2 if TOPP else 0), pivot)

    @triton.jit
    def kept_item(row, c, src, temps, part_max, part_sum, param, pivots, state_i, state_f, part_w, part_c, scratch,
                  counters, d, vocab, splits, chunk, unscale,
                  FROM_LOGITS: tl.constexpr, TOPP: tl.constexpr, HAS_TOPK: tl.constexpr, NT: tl.constexpr,
                  CAP: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK: tl.constexpr, SPLIT_BLOCK: tl.constexpr,
                  PRECISE: tl.constexpr):
        """float64 sum of the kept values (>= pivot) in this slice; the row's last stores it, floored."""
        t, big, total, pk, sk = _context(temps, part_max, part_sum, pivots, row, d, splits, unscale,
                                         FROM_LOGITS, TOPP, HAS_TOPK, SPLIT_BLOCK)
        slot = 2 if TOPP else 0
        pivot = tl.load(pivots + row * 4 + slot, cache_modifier=".cg")
        base = src + row.to(tl.int64) * vocab
        lo_idx = c * chunk
        hi_idx = tl.minimum(lo_idx + chunk, vocab)
        offs = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], tl.float64)
        for start in range(lo_idx, hi_idx, BLOCK):
            idx = start + offs
            valid = idx < hi_idx
            x = tl.load(base + idx, mask=valid, other=0.0).to(tl.float32)
            v = _value(x, t, big, total, pk, sk, FROM_LOGITS, TOPP, HAS_TOPK, PRECISE)
            acc += tl.where(valid & (v >= pivot), v.to(tl.float64), 0.0)
        part = (row.to(tl.int64) * splits + c) * NT
        tl.store(part_w + part, tl.sum(acc, axis=0))
        last = arrive(counters, row, splits)
        if last:
            s = tl.arange(0, SPLIT_BLOCK)
            kept = tl.sum(tl.load(part_w + (row.to(tl.int64) * splits + s) * NT, mask=s < splits, other=0.0,
                                  cache_modifier=".cg"), axis=0)
            tl.store(pivots + row * 4 + slot + 1, tl.maximum(kept, _FLOOR).to(tl.float32))
        return last

    @triton.jit(do_not_specialize=["d", "splits"])
    def _init_kernel(src, temps, part_max, part_sum, param, pivots, state_i, state_f, part_w, part_c, scratch,
                     counters, d, vocab, splits, chunk, unscale,
                     FROM_LOGITS: tl.constexpr, TOPP: tl.constexpr, HAS_TOPK: tl.constexpr, NT: tl.constexpr,
                     CAP: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK: tl.constexpr, SPLIT_BLOCK: tl.constexpr,
                     PRECISE: tl.constexpr):
        init_item(tl.program_id(0), tl.program_id(1), src, temps, part_max, part_sum, param, pivots, state_i,
                  state_f, part_w, part_c, scratch, counters, d, vocab, splits, chunk, unscale, FROM_LOGITS, TOPP,
                  HAS_TOPK, NT, CAP, BLOCK_S, BLOCK, SPLIT_BLOCK, PRECISE)

    @triton.jit(do_not_specialize=["d", "splits"])
    def _pass_kernel(src, temps, part_max, part_sum, param, pivots, state_i, state_f, part_w, part_c, scratch,
                     counters, d, vocab, splits, chunk, unscale,
                     FROM_LOGITS: tl.constexpr, TOPP: tl.constexpr, HAS_TOPK: tl.constexpr, NT: tl.constexpr,
                     CAP: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK: tl.constexpr, SPLIT_BLOCK: tl.constexpr,
                     PRECISE: tl.constexpr):
        pass_item(tl.program_id(0), tl.program_id(1), src, temps, part_max, part_sum, param, pivots, state_i,
                  state_f, part_w, part_c, scratch, counters, d, vocab, splits, chunk, unscale, FROM_LOGITS, TOPP,
                  HAS_TOPK, NT, CAP, BLOCK_S, BLOCK, SPLIT_BLOCK, PRECISE)

    @triton.jit(do_not_specialize=["d", "splits"])
    def _gather_kernel(src, temps, part_max, part_sum, param, pivots, state_i, state_f, part_w, part_c, scratch,
                       counters, d, vocab, splits, chunk, unscale,
                       FROM_LOGITS: tl.constexpr, TOPP: tl.constexpr, HAS_TOPK: tl.constexpr, NT: tl.constexpr,
                       CAP: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK: tl.constexpr, SPLIT_BLOCK: tl.constexpr,
                       PRECISE: tl.constexpr):
        gather_item(tl.program_id(0), tl.program_id(1), src, temps, part_max, part_sum, param, pivots, state_i,
                    state_f, part_w, part_c, scratch, counters, d, vocab, splits, chunk, unscale, FROM_LOGITS, TOPP,
                    HAS_TOPK, NT, CAP, BLOCK_S, BLOCK, SPLIT_BLOCK, PRECISE)

    @triton.jit(do_not_specialize=["d", "splits"])
    def _resolve_kernel(src, temps, part_max, part_sum, param, pivots, state_i, state_f, part_w, part_c, scratch,
                        counters, d, vocab, splits, chunk, unscale,
                        FROM_LOGITS: tl.constexpr, TOPP: tl.constexpr, HAS_TOPK: tl.constexpr, NT: tl.constexpr,
                        CAP: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK: tl.constexpr, SPLIT_BLOCK: tl.constexpr,
                        PRECISE: tl.constexpr):
        resolve_item(tl.program_id(0), src, temps, part_max, part_sum, param, pivots, state_i, state_f, part_w,
                     part_c, scratch, counters, d, vocab, splits, chunk, unscale, FROM_LOGITS, TOPP, HAS_TOPK, NT,
                     CAP, BLOCK_S, BLOCK, SPLIT_BLOCK, PRECISE)

    @triton.jit(do_not_specialize=["d", "splits"])
    def _kept_kernel(src, temps, part_max, part_sum, param, pivots, state_i, state_f, part_w, part_c, scratch,
                     counters, d, vocab, splits, chunk, unscale,
                     FROM_LOGITS: tl.constexpr, TOPP: tl.constexpr, HAS_TOPK: tl.constexpr, NT: tl.constexpr,
                     CAP: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK: tl.constexpr, SPLIT_BLOCK: tl.constexpr,
                     PRECISE: tl.constexpr):
        kept_item(tl.program_id(0), tl.program_id(1), src, temps, part_max, part_sum, param, pivots, state_i,
                  state_f, part_w, part_c, scratch, counters, d, vocab, splits, chunk, unscale, FROM_LOGITS, TOPP,
                  HAS_TOPK, NT, CAP, BLOCK_S, BLOCK, SPLIT_BLOCK, PRECISE)

    @triton.jit
    def _apply_kernel(probs, pivots, out, vocab, chunk, HAS_TOPK: tl.constexpr, HAS_TOPP: tl.constexpr,
                      BLOCK: tl.constexpr):
        row = tl.program_id(0)
        c = tl.program_id(1)
        pk = tl.load(pivots + row * 4 + 0)
        sk = tl.load(pivots + row * 4 + 1)
        pp = tl.load(pivots + row * 4 + 2)
        sp = tl.load(pivots + row * 4 + 3)
        offs = tl.arange(0, BLOCK)
        lo = c * chunk
        hi = tl.minimum(lo + chunk, vocab)
        base = row.to(tl.int64) * vocab
        for start in range(lo, hi, BLOCK):
            idx = start + offs
            inside = idx < hi
            p = tl.load(probs + base + idx, mask=inside, other=0.0)
            tl.store(out + base + idx, renormed(p, pk, sk, pp, sp, HAS_TOPK, HAS_TOPP), mask=inside)
