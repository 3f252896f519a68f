"""EAGLE verification at kernel speed: Triton kernels that read the logits directly.

:func:`run_step` is :func:`graphborrow.eagle.eagle_verify`'s fused body (every mode is
this one step: it holds no [bs*D, V] matrix); :func:`fused_verify` is the same call with
static output buffers. Each row's target distribution is the formula of
:mod:`graphborrow.eagle.probs`, which the reference computes too, computed where it is
needed. The step is three launches:

1. ``_row_max_kernel`` — per (row, vocabulary slice): the largest logit. Its first slices
   also zero ``predicts`` and the step's counters and write the per-request parameters
   (temperature, top-k, top-p: numbers or the caller's tensors) into the workspace, so
   nothing runs before it;
2. ``_row_sum_kernel`` — per (row, slice): the fixed-point sum of ``exp(x / t - m)``.
   The last slice of a request to finish (an atomic counter) walks the request's draft
   tree: upstream's acceptance rule, each tried candidate's probability from its logit
   and its row's statistics;
3. ``_residual_kernel`` — per (request, slice): the float64 mass of the final row's
   residual (its rejected children removed unless every depth was accepted); the last
   slice to finish finds the slice where ``coin * mass`` falls and scans only that one.

With top-k / top-p, :func:`graphborrow.eagle.triton.select.select_launches` finds every row's
pivots and kept sums between 2 and 3 (a sort-free search, a few launches), and the walk
runs in its own launch. Nothing synchronises with the host, so the step can be captured
in a CUDA graph.

Host time. Everything a call would otherwise redo is computed once per *plan* — the
step's shape and the form of its arguments (a number or a tensor, and its dtype) —
and cached (:class:`StepPlan`): the vocabulary split, grids, the workspace layout and,
after the plan's first call, the compiled kernels, which later calls launch directly
(:mod:`.launch`). Per call that leaves one workspace allocation (:mod:`.workspace`: a
size fixed by the shape, so the capacity planner replays exactly this request, recorded
by ``run_step(..., launch=False)`` on the layout-only device), the caller's device
addresses, and the launches. The caller's coins are read where they are; coins not
given are drawn into the workspace. Without CUDA the kernels run in Triton's
interpreter (slow, for tests).

The same coins give the reference's tokens: every probability is bitwise the
reference's; the float64 running sums of the residual and of top-k / top-p kept mass are
added in another order than torch's, which matters only when a coin lands within about
1e-16 of a boundary (see :mod:`graphborrow.eagle.triton.probs`).
"""

from __future__ import annotations

import torch

from ..draft_tree import DraftTree
from ..modes import VerifyResult
from ..scope import run_borrowing
from ..step import VerifyStep, check_outputs, draw_into
from . import select as _select
from .launch import Launcher, PlanCache, aligned
from .probs import (
    INTERPRETED,
    TRITON_AVAILABLE,
    compile_options,
    sum_bits,
    target_probs_reference,
)
from .select import (
    select_launches,
    select_slots,
    split_layout,
    top_k_renorm,
    top_p_renorm,
)
from .workspace import Layout

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

    from .probs import fixed_point_e, prob, renormed, row_max_y, row_norm
    from .select import arrive

__all__ = [
    "TRITON_AVAILABLE",
    "StepPlan",
    "clear_plans",
    "fused_token_probs",
    "fused_verify",
    "fused_workspace_bytes",
    "run_step",
    "split_layout",
    "target_probs_reference",
    "top_k_renorm",
    "top_p_renorm",
]

WALK_WARPS = 1
WALK_FIELDS = 4  # final node, its slot, last rejected token, dropped-token count; then the dropped tokens
MERGED_WORKSPACE = 64 * 1024  # bytes: a workspace this small shares its outputs' allocation (without a borrow)
INT32_MAX = 2**31 - 1

