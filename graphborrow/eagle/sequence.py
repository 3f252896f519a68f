"""A verification step's allocation sequence, and the plans the capacity planner makes of it.

The reference step runs in phases (:mod:`.modes`): ``prepare``, then the mode's work on
groups of requests, then the release of what ``prepare`` made. Each phase is recorded
once per shape on the layout-only device (:mod:`graphborrow.planning.planner`) and cached; a
mode's sequence is their concatenation, e.g. chunked with 128 requests in groups of 48:
``prepare(128) + body(48) * 2 + body(32) + release(128)``. That is exactly what
:func:`~graphborrow.eagle.modes.run_reference` executes, phase for phase.

The fused step (:mod:`.fused`) has one sequence whatever the mode: its coins and its
workspace, recorded by running :func:`~graphborrow.eagle.triton.fused.run_step` with
``launch=False`` (the allocations without a kernel) on the same device
(:func:`fused_sequence`).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Optional

import torch

from graphborrow.core.sizes import SMALL_SIZE, round_size
from graphborrow.planning import planner
from graphborrow.planning.stored import stored_sequences

from .draft_tree import DraftTree
from .modes import MODES, VerifyResult, lean_rows, standard_rows
from .step import StepShape, VerifyStep, prepare

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
    peak_bytes: int  # most bytes (512-byte-rounded blocks) the step holds at once when it runs

    @property
    def fits(self) -> bool:
        return self.replay.fits

    @property
    def reason(self) -> str:
        return self.replay.reason


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
    bs, d = shape.batch_size, shape.draft_tokens
    if bs == 0:
        return planner.AllocationSequence()
    prefix, release = _prepare_phases(bs, d, shape.top_k, shape.top_p)
    if mode == "lean":
        return prefix + _rows_body(shape, "lean") + release
    per = bs if mode == "standard" or per_chunk is None else int(per_chunk)
    if not 1 <= per <= bs:
        raise ValueError(f"per_chunk must be in [1, {bs}], got {per_chunk!r}")
    groups, rest = divmod(bs, per)
    body = _rows_body(shape._replace(batch_size=per), "standard") * groups
    if rest:
        body = body + _rows_body(shape._replace(batch_size=rest), "standard")
    return prefix + body + release


def verify_bytes(batch_size: int, draft_tokens: int, vocab: int, mode: str, top_k: bool = False,
                 top_p: bool = False, chunk_rows: Optional[int] = None) -> int:
    """Most bytes (allocator blocks) the step holds at once, from its recorded sequence.

    A size, not a verdict: whether a step fits depends on the pool's layout as much as on
    this number (see :func:`graphborrow.planning.capacity.plan_verify`). ``chunk_rows`` sizes
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
    """Replay the step's sequence against ``image``.

    Args:
        image: the borrow pool as the planner sees it.
        shape: the step's :class:`~graphborrow.eagle.step.StepShape`.
        mode: "standard", "lean" or "chunked".
        per_chunk: chunked mode's requests per group (default: the whole batch).

    Returns:
        A :class:`ChunkPlan`: the replay's verdict, the group size and the step's peak bytes.
    """
    per = shape.batch_size if mode != "chunked" or per_chunk is None else per_chunk
    sequence = verify_sequence(shape, mode, per)
    result = planner.replay(sequence, image, describe_tensor(shape, per))
    return ChunkPlan(result, per, shape, mode, sequence.peak_bytes)


def plan_fused_step(image: planner.PoolImage, shape: StepShape, mode: str = "standard") -> ChunkPlan:
    """Replay the fused step's sequence against ``image`` (every mode runs the whole batch at once).

    Args:
        image: the borrow pool as the planner sees it.
        shape: the step's :class:`~graphborrow.eagle.step.StepShape`.
        mode: recorded in the plan only; the fused sequence is the same for every mode.

    Returns:
        A :class:`ChunkPlan` for the whole batch.
    """
    sequence = fused_sequence(shape)
    result = planner.replay(sequence, image, describe_tensor(shape, shape.batch_size))
    return ChunkPlan(result, shape.batch_size, shape, mode, sequence.peak_bytes)


