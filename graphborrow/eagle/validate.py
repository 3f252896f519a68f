"""Checks of a verification step's arguments, kept apart from the step itself.

Two kinds: *shape checks* read only tensor metadata and always run; *value checks*
(a well-formed tree, logits a sampler can draw from, parameters in range) read values
on the host, so they synchronise the device. ``eagle_verify(..., validate=False)``
skips the value checks, e.g. for a step captured in a CUDA graph whose inputs are
checked where they are produced. Value checks run before the borrow scope: their
few small temporaries never enter the borrowed runs.
"""

from __future__ import annotations

import torch

__all__ = ["check_logits_rows", "check_tree"]

LOGIT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def expect(t, name, shape, dtype) -> None:
    """``t`` is a tensor of exactly this shape and dtype."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.shape != shape:  # (torch.Size is a tuple)
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}; convert with .to({dtype})")


def check_thresholds(threshold_single, threshold_acc) -> tuple[float, float]:
    """Both in [0, 1]; returns them as floats, threshold_acc floored at 1e-9 (a divisor)."""
    for name, value in (("threshold_single", threshold_single), ("threshold_acc", threshold_acc)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be a number in [0, 1] (1 is exact target sampling), got {value!r}")
    return float(threshold_single), max(float(threshold_acc), 1e-9)


def check_tree(next_token: torch.Tensor, next_sibling: torch.Tensor, retrive_index: torch.Tensor,
               slots: int) -> None:
    """The links form a tree under node 0 and the output slots are distinct (reads values).

    Link values are -1 (none) or a node index; no node is linked from two places (first
    child of one node, next sibling of another); node 0 is linked from nowhere; no chain
    of links closes on itself. ``retrive_index`` holds distinct slots of ``predicts``
    ([0, slots)): two nodes sharing a slot would overwrite each other's output.
    """
    bs, d = next_token.shape
    for name, t in (("retrive_next_token", next_token), ("retrive_next_sibling", next_sibling)):
        if bool(((t < -1) | (t >= d)).any()):
            raise ValueError(f"{name} values must be -1 (none) or a node index in [0, {d})")
    if bs == 0:
        return
    if bool(((retrive_index < 0) | (retrive_index >= slots)).any()):
        raise ValueError(f"retrive_index values must be slots in [0, {slots}) of predicts")
    flat = retrive_index.flatten().sort().values
    repeated = flat[1:][flat[1:] == flat[:-1]]
    if repeated.numel():
        slot = int(repeated[0])
        where = (retrive_index == slot).nonzero().tolist()
        raise ValueError(
            f"retrive_index gives slot {slot} to more than one node (request, node): {where[:4]}; "
            "each node needs its own slot of predicts, or one request's output overwrites another's"
        )
    links = torch.cat([next_token, next_sibling], dim=1)  # [bs, 2D]: every edge's target
    indegree = next_token.new_zeros(bs, d + 1)
    indegree.scatter_add_(1, (links + 1), torch.ones_like(links))
    indegree = indegree[:, 1:]  # drop the "-1 = none" bucket
    if bool((indegree[:, 0] > 0).any()):
        b = int((indegree[:, 0] > 0).nonzero()[0])
        raise ValueError(
            f"request {b}: node 0 (the root) is linked as a child or sibling; the root has no parent"
        )
    if bool((indegree > 1).any()):
        b, n = (int(v) for v in (indegree > 1).nonzero()[0])
        raise ValueError(
            f"request {b}: node {n} is linked from {int(indegree[b, n])} places (retrive_next_token / "
            "retrive_next_sibling); in a tree each node has one parent and one place among its siblings"
        )
    # With every in-degree <= 1, a node lies on a cycle exactly when no chain of links
    # from a node without a parent reaches it.
    reached = indegree == 0
    for _ in range(d):
        spread = next_token.new_zeros(bs, d + 1, dtype=torch.bool)
        for link in (next_token, next_sibling):
            spread.scatter_(1, torch.where(reached, link, -1) + 1, True)
        grown = reached | spread[:, 1:]
        if torch.equal(grown, reached):
            break
        reached = grown
    if not bool(reached.all()):
        b = int((~reached).any(dim=1).nonzero()[0])
        cycle = (~reached[b]).nonzero().flatten().tolist()
        raise ValueError(
            f"request {b}: nodes {cycle} link to each other in a cycle (retrive_next_token / "
            "retrive_next_sibling); the links must form a tree, each node reachable once from the root"
        )


def check_logits_rows(logits: torch.Tensor, temperatures: torch.Tensor, draft_tokens: int) -> None:
    """Every row has a finite maximum that stays finite once divided by its temperature.

    ``temperatures``: a host tensor [bs]; the rows' maxima come to the host to meet it.

    A row holding NaN or +inf, a row of nothing but -inf, or a temperature so small that
    max / temperature overflows would give the sampler no distribution (and upstream's
    fallback would then silently emit token V-1). -inf entries elsewhere are fine:
    they are how engines mask tokens.
    """
    if logits.shape[0] == 0:
        return
    top = logits.amax(dim=1).float().cpu() / temperatures.repeat_interleave(draft_tokens)
    bad = ~torch.isfinite(top)
    if bool(bad.any()):
        rows = bad.nonzero().flatten().tolist()
        shown = [(r // draft_tokens, r % draft_tokens) for r in rows[:6]]
        raise ValueError(
            f"logits rows {rows[:6]}{' ...' if len(rows) > 6 else ''} (request, node {shown}) hold NaN or +inf, "
            "only -inf, or overflow once divided by the temperature, so they define no distribution; "
            "fix the model output (mask tokens with -inf, never a whole row) or raise the temperature"
        )


def check_kernel_args(predicts, accept_index, accept_token_num, candidates, retrive_index, next_token,
                      next_sibling, coins, coins_final, target_probs, draft_probs, deterministic):
    """Everything the reference kernel reads, shapes and values (it is a reference: it always checks)."""
    if not isinstance(candidates, torch.Tensor) or candidates.dim() != 2:
        raise ValueError("candidates must be an int64 tensor [bs, D]")
    bs, d = candidates.shape
    if not isinstance(target_probs, torch.Tensor) or target_probs.dim() != 3:
        raise ValueError("target_probs must be a float32 tensor [bs, D, V]")
    vocab = target_probs.shape[2]
    for name, t in (("candidates", candidates), ("retrive_index", retrive_index),
                    ("retrive_next_token", next_token), ("retrive_next_sibling", next_sibling)):
        expect(t, name, (bs, d), torch.int64)
    if not isinstance(accept_index, torch.Tensor) or accept_index.dim() != 2 or accept_index.shape[0] != bs:
        raise ValueError(f"accept_index must be an int32 tensor [bs={bs}, S]")
    expect(predicts, "predicts", (bs * d,), torch.int32)
    expect(accept_index, "accept_index", (bs, accept_index.shape[1]), torch.int32)
    expect(accept_token_num, "accept_token_num", (bs,), torch.int32)
    expect(coins, "uniform_samples", (bs, d), torch.float32)
    expect(coins_final, "uniform_samples_for_final_sampling", (bs,), torch.float32)
    expect(target_probs, "target_probs", (bs, d, vocab), torch.float32)
    expect(draft_probs, "draft_probs", (bs, d, vocab), torch.float32)
    if accept_index.shape[1] < 1:
        raise ValueError("accept_index needs at least one column (the root)")
    if not isinstance(deterministic, bool):
        raise ValueError(f"deterministic must be a bool, got {deterministic!r}")
    check_tree(next_token, next_sibling, retrive_index, bs * d)
    check_candidates(candidates, vocab)
    if bs and d and vocab:
        low = target_probs.amin(dim=2)
        if not bool((low >= 0).all()) or not bool(torch.isfinite(target_probs.amax(dim=2)).all()):
            raise ValueError(
                "target_probs must hold probabilities: finite and >= 0 in every row "
                "(negative values suggest logits: apply softmax first)"
            )
    return bs, d


def check_candidates(candidates: torch.Tensor, vocab: int) -> None:
    if bool(((candidates < 0) | (candidates >= vocab)).any()):
        raise ValueError(f"candidates must be token ids in [0, {vocab})")