# How a per-request parameter reaches the kernels (the first kernel writes it into the workspace)
ABSENT, NUMBER, PER_REQUEST, ONE_VALUE = 0, 1, 2, 3


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
) -> VerifyResult:
    """Non-greedy EAGLE verification of ``tree`` against ``logits`` [bs*D, V], fused.

    :func:`graphborrow.eagle.eagle_verify` with ``impl="fused"``, plus what a caller that
    manages buffers needs: output buffers to write into and a dry run. Arguments mean what
    they mean there; the same coins give the same tokens (see the module docstring).

    Args:
        out: optional ``(predicts [bs*D], accept_index [bs, S], accept_length [bs])`` int32
            contiguous buffers to write into (static buffers for graph capture); every entry
            is rewritten.
        validate: check values on the host (syncs); ``False`` skips those checks, so the
            step can be captured in a CUDA graph. Shapes and dtypes are always checked.
        chunk_requests: accepted (a positive int) for parity with the chunked reference; the
            fused step needs no chunking and runs over every request at once.
        launch: ``False`` allocates the workspace (and outputs) and returns without running
            a kernel: the allocation sequence, for the capacity planner and the simulated device.

    Returns:
        A :class:`~graphborrow.eagle.modes.VerifyResult` (predicts, accept_index, accept_length).

    Raises:
        ValueError: a bad argument, named (see :class:`~graphborrow.eagle.step.VerifyStep`).
        RuntimeError: ``launch=True`` without triton, or CPU tensors outside Triton's interpreter.
    """
    if chunk_requests is not None and (isinstance(chunk_requests, bool) or not isinstance(chunk_requests, int)
                                       or chunk_requests < 1):
        raise ValueError(f"chunk_requests must be a positive int (requests per chunk), got {chunk_requests!r}")
    step = VerifyStep.of(logits, candidates, tree, temperatures, top_ks, top_ps, coins, coins_final, generator,
                         threshold_single, threshold_acc)
    step.require_contiguous()
    if validate:
        step.validate()
    if launch:
        _check_launchable(step.logits)
    if out is None:
        return verify(step, borrow, launch)
    out = VerifyResult(*check_outputs(out, step))
    if step.batch_size:
        run_borrowing(borrow, run_step, step, out, launch)
    return out


