"""Notebook 05's studies: each verification mode run inside a borrow, and the emitted tokens
checked against the target distribution.

:func:`modes_in_borrow` asks the capacity planner about each mode, runs the modes that fit
with the graph pool's idle runs as their memory, and measures each step's high-water mark
from the allocator's trace and the device memory all of them took (the driver's view).
:func:`acceptance_study` verifies one request's tree many times with independent coins and
compares what was emitted with the theory: tokens per step, the first token's distribution,
and the second token's after a given child was accepted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from graphborrow.core.sizes import MB, round_size
from graphborrow.eagle import MODES, eagle_verify
from graphborrow.eagle.acceptance import (
    chi_square,
    children_of,
    emitted_tokens,
    expected_emitted_tokens,
    sample_copies,
    tokens_after,
)
from graphborrow.eagle.draft_tree import DraftTree, build_draft_tree, tree_depth_for, tree_from_parents
from graphborrow.eagle.plan import plan_verify

from .hazards import peak_step_bytes

__all__ = ["ModesReport", "modes_in_borrow", "AcceptanceReport", "acceptance_study", "pooled_chi_square",
           "drafted_tree", "breadth_first_parents"]


@dataclass
class ModesReport:
    """One verification step per mode, each borrowing from the graph pool.

    ``plans``: the planner's answer per mode. ``peaks``: the measured high-water mark (bytes)
    of each mode that fits; ``planned``: the planner's borrowed peak plus the step's outputs
    (made before the borrow, so not planned). ``results``: what each mode emitted.
    ``device_bytes``: new device memory all the borrowed steps took together. ``refused``:
    for each mode the planner says does not fit, whether the borrow refused it when it ran
    (True: the planner was right).
    """

    plans: dict
    peaks: dict
    planned: dict
    results: dict
    device_bytes: int
    refused: dict

    @property
    def fitting(self) -> list[str]:
        return [m for m in MODES if self.plans[m].fits]


def modes_in_borrow(state, logits, tree, temperature: float, coins, coins_final) -> ModesReport:
    """Plan, then run, one verification step per mode borrowing from ``state``: the modes that
    fit to measure them, the others to see the borrow refuse them as the planner said.

    Args:
        state: the graph pool's :class:`~graphborrow.core.borrow.BorrowState`.
        logits: ``[bs*D, V]`` target logits (the decode graph's output).
        tree: the draft tree of the ``bs`` requests.
        temperature: the sampling temperature.
        coins, coins_final: the step's random numbers (the same for every mode).

    Returns:
        A :class:`ModesReport`.
    """
    backend = state.backend
    bs, d = tree.candidates.shape
    vocab = logits.shape[-1]
    plans = {mode: plan_verify(state, bs, d, vocab, mode, impl="reference") for mode in MODES}
    results, peaks, planned = {}, {}, {}
    # the step's outputs are ordinary (not borrowed) tensors of a few KiB: let the default pool cache a
    # small-pool segment for them first, so any new device memory below is borrowed bytes gone astray
    warm = torch.empty(MB, dtype=torch.uint8, device=backend.device)
    del warm
    free_before = backend.mem_get_info()[0]

    def verify(mode, **groups):
        return eagle_verify(logits, None, tree, temperature, coins=coins, coins_final=coins_final, borrow=state,
                            mode=mode, validate=False, impl="reference", **groups)

    for mode in [m for m in MODES if plans[m].fits]:
        state.retire()
        with state.borrow("build the borrow pool"):  # a fresh pool precarves its seeds: not the step's bytes
            pass

        def step(mode=mode):
            results[mode] = verify(mode)
        peaks[mode] = peak_step_bytes(step, backend)
        outputs = sum(round_size(t.numel() * t.element_size()) for t in results[mode])
        planned[mode] = plans[mode].peak_bytes + outputs
    refused = {}
    for mode in [m for m in MODES if not plans[m].fits]:
        state.retire()
        # chunked that does not fit would be refused by eagle_verify's own plan: run its smallest
        # group (one request) so the borrow itself is what refuses it
        groups = {"chunk_rows": d} if mode == "chunked" else {}
        try:
            verify(mode, **groups)
            refused[mode] = False
        except backend.OutOfMemoryError:
            refused[mode] = True
    state.retire()
    return ModesReport(plans, peaks, planned, results, free_before - backend.mem_get_info()[0], refused)


def breadth_first_parents(draft_tokens: int, branching: int) -> list[int]:
    """The parent of each node of a tree that gives every node ``branching`` children, breadth
    first, until ``draft_tokens`` nodes (the root's parent is -1)."""
    return [-1] + [(n - 1) // branching for n in range(1, draft_tokens)]


def drafted_tree(logits: torch.Tensor, draft_tokens: int, branching: int, temperature: float, noise: float,
                 generator: torch.Generator) -> DraftTree:
    """The draft tree a draft model close to the target would propose for each request.

    The draft's distribution at a node is the target's row there (``logits[request * D + node]``,
    at ``temperature``) with Gaussian noise of standard deviation ``noise`` added to the scaled
    logits: 0 drafts from the target itself, large values from an unrelated model. Each node's
    ``branching`` children are drawn from it without replacement (Gumbel top-k), most likely
    first, breadth first until ``draft_tokens`` nodes; the root is a random last verified token.
    Drawn on the CPU, returned on ``logits``' device.

    Args:
        logits: ``[bs * D, V]`` target logits (the decode graph's output).
        draft_tokens: nodes per request, root included (D).
        branching: children per expanded node (at most V).
        temperature: the sampling temperature the verification uses.
        noise: how far the draft is from the target.
        generator: a CPU generator (reproducible drafts).

    Returns:
        A :class:`~graphborrow.eagle.draft_tree.DraftTree` of ``bs`` requests.

    Raises:
        ValueError: ``logits`` rows are not a multiple of ``draft_tokens``, or ``branching`` is
            outside [1, V], or ``noise`` is negative.
    """
    rows, vocab = logits.shape
    if draft_tokens < 1 or rows % draft_tokens:
        raise ValueError(f"logits have {rows} rows, not batch x draft_tokens={draft_tokens}")
    if not 1 <= branching <= vocab:
        raise ValueError(f"branching must be in [1, {vocab}], got {branching}")
    if noise < 0:
        raise ValueError(f"noise is a standard deviation, at least 0; got {noise}")
    bs = rows // draft_tokens
    scaled = logits.detach().float().cpu().view(bs, draft_tokens, vocab) / temperature
    draft = scaled + noise * torch.randn(scaled.shape, generator=generator)
    gumbel = -torch.log(-torch.log(torch.rand(scaled.shape, generator=generator).clamp(1e-20, 1 - 1e-7)))
    children = (draft.log_softmax(-1) + gumbel).topk(branching, dim=-1).indices  # [bs, D, branching]
    parents = breadth_first_parents(draft_tokens, branching)
    candidates = torch.empty(bs, draft_tokens, dtype=torch.long)
    candidates[:, 0] = torch.randint(vocab, (bs,), generator=generator)
    for node in range(1, draft_tokens):
        candidates[:, node] = children[:, parents[node], (node - 1) % branching]
    return tree_from_parents([parents] * bs, candidates, device=logits.device)


def pooled_chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> tuple[float, int, float]:
    """Pearson's chi-square of ``tokens`` against ``probs``, with the categories whose expected
    count is under 5 pooled into one (the textbook condition for the test), so it runs at any
    sample size that gives at least two categories of 5.

    Returns:
        ``(statistic, degrees of freedom, critical value at alpha 0.001)``.
    """
    probs = probs.double().cpu()
    expected = probs * len(tokens)
    small = (expected < 5) & (probs > 0)
    if not small.any():
        return chi_square(tokens, probs)
    kept = torch.nonzero(~small).flatten()
    index = torch.full((probs.numel(),), len(kept), dtype=torch.long)
    index[kept] = torch.arange(len(kept))
    merged = torch.cat([probs[kept], probs[small].sum().reshape(1)])
    return chi_square(index[tokens.long().cpu()], merged)


@dataclass
class AcceptanceReport:
    """What ``samples`` verifications of one request's tree emitted, against the theory."""

    samples: int
    probs: torch.Tensor          # [D, V] target rows of the request
    mean_tokens: float           # emitted tokens per step, measured
    theory_tokens: float         # the same, from the acceptance rule
    standard_error: float
    first: torch.Tensor          # the first emitted token of every copy
    first_test: tuple            # (statistic, df, critical) of the first token
    second_node: int | None      # the accepted root child whose next token is tested
    second_samples: int
    second_test: tuple | None    # (statistic, df, critical) of the token after it

    @property
    def total_variation(self) -> float:
        """Half the L1 distance between the first token's frequencies and the root's row."""
        freq = torch.bincount(self.first, minlength=self.probs.shape[1]).double() / self.samples
        return 0.5 * (freq - self.probs[0].double()).abs().sum().item()


def acceptance_study(draft_tokens: int, branching: int, temperature: float, samples: int, seed: int = 0,
                     vocab: int = 12, logit_std: float = 0.2, noise: float | None = None) -> AcceptanceReport:
    """Verify one request's draft tree ``samples`` times on the CPU with independent coins.

    Args:
        draft_tokens: tree nodes (root included).
        branching: children per expanded node (at most ``vocab``).
        temperature: the sampling temperature.
        samples: copies verified.
        seed: the random logits', tree's and coins' seed.
        vocab: a small vocabulary, so every token is counted.
        logit_std: the random logits' standard deviation; at notebook 05's temperature (0.1) the
            default makes rows as peaked as a trained model's top tokens (a standard deviation
            of 2 after the temperature), at temperature 1 nearly flat.
        noise: the draft model's distance from the target (:func:`drafted_tree`); None drafts
            random tokens (an EAGLE-2 tree of a random draft model).

    Returns:
        An :class:`AcceptanceReport`; the second-token test is None for a one-node tree.
    """
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ValueError(f"samples must be a whole number of 1 or more (copies verified), got {samples!r}: "
                         "a mean over no copy is undefined")
    gen = torch.Generator().manual_seed(seed)
    row_logits = torch.randn(draft_tokens, vocab, generator=gen) * logit_std
    probs = torch.softmax(row_logits / temperature, -1)
    b = min(branching, vocab)
    if noise is None:
        tree = build_draft_tree(b, tree_depth_for(draft_tokens, b), draft_tokens, 1, vocab, generator=gen)
    else:
        tree = drafted_tree(row_logits, draft_tokens, b, temperature, noise, gen)
    res = sample_copies(tree, row_logits, temperature, samples, generator=gen)
    lengths = res.accept_length.double()
    # never below one copy's weight: when every copy emitted the same count the sample's spread
    # is zero, although the theory may differ from it by a rounding (a tree covering the whole
    # vocabulary accepts a child with probability 1 - 1e-8 in float32); one copy tells nothing
    error = max(lengths.std().item() / math.sqrt(samples), 1 / samples) if samples > 1 else float(draft_tokens)
    _, first = emitted_tokens(res, 0)
    second_node, second, second_test = None, torch.empty(0, dtype=torch.long), None
    if draft_tokens > 1:
        # the root's child the target likes best: the most copies accept it, so its test has the most samples
        second_node = max(children_of(tree, 0), key=lambda n: probs[0, tree.candidates[0, n]].item())
        second = tokens_after(res, int(tree.candidates[0, second_node]))
        if len(second) >= 10:
            second_test = pooled_chi_square(second, probs[second_node])
    return AcceptanceReport(samples, probs, lengths.mean().item(), expected_emitted_tokens(tree, probs), error,
                            first, pooled_chi_square(first, probs[0]), second_node, len(second), second_test)
