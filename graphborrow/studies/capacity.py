"""Which verification steps fit a pool: the capacity planner's grid, checked by running steps.

Notebook 06 asks :func:`~graphborrow.eagle.plan.plan_verify` about every (batch size, draft
tokens, mode) cell, then runs the cells where the answer changes for real, borrowing from
the same pool, so the planner is checked against the allocator it models (the simulated
device's, or the GPU's). The functions here hold that logic so the notebook stays thin.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

from graphborrow.core.errors import BorrowCapacityError
from graphborrow.device import get_backend
from graphborrow.eagle import eagle_verify
from graphborrow.eagle.draft_tree import DraftTree, build_draft_tree, tree_depth_for
from graphborrow.eagle.modes import MODES
from graphborrow.eagle.plan import plan_verify
from graphborrow.planning.planner import AllocationSequence, PoolImage, replay

from .plots import capacity_map

__all__ = ["tensor_fits_run", "boundary_cells", "verify_inputs", "fit_grid_figure", "fit_policy_contrast", "plan_table", "run_verify_step", "summarize_fit"]


def plan_table(pool, batches: Iterable[int], draft_tokens: Iterable[int], vocab: int,
               modes: Sequence[str] = MODES, top_k: bool = False,
               top_p: bool = False) -> list[dict]:
    """The planner's answer for every cell of the grid.

    Args:
        pool: a :class:`~graphborrow.core.borrow.BorrowState` or a :class:`~graphborrow.planning.planner.PoolImage`.
        batches, draft_tokens, modes: the grid.
        vocab: the vocabulary of the probabilities.
        top_k, top_p: whether those renorms run.

    Returns:
        Rows with batch_size, draft_tokens, mode, fits, peak_bytes (most bytes of blocks
        the step holds at once), requests_per_chunk and reason.
    """
    rows = []
    for d in sorted(set(draft_tokens)):
        for bs in sorted(set(batches)):
            for mode in modes:
                p = plan_verify(pool, bs, d, vocab, mode, top_k, top_p, impl="reference")
                rows.append({"batch_size": bs, "draft_tokens": d, "mode": mode, "fits": p.fits,
                             "peak_bytes": p.peak_bytes, "requests_per_chunk": p.requests_per_chunk,
                             "reason": p.reason})
    return rows


def summarize_fit(rows: Iterable[dict]) -> dict:
    """Largest fitting batch per (mode, draft tokens): ``{mode: {draft_tokens: batch}}``, None where
    no batch of the table fits."""
    best: dict = {}
    for r in rows:
        cell = best.setdefault(r["mode"], {}).setdefault(r["draft_tokens"], None)
        if r["fits"]:
            best[r["mode"]][r["draft_tokens"]] = max(cell or 0, r["batch_size"])
    return best


def boundary_cells(rows: Iterable[dict], draft_tokens: int) -> list[dict]:
    """Per mode at ``draft_tokens``: the largest batch planned to fit and the smallest planned not to.

    These are the cells a wrong planner would get wrong first; running them checks it.
    """
    rows = [r for r in rows if r["draft_tokens"] == draft_tokens]
    out = []
    for mode in dict.fromkeys(r["mode"] for r in rows):
        mine = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["batch_size"])
        fit = [r for r in mine if r["fits"]]
        miss = [r for r in mine if not r["fits"]]
        if fit:
            out.append(fit[-1])
        if miss:
            out.append(miss[0])
    return out


def verify_inputs(batch_size: int, draft_tokens: int, vocab: int, branching: int = 4, seed: int = 0,
                  backend=None) -> tuple[torch.Tensor, DraftTree]:
    """Logits ``[bs*D, V]`` (float32) and a draft tree for one verification step on ``backend``.

    On a device with bytes the tree is a real EAGLE tree (``branching`` children per
    expanded node) and the logits are random; on the layout-only simulated device, which
    has no values to read, both only have their shapes, which is all the allocator sees
    (run ``eagle_verify`` with ``validate=False`` there). ``backend``: where they are made; None
    for the device ``torch.cuda`` is.
    """
    backend = backend if backend is not None else get_backend("auto")
    device = backend.device
    if backend.backed:
        g = torch.Generator().manual_seed(seed)
        branching = min(branching, vocab)
        tree = build_draft_tree(branching, tree_depth_for(draft_tokens, branching), draft_tokens, batch_size,
                                vocab, generator=g, device=device)
        logits = torch.randn(batch_size * draft_tokens, vocab, generator=g).to(device)
    else:
        links = torch.zeros(batch_size, draft_tokens, dtype=torch.long, device=device)
        tree = DraftTree(links, links, links, links, draft_tokens)
        logits = torch.empty(batch_size * draft_tokens, vocab, device=device)
    return logits, tree


def run_verify_step(state, batch_size: int, draft_tokens: int, vocab: int, mode: str,
                    branching: int = 4, seed: int = 0) -> bool:
    """Run one ``eagle_verify`` step borrowing from ``state``; True when it completed.

    On a device with bytes the tree is a real EAGLE tree and the logits random; on the
    layout-only simulated device (no bytes to read) the tensors only have their shapes,
    which is all the allocator sees. The borrow pool is retired before and after, so the
    step starts from the pool the planner was asked about.

    Args:
        state: the :class:`~graphborrow.core.borrow.BorrowState` to borrow from.
        batch_size, draft_tokens, vocab, mode: the step.
        branching: children per expanded tree node (trees on devices with bytes).
        seed: for the tree and the logits.

    Returns:
        True if the step finished, False if it ran out of borrowed memory.
    """
    backend = state.backend
    logits, tree = verify_inputs(batch_size, draft_tokens, vocab, branching, seed, backend=backend)
    state.retire()
    try:
        # the reference implementation: the one whose allocation sequence the planner replays
        eagle_verify(logits, None, tree, 1.0, borrow=state, mode=mode, validate=False, impl="reference")
        completed = True
    except (backend.OutOfMemoryError, BorrowCapacityError):
        completed = False
    finally:
        backend.synchronize()
        del logits, tree
        state.retire()
    return completed


def tensor_fits_run(tensor_bytes: int, run_bytes: int) -> bool:
    """Whether one tensor of ``tensor_bytes`` fits a fresh borrow pool over one run of ``run_bytes``
    (no precarve): the planner replays the single allocation, segment rounding and all."""
    image = PoolImage.from_runs([(1 << 40, int(run_bytes))])
    return replay(AllocationSequence((("alloc", 0, int(tensor_bytes), 0),)), image).fits


def fit_grid_figure(rows: Sequence[dict], title: str = ""):
    """One capacity grid per mode (batch size x draft tokens): colour = the step's peak
    MiB, hatched = does not fit. Returns a matplotlib Figure."""
    from matplotlib.figure import Figure

    modes = list(dict.fromkeys(r["mode"] for r in rows))
    if not modes:
        raise ValueError("fit_grid_figure needs at least one row")
    xs = len({r["draft_tokens"] for r in rows})
    ys = len({r["batch_size"] for r in rows})
    fig = Figure(figsize=(max(3.2, 1.4 + 0.75 * xs) * len(modes) + 1.2, 1.8 + 0.42 * ys), layout="constrained")
    peaks = [max(r["peak_bytes"], 1) for r in rows]
    limits = (min(peaks), max(peaks))  # one colour scale for every mode, so colours compare across grids
    axes = fig.subplots(1, len(modes), squeeze=False)[0]
    for k, (ax, mode) in enumerate(zip(axes, modes)):
        capacity_map([r for r in rows if r["mode"] == mode], value="peak_bytes", ax=ax, title=f"{mode}",
                     limits=limits, colorbar=k == len(modes) - 1)
    fig.suptitle(title or "peak MiB of each verification step; hatched: does not fit the free runs")
    return fig


def fit_policy_contrast(state, vocab: int, batches: Iterable[int] = (1, 2, 4, 8, 16, 32, 64),
                        draft_tokens: Iterable[int] = (1, 2, 4, 8, 16), mode: str = "standard"):
    """The first step (smallest batch, then draft tokens) that fits ``state`` under best fit and
    not under first fit, or None when no step of the grid tells them apart.

    ``state``'s ``best_fit`` is restored afterwards; its borrow pool is retired.

    Returns:
        ``(batch_size, draft_tokens)`` or None.
    """
    saved = state.best_fit
    try:
        for bs in sorted(set(batches)):
            for d in sorted(set(draft_tokens)):
                verdict = {}
                for best in (True, False):
                    state.retire()
                    state.best_fit = best
                    verdict[best] = plan_verify(state, bs, d, vocab, mode, impl="reference").fits
                if verdict[True] and not verdict[False]:
                    return bs, d
        return None
    finally:
        state.retire()
        state.best_fit = saved
