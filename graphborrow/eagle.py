"""EAGLE verification sampling: temperature, softmax, renorm, tree speculative sampling.

:func:`tree_speculative_sampling_target_only` reproduces the newest upstream kernel
(same arguments, in-place outputs and acceptance rule) in pure PyTorch, vectorised
over the batch. :func:`eagle_verify` is the whole non-greedy verification step:

- ``"standard"`` materialises the [bs*D, V] target probabilities and a draft scratch
  of the same size, as serving engines do;
- ``"lean"`` never does: it walks the tree on the candidates' probabilities, computed
  one tree position ([bs, V]) at a time, and rebuilds one residual row per request;
- ``"chunked"`` runs the standard step on groups of requests sized to the largest
  free run of the borrow state, so borrowing covers batches that would not fit whole.

All three emit identical tokens for identical coins: every probability comes from the
same per-row arithmetic, whatever rows share a call. Outputs are allocated before the
borrow scope; every temporary is created and released inside it.
"""

from __future__ import annotations

import contextlib
import traceback
from typing import NamedTuple

import torch

from .draft_tree import DraftTree, build_draft_tree, tree_from_parents  # noqa: F401  (re-exported)
from .errors import BorrowCapacityError
from .renorm import PIVOT_BYTES_PER_ENTRY, pivot_chunk_rows, top_k_renorm_probs, top_p_renorm_probs
from .sizes import SMALL_SIZE, allocation_size, is_small, round_size

MODES = ("standard", "lean", "chunked")
BORROW_USER = "EAGLE verify"


class VerifyResult(NamedTuple):
    """``predicts`` [bs*D] int32: the emitted token at each accepted node's slot;
    ``accept_index`` [bs, S] int32: accepted nodes' slots (-1 past the path);
    ``accept_length`` [bs] int32: tokens emitted per request (accepted drafts + 1)."""

    predicts: torch.Tensor
    accept_index: torch.Tensor
    accept_length: torch.Tensor


# ---------------------------------------------------------------------------------
# The kernel


def tree_speculative_sampling_target_only(
    predicts,
    accept_index,
    accept_token_num,
    candidates,
    retrive_index,
    retrive_next_token,
    retrive_next_sibling,
    uniform_samples,
    uniform_samples_for_final_sampling,
    target_probs,
    draft_probs,
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
    deterministic: bool = True,
) -> None:
    """Walk each request's draft tree, accepting drafts against the target distribution.

    At each depth the children of the last accepted node are tried in sibling order;
    child ``c`` with target probability p (of the parent's row) is accepted when
    ``p > 0 and (coin < acc / threshold_acc or p >= threshold_single)``, where ``acc``
    sums p over the siblings tried so far at this depth and ``coin`` is the parent's
    uniform sample. Rejected siblings are written to ``draft_probs[b, parent, tok]``.
    The last token is drawn from ``relu(row - draft_probs[b, parent])`` of the last
    accepted node (without the subtraction when all S-1 depths were accepted), by
    inverse CDF with ``u = uniform_samples_for_final_sampling * sum``.

    Writes ``predicts`` [bs*D] (at the slots of accepted nodes), ``accept_index``
    [bs, S] (columns 0..n), ``accept_token_num`` [bs] and ``draft_probs``; entries off
    the accepted path keep their values. ``deterministic`` exists for signature parity:
    the PyTorch operations used here are deterministic.
    """
    bs, d = _check_kernel_args(
        predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
        retrive_next_sibling, uniform_samples, uniform_samples_for_final_sampling, target_probs,
        draft_probs, deterministic,
    )
    thr_single, thr_acc = _check_thresholds(threshold_single, threshold_acc)
    tables = _TreeTables.build(candidates, retrive_next_token, retrive_next_sibling)
    child_probs = target_probs.gather(2, tables.child_tokens)
    walk = _walk(tables, child_probs, candidates, retrive_index, uniform_samples, thr_single, thr_acc,
                 predicts, accept_index, accept_token_num, draft_probs)
    del child_probs
    rows = _arange(bs, like=retrive_index)
    residual = target_probs[rows, walk.final_node]
    subtract = draft_probs[rows, walk.final_node]
    _subtract_draft(residual, subtract, walk.bonus)
    del subtract
    cdf = residual.to(torch.float64)
    del residual
    _emit(cdf, uniform_samples_for_final_sampling, walk, retrive_index, predicts)


