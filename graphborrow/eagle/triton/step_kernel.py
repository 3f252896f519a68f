"""The persistent kernel of a fused verification step, and the token-probability kernel.

:mod:`.fused` launches these with a configuration of :mod:`.launch_config`; how the step's
work queue runs (ticket order, per-row step numbers, counters that start and end at zero)
is described in ``docs/kernels.md``, "One launch: how the queue works". ``KINDS``, the items
one launch of ``verify_kernel`` can meet (the others are not compiled in, so a launch of a
few kinds needs fewer registers), is a sum of the flags below.
"""

from __future__ import annotations

from .runtime import TRITON_AVAILABLE

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

    from .formula import fixed_point_e, multiply_ok, prob, prob_by_product, renormed, row_max_y, row_norm
    from .pivot_search import arrive, gather_item, init_item, kept_item, pass_item, resolve_item

__all__ = ["ABSENT", "BRACKET", "GATHER", "KEPT", "MAX_SUM", "NUMBER", "ONE_VALUE", "PASS", "PER_REQUEST", "RESIDUAL",
           "RESOLVE", "SYNC_HEAD", "TRACE_FIELDS", "WALK_FIELDS"]

# The kinds of item (verify_kernel's KINDS): maxima and sums, residuals, and per top-k / top-p
# search its bracket, resolve, kept sums, passes and gather
MAX_SUM, RESIDUAL, BRACKET, RESOLVE, KEPT, PASS, GATHER = 1, 2, 4, 8, 16, 32, 64
WALK_FIELDS = 4  # final node, its slot, last rejected token, dropped-token count; then the dropped tokens
SYNC_HEAD = 32  # int32 words before the per-row counters: ticket, programs gone, rows zeroed (one cache line)

# int64 words a traced launch writes per ticket (at its ticket) and per program (after the last
# ticket): clock times in ns (``%globaltimer``) and who did what (see :mod:`.timeline`)
TRACE_FIELDS = 8

# How a per-request parameter reaches the kernel (its first items write it into the workspace)
ABSENT, NUMBER, PER_REQUEST, ONE_VALUE = 0, 1, 2, 3

