"""Does a verification step fit the borrowed runs? The allocator model answers, not a formula.

:func:`plan_verify` records the step's allocation sequence on a layout-only simulated
device (cached per shape) and replays it against a copy of the borrow pool as it is at
that moment (see :mod:`graphborrow.planner`). Its contract: ``fits`` is True exactly
when ``eagle_verify`` with those shapes and that mode, borrowing from the state now,
completes without running out of borrowed memory.

Why a formula cannot answer: a step's small tensors carve a 2 MiB small-pool segment out
of a run; a 1-10 MiB tensor needs a whole 20 MiB segment; larger ones a 2 MiB multiple;
order and frees inside the step decide which blocks are reused; the arena picks extents
by best or first fit. :func:`largest_borrowable` and :func:`size_class_table` teach
those classes; :func:`unborrowable_runs` names runs that can never hold a borrow.

    plan = plan_verify(state, batch_size=32, draft_tokens=8, vocab=128256)
    plan.fits, plan.peak_bytes, plan.reason
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

import torch

from .borrow import BorrowState
from .eagle.modes import MODES
from .eagle.sequence import plan_fused_step, plan_step, requests_per_chunk
from .eagle.step import StepShape
from .eagle.verify import IMPLS, fused_available
from .planner import AllocationSequence, PoolImage, replay, size_class
from .sizes import MB

__all__ = [
    "FitPolicyPool",
    "VerifyPlan",
    "describe_plan",
    "fit_policy_pool",
    "largest_borrowable",
    "plan_verify",
    "size_class_table",
    "unborrowable_runs",
]


@dataclasses.dataclass(frozen=True)
class VerifyPlan:
    """The planner's answer for one verification step against one borrow pool.

    ``fits``: the step completes in the borrowed runs. ``requests_per_chunk``: the whole
    batch for standard and lean; chunked mode's group size (the most that fits, or 1
    with ``fits`` False when not even one request does). ``peak_bytes``: most bytes
    (512-byte-rounded blocks) the step holds at once when it runs, wherever it runs.
    ``carved_bytes``: bytes the arena carved from the runs for new segments in the
    replay (the pool's precarve included). ``allocations``: how many of the step's
    requests the replay served. ``reason``: why it does not fit, in words: which tensor,
    its size class, the largest run and the room left.
    """

    fits: bool
    requests_per_chunk: int
    peak_bytes: int
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


def plan_verify(state, batch_size: int, draft_tokens: int, vocab: int, mode: str = "standard",
                top_k: bool = False, top_p: bool = False, impl: str = "auto") -> VerifyPlan:
    """Would ``eagle_verify`` of this shape, borrowing from ``state`` now, fit?

    Args:
        state: a :class:`~graphborrow.borrow.BorrowState` (or a
            :class:`~graphborrow.planner.PoolImage`); it is only read (a built pool after
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
        ValueError: a size that is not an int in range, an unknown ``mode`` or ``impl``, or
            ``top_k`` / ``top_p`` that are not bools.
    """
    for name, value, least in (("batch_size", batch_size, 0), ("draft_tokens", draft_tokens, 1), ("vocab", vocab, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    for name, value in (("top_k", top_k), ("top_p", top_p)):
        if not isinstance(value, bool):
            raise ValueError(f"{name} says whether that renorm runs: pass True or False, got {value!r}")
    impl = _planned_impl(impl, state)
    image = state if isinstance(state, PoolImage) else PoolImage.of(state)
    shape = StepShape(batch_size, draft_tokens, vocab, top_k, top_p)
    if batch_size == 0:
        return VerifyPlan(True, 0, 0, "", mode, 0, draft_tokens, vocab, top_k, top_p, largest_run=image.largest_run,
                          impl=impl)
    if impl == "fused":
        found = plan_fused_step(image, shape, mode)
    elif mode == "chunked":
        found = requests_per_chunk(image, shape)
    else:
        found = plan_step(image, shape, mode)
    r = found.replay
    return VerifyPlan(r.fits, found.requests_per_chunk, found.peak_bytes, r.reason, mode, batch_size, draft_tokens,
                      vocab, top_k, top_p, r.carved_bytes, r.allocations, image.largest_run, impl)


def _planned_impl(impl: str, state) -> str:
    """The implementation ``eagle_verify(impl=impl)`` would run on ``state``'s device."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl != "auto":
        return impl
    from .backend import CudaBackend

    backend = getattr(state, "backend", None)
    return "fused" if isinstance(backend, CudaBackend) and fused_available() else "reference"


# ----------------------------------------------------------------------------- size classes


def largest_borrowable(run_bytes: int, seeds: Sequence[int] = ()) -> int:
    """The largest single tensor a fresh borrow pool over one run of ``run_bytes`` can hold.

    Found by the planner, class by class (the answer is not monotone in the tensor size:
    a 1-10 MiB tensor needs a 20 MiB segment where a 10 MiB one needs 10):

    - runs under 2 MiB hold nothing (not even a small-pool segment);
    - runs of 2 MiB to 10 MiB hold small tensors only (up to 1 MiB);
    - runs of 10 MiB to 20 MiB add large tensors up to the run rounded down to 2 MiB,
      but no 1-10 MiB tensor;
    - from 20 MiB every class, up to the run rounded down to 2 MiB.

    Args:
        run_bytes: the run's size.
        seeds: the pool's precarve over that run (``state.precarve_sizes([(0, run_bytes)])``):
            a precarved segment holds any large tensor up to its size.

    Returns:
        Bytes (0: the run can never hold a borrow).

    Raises:
        ValueError: ``run_bytes`` is not an int >= 0.
    """
    if isinstance(run_bytes, bool) or not isinstance(run_bytes, int) or run_bytes < 0:
        raise ValueError(f"run_bytes must be an int >= 0, got {run_bytes!r}")
    image = PoolImage.from_runs([(1 << 40, run_bytes)], seeds=seeds) if run_bytes else PoolImage()
    best = 0
    for low, high in ((1, 1 * MB), (1 * MB + 1, 10 * MB - 1), (10 * MB, max(run_bytes, 10 * MB))):
        if _fits_one(image, low):
            while low < high:  # largest size in [low, high] that fits (monotone within a class)
                mid = (low + high + 1) // 2
                low, high = (mid, high) if _fits_one(image, mid) else (low, mid - 1)
            best = max(best, low)
    return best


def _fits_one(image: PoolImage, nbytes: int) -> bool:
    return replay(AllocationSequence((("alloc", -1, nbytes, 0),)), image).fits


def size_class_table(run_sizes: Iterable[int] | None = None) -> list[dict]:
    """Rows for the figure "largest borrowable tensor against run size"
    (:func:`graphborrow.plots.largest_borrowable_plot`).

    Args:
        run_sizes: run sizes in bytes (default: every 256 KiB up to 40 MiB).

    Returns:
        One dict per run: ``run_bytes``, ``largest_bytes`` and ``class`` (the size class of
        the largest borrowable tensor, or "none").
    """
    if run_sizes is None:
        run_sizes = range(MB // 4, 40 * MB + 1, MB // 4)
    rows = []
    for run in run_sizes:
        largest = largest_borrowable(int(run))
        rows.append({"run_bytes": int(run), "largest_bytes": largest,
                     "class": size_class(largest).name if largest else "none"})
    return rows


def unborrowable_runs(runs: Iterable[Sequence[int]]) -> list[tuple[int, int]]:
    """The ``(address, nbytes)`` runs that can never hold a borrow: too small for even a 2 MiB
    small-pool segment (the arena carves whole segments).

    Args:
        runs: ``(address, nbytes)`` pairs, as :func:`graphborrow.runs.find_free_runs` returns them.

    Returns:
        The runs whose :func:`largest_borrowable` is 0, in the order given.
    """
    return [(int(a), int(n)) for a, n in runs if largest_borrowable(int(n)) == 0]


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


# ----------------------------------------------------------------------------- fit policy


class FitPolicyPool:
    """A captured graph pool whose free runs make the arena's fit policy decide what fits.

    Two graphs leave a 20 MiB run (a whole segment whose 9 MiB intermediates died) and a
    12 MiB one (behind an 8 MiB output kept alive), plus small-pool slivers under 2 MiB
    that can never hold a borrow. A step whose small tensors come first and that then
    needs one 20 MiB segment (any 1-10 MiB tensor) fits under best fit, which carves the
    2 MiB small-pool segment out of the 12 MiB run, and not under first fit, which carves
    it out of the 20 MiB run (the first extent: runs come largest first). Precarve is off,
    so the arena alone decides.

    Args:
        backend: the device (any :class:`~graphborrow.device_api.DeviceAPI`; active if simulated).
    """

    def __init__(self, backend) -> None:
        self.backend = backend
        self.state = BorrowState(backend, pool_id=backend.graph_pool_handle(), precarve=False)
        self.pool_id = self.state.pool_id
        b = backend
        self.inputs = [torch.empty(8 * MB // 4, device=b.device), torch.empty(9 * MB // 4, device=b.device)]
        b.synchronize()
        self.graphs, self.outputs = [b.CUDAGraph(), b.CUDAGraph()], []
        with self.state.capture_scope(), b.graph(self.graphs[0], pool=self.pool_id):
            self.outputs.append(self.inputs[0] * 2)  # kept: 12 MiB stay free behind it
        with self.state.capture_scope(), b.graph(self.graphs[1], pool=self.pool_id):
            doubled = self.inputs[1] * 2  # takes the 12 MiB block
            shifted = self.inputs[1] + 1  # needs a segment of its own: 20 MiB
            self.outputs.append(doubled[:8] + shifted[:8])
            del doubled, shifted
        b.synchronize()

    def snapshot(self) -> list[dict]:
        """The pool's segments, to show its runs.

        Returns:
            Segment dicts in torch's snapshot format, this pool's only.
        """
        return self.backend.memory_snapshot(self.pool_id)


def fit_policy_pool(backend) -> FitPolicyPool:
    """A pool where best fit and first fit change what fits (see :class:`FitPolicyPool`).

    Args:
        backend: the device (any :class:`~graphborrow.device_api.DeviceAPI`; active if simulated).

    Returns:
        The :class:`FitPolicyPool`, its ``state`` ready to borrow.
    """
    return FitPolicyPool(backend)
