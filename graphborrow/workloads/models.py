"""Ladders from real model code: transformers causal LMs captured as a serving engine does.

The synthetic workload (:mod:`graphborrow.workloads.ladder`) is two Llama-shaped MLP blocks and a
head. Serving engineers serve whole models, so this module builds the same kind of pool
from Hugging Face ``transformers`` model code: a configuration written here (Llama-3-8B,
Qwen2.5-7B, Mistral-7B, Mixtral-8x7B and Qwen3-30B-A3B widths; a layer count keeps it
small), or any transformers causal-LM configuration a reader brings; random weights
created directly on the device, never a download.

Capture follows SGLang's CUDA-graph runner:

* one KV cache for the largest batch (transformers' ``StaticCache`` layout), each smaller
  batch's graph using the leading rows of it;
* static inputs (token ids, positions, the attention mask) allocated before capture, as
  engines prepare attention metadata outside the graph;
* per batch size an EAGLE-verify graph: ``batch × draft_tokens`` query tokens against a
  cache of ``context`` tokens, logits for every token (the verification input);
* optionally prefill: one graph for ``prefill_tokens`` tokens, or ``"piecewise"``: one
  graph per piece (embedding and rotary tables, each decoder layer, norm and head);
* every graph warmed up twice on the capture stream (library workspaces land outside the
  pool), then captured on that stream, largest first, into one shared pool, all under
  ``torch.inference_mode()``.

The same code runs on a GPU and on the simulated device; ``tiny=True`` scales the widths
down (same architecture) so a backed simulated device can run it with real values.
``transformers`` is an optional extra: ``pip install graphborrow[models]``.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

from graphborrow.core.borrow import BorrowState
from graphborrow.core.errors import ParameterError

from .base import Ladder, model_code_queries

__all__ = [
    "MODELS",
    "ModelLadder",
    "ModelSpec",
    "PREFILL_MODES",
    "config_for_capture",
    "model_config",
    "require_transformers",
]

PREFILL_MODES = ("none", "graph", "piecewise")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A published model's widths, as a transformers configuration class and its fields."""

    name: str
    config_class: str
    model_class: str
    fields: dict
    tiny_fields: dict
    moe: bool = False
    note: str = ""


_DENSE_TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16, vocab_size=512)

MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            "llama-3-8b", "LlamaConfig", "LlamaForCausalLM",
            dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                 head_dim=128, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192,
                 rms_norm_eps=1e-5, tie_word_embeddings=False),
            _DENSE_TINY,
            note="Meta-Llama-3-8B widths",
        ),
        ModelSpec(
            "qwen2.5-7b", "Qwen2Config", "Qwen2ForCausalLM",
            dict(hidden_size=3584, intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4,
                 vocab_size=152064, rope_theta=1000000.0, max_position_embeddings=32768, rms_norm_eps=1e-6,
                 tie_word_embeddings=False, use_sliding_window=False),
            dict(_DENSE_TINY, head_dim=None),
            note="Qwen2.5-7B widths (q/k/v projections with bias)",
        ),
        ModelSpec(
            "mistral-7b", "MistralConfig", "MistralForCausalLM",
            dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                 head_dim=128, vocab_size=32768, rope_theta=1000000.0, max_position_embeddings=32768,
                 rms_norm_eps=1e-5, sliding_window=None, tie_word_embeddings=False),
            _DENSE_TINY,
            note="Mistral-7B-v0.3 widths (no sliding window)",
        ),
        ModelSpec(
            "mixtral-8x7b", "MixtralConfig", "MixtralForCausalLM",
            dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                 head_dim=128, vocab_size=32000, num_local_experts=8, num_experts_per_tok=2,
                 rope_theta=1000000.0, max_position_embeddings=32768, rms_norm_eps=1e-5,
                 sliding_window=None, tie_word_embeddings=False),
            dict(_DENSE_TINY, num_local_experts=4, num_experts_per_tok=2),
            moe=True,
            note="Mixtral-8x7B widths: 8 experts, 2 per token",
        ),
        ModelSpec(
            "qwen3-30b-a3b", "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
            dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_attention_heads=32,
                 num_key_value_heads=4, head_dim=128, vocab_size=151936, num_experts=128, num_experts_per_tok=8,
                 norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], rope_theta=1000000.0,
                 max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False,
                 use_sliding_window=False),
            dict(_DENSE_TINY, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2),
            moe=True,
            note="Qwen3-30B-A3B widths: 128 experts, 8 per token",
        ),
    )
}


def require_transformers():
    """Import transformers, or say how to install it."""
    try:
        import transformers
    except ImportError as e:
        raise ImportError(
            "real-model ladders need the optional 'transformers' dependency: "
            "pip install 'graphborrow[models]' (or pick MODEL='synthetic')"
        ) from e
    return transformers


