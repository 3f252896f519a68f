"""The draft side of speculative decoding: a draft model of set agreement and EAGLE-2 tree growth.

The draft model is the target with perturbed weights: every matrix is
``a * target + (1 - a) * fresh`` (a fresh initialisation of the same distribution), norms
copied. ``a = 1`` is the target itself, ``a = 0`` an unrelated model; how often its drafts are
accepted is measured by the loop, not assumed.

:class:`DraftStep` grows one tree per request on the device with static shapes only (so a
CUDA graph captures it whole): an *extend* forward over the tokens accepted since the last
step (its last one is the tree's root), then ``depth - 1`` forwards over the frontier, each
node attending to the request's prefix and its own ancestors; the best ``D - 1`` nodes by
path log-probability are kept, as :func:`graphborrow.eagle.build_draft_tree` keeps them. It
writes the tree and the target's verify inputs (token ids, positions, the tree attention
mask, KV slots) into buffers allocated before capture.
"""

from __future__ import annotations

import torch

from graphborrow.eagle import DraftTree

from .slot_cache import slot_cache

__all__ = ["DraftStep", "VerifyInputs", "mix_weights"]


def mix_weights(draft, target, agreement: float, seed: int, std) -> None:
    """Set ``draft`` (the target's configuration) to the target perturbed to ``agreement``.

    The fresh part is drawn anew from ``seed`` (``std(name)`` is each matrix's initial standard
    deviation), so the same seed gives the same draft at every agreement: a sweep over
    agreements changes the weights in place, and captured graphs stay valid.
    """
    keep, fresh = agreement, 1.0 - agreement
    targets = dict(target.named_parameters())
    torch.manual_seed(seed)
    for name, p in draft.named_parameters():
        p.copy_(targets[name])
        if p.dim() >= 2:  # norm weights (ones) stay the target's
            noise = torch.empty_like(p).normal_(0.0, std(name))
            p.mul_(keep).add_(noise, alpha=fresh)
            del noise


class VerifyInputs:
    """The target's static verify inputs for one captured batch: written by the draft step."""

    def __init__(self, batch: int, nodes: int, cache_len: int, kv, device):
        self.ids = torch.zeros(batch, nodes, dtype=torch.int64, device=device)
        self.positions = torch.zeros(batch, nodes, dtype=torch.int64, device=device)
        self.mask = torch.zeros(batch, 1, nodes, cache_len, dtype=torch.bool, device=device)
        self.cache = slot_cache(kv, batch, nodes)


