"""The fused verification step: ``eagle_verify(impl="fused")``'s body, one persistent Triton kernel.

:func:`verify` runs a checked :class:`~graphborrow.eagle.step.VerifyStep` (every mode is
this one step: it holds no [bs*D, V] matrix), launching ``verify_kernel``
(:mod:`.step_kernel`) through Triton's launcher with the step's cached
:class:`~graphborrow.eagle.triton.launch_config.StepConfig`; :func:`run_step` is the same
step in a workspace of its own (borrowed, captured in a graph, or recorded without a launch
for the capacity planner). Every probability is the reference's formula
(:mod:`graphborrow.eagle.probs`), so the same coins give the reference's tokens. How the
kernel works and how fast it is: ``docs/kernels.md``.
"""

from __future__ import annotations

import torch

from ..scope import run_borrowing
from ..step import VerifyResult, VerifyStep, check_outputs, draw_into
from . import launch_config as lc
from .launch_config import StepConfig, Workspace, step_config, sync_words
from .runtime import INTERPRETED, TRITON_AVAILABLE, capturing_now, compile_options
from .step_kernel import NUMBER, PER_REQUEST

if TRITON_AVAILABLE:
    from .step_kernel import token_prob_kernel, verify_kernel

__all__ = ["allocate_outputs", "check_launchable", "fused_token_probs", "run_config", "run_step", "step_counters",
           "verify"]

INT32_MAX = 2**31 - 1


def verify(step: VerifyStep, borrow=None, out=None) -> VerifyResult:
    """The fused step for a checked (and, if asked, validated) ``step``: new outputs (one
    allocation) unless ``out`` gives them (:func:`~graphborrow.eagle.step.check_outputs`).

    With an enabled ``borrow`` the step's workspace is allocated inside the borrow scope and
    freed there; without one (and outside a CUDA graph capture) the configuration's
    workspace for the current stream is used, so the call allocates its outputs alone.

    Returns:
        The step's :class:`~graphborrow.eagle.step.VerifyResult`.
    """
    config = step_config(step)
    if out is None:
        out = config.outputs(step.candidates.new_empty(config.output_words, dtype=torch.int32))
    else:
        out = VerifyResult(*check_outputs(out, step))
    if not step.batch_size:
        return out
    if (borrow is None or not borrow.enabled) and not (step.logits.is_cuda and capturing_now()):
        _launch(config, step, out, config.workspace(step.logits))
    else:
        run_borrowing(borrow, run_step, step, out)
    return out


def check_launchable(logits: torch.Tensor) -> None:
    """Refuse, naming the fix, logits the fused kernels cannot run on."""
    if not TRITON_AVAILABLE:
        raise ValueError("impl='fused' needs the Triton verification kernels, and triton is not installed; pip "
                         "install 'graphborrow[kernels]', or use impl='reference'")
    if logits.device.type not in ("cuda", "cpu"):
        raise ValueError(f"the fused kernels launch on CUDA (or CPU tensors in Triton's interpreter), "
                         f"got {logits.device}; use impl='reference'")
    if logits.device.type == "cpu" and not INTERPRETED:
        raise ValueError("CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1 before importing "
                         "graphborrow.eagle.triton.runtime, or use impl='reference'")


def allocate_outputs(step: VerifyStep) -> VerifyResult:
    """The fused step's outputs, uninitialised (the kernel writes every entry): three views
    of one int32 allocation, each starting 16-byte aligned."""
    config = step_config(step)
    return config.outputs(step.candidates.new_empty(config.output_words, dtype=torch.int32))


def run_step(step: VerifyStep, out: VerifyResult, launch: bool = True, counters: torch.Tensor | None = None) -> None:
    """The fused step into ``out``, its workspace allocated here (inside the caller's borrow
    scope, if any).

    ``step`` was checked (``check`` and ``require_contiguous``) and, if asked, validated by
    the caller; nothing is checked again here. Allocates the step's one workspace, then
    (unless ``launch`` is False) zeroes its counters and launches the kernel, which writes
    every entry of ``out`` (``accept_length`` counting the emitted token). With
    ``launch=False`` nothing runs: the capacity planner records this function on the
    layout-only device, so its answer is the allocation sequence of exactly this path.
    ``counters``: zeroed counters of the caller's (:func:`step_counters`) used instead of the
    workspace's, so nothing is zeroed first (a captured step then is its kernel alone).
    """
    config = step_config(step)
    workspace = config.fresh_workspace(step.logits) if launch else config.layout.allocate(step.logits)
    if launch:
        _launch(config, step, out, workspace, counters)


def run_config(config: StepConfig, step: VerifyStep, out: VerifyResult) -> None:
    """:func:`run_step` with a configuration of the caller's (one made for ``step``'s shape,
    say a traced one: :mod:`.timeline`) instead of the cached one."""
    _launch(config, step, out, config.fresh_workspace(step.logits))


def step_counters(step: VerifyStep) -> torch.Tensor:
    """Counters a step's owner keeps (``sync_words`` int32 zeros on the logits' device) for
    :func:`run_step`'s ``counters``.

    Every launch leaves its counters zeroed, so counters that nothing else writes stay ready
    for the next launch without a zeroing node before it, as long as launches using them run
    one after another. A graph's own workspace cannot give that: the memory a captured step
    frees is taken by the later nodes of the same capture, and of later captures into the
    same pool. So these are allocated outside the capture, and whoever keeps the graph keeps
    them (:mod:`graphborrow.eagle.graphs`); two graphs replayed at once on two streams must
    not share them.
    """
    bs, d = step.candidates.shape
    return torch.zeros(sync_words(bs, d), dtype=torch.int32, device=step.logits.device)


