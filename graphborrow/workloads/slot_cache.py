"""A KV cache whose writes go to per-request slots, as a serving engine's KV pool takes them.

transformers' ``StaticCache`` writes every request of a batch at the same positions. In a
speculative decoding loop requests run ahead by different numbers of accepted tokens, so an
engine hands each forward the slots its tokens' keys and values go to (SGLang's
``out_cache_loc``). :func:`slot_cache` builds that: one preallocated ``[batch, kv_heads, length,
head_dim]`` K and V tensor per layer (shared by every graph of the ladder: a smaller batch's
cache is the leading rows) and a ``slots`` tensor ``[batch, tokens]`` written before each
forward; the layer scatters the new keys and values there and returns the whole cache, whose
unwritten or stale slots the caller's attention mask hides.
"""

from __future__ import annotations

import functools

import torch

from .models import require_transformers

__all__ = ["kv_tensors", "slot_cache"]


def kv_tensors(config, batch: int, length: int, dtype: torch.dtype, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One zeroed (K, V) pair per decoder layer of ``config``, ``[batch, kv_heads, length, head_dim]``."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    shape = (batch, config.num_key_value_heads, length, head_dim)
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(config.num_hidden_layers)]


@functools.lru_cache(maxsize=None)
def _layer_class():
    transformers = require_transformers()

    class SlotLayer(transformers.cache_utils.StaticLayer):
        """One decoder layer's K and V, written at ``slots`` (shared with the cache)."""

        def __init__(self, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor):
            super().__init__(max_cache_len=keys.shape[2])
            self.keys, self.values, self.slots = keys, values, slots
            self.dtype, self.device = keys.dtype, keys.device
            self.batch_size, self.num_heads = keys.shape[:2]
            self.k_head_dim = self.v_head_dim = keys.shape[-1]
            self.is_initialized = True

        def update(self, key_states, value_states, *args, **kwargs):
            b, h, q, d = key_states.shape
            index = self.slots[:, None, :, None].expand(b, h, q, d)
            self.keys.scatter_(2, index, key_states)
            self.values.scatter_(2, index, value_states)
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return self.max_cache_len  # positions are always given: nothing asks how much is written

    return SlotLayer


def slot_cache(kv, batch: int, tokens: int):
    """A transformers ``Cache`` over the leading ``batch`` rows of shared KV tensors.

    Args:
        kv: the per-layer (K, V) tensors of :func:`kv_tensors` (the largest batch's).
        batch: rows of them this cache uses.
        tokens: tokens per request of the forwards that use this cache (the width of ``slots``).

    Returns:
        The cache; ``cache.slots`` (``[batch, tokens]`` int64, zeros) is where the next forward
        writes: set it in place (``cache.slots.copy_(...)``) so a captured graph reads the new
        slots on replay.
    """
    transformers = require_transformers()
    slots = torch.zeros(batch, tokens, dtype=torch.int64, device=kv[0][0].device)
    layer = _layer_class()
    cache = transformers.cache_utils.Cache(layers=[layer(k[:batch], v[:batch], slots) for k, v in kv])
    cache.slots = slots
    return cache
