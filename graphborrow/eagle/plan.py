"""Does a verification step fit the borrowed runs? The allocator model answers, not a formula.

:func:`plan_verify` records the step's allocation sequence (:mod:`.sequence`) on a
layout-only simulated device, cached per shape, and replays it against a copy of the
borrow pool as it is at that moment (:mod:`graphborrow.planning.planner`). Its contract:
``fits`` is True exactly when ``eagle_verify`` with those shapes and that mode, borrowing
from the state now, completes without running out of borrowed memory.

    plan = plan_verify(state, batch_size=32, draft_tokens=8, vocab=128256)
    plan.fits, plan.peak_bytes, plan.reason
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from graphborrow.core.sizes import MB
from graphborrow.device.cuda import CudaBackend
from graphborrow.planning.planner import PoolImage

from .modes import MODES
from .sequence import ChunkPlan, plan_fused_step, plan_step, requests_per_chunk
from .step import StepShape, choose_impl

__all__ = ["VerifyPlan", "describe_plan", "plan_verify", "MAX_STEP_BYTES"]

MAX_STEP_BYTES = 1 << 40  # 1 TiB: one probability tensor of a step no GPU holds (an H200 has 141 GB)


@dataclasses.dataclass(frozen=True)
class VerifyPlan:
    """The planner's answer for one verification step against one borrow pool.

    ``fits``: the step completes in the borrowed runs. ``requests_per_chunk``: the whole
    batch for standard and lean; chunked mode's group size (the most that fits, or 1
    with ``fits`` False when not even one request does). ``peak_bytes``: most bytes
    (512-byte-rounded blocks) the step holds at once when it runs, wherever it runs (of
    a step that does not fit, recorded when first read). ``carved_bytes``: bytes the
    arena carved from the runs for new segments in the replay (the pool's precarve
    included). ``allocations``: how many of the step's requests the replay served: the
    replay ends at the first one the pool cannot serve. ``reason``: why it does not fit,
    in words: which tensor, its size class, the largest run and the room left.
    """

    fits: bool
    requests_per_chunk: int
    reason: str
    mode: str
    batch_size: int
    draft_tokens: int
    vocab: int
    top_k: bool
    top_p: bool
    carved_bytes: int = 0
    allocations: int = 0
    largest_run: int = 0
    impl: str = "reference"
    found: Optional[ChunkPlan] = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def peak_bytes(self) -> int:
        return 0 if self.found is None else self.found.peak_bytes


def plan_verify(state, batch_size: int, draft_tokens: int, vocab: int, mode: str = "standard",
                top_k: bool = False, top_p: bool = False, impl: str = "auto") -> VerifyPlan:
    """Would ``eagle_verify`` of this shape, borrowing from ``state`` now, fit?

    Args:
        state: a :class:`~graphborrow.core.borrow.BorrowState` (or a
            :class:`~graphborrow.planning.planner.PoolImage`); it is only read (a built pool after
            the allocator call the next borrow makes first, see ``PoolImage.of``).
        batch_size: requests (0 fits trivially).
        draft_tokens: tree nodes per request (D).
        vocab: vocabulary size V (float32 logits, as samplers read them).
        mode: "standard", "lean" or "chunked".
        top_k: whether the top-k renorm runs (True or False).
        top_p: whether the top-p renorm runs (True or False).
        impl: the implementation whose allocations are planned, as ``eagle_verify`` takes it:
            ``"reference"``, ``"fused"`` (the Triton kernels' coins and workspace, recorded
            with ``launch=False``; one group whatever the mode) or ``"auto"``: fused when
            the state's device is a real CUDA device and Triton is installed (as
            ``eagle_verify(impl="auto")`` decides for CUDA logits), else the reference.

    Returns:
        A :class:`VerifyPlan`. The answer comes from replaying the step's own allocation
        sequence against the pool's current state, not from a byte formula.

    Raises:
        ValueError: a size that is not an int in range, a step whose float32 probabilities
            alone exceed :data:`MAX_STEP_BYTES`, an unknown ``mode`` or ``impl``, or
            ``top_k`` / ``top_p`` that are not bools.
    """
    for name, value, least in (("batch_size", batch_size, 0), ("draft_tokens", draft_tokens, 1), ("vocab", vocab, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
    probabilities = 4 * batch_size * draft_tokens * vocab
    if probabilities > MAX_STEP_BYTES:
        raise ValueError(
            f"batch_size={batch_size} x draft_tokens={draft_tokens} x vocab={vocab}: the step's float32 probabilities "
            f"alone would take {probabilities / 2**40:.3g} TiB, more than any GPU holds (the planner stops at "
            f"{MAX_STEP_BYTES >> 40} TiB); plan a smaller batch")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    for name, value in (("top_k", top_k), ("top_p", top_p)):
        if not isinstance(value, bool):
            raise ValueError(f"{name} says whether that renorm runs: pass True or False, got {value!r}")
    impl = choose_impl(impl, isinstance(getattr(state, "backend", None), CudaBackend))
    image = state if isinstance(state, PoolImage) else PoolImage.of(state)
    shape = StepShape(batch_size, draft_tokens, vocab, top_k, top_p)
    if batch_size == 0:
        return VerifyPlan(True, 0, "", mode, 0, draft_tokens, vocab, top_k, top_p, largest_run=image.largest_run,
                          impl=impl)
    if impl == "fused":
        found = plan_fused_step(image, shape, mode)
    elif mode == "chunked":
        found = requests_per_chunk(image, shape)
    else:
        found = plan_step(image, shape, mode)
    r = found.replay
    return VerifyPlan(r.fits, found.requests_per_chunk, r.reason, mode, batch_size, draft_tokens, vocab, top_k, top_p,
                      r.carved_bytes, r.allocations, image.largest_run, impl, found)


def describe_plan(plan: VerifyPlan) -> str:
    """One line for a status bar: fits, or why not.

    Args:
        plan: an answer of :func:`plan_verify`.

    Returns:
        The step's shape and mode, then the peak of its blocks in MiB when it fits, or the
        plan's reason when it does not.
    """
    what = f"bs={plan.batch_size} x D={plan.draft_tokens}, V={plan.vocab}, {plan.mode}"
    if plan.impl == "fused":
        what += " (fused kernels)"
    if plan.fits:
        chunk = f" in groups of {plan.requests_per_chunk}" if plan.mode == "chunked" and plan.impl != "fused" else ""
        return f"{what} fits{chunk}: peak {plan.peak_bytes / MB:.1f} MiB of blocks"
    return f"{what} does not fit: {plan.reason}"