class _TreeTables(NamedTuple):
    """Each node's children in sibling order, padded with -1: [bs, D, K], K = max(D-1, 1)."""

    children: torch.Tensor
    valid: torch.Tensor
    child_tokens: torch.Tensor

    @staticmethod
    def build(candidates, next_token, next_sibling) -> "_TreeTables":
        bs, d = next_token.shape
        cur = next_token
        columns = []
        for _k in range(max(d - 1, 1)):
            columns.append(cur)
            cur = torch.where(cur >= 0, next_sibling.gather(1, cur.clamp(min=0)), cur)
        children = torch.stack(columns, dim=2)
        valid = children >= 0
        child_tokens = candidates.gather(1, children.clamp(min=0).reshape(bs, -1)).reshape(children.shape)
        return _TreeTables(children, valid, child_tokens)


class _Walk(NamedTuple):
    final_node: torch.Tensor      # [bs] last accepted node (0 = root)
    bonus: torch.Tensor           # [bs] every depth accepted: sample without subtraction
    final_rejected: torch.Tensor  # [bs, K] rejected children of final_node (lean residual)
    final_tokens: torch.Tensor    # [bs, K] their tokens
    last_rejected: torch.Tensor   # [bs] last rejected token with p > 0, or -1


def _walk(tables, child_probs, candidates, retrive_index, coins, thr_single, thr_acc,
          predicts, accept_index, accept_token_num, draft_probs) -> _Walk:
    """Acceptance decisions for every node at once, then the path, one depth at a time."""
    bs, d, k_max = tables.children.shape
    steps = accept_index.shape[1]
    p = torch.where(tables.valid, child_probs, 0.0)
    acc = torch.zeros_like(p[:, :, 0])
    accepted = []
    for k in range(k_max):  # acc += p in sibling order, as the kernel does; coins[b, n] decides n's children
        pk = p[:, :, k]
        acc = acc + pk
        ok = (pk > 0) & ((coins < acc / thr_acc) | (pk >= thr_single))
        accepted.append(ok & tables.valid[:, :, k])
    accepted = torch.stack(accepted, dim=2)
    k_index = _arange(k_max, like=tables.children)
    first_ok = torch.where(accepted, k_index, k_max).amin(dim=2)  # [bs, D]; k_max = none

    rows = _arange(bs, like=tables.children)
    node = torch.zeros_like(rows)
    alive = torch.ones_like(rows, dtype=torch.bool)
    accept_index[:, 0] = retrive_index[:, 0].to(accept_index.dtype)
    accepted_count = torch.zeros_like(rows)
    last_rejected = torch.full_like(rows, -1)
    final_rejected = torch.zeros_like(tables.valid[:, 0])
    final_tokens = tables.child_tokens[:, 0]
    for j in range(1, steps):
        k_ok = first_ok[rows, node]
        tokens = tables.child_tokens[rows, node]
        probs = child_probs[rows, node]
        rejected = tables.valid[rows, node] & (k_index < k_ok.unsqueeze(1)) & alive.unsqueeze(1)
        if draft_probs is not None:
            _record_rejected(draft_probs, rows, node, tokens, probs, rejected)
        positive = torch.where(rejected & (probs > 0), k_index, -1).amax(dim=1)
        last_rejected = torch.where(positive >= 0, tokens.gather(1, positive.clamp(min=0).unsqueeze(1)).squeeze(1),
                                    last_rejected)
        final_rejected = torch.where(alive.unsqueeze(1), rejected, final_rejected)
        final_tokens = torch.where(alive.unsqueeze(1), tokens, final_tokens)

        step = alive & (k_ok < k_max)
        child = tables.children[rows, node, k_ok.clamp(max=k_max - 1)].clamp(min=0)
        slot = retrive_index[rows, node]
        predicts[slot] = torch.where(step, candidates[rows, child].to(predicts.dtype), predicts[slot])
        accept_index[:, j] = torch.where(step, retrive_index[rows, child].to(accept_index.dtype), accept_index[:, j])
        accepted_count += step
        node = torch.where(step, child, node)
        alive = step
    accept_token_num.copy_(accepted_count)
    bonus = accepted_count == steps - 1
    final_rejected = final_rejected & ~bonus.unsqueeze(1)
    return _Walk(node, bonus, final_rejected, final_tokens, last_rejected)