def model_config(name: str, layers: int = 2, tiny: bool = False):
    """The transformers configuration for ``name`` with ``layers`` decoder layers.

    Attention is ``sdpa`` (what transformers picks on a GPU without flash-attn installed),
    mixture-of-experts layers use ``grouped_mm`` (capturable: no data-dependent shapes).
    ``tiny`` keeps the architecture and shrinks the widths (for a backed simulated device).
    """
    spec = _spec(name)
    if not isinstance(layers, int) or layers < 1:
        raise ParameterError(f"layers must be a positive integer, got {layers!r}")
    transformers = require_transformers()
    fields = dict(spec.fields)
    if tiny:
        fields.update(spec.tiny_fields)
        if spec.moe and "moe_intermediate_size" in fields:
            fields["intermediate_size"] = 2 * fields["moe_intermediate_size"]
        fields = {k: v for k, v in fields.items() if not (k in spec.tiny_fields and v is None)}  # None: derive it
    config = getattr(transformers, spec.config_class)(num_hidden_layers=layers, **fields)
    config._attn_implementation = "sdpa"
    if spec.moe:
        config._experts_implementation = "grouped_mm"
    return config


def config_for_capture(config, layers: int = 2):
    """A copy of any transformers causal-LM ``config`` set up as :func:`model_config` sets up
    the named ones: ``layers`` decoder layers, ``sdpa`` attention, and, for a
    mixture-of-experts model, ``grouped_mm`` experts (capturable)."""
    if not isinstance(layers, int) or layers < 1:
        raise ParameterError(f"layers must be a positive integer, got {layers!r}")
    transformers = require_transformers()
    if not isinstance(config, transformers.PretrainedConfig):
        raise ParameterError(f"model must be a name in {sorted(MODELS)} or a transformers configuration, "
                             f"got {type(config).__name__}")
    config = config.__class__.from_dict(config.to_dict())
    config.num_hidden_layers = layers
    config._attn_implementation = "sdpa"
    if _is_moe(config):
        config._experts_implementation = "grouped_mm"
    return config


def _is_moe(config) -> bool:
    return any((getattr(config, name, 0) or 0) > 1 for name in ("num_local_experts", "num_experts", "n_routed_experts"))