def requests_per_chunk(state, shape: StepShape) -> ChunkPlan:
    """The most requests per group whose chunked step fits ``state``'s borrow pool now.

    Every group size from the whole batch down is tried in turn (the answer is not
    monotone: a 1-10 MiB matrix needs a 20 MiB segment where a 12 MiB one needs 12).
    When none fits, the returned plan (for one request per group) says why.

    Args:
        state: a :class:`~graphborrow.core.borrow.BorrowState` or a
            :class:`~graphborrow.planning.planner.PoolImage`; only read.
        shape: the step's :class:`~graphborrow.eagle.step.StepShape`.

    Returns:
        A :class:`ChunkPlan` for chunked mode with the largest group that fits.
    """
    image = state if isinstance(state, planner.PoolImage) else planner.PoolImage.of(state)
    if shape.batch_size == 0:
        return ChunkPlan(planner.Replay(True, 0, 0, 0, None), 0, shape, "chunked", 0)
    room = _free_space(image)
    for per in range(shape.batch_size, 1, -1):
        if _could_fit(room, shape, per):
            found = plan_step(image, shape, "chunked", per)
            if found.fits or image.disabled is not None:
                return found
    return plan_step(image, shape, "chunked", 1)


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


@functools.lru_cache(maxsize=CACHE_SIZE)
def _prepare_phases(bs: int, d: int, top_k: bool, top_p: bool):
    """``prepare``'s allocations, and the frees that release them at the step's end (recorded once
    per shape and kept on disk: :mod:`graphborrow.planning.stored`)."""
    key = [int(bs), int(d), bool(top_k), bool(top_p)]
    return stored_sequences("verify-prepare", key, lambda: _record_prepare(bs, d, top_k, top_p))


def _record_prepare(bs: int, d: int, top_k: bool, top_p: bool):
    with planner.recording() as rec:
        step = _dummy_step(StepShape(bs, d, 1, top_k, top_p))
        with rec.phase() as made:
            params = prepare(step)
        with rec.phase() as released:
            del params
    return planner.AllocationSequence(tuple(made)), planner.AllocationSequence(tuple(released))


@functools.lru_cache(maxsize=CACHE_SIZE)
def _rows_body(shape: StepShape, mode: str) -> planner.AllocationSequence:
    """One group's rows in ``mode``: :func:`~graphborrow.eagle.modes.standard_rows` or
    :func:`~graphborrow.eagle.modes.lean_rows`, outputs and parameters made outside the phase
    (recorded once per shape and kept on disk)."""
    return stored_sequences("verify-rows", [*_key(shape), mode], lambda: (_record_rows(shape, mode),))[0]


def _record_rows(shape: StepShape, mode: str) -> planner.AllocationSequence:
    with planner.recording() as rec:
        step = _dummy_step(shape)
        out = _outputs(step)
        params = prepare(step)
        with rec.phase() as body:
            if mode == "lean":
                lean_rows(step, params, out)
            else:
                standard_rows(step, params, 0, shape.batch_size, out)
        del params, out
    return planner.AllocationSequence(tuple(body))


@functools.lru_cache(maxsize=CACHE_SIZE)
def fused_sequence(shape: StepShape) -> planner.AllocationSequence:
    """The fused step's allocation sequence: :func:`~graphborrow.eagle.triton.fused.run_step` with
    ``launch=False``, recorded on the layout-only device (outputs made before, as
    ``eagle_verify`` makes them outside the borrow scope).

    Args:
        shape: the step's :class:`~graphborrow.eagle.step.StepShape`.

    Returns:
        The :class:`~graphborrow.planning.planner.AllocationSequence` (cached per shape).
    """
    from .triton import (
        fused,  # imports triton (selecting its interpreter without CUDA): only when planned
    )

    if shape.batch_size == 0:
        return planner.AllocationSequence()

    def record():
        with planner.recording() as rec:
            step = _dummy_step(shape)
            out = _outputs(step)
            with rec.phase() as body:
                fused.run_step(step, out, launch=False)
            del out
        return (planner.AllocationSequence(tuple(body)),)

    triton = getattr(sys.modules.get("triton"), "__version__", "")  # its interpreter runs the step's code
    return stored_sequences("verify-fused", [*_key(shape), triton], record)[0]
