"""Notebook 00's one borrow: the verification probabilities of the largest captured batch that
fits a free run, measured with both meters (the driver's free memory and ``memory_reserved``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["OneBorrow", "borrow_probabilities"]


@dataclass(frozen=True)
class OneBorrow:
    """One borrowed probability tensor and what each meter said about it.

    ``batch``: the decode batch whose logits were used (None: not even the smallest batch's
    probabilities fit a run, so ``rows`` rows of it were borrowed). ``span``: where the tensor
    lay, ``(address, nbytes)``. ``device_bytes``: device memory the borrow took (driver view).
    ``reserved_growth``: how much ``memory_reserved`` grew. ``carved``: bytes of segments the
    borrow pool carved out of the runs. ``inside_run``: the tensor lay inside one free run.
    """

    batch: int | None
    rows: int
    vocab: int
    span: tuple
    device_bytes: int
    reserved_growth: int
    carved: int
    inside_run: bool


def borrow_probabilities(ladder) -> OneBorrow:
    """Borrow ``softmax`` of the decode logits of the largest captured batch whose probabilities
    fit a free run (``state.can_fit``, asked before anything is allocated), else as many rows
    of the smallest batch as fit, and read both meters before and inside the borrow.

    Args:
        ladder: a captured ladder whose pool has a borrowable run
            (:func:`graphborrow.workloads.ladder.borrowable_ladder`).

    Returns:
        A :class:`OneBorrow`.

    Raises:
        ValueError: no run can hold even one row of probabilities.
    """
    backend, state = ladder.backend, ladder.state
    element = ladder.outputs[("decode", max(ladder.decode_batches))].element_size()
    vocab = ladder.shape.vocab
    fitting = [bs for bs in sorted(ladder.decode_batches, reverse=True)
               if state.can_fit(bs * ladder.draft_tokens * vocab * element)]
    batch = fitting[0] if fitting else None
    logits = ladder.decode(batch or min(ladder.decode_batches))
    rows = logits.shape[0] if batch else 0
    if batch is None:  # one request's rows at most: the largest block of rows a run holds
        rows = min(logits.shape[0], state.largest_run() // (vocab * element))
        while rows > 0 and not state.can_fit(rows * vocab * element):
            rows -= 1
    if rows < 1:
        raise ValueError(f"no free run can hold one row of {vocab} probabilities; capture larger shapes")
    backend.synchronize()
    free_before, reserved_before = backend.mem_get_info()[0], backend.memory_reserved()
    with state.borrow("overview"):
        probs = torch.softmax(logits[:rows], dim=-1)
        span = (backend.data_ptr(probs), probs.numel() * probs.element_size())
        backend.synchronize()
        free_inside, reserved_inside = backend.mem_get_info()[0], backend.memory_reserved()
        carved = state.arena.cursor_bytes
        del probs
    inside = any(a <= span[0] and span[0] + span[1] <= a + n for a, n in state.free_runs())
    return OneBorrow(batch, rows, vocab, span, free_before - free_inside, reserved_inside - reserved_before,
                     carved, inside)