def _record_rejected(draft_probs, rows, node, tokens, probs, rejected) -> None:
    """draft_probs[b, node, tok] = p for rejected children; every write to one entry agrees."""
    same_token = tokens.unsqueeze(2) == tokens.unsqueeze(1)
    hit = (same_token & rejected.unsqueeze(1)).any(dim=2)
    b = rows.unsqueeze(1)
    n = node.unsqueeze(1)
    draft_probs[b, n, tokens] = torch.where(hit, probs, draft_probs[b, n, tokens])


def _subtract_draft(residual, subtract, bonus) -> None:
    """residual = relu(residual - subtract), leaving bonus rows (all depths accepted) whole."""
    residual.sub_(subtract.masked_fill_(bonus.unsqueeze(1), 0.0)).clamp_(min=0.0)


def _emit(cdf, coins_final, walk, retrive_index, predicts) -> None:
    """Write the sampled last token at the final node's slot (``cdf``: float64 residual, consumed)."""
    rows = _arange(cdf.shape[0], like=retrive_index)
    token = _inverse_cdf(cdf, coins_final, walk.last_rejected)
    predicts[retrive_index[rows, walk.final_node]] = token.to(predicts.dtype)


def _inverse_cdf(cdf: torch.Tensor, coins: torch.Tensor, last_rejected: torch.Tensor) -> torch.Tensor:
    """First index whose running sum exceeds ``coin * sum`` of the residual rows.

    ``cdf`` holds the residual in float64 and is turned into its running sum in place.
    Fallbacks as in the kernel: the last index with positive mass, then the last
    rejected token with p > 0, then V-1.
    """
    vocab = cdf.shape[1]
    positive = cdf > 0
    any_positive = positive.any(dim=1)
    last_positive = (vocab - 1) - positive.flip(1).to(torch.uint8).argmax(dim=1)
    del positive
    cdf.cumsum_(dim=1)
    u = coins.to(torch.float64) * cdf[:, -1]
    first = torch.searchsorted(cdf, u.unsqueeze(1), right=True).squeeze(1)
    fallback = torch.where(last_rejected >= 0, last_rejected, vocab - 1)
    fallback = torch.where(any_positive, last_positive, fallback)
    return torch.where(first < vocab, first, fallback)


