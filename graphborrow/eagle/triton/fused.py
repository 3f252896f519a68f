"""EAGLE verification at kernel speed: one persistent Triton kernel that reads the logits directly.

:func:`run_step` is :func:`graphborrow.eagle.eagle_verify`'s fused body (every mode is
this one step: it holds no [bs*D, V] matrix); :func:`fused_verify` is the same call with
static output buffers. Each row's target distribution is the formula of
:mod:`graphborrow.eagle.probs`, which the reference computes too, computed where it is
needed.

**One launch.** The step is one launch of ``verify_kernel`` (:mod:`.step_kernel`), a *persistent* kernel: a grid
no larger than what the GPU holds at once, whose programs take work items from a queue
(an atomic ticket counter in the workspace) until it is empty. The items, in ticket order:

1. per (row, vocabulary slice): the slice's largest logit (``m = max(x) / t`` later, as
   division by t > 0 is monotone). A row's slice 0 also writes its request's parameters
   (temperature, top-k, top-p: numbers or the caller's tensors) into the workspace, and
   ticket 0 zeroes every ``predicts`` entry;
2. per (row, slice): the fixed-point sum of ``exp(x / t - m)``, once the row's maxima are
   all in. The sums trail the maxima by ``lag`` items (:func:`sum_lag`), taken in turn
   with them, so a large step's sums re-read logits still in L2;
3. with top-k / top-p: the sort-free pivot search of :mod:`.select` (bracket, passes,
   gather, resolve, kept sum), each step once the row's previous one is done;
4. per (request, slice): the float64 mass of the final row's residual (its rejected children
   removed unless every depth was accepted), once the request's tree has been walked; the
   request's last slice finds the slice where ``coin * mass`` falls and scans only that one.

The walk of a request's draft tree (upstream's acceptance rule) is done by the program that
finishes the last row of the request. The item that finishes a row first writes the row's
probability of each of its request's candidates (``cand_p``: one gather of D logits), so the
walk reads each tried child's probability in one load instead of computing the row's
statistics and loading the child's token, then its logit, at every depth; and its (m, s)
(``norms``), which the residual items read instead of reducing the row's slices again.
Dependencies are per row and per request: the program that completes a row's step (the
last of its slices to arrive, an atomic counter) publishes it (a release store of the row's
step number); an item of the next step spins until it sees it (acquire). Every item
depends only on items with smaller tickets, taken earlier by programs that are running, so
the spin always ends, whatever the grid size and however many programs the GPU holds at
once; in Triton's interpreter (programs one after another)
program 0 takes every ticket in order and never waits.

With top-k / top-p, a step of ``SPLIT_ROWS`` rows or more runs as one launch per kind of
item instead (maxima and sums; per search its bracket, passes, gather, resolve and kept
sums; residuals: 12 launches with both): the same kernel, each launch taking a range of
tickets and compiled with the code of its items alone, so the memory-bound passes need
fewer registers (more programs per SM) than in the one launch whose code holds every kind
of item, while the host time of the launches is small beside the step's device time. Below
it, that one launch. (On the H200 both are still slower on the device than the earlier
one-kernel-per-step design: docs/kernels.md.)

Nothing synchronises with the host, so the step can be captured in a CUDA graph.

**The counters start at zero and end at zero.** Every counter the kernel uses (ticket,
arrivals, per-row step numbers, walk flags) lives in the workspace's ``sync`` slot, which
must hold zeros when the kernel starts; the kernel leaves it zeroed (each counter is reset
by the last program to use it, the ticket by the last program to leave). A fresh
workspace has its ``sync`` slot zeroed before the launch (one fill: captured, a memset node
before the kernel's); the cached workspace (below) is zeroed once, when it is made; and a
caller that owns counters outside its workspace (:func:`step_counters`, as the graph
path's entries do) passes them in place of the slot, so its captured step is the kernel alone.

Host time. Everything a call would otherwise redo is computed once per *plan* — the
step's shape and the form of its arguments (a number or a tensor, and its dtype) —
and cached (:class:`StepPlan`): the vocabulary split, the item counts, launches and grids,
the workspace layout and, after the plan's first call, the compiled kernels, which later
calls launch directly (:mod:`.launch`). An eager call without a borrow (and not being captured
into a CUDA graph) reuses the plan's workspace for the current stream, made on first use
(:meth:`StepPlan.workspace`), so it allocates its outputs only, and nothing when the caller
passes them (``out=``); :func:`.eager.eager` is that call with the arguments checked and assembled
in as few Python operations as the checks allow, launching through :mod:`.direct` (the
kernel's other arguments packed once per plan and stream).
With a borrow, or while a graph is captured, the step allocates its workspace (a size fixed
by the shape, so the capacity planner replays exactly this request, recorded by
``run_step(..., launch=False)`` on the layout-only device) and zeroes its counters first.
The caller's coins are read where they are; coins not given are drawn into the
workspace. Without CUDA the kernel runs in Triton's interpreter (slow, for tests).

The same coins give the reference's tokens: every probability is bitwise the
reference's; the float64 running sums of the residual and of top-k / top-p kept mass are
added in another order than torch's, which matters only when a coin lands within about
1e-16 of a boundary (see :mod:`graphborrow.eagle.triton.probs`).
"""