def _launch(config: StepConfig, step: VerifyStep, out: VerifyResult, workspace: Workspace,
            counters: torch.Tensor | None = None) -> None:
    """Launch the step in ``workspace``: a fresh one has its counters zeroed first, unless
    zeroed ``counters`` of the caller's stand in for them."""
    w = workspace.views
    if workspace.fresh and counters is None:
        w.sync.zero_()
    tree, device = step.tree, step.logits.get_device()
    coins = [c if c is not None and c.get_device() == device else None for c in (step.coins, step.coins_final)]
    if coins[0] is None or coins[1] is None or config.copies:
        _fill_slots(config, step, w, coins)
    values, slots = (step.temperatures, step.top_ks, step.top_ps), (w.temps, w.top_k, w.top_p)
    t_src, k_src, p_src = (v if direct else slot for v, direct, slot in zip(values, config.in_place, slots))
    call = (step.logits, step.candidates, tree.retrive_index, tree.retrive_next_token, tree.retrive_next_sibling,
            *out, w.coins if coins[0] is None else coins[0], w.coins_final if coins[1] is None else coins[1],
            t_src, k_src, p_src,
            _number(step.temperatures, config.forms[0], float), _number(step.top_ks, config.forms[1], _clamped_int),
            _number(step.top_ps, config.forms[2], float), step.threshold_single, step.threshold_acc)
    if counters is not None:
        tails = _tails(config, w._replace(sync=counters))
    else:
        tails = workspace.tails
        if tails is None:
            tails = workspace.tails = _tails(config, w)
    compiled = [verify_kernel[grid](*call, *tail, **options) for grid, tail, options in tails]
    if not config.tuned:
        config.tune(compiled)


def _tails(config: StepConfig, w) -> list:
    """Each launch's grid, its kernel arguments after the per-call ones (the workspace's slots,
    then the configuration's sizes and constexprs) and its compile options."""
    t_form, k_form, p_form = config.forms
    slots = (w.temps, w.top_k, w.top_p, w.part_max, w.part_sum, w.walk_state, w.res_sum, w.res_last, w.sync,
             w.pivots, w.state_i, w.state_f, w.part_w, w.part_c, w.scratch, w.cand_p, w.norms,
             config.bs, config.d, config.vocab, config.splits, config.chunk, config.rsplits, config.rchunk,
             config.steps, config.passes, config.lag)
    trace = w.sync if config.trace is None else config.trace
    return [((programs, 1, 1),
             (*slots, programs, first, end, config.scale, config.unscale, trace, t_form, k_form, p_form,
              config.has_k, config.has_p, config.nsel, config.step, kinds, walks, lc.SELECT_THRESHOLDS, lc.SELECT_CAP,
              lc.SELECT_BLOCK, lc.BLOCK, lc.SPLIT_MAX, config.d_block, not INTERPRETED, config.trace is not None),
             options)
            for programs, (first, end, kinds, walks), options in zip(config.programs, config.groups, config.options)]


def _fill_slots(config: StepConfig, step: VerifyStep, w, coins: list) -> None:
    """Fill the slots the kernel reads instead of the caller's tensors: coins drawn (or
    copied from another device), parameter tensors the kernel cannot read in place."""
    for slot, given, usable in ((w.coins, step.coins, coins[0]), (w.coins_final, step.coins_final, coins[1])):
        if usable is None:
            if given is None:
                draw_into(slot, step.generator)
            else:
                slot.copy_(given)
    for slot, value, form, direct in zip((w.temps, w.top_k, w.top_p), (step.temperatures, step.top_ks, step.top_ps),
                                         config.forms, config.in_place):
        if form == PER_REQUEST and not direct:
            slot.copy_(value.reshape(-1).expand(config.bs))


def _number(value, form: int, convert):
    """A parameter given as a number, as the kernel takes it (0 of its type when it reads a tensor)."""
    return convert(value) if form == NUMBER else convert(0)


def _clamped_int(k) -> int:
    """top-k as an int32 kernel argument: k >= V keeps everything, so 2**31 - 1 stands for any larger k."""
    return min(int(k), INT32_MAX)


def fused_token_probs(logits: torch.Tensor, temperatures, d: int, tokens: torch.Tensor) -> torch.Tensor:
    """The fused path's target probabilities at ``tokens`` [rows, K] (int64), per row.

    For checking: they equal ``target_probs_reference(logits, temperatures per row)``
    gathered at ``tokens``, bit for bit. The row statistics come from the step's own kernel
    (``verify_kernel`` stopped after the sums), the probabilities from a second launch.

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
    config = StepConfig(bs, d, vocab, 1, (form, lc.ABSENT, lc.ABSENT), (False, False, False), logits.get_device(),
                        step=False)
    w = config.fresh_workspace(logits).views
    w.sync.zero_()
    if form == PER_REQUEST:
        w.temps.copy_(temperatures.reshape(-1).expand(bs))
    tokens = tokens.contiguous()
    out = logits.new_empty(tokens.shape, dtype=torch.float32)
    none = w.part_max  # (the step's tree and outputs: not read without the step)
    call = (logits, *([none] * 7), w.coins, w.coins_final, w.temps, w.top_k, w.top_p,
            _number(temperatures, form, float), 0, 0.0, 1.0, 1.0)
    for grid, tail, options in _tails(config, w):
        verify_kernel[grid](*call, *tail, **options)
    token_prob_kernel[(rows,)](logits, w.temps, w.part_max, w.part_sum, tokens, out, d, vocab, config.splits,
                               tokens.shape[1], config.unscale, 256, lc.SPLIT_MAX, not INTERPRETED, num_warps=4,
                               **compile_options())
    return out
