"""Launch configurations of the fused kernels: what every call of one shape computes once, cached.

A :class:`StepConfig` is everything about a fused verification step that its shape and the
form of its arguments decide (a parameter given as a number or a tensor, and its dtype):
the vocabulary split, the work items and the launches that take them, each launch's grid
and compile options, the workspace's layout and the outputs' layout. A
:class:`RenormConfig` is the same for the standalone top-k / top-p renorm. Both are made on
first sight and kept (:data:`STEP_CONFIGS`, :data:`RENORM_CONFIGS`), and each keeps the
workspace its eager calls share per stream (:class:`Workspace`). The sizes below are part
of every configuration's key (:func:`tunables`), so a test that shrinks them gets
configurations of its own.
"""

from __future__ import annotations

import torch

from ..probs import sum_bits
from ..step import VerifyResult
from .occupancy import program_cap, resident_programs
from .pivot_search import STATE_FLOATS, STATE_INTS
from .runtime import INTERPRETED, compile_options, current_stream
from .step_kernel import (
    ABSENT,
    BRACKET,
    GATHER,
    KEPT,
    MAX_SUM,
    NUMBER,
    ONE_VALUE,
    PASS,
    PER_REQUEST,
    RESIDUAL,
    RESOLVE,
    SYNC_HEAD,
    WALK_FIELDS,
)
from .workspace import Layout

__all__ = ["RENORM_CONFIGS", "STEP_CONFIGS", "ConfigCache", "RenormConfig", "StepConfig", "Workspace",
           "clear_configs", "row_layout", "split_layout", "step_config", "step_groups", "step_slots", "sync_words",
           "tunables", "workspace_bytes"]

BLOCK = 2048            # vocabulary entries per tile in the streaming kernels
SPLIT_MAX = 64          # most vocabulary slices per row
TARGET_PROGRAMS = 1056  # eight per H200 SM: slices enough to fill the GPU at small batches
SELECT_BLOCK = 1024     # entries per tile in the pivot search's threshold passes
SELECT_THRESHOLDS = 8   # thresholds per pass: the bracket shrinks ~9-fold per pass
SELECT_PASSES = 4       # multi-program passes before the gather
SELECT_CAP = 1024       # entries gathered and sorted exactly once the bracket holds no more
SELECT_WARPS = 8
STREAM_WARPS = 8
PROGRAMS_PER_SM = 4     # the step's grid before the compiled kernel's occupancy is known
# Registers per thread the step may use (ptxas: maxnreg), plain and with top-k / top-p: four
# and two programs of 8 warps per SM (docs/kernels.md, "One launch: how the queue works").
STEP_MAX_REGISTERS = (64, 128)
# With top-k / top-p a step of at least this many rows runs as one launch per kind of item,
# each compiled with the code of its items alone and its own register cap (resolve: uncapped).
SPLIT_ROWS = 32
SPLIT_MAX_REGISTERS = {MAX_SUM: 64, BRACKET: 80, PASS: 80, GATHER: 80, KEPT: 64, RESIDUAL: 64}
# The logits (fp32 at most) the sums may trail the maxima by, so a row's sums re-read its
# slices from L2 (the H200's holds 50 MiB; half of it leaves room for the rest).
SUM_LAG_BYTES = 24 << 20
# A plain step of at most ONE_ROUND_ROWS rows splits its rows for one round of ONE_ROUND_PROGRAMS
# programs (docs/kernels.md, "One round of programs for small steps"); larger steps aim at
# TARGET_PROGRAMS items, enough for the programs to balance.
ONE_ROUND_ROWS = 32
ONE_ROUND_PROGRAMS = 528
RESIDUAL_ITEMS = 1056   # items the residual split aims at (bs requests, a few slices each)
CACHE_SIZE = 256        # configurations kept per cache; the oldest goes first