from __future__ import annotations

import functools

import torch

from ..draft_tree import DraftTree
from ..modes import VerifyResult
from ..scope import run_borrowing
from ..step import VerifyStep, check_outputs, draw_into
from . import select as _select
from .launch import Launcher, PlanCache, aligned, current_stream
from .probs import (
    INTERPRETED,
    TRITON_AVAILABLE,
    compile_options,
    sum_bits,
    target_probs_reference,
)
from .select import (
    select_slots,
    split_layout,
    top_k_renorm,
    top_p_renorm,
)
from .step_kernel import ABSENT, NUMBER, ONE_VALUE, PER_REQUEST, SYNC_HEAD, WALK_FIELDS
from .workspace import Layout

if TRITON_AVAILABLE:
    import triton

    from .step_kernel import token_prob_kernel, verify_kernel

__all__ = [
    "TRITON_AVAILABLE",
    "StepPlan",
    "clear_plans",
    "fused_token_probs",
    "fused_verify",
    "fused_workspace_bytes",
    "run_plan",
    "run_step",
    "split_layout",
    "step_counters",
    "target_probs_reference",
    "top_k_renorm",
    "top_p_renorm",
]

PROGRAMS_PER_SM = 4  # the grid before the compiled kernel's occupancy is known
# Registers per thread the kernel may use (ptxas: maxnreg), plain and with top-k / top-p: four
# and two programs of 8 warps per SM. Uncapped, the whole step in one function takes 80 and
# 255 registers, as many as its heaviest rarely run code (the sampling scan, the search's
# sort) needs, and the GPU would hold three programs per SM, or one; capped, that code
# spills a little to the stack and the streaming loops keep the GPU's memory busy.
STEP_MAX_REGISTERS = (64, 128)
# With top-k / top-p a step of at least this many rows runs as one launch per kind of item
# (five to eight launches, each compiled with the code of its items alone): the memory-bound
# passes then run at the occupancy of small kernels, and the host time of the launches is
# small beside the step's.
SPLIT_ROWS = 32
MAX_SUM, RESIDUAL, BRACKET, RESOLVE, KEPT, PASS, GATHER = 1, 2, 4, 8, 16, 32, 64  # kinds, as verify_kernel's KINDS
SPLIT_MAX_REGISTERS = {MAX_SUM: 64, BRACKET: 80, PASS: 80, GATHER: 80, KEPT: 64, RESIDUAL: 64}  # (resolve: uncapped)
# The logits (fp32 at most) the sums may trail the maxima by: a row's sums then re-read its
# slices from L2 instead of memory (the H200's L2 holds 50 MiB; half of it leaves room for the rest).
SUM_LAG_BYTES = 24 << 20
# A step of at most ONE_ROUND_ROWS rows splits its rows for one round of the plain step's
# resident programs (four per H200 SM): each program then takes one maximum and one sum of
# two or four tiles instead of two of one or two: fewer tickets, arrivals and waits on the
# path that sets a small step's time (2.4-3.8 us of 31-38 replayed at 4 x 4, 4 x 8 and 1 x 16
# on the H200, data/verify_one_round_h200.json).
# Larger steps aim at select.TARGET_PROGRAMS items, enough for the programs to balance.
ONE_ROUND_ROWS = 32
ONE_ROUND_PROGRAMS = 528
# Items the residual split aims at (bs requests, a few slices each; two and four times as
# many slices measured within the noise, data/verify_tiles_in_flight_residual_split_h200.txt).
RESIDUAL_ITEMS = 1056
INTERPRETED_PROGRAMS = 3  # the interpreter runs programs one after another: program 0 does every item
INT32_MAX = 2**31 - 1



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
        launch: ``False`` allocates the outputs and the workspace and returns without running
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
    return verify(step, borrow, launch, out)