def verify(step: VerifyStep, borrow=None, launch: bool = True) -> VerifyResult:
    """:func:`~graphborrow.eagle.eagle_verify`'s fused path for a checked (and, if asked,
    validated) ``step``: new outputs, then the step, its temporaries in ``borrow``'s scope
    when it is enabled.

    Without a borrow a step whose workspace is small (``MERGED_WORKSPACE`` bytes at most)
    makes one allocation, not two: its outputs and its workspace share one buffer, so the
    workspace lives as long as the caller keeps the outputs.

    Returns:
        The step's :class:`~graphborrow.eagle.modes.VerifyResult`.
    """
    plan = plan_for(step)
    if not step.batch_size or (borrow is not None and borrow.enabled) or plan.layout.nbytes > MERGED_WORKSPACE:
        out = plan.outputs(step.candidates.new_empty(plan.output_words, dtype=torch.int32))
        if step.batch_size:
            run_borrowing(borrow, run_step, step, out, launch)
        return out
    buffer = step.candidates.new_empty(plan.output_words + plan.layout.nbytes // 4, dtype=torch.int32)
    out = plan.outputs(buffer)
    if launch:
        _launch(plan, step, out, buffer, 4 * plan.output_words)
    return out


def allocate_outputs(step: VerifyStep) -> VerifyResult:
    """The fused step's outputs, uninitialised (the kernels write every entry): three views
    of one int32 allocation, each starting 16-byte aligned."""
    plan = plan_for(step)
    return plan.outputs(step.candidates.new_empty(plan.output_words, dtype=torch.int32))


def _check_launchable(logits: torch.Tensor) -> None:
    if not TRITON_AVAILABLE:
        raise RuntimeError("the fused kernels need triton (pip install triton, or the 'kernels' extra); "
                           "launch=False records the allocations without it")
    if logits.device.type not in ("cuda", "cpu"):
        raise ValueError(f"the fused kernels launch on CUDA (or CPU tensors in Triton's interpreter), "
                         f"got {logits.device}; pass launch=False to record allocations only")
    if logits.device.type == "cpu" and not INTERPRETED:
        raise RuntimeError("CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1 before importing "
                           "graphborrow.eagle.triton.fused")


# ---------------------------------------------------------------------------------
# Plans: what a call of one shape and argument form computes once


class StepPlan:
    """Everything about a fused step that its shape and argument forms decide.

    ``layout``: the workspace's slots; ``grid_rows`` / ``grid_walk`` / ``grid_residual``:
    the launch grids; ``forms``: how temperature, top-k and top-p arrive (``ABSENT``,
    ``NUMBER``, ``PER_REQUEST``, ``ONE_VALUE``) and whether the kernels read the caller's
    tensor in place (``in_place``); ``output_words``: int32 words of the outputs, each of
    the three starting 16-byte aligned; ``launcher``: the compiled kernels.
    """

    def __init__(self, bs: int, d: int, vocab: int, steps: int, forms: tuple, in_place: tuple):
        self.bs, self.d, self.vocab, self.steps = bs, d, vocab, steps
        self.forms, self.in_place = forms, in_place
        self.copies = any(f == PER_REQUEST and not direct for f, direct in zip(forms, in_place))  # into slots first
        self.rows = rows = bs * d
        self.splits, self.chunk = split_layout(rows, vocab)
        self.rsplits, self.rchunk = split_layout(bs, vocab)
        bits = sum_bits(vocab)
        self.scale, self.unscale = 2.0 ** bits, 2.0 ** -bits
        self.has_k, self.has_p = forms[1] != ABSENT, forms[2] != ABSENT
        self.renorm = self.has_k or self.has_p
        self.layout = Layout(step_slots(bs, d, vocab, self.has_k, self.has_p))
        words = [bs * d, bs * steps, bs]
        self.output_starts = (0, -(-words[0] // 4) * 4, -(-words[0] // 4) * 4 + -(-words[1] // 4) * 4)
        self.output_words = -(-(self.output_starts[2] + bs) // 32) * 32  # (128 bytes: the workspace after it aligned)
        self.grid_rows = (rows, self.splits, 1)
        self.grid_walk = (bs, 1, 1)
        self.grid_residual = (bs, self.rsplits, 1)
        self.d_block = triton.next_power_of_2(d) if TRITON_AVAILABLE else d
        self.stream_options = dict(num_warps=_select.STREAM_WARPS, **compile_options())
        self.walk_options = dict(num_warps=WALK_WARPS, **compile_options())
        self.launcher = Launcher()

    def outputs(self, buffer: torch.Tensor) -> VerifyResult:
        """The three outputs as views at the start of an int32 ``buffer``."""
        bs, p, a, n = self.bs, *self.output_starts
        return VerifyResult(buffer.as_strided((bs * self.d,), (1,), p),
                            buffer.as_strided((bs, self.steps), (self.steps, 1), a), buffer.as_strided((bs,), (1,), n))


def step_slots(bs: int, d: int, vocab: int, has_k: bool, has_p: bool) -> list:
    """The fused step's workspace slots, ``(name, dtype, shape)``: per request ``temps``,
    ``top_k`` (int32) and ``top_p`` as the kernels read them, ``coins`` / ``coins_final``
    (drawn here when not given), ``walk_state`` [bs, 4 + D] (final node, its slot, last
    rejected token, dropped-token count, then those tokens), ``res_sum`` / ``res_last``
    per (request, residual slice), ``counters``; per (row, slice) ``part_max`` and the
    fixed-point ``part_sum``; with top-k / top-p, ``pivots`` [rows, 4] and the search's
    slots (:func:`~graphborrow.eagle.triton.select.select_slots`). It grows with bs * D,
    never with V."""
    rows = bs * d
    splits, _ = split_layout(rows, vocab)
    rsplits, _ = split_layout(bs, vocab)
    slots = [("temps", torch.float32, (bs,)), ("top_k", torch.int32, (bs if has_k else 0,)),
             ("top_p", torch.float32, (bs if has_p else 0,)), ("coins", torch.float32, (bs, d)),
             ("coins_final", torch.float32, (bs,)), ("part_max", torch.float32, (rows, splits)),
             ("part_sum", torch.int64, (rows, splits)), ("walk_state", torch.int32, (bs, WALK_FIELDS + d)),
             ("res_sum", torch.float64, (bs, rsplits)), ("res_last", torch.int32, (bs, rsplits)),
             ("counters", torch.int32, (bs,))]
    if has_k or has_p:
        slots += [("pivots", torch.float32, (rows, 4))] + select_slots(rows, splits)
    return slots


def fused_workspace_bytes(bs: int, d: int, vocab: int, top_k: bool = False, top_p: bool = False) -> int:
    """Bytes of a fused step's workspace (before allocator rounding): it grows with bs * D,
    never with bs * D * V.

    Args:
        bs, d, vocab: the step's shape.
        top_k, top_p: whether those renorms run.

    Returns:
        The workspace size in bytes.
    """
    return Layout(step_slots(bs, d, vocab, top_k, top_p)).nbytes


_PLANS = PlanCache(StepPlan)


def clear_plans() -> None:
    """Forget every cached plan, the standalone renorm's too (and the compiled-kernel handles they hold)."""
    _PLANS.clear()
    _select.clear_plans()


def plan_for(step: VerifyStep) -> StepPlan:
    """The cached plan of ``step``'s shape and argument forms (made on first sight)."""
    bs, d = step.candidates.shape
    logits = step.logits
    device = logits.get_device()
    forms, in_place, dtypes = [], [], []
    for value in (step.temperatures, step.top_ks, step.top_ps):
        if value is None:
            forms.append(ABSENT)
            in_place.append(False)
        elif not isinstance(value, torch.Tensor):
            forms.append(NUMBER)
            in_place.append(False)
        else:  # read in place when the kernels can; else copied into its slot first
            direct = value.get_device() == device and value.is_contiguous()
            forms.append(PER_REQUEST if not direct or value.numel() == bs else ONE_VALUE)
            in_place.append(direct)
            dtypes.append(value.dtype)
    forms, in_place = tuple(forms), tuple(in_place)
    return _PLANS.get((bs, d, logits.shape[1], logits.dtype, step.tree.tree_depth, device, forms, in_place,
                       tuple(dtypes), _select.tunables()),
                      bs, d, logits.shape[1], step.tree.tree_depth, forms, in_place)


# ---------------------------------------------------------------------------------
# One step


def run_step(step: VerifyStep, out: VerifyResult, launch: bool = True) -> None:
    """The fused step into ``out``, its workspace allocated here (inside the caller's borrow
    scope, if any).

    ``step`` was checked (``check`` and ``require_contiguous``) and, if asked, validated by
    the caller; nothing is checked again here. Allocates the step's one workspace, then
    (unless ``launch`` is False) launches the kernels, which write every entry of ``out``
    (``accept_length`` counting the emitted token). With ``launch=False`` nothing runs:
    the capacity planner records this function on the layout-only device, so its plan is
    the allocation sequence of exactly this path.
    """
    plan = plan_for(step)
    buffer = plan.layout.allocate(step.logits)
    if launch:
        _launch(plan, step, out, buffer, 0)


def _launch(plan: StepPlan, step: VerifyStep, out: VerifyResult, buffer: torch.Tensor, at: int) -> None:
    """Launch the step: its workspace is ``buffer``'s bytes from ``at``."""
    tree, device = step.tree, step.logits.get_device()
    values = (step.temperatures, step.top_ks, step.top_ps)
    params = [v if direct else None for v, direct in zip(values, plan.in_place)]
    coins = [c if c is not None and c.get_device() == device else None for c in (step.coins, step.coins_final)]
    if coins[0] is None or coins[1] is None or plan.copies:
        _fill_slots(plan, step, buffer, at, coins)
    given = [step.logits, step.candidates, tree.retrive_index, tree.retrive_next_token, tree.retrive_next_sibling,
             *out, *coins, *params]
    pointers = [None if t is None else t.data_ptr() for t in given]
    launcher = plan.launcher
    if launcher.direct(device, aligned(*(p for p in pointers if p is not None))):
        w = plan.layout.pointers(buffer, at)
    else:
        w, pointers = plan.layout.views(buffer, at), given
    launcher.run(_launches(plan, step, w, pointers))


def _fill_slots(plan: StepPlan, step: VerifyStep, buffer: torch.Tensor, at: int, coins: list) -> None:
    """Fill the slots the kernels read instead of the caller's tensors: coins drawn (or
    copied from another device), parameter tensors the kernels cannot read in place."""
    layout = plan.layout
    for name, given, usable in (("coins", step.coins, coins[0]), ("coins_final", step.coins_final, coins[1])):
        if usable is None:
            slot = layout.view(buffer, name, at)
            if given is None:
                draw_into(slot, step.generator)
            else:
                slot.copy_(given)
    for name, value, form, direct in zip(("temps", "top_k", "top_p"), (step.temperatures, step.top_ks, step.top_ps),
                                         plan.forms, plan.in_place):
        if form == PER_REQUEST and not direct:
            layout.view(buffer, name, at).copy_(value.reshape(-1).expand(plan.bs))


def _launches(plan: StepPlan, step: VerifyStep, w, pointers: list) -> list:
    """The step's launches, ``(kernel, grid, args, options)``: pointer arguments are ``w``'s
    slots and ``pointers`` (the caller's tensors, None where a slot stands in), as device
    addresses or tensors alike."""
    (logits, candidates, retrive_index, next_token, next_sibling, predicts, accept_index, accept_length,
     coins, coins_final, temps_src, k_src, p_src) = pointers
    coins = w.coins if coins is None else coins
    coins_final = w.coins_final if coins_final is None else coins_final
    t_form, k_form, p_form = plan.forms
    top_k = w.top_k if plan.has_k else w.part_max  # (an unused pointer when absent)
    top_p = w.top_p if plan.has_p else w.part_max
    pivots = w.pivots if plan.renorm else w.part_max
    select_counters = w.select_counters if plan.renorm else w.counters
    bs, d, vocab, splits, steps = plan.bs, plan.d, plan.vocab, plan.splits, plan.steps
    block, split_block, precise = _select.BLOCK, _select.SPLIT_MAX, not INTERPRETED
    launches = [(_row_max_kernel, plan.grid_rows, (
        logits, w.part_max, predicts, w.counters, select_counters,
        w.temps, w.temps if temps_src is None else temps_src, _number(step.temperatures, t_form, float),
        top_k, top_k if k_src is None else k_src, _number(step.top_ks, k_form, _clamped_int),
        top_p, top_p if p_src is None else p_src, _number(step.top_ps, p_form, float),
        bs, vocab, splits, plan.chunk, plan.renorm, t_form, k_form, p_form, block), plan.stream_options)]
    walk = (pivots, candidates, retrive_index, next_token, next_sibling, coins, predicts, accept_index,
            accept_length, w.walk_state)
    thresholds = (step.threshold_single, step.threshold_acc)
    launches.append((_row_sum_kernel, plan.grid_rows, (
        logits, w.temps, w.part_max, w.part_sum, w.counters, *walk, d, vocab, splits, plan.chunk, steps,
        plan.scale, plan.unscale, *thresholds, not plan.renorm, False, False, block, split_block, precise),
        plan.stream_options))
    if plan.renorm:
        search = _select.SelectWorkspace(w.state_i, w.state_f, w.part_w, w.part_c, w.scratch, w.select_counters)
        launches += select_launches(plan.rows, vocab, logits, pivots, search, top_k if plan.has_k else None,
                                    top_p if plan.has_p else None, d, splits, plan.chunk,
                                    stats=(w.temps, w.part_max, w.part_sum, plan.unscale))
        launches.append((_walk_kernel, plan.grid_walk, (
            logits, w.temps, w.part_max, w.part_sum, *walk, d, vocab, splits, steps, plan.unscale, *thresholds,
            plan.has_k, plan.has_p, split_block, precise), plan.walk_options))
    launches.append((_residual_kernel, plan.grid_residual, (
        logits, w.temps, w.part_max, w.part_sum, pivots, w.walk_state, coins_final, w.res_sum, w.res_last,
        w.counters, predicts, d, vocab, splits, plan.rsplits, plan.rchunk, plan.unscale, plan.has_k, plan.has_p,
        plan.d_block, block, split_block, precise), plan.stream_options))
    return launches


def _number(value, form: int, convert):
    """A parameter given as a number, as the first kernel takes it (0 of its type when it reads a tensor)."""
    return convert(value) if form == NUMBER else convert(0)


def _clamped_int(k) -> int:
    """top-k as an int32 kernel argument: k >= V keeps everything, so 2**31 - 1 stands for any larger k."""
    return min(int(k), INT32_MAX)


def fused_token_probs(logits: torch.Tensor, temperatures, d: int, tokens: torch.Tensor) -> torch.Tensor:
    """The fused path's target probabilities at ``tokens`` [rows, K] (int64), per row.

    For checking: they equal ``target_probs_reference(logits, temperatures per row)``
    gathered at ``tokens``, bit for bit.

    Args:
        logits: [rows, V] logits, rows a multiple of ``d``.
        temperatures: a number or one per request (rows / d).
        d: rows per request.
        tokens: [rows, K] int64 token ids.

    Returns:
        [rows, K] float32 probabilities.

    Raises:
        ValueError: ``tokens`` of the wrong shape or dtype, or rows not a multiple of ``d``.
    """
    rows, vocab = logits.shape
    if tokens.dim() != 2 or tokens.shape[0] != rows or tokens.dtype != torch.int64:
        raise ValueError(f"tokens must be int64 [rows={rows}, K]")
    if rows % d:
        raise ValueError(f"logits hold {rows} rows, not a whole number of requests of d={d} rows")
    bs = rows // d
    form = PER_REQUEST if isinstance(temperatures, torch.Tensor) else NUMBER
    plan = StepPlan(bs, d, vocab, 1, (form, ABSENT, ABSENT), (False, False, False))
    w = plan.layout.views(plan.layout.allocate(logits))
    if form == PER_REQUEST:
        w.temps.copy_(temperatures.reshape(-1).expand(bs))
    tokens = tokens.contiguous()
    out = logits.new_empty(tokens.shape, dtype=torch.float32)
    none, block, split_block, precise = w.part_max, _select.BLOCK, _select.SPLIT_MAX, not INTERPRETED
    launcher = Launcher()  # a check, not a hot path: every launch through the JIT front end
    launcher.direct(logits.get_device(), False)
    launcher.run([
        (_row_max_kernel, plan.grid_rows, (
            logits, w.part_max, w.walk_state, w.counters, w.counters, w.temps, w.temps,
            _number(temperatures, form, float), none, none, 0, none, none, 0.0, bs, vocab, plan.splits, plan.chunk,
            False, form, ABSENT, ABSENT, block), plan.stream_options),
        (_row_sum_kernel, plan.grid_rows, (
            logits, w.temps, w.part_max, w.part_sum, w.counters, *([none] * 10), d, vocab, plan.splits, plan.chunk,
            1, plan.scale, plan.unscale, 1.0, 1.0, False, False, False, block, split_block, precise),
         plan.stream_options),
        (_token_prob_kernel, (rows, 1, 1), (
            logits, w.temps, w.part_max, w.part_sum, tokens, out, d, vocab, plan.splits, tokens.shape[1],
            plan.unscale, 256, split_block, precise), dict(num_warps=4, **compile_options()))])
    return out


# ---------------------------------------------------------------------------------
# Kernels

if TRITON_AVAILABLE:
    WALK_FIELDS_C = tl.constexpr(WALK_FIELDS)

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

    @triton.jit(do_not_specialize=["bs", "splits", "t_value", "k_value", "p_value"])
    def _row_max_kernel(logits, part_max, predicts, counters, select_counters, temps, t_src, t_value, top_k, k_src,
                        k_value, top_p, p_src, p_value, bs, vocab, splits, chunk,
                        ZERO_SELECT: tl.constexpr, T_FORM: tl.constexpr, K_FORM: tl.constexpr,
                        P_FORM: tl.constexpr, BLOCK: tl.constexpr):
        """Largest logit per (row, slice): m = max(x) / t later, as division by t > 0 is monotone.
        Slice 0 of each row zeroes its output and counters; of the first bs rows, also writes
        that request's parameters."""
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
                _store_param(temps, t_src, t_value, row, T_FORM, False)
                _store_param(top_k, k_src, k_value, row, K_FORM, True)
                _store_param(top_p, p_src, p_value, row, P_FORM, False)
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


