"""Top-k / top-p pivots without a sort: a k-ary search over float keys, parallel over vocabulary slices.

flashinfer's renormalisation (see :mod:`graphborrow.eagle.renorm`) keeps each row's entries at
or above a pivot: the k-th largest probability (top-k), or the largest value v whose
mass ``W(v) = sum(p >= v)`` reaches top_p (top-p). Both are "the largest key whose
weight W reaches a target", W a count or a float64 mass. The search narrows a bracket
[lo, hi) of float keys with ``W(lo) >= target > W(hi)``:

1. ``init_kernel`` — per slice of each row: the smallest and largest key in play and
   the total weight; the row's last slice to finish sets the bracket;
2. ``pass_kernel`` (``SELECT_PASSES`` launches) — per slice: the weight at or above
   ``SELECT_THRESHOLDS`` thresholds spread inside the bracket (alternately by value and
   by key); the last slice sums the slices in a fixed order and narrows the bracket;
3. ``gather_kernel`` — once at most ``SELECT_CAP`` entries lie inside, every slice
   copies its entries there into a scratch row (at slots reserved with an atomic);
4. ``resolve_kernel`` — one program per row sorts them and walks down exactly. A row the
   passes did not narrow enough is finished there alone, pass after pass over the whole
   row (slow, always exact);
5. ``kept_kernel`` — the float64 sum of the kept probabilities, floored at 1e-8.

"The last slice to finish" is an atomic counter per row: each program stores its
partial result, then increments; the one that sees ``splits - 1`` reads them all,
acts for the row and resets the counter. Nothing synchronises with the host.

The kernels read either probabilities (the standalone renorms of
:mod:`graphborrow.eagle.triton.fused_renorm`, which end with ``apply_kernel``) or logits
with their row statistics (the fused verification, ``FROM_LOGITS``), where p is computed
on the fly by the formula of :mod:`graphborrow.eagle.triton.formula`. p is a non-decreasing
function of the logit, so the search runs on logit keys: the k-th largest p is p of the k-th
largest logit, and top-p's pivot is p of the largest logit whose mass reaches the target.
"""

from __future__ import annotations

from .runtime import TRITON_AVAILABLE

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

    from .formula import float_key, key_float, prob, renormed, row_norm

__all__ = ["KEPT_SUM_FLOOR", "SELECT_RUN", "STATE_FLOATS", "STATE_INTS"]

SELECT_RUN = 4          # coalesced runs per tile: each thread takes one entry of each
KEPT_SUM_FLOOR = 1e-8
STATE_INTS = 8          # lo, hi, count >= lo, count >= hi, passes, active, gathered, (spare)
STATE_FLOATS = 4        # weight >= hi, total weight, target, (spare)

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
    def init_kernel(src, temps, part_max, part_sum, param, pivots, state_i, state_f, part_w, part_c, scratch,
                     counters, d, vocab, splits, chunk, unscale,
                     FROM_LOGITS: tl.constexpr, TOPP: tl.constexpr, HAS_TOPK: tl.constexpr, NT: tl.constexpr,
                     CAP: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK: tl.constexpr, SPLIT_BLOCK: tl.constexpr,
                     PRECISE: tl.constexpr):
        init_item(tl.program_id(0), tl.program_id(1), src, temps, part_max, part_sum, param, pivots, state_i,
                  state_f, part_w, part_c, scratch, counters, d, vocab, splits, chunk, unscale, FROM_LOGITS, TOPP,
                  HAS_TOPK, NT, CAP, BLOCK_S, BLOCK, SPLIT_BLOCK, PRECISE)

    @triton.jit(do_not_specialize=["d", "splits"])
    def pass_kernel(src, temps, part_max, part_sum, param, pivots, state_i, state_f, part_w, part_c, scratch,
                     counters, d, vocab, splits, chunk, unscale,
                     FROM_LOGITS: tl.constexpr, TOPP: tl.constexpr, HAS_TOPK: tl.constexpr, NT: tl.constexpr,
                     CAP: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK: tl.constexpr, SPLIT_BLOCK: tl.constexpr,
                     PRECISE: tl.constexpr):
        pass_item(tl.program_id(0), tl.program_id(1), src, temps, part_max, part_sum, param, pivots, state_i,
                  state_f, part_w, part_c, scratch, counters, d, vocab, splits, chunk, unscale, FROM_LOGITS, TOPP,
                  HAS_TOPK, NT, CAP, BLOCK_S, BLOCK, SPLIT_BLOCK, PRECISE)

    @triton.jit(do_not_specialize=["d", "splits"])
    def gather_kernel(src, temps, part_max, part_sum, param, pivots, state_i, state_f, part_w, part_c, scratch,
                       counters, d, vocab, splits, chunk, unscale,
                       FROM_LOGITS: tl.constexpr, TOPP: tl.constexpr, HAS_TOPK: tl.constexpr, NT: tl.constexpr,
                       CAP: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK: tl.constexpr, SPLIT_BLOCK: tl.constexpr,
                       PRECISE: tl.constexpr):
        gather_item(tl.program_id(0), tl.program_id(1), src, temps, part_max, part_sum, param, pivots, state_i,
                    state_f, part_w, part_c, scratch, counters, d, vocab, splits, chunk, unscale, FROM_LOGITS, TOPP,
                    HAS_TOPK, NT, CAP, BLOCK_S, BLOCK, SPLIT_BLOCK, PRECISE)

    @triton.jit(do_not_specialize=["d", "splits"])
    def resolve_kernel(src, temps, part_max, part_sum, param, pivots, state_i, state_f, part_w, part_c, scratch,
                        counters, d, vocab, splits, chunk, unscale,
                        FROM_LOGITS: tl.constexpr, TOPP: tl.constexpr, HAS_TOPK: tl.constexpr, NT: tl.constexpr,
                        CAP: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK: tl.constexpr, SPLIT_BLOCK: tl.constexpr,
                        PRECISE: tl.constexpr):
        resolve_item(tl.program_id(0), src, temps, part_max, part_sum, param, pivots, state_i, state_f, part_w,
                     part_c, scratch, counters, d, vocab, splits, chunk, unscale, FROM_LOGITS, TOPP, HAS_TOPK, NT,
                     CAP, BLOCK_S, BLOCK, SPLIT_BLOCK, PRECISE)

    @triton.jit(do_not_specialize=["d", "splits"])
    def kept_kernel(src, temps, part_max, part_sum, param, pivots, state_i, state_f, part_w, part_c, scratch,
                     counters, d, vocab, splits, chunk, unscale,
                     FROM_LOGITS: tl.constexpr, TOPP: tl.constexpr, HAS_TOPK: tl.constexpr, NT: tl.constexpr,
                     CAP: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK: tl.constexpr, SPLIT_BLOCK: tl.constexpr,
                     PRECISE: tl.constexpr):
        kept_item(tl.program_id(0), tl.program_id(1), src, temps, part_max, part_sum, param, pivots, state_i,
                  state_f, part_w, part_c, scratch, counters, d, vocab, splits, chunk, unscale, FROM_LOGITS, TOPP,
                  HAS_TOPK, NT, CAP, BLOCK_S, BLOCK, SPLIT_BLOCK, PRECISE)

    @triton.jit
    def apply_kernel(probs, pivots, out, vocab, chunk, HAS_TOPK: tl.constexpr, HAS_TOPP: tl.constexpr,
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