def _spec(name: str) -> ModelSpec:
    spec = MODELS.get(name)
    if spec is None:
        raise ParameterError(f"unknown model {name!r}; choose one of {sorted(MODELS)} (or 'synthetic')")
    return spec


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class ModelLadder(Ladder):
    """EAGLE-verify graphs per batch size (and optional prefill graphs) of a transformers model.

    Args:
        backend: a :mod:`graphborrow.device.cuda` device (CUDA or simulated).
        model: a name in :data:`MODELS`, or any transformers causal-LM configuration
            (``transformers.PretrainedConfig``; random weights of its widths, never a
            download; :func:`config_for_capture` sets its layers and attention).
        layers: decoder layers to build (the pool's shape depends on per-layer
            temporaries, not on depth, beyond a few layers).
        decode_batches: batch sizes of the verify ladder.
        draft_tokens: query tokens per request in a verify step.
        context: cached tokens each request attends to (the KV cache holds
            ``context + draft_tokens`` per request, or ``prefill_tokens`` if larger).
        prefill: ``"none"``, ``"graph"`` (one graph) or ``"piecewise"`` (one per piece).
        prefill_tokens: tokens of the prefill graph(s) (one request); ``context`` by
            default. A longer prompt lengthens the KV cache, and so every verify graph's
            attention temporaries: compare prefill settings at equal cache lengths.
        state: the BorrowState owning the pool (a new one on a fresh handle by default).
        order: ``"largest_first"`` (prefill, then batches descending) or ``"smallest_first"``.
        dtype: weights and activations (bfloat16 as served).
        tiny: shrink the widths (backed simulated device, tests).
        seed: weight initialisation seed.
    """

    def __init__(
        self,
        backend,
        model="llama-3-8b",
        layers: int = 2,
        decode_batches: Sequence[int] = (64, 32, 16, 8, 4, 2, 1),
        draft_tokens: int = 8,
        context: int = 1024,
        prefill: str = "none",
        prefill_tokens: Optional[int] = None,
        state: Optional[BorrowState] = None,
        order: str = "largest_first",
        dtype: torch.dtype = torch.bfloat16,
        tiny: bool = False,
        seed: int = 0,
    ):
        if not decode_batches or any(not isinstance(b, int) or b < 1 for b in decode_batches):
            raise ParameterError(f"decode_batches must be positive batch sizes, got {list(decode_batches)}")
        if not isinstance(draft_tokens, int) or draft_tokens < 1:
            raise ParameterError(f"draft_tokens must be a positive integer, got {draft_tokens!r}")
        if not isinstance(context, int) or context < 0:
            raise ParameterError(f"context must be a number of cached tokens >= 0, got {context!r}")
        if prefill not in PREFILL_MODES:
            raise ParameterError(f"prefill must be one of {PREFILL_MODES}, got {prefill!r}")
        if prefill_tokens is None:
            prefill_tokens = context  # the prompt fills the context the verify graphs attend to
        if prefill != "none" and (not isinstance(prefill_tokens, int) or prefill_tokens < 1):
            raise ParameterError(f"prefill_tokens must be a positive integer, got {prefill_tokens!r}")
        if order not in ("largest_first", "smallest_first"):
            raise ParameterError(f"order must be 'largest_first' or 'smallest_first', got {order!r}")
        self.backend = backend
        if isinstance(model, str):
            self.name, self.spec = model, _spec(model)
            self.config = model_config(model, layers=layers, tiny=tiny)
        else:
            if tiny:
                raise ParameterError("tiny widths exist for the named models only; give a configuration with "
                                     "small widths, or capture on a GPU or a layout-only simulated device")
            self.spec = None
            self.config = config_for_capture(model, layers=layers)
            self.name = getattr(model, "name_or_path", "") or self.config.model_type
        self.layers = layers
        self.draft_tokens = draft_tokens
        self.context = context
        self.prefill_mode = prefill
        self.prefill_tokens = prefill_tokens if prefill != "none" else 0
        self.decode_batches = sorted(set(decode_batches), reverse=(order == "largest_first"))
        self.order = order
        self.dtype = dtype
        self.tiny = tiny
        self.cache_len = max(context + draft_tokens, self.prefill_tokens)
        self.state = state if state is not None else BorrowState(backend, pool_id=backend.graph_pool_handle())
        self.pool_id = self.state.pool_id
        self.graphs: dict = {}
        self.inputs: dict = {}
        self.outputs: dict = {}
        self._caches: dict = {}
        self._capture_stream = backend.Stream()
        torch.manual_seed(seed)
        with torch.inference_mode():
            self.model = self._build_model()
            self._kv = self._allocate_kv(max(self.decode_batches + ([1] if self.prefill_tokens else [])))

    # ------------------------------------------------------------------ building
    def _build_model(self):
        transformers = require_transformers()
        # import the model's modules before the device block: libraries imported on the way
        # (torchaudio, through transformers' audio utilities) would make their module-level
        # tensors on the device, allocations that are not the workload's
        if self.spec is not None:
            getattr(transformers, self.spec.model_class)
        else:
            transformers.AutoModelForCausalLM._model_mapping[type(self.config)]
        with torch.device(self.backend.device):
            model = transformers.AutoModelForCausalLM.from_config(self.config, dtype=self.dtype)
        model.eval()
        model.requires_grad_(False)
        return model

    def _allocate_kv(self, batch: int) -> list:
        """One K and one V tensor per layer for the largest batch: the engine's KV pool."""
        c = self.config
        shape = (batch, c.num_key_value_heads, self.cache_len, _head_dim(c))
        return [
            (torch.zeros(shape, dtype=self.dtype, device=self.backend.device),
             torch.zeros(shape, dtype=self.dtype, device=self.backend.device))
            for _ in range(c.num_hidden_layers)
        ]

    def _cache(self, batch: int):
        """A StaticCache whose layers are the leading ``batch`` rows of the shared KV tensors."""
        cache = self._caches.get(batch)
        if cache is not None:
            return cache
        transformers = require_transformers()
        cache = transformers.StaticCache(config=self.config, max_cache_len=self.cache_len)
        for layer, (k, v) in zip(cache.layers, self._kv):
            layer.keys, layer.values = k[:batch], v[:batch]
            layer.dtype, layer.device = k.dtype, k.device
            layer.batch_size, layer.num_heads = batch, k.shape[1]
            layer.k_head_dim = layer.v_head_dim = k.shape[-1]
            layer.cumulative_length = torch.zeros((), dtype=torch.int64, device=self.backend.device)
            layer.is_initialized = True
        self._caches[batch] = cache
        return cache

    def _rewind(self, cache, position: int) -> None:
        """Point the cache's write position at ``position`` (done before every run)."""
        for layer in cache.layers:
            layer.cumulative_length.fill_(position)

    def _static_inputs(self, batch: int, tokens: int, start: int) -> dict:
        """Token ids, positions and a causal boolean mask over the cache (prepared outside graphs)."""
        device = self.backend.device
        ids = torch.zeros(batch, tokens, dtype=torch.int64, device=device)
        positions = torch.arange(start, start + tokens, device=device).unsqueeze(0).expand(batch, tokens).contiguous()
        key_pos = torch.arange(self.cache_len, device=device)
        mask = (key_pos[None, :] <= positions[0][:, None])[None, None].expand(batch, 1, tokens, self.cache_len).contiguous()
        return {"input_ids": ids, "position_ids": positions, "attention_mask": mask}

    # ------------------------------------------------------------------- capture
    def _run_captured(self, key, run, cache, position: int) -> None:
        """Warm up ``run`` twice on the capture stream, then capture it into the shared pool."""
        b = self.backend
        with torch.inference_mode(), model_code_queries(b):
            b.synchronize()
            with b.stream(self._capture_stream):
                for _ in range(2):
                    if cache is not None:
                        self._rewind(cache, position)
                    out = run()
                    del out
            b.synchronize()
            if cache is not None:
                self._rewind(cache, position)
            g = b.CUDAGraph()
            with self.state.capture_scope(), b.graph(g, pool=self.pool_id, stream=self._capture_stream):
                out = run()
        self.graphs[key], self.outputs[key] = g, out

    def _capture_verify(self, batch: int) -> None:
        cache = self._cache(batch)
        inputs = self._static_inputs(batch, self.draft_tokens, self.context)
        model = self.model

        def run():
            return model(**inputs, past_key_values=cache, use_cache=True, logits_to_keep=0).logits

        self.inputs[("verify", batch)] = inputs
        self._run_captured(("verify", batch), run, cache, self.context)

    def _capture_prefill_graph(self) -> None:
        cache = self._cache(1)
        inputs = self._static_inputs(1, self.prefill_tokens, 0)
        model = self.model

        def run():
            return model(**inputs, past_key_values=cache, use_cache=True, logits_to_keep=1).logits

        self.inputs[("prefill",)] = inputs
        self._run_captured(("prefill",), run, cache, 0)

    def _capture_prefill_pieces(self) -> None:
        """Piecewise prefill: embedding + rotary tables, each decoder layer, norm + head."""
        cache = self._cache(1)
        inputs = self._static_inputs(1, self.prefill_tokens, 0)
        body = self.model.model
        mask = inputs["attention_mask"]
        self.inputs[("prefill", "embed")] = inputs
        self._run_captured(
            ("prefill", "embed"),
            lambda: (lambda h: (h,) + tuple(body.rotary_emb(h, position_ids=inputs["position_ids"])))(
                body.embed_tokens(inputs["input_ids"])
            ),
            None, 0,
        )
        hidden, cos, sin = self.outputs[("prefill", "embed")]
        for i, layer in enumerate(body.layers):
            def run(layer=layer, hidden=hidden):
                out = layer(hidden, attention_mask=mask, position_embeddings=(cos, sin),
                            position_ids=inputs["position_ids"], past_key_values=cache, use_cache=True)
                return out[0] if isinstance(out, tuple) else out

            # every layer writes the cache at the prompt's positions, so rewind before each
            self._run_captured(("prefill", "layer", i), run, cache, 0)
            hidden = self.outputs[("prefill", "layer", i)]
        head = self.model.lm_head
        self._run_captured(("prefill", "head"), lambda h=hidden: head(body.norm(h[:, -1:, :])), None, 0)

    def capture(self) -> "ModelLadder":
        """Capture the prefill graph(s), if any, and the verify ladder, in the configured order."""
        prefill = []
        if self.prefill_mode == "graph":
            prefill = [self._capture_prefill_graph]
        elif self.prefill_mode == "piecewise":
            prefill = [self._capture_prefill_pieces]
        verify = [lambda bs=bs: self._capture_verify(bs) for bs in self.decode_batches]
        plan = prefill + verify if self.order == "largest_first" else verify + prefill
        for step in plan:
            step()
        self.backend.synchronize()
        return self

    # -------------------------------------------------------------------- using it
    def decode(self, batch: int) -> torch.Tensor:
        """Replay the verify graph for ``batch`` requests; returns its [batch, draft_tokens, vocab] logits."""
        bs = self.graph_batch(batch)
        key = ("verify", bs)
        if key not in self.graphs:
            raise ParameterError(f"the verify graph for batch {bs} was not captured yet; call capture() first")
        self._rewind(self._cache(bs), self.context)
        with self.state.replay_scope():
            self.graphs[key].replay()
        return self.outputs[key][:batch]

    def describe(self) -> str:
        prefill = "no prefill" if self.prefill_mode == "none" else f"{self.prefill_mode} prefill of {self.prefill_tokens} tokens"
        return (f"{self.name} ({self.layers} layers{', tiny widths' if self.tiny else ''}): verify graphs for "
                f"batch {self.decode_batches} x {self.draft_tokens} tokens against {self.context} cached, {prefill}")