def verify(step: VerifyStep, borrow=None, launch: bool = True, out=None) -> VerifyResult:
    """:func:`~graphborrow.eagle.eagle_verify`'s fused path for a checked (and, if asked,
    validated) ``step``: new outputs (one allocation) unless ``out`` gives them
    (:func:`~graphborrow.eagle.step.check_outputs`), then the step.

    With an enabled ``borrow`` the step's workspace is allocated inside the borrow scope and
    freed there; without one (and outside a CUDA graph capture) the plan's cached workspace
    for the current stream is used, so the call allocates nothing else.

    Returns:
        The step's :class:`~graphborrow.eagle.modes.VerifyResult`.
    """
    plan = plan_for(step)
    if out is None:
        out = plan.outputs(step.candidates.new_empty(plan.output_words, dtype=torch.int32))
    else:
        out = VerifyResult(*check_outputs(out, step))
    if step.batch_size:
        _run(plan, step, out, borrow, launch)
    return out


def allocate_outputs(step: VerifyStep) -> VerifyResult:
    """The fused step's outputs, uninitialised (the kernel writes every entry): three views
    of one int32 allocation, each starting 16-byte aligned."""
    plan = plan_for(step)
    return plan.outputs(step.candidates.new_empty(plan.output_words, dtype=torch.int32))


def _run(plan: "StepPlan", step: VerifyStep, out: VerifyResult, borrow, launch: bool) -> None:
    """The step into ``out``: in the plan's cached workspace when it can be (launched, no
    enabled borrow, no graph being captured), else :func:`run_step` (in the borrow scope)."""
    if launch and (borrow is None or not borrow.enabled) and not _capturing(step.logits):
        _launch(plan, step, out, plan.workspace(step.logits), fresh=False)
    else:
        run_borrowing(borrow, run_step, step, out, launch)


def _capturing(logits: torch.Tensor) -> bool:
    """Whether the current CUDA stream is capturing a graph (a captured step must not bake in
    a workspace that later eager calls share)."""
    return logits.is_cuda and torch.cuda.is_current_stream_capturing()


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


class CachedWorkspace:
    """A plan's workspace for one stream, reused by every eager call on that stream.

    ``buffer``: the workspace (its counters zeroed once, when it was made; each launch
    leaves them zeroed); ``views``: its slots as tensors; ``pointers``: their addresses;
    ``launches``: the short path's launches on this stream, ``(call, leading, trailing)``
    each, made by its first call once the plan's kernel is compiled (:mod:`.eager`).
    """

    __slots__ = ("buffer", "views", "pointers", "launches")

    def __init__(self, buffer: torch.Tensor, layout: Layout):
        self.buffer = buffer
        self.views = layout.views(buffer)
        self.pointers = layout.pointers(buffer)
        self.launches = None  # [(C launcher, leading arguments, trailing arguments)], one per launch