# ---------------------------------------------------------------------------------
# The verification step


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
) -> VerifyResult:
    """Non-greedy EAGLE verification of ``tree`` against ``logits`` [bs*D, V].

    ``temperatures`` (> 0), ``top_ks`` and ``top_ps`` are numbers or per-request
    tensors [bs]. ``coins`` [bs, D] / ``coins_final`` [bs] fix the randomness; missing
    ones are drawn (from ``generator`` when given). With ``borrow`` (a borrow state)
    enabled, every temporary lives inside ``borrow.borrow("EAGLE verify")``.
    ``mode`` is ``"standard"``, ``"lean"`` or ``"chunked"`` (see the module docstring);
    ``chunk_rows`` overrides the chunk size (rows = requests * D).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if not isinstance(tree, DraftTree) and not hasattr(tree, "retrive_next_token"):
        raise ValueError("tree must be a DraftTree (see build_draft_tree / tree_from_parents)")
    candidates = tree.candidates if candidates is None else candidates
    bs, d, vocab = _check_verify_args(logits, candidates, tree, coins, coins_final)
    thr_single, thr_acc = _check_thresholds(threshold_single, threshold_acc)
    steps = int(tree.tree_depth)
    if steps < 1:
        raise ValueError(f"tree.tree_depth must be >= 1, got {steps}")

    predicts = candidates.new_zeros(bs * d, dtype=torch.int32)
    accept_index = candidates.new_full((bs, steps), -1, dtype=torch.int32)
    accept_length = candidates.new_zeros(bs, dtype=torch.int32)

    borrowing = borrow is not None and bool(borrow.enabled)
    scope = borrow.borrow(BORROW_USER) if borrowing else contextlib.nullcontext()
    with scope:
        try:
            _verify_into(logits, candidates, tree, temperatures, top_ks, top_ps, coins, coins_final,
                         generator, borrow if borrowing else None, thr_single, thr_acc, mode, chunk_rows,
                         predicts, accept_index, accept_length)
        except BaseException as exc:
            traceback.clear_frames(exc.__traceback__)  # the failed step's temporaries die here too
            raise
    accept_length += 1
    return VerifyResult(predicts, accept_index, accept_length)


def _verify_into(logits, candidates, tree, temperatures, top_ks, top_ps, coins, coins_final, generator,
                 borrow, thr_single, thr_acc, mode, chunk_rows, predicts, accept_index, accept_length) -> None:
    """The step's body: everything allocated here dies when it returns."""
    bs, d = candidates.shape
    vocab = logits.shape[1]
    temps = _per_request(temperatures, bs, "temperatures", like=logits, dtype=torch.float32)
    if bool((~(temps > 0) | ~torch.isfinite(temps)).any()):
        raise ValueError("temperatures must be finite and > 0 (greedy requests take the argmax path instead)")
    top_k = _sampling_param(top_ks, bs, "top_ks", logits, torch.long)
    top_p = _sampling_param(top_ps, bs, "top_ps", logits, torch.float32)
    coins = _draw(coins, (bs, d), generator, logits)
    coins_final = _draw(coins_final, (bs,), generator, logits)
    tables = _TreeTables.build(candidates, tree.retrive_next_token, tree.retrive_next_sibling)

    if mode == "lean":
        _lean(logits, candidates, tree, tables, temps, top_k, top_p, coins, coins_final, thr_single, thr_acc,
              predicts, accept_index, accept_length)
        return
    per_chunk = bs
    if mode == "chunked":
        per_chunk = requests_per_chunk(bs, d, vocab, top_k is not None, top_p is not None, borrow, chunk_rows)
    for lo in range(0, bs, per_chunk):
        hi = min(lo + per_chunk, bs)
        sub = slice(lo, hi)
        chunk_tables = _TreeTables(tables.children[sub], tables.valid[sub], tables.child_tokens[sub])
        _standard(logits[lo * d:hi * d], candidates[sub], tree.retrive_index[sub], chunk_tables, temps[sub],
                  _rows_of(top_k, sub), _rows_of(top_p, sub), coins[sub], coins_final[sub], thr_single, thr_acc,
                  predicts, accept_index[sub], accept_length[sub])


def _standard(logits, candidates, retrive_index, tables, temps, top_k, top_p, coins, coins_final,
              thr_single, thr_acc, predicts, accept_index, accept_length) -> None:
    """The upstream step: full target probabilities plus a zeroed draft scratch."""
    bs, d = candidates.shape
    target = _target_probs(logits, temps.repeat_interleave(d), _repeat(top_k, d), _repeat(top_p, d))
    target = target.view(bs, d, -1)
    draft = torch.zeros_like(target)
    child_probs = target.gather(2, tables.child_tokens)
    walk = _walk(tables, child_probs, candidates, retrive_index, coins, thr_single, thr_acc,
                 predicts, accept_index, accept_length, draft)
    del child_probs
    rows = _arange(bs, like=retrive_index)
    subtract = draft[rows, walk.final_node]
    del draft
    residual = target[rows, walk.final_node]
    del target
    _subtract_draft(residual, subtract, walk.bonus)
    del subtract
    cdf = residual.to(torch.float64)
    del residual
    _emit(cdf, coins_final, walk, retrive_index, predicts)


def _lean(logits, candidates, tree, tables, temps, top_k, top_p, coins, coins_final, thr_single, thr_acc,
          predicts, accept_index, accept_length) -> None:
    """Same tokens as _standard, holding only [bs, V] rows: one tree position at a time."""
    bs, d = candidates.shape
    vocab = logits.shape[1]
    per_position = logits.view(bs, d, vocab)
    child_probs = torch.zeros_like(tables.child_tokens, dtype=torch.float32)
    has_children = tables.valid[:, :, 0].any(dim=0).tolist()
    for n in range(d):
        if has_children[n]:
            probs = _target_probs(per_position[:, n], temps, top_k, top_p)
            child_probs[:, n] = probs.gather(1, tables.child_tokens[:, n])
            del probs
    walk = _walk(tables, child_probs, candidates, tree.retrive_index, coins, thr_single, thr_acc,
                 predicts, accept_index, accept_length, None)
    del child_probs
    rows = _arange(bs, like=tables.children)
    residual = _target_probs(per_position[rows, walk.final_node], temps, top_k, top_p)  # gathered rows die early
    # relu(row - draft) with a zeroed draft that holds p at the rejected tokens: zero them.
    same_token = walk.final_tokens.unsqueeze(2) == walk.final_tokens.unsqueeze(1)
    hit = (same_token & walk.final_rejected.unsqueeze(1)).any(dim=2)
    residual.scatter_(1, walk.final_tokens, torch.where(hit, 0.0, residual.gather(1, walk.final_tokens)))
    cdf = residual.to(torch.float64)
    del residual
    _emit(cdf, coins_final, walk, tree.retrive_index, predicts)