class DraftStep:
    """One request batch's tree growth, with its static state and outputs.

    State (rows are requests; set in place between steps): ``length`` [B] tokens in the
    target's cache, ``ext`` [B, S] the tokens accepted since the last step (root last),
    ``n_ext`` [B] how many of them are real. Outputs: ``tree`` (a :class:`DraftTree` of
    ``nodes`` nodes per request) and the :class:`VerifyInputs` ``verify``.
    """

    def __init__(self, draft, kv, batch: int, nodes: int, topk: int, depth: int, cache_len: int,
                 verify: VerifyInputs):
        device = kv[0][0].device
        self.draft, self.batch, self.nodes, self.topk, self.depth = draft, batch, nodes, topk, depth
        self.cache_len, self.trash = cache_len, cache_len - 1  # padded tokens write the last slot
        self.width = depth + 1  # S: the most tokens one step accepts
        self.scratch = max((depth - 1) * topk, 1)  # slots after the root for the frontier's keys
        self.length = torch.zeros(batch, dtype=torch.int64, device=device)
        self.ext = torch.zeros(batch, self.width, dtype=torch.int64, device=device)
        self.n_ext = torch.ones(batch, dtype=torch.int64, device=device)
        self.ext_cache = slot_cache(kv, batch, self.width)
        self.level_cache = slot_cache(kv, batch, topk)
        self.verify = verify
        links = torch.zeros(batch, nodes, dtype=torch.int64, device=device)
        self.tree = DraftTree(verify.ids, torch.arange(batch * nodes, device=device).view(batch, nodes),
                              links, links.clone(), depth + 1)

    def rows(self, batch: int) -> DraftTree:
        """The tree of the first ``batch`` requests (views)."""
        t = self.tree
        return DraftTree(t.candidates[:batch], t.retrive_index[:batch], t.retrive_next_token[:batch],
                         t.retrive_next_sibling[:batch], t.tree_depth)

    def _forward(self, cache, ids, positions, mask) -> torch.Tensor:
        out = self.draft.model(input_ids=ids, position_ids=positions, attention_mask=mask.unsqueeze(1),
                               past_key_values=cache, use_cache=True)
        return out.last_hidden_state

    def _top(self, hidden: torch.Tensor):
        logp = torch.log_softmax(self.draft.lm_head(hidden).float(), dim=-1)
        return logp.topk(self.topk, dim=-1)

    def __call__(self) -> None:
        b, k, s, device = self.batch, self.topk, self.width, self.length.device
        keys = torch.arange(self.cache_len, device=device)
        length = self.length
        # extend: the accepted tokens at positions length - n_ext + 1 ... length (the root)
        j = torch.arange(s, device=device)
        pos = (length - self.n_ext + 1).unsqueeze(1) + j
        valid = j < self.n_ext.unsqueeze(1)
        self.ext_cache.slots.copy_(torch.where(valid, pos, self.trash))
        mask = ((keys <= pos.unsqueeze(2)) & valid.unsqueeze(2)) | (keys == 0)  # padded rows: slot 0 only
        hidden = self._forward(self.ext_cache, self.ext, pos.clamp(max=self.trash), mask)
        rows = torch.arange(b, device=device)
        root = self.ext[rows, self.n_ext - 1]
        top = self._top(hidden[rows, self.n_ext - 1])
        tokens, scores = [top.indices], [top.values]
        parents = [torch.zeros(b, k, dtype=torch.int64, device=device)]
        f_tok, f_score = top.indices, top.values
        f_id = torch.arange(1, k + 1, device=device).expand(b, k)
        f_anc = torch.zeros(b, k, self.scratch, dtype=torch.bool, device=device)
        next_id = 1 + k
        offsets = torch.arange(self.scratch, device=device)
        rel = keys - (length + 1).unsqueeze(1)  # a key's place in the frontier's scratch slots
        in_scratch = (rel >= 0) & (rel < self.scratch)
        rel = rel.clamp(0, self.scratch - 1).unsqueeze(1).expand(b, k, self.cache_len)
        prefix = keys <= length.view(b, 1, 1)
        for level in range(1, self.depth):
            own = (level - 1) * k + torch.arange(k, device=device)
            f_anc = f_anc | (offsets == own.unsqueeze(1))
            self.level_cache.slots.copy_((length + 1).unsqueeze(1) + own)
            mask = prefix | (f_anc.gather(2, rel) & in_scratch.unsqueeze(1))
            hidden = self._forward(self.level_cache, f_tok, (length + level).unsqueeze(1).expand(b, k), mask)
            top = self._top(hidden)  # [b, k, k]
            level_scores = (f_score.unsqueeze(2) + top.values).reshape(b, k * k)
            level_tokens = top.indices.reshape(b, k * k)
            tokens.append(level_tokens)
            scores.append(level_scores)
            parents.append(f_id.unsqueeze(2).expand(b, k, k).reshape(b, k * k))
            best = torch.sort(level_scores, dim=1, descending=True, stable=True).indices[:, :k]
            f_id = (next_id + best)
            f_score = level_scores.gather(1, best)
            f_tok = level_tokens.gather(1, best)
            f_anc = f_anc.gather(1, (best // k).unsqueeze(2).expand(b, k, self.scratch))
            next_id += k * k
        self._select(root, torch.cat(tokens, 1), torch.cat(scores, 1), torch.cat(parents, 1))

    def _select(self, root, tokens, scores, parents) -> None:
        """Keep the best ``nodes - 1`` nodes (creation order), link them and write the verify inputs."""
        b, d, device = self.batch, self.nodes, root.device
        keep = d - 1
        order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :keep]
        kept = torch.sort(order, dim=1).values
        new_index = torch.full((b, tokens.shape[1] + 1), -1, dtype=torch.int64, device=device)
        new_index[:, 0] = 0
        new_index.scatter_(1, kept + 1, torch.arange(1, keep + 1, device=device).expand(b, keep))
        candidates = torch.cat([root.unsqueeze(1), tokens.gather(1, kept)], dim=1)
        parent = torch.cat([torch.full((b, 1), -1, dtype=torch.int64, device=device),
                            new_index.gather(1, parents.gather(1, kept))], dim=1)
        idx = torch.arange(d, device=device)
        first = torch.where(parent.unsqueeze(1) == idx.view(1, d, 1), idx, d).amin(dim=2)
        later = (parent.unsqueeze(2) == parent.unsqueeze(1)) & (idx.view(1, 1, d) > idx.view(1, d, 1))
        later &= (parent >= 0).unsqueeze(2)
        sibling = torch.where(later, idx, d).amin(dim=2)
        # depth and ancestors (self included) of every node, walking up `depth` times
        up = parent.clamp(min=0)
        node = idx.expand(b, d)
        ancestors = node.unsqueeze(2) == idx
        node_depth = torch.zeros(b, d, dtype=torch.int64, device=device)
        for _ in range(self.depth):
            node_depth += node != 0
            node = up.gather(1, node)
            ancestors |= node.unsqueeze(2) == idx
        length = self.length
        keys = torch.arange(self.cache_len, device=device)
        rel = keys - length.unsqueeze(1)
        in_tree = (rel >= 0) & (rel < d)
        rel = rel.clamp(0, d - 1).unsqueeze(1).expand(b, d, self.cache_len)
        mask = (keys < length.view(b, 1, 1)) | (ancestors.gather(2, rel) & in_tree.unsqueeze(1))
        v = self.verify
        v.ids.copy_(candidates)
        v.positions.copy_(length.unsqueeze(1) + node_depth)
        v.mask.copy_(mask.unsqueeze(1))
        v.cache.slots.copy_(length.unsqueeze(1) + idx)
        self.tree.retrive_next_token.copy_(torch.where(first < d, first, -1))
        self.tree.retrive_next_sibling.copy_(torch.where(sibling < d, sibling, -1))