if TRITON_AVAILABLE:
    WALK_FIELDS_C = tl.constexpr(WALK_FIELDS)
    TRACE_FIELDS_C = tl.constexpr(TRACE_FIELDS)
    SYNC_HEAD_C = tl.constexpr(SYNC_HEAD)

    @triton.jit
    def _now():
        """The GPU's global clock in ns (``%globaltimer``: one clock for every SM)."""
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                         pack=1)

    @triton.jit
    def _sm():
        return tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=True, pack=1)

    @triton.jit
    def _store_param(dst, src, value, req, FORM: tl.constexpr, CLAMP: tl.constexpr):
        """Request ``req``'s parameter into its slot: from a number, the caller's per-request
        tensor or its one value (ABSENT: nothing). CLAMP: an integer read as int32, where
        k >= 2**31 keeps everything as 2**31 - 1 does."""
        if FORM == 1:
            tl.store(dst + req, value)
        elif FORM >= 2:
            if FORM == 2:
                v = tl.load(src + req)
            else:
                v = tl.load(src)
            if CLAMP:
                v = tl.minimum(v.to(tl.int64), 2147483647)
            tl.store(dst + req, v)

    @triton.jit
    def _wait(flag, at_least):
        """Spin until ``*flag >= at_least`` (acquire: what its writer did before is visible)."""
        seen = tl.atomic_add(flag, 0, sem="acquire")
        while seen < at_least:
            seen = tl.atomic_add(flag, 0, sem="acquire")

    @triton.jit
    def _publish(flag, value):
        """``*flag = value`` once every thread's stores are done (release)."""
        tl.debug_barrier()
        tl.atomic_xchg(flag, value, sem="release")

    @triton.jit
    def _max_item(row, c, logits, part_max, temps, t_src, t_value, top_k, k_src, k_value, top_p, p_src, p_value,
                  arrivals, d, vocab, splits, chunk, T_FORM: tl.constexpr, K_FORM: tl.constexpr, P_FORM: tl.constexpr,
                  BLOCK: tl.constexpr):
        """Largest logit of one (row, slice). Slice 0 writes the row's request's parameters
        (every row of a request writes the same values, so each row's later items find them)."""
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
            req = row // d
            _store_param(temps, t_src, t_value, req, T_FORM, False)
            _store_param(top_k, k_src, k_value, req, K_FORM, True)
            _store_param(top_p, p_src, p_value, req, P_FORM, False)
        return arrive(arrivals, row, splits)

    @triton.jit
    def _zero_outputs(ticket, predicts, rows, zeroed, STEP: tl.constexpr, BLOCK: tl.constexpr):
        """Ticket 0 (of a step): zero every output entry, then count them in ``zeroed``. Walks
        write outputs only once every entry is zeroed (a tree may give a node another request's
        slot); ticket 0 comes before every walk, so a walk never waits for a ticket no program
        has taken."""
        if STEP:  # noqa: SIM102 (a compile-time branch around a run-time one)
            if ticket == 0:
                offs = tl.arange(0, BLOCK)
                for start in range(0, rows, BLOCK):
                    tl.store(predicts + start + offs, 0, mask=start + offs < rows)
                tl.debug_barrier()
                tl.atomic_add(zeroed, rows, sem="release")

    @triton.jit
    def _sum_item(row, c, logits, temps, part_max, part_sum, arrivals, d, vocab, splits, chunk, scale,
                  BLOCK: tl.constexpr, SPLIT_BLOCK: tl.constexpr, PRECISE: tl.constexpr):
        """Fixed-point sum of e over one (row, slice), the row's maxima all in."""
        t = tl.load(temps + row // d, cache_modifier=".cg")
        big = row_max_y(part_max, row, splits, t, SPLIT_BLOCK)
        inv_t = tl.math.div_rn(1.0, t)
        fast = multiply_ok(t, big)
        base = logits + row.to(tl.int64) * vocab
        lo = c * chunk
        hi = tl.minimum(lo + chunk, vocab)
        offs = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], tl.int64)
        for start in range(lo, hi, BLOCK):
            idx = start + offs
            x = tl.load(base + idx, mask=idx < hi, other=float("-inf")).to(tl.float32)
            acc += fixed_point_e(x, t, inv_t, big, fast, scale, PRECISE)
        tl.store(part_sum + row.to(tl.int64) * splits + c, tl.sum(acc, axis=0))
        return arrive(arrivals, row, splits)

    @triton.jit
    def _search_item(k, row, c, logits, temps, part_max, part_sum, param, pivots, state_i, state_f, part_w, part_c,
                     scratch, arrivals, d, vocab, splits, chunk, unscale, passes, TOPP: tl.constexpr,
                     HAS_TOPK: tl.constexpr, KINDS: tl.constexpr, NT: tl.constexpr, CAP: tl.constexpr,
                     BLOCK_S: tl.constexpr, BLOCK: tl.constexpr, SPLIT_BLOCK: tl.constexpr, PRECISE: tl.constexpr):
        """Step ``k`` of one top-k / top-p search (:mod:`.pivot_search`): 0 the bracket, 1..passes
        the passes, then the gather, the resolve (one item per row) and the kept sum (each
        compiled in when ``KINDS`` has it). Returns whether this program finished the row's step."""
        last = k < 0
        if k == 0:
            if (KINDS & 4) != 0:
                last = init_item(row, c, logits, temps, part_max, part_sum, param, pivots, state_i, state_f, part_w,
                                 part_c, scratch, arrivals, d, vocab, splits, chunk, unscale, True, TOPP, HAS_TOPK,
                                 NT, CAP, BLOCK_S, BLOCK, SPLIT_BLOCK, PRECISE)
        elif k <= passes:
            if (KINDS & 32) != 0:
                last = pass_item(row, c, logits, temps, part_max, part_sum, param, pivots, state_i, state_f, part_w,
                                 part_c, scratch, arrivals, d, vocab, splits, chunk, unscale, True, TOPP, HAS_TOPK,
                                 NT, CAP, BLOCK_S, BLOCK, SPLIT_BLOCK, PRECISE)
        elif k == passes + 1:
            if (KINDS & 64) != 0:
                last = gather_item(row, c, logits, temps, part_max, part_sum, param, pivots, state_i, state_f,
                                   part_w, part_c, scratch, arrivals, d, vocab, splits, chunk, unscale, True, TOPP,
                                   HAS_TOPK, NT, CAP, BLOCK_S, BLOCK, SPLIT_BLOCK, PRECISE)
        elif k == passes + 2:
            if (KINDS & 8) != 0:
                resolve_item(row, logits, temps, part_max, part_sum, param, pivots, state_i, state_f, part_w, part_c,
                             scratch, arrivals, d, vocab, splits, chunk, unscale, True, TOPP, HAS_TOPK, NT, CAP,
                             BLOCK_S, BLOCK, SPLIT_BLOCK, PRECISE)
                last = k >= 0  # (one item per row: it finishes the step)
        else:
            if (KINDS & 16) != 0:
                last = kept_item(row, c, logits, temps, part_max, part_sum, param, pivots, state_i, state_f, part_w,
                                 part_c, scratch, arrivals, d, vocab, splits, chunk, unscale, True, TOPP, HAS_TOPK,
                                 NT, CAP, BLOCK_S, BLOCK, SPLIT_BLOCK, PRECISE)
        return last

    @triton.jit
    def _search_of(q, k, row, c, logits, temps, part_max, part_sum, top_k, top_p, pivots, state_i, state_f, part_w,
                   part_c, scratch, arrivals, d, vocab, splits, chunk, unscale, passes, HAS_TOPK: tl.constexpr,
                   HAS_TOPP: tl.constexpr, KINDS: tl.constexpr, NT: tl.constexpr, CAP: tl.constexpr,
                   BLOCK_S: tl.constexpr, BLOCK: tl.constexpr, SPLIT_BLOCK: tl.constexpr, PRECISE: tl.constexpr):
        """Step ``k`` of search ``q`` (0: top-k's, when both run); returns whether this program
        finished the row's step."""
        last = k < 0
        if HAS_TOPK and HAS_TOPP:
            if q == 0:
                last = _search_item(k, row, c, logits, temps, part_max, part_sum, top_k, pivots, state_i, state_f,
                                    part_w, part_c, scratch, arrivals, d, vocab, splits, chunk, unscale, passes, False,
                                    HAS_TOPK, KINDS, NT, CAP, BLOCK_S, BLOCK, SPLIT_BLOCK, PRECISE)
            else:
                last = _search_item(k, row, c, logits, temps, part_max, part_sum, top_p, pivots, state_i, state_f,
                                    part_w, part_c, scratch, arrivals, d, vocab, splits, chunk, unscale, passes, True,
                                    HAS_TOPK, KINDS, NT, CAP, BLOCK_S, BLOCK, SPLIT_BLOCK, PRECISE)
        elif HAS_TOPK:
            last = _search_item(k, row, c, logits, temps, part_max, part_sum, top_k, pivots, state_i, state_f, part_w,
                                part_c, scratch, arrivals, d, vocab, splits, chunk, unscale, passes, False, HAS_TOPK,
                                KINDS, NT, CAP, BLOCK_S, BLOCK, SPLIT_BLOCK, PRECISE)
        elif HAS_TOPP:
            last = _search_item(k, row, c, logits, temps, part_max, part_sum, top_p, pivots, state_i, state_f, part_w,
                                part_c, scratch, arrivals, d, vocab, splits, chunk, unscale, passes, True, HAS_TOPK,
                                KINDS, NT, CAP, BLOCK_S, BLOCK, SPLIT_BLOCK, PRECISE)
        return last

    @triton.jit
    def _max_sum_order(ticket, per_step, lag):
        """(stage, item) of one of the first ``2 * per_step`` tickets: ``lag`` maxima first,
        then maxima and sums in turn, the sums ``lag`` items behind, then the last sums. A row's
        sums thus re-read its logits while they are still in L2 (``lag`` >= ``splits``: a sum's
        maxima always have smaller tickets)."""
        stage = ticket * 0
        i = ticket
        if ticket >= lag:
            u = ticket - lag
            both = per_step - lag  # maxima after the first lag
            if u < 2 * both:
                stage = u % 2
                i = tl.where(stage == 0, lag + u // 2, u // 2)
            else:
                stage = stage + 1
                i = both + (u - 2 * both)
        return stage, i

    @triton.jit(do_not_specialize=["t_value", "k_value", "p_value", "thr_single", "thr_acc", "bs", "d", "splits",
                                   "rsplits", "steps", "passes", "lag", "programs", "first", "end"])
    def verify_kernel(logits, candidates, retrive_index, next_token, next_sibling, predicts, accept_index,
                     accept_length, coins, coins_final, t_src, k_src, p_src, t_value, k_value, p_value, thr_single,
                     thr_acc,
                     temps, top_k, top_p, part_max, part_sum, walk_state, res_sum, res_last, sync, pivots, state_i,
                     state_f, part_w, part_c, scratch, cand_p, norms,
                     bs, d, vocab, splits, chunk, rsplits, rchunk, steps, passes, lag, programs, first, end, scale,
                     unscale, trace,
                     T_FORM: tl.constexpr, K_FORM: tl.constexpr, P_FORM: tl.constexpr, HAS_TOPK: tl.constexpr,
                     HAS_TOPP: tl.constexpr, NSEL: tl.constexpr, STEP: tl.constexpr, KINDS: tl.constexpr,
                     WALKS: tl.constexpr, NT: tl.constexpr, CAP: tl.constexpr, BLOCK_S: tl.constexpr,
                     BLOCK: tl.constexpr, SPLIT_BLOCK: tl.constexpr, D_BLOCK: tl.constexpr, PRECISE: tl.constexpr,
                     TRACE: tl.constexpr):
        """The step's items with tickets ``first`` to ``end``; each program takes tickets until they
        run out. A row's step number ``ready[row]`` counts its finished steps; the program that
        finishes a request's last row walks its tree. ``KINDS``: the items this launch can meet
        (module docstring); ``WALKS``: it holds the kind that finishes a row, so the walk is
        compiled in. STEP False: maxima and sums only. TRACE: write each ticket's and each
        program's clock times to ``trace`` (:func:`_trace_ticket`)."""
        rows = bs * d
        per_step = rows * splits
        ready = sync + SYNC_HEAD_C  # [rows] steps done
        arrivals = ready + rows  # [rows] programs in, this step (reset by the last)
        rows_done = arrivals + rows  # [bs] rows finished
        walked = rows_done + bs  # [bs] tree walked (1)
        res_arrivals = walked + bs  # [bs] residual slices in
        search = (passes + 3) * per_step + rows  # one search's items
        searches_end = 2 * per_step + NSEL * search
        final = 1 + NSEL * (passes + 4)  # the step whose end finishes a row
        started = _clock(TRACE, 0)
        ticket_at, waited, done = started, started, started
        ticket = first + tl.atomic_add(sync, 1, sem="relaxed")
        while ticket < end:
            row = ticket * 0
            stage = ticket * 0 - 1
            last = ticket < 0
            acted = ticket < 0  # (traced: a residual item that sampled, or a finishing item that walked)
            ticket_at = _clock(TRACE, ticket_at)
            waited = ticket_at
            if ticket < 2 * per_step:
                if (KINDS & 1) != 0:
                    stage, i = _max_sum_order(ticket, per_step, lag)
                    row = i // splits
                    c = i - row * splits
                    _zero_outputs(ticket, predicts, rows, sync + 2, STEP, BLOCK)
                    if stage == 0:
                        last = _max_item(row, c, logits, part_max, temps, t_src, t_value, top_k, k_src, k_value,
                                         top_p, p_src, p_value, arrivals, d, vocab, splits, chunk, T_FORM, K_FORM,
                                         P_FORM, BLOCK)
                    else:
                        _wait(ready + row, 1)
                        waited = _clock(TRACE, waited)
                        last = _sum_item(row, c, logits, temps, part_max, part_sum, arrivals, d, vocab, splits,
                                         chunk, scale, BLOCK, SPLIT_BLOCK, PRECISE)
            elif ticket < searches_end:
                if (KINDS & 124) != 0:
                    u = ticket - 2 * per_step
                    q = u // search  # which search: top-k's, then top-p's
                    v = u - q * search
                    gathered = (passes + 2) * per_step
                    if v < gathered:
                        k = v // per_step
                        i = v - k * per_step
                        row = i // splits
                        c = i - row * splits
                    elif v < gathered + rows:
                        k = passes + 2
                        row = v - gathered
                        c = 0
                    else:
                        k = passes + 3
                        i = v - gathered - rows
                        row = i // splits
                        c = i - row * splits
                    stage = 2 + q * (passes + 4) + k
                    _wait(ready + row, stage)
                    waited = _clock(TRACE, waited)
                    last = _search_of(q, k, row, c, logits, temps, part_max, part_sum, top_k, top_p, pivots, state_i,
                                      state_f, part_w, part_c, scratch, arrivals, d, vocab, splits, chunk, unscale,
                                      passes, HAS_TOPK, HAS_TOPP, KINDS, NT, CAP, BLOCK_S, BLOCK, SPLIT_BLOCK, PRECISE)
            else:
                if (KINDS & 2) != 0:
                    i = ticket - searches_end
                    b = i // rsplits
                    _wait(walked + b, 1)
                    waited = _clock(TRACE, waited)
                    row = b
                    stage = ticket * 0 - 2
                    acted = _residual_item(b, i - b * rsplits, logits, temps, norms, pivots, walk_state, coins_final,
                                           res_sum, res_last, res_arrivals, ready, walked, predicts, d, vocab,
                                           rsplits, rchunk, HAS_TOPK, HAS_TOPP, D_BLOCK, BLOCK // 2, SPLIT_BLOCK,
                                           PRECISE)
            done = _clock(TRACE, done)
            if last:
                if STEP and WALKS:
                    if stage == final:
                        acted = _finish_row(row, logits, temps, part_max, part_sum, pivots, candidates, cand_p, norms,
                                            retrive_index, next_token, next_sibling, coins, predicts, accept_index,
                                            accept_length, walk_state, sync, rows_done, walked, rows, d, vocab, splits,
                                            steps, unscale, thr_single, thr_acc, HAS_TOPK, HAS_TOPP, KINDS,
                                            SPLIT_BLOCK, D_BLOCK, PRECISE)
                    else:
                        _publish(ready + row, stage + 1)
                else:
                    _publish(ready + row, stage + 1)
            if TRACE:
                _trace_ticket(trace + ticket.to(tl.int64) * TRACE_FIELDS_C, ticket_at, waited, done, _now(), stage,
                              row, last, acted)
            ticket = first + tl.atomic_add(sync, 1, sem="relaxed")
        # the last program out resets the queue (every program has taken its last ticket)
        tl.debug_barrier()
        if tl.atomic_add(sync + 1, 1, sem="acq_rel") == programs - 1:
            tl.store(sync + 0, 0)
            tl.store(sync + 1, 0)
            tl.store(sync + 2, 0)
        if TRACE:
            _trace_program(trace + (end + tl.program_id(0)).to(tl.int64) * TRACE_FIELDS_C, started)

    @triton.jit
    def _finish_row(row, logits, temps, part_max, part_sum, pivots, candidates, cand_p, norms, retrive_index,
                    next_token, next_sibling, coins, predicts, accept_index, accept_length, walk_state, sync, rows_done,
                    walked, rows, d, vocab, splits, steps, unscale, thr_single, thr_acc, HAS_TOPK: tl.constexpr,
                    HAS_TOPP: tl.constexpr, KINDS: tl.constexpr, SPLIT_BLOCK: tl.constexpr, D_BLOCK: tl.constexpr,
                    PRECISE: tl.constexpr):
        """The end of a row's last step: its walk numbers, then, from the request's last row to
        finish, the request's walk (returns True) and its walk flag."""
        b = row // d
        _candidate_probs(row, b, logits, temps, part_max, part_sum, pivots, candidates, cand_p, norms, d, vocab,
                         splits, unscale, HAS_TOPK, HAS_TOPP, SPLIT_BLOCK, D_BLOCK, PRECISE)
        walks = arrive(rows_done, b, d)
        if walks:
            if (KINDS & 1) != 0:  # (else a launch before zeroed every output entry)
                _wait(sync + 2, rows)  # every output entry zeroed
            _walk(b, cand_p, candidates, retrive_index, next_token, next_sibling, coins, predicts, accept_index,
                  accept_length, walk_state, d, steps, thr_single, thr_acc)
            _publish(walked + b, 1)
        return walks

    @triton.jit
    def _clock(TRACE: tl.constexpr, otherwise):
        """The global clock when tracing, else ``otherwise`` (unchanged: no clock read)."""
        if TRACE:
            return _now()
        else:
            return otherwise

    @triton.jit
    def _trace_program(here, started):
        """A program's record: when it started and left, and its SM."""
        tl.store(here + 0, started)
        tl.store(here + 1, _now())
        tl.store(here + 2, _sm().to(tl.int64))

    @triton.jit
    def _trace_ticket(here, ticket_at, waited, done, published, stage, row, last, acted):
        """One ticket's record: when it was taken, when its wait ended, when its item's work was
        done and when the program moved on (after publishing, or walking a tree); the SM, the
        program, its stage (-2: a residual), its row (a residual's: the request), and whether
        it finished its row's step (1) and sampled or walked (2)."""
        tl.store(here + 0, ticket_at)
        tl.store(here + 1, waited)
        tl.store(here + 2, done)
        tl.store(here + 3, published)
        tl.store(here + 4, _sm().to(tl.int64))
        tl.store(here + 5, tl.program_id(0).to(tl.int64))
        tl.store(here + 6, stage.to(tl.int64))
        tl.store(here + 7, row.to(tl.int64) * 4 + last.to(tl.int64) + 2 * acted.to(tl.int64))

    @triton.jit
    def _pivots_of(pivots, row, HAS_TOPK: tl.constexpr, HAS_TOPP: tl.constexpr):
        pk = 0.0
        sk = 1.0
        pp = 0.0
        sp = 1.0
        if HAS_TOPK:
            pk = tl.load(pivots + row * 4 + 0, cache_modifier=".cg")
            sk = tl.load(pivots + row * 4 + 1, cache_modifier=".cg")
        if HAS_TOPP:
            pp = tl.load(pivots + row * 4 + 2, cache_modifier=".cg")
            sp = tl.load(pivots + row * 4 + 3, cache_modifier=".cg")
        return pk, sk, pp, sp

    @triton.jit
    def _candidate_probs(row, b, logits, temps, part_max, part_sum, pivots, candidates, cand_p, norms, d, vocab,
                         splits, unscale, HAS_TOPK: tl.constexpr, HAS_TOPP: tl.constexpr, SPLIT_BLOCK: tl.constexpr,
                         D_BLOCK: tl.constexpr, PRECISE: tl.constexpr):
        """Row ``row``'s (renormalised) probability of each of its request's candidate tokens,
        into ``cand_p[row]``, and its (m, s) into ``norms[row]``: written by the item that
        finishes the row, so the walk finds the probability of every child it tries in one
        load, and a residual item its row's statistics in one (candidate ids outside [0, V),
        which no walk reaches, are not read)."""
        t = tl.load(temps + b, cache_modifier=".cg")
        big, total = row_norm(part_max, part_sum, row, splits, t, unscale, SPLIT_BLOCK)
        tl.store(norms + row.to(tl.int64) * 2, big)
        tl.store(norms + row.to(tl.int64) * 2 + 1, total)
        pk, sk, pp, sp = _pivots_of(pivots, row, HAS_TOPK, HAS_TOPP)
        k = tl.arange(0, D_BLOCK)
        tok = tl.load(candidates + b * d + k, mask=k < d, other=-1)
        inside = (tok >= 0) & (tok < vocab)
        x = tl.load(logits + row.to(tl.int64) * vocab + tok, mask=inside, other=0.0).to(tl.float32)
        p = renormed(prob(x, t, big, total, PRECISE), pk, sk, pp, sp, HAS_TOPK, HAS_TOPP)
        tl.store(cand_p + row.to(tl.int64) * d + k, p, mask=k < d)

    @triton.jit
    def _walk(b, cand_p, candidates, retrive_index, next_token, next_sibling, coins, predicts, accept_index,
              accept_length, walk_state, d, steps, thr_single, thr_acc):
        """Upstream's acceptance rule down one request's tree, each tried child's probability
        read from its parent row's ``cand_p``; records where the walk ended (for the residual
        items, which read it through L2)."""
        node0 = b * d
        state = walk_state + b * (WALK_FIELDS_C + d)
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
            child = tl.load(next_token + row).to(tl.int32)
            chosen = -1
            acc = 0.0
            tried = 0
            while (child != -1) & (chosen == -1):
                p = tl.load(cand_p + row.to(tl.int64) * d + child, cache_modifier=".cg")
                nxt = tl.load(next_sibling + node0 + child).to(tl.int32)
                tok = tl.load(candidates + node0 + child).to(tl.int32)
                tl.store(state + WALK_FIELDS_C + tried, tok)  # the residual drops this depth's tried tokens
                tried += 1
                acc = acc + p
                ok = (p > 0) & ((coin < tl.math.div_rn(acc, thr_acc)) | (p >= thr_single))
                last_rej = tl.where((~ok) & (p > 0), tok, last_rej)
                chosen = tl.where(ok, child, -1)
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
    def _residual_tile(base, idx, hi, start, t, inv_t, big, fast, total, pk, sk, pp, sp, dropped,
                       D_BLOCK: tl.constexpr, BLOCK: tl.constexpr, HAS_TOPK: tl.constexpr, HAS_TOPP: tl.constexpr,
                       PRECISE: tl.constexpr):
        """One tile of the final row's probabilities with the rejected children's tokens
        (``dropped``, -1 padded) zeroed: relu(p - p) = 0 where upstream subtracts the draft."""
        valid = idx < hi
        x = tl.load(base + idx, mask=valid, other=float("-inf")).to(tl.float32)
        p = prob_by_product(x, t, inv_t, big, total, fast, PRECISE)
        r = tl.where(valid, renormed(p, pk, sk, pp, sp, HAS_TOPK, HAS_TOPP), 0.0)
        here = (dropped >= start) & (dropped < start + BLOCK)
        if tl.sum(here.to(tl.int32), axis=0) > 0:  # few tiles hold one
            k = tl.arange(0, D_BLOCK)
            for i in range(0, D_BLOCK):
                tok = tl.max(tl.where((k == i) & here, dropped, -1), axis=0)  # -1: none
                r = tl.where(idx == tok, 0.0, r)
        return r

    @triton.jit
    def _residual_item(b, c, logits, temps, norms, pivots, walk_state, coins_final, res_sum, res_last, res_arrivals,
                       ready, walked, predicts, d, vocab, rsplits, rchunk, HAS_TOPK: tl.constexpr,
                       HAS_TOPP: tl.constexpr, D_BLOCK: tl.constexpr, BLOCK: tl.constexpr, SPLIT_BLOCK: tl.constexpr,
                       PRECISE: tl.constexpr):
        """Residual mass of one (request, slice), the request's tree walked; the request's last
        slice samples the final token, then resets the request's flags for the next launch
        (and returns True)."""
        state = walk_state + b * (WALK_FIELDS_C + d)
        row = b * d + tl.load(state + 0, cache_modifier=".cg")
        t = tl.load(temps + b, cache_modifier=".cg")
        big = tl.load(norms + row.to(tl.int64) * 2, cache_modifier=".cg")
        total = tl.load(norms + row.to(tl.int64) * 2 + 1, cache_modifier=".cg")
        inv_t = tl.math.div_rn(1.0, t)
        fast = multiply_ok(t, big)
        pk, sk, pp, sp = _pivots_of(pivots, row, HAS_TOPK, HAS_TOPP)
        k = tl.arange(0, D_BLOCK)
        dropped = tl.load(state + WALK_FIELDS_C + k, mask=k < tl.load(state + 3, cache_modifier=".cg"), other=-1,
                          cache_modifier=".cg")
        base = logits + row.to(tl.int64) * vocab
        offs = tl.arange(0, BLOCK)
        lo = c * rchunk
        hi = tl.minimum(lo + rchunk, vocab)
        mass = tl.zeros([BLOCK], tl.float64)
        last_pos = tl.full([BLOCK], -1, tl.int32)
        for start in range(lo, hi, BLOCK):
            idx = start + offs
            r = _residual_tile(base, idx, hi, start, t, inv_t, big, fast, total, pk, sk, pp, sp, dropped, D_BLOCK,
                               BLOCK, HAS_TOPK, HAS_TOPP, PRECISE)
            mass += r.to(tl.float64)
            last_pos = tl.maximum(last_pos, tl.where(r > 0, idx, -1))
        tl.store(res_sum + b * rsplits + c, tl.sum(mass, axis=0))
        tl.store(res_last + b * rsplits + c, tl.max(last_pos, axis=0))
        sampled = arrive(res_arrivals, b, rsplits)
        if sampled:
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
                    sr = _residual_tile(base, sidx, vocab, pos, t, inv_t, big, fast, total, pk, sk, pp, sp, dropped,
                                        D_BLOCK, BLOCK, HAS_TOPK, HAS_TOPP, PRECISE)
                    cdf = cum + tl.cumsum(sr.to(tl.float64), axis=0)
                    at = tl.min(tl.where((cdf > u) & (sidx < vocab), sidx, vocab), axis=0)
                    token = tl.where(at < vocab, at, -1)
                    cum = tl.max(cdf, axis=0)
                    pos += BLOCK
            if token == -1:  # the reference's fallbacks: last positive index, last rejected token, V - 1
                positive = tl.max(tl.load(res_last + b * rsplits + slots, mask=inside, other=-1,
                                          cache_modifier=".cg"), axis=0)
                last_rej = tl.load(state + 2, cache_modifier=".cg")
                token = tl.where(positive >= 0, positive, tl.where(last_rej >= 0, last_rej, vocab - 1))
            tl.store(predicts + tl.load(state + 1, cache_modifier=".cg"), token)
            tl.store(walked + b, 0)
            tl.store(ready + b * d + k, 0, mask=k < d)
        return sampled


    @triton.jit(do_not_specialize=["d", "splits", "k"])
    def token_prob_kernel(logits, temps, part_max, part_sum, tokens, out, d, vocab, splits, k, unscale,
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


