"""The whole non-greedy verification step, in three modes and two implementations.

Modes of the reference implementation (pure PyTorch, any device):

- ``"standard"`` materialises the [bs*D, V] target probabilities and a draft scratch
  of the same size, as serving engines do;
- ``"lean"`` never does: it walks the tree on the candidates' probabilities, computed
  one tree position ([bs, V]) at a time, and rebuilds one residual row per request;
- ``"chunked"`` runs the standard step on groups of requests, as many per group as the
  capacity planner finds fitting the borrow pool, so borrowing covers batches that
  would not fit whole.

All three emit identical tokens for identical coins: every probability comes from the
same per-row arithmetic, whatever rows share a call. ``impl="fused"`` runs the step as
one CUDA kernel (``graphborrow.eagle.fused``, where installed) with the same meaning.

Outputs are allocated before the borrow scope; every temporary is created and released
inside it. Value checks (:mod:`.validate`) run before it and can be skipped.
"""

from __future__ import annotations

import contextlib
import importlib
import traceback

import torch

from ..draft_tree import DraftTree
from ..errors import BorrowCapacityError
from .modes import MODES, VerifyResult, run_reference
from .sequence import requests_per_chunk
from .step import VerifyStep, draw

__all__ = ["BORROW_USER", "IMPLS", "eagle_verify"]

IMPLS = ("auto", "reference", "fused")
BORROW_USER = "EAGLE verify"
FUSED_MODULES = ("graphborrow.eagle.fused", "graphborrow.fused_verify")


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
) -> VerifyResult:
    """Non-greedy EAGLE verification of ``tree`` against ``logits`` [bs*D, V].

    Args:
        logits: [bs*D, V] float32 / float16 / bfloat16, one row per tree node.
        candidates: [bs, D] int64 draft tokens (None: ``tree.candidates``).
        tree: a :class:`~graphborrow.draft_tree.DraftTree`.
        temperatures, top_ks, top_ps, coins, coins_final, generator, threshold_single,
            threshold_acc: see :class:`~graphborrow.eagle.step.VerifyStep`.
        borrow: a borrow state; when enabled, every temporary lives inside
            ``borrow.borrow("EAGLE verify")``.
        mode: ``"standard"``, ``"lean"`` or ``"chunked"`` (see the module docstring).
        chunk_rows: chunked mode's group size in rows (a multiple of D) instead of the
            planner's; without a borrow, chunked mode runs one group.
        impl: ``"reference"`` (pure PyTorch), ``"fused"`` (the CUDA kernel; an error where
            it is not installed) or ``"auto"`` (fused for CUDA tensors where installed).
        validate: run the value checks (tree shape, parameter ranges, logits rows a
            sampler can draw from); they read on the host, so a step captured in a CUDA
            graph passes False and checks its inputs where they are made.

    Returns:
        A :class:`VerifyResult`.

    Raises:
        ValueError: a bad argument, named. BorrowCapacityError: chunked mode, when not
        even one request's step fits the borrow pool (raised before anything is allocated).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if not isinstance(tree, DraftTree) and not hasattr(tree, "retrive_next_token"):
        raise ValueError("tree must be a DraftTree (see build_draft_tree / tree_from_parents)")
    step = VerifyStep(logits, tree.candidates if candidates is None else candidates, tree, temperatures,
                      top_ks, top_ps, coins, coins_final, generator, threshold_single, threshold_acc).check()
    if validate:
        step.validate()
    fused = _fused_module(impl, step)
    borrowing = borrow is not None and bool(borrow.enabled)
    bs = step.batch_size
    per_chunk = bs
    if mode == "chunked":
        per_chunk = _chunk_requests(step, borrow if borrowing else None, chunk_rows)

    predicts = step.candidates.new_zeros(bs * step.draft_tokens, dtype=torch.int32)
    accept_index = step.candidates.new_full((bs, step.tree_depth), -1, dtype=torch.int32)
    accept_length = step.candidates.new_zeros(bs, dtype=torch.int32)
    out = VerifyResult(predicts, accept_index, accept_length)
    if bs == 0:
        return out

    scope = borrow.borrow(BORROW_USER) if borrowing else contextlib.nullcontext()
    with scope:
        try:
            if fused is None:
                run_reference(step, mode, per_chunk, out)
            else:
                _run_fused(fused, step, out)
        except BaseException as exc:
            traceback.clear_frames(exc.__traceback__)  # the failed step's temporaries die here too
            raise
    if fused is None:
        accept_length += 1
    return out


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


# ---------------------------------------------------------------------------------
# The fused implementation


def _fused_module(impl: str, step: VerifyStep):
    """The fused kernel's module for this step, or None to run the reference."""
    if impl == "reference":
        return None
    module = _load_fused()
    if impl == "fused":
        if module is None:
            raise ValueError(
                "impl='fused' needs the Triton verification kernel (graphborrow.eagle.fused), which is not "
                "installed in this build; use impl='reference' (or 'auto', which falls back to it)"
            )
        return module
    on_cuda = step.logits.is_cuda and getattr(module, "available", lambda: True)()
    return module if module is not None and on_cuda else None


def _load_fused():
    for name in FUSED_MODULES:
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            if exc.name != name:  # the module exists but something it needs does not
                raise
    return None


def _run_fused(fused, step: VerifyStep, out: VerifyResult) -> None:
    """Run the fused kernel into ``out`` (its accept_length counts the emitted token already)."""
    coins = draw(step.coins, (step.batch_size, step.draft_tokens), step.generator, step.logits)
    coins_final = draw(step.coins_final, (step.batch_size,), step.generator, step.logits)
    fused.fused_verify(step.logits, step.candidates, step.tree, step.temperatures, top_ks=step.top_ks,
                       top_ps=step.top_ps, coins=coins, coins_final=coins_final,
                       threshold_single=step.threshold_single, threshold_acc=step.threshold_acc,
                       out=tuple(out), validate=False)