def tunables() -> tuple:
    """The sizes a configuration is made with as they are now (tests shrink them): part of every key."""
    return (BLOCK, SPLIT_MAX, TARGET_PROGRAMS, SELECT_BLOCK, SELECT_THRESHOLDS, SELECT_PASSES, SELECT_CAP,
            SELECT_WARPS, STREAM_WARPS, PROGRAMS_PER_SM, STEP_MAX_REGISTERS, tuple(SPLIT_MAX_REGISTERS.items()),
            SPLIT_ROWS, SUM_LAG_BYTES, ONE_ROUND_ROWS, ONE_ROUND_PROGRAMS, RESIDUAL_ITEMS)


# ---------------------------------------------------------------------------------
# The split of rows into slices, the items and the launches


def split_layout(rows: int, vocab: int, want: int | None = None) -> tuple[int, int]:
    """(slices per row, entries per slice) for the [rows, slices] items: ``want`` slices per
    row or fewer (by default enough for ``TARGET_PROGRAMS`` items, to fill the GPU), every
    slice a whole number of tiles and none empty."""
    tiles = max(1, -(-vocab // BLOCK))
    if want is None:
        want = -(-TARGET_PROGRAMS // max(rows, 1))
    splits = int(min(SPLIT_MAX, tiles, max(1, want)))
    per = -(-tiles // splits)
    return -(-tiles // per), per * BLOCK


def row_layout(rows: int, vocab: int, renorm: bool = False) -> tuple[int, int]:
    """(slices per row, entries per slice) of a step's row items: one round of programs for a
    small plain step (``ONE_ROUND_ROWS``), else aimed at ``TARGET_PROGRAMS``."""
    one_round = rows <= ONE_ROUND_ROWS and not renorm
    return split_layout(rows, vocab, ONE_ROUND_PROGRAMS // rows if one_round else None)


def residual_layout(bs: int, vocab: int) -> tuple[int, int]:
    """(slices per request, entries per slice) of the residual items."""
    return split_layout(bs, vocab, -(-RESIDUAL_ITEMS // max(bs, 1)))


def sum_lag(rows: int, splits: int, chunk: int) -> int:
    """Maxima items the first sums trail by (``verify_kernel``'s ``lag``): every (row, slice)
    when the logits fit in ``SUM_LAG_BYTES``, else as many slices as do, and never fewer than
    one row's (so a sum's maxima always come first in the queue)."""
    return int(min(rows * splits, max(splits, SUM_LAG_BYTES // (4 * chunk))))


def step_items(bs: int, d: int, splits: int, rsplits: int, nsel: int, passes: int, step: bool = True) -> int:
    """Work items of one step (as ``verify_kernel`` counts them): maxima and sums per (row,
    slice); per top-k / top-p search, its bracket, passes, gather and kept sum per (row,
    slice) and its resolve per row; the residual per (request, slice). ``step=False``: the
    row statistics alone."""
    per_row_slices = bs * d * splits
    if not step:
        return 2 * per_row_slices
    return 2 * per_row_slices + nsel * ((passes + 3) * per_row_slices + bs * d) + bs * rsplits


def step_groups(bs: int, d: int, splits: int, rsplits: int, nsel: int, passes: int, step: bool = True,
                split: bool = False) -> list:
    """The step's launches, ``(first ticket, end ticket, kinds, walks)`` each: one launch of
    every item, or (``split``) one per kind of item: maxima and sums, then per search its
    bracket, its passes, its gather, its resolve and its kept sums, then the residuals.
    ``kinds``: ``verify_kernel``'s ``KINDS``; ``walks``: the launch holds the items that
    finish a row, so it walks trees."""
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


# ---------------------------------------------------------------------------------
# Workspaces


def select_slots(rows: int, splits: int, counters: bool = True) -> list:
    """The pivot search's workspace slots, ``(name, dtype, shape)``: per-row state, per-slice
    partial weights and counts, the gathered entries, and (``counters``) per-row arrival
    counters, which a step keeps in its own ``sync`` slot instead."""
    t = SELECT_THRESHOLDS
    slots = [("state_i", torch.int32, (rows, STATE_INTS)), ("state_f", torch.float64, (rows, STATE_FLOATS)),
             ("part_w", torch.float64, (rows, splits, t)), ("part_c", torch.int32, (rows, splits, t)),
             ("scratch", torch.int32, (rows, SELECT_CAP))]
    return slots + [("select_counters", torch.int32, (rows,))] if counters else slots


def step_slots(bs: int, d: int, vocab: int, has_k: bool, has_p: bool) -> list:
    """The fused step's workspace slots, ``(name, dtype, shape)``: per request ``temps``,
    ``top_k`` (int32) and ``top_p`` as the kernel reads them, ``coins`` / ``coins_final``
    (drawn here when not given), ``walk_state`` [bs, 4 + D] (final node, its slot, last
    rejected token, dropped-token count, then those tokens), ``res_sum`` / ``res_last``
    per (request, residual slice), ``sync`` (every counter: :func:`sync_words`); per (row,
    slice) ``part_max`` and the fixed-point ``part_sum``; with top-k / top-p, ``pivots``
    [rows, 4] and the search's slots (:func:`select_slots`; without, they are empty); last
    ``cand_p`` [rows, D], each row's probability of each of its request's candidates (what
    the walk reads), and ``norms`` [rows, 2], each row's (m, s) (what the residual reads).
    It grows with bs * D * D, never with V."""
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


def workspace_bytes(bs: int, d: int, vocab: int, top_k: bool = False, top_p: bool = False) -> int:
    """Bytes of a fused step's workspace (before allocator rounding): it grows with bs * D,
    never with bs * D * V.

    Args:
        bs, d, vocab: the step's shape.
        top_k, top_p: whether those renorms run.

    Returns:
        The workspace size in bytes.
    """
    return Layout(step_slots(bs, d, vocab, top_k, top_p)).nbytes


class Workspace:
    """A workspace and what the launches that use it take from it: ``buffer``, its slots as
    typed tensors (``views``), and ``tails``, the launches' arguments that do not change from
    call to call (filled by the first launch that uses it; None again when the grid changes).

    A configuration keeps one per stream for its eager calls (:meth:`StepConfig.workspace`);
    a call with a borrow or inside a graph capture makes a fresh one (``fresh``: its
    counters must be zeroed before the launch).
    """

    __slots__ = ("buffer", "views", "tails", "fresh", "numbers")

    def __init__(self, buffer: torch.Tensor, layout: Layout, fresh: bool):
        self.buffer, self.fresh = buffer, fresh
        self.views = layout.views(buffer)
        self.tails = None
        self.numbers = [None, None]  # (the standalone renorm: the top-k / top-p numbers its slots hold)


# ---------------------------------------------------------------------------------
# Configurations


class ConfigCache:
    """Configurations by key, made on first sight by ``make(*args)``; at most ``size`` kept
    (the oldest goes first)."""

    def __init__(self, make, size: int = CACHE_SIZE):
        self.make, self.size, self.configs = make, size, {}

    def get(self, key, *args):
        """The configuration for ``key``, made from ``args`` if there is none."""
        config = self.configs.get(key)
        if config is None:
            if len(self.configs) >= self.size:
                self.configs.pop(next(iter(self.configs)))
            config = self.configs[key] = self.make(*args)
        return config

    def clear(self) -> None:
        self.configs.clear()


class _Cached:
    """What both configurations share: a layout, one workspace per stream, and the grid."""

    layout: Layout
    counters: str  # the slot that holds the counters every launch leaves at zero

    def workspace(self, like: torch.Tensor) -> Workspace:
        """The workspace eager calls on the current stream share: made (its counters zeroed)
        on first use and kept with the configuration.

        Calls on one stream run one after another, so one workspace per stream is safe;
        calls on two streams get two. It is not for calls inside a graph capture (a graph
        would keep its address and could replay on another stream) nor for borrowed steps.
        :func:`clear_configs` drops it (the memory returns to the caching allocator, on the
        stream it was made on, so no launch still using it sees it reused).
        """
        stream = current_stream(self.device) if like.is_cuda else 0
        entry = self.cached.get(stream)
        if entry is None:
            entry = self.cached[stream] = self.fresh_workspace(like)
            getattr(entry.views, self.counters).zero_()
            entry.fresh = False
        return entry

    def fresh_workspace(self, like: torch.Tensor) -> Workspace:
        """A new workspace on ``like``'s device, its counters not yet zeroed."""
        return Workspace(self.layout.allocate(like), self.layout, fresh=True)


class StepConfig(_Cached):
    """Everything about a fused step that its shape and argument forms decide.

    ``layout``: the workspace's slots; ``items``: the work items of one step; ``groups``:
    its launches, ``(first ticket, end, kinds, walks)`` each (:func:`step_groups`), and
    ``programs``: each one's persistent grid (at most what the GPU holds at once, once the
    compiled kernel's occupancy is known: :meth:`tune`); ``options``: each one's compile
    options; ``forms``: how temperature, top-k and top-p arrive (``ABSENT``, ``NUMBER``,
    ``PER_REQUEST``, ``ONE_VALUE``) and whether the kernel reads the caller's tensor in
    place (``in_place``); ``output_words``: int32 words of the outputs, each of the three
    starting 16-byte aligned; ``cached``: the eager calls' workspaces by stream; ``trace``:
    where a traced configuration's launches write their clock times (None: not traced; set
    before the first launch, on a configuration of its own: :mod:`.timeline`).
    """

    counters = "sync"

    def __init__(self, bs: int, d: int, vocab: int, steps: int, forms: tuple, in_place: tuple, device: int = -1,
                 step: bool = True):
        self.bs, self.d, self.vocab, self.steps, self.device = bs, d, vocab, steps, device
        self.forms, self.in_place = forms, in_place
        self.step = step  # False: the row statistics alone (fused_token_probs)
        self.copies = any(f == PER_REQUEST and not direct for f, direct in zip(forms, in_place))  # into slots first
        self.rows = rows = bs * d
        self.has_k, self.has_p = forms[1] != ABSENT, forms[2] != ABSENT
        self.renorm = self.has_k or self.has_p
        self.nsel = int(self.has_k) + int(self.has_p)
        self.splits, self.chunk = row_layout(rows, vocab, self.renorm)
        self.rsplits, self.rchunk = residual_layout(bs, vocab)
        bits = sum_bits(vocab)
        self.scale, self.unscale = 2.0 ** bits, 2.0 ** -bits
        self.passes = SELECT_PASSES
        self.layout = Layout(step_slots(bs, d, vocab, self.has_k, self.has_p))
        words = [bs * d, bs * steps, bs]
        starts = (0, -(-words[0] // 4) * 4, -(-words[0] // 4) * 4 + -(-words[1] // 4) * 4)
        self.output_words = -(-(starts[2] + bs) // 4) * 4
        # the outputs cut from one buffer in one call: each followed by its padding where it has
        # any, and where each of the three is among the pieces
        self.output_pieces, self.output_at = [], []
        for i, end in enumerate((*starts[1:], self.output_words)):
            self.output_at.append(len(self.output_pieces))
            padding = end - starts[i] - words[i]
            self.output_pieces += [words[i], padding] if padding else [words[i]]
        self.lag = sum_lag(rows, self.splits, self.chunk)
        self.items = step_items(bs, d, self.splits, self.rsplits, self.nsel, self.passes, step)
        self.split = self.renorm and rows >= SPLIT_ROWS
        self.groups = step_groups(bs, d, self.splits, self.rsplits, self.nsel, self.passes, step, self.split)
        cap = program_cap(device, PROGRAMS_PER_SM)
        self.programs = [max(1, min(end - first, cap)) for first, end, _, _ in self.groups]
        self.tuned = INTERPRETED  # (the grid is final once the kernel's occupancy is known)
        self.d_block = 1 << max(d - 1, 0).bit_length()
        self.options = []
        for _, _, kinds, _ in self.groups:
            options = dict(num_warps=STREAM_WARPS, **compile_options())
            registers = SPLIT_MAX_REGISTERS.get(kinds) if self.split else STEP_MAX_REGISTERS[int(self.renorm)]
            if registers and not INTERPRETED:
                options["maxnreg"] = registers
            self.options.append(options)
        self.cached: dict = {}
        self.trace = None  # an int64 tensor: the launches record their clock times there (:mod:`.timeline`)

    def outputs(self, buffer: torch.Tensor):
        """The three outputs, cut from an int32 ``buffer`` of ``output_words`` (which nothing
        else holds: the pieces share its memory without being tracked as its views)."""
        pieces = buffer.unsafe_split_with_sizes(self.output_pieces)
        at = self.output_at
        return VerifyResult(pieces[0], pieces[at[1]].view(self.bs, self.steps), pieces[at[2]])

    def tune(self, compiled: list) -> None:
        """Once the kernels are compiled (``compiled``: each launch's): the grid becomes what the
        GPU holds at once (more programs would only start after others finished, to find the
        queue empty)."""
        self.tuned = True
        programs = []
        for (first, end, _, _), kernel, now in zip(self.groups, compiled, self.programs):
            resident = resident_programs(kernel, self.device, STREAM_WARPS) if kernel is not None else 0
            programs.append(min(end - first, resident) if resident else now)
        self.set_programs(programs)

    def set_programs(self, programs) -> None:
        """Each launch's persistent grid from now on (one number: every launch's; any
        positive size gives the same result)."""
        if isinstance(programs, int):
            programs = [programs] * len(self.groups)
        self.programs = [max(1, int(n)) for n in programs]
        for entry in self.cached.values():
            entry.tails = None


class RenormConfig(_Cached):
    """What the standalone renorm of one shape computes once: the split and the workspace's
    layout (the pivots, the search's slots, top-k and top-p per row), and the eager calls'
    workspaces by stream (``cached``)."""

    counters = "select_counters"

    def __init__(self, rows: int, vocab: int, has_k: bool, has_p: bool, device: int = -1):
        self.rows, self.vocab, self.has_k, self.has_p, self.device = rows, vocab, has_k, has_p, device
        self.splits, self.chunk = split_layout(rows, vocab)
        # the parameter slots go last: placed before the search's slots they moved its state by
        # 128 bytes, and on the H200 the passes of an 8-row renorm took 39 % longer (docs/kernels.md)
        self.layout = Layout([("pivots", torch.float32, (rows, 4))] + select_slots(rows, self.splits)
                             + [("top_k", torch.int32, (rows if has_k else 0,)),
                                ("top_p", torch.float32, (rows if has_p else 0,))])
        self.search_options = dict(num_warps=SELECT_WARPS, **compile_options())
        self.apply_options = dict(num_warps=STREAM_WARPS, **compile_options())
        self.cached: dict = {}


STEP_CONFIGS = ConfigCache(StepConfig)
RENORM_CONFIGS = ConfigCache(RenormConfig)


def clear_configs() -> None:
    """Forget every cached configuration, the fused step's and the standalone renorm's (and
    the workspaces they hold)."""
    STEP_CONFIGS.clear()
    RENORM_CONFIGS.clear()


def step_config(step) -> StepConfig:
    """The cached configuration of a :class:`~graphborrow.eagle.step.VerifyStep`'s shape and
    argument forms (made on first sight)."""
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
    forms, in_place = tuple(forms), tuple(in_place)
    return STEP_CONFIGS.get((bs, d, logits.shape[1], logits.dtype, step.tree.tree_depth, device, forms, in_place,
                             tuple(dtypes), tunables()),
                            bs, d, logits.shape[1], step.tree.tree_depth, forms, in_place, device)