def _target_probs(logits, temps, top_k, top_p) -> torch.Tensor:
    """softmax(logits / temperature), then top-k and top-p renormalisation, per row."""
    scaled = logits / temps.unsqueeze(1)
    del logits  # frees rows gathered just for this call
    probs = torch.softmax(scaled, dim=-1)
    del scaled
    if top_k is not None:
        probs = top_k_renorm_probs(probs, top_k)
    if top_p is not None:
        probs = top_p_renorm_probs(probs, top_p)
    return probs


def requests_per_chunk(bs: int, d: int, vocab: int, top_k: bool, top_p: bool, borrow=None,
                       chunk_rows: int | None = None) -> int:
    """Requests per chunk in chunked mode: from ``chunk_rows``; else the most whose step
    (:func:`verify_bytes`) ``borrow.can_fit`` as one block, allocator rounding included;
    a step too small for that rounding (it asks for a 20 MiB segment) is sized by bytes
    instead. Without an enabled borrow: the whole batch."""
    if chunk_rows is not None:
        if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < d:
            raise BorrowCapacityError(
                f"chunk_rows={chunk_rows!r} holds no whole request of {d} rows; use a multiple of {d}"
            )
        return min(chunk_rows // d, bs)
    if borrow is None or not borrow.enabled:
        return bs  # nothing to size from: one chunk
    largest = borrow.largest_run()

    def step(n: int) -> int:
        return verify_bytes(bs, d, vocab, "chunked", top_k, top_p, chunk_rows=n * d)

    fits = _largest_passing(bs, lambda n: borrow.can_fit(step(n)))
    if fits == 0:
        fits = _largest_passing(bs, lambda n: step(n) <= largest and borrow.can_fit(4 * n * d * vocab))
    if fits == 0:
        need = verify_bytes(bs, d, vocab, "chunked", top_k, top_p, chunk_rows=d)
        raise BorrowCapacityError(
            f"one request's verification needs {need / 2**20:.1f} MiB but the largest free run is "
            f"{largest / 2**20:.1f} MiB; use mode='lean', or verify without borrowing"
        )
    return fits


def _largest_passing(most: int, passes) -> int:
    """Largest n in [1, most] with passes(n) (monotone), or 0."""
    found, lo, hi = 0, 1, most
    while lo <= hi:
        mid = (lo + hi) // 2
        if passes(mid):
            found, lo = mid, mid + 1
        else:
            hi = mid - 1
    return found


# ---------------------------------------------------------------------------------
# Capacity planning


def verify_bytes(bs: int, d: int, vocab: int, mode: str, top_k: bool = False, top_p: bool = False,
                 chunk_rows: int | None = None) -> int:
    """Peak step-local bytes of :func:`eagle_verify`, as the caching allocator charges them.

    Counts temporaries only (not logits, tree or outputs), with coins drawn inside the
    step; an upper bound that follows the code phase by phase. ``chunk_rows`` sizes
    chunked mode (default: one request per chunk).
    """
    for name, value in (("bs", bs), ("d", d), ("vocab", vocab)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    fixed = _small_bytes(bs, d, top_k, top_p)
    if mode == "lean":  # one tree position's rows at a time, then the final rows' residual
        return fixed + max(_probs_bytes(bs, vocab, top_k, top_p), _residual_bytes(bs, vocab))
    if mode == "chunked":
        per = (chunk_rows if chunk_rows is not None else d) // d
        if per < 1:
            raise ValueError(f"chunk_rows={chunk_rows} holds no whole request of {d} rows")
        return fixed + _standard_bytes(min(per, bs), d, vocab, top_k, top_p)
    return fixed + _standard_bytes(bs, d, vocab, top_k, top_p)


def _r(nbytes: int) -> int:
    """Bytes the caching allocator charges for one tensor: a 512-byte-rounded block, or the
    whole fresh segment when what would remain of it is too small to split off (<= 1 MiB)."""
    size = round_size(nbytes)
    if is_small(size):
        return size
    segment = allocation_size(size)
    return segment if segment - size <= SMALL_SIZE else size


SMALL_SLACK = 1 << 20  # validation masks, indices and scalars of a few KiB each


def _small_bytes(bs, d, top_k, top_p) -> int:
    """Coins, per-request values and their per-row copies, tree tables and the walk's state."""
    k = max(d - 1, 1)
    rows = bs * d
    coins = _r(4 * bs * d) + _r(4 * bs)
    per_request = (1 + top_k + top_p) * (_r(8 * bs) + _r(8 * rows))
    tables = 2 * _r(8 * bs * d * k) + _r(bs * d * k) + _r(4 * bs * d * k)
    walk = 8 * _r(8 * bs * d * k) + 24 * _r(8 * bs * k) + 32 * _r(8 * bs)
    return coins + per_request + tables + walk + SMALL_SLACK


def _probs_bytes(rows, vocab, top_k, top_p) -> int:
    """Peak while computing target probabilities for ``rows`` rows."""
    probs = _r(4 * rows * vocab)
    peak = 2 * probs  # scaled logits and their softmax
    if top_k or top_p:  # input + max(pivot workspace, mask + kept output)
        chunk = min(rows, pivot_chunk_rows(vocab))
        workspace = _r(PIVOT_BYTES_PER_ENTRY * chunk * vocab) + 4 * _r(8 * rows)
        peak = max(peak, probs + max(workspace, _r(rows * vocab) + probs))
    return peak


def _residual_bytes(rows, vocab) -> int:
    """Residual rows while converted to float64, then the float64 copy with its sign masks."""
    return max(_r(4 * rows * vocab) + _r(8 * rows * vocab), _r(8 * rows * vocab) + 3 * _r(rows * vocab))


def _standard_bytes(bs, d, vocab, top_k, top_p) -> int:
    matrix = _r(4 * bs * d * vocab)
    row = _r(4 * bs * vocab)
    sample = max(2 * matrix + row, matrix + 2 * row, _residual_bytes(bs, vocab))
    return max(_probs_bytes(bs * d, vocab, top_k, top_p), sample)


# ---------------------------------------------------------------------------------
# Helpers


def _arange(n: int, like: torch.Tensor) -> torch.Tensor:
    """0..n-1 (int64) next to ``like``, without naming a device (works on the simulated one)."""
    return torch.arange(n, out=like.new_empty(n, dtype=torch.long))


def _draw(given, shape, generator, like) -> torch.Tensor:
    """Caller's coins (validated), or fresh uniforms in [0, 1) next to ``like``."""
    if given is not None:
        return given
    out = like.new_empty(shape, dtype=torch.float32)
    if generator is None:
        return out.uniform_()
    if generator.device.type == "cpu":
        return out.copy_(torch.rand(shape, generator=generator))
    return out.uniform_(generator=generator)


def _per_request(value, bs, name, like, dtype) -> torch.Tensor:
    """A number or a [bs] / [bs, 1] tensor as a [bs] tensor next to ``like``."""
    if isinstance(value, torch.Tensor):
        if value.numel() == 1 and bs != 1 and value.dim() == 0:
            return like.new_full((bs,), value.item(), dtype=dtype)
        if value.numel() != bs:
            raise ValueError(
                f"{name} must be a number or hold one value per request ({bs}), got shape {tuple(value.shape)}"
            )
        if dtype == torch.long and value.is_floating_point():
            raise ValueError(f"{name} must hold integers, got {value.dtype}")
        return like.new_empty(bs, dtype=dtype).copy_(value.reshape(bs))
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number or a tensor of one value per request, got {type(value).__name__}")
    return like.new_full((bs,), value, dtype=dtype)


def _sampling_param(value, bs, name, like, dtype):
    """None, a number (kept: renorm's cheaper scalar path), or a per-request tensor."""
    if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
        return value
    return _per_request(value, bs, name, like=like, dtype=dtype)


def _rows_of(value, sub):
    return value[sub] if isinstance(value, torch.Tensor) else value


def _repeat(value, d):
    return value.repeat_interleave(d) if isinstance(value, torch.Tensor) else value


def _check_thresholds(threshold_single, threshold_acc):
    for name, value in (("threshold_single", threshold_single), ("threshold_acc", threshold_acc)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be a number in [0, 1] (1 is exact target sampling), got {value!r}")
    return float(threshold_single), max(float(threshold_acc), 1e-9)


def _check_tree_values(next_token, next_sibling, retrive_index, d, slots) -> None:
    for name, t in (("retrive_next_token", next_token), ("retrive_next_sibling", next_sibling)):
        if bool(((t < -1) | (t >= d)).any()):
            raise ValueError(f"{name} values must be -1 (none) or a node index in [0, {d})")
    if bool(((retrive_index < 0) | (retrive_index >= slots)).any()):
        raise ValueError(f"retrive_index values must be slots in [0, {slots}) of predicts")


def _expect(t, name, shape, dtype) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}; convert with .to({dtype})")


def _check_kernel_args(predicts, accept_index, accept_token_num, candidates, retrive_index, next_token,
                       next_sibling, coins, coins_final, target_probs, draft_probs, deterministic):
    if not isinstance(candidates, torch.Tensor) or candidates.dim() != 2:
        raise ValueError("candidates must be an int64 tensor [bs, D]")
    bs, d = candidates.shape
    if not isinstance(target_probs, torch.Tensor) or target_probs.dim() != 3:
        raise ValueError("target_probs must be a float32 tensor [bs, D, V]")
    vocab = target_probs.shape[2]
    for name, t in (("candidates", candidates), ("retrive_index", retrive_index),
                    ("retrive_next_token", next_token), ("retrive_next_sibling", next_sibling)):
        _expect(t, name, (bs, d), torch.int64)
    if not isinstance(accept_index, torch.Tensor) or accept_index.dim() != 2 or accept_index.shape[0] != bs:
        raise ValueError(f"accept_index must be an int32 tensor [bs={bs}, S]")
    _expect(predicts, "predicts", (bs * d,), torch.int32)
    _expect(accept_index, "accept_index", (bs, accept_index.shape[1]), torch.int32)
    _expect(accept_token_num, "accept_token_num", (bs,), torch.int32)
    _expect(coins, "uniform_samples", (bs, d), torch.float32)
    _expect(coins_final, "uniform_samples_for_final_sampling", (bs,), torch.float32)
    _expect(target_probs, "target_probs", (bs, d, vocab), torch.float32)
    _expect(draft_probs, "draft_probs", (bs, d, vocab), torch.float32)
    if accept_index.shape[1] < 1:
        raise ValueError("accept_index needs at least one column (the root)")
    if not isinstance(deterministic, bool):
        raise ValueError(f"deterministic must be a bool, got {deterministic!r}")
    _check_tree_values(next_token, next_sibling, retrive_index, d, bs * d)
    if bool(((candidates < 0) | (candidates >= vocab)).any()):
        raise ValueError(f"candidates must be token ids in [0, {vocab})")
    return bs, d


def _check_verify_args(logits, candidates, tree, coins, coins_final):
    if not isinstance(candidates, torch.Tensor) or candidates.dim() != 2 or candidates.dtype != torch.int64:
        raise ValueError("candidates must be an int64 tensor [bs, D] (draft tokens, node 0 = root)")
    bs, d = candidates.shape
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.shape[0] != bs * d:
        raise ValueError(
            f"logits must be [bs*D, V] = [{bs * d}, V] (one row per tree node), got "
            f"{tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__}"
        )
    if logits.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"logits must be float32, float16 or bfloat16, got {logits.dtype}")
    if not logits.is_contiguous():
        raise ValueError("logits must be contiguous; call .contiguous() first")
    vocab = logits.shape[1]
    for name in ("retrive_index", "retrive_next_token", "retrive_next_sibling"):
        _expect(getattr(tree, name), f"tree.{name}", (bs, d), torch.int64)
    if coins is not None:
        _expect(coins, "coins", (bs, d), torch.float32)
    if coins_final is not None:
        _expect(coins_final, "coins_final", (bs,), torch.float32)
    _check_tree_values(tree.retrive_next_token, tree.retrive_next_sibling, tree.retrive_index, d, bs * d)
    if bool(((candidates < 0) | (candidates >= vocab)).any()):
        raise ValueError(f"candidates must be token ids in [0, {vocab})")
    return bs, d, vocab
