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
same per-row arithmetic (:mod:`.probs`), whatever rows share a call.

Implementations: ``impl="fused"`` runs the step as a few Triton launches that read the
logits directly (:mod:`.fused`; no [bs*D, V] matrix, so every mode is the same step
there); ``"reference"`` runs the modes above; ``"auto"`` (the default) takes the fused
path for tensors on a real CUDA device when Triton is installed, the reference
elsewhere (CPU, the simulated device). Both compute the target probabilities by the same
formula, so for the same coins they emit bitwise the same tokens.

Outputs are allocated before the borrow scope; every temporary is created and released
inside it. Value checks (:mod:`.validate`) run before it and can be skipped.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util

import torch

from graphborrow.core.errors import BorrowCapacityError
from graphborrow.sim.tensor import is_sim_tensor

from .draft_tree import DraftTree
from .modes import MODES, VerifyResult, run_reference
from .scope import run_borrowing
from .sequence import requests_per_chunk
from .step import VerifyStep, check_outputs

__all__ = ["IMPLS", "eagle_verify", "fused_available", "resolve_impl"]

IMPLS = ("auto", "reference", "fused")
FUSED_MODULE = "graphborrow.eagle.triton.fused"
EAGER_MODULE = "graphborrow.eagle.triton.eager"
GRAPHS_MODULE = "graphborrow.eagle.graphs"


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
            :func:`~graphborrow.eagle.kernel.tree_speculative_sampling_target_only`).
        threshold_acc: the accumulated probability is divided by this before the coin
            test (1.0: exact sampling).
        borrow: a borrow state; when enabled, every temporary lives inside
            ``borrow.borrow("EAGLE verify")``.
        mode: ``"standard"``, ``"lean"`` or ``"chunked"`` (see the module docstring).
        chunk_rows: chunked mode's group size in rows (a multiple of D) instead of the
            planner's; without a borrow, chunked mode runs one group. The fused path holds
            no [rows, V] matrix and runs every mode as one group.
        impl: ``"reference"`` (pure PyTorch), ``"fused"`` (the Triton kernels: CUDA tensors,
            or CPU tensors in Triton's interpreter; an error without Triton or on the
            simulated device) or ``"auto"`` (fused for real CUDA tensors where Triton is
            installed, else the reference). See :func:`resolve_impl`.
        validate: run the value checks (tree shape, parameter ranges, logits rows a
            sampler can draw from); they read on the host, so a step captured in a CUDA
            graph passes False and checks its inputs where they are made.
        graph: replay the fused step from a CUDA graph captured on the first call with
            these tensors (same addresses, shapes, dtypes) and parameters; the result's
            tensors are that graph's outputs, rewritten by its next replay. See
            :mod:`graphborrow.eagle.graphs` for what invalidates an entry, the memory it
            holds and how to clear it.
        out: ``(predicts [bs*D], accept_index [bs, S], accept_length [bs])``, int32 and
            contiguous on the logits' device, to write the result into instead of new
            tensors (say the previous step's result, once the caller has read it); every
            entry is rewritten. A serving loop that passes it allocates nothing per call.
            Not with ``graph=True``, whose entries own their outputs.

    Returns:
        A :class:`VerifyResult` (of ``out``'s tensors when given).

    Raises:
        ValueError: a bad argument, named.
        BorrowCapacityError: chunked mode, when not even one request's step fits the
            borrow pool (raised before anything is allocated).
    """
    if graph:
        if out is not None:
            raise ValueError("graph=True returns its captured step's own outputs (rewritten by each replay), so it "
                             "takes no out=; copy what you keep from the result, or call without graph=True")
        return _graph_steps().verify(logits, candidates, tree, temperatures, top_ks, top_ps, coins, coins_final,
                                     generator, borrow, threshold_single, threshold_acc, impl, validate)
    if (not validate and borrow is None and impl != "reference" and type(logits) is torch.Tensor and logits.is_cuda
            and mode in MODES and impl in IMPLS and fused_available()):  # the eager serving call: its short path
        result = _import(EAGER_MODULE).eager(logits, candidates, tree, temperatures, top_ks, top_ps, coins,
                                             coins_final, generator, threshold_single, threshold_acc, out)
        if result is not None:
            return result
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    step = VerifyStep.of(logits, candidates, tree, temperatures, top_ks, top_ps, coins, coins_final, generator,
                         threshold_single, threshold_acc)
    fused = _fused_module(resolve_impl(impl, step.logits))
    if fused is not None:
        step.require_contiguous()
    if validate:
        step.validate()
    if fused is not None:
        return fused.verify(step, borrow, out=out)  # (it checks out=)
    if out is not None:
        out = VerifyResult(*check_outputs(out, step))
    borrowing = borrow is not None and bool(borrow.enabled)
    per_chunk = step.batch_size
    if mode == "chunked":
        per_chunk = _chunk_requests(step, borrow if borrowing else None, chunk_rows)
    bs = step.batch_size
    if out is None:
        out = VerifyResult(step.candidates.new_zeros(bs * step.draft_tokens, dtype=torch.int32),
                           step.candidates.new_full((bs, step.tree_depth), -1, dtype=torch.int32),
                           step.candidates.new_zeros(bs, dtype=torch.int32))
    else:
        out.predicts.zero_()
        out.accept_index.fill_(-1)
        out.accept_length.zero_()
    if bs:
        run_borrowing(borrow, run_reference, step, mode, per_chunk, out)
        out.accept_length.add_(1)
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


def resolve_impl(impl: str, logits: torch.Tensor) -> str:
    """The implementation a step on ``logits`` runs: "reference" or "fused".

    ``"auto"`` takes the fused kernels for tensors on a real CUDA device when Triton is
    installed; CPU tensors and the simulated device's take the reference. The capacity
    planner asks the same question, so it plans the path that will run.

    Args:
        impl: ``"auto"``, ``"reference"`` or ``"fused"``.
        logits: the step's logits; only their device is read.

    Returns:
        ``"reference"`` or ``"fused"``.

    Raises:
        ValueError: an unknown ``impl``, or ``"fused"`` on the simulated device or
            without Triton.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "reference":
        return impl
    simulated = type(logits) is not torch.Tensor and is_sim_tensor(logits)
    if impl == "auto" and logits.is_cuda and fused_available():
        return "reference" if simulated else "fused"  # (a real CUDA tensor: CUDA is available)
    if impl == "fused":
        if simulated:
            raise ValueError("impl='fused' launches Triton kernels, which the simulated device cannot run; use "
                             "impl='reference' (or 'auto') there, and plan the fused step with "
                             "graphborrow.planning.capacity.plan_verify(..., impl='fused')")
        if not fused_available():
            raise ValueError("impl='fused' needs the Triton verification kernels (graphborrow.eagle.triton.fused), and "
                             "triton is not installed; pip install 'graphborrow[kernels]', or use impl='reference'")
        return impl
    on_gpu = logits.is_cuda and not simulated and torch.cuda.is_available()
    return "fused" if on_gpu and fused_available() else "reference"


@functools.cache
def fused_available() -> bool:
    """Whether the fused kernels can be imported (triton is installed).

    Returns:
        True when triton is installed (found without importing it).
    """
    return importlib.util.find_spec("triton") is not None


def _fused_module(impl: str):
    """The fused kernels' module for a resolved ``impl``, or None to run the reference."""
    return _import(FUSED_MODULE) if impl == "fused" else None


@functools.cache
def _import(name: str):
    """A module imported on first use (the kernels' module imports triton, which selects its
    interpreter on a machine without CUDA; the graph cache, torch.cuda graphs)."""
    return importlib.import_module(name)


def _graph_steps():
    """The process's cache of captured verification steps (:mod:`graphborrow.eagle.graphs`)."""
    return _import(GRAPHS_MODULE).GRAPH_STEPS