class StepPlan:
    """Everything about a fused step that its shape and argument forms decide.

    ``layout``: the workspace's slots; ``items``: the work items of one step; ``groups``:
    its launches, ``(first ticket, end, kinds, walks)`` each (:func:`step_groups`), and
    ``programs``: each one's persistent grid (at most what the GPU holds at once, once the
    compiled kernel's occupancy is known); ``forms``: how temperature, top-k and top-p
    arrive (``ABSENT``, ``NUMBER``, ``PER_REQUEST``, ``ONE_VALUE``) and whether the kernel
    reads the caller's tensor in place (``in_place``); ``output_words``: int32 words of the
    outputs, each of the three starting 16-byte aligned; ``launcher``: the compiled kernel;
    ``cached``: the eager calls' workspaces by stream (:meth:`workspace`); ``trace``: where a
    traced plan's launches write their clock times (None: not traced; set before the first
    launch, on a plan of its own: :func:`graphborrow.eagle.triton.timeline.traced_plan`).
    """

    def __init__(self, bs: int, d: int, vocab: int, steps: int, forms: tuple, in_place: tuple, device: int = -1,
                 step: bool = True):
        self.bs, self.d, self.vocab, self.steps, self.device = bs, d, vocab, steps, device
        self.torch_device = torch.device("cuda", device) if device >= 0 else torch.device("cpu")
        self.forms, self.in_place = forms, in_place
        self.copies = any(f == PER_REQUEST and not direct for f, direct in zip(forms, in_place))  # into slots first
        self.rows = rows = bs * d
        self.has_k, self.has_p = forms[1] != ABSENT, forms[2] != ABSENT
        self.splits, self.chunk = row_layout(rows, vocab, self.has_k or self.has_p)
        self.rsplits, self.rchunk = residual_layout(bs, vocab)
        bits = sum_bits(vocab)
        self.scale, self.unscale = 2.0 ** bits, 2.0 ** -bits
        self.renorm = self.has_k or self.has_p
        self.nsel = int(self.has_k) + int(self.has_p)
        self.passes = _select.SELECT_PASSES
        self.layout = Layout(step_slots(bs, d, vocab, self.has_k, self.has_p))
        words = [bs * d, bs * steps, bs]
        self.output_starts = (0, -(-words[0] // 4) * 4, -(-words[0] // 4) * 4 + -(-words[1] // 4) * 4)
        self.output_words = -(-(self.output_starts[2] + bs) // 4) * 4
        self.output_bytes = (4 * self.output_starts[1], 4 * self.output_starts[2])  # accept_index, accept_length
        # the buffer cut in one call (one C call makes the pieces; three as_strided calls cost twice the host time):
        # predicts, accept_index and accept_length, each followed by its padding where it has any (a piece is
        # a tensor made per call), and where each of the three is among the pieces
        starts = (*self.output_starts, self.output_words)
        lengths = (bs * d, bs * steps, bs)
        self.output_pieces, self.output_at = [], []
        for i in range(3):
            self.output_at.append(len(self.output_pieces))
            padding = starts[i + 1] - starts[i] - lengths[i]
            self.output_pieces += [lengths[i], padding] if padding else [lengths[i]]
        self.output_template = None  # an empty int32 tensor on the device, made for the eager short path
        self.lag = sum_lag(rows, self.splits, self.chunk)
        self.items = step_items(bs, d, self.splits, self.rsplits, self.nsel, self.passes, step)
        self.split = self.renorm and rows >= SPLIT_ROWS
        self.groups = step_groups(bs, d, self.splits, self.rsplits, self.nsel, self.passes, step, self.split)
        self.programs = [max(1, min(end - first, _program_cap(device))) for first, end, _, _ in self.groups]
        self.tuned = INTERPRETED  # (the grid is final once the kernel's occupancy is known)
        self.d_block = triton.next_power_of_2(d) if TRITON_AVAILABLE else d
        self.options = []
        for _, _, kinds, _ in self.groups:
            options = dict(num_warps=_select.STREAM_WARPS, **compile_options())
            cap = SPLIT_MAX_REGISTERS.get(kinds) if self.split else STEP_MAX_REGISTERS[int(self.renorm)]
            if cap and not INTERPRETED:
                options["maxnreg"] = cap
            self.options.append(options)
        self.launcher = Launcher()
        self.cached: dict = {}
        self.trace = None  # an int64 tensor: the launches record their clock times there (:mod:`.timeline`)

    def outputs(self, buffer: torch.Tensor) -> VerifyResult:
        """The three outputs, cut from an int32 ``buffer`` of ``output_words`` (which nothing
        else holds: the pieces share its memory without being tracked as its views)."""
        pieces = buffer.unsafe_split_with_sizes(self.output_pieces)
        at = self.output_at
        return VerifyResult(pieces[0], pieces[at[1]].view(self.bs, self.steps), pieces[at[2]])

    def workspace(self, like: torch.Tensor) -> CachedWorkspace:
        """The workspace eager calls on the current stream share: made (its counters zeroed)
        on first use and kept with the plan.

        Calls on one stream run one after another, so one workspace per stream is safe;
        calls on two streams get two. It is not used while a graph is captured (a graph
        would keep its address and could run on another stream) nor with a borrow.
        :func:`clear_plans` drops it (the memory returns to the caching allocator, on the
        stream it was made on, so no launch still using it can see it reused).
        """
        stream = 0 if INTERPRETED else current_stream(self.device)
        entry = self.cached.get(stream)
        if entry is None:
            buffer = self.layout.allocate(like)
            self.layout.view(buffer, "sync").zero_()
            entry = self.cached[stream] = CachedWorkspace(buffer, self.layout)
        return entry

    def tune(self) -> None:
        """Once the kernel is compiled: the grid becomes what the GPU holds at once (more
        programs would only start after others finished, to find the queue empty)."""
        self.tuned = True
        programs = []
        for (first, end, _, _), kernel, now in zip(self.groups, self.launcher.compiled, self.programs):
            resident = _resident_programs(kernel, self.device)
            programs.append(min(end - first, resident) if resident else now)
        self.set_programs(programs)

    def set_programs(self, programs) -> None:
        """Each launch's persistent grid from now on (one number: every launch's; any
        positive size gives the same result)."""
        if isinstance(programs, int):
            programs = [programs] * len(self.groups)
        self.programs = [max(1, int(n)) for n in programs]
        for entry in self.cached.values():
            entry.launches = None


def step_items(bs: int, d: int, splits: int, rsplits: int, nsel: int, passes: int, step: bool = True) -> int:
    """Work items of one step (as ``verify_kernel`` counts them): maxima and sums per (row,
    slice); per top-k / top-p search, its bracket, passes, gather and kept sum per (row,
    slice) and its resolve per row; the residual per (request, slice). ``step=False``: the
    row statistics alone."""
    rows = bs * d
    per_row_slices = rows * splits
    if not step:
        return 2 * per_row_slices
    return 2 * per_row_slices + nsel * ((passes + 3) * per_row_slices + rows) + bs * rsplits


def sum_lag(rows: int, splits: int, chunk: int) -> int:
    """Maxima items the first sums trail by (``verify_kernel``'s ``lag``): every (row, slice)
    when the logits fit in ``SUM_LAG_BYTES``, else as many slices as do, and never fewer than
    one row's (so a sum's maxima always come first in the queue)."""
    return int(min(rows * splits, max(splits, SUM_LAG_BYTES // (4 * chunk))))


def step_groups(bs: int, d: int, splits: int, rsplits: int, nsel: int, passes: int, step: bool = True,
                split: bool = False) -> list:
    """The step's launches, ``(first ticket, end ticket, kinds, walks)`` each: one launch of
    every item, or (``split``) one per kind of item: maxima and sums, then per search its
    bracket, its passes, its gather, its resolve and its kept sums, then the residuals.
    Kinds (``verify_kernel``'s ``KINDS``): 1 maxima and sums, 2 residuals, 4 a search's
    bracket, 32 its passes, 64 its gather, 8 its resolve, 16 its kept sum; ``walks``: the launch
    holds the items that finish a row, so it walks trees."""
    rows = bs * d
    per_step = rows * splits
    total = step_items(bs, d, splits, rsplits, nsel, passes, step)
    if not step:
        return [(0, total, MAX_SUM, False)]
    if not split:
        return [(0, total, MAX_SUM | RESIDUAL | (BRACKET | PASS | GATHER | RESOLVE | KEPT if nsel else 0), True)]
    groups = [(0, 2 * per_step, MAX_SUM, nsel == 0)]
    search = (passes + 3) * per_step + rows
    for q in range(nsel):
        base = 2 * per_step + q * search
        passed = base + (passes + 1) * per_step
        gathered = passed + per_step
        groups += [(base, base + per_step, BRACKET, False), (base + per_step, passed, PASS, False),
                   (passed, gathered, GATHER, False), (gathered, gathered + rows, RESOLVE, False),
                   (gathered + rows, base + search, KEPT, True)]
    return [g for g in groups if g[1] > g[0]] + [(2 * per_step + nsel * search, total, RESIDUAL, False)]


def sync_words(bs: int, d: int) -> int:
    """int32 counters of a step: the queue's (``SYNC_HEAD``), then per row its step number
    and arrivals, per request its rows done, its walk flag and its residual arrivals."""
    return SYNC_HEAD + 2 * bs * d + 3 * bs


@functools.cache
def _device_properties(device: int):
    return torch.cuda.get_device_properties(device)


def _program_cap(device: int) -> int:
    """The grid before the kernel is compiled: ``PROGRAMS_PER_SM`` per SM."""
    if INTERPRETED:
        return INTERPRETED_PROGRAMS
    if device < 0 or not torch.cuda.is_available():
        return 132 * PROGRAMS_PER_SM  # (compiling without a GPU: an H200's)
    return _device_properties(device).multi_processor_count * PROGRAMS_PER_SM


def _resident_programs(kernel, device: int) -> int:
    """Programs of ``kernel`` the GPU holds at once (by its registers, shared memory and
    warps per program), or 0 when unknown."""
    if device < 0 or not torch.cuda.is_available():
        return 0
    props = _device_properties(device)
    threads = 32 * int(getattr(kernel.metadata, "num_warps", _select.STREAM_WARPS))
    per_sm = getattr(props, "max_threads_per_multi_processor", 2048) // threads
    regs = int(getattr(kernel, "n_regs", 0) or 0)
    if regs:
        per_sm = min(per_sm, getattr(props, "regs_per_multiprocessor", 65536) // (-(-regs // 8) * 8 * threads))
    shared = int(getattr(kernel.metadata, "shared", 0) or 0)
    if shared:
        per_sm = min(per_sm, getattr(props, "shared_memory_per_multiprocessor", 233472) // (shared + 1024))
    return props.multi_processor_count * max(per_sm, 1)


def step_slots(bs: int, d: int, vocab: int, has_k: bool, has_p: bool) -> list:
    """The fused step's workspace slots, ``(name, dtype, shape)``: per request ``temps``,
    ``top_k`` (int32) and ``top_p`` as the kernel reads them, ``coins`` / ``coins_final``
    (drawn here when not given), ``walk_state`` [bs, 4 + D] (final node, its slot, last
    rejected token, dropped-token count, then those tokens), ``res_sum`` / ``res_last``
    per (request, residual slice), ``sync`` (every counter: :func:`sync_words`); per (row,
    slice) ``part_max`` and the fixed-point ``part_sum``; with top-k / top-p, ``pivots``
    [rows, 4] and the search's slots (:func:`~graphborrow.eagle.triton.select.select_slots`;
    without, they are empty); last ``cand_p`` [rows, D], each row's probability of each of its
    request's candidates (what the walk reads), and ``norms`` [rows, 2], each row's (m, s)
    (what the residual reads). It grows with bs * D * D, never with V."""
    rows = bs * d
    renorm = has_k or has_p
    splits, _ = row_layout(rows, vocab, renorm)
    rsplits, _ = residual_layout(bs, vocab)
    slots = [("temps", torch.float32, (bs,)), ("top_k", torch.int32, (bs if has_k else 0,)),
             ("top_p", torch.float32, (bs if has_p else 0,)), ("coins", torch.float32, (bs, d)),
             ("coins_final", torch.float32, (bs,)), ("part_max", torch.float32, (rows, splits)),
             ("part_sum", torch.int64, (rows, splits)), ("walk_state", torch.int32, (bs, WALK_FIELDS + d)),
             ("res_sum", torch.float64, (bs, rsplits)), ("res_last", torch.int32, (bs, rsplits)),
             ("sync", torch.int32, (sync_words(bs, d),)), ("pivots", torch.float32, (rows if renorm else 0, 4))]
    walk = [("cand_p", torch.float32, (rows, d)), ("norms", torch.float32, (rows, 2))]
    return slots + select_slots(rows if renorm else 0, splits, counters=False) + walk


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


def row_layout(rows: int, vocab: int, renorm: bool = False) -> tuple[int, int]:
    """(slices per row, entries per slice) of a step's row items: one round of programs for a
    small plain step (``ONE_ROUND_ROWS``), else aimed at ``select.TARGET_PROGRAMS``."""
    one_round = rows <= ONE_ROUND_ROWS and not renorm
    return split_layout(rows, vocab, ONE_ROUND_PROGRAMS // rows if one_round else None)


def residual_layout(bs: int, vocab: int) -> tuple[int, int]:
    """(slices per request, entries per slice) of the residual items."""
    return split_layout(bs, vocab, -(-RESIDUAL_ITEMS // max(bs, 1)))


def tunables() -> tuple:
    """The sizes a plan is made with as they are now (tests shrink them): part of every plan's key."""
    return _select.tunables() + (STEP_MAX_REGISTERS, tuple(SPLIT_MAX_REGISTERS.items()), PROGRAMS_PER_SM, SPLIT_ROWS,
                                 SUM_LAG_BYTES, ONE_ROUND_ROWS, ONE_ROUND_PROGRAMS, RESIDUAL_ITEMS)


STEP_PLANS = PlanCache(StepPlan)  # every plan made, by key (the eager short path looks its plan up here)
ON_CLEAR: list = []  # called by clear_plans: what else holds plans (the compiled short path's routes)


def clear_plans() -> None:
    """Forget every cached plan, the standalone renorm's too (the compiled-kernel handles and
    the cached workspaces they hold), and the compiled short path's routes to them."""
    STEP_PLANS.clear()
    _select.clear_plans()
    for clear in ON_CLEAR:
        clear()


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
        else:  # read in place when the kernel can; else copied into its slot first
            direct = value.get_device() == device and value.is_contiguous()
            forms.append(PER_REQUEST if not direct or value.numel() == bs else ONE_VALUE)
            in_place.append(direct)
            dtypes.append(value.dtype)
    return STEP_PLANS.get((bs, d, logits.shape[1], logits.dtype, step.tree.tree_depth, device, tuple(forms),
                           tuple(in_place), tuple(dtypes), tunables()),
                          bs, d, logits.shape[1], step.tree.tree_depth, tuple(forms), tuple(in_place), device)


# ---------------------------------------------------------------------------------
# One step


def run_step(step: VerifyStep, out: VerifyResult, launch: bool = True, counters: torch.Tensor | None = None) -> None:
    """The fused step into ``out``, its workspace allocated here (inside the caller's borrow
    scope, if any).

    ``step`` was checked (``check`` and ``require_contiguous``) and, if asked, validated by
    the caller; nothing is checked again here. Allocates the step's one workspace, then
    (unless ``launch`` is False) zeroes its counters and launches the kernel, which writes
    every entry of ``out`` (``accept_length`` counting the emitted token). With
    ``launch=False`` nothing runs: the capacity planner records this function on the
    layout-only device, so its plan is the allocation sequence of exactly this path.
    ``counters``: zeroed counters of the caller's (:func:`step_counters`) used instead of the
    workspace's, so nothing is zeroed first (a captured step then is its kernel alone).
    """
    plan = plan_for(step)
    buffer = plan.layout.allocate(step.logits)
    if launch:
        _launch(plan, step, out, buffer, fresh=True, counters=counters)


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


def run_plan(plan: StepPlan, step: VerifyStep, out: VerifyResult) -> None:
    """:func:`run_step` with a plan of the caller's (one made for ``step``'s shape, say a
    traced one: :mod:`.timeline`) instead of the cached one."""
    _launch(plan, step, out, plan.layout.allocate(step.logits), fresh=True)


def _launch(plan: StepPlan, step: VerifyStep, out: VerifyResult, workspace, fresh: bool,
            counters: torch.Tensor | None = None) -> None:
    """Launch the step. ``workspace``: a fresh buffer (``fresh``: its counters are zeroed
    first, unless zeroed ``counters`` of the caller's stand in for them) or the plan's
    :class:`CachedWorkspace`."""
    tree, device = step.tree, step.logits.get_device()
    buffer = workspace if fresh else workspace.buffer
    if fresh and counters is None:
        plan.layout.view(buffer, "sync").zero_()
    values = (step.temperatures, step.top_ks, step.top_ps)
    params = [v if direct else None for v, direct in zip(values, plan.in_place)]
    coins = [c if c is not None and c.get_device() == device else None for c in (step.coins, step.coins_final)]
    if coins[0] is None or coins[1] is None or plan.copies:
        _fill_slots(plan, step, buffer, coins)
    given = [step.logits, step.candidates, tree.retrive_index, tree.retrive_next_token, tree.retrive_next_sibling,
             *out, *coins, *params]
    pointers = [None if t is None else t.data_ptr() for t in given]
    launcher = plan.launcher
    if launcher.direct(device, aligned(*(p for p in pointers if p is not None))):
        w = workspace.pointers if not fresh else plan.layout.pointers(buffer)
    else:
        w, pointers = (workspace.views if not fresh else plan.layout.views(buffer)), given
    if counters is not None:
        w = w._replace(sync=counters if isinstance(w.sync, torch.Tensor) else counters.data_ptr())
    numbers = (_number(step.temperatures, plan.forms[0], float), _number(step.top_ks, plan.forms[1], _clamped_int),
               _number(step.top_ps, plan.forms[2], float), step.threshold_single, step.threshold_acc)
    call, tails = _step_args(plan, w, pointers, numbers)
    launcher.run([(verify_kernel, (programs, 1, 1), call + tail, options)
                  for programs, tail, options in zip(plan.programs, tails, plan.options)])
    if launcher.ready and not plan.tuned:
        plan.tune()


def _fill_slots(plan: StepPlan, step: VerifyStep, buffer: torch.Tensor, coins: list) -> None:
    """Fill the slots the kernel reads instead of the caller's tensors: coins drawn (or
    copied from another device), parameter tensors the kernel cannot read in place."""
    layout = plan.layout
    for name, given, usable in (("coins", step.coins, coins[0]), ("coins_final", step.coins_final, coins[1])):
        if usable is None:
            slot = layout.view(buffer, name)
            if given is None:
                draw_into(slot, step.generator)
            else:
                slot.copy_(given)
    for name, value, form, direct in zip(("temps", "top_k", "top_p"), (step.temperatures, step.top_ks, step.top_ps),
                                         plan.forms, plan.in_place):
        if form == PER_REQUEST and not direct:
            layout.view(buffer, name).copy_(value.reshape(-1).expand(plan.bs))


def _step_args(plan: StepPlan, w, pointers, numbers, step: bool = True) -> tuple:
    """``verify_kernel``'s arguments: the per-call ones (the caller's tensors, numbers and
    thresholds) as a tuple, and the rest (the workspace's slots, the plan's sizes and
    constexprs) as a tuple per launch, as device addresses or tensors alike. ``pointers``: logits, candidates, the
    tree's three tables, the three outputs, coins, coins_final and the temperature / top-k /
    top-p tensors read in place (None where a slot stands in); ``numbers``: temperature,
    top-k and top-p as the kernel takes them, then the two thresholds."""
    (logits, candidates, retrive_index, next_token, next_sibling, predicts, accept_index, accept_length,
     coins, coins_final, t_src, k_src, p_src) = pointers
    call = (logits, candidates, retrive_index, next_token, next_sibling, predicts, accept_index, accept_length,
            w.coins if coins is None else coins, w.coins_final if coins_final is None else coins_final,
            w.temps if t_src is None else t_src, w.top_k if k_src is None else k_src,
            w.top_p if p_src is None else p_src, *numbers)
    return call, launch_tails(plan, w, step)


def launch_tails(plan: StepPlan, w, step: bool = True) -> list:
    """Each launch's kernel arguments after the per-call ones: the workspace's slots, then the plan's."""
    t_form, k_form, p_form = plan.forms
    slots = (w.temps, w.top_k, w.top_p, w.part_max, w.part_sum, w.walk_state, w.res_sum, w.res_last, w.sync,
             w.pivots, w.state_i, w.state_f, w.part_w, w.part_c, w.scratch, w.cand_p, w.norms,
             plan.bs, plan.d, plan.vocab, plan.splits, plan.chunk, plan.rsplits, plan.rchunk, plan.steps, plan.passes,
             plan.lag)
    trace = w.sync if plan.trace is None else plan.trace if isinstance(w.sync, torch.Tensor) else plan.trace.data_ptr()
    return [(*slots, programs, first, end, plan.scale, plan.unscale, trace, t_form, k_form, p_form, plan.has_k,
             plan.has_p, plan.nsel, step, kinds, walks, _select.SELECT_THRESHOLDS, _select.SELECT_CAP,
             _select.SELECT_BLOCK, _select.BLOCK, _select.SPLIT_MAX, plan.d_block, not INTERPRETED,
             plan.trace is not None)
            for programs, (first, end, kinds, walks) in zip(plan.programs, plan.groups)]


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
    plan = StepPlan(bs, d, vocab, 1, (form, ABSENT, ABSENT), (False, False, False), logits.get_device(), step=False)
    buffer = plan.layout.allocate(logits)
    w = plan.layout.views(buffer)
    w.sync.zero_()
    if form == PER_REQUEST:
        w.temps.copy_(temperatures.reshape(-1).expand(bs))
    tokens = tokens.contiguous()
    out = logits.new_empty(tokens.shape, dtype=torch.float32)
    none = w.part_max  # (the step's tree and outputs: not read without the step)
    pointers = (logits, *([none] * 7), None, None, None, None, None)  # coins and parameters: the slots
    numbers = (_number(temperatures, form, float), 0, 0.0, 1.0, 1.0)
    call, (tail,) = _step_args(plan, w, pointers, numbers, step=False)
    launcher = Launcher()  # a check, not a hot path: every launch through the JIT front end
    launcher.direct(logits.get_device(), False)
    launcher.run([
        (verify_kernel, (plan.programs[0], 1, 1), call + tail, plan.options[0]),
        (token_prob_kernel, (rows, 1, 1), (
            logits, w.temps, w.part_max, w.part_sum, tokens, out, d, vocab, plan.splits, tokens.shape[1],
            plan.unscale, 256, _select.SPLIT_MAX, not INTERPRETED), dict(num_warps=4, **compile_options()))])
    return out
