"""The reference verification step (pure PyTorch, any device) and its three modes.

- ``"standard"`` materialises the [bs*D, V] target probabilities and a draft scratch of
  the same size, as serving engines do;
- ``"lean"`` never does: it walks the tree on the candidates' probabilities, computed one
  tree position ([bs, V]) at a time, and rebuilds one residual row per request;
- ``"chunked"`` runs the standard step on groups of requests (as many per group as the
  capacity planner finds fitting the borrow pool, chosen by ``eagle_verify``), so borrowing
  covers batches that would not fit whole.

All three emit identical tokens for identical coins: every row's probabilities come from
the formula of :func:`~graphborrow.eagle.probs.target_probs`, which the fused kernels
share bit for bit. Every mode runs in three phases: :func:`~graphborrow.eagle.step.prepare`
(parameters, coins, tree tables), the mode's work (:func:`standard_rows` over groups of
requests, or :func:`lean_rows`), then the release of what ``prepare`` made. Each phase's
allocations depend on the step's shape alone; the capacity planner records them phase by
phase (:mod:`.sequence`).
"""

from __future__ import annotations

import torch

from .tree_sampling import arange_like, sample_final_token, subtract_draft, walk_tree
from .probs import target_probs
from .scope import run_borrowing
from .step import DeviceParams, VerifyResult, VerifyStep, check_outputs, prepare

__all__ = ["MODES", "allocate_outputs", "lean_rows", "run_into", "run_reference", "standard_rows", "verify"]

MODES = ("standard", "lean", "chunked")


def verify(step: VerifyStep, borrow=None, out=None, mode: str = "standard", per_chunk: int | None = None
           ) -> VerifyResult:
    """The reference step for a checked (and, if asked, validated) ``step``: new outputs
    unless ``out`` gives them (:func:`~graphborrow.eagle.step.check_outputs`), then
    :func:`run_into`. ``per_chunk``: requests per group (chunked mode; default the whole batch)."""
    out = allocate_outputs(step) if out is None else VerifyResult(*check_outputs(out, step))
    run_into(step, out, borrow, mode, per_chunk or max(step.batch_size, 1))
    return out


def allocate_outputs(step: VerifyStep) -> VerifyResult:
    """The step's three outputs, uninitialised (:func:`run_into` writes every entry)."""
    bs, c = step.batch_size, step.candidates
    return VerifyResult(c.new_empty(bs * step.draft_tokens, dtype=torch.int32),
                        c.new_empty((bs, step.tree_depth), dtype=torch.int32), c.new_empty(bs, dtype=torch.int32))


def run_into(step: VerifyStep, out: VerifyResult, borrow, mode: str, per_chunk: int) -> None:
    """Every entry of ``out`` rewritten by the step, its temporaries inside ``borrow``'s scope
    (when enabled); reads nothing on the host, so a CUDA graph can capture it."""
    out.predicts.zero_()
    out.accept_index.fill_(-1)
    out.accept_length.zero_()
    if step.batch_size:
        run_borrowing(borrow, run_reference, step, mode, per_chunk, out)
        out.accept_length.add_(1)


def run_reference(step: VerifyStep, mode: str, per_chunk: int, out: VerifyResult) -> None:
    """The reference step's body: everything allocated here dies when it returns.

    Its allocations come in three phases the capacity planner records one by one:
    :func:`~graphborrow.eagle.step.prepare`, the mode's work over groups of requests,
    and the release of what ``prepare`` made.
    """
    params = prepare(step)
    if mode == "lean":
        lean_rows(step, params, out)
    else:
        for lo in range(0, step.batch_size, per_chunk):
            standard_rows(step, params, lo, min(lo + per_chunk, step.batch_size), out)
    del params


def standard_rows(step: VerifyStep, params: DeviceParams, lo: int, hi: int, out: VerifyResult) -> None:
    """The upstream step for requests lo..hi-1: full target probabilities plus a zeroed draft scratch."""
    d = step.draft_tokens
    p = params.rows(lo, hi)
    target = target_probs(step.logits[lo * d:hi * d], p.temps.repeat_interleave(d), _repeat(p.top_k, d),
                          _repeat(p.top_p, d))
    target = target.view(hi - lo, d, -1)
    draft = torch.zeros_like(target)
    child_probs = target.gather(2, p.tables.child_tokens)
    retrive_index = step.tree.retrive_index[lo:hi]
    walk = walk_tree(p.tables, child_probs, step.candidates[lo:hi], retrive_index, p.coins,
                     step.threshold_single, step.threshold_acc, out.predicts, out.accept_index[lo:hi],
                     out.accept_length[lo:hi], draft)
    del child_probs
    rows = arange_like(hi - lo, retrive_index)
    subtract = draft[rows, walk.final_node]
    del draft
    residual = target[rows, walk.final_node]
    del target
    subtract_draft(residual, subtract, walk.bonus)
    del subtract
    cdf = residual.to(torch.float64)
    del residual
    sample_final_token(cdf, p.coins_final, walk, retrive_index, out.predicts)


def lean_rows(step: VerifyStep, params: DeviceParams, out: VerifyResult) -> None:
    """Same tokens as :func:`standard_rows`, holding only [bs, V] rows: one tree position at a time.

    Every position is computed, leaves included: which nodes have children is a value,
    and the step reads none on the host.
    """
    bs, d, vocab = step.batch_size, step.draft_tokens, step.vocab
    tables = params.tables
    per_position = step.logits.view(bs, d, vocab)
    child_probs = torch.zeros_like(tables.child_tokens, dtype=torch.float32)
    for n in range(d):
        probs = target_probs(per_position[:, n], params.temps, params.top_k, params.top_p)
        child_probs[:, n] = probs.gather(1, tables.child_tokens[:, n])
        del probs
    walk = walk_tree(tables, child_probs, step.candidates, step.tree.retrive_index, params.coins,
                     step.threshold_single, step.threshold_acc, out.predicts, out.accept_index, out.accept_length,
                     None)
    del child_probs
    rows = arange_like(bs, tables.children)
    residual = target_probs(per_position[rows, walk.final_node], params.temps, params.top_k, params.top_p)
    # relu(row - draft) with a zeroed draft that holds p at the rejected tokens: zero them.
    same_token = walk.final_tokens.unsqueeze(2) == walk.final_tokens.unsqueeze(1)
    hit = (same_token & walk.final_rejected.unsqueeze(1)).any(dim=2)
    residual.scatter_(1, walk.final_tokens, torch.where(hit, 0.0, residual.gather(1, walk.final_tokens)))
    cdf = residual.to(torch.float64)
    del residual
    sample_final_token(cdf, params.coins_final, walk, step.tree.retrive_index, out.predicts)


def _repeat(value, d):
    return None if value is None else value.repeat_interleave(d)
