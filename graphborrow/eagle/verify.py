"""``eagle_verify``: the whole non-greedy verification step, routed to the reference or the fused kernels.

Two implementations run a checked :class:`~graphborrow.eagle.step.VerifyStep`: the reference
(:mod:`.modes`, pure PyTorch on any device, in three modes) and the fused Triton kernel
(:mod:`graphborrow.eagle.triton.fused`, one launch that reads the logits directly).
:func:`~graphborrow.eagle.step.choose_impl` says which one runs. ``graph=True`` layers
:mod:`.graphs` on either: the step captured in a CUDA graph on its first call and replayed
after. Both implementations compute every probability by the same formula, so for the same
coins they emit bitwise the same tokens.

Outputs are allocated before the borrow scope; every temporary is created and released
inside it. Value checks (:mod:`.validate`) run before it and can be skipped.
"""

from __future__ import annotations

import torch

from graphborrow.core.checks import as_flag
from graphborrow.core.errors import BorrowCapacityError
from graphborrow.sim.tensor import is_sim_tensor

from . import modes
from .draft_tree import DraftTree
from .modes import MODES
from .sequence import requests_per_chunk
from .step import IMPLS, VerifyResult, VerifyStep, choose_impl, real_cuda

__all__ = ["eagle_verify"]


def eagle_verify(
    logits: torch.Tensor,
    candidates: torch.Tensor | None,
    tree: DraftTree,
    temperatures,
    top_ks=None,
    top_ps=None,
    coins: torch.Tensor | None = None,
    coins_final: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    borrow=None,
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
    mode: str = "standard",
    chunk_rows: int | None = None,
    impl: str = "auto",
    validate: bool = True,
    graph: bool = False,
    out=None,
) -> VerifyResult:
    """Non-greedy EAGLE verification of ``tree`` against ``logits`` [bs*D, V].

    Args:
        logits: [bs*D, V] float32 / float16 / bfloat16, one row per tree node.
        candidates: [bs, D] int64 draft tokens (None: ``tree.candidates``).
        tree: a :class:`~graphborrow.eagle.draft_tree.DraftTree`.
        temperatures: sampling temperature (> 0), a number or a per-request tensor [bs].
        top_ks: top-k (>= 1), a number or a per-request tensor [bs]; None skips that renorm.
        top_ps: top-p (in (0, 1]), a number or a per-request tensor [bs]; None skips that renorm.
        coins: [bs, D] float32 uniform draws for the acceptance tests; None draws them.
            Supplying them makes the result reproducible (the fused and reference paths
            emit the same tokens for the same coins).
        coins_final: [bs] float32 draws for the final (residual) sample; None draws them.
        generator: the generator missing coins are drawn from.
        threshold_single: a draft token whose target probability is at least this is
            accepted outright (1.0: exact sampling; see
            :func:`~graphborrow.eagle.tree_sampling.tree_speculative_sampling_target_only`).
        threshold_acc: the accumulated probability is divided by this before the coin
            test (1.0: exact sampling).
        borrow: a borrow state; when enabled, every temporary lives inside
            ``borrow.borrow("EAGLE verify")``.
        mode: the reference's ``"standard"``, ``"lean"`` or ``"chunked"`` (:mod:`.modes`); the
            fused step holds no [rows, V] matrix and runs every mode as one group.
        chunk_rows: chunked mode's group size in rows (a multiple of D) instead of the
            planner's; without a borrow, chunked mode runs one group.
        impl: ``"reference"`` (pure PyTorch), ``"fused"`` (the Triton kernels: CUDA tensors,
            or CPU tensors in Triton's interpreter; an error without Triton or on the
            simulated device) or ``"auto"`` (fused for real CUDA tensors where Triton is
            installed, else the reference): :func:`~graphborrow.eagle.step.choose_impl`.
        validate: run the value checks (tree shape, parameter ranges, logits rows a
            sampler can draw from); they read on the host, so a step captured in a CUDA
            graph passes False and checks its inputs where they are made.
        graph: replay the step from a CUDA graph captured on the first call with these
            tensors (same addresses, shapes, dtypes) and parameters; the result's tensors
            are that graph's outputs, rewritten by its next replay. See
            :mod:`graphborrow.eagle.graphs` for what invalidates an entry, the memory it
            holds and how to clear it.
        out: ``(predicts [bs*D], accept_index [bs, S], accept_length [bs])``, int32 and
            contiguous on the logits' device, to write the result into instead of new
            tensors (say the previous step's result, once the caller has read it); every
            entry is rewritten. A serving loop that passes it allocates nothing per call.
            Not with ``graph=True``, whose entries own their outputs.

    Returns:
        A :class:`~graphborrow.eagle.step.VerifyResult` (of ``out``'s tensors when given).

    Raises:
        ValueError: a bad argument, named.
        TypeError: ``validate`` or ``graph`` not a bool (a string such as 'no' would read as true).
        BorrowCapacityError: chunked mode, when not even one request's step fits the
            borrow pool (raised before anything is allocated).
    """
    validate, graph = as_flag(validate, "validate"), as_flag(graph, "graph")
    if graph:
        if out is not None:
            raise ValueError("graph=True returns its captured step's own outputs (rewritten by each replay), so it "
                             "takes no out=; copy what you keep from the result, or call without graph=True")
        call = (logits, candidates, tree, temperatures, top_ks, top_ps, coins, coins_final, generator, borrow,
                threshold_single, threshold_acc, mode, chunk_rows, impl)
        graphs = _graphs()
        found = graphs.GRAPH_STEPS.last(call)  # the serving loop's common case: the same objects again
        if found is not None:
            return found.replay(validate)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    step = VerifyStep.of(logits, candidates, tree, temperatures, top_ks, top_ps, coins, coins_final, generator,
                         threshold_single, threshold_acc)
    impl = choose_impl(impl, real_cuda(step.logits))
    fused = None
    if impl == "fused":
        if is_sim_tensor(step.logits):
            raise ValueError("impl='fused' launches Triton kernels, which the simulated device cannot run; use "
                             "impl='reference' (or 'auto') there, and plan the fused step with "
                             "graphborrow.eagle.plan.plan_verify(..., impl='fused')")
        fused = _fused()
        fused.check_launchable(step.logits)
        step.require_contiguous()
    if validate:
        step.validate()
    borrowing = borrow if borrow is not None and bool(borrow.enabled) else None
    per_chunk = None if fused is not None or mode != "chunked" else _chunk_requests(step, borrowing, chunk_rows)
    if graph:
        return graphs.GRAPH_STEPS.verify(call, step, impl, mode, per_chunk, borrowing, validate)
    if fused is not None:
        return fused.verify(step, borrow, out=out)
    return modes.verify(step, borrow, out, mode, per_chunk)


