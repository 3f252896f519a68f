"""A verification step's allocation sequence, and the plans the capacity planner makes of it.

The reference step runs in phases (:mod:`.modes`): ``prepare``, then the mode's work on
groups of requests, then the release of what ``prepare`` made. Each phase is recorded
once per shape on the layout-only device (:mod:`graphborrow.planning.planner`) and cached; a
mode's sequence is their concatenation, e.g. chunked with 128 requests in groups of 48:
``prepare(128) + body(48) * 2 + body(32) + release(128)``. That is exactly what
:func:`~graphborrow.eagle.modes.run_reference` executes, phase for phase.

The fused step (:mod:`graphborrow.eagle.triton.fused`) has one sequence whatever the mode:
its coins and its workspace, recorded by running :func:`~graphborrow.eagle.triton.fused.run_step` with
``launch=False`` (the allocations without a kernel) on the same device
(:func:`fused_sequence`).

A plan feeds the phases to the replay one by one, and a phase not recorded yet is
recorded while the replay listens: the first request the pool cannot serve ends both. So a
step that cannot fit is refused after its requests up to that one, in a time that does not
grow with the batch (recording a whole step walks its rows a few at a time).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Optional

import torch

from graphborrow.core.sizes import SMALL_SIZE, round_size
from graphborrow.planning import planner
from graphborrow.planning.stored import PhaseStore

from .draft_tree import DraftTree
from .modes import MODES, lean_rows, standard_rows
from .step import StepShape, VerifyResult, VerifyStep, prepare

__all__ = ["ChunkPlan", "describe_tensor", "fused_sequence", "plan_fused_step", "plan_step", "requests_per_chunk",
           "verify_bytes", "verify_sequence"]

CACHE_SIZE = 1024


@dataclasses.dataclass(frozen=True)
class ChunkPlan:
    """A verification step's plan: the replay, and the requests per group it was made for."""

    replay: planner.Replay
    requests_per_chunk: int
    shape: StepShape
    mode: str
    fused: bool = False

    @property
    def fits(self) -> bool:
        return self.replay.fits

    @property
    def reason(self) -> str:
        return self.replay.reason

    @functools.cached_property
    def peak_bytes(self) -> int:
        """Most bytes (512-byte-rounded blocks) the step holds at once when it runs, wherever it runs.

        Of a step that does not fit, the replay saw only the requests up to the one it could not
        serve: the rest is recorded when this is first read (a time that grows with the batch).
        """
        if self.requests_per_chunk == 0:
            return 0
        if self.fused:
            return fused_sequence(self.shape).peak_bytes
        return verify_sequence(self.shape, self.mode, self.requests_per_chunk).peak_bytes


def verify_sequence(shape: StepShape, mode: str, per_chunk: Optional[int] = None) -> planner.AllocationSequence:
    """The reference step's allocation sequence for ``shape`` in ``mode``.

    Args:
        shape: the step's :class:`~graphborrow.eagle.step.StepShape`.
        mode: "standard", "lean" or "chunked".
        per_chunk: chunked mode's requests per group (default: the whole batch).

    Returns:
        The :class:`~graphborrow.planning.planner.AllocationSequence` (phases recorded once per shape).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    bs = shape.batch_size
    if bs == 0:
        return planner.AllocationSequence()
    per = _group(shape, mode, per_chunk)
    prefix, release = PREPARE(*_prepare_key(shape))
    sequence = prefix
    for rows, times in _bodies(shape, mode, per):
        sequence = sequence + ROWS(*rows)[0] * times
    return sequence + release


def _group(shape: StepShape, mode: str, per_chunk: Optional[int]) -> int:
    """Requests per group: the whole batch but in chunked mode given ``per_chunk``."""
    bs = shape.batch_size
    per = bs if mode != "chunked" or per_chunk is None else int(per_chunk)
    if not 1 <= per <= bs:
        raise ValueError(f"per_chunk must be in [1, {bs}], got {per_chunk!r}")
    return per


def _bodies(shape: StepShape, mode: str, per: int) -> list[tuple[tuple, int]]:
    """The mode's work as ``((shape, body mode), times)``: lean once, the others group by group."""
    if mode == "lean":
        return [((shape, "lean"), 1)]
    groups, rest = divmod(shape.batch_size, per)
    bodies = [((shape._replace(batch_size=per), "standard"), groups)]
    return bodies + [((shape._replace(batch_size=rest), "standard"), 1)] if rest else bodies