def _chunk_requests(step: VerifyStep, borrow, chunk_rows) -> int:
    """Requests per group in chunked mode: from ``chunk_rows``, else from the capacity planner."""
    d = step.draft_tokens
    if chunk_rows is not None:
        if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < d:
            raise BorrowCapacityError(
                f"chunk_rows={chunk_rows!r} holds no whole request of {d} rows; use a multiple of {d}"
            )
        return max(1, min(chunk_rows // d, step.batch_size))
    if borrow is None or step.batch_size == 0:
        return max(step.batch_size, 1)  # nothing to size from: one group
    found = requests_per_chunk(borrow, step.shape)
    if not found.fits:
        raise BorrowCapacityError(f"chunked verification cannot run in the borrowed runs: {found.reason}")
    return found.requests_per_chunk


_FUSED = _GRAPHS = None  # the modules below, once imported


def _fused():
    """The fused kernels' module, imported on first use (it imports triton, which selects its
    interpreter on a machine without CUDA)."""
    global _FUSED
    if _FUSED is None:
        from .triton import fused

        _FUSED = fused
    return _FUSED


def _graphs():
    """The graph path's module, imported on first use (with the fused kernels')."""
    global _GRAPHS
    if _GRAPHS is None:
        from . import graphs

        _GRAPHS = graphs
    return _GRAPHS