def verify_bytes(batch_size: int, draft_tokens: int, vocab: int, mode: str, top_k: bool = False,
                 top_p: bool = False, chunk_rows: Optional[int] = None) -> int:
    """Most bytes (allocator blocks) the step holds at once, from its recorded sequence.

    A size, not a verdict: whether a step fits depends on the pool's layout as much as on
    this number (see :func:`graphborrow.eagle.plan.plan_verify`). ``chunk_rows`` sizes
    chunked mode's groups (default: one request per group).

    Args:
        batch_size: requests (bs), at least 1.
        draft_tokens: tree nodes per request (D), at least 1.
        vocab: vocabulary size V (float32 logits).
        mode: "standard", "lean" or "chunked".
        top_k: whether the top-k renorm runs.
        top_p: whether the top-p renorm runs.
        chunk_rows: chunked mode's group size in rows (whole requests are taken); ignored
            by the other modes.

    Returns:
        Bytes: the peak of the step's 512-byte-rounded blocks (what it would add to the
        device's footprint without borrowing).

    Raises:
        ValueError: a size that is not a positive int, or an unknown ``mode``.
    """
    for name, value in (("batch_size", batch_size), ("draft_tokens", draft_tokens), ("vocab", vocab)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    per = max(1, (chunk_rows or draft_tokens) // draft_tokens) if mode == "chunked" else None
    shape = StepShape(batch_size, draft_tokens, vocab, bool(top_k), bool(top_p))
    return verify_sequence(shape, mode, min(per, batch_size) if per else None).peak_bytes


def plan_step(image: planner.PoolImage, shape: StepShape, mode: str, per_chunk: Optional[int] = None) -> ChunkPlan:
    """Replay the step's sequence against ``image``, up to the first request that does not fit.

    Args:
        image: the borrow pool as the planner sees it.
        shape: the step's :class:`~graphborrow.eagle.step.StepShape`.
        mode: "standard", "lean" or "chunked".
        per_chunk: chunked mode's requests per group (default: the whole batch).

    Returns:
        A :class:`ChunkPlan`: the replay's verdict and the group size.
    """
    return _plan(image, shape, mode, _group(shape, mode, per_chunk))[0]


def _plan(image: planner.PoolImage, shape: StepShape, mode: str, per: int) -> tuple[ChunkPlan, Optional[str]]:
    """The plan, and the part of the step where its replay ended: "prepare", "rows", "release" or None."""
    ended = None
    with planner.replaying(image, describe_tensor(shape, per)) as replay:
        if _feed(replay, PREPARE, _prepare_key(shape)):
            ended = "prepare"
        for rows, times in _bodies(shape, mode, per):
            if not ended and _feed(replay, ROWS, rows, times):
                ended = "rows"
        if not ended and not replay.feed(PREPARE(*_prepare_key(shape))[1]):
            ended = "release"
    return ChunkPlan(replay.result(), per, shape, mode), ended


def _feed(replay: planner.Replayer, store: PhaseStore, args: tuple, times: int = 1) -> bool:
    """Feed the first phase of ``store``'s ``args`` to ``replay`` ``times`` times, recording it now,
    while the replay listens, when it is not known yet. True when the replay has ended."""
    if replay.done:
        return True
    try:
        phases, heard = store.get(args, replay.serve)
    except planner.RecordingStopped:  # the replay ended inside the phase: nothing of it was kept
        return True
    for _ in range(times - heard):
        if not replay.feed(phases[0]):
            break
    return replay.done


def plan_fused_step(image: planner.PoolImage, shape: StepShape, mode: str = "standard") -> ChunkPlan:
    """Replay the fused step's sequence against ``image`` (every mode runs the whole batch at once).

    Args:
        image: the borrow pool as the planner sees it.
        shape: the step's :class:`~graphborrow.eagle.step.StepShape`.
        mode: recorded in the plan only; the fused sequence is the same for every mode.

    Returns:
        A :class:`ChunkPlan` for the whole batch.
    """
    with planner.replaying(image, describe_tensor(shape, shape.batch_size)) as replay:
        if shape.batch_size:
            _feed(replay, FUSED, (shape,))
    return ChunkPlan(replay.result(), shape.batch_size, shape, mode, fused=True)


def requests_per_chunk(state, shape: StepShape) -> ChunkPlan:
    """The most requests per group whose chunked step fits ``state``'s borrow pool now.

    Every group size from the largest the pool could hold down is tried in turn (the answer
    is not monotone: a 1-10 MiB matrix needs a 20 MiB segment where a 12 MiB one needs 12);
    a step whose ``prepare`` does not fit fits in no group size. When none fits, the returned
    plan (for one request per group) says why.

    Args:
        state: a :class:`~graphborrow.core.borrow.BorrowState` or a
            :class:`~graphborrow.planning.planner.PoolImage`; only read.
        shape: the step's :class:`~graphborrow.eagle.step.StepShape`.

    Returns:
        A :class:`ChunkPlan` for chunked mode with the largest group that fits.
    """
    image = state if isinstance(state, planner.PoolImage) else planner.PoolImage.of(state)
    if shape.batch_size == 0:
        return ChunkPlan(planner.Replay(True, 0, 0, 0, None), 0, shape, "chunked")
    for per in range(_largest_could_fit(_free_space(image), shape), 1, -1):
        found, ended = _plan(image, shape, "chunked", per)
        if found.fits or image.disabled is not None:
            return found
        if ended == "prepare":  # the same for every group size
            break
    return plan_step(image, shape, "chunked", 1)


def _largest_could_fit(room: tuple[int, int], shape: StepShape) -> int:
    """The largest group size (0 to the batch) meeting :func:`_could_fit`, which smaller groups meet too."""
    low, high = 0, shape.batch_size
    while low < high:
        middle = (low + high + 1) // 2
        if _could_fit(room, shape, middle):
            low = middle
        else:
            high = middle - 1
    return low


def _free_space(image: planner.PoolImage) -> tuple[int, int]:
    """(largest, total) bytes a step could ever get from the pool: cached free large blocks and
    the arena's room (over-estimates: precarve seeds lie inside the extents)."""
    cached = [b["size"] for s in image.segments if s.get("segment_type") == "large"
              for b in s["blocks"] if b["state"] == "inactive"]
    rooms = [n for _, n in image.extents]
    return max(cached + rooms, default=0), sum(cached) + sum(rooms)


def _could_fit(room: tuple[int, int], shape: StepShape, per: int) -> bool:
    """A necessary condition, never a verdict: a group of ``per`` requests holds its float32 target
    probabilities [per*D, V] and a draft scratch of that size at once, each in one block."""
    block = round_size(per * shape.draft_tokens * shape.vocab * 4)
    largest, total = room
    return block <= SMALL_SIZE or (block <= largest and 2 * block <= total)


def describe_tensor(shape: StepShape, per_chunk: int):
    """A namer for the step's requests: "[rows, V] float32 matrix" where the size says so.

    Args:
        shape: the step's :class:`~graphborrow.eagle.step.StepShape`.
        per_chunk: requests per group, whose row counts are tried too.

    Returns:
        A function from a request's size in bytes to words such as ``"a [256, 128256]
        float32 matrix"``, or ``""`` when no row count explains the size; the planner
        uses it to say which tensor did not fit.
    """
    bs, d, vocab = shape.batch_size, shape.draft_tokens, shape.vocab
    row_counts = sorted({bs * d, per_chunk * d, (bs % per_chunk or per_chunk) * d, bs, per_chunk}, reverse=True)
    kinds = {4: "float32 matrix", 8: "float64 matrix", 1: "bool mask"}
    if shape.logits_dtype != torch.float32:
        kinds[2] = f"matrix of {str(shape.logits_dtype).replace('torch.', '')} logits rows"

    def describe(nbytes: int) -> str:
        for width, name in kinds.items():
            for rows in row_counts:
                if rows * vocab * width == nbytes:
                    return f"a [{rows}, {vocab}] {name}"
        return ""

    return describe


# ----------------------------------------------------------------------------- recorded phases


def _dummy_step(shape: StepShape) -> VerifyStep:
    """A step of this shape on the (active) layout-only device: no values, exact layout."""
    bs, d = shape.batch_size, shape.draft_tokens

    def long():
        return torch.empty(bs, d, dtype=torch.long, device="cuda")

    tree = DraftTree(long(), long(), long(), long(), d)
    logits = torch.empty(bs * d, shape.vocab, dtype=shape.logits_dtype, device="cuda")
    return VerifyStep(logits, tree.candidates, tree, 1.0, 1 if shape.top_k else None, 1.0 if shape.top_p else None)


def _outputs(step: VerifyStep) -> VerifyResult:
    bs, d = step.batch_size, step.draft_tokens
    c = step.candidates
    return VerifyResult(c.new_zeros(bs * d, dtype=torch.int32), c.new_full((bs, step.tree_depth), -1, dtype=torch.int32),
                        c.new_zeros(bs, dtype=torch.int32))


def _key(shape: StepShape) -> list:
    """The shape as JSON values: what a stored sequence is named by (with the code's version)."""
    return [int(shape.batch_size), int(shape.draft_tokens), int(shape.vocab), bool(shape.top_k), bool(shape.top_p),
            str(shape.logits_dtype)]


def _prepare_key(shape: StepShape) -> tuple:
    return (shape.batch_size, shape.draft_tokens, shape.top_k, shape.top_p)


def _record_prepare(bs: int, d: int, top_k: bool, top_p: bool, listener=None):
    """``prepare``'s allocations, and the frees that release them at the step's end."""
    with planner.recording() as rec:
        step = _dummy_step(StepShape(bs, d, 1, top_k, top_p))
        with rec.phase(listener) as made:
            params = prepare(step)
        with rec.phase() as released:
            del params
    return planner.AllocationSequence(tuple(made)), planner.AllocationSequence(tuple(released))


def _record_rows(shape: StepShape, mode: str, listener=None) -> tuple[planner.AllocationSequence]:
    """One group's rows in ``mode``: :func:`~graphborrow.eagle.modes.standard_rows` or
    :func:`~graphborrow.eagle.modes.lean_rows`, outputs and parameters made outside the phase."""
    with planner.recording() as rec:
        step = _dummy_step(shape)
        out = _outputs(step)
        params = prepare(step)
        with rec.phase(listener) as body:
            if mode == "lean":
                lean_rows(step, params, out)
            else:
                standard_rows(step, params, 0, shape.batch_size, out)
        del params, out
    return (planner.AllocationSequence(tuple(body)),)


def _record_fused(shape: StepShape, listener=None) -> tuple[planner.AllocationSequence]:
    from .triton import fused

    with planner.recording() as rec:
        step = _dummy_step(shape)
        out = _outputs(step)
        with rec.phase(listener) as body:
            fused.run_step(step, out, launch=False)
        del out
    return (planner.AllocationSequence(tuple(body)),)


def _triton_version() -> str:
    """Triton's version: its interpreter runs the fused step's code (imported only when planned)."""
    from .triton import fused  # noqa: F401  (imports triton, selecting its interpreter without CUDA)

    return getattr(sys.modules.get("triton"), "__version__", "")


# Each phase is recorded once per shape and kept (in memory and on disk: graphborrow.planning.stored)
PREPARE = PhaseStore("verify-prepare", _record_prepare, lambda bs, d, top_k, top_p: [int(bs), int(d), bool(top_k),
                                                                                   bool(top_p)], CACHE_SIZE)
ROWS = PhaseStore("verify-rows", _record_rows, lambda shape, mode: [*_key(shape), mode], CACHE_SIZE)
FUSED = PhaseStore("verify-fused", _record_fused, lambda shape: [*_key(shape), _triton_version()], CACHE_SIZE)


def fused_sequence(shape: StepShape) -> planner.AllocationSequence:
    """The fused step's allocation sequence: :func:`~graphborrow.eagle.triton.fused.run_step` with
    ``launch=False``, recorded on the layout-only device (outputs made before, as
    ``eagle_verify`` makes them outside the borrow scope).

    Args:
        shape: the step's :class:`~graphborrow.eagle.step.StepShape`.

    Returns:
        The :class:`~graphborrow.planning.planner.AllocationSequence` (kept per shape).
    """
    if shape.batch_size == 0:
        return planner.AllocationSequence()
    return FUSED(shape)[0]
