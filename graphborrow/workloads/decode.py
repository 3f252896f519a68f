"""Speculative decoding end to end, driven the way a serving engine drives transformers models.

A target model (Llama-3-8B widths, a few layers, random weights) and a draft model of set
agreement with it (:mod:`.drafting`) share one KV layout: a static cache per model sized for
the largest batch, written at per-request slots (:mod:`.slot_cache`). Prefill runs eagerly;
for every batch of the ladder the draft step (tree growth) and the target's verify forward
are captured as CUDA graphs into one shared pool, largest batch first. Each step then

1. replays the draft graph: an EAGLE-2 tree of ``D`` nodes per request, written into the
   verify graph's static inputs;
2. replays the verify graph: logits ``[bs, D, V]`` for every node;
3. verifies the tree (the *mode*: :data:`MODES`), allocating its temporaries plainly or
   borrowing the pool's idle runs;
4. writes the accepted nodes' keys and values back to the requests' next positions and
   makes the last emitted token the next root,

until every request has ``new_tokens`` tokens (a request that has them stops advancing;
its row still runs, as a padded row of a captured graph does). The first new token is the
prefill's greedy choice; every later one is sampled by verification.

Random-weight models are nearly uniform over the vocabulary, while a served model is
confident about most tokens, and acceptance depends on that: the target's head is scaled so
its logits have a standard deviation of :data:`LOGIT_STD` (its top token then holds most of
the probability at temperature 1).

The same code runs on a GPU and on the simulated device: with bytes it computes every value;
layout-only it reproduces every allocation of a given number of steps, which is how the
loop's memory on the H200 is predicted on a CPU.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Optional, Sequence

import torch

from graphborrow.core.borrow import BorrowState
from graphborrow.core.errors import BorrowCapacityError, ParameterError
from graphborrow.eagle import (
    eagle_verify,
    top_k_renorm_probs,
    top_p_renorm_probs,
    tree_speculative_sampling_target_only,
)
from graphborrow import plan_verify

from .base import Ladder, model_code_queries
from .drafting import DraftStep, VerifyInputs, mix_weights
from .models import model_config, require_transformers
from .slot_cache import kv_tensors, slot_cache

__all__ = ["BORROW_MODES", "DecodeLoop", "LOGIT_STD", "LoopResult", "MODES", "SERVED_LAYERS", "tree_shape"]

# "plain": eagle_verify's standard step in freshly allocated memory; the borrowing modes: the
# same reference step (standard, lean, chunked) in the graph pool's idle runs; "upstream":
# torch.softmax probabilities and the reference kernel (upstream's step); "fused": the Triton
# kernels (a GPU only; they need no [bs*D, V] matrix, so nothing to borrow).
MODES = ("plain", "standard", "lean", "chunked", "upstream", "fused")
BORROW_MODES = ("standard", "lean", "chunked")

LOGIT_STD = 12.0
SERVED_LAYERS = 32  # Llama-3-8B's decoder layers: what a KV token costs in the served model


def tree_shape(draft_tokens: int) -> tuple[int, int]:
    """``(topk, depth)`` of the draft tree for ``draft_tokens`` nodes, as upstream measured them:
    a chain (topk 1) up to 4 nodes, else 4 children per expanded node, at least 3 levels deep.
    One node is the root alone: no draft is kept, one token a step (plain decoding)."""
    if isinstance(draft_tokens, bool) or not isinstance(draft_tokens, int) or draft_tokens < 1:
        raise ParameterError(f"draft_tokens must be an integer >= 1 (the root, then drafts), got {draft_tokens!r}")
    if draft_tokens <= 4:
        return 1, max(draft_tokens - 1, 1)
    topk, depth = 4, 1
    while 1 + topk + (depth - 1) * topk * topk < draft_tokens:
        depth += 1
    return topk, max(depth, 3)


def loop_config(model: str, layers: int, hidden=None, intermediate=None, vocab=None):
    """``model``'s transformers configuration, with other widths if given (128-wide heads, a
    quarter of them for keys and values, as Llama-3-8B's)."""
    config = model_config(model, layers=layers)
    if hidden is not None:
        heads = max(1, hidden // 128)
        config.hidden_size, config.head_dim = hidden, hidden // heads
        config.num_attention_heads, config.num_key_value_heads = heads, max(1, heads // 4)
    if intermediate is not None:
        config.intermediate_size = intermediate
    if vocab is not None:
        config.vocab_size = vocab
    return config


@dataclasses.dataclass
class LoopResult:
    """One run of the loop: what it emitted, how fast, and what it held.

    ``prompts``: per request its prompt; ``tokens``: its new tokens; ``accept_lengths``: per
    step, per request the tokens it emitted (requests already done count 0); the last two are
    None on a layout-only device.
    ``seconds``: the decode steps' wall time (prefill apart). Memory in bytes:
    ``reserved_before`` / ``peak_reserved`` (``max_memory_reserved`` over the steps, which
    counts a borrow pool's segments a second time), ``device_before`` / ``device_after``
    (used device memory by ``mem_get_info``: what the steps really added),
    ``borrow_pool_bytes`` (the borrow pool's segments, inside the graph pool), ``graph_pool_bytes``;
    ``memory``: per step ``reserved``, ``peak`` (so far), ``allocated``, ``borrowed`` and
    ``device`` (``mem_get_info``'s used bytes) after it.
    """

    mode: str
    batch: int
    draft_tokens: int
    new_tokens: int
    steps: int
    seconds: float
    prefill_seconds: float
    prompts: list
    tokens: Optional[list]
    accept_lengths: Optional[list]
    reserved_before: int
    peak_reserved: int
    allocated_before: int
    allocated_after: int
    device_before: int
    device_after: int
    borrow_pool_bytes: int
    graph_pool_bytes: int
    memory: list

    @property
    def mean_accept_length(self) -> Optional[float]:
        """Tokens per request per step, over the steps each request was still decoding; None without
        token values (a layout-only device) or without a step that emitted a token."""
        if self.accept_lengths is None:
            return None
        counted = [n for step in self.accept_lengths for n in step if n]
        return sum(counted) / len(counted) if counted else None

    @property
    def tokens_per_second(self) -> float:
        return self.batch * self.new_tokens / self.seconds if self.seconds > 0 else float("nan")

    @property
    def device_added(self) -> int:
        """Device memory the steps added (``mem_get_info``), the borrow pool's double count apart."""
        return self.device_after - self.device_before

    def row(self) -> dict:
        """The result as a flat dict (JSON), without per-step lists."""
        lists = ("prompts", "tokens", "accept_lengths", "memory")
        out = {k: v for k, v in dataclasses.asdict(self).items() if k not in lists}
        out.update(mean_accept_length=self.mean_accept_length, tokens_per_second=self.tokens_per_second,
                   device_added=self.device_added)
        return out


def reset_peak(backend) -> None:
    """Start the peak of ``max_memory_reserved`` afresh (the device API has no call for it)."""
    if backend.name == "sim":
        with backend.allocator_call():
            backend.allocator.reset_peak_memory_stats()
    else:
        torch.cuda.reset_peak_memory_stats()


def pool_bytes(backend, pool_id) -> int:
    """Reserved bytes of the private pool ``pool_id``."""
    return sum(s["total_size"] for s in backend.memory_snapshot(pool_id))


class DecodeLoop(Ladder):
    """Target, draft, KV caches and the captured ladder of one speculative decoding loop.

    Args:
        backend: a CUDA or simulated device (:func:`graphborrow.device.get_backend`).
        model: a name in :data:`graphborrow.workloads.models.MODELS` (its architecture and widths).
        layers: decoder layers of both models.
        hidden, intermediate, vocab: other widths than the model's (the teaching preset's).
        batches: the captured ladder (a run pads its batch up to the smallest that holds it).
        draft_tokens: tree nodes per request, root included (D).
        topk, depth: the tree's children per expanded node and its levels (:func:`tree_shape`).
        prompt_tokens: each request's prompt.
        max_new_tokens: the most new tokens a run may ask for (the KV caches are sized for it).
        agreement: the draft's weights ``a * target + (1 - a) * fresh``, in [0, 1].
        dtype: weights and activations.
        seed: weights and prompts.
        state: the BorrowState owning the graph pool (a new one on a fresh handle by default).

    Raises:
        ParameterError: any argument out of range, named, before anything is allocated.
    """

    def __init__(self, backend, model: str = "llama-3-8b", *, layers: int = 2, hidden: Optional[int] = None,
                 intermediate: Optional[int] = None, vocab: Optional[int] = None,
                 batches: Sequence[int] = (64, 32, 8, 1), draft_tokens: int = 8, topk: Optional[int] = None,
                 depth: Optional[int] = None, prompt_tokens: int = 32, max_new_tokens: int = 32,
                 agreement: float = 0.9, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                 state: Optional[BorrowState] = None):
        _check_agreement(agreement)
        for name, value, least in (("layers", layers, 1), ("prompt_tokens", prompt_tokens, 1),
                                   ("max_new_tokens", max_new_tokens, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ParameterError(f"{name} must be an integer >= {least}, got {value!r}")
        if not batches or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in batches):
            raise ParameterError(f"batches must be positive batch sizes, got {list(batches)}")
        shape = tree_shape(draft_tokens)
        self.topk = shape[0] if topk is None else topk
        self.depth = shape[1] if depth is None else depth
        for name, value in (("topk", self.topk), ("depth", self.depth)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ParameterError(f"{name} must be a positive integer, got {value!r}")
        most = 1 + self.topk + (self.depth - 1) * self.topk ** 2
        if draft_tokens > most:
            raise ParameterError(f"draft_tokens={draft_tokens} exceeds the {most} nodes a topk={self.topk}, "
                                 f"depth={self.depth} tree holds; raise topk or depth")
        self.backend, self.model_name = backend, model
        self.config = loop_config(model, layers, hidden, intermediate, vocab)
        self.vocab = self.config.vocab_size
        if self.topk > self.vocab:
            raise ParameterError(f"topk={self.topk} exceeds the vocabulary ({self.vocab})")
        self.layers, self.draft_tokens, self.agreement, self.dtype = layers, draft_tokens, agreement, dtype
        self.prompt_tokens, self.max_new_tokens, self.seed = prompt_tokens, max_new_tokens, seed
        self.width = self.depth + 1
        # a request still decoding holds at most prompt + new - 1 tokens; one that is done at most
        # width - 1 more; a step writes past its length the tree, the write-back and the frontier
        ahead = max(draft_tokens, self.width, 1 + (self.depth - 1) * self.topk)
        self.cache_len = prompt_tokens + max_new_tokens + self.width + ahead + 1  # the last slot takes padding
        self.decode_batches = sorted(set(batches), reverse=True)
        self.state = state if state is not None else BorrowState(backend, pool_id=backend.graph_pool_handle())
        self.pool_id = self.state.pool_id
        self.graphs: dict = {}
        self.steps: dict = {}
        self._capture_stream = backend.Stream()
        with backend.activated(), torch.inference_mode():  # "cuda" is this device, whichever is active
            torch.manual_seed(seed)
            self.target = self._build()
            head = self.target.lm_head.weight
            head.mul_(self._init_std("lm_head.weight") / self.config.initializer_range)
            self.draft = self._build()
            mix_weights(self.draft, self.target, agreement, seed + 1, self._init_std)
            # what initialisation cached goes back before the caches are made, so none of them
            # keeps a freed initialisation segment reserved (its free part would serve later steps)
            backend.synchronize()
            backend.empty_cache()
            top = self.decode_batches[0]
            self.kv = kv_tensors(self.config, top, self.cache_len, dtype, backend.device)
            self.draft_kv = kv_tensors(self.config, top, self.cache_len, dtype, backend.device)

    def _build(self):
        transformers = require_transformers()
        transformers.LlamaForCausalLM  # imported before the device block (see ModelLadder._build_model)
        with torch.device(self.backend.device):
            model = transformers.AutoModelForCausalLM.from_config(self.config, dtype=self.dtype)
        model.eval()
        model.requires_grad_(False)
        return model

    def _init_std(self, name: str) -> float:
        """A matrix's initial standard deviation: transformers' for every one but the target's scaled head."""
        if name == "lm_head.weight":
            return LOGIT_STD / math.sqrt(self.config.hidden_size)
        return self.config.initializer_range

    def set_agreement(self, agreement: float) -> None:
        """Perturb the draft to ``agreement`` again, in place (the captured graphs stay valid)."""
        _check_agreement(agreement)
        with self.backend.activated(), torch.inference_mode():
            mix_weights(self.draft, self.target, agreement, self.seed + 1, self._init_std)
        self.agreement = agreement
        self.backend.synchronize()
        self.backend.empty_cache()

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token in the served model (:data:`SERVED_LAYERS` layers of these widths)."""
        c = self.config
        return 2 * SERVED_LAYERS * c.num_key_value_heads * c.head_dim * torch.empty((), dtype=self.dtype).element_size()

    def describe(self) -> str:
        c = self.config
        return (f"{self.model_name}'s architecture (hidden {c.hidden_size}, intermediate {c.intermediate_size}, "
                f"vocabulary {self.vocab}), {self.layers} layer{'s' * (self.layers != 1)}, "
                f"{str(self.dtype).replace('torch.', '')}; draft agreement "
                f"{self.agreement}; trees of {self.draft_tokens} nodes (top-{self.topk}, depth {self.depth}); "
                f"ladder {self.decode_batches}; prompts of {self.prompt_tokens} tokens, up to "
                f"{self.max_new_tokens} new")

    # ------------------------------------------------------------------- capture
    def capture(self) -> "DecodeLoop":
        """Capture, largest batch first, each batch's draft step and verify forward into one pool."""
        with self.backend.activated():
            self._capture_ladder()
        return self

    def _capture_ladder(self) -> None:
        for batch in self.decode_batches:
            verify = VerifyInputs(batch, self.draft_tokens, self.cache_len, self.kv, self.backend.device)
            step = DraftStep(self.draft, self.draft_kv, batch, self.draft_tokens, self.topk, self.depth,
                             self.cache_len, verify)
            self.steps[batch] = step
            self._capture(("draft", batch), step)
            target = self.target

            def forward(v=verify):
                return target(input_ids=v.ids, position_ids=v.positions, attention_mask=v.mask,
                              past_key_values=v.cache, use_cache=True, logits_to_keep=0).logits

            self._capture(("verify", batch), forward)
        self.backend.synchronize()

    def _capture(self, key, run) -> None:
        """Warm ``run`` up twice on the capture stream, then capture it into the shared pool."""
        b = self.backend
        with torch.inference_mode(), model_code_queries(b):
            b.synchronize()
            with b.stream(self._capture_stream):
                for _ in range(2):
                    out = run()
                    del out
            b.synchronize()
            g = b.CUDAGraph()
            with self.state.capture_scope(), b.graph(g, pool=self.pool_id, stream=self._capture_stream):
                out = run()
        self.graphs[key] = (g, out)

    def _replay(self, key):
        g, out = self.graphs[key]
        with self.state.replay_scope():
            g.replay()
        return out

    # ------------------------------------------------------------------------ run
    def check_run(self, batch: int, mode: str, new_tokens: int, top_k=None, top_p=None) -> tuple[int, Optional[int]]:
        """Refuse a run that cannot go, before any work.

        Returns:
            ``(graph_batch, chunk_rows)``: the captured batch the run replays and, in chunked
            mode, the rows per group the capacity planner fits (the pool is the same every step,
            so it is planned once).

        Raises:
            ParameterError: an unknown mode, the fused kernels off a GPU, a batch above the ladder,
                more new tokens than the KV caches were sized for.
            BorrowCapacityError: a borrowing mode the capacity planner finds does not fit
                the pool's idle runs (its reason).
        """
        if mode not in MODES:
            raise ParameterError(f"mode must be one of {MODES}, got {mode!r}")
        if mode == "fused" and self.backend.name != "cuda":
            raise ParameterError("mode 'fused' runs the Triton kernels, which need a GPU; on the simulated device "
                                 "use one of " + ", ".join(m for m in MODES if m != "fused"))
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ParameterError(f"batch must be a positive integer, got {batch!r}")
        graph_batch = self.graph_batch(batch)
        if isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or new_tokens < 1:
            raise ParameterError(f"new_tokens must be a positive integer, got {new_tokens!r}")
        if new_tokens > self.max_new_tokens:
            raise ParameterError(
                f"new_tokens={new_tokens} needs a KV cache of {self.prompt_tokens + new_tokens} tokens and more per "
                f"request, but this loop's caches were sized for {self.max_new_tokens} new tokens "
                f"({self.cache_len} slots); build the DecodeLoop with max_new_tokens >= {new_tokens}")
        if not self.graphs:
            raise ParameterError("the loop's graphs are not captured yet; call capture() first")
        if mode not in BORROW_MODES:
            return graph_batch, None
        plan = plan_verify(self.state, batch, self.draft_tokens, self.vocab, mode=mode, top_k=top_k is not None,
                           top_p=top_p is not None, impl="reference")
        if not plan.fits:
            raise BorrowCapacityError(f"mode {mode!r} at batch {batch} x {self.draft_tokens} draft tokens does not "
                                      f"fit the graph pool's idle runs: {plan.reason}")
        return graph_batch, plan.requests_per_chunk * self.draft_tokens if mode == "chunked" else None

    def run(self, batch: int, mode: str = "plain", new_tokens: Optional[int] = None, temperature: float = 1.0,
            top_k: Optional[int] = None, top_p: Optional[float] = None, seed: int = 0,
            steps: Optional[int] = None, record_memory: bool = True) -> LoopResult:
        """Prefill ``batch`` random prompts, then decode until each request has ``new_tokens`` tokens.

        Args:
            batch: requests.
            mode: how verification runs (:data:`MODES`).
            new_tokens: per request (default ``max_new_tokens``).
            temperature, top_k, top_p: the sampling parameters verification applies.
            seed: prompts and coins (the same seed gives every mode the same coins).
            steps: the most steps; a layout-only device, which cannot read what was accepted,
                runs exactly this many (required there).
            record_memory: read the memory counters after every step (``LoopResult.memory``).

        Returns:
            A :class:`LoopResult`; nothing the run allocated outlives it.
        """
        new_tokens = self.max_new_tokens if new_tokens is None else new_tokens
        graph_batch, chunk_rows = self.check_run(batch, mode, new_tokens, top_k, top_p)
        with self.backend.activated():
            return self._run(batch, mode, new_tokens, temperature, top_k, top_p, seed, steps, record_memory,
                             graph_batch, chunk_rows)

    def _run(self, batch, mode, new_tokens, temperature, top_k, top_p, seed, steps, record_memory, graph_batch,
             chunk_rows) -> LoopResult:
        backed = getattr(self.backend, "backed", True)
        if not backed and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
            raise ParameterError("a layout-only device cannot read what verification accepted: give steps, "
                                 "the number of steps to run")
        b, device, d = self.backend, self.backend.device, self.draft_tokens
        step = self.steps[graph_batch]
        host = torch.Generator().manual_seed(seed)
        with torch.inference_mode():
            t0 = time.perf_counter()
            prompts = self._prefill(step, batch, host)
            b.synchronize()
            prefill_seconds = time.perf_counter() - t0
            b.empty_cache()  # the prefill's temporaries go back: the steps start from what an engine holds
            reset_peak(b)
            reserved_before, allocated_before = b.memory_reserved(), b.memory_allocated()
            device_before = _device_used(b)
            graph_pool = pool_bytes(b, self.pool_id)
            produced = torch.ones(batch, dtype=torch.int64, device=device)
            out = (torch.zeros(batch * d, dtype=torch.int32, device=device),
                   torch.full((batch, self.width), -1, dtype=torch.int32, device=device),
                   torch.zeros(batch, dtype=torch.int32, device=device))
            tokens = torch.zeros(batch, new_tokens + self.width + 1, dtype=torch.int64, device=device)
            tokens[:, 0] = step.ext[:batch, 0]
            done = [1] * batch if backed else None
            accepted, memory, n = ([] if backed else None), [], 0
            t0 = time.perf_counter()
            while (steps is None or n < steps) and (not backed or min(done) < new_tokens):
                coins = torch.rand(batch, d, generator=host).to(device)
                coins_final = torch.rand(batch, generator=host).to(device)
                self._replay(("draft", graph_batch))
                logits = self._replay(("verify", graph_batch))[:batch].reshape(batch * d, self.vocab)
                result = self._verify(mode, logits, step.rows(batch), temperature, top_k, top_p, coins, coins_final,
                                      out, chunk_rows)
                del logits, coins, coins_final
                acc = self._write_back(step, batch, result, produced, tokens, new_tokens)
                n += 1
                if backed:
                    counts = acc.tolist()
                    accepted.append(counts)
                    done = [x + c for x, c in zip(done, counts)]
                del acc, result
                if record_memory:
                    memory.append({"step": n, "reserved": b.memory_reserved(), "peak": _peak(b),
                                   "allocated": b.memory_allocated(), "borrowed": self.borrow_pool_bytes(),
                                   "device": _device_used(b)})
            b.synchronize()
            seconds = time.perf_counter() - t0
            emitted = [row[:new_tokens] for row in tokens.tolist()] if backed else None
            peak = _peak(b)
            borrowed = self.borrow_pool_bytes()
            del tokens, produced, out
        self.state.retire()  # the next run starts from the same pool
        return LoopResult(mode, batch, d, new_tokens, n, seconds, prefill_seconds, prompts, emitted, accepted,
                          reserved_before, peak, allocated_before, b.memory_allocated(), device_before,
                          _device_used(b), borrowed, graph_pool, memory)

    def borrow_pool_bytes(self) -> int:
        """Bytes of the borrow pool's segments now (carved from the graph pool's idle runs)."""
        pool = self.state.mem_pool
        return pool_bytes(self.backend, self.backend.pool_id(pool)) if pool is not None else 0

    def _prefill(self, step: DraftStep, batch: int, host: torch.Generator) -> list:
        """Both models over random prompts (eager); the first new token is the target's greedy one.
        Returns the prompts."""
        device, p = self.backend.device, self.prompt_tokens
        drawn = torch.randint(self.vocab, (batch, p), generator=host)
        prompts = drawn.to(device)
        positions = torch.arange(p, device=device).expand(batch, p)
        keys = torch.arange(self.cache_len, device=device)
        mask = (keys <= positions.unsqueeze(2)).unsqueeze(1)
        for model, kv in ((self.target, self.kv), (self.draft, self.draft_kv)):
            cache = slot_cache(kv, batch, p)
            cache.slots.copy_(positions)
            hidden = model.model(input_ids=prompts, position_ids=positions, attention_mask=mask,
                                 past_key_values=cache, use_cache=True).last_hidden_state
            if model is self.target:
                first = model.lm_head(hidden[:, -1]).argmax(dim=-1)
            del hidden, cache
        step.length[:batch].fill_(p)
        step.ext[:batch, 0] = first
        step.n_ext[:batch].fill_(1)
        return drawn.tolist()

    def _verify(self, mode, logits, tree, temperature, top_k, top_p, coins, coins_final, out, chunk_rows):
        if mode == "upstream":  # float32 logits divided by the temperature, then softmax, as upstream's step
            scaled = logits / temperature if logits.dtype == torch.float32 else logits.float().div_(temperature)
            probs = torch.softmax(scaled, dim=-1)
            del scaled
            if top_k is not None:
                probs = top_k_renorm_probs(probs, top_k)
            if top_p is not None:
                probs = top_p_renorm_probs(probs, top_p)
            bs, d = tree.candidates.shape
            probs = probs.view(bs, d, -1)
            draft_probs = torch.zeros_like(probs)
            predicts, accept_index, accept_length = out
            tree_speculative_sampling_target_only(predicts, accept_index, accept_length, tree.candidates,
                                                  tree.retrive_index, tree.retrive_next_token,
                                                  tree.retrive_next_sibling, coins, coins_final, probs, draft_probs)
            del probs, draft_probs
            accept_length.add_(1)
            return out
        borrow = self.state if mode in BORROW_MODES else None
        return eagle_verify(logits, None, tree, temperature, top_k, top_p, coins=coins, coins_final=coins_final,
                            borrow=borrow, mode="standard" if borrow is None else mode, chunk_rows=chunk_rows,
                            impl="fused" if mode == "fused" else "reference", validate=False, out=out)

    def _write_back(self, step: DraftStep, batch: int, result, produced, tokens, new_tokens) -> torch.Tensor:
        """Keep the accepted path: its keys and values at the next positions, its tokens, the next root.

        Returns the tokens each request emitted this step (0 for requests already done)."""
        device, d, s = self.backend.device, self.draft_tokens, self.width
        predicts, accept_index, accept_length = result
        active = produced < new_tokens
        acc = accept_length.long() * active
        j = torch.arange(s, device=device)
        take = j < acc.unsqueeze(1)
        slot = accept_index.long().clamp(min=0)
        emitted = predicts.long()[slot]
        length = step.length[:batch]
        node = slot - torch.arange(batch, device=device).unsqueeze(1) * d
        dst = length.unsqueeze(1) + j
        src = torch.where(take, length.unsqueeze(1) + node, dst)
        for k, v in self.kv:
            for cache in (k, v):
                rows = cache[:batch]
                shape = (batch, rows.shape[1], s, rows.shape[3])
                moved = rows.gather(2, src[:, None, :, None].expand(shape))
                rows.scatter_(2, dst[:, None, :, None].expand(shape), moved)
                del moved
        trash = tokens.shape[1] - 1
        tokens.scatter_(1, torch.where(take, produced.unsqueeze(1) + j, trash), emitted)
        last = emitted.gather(1, (acc - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
        root = step.ext[:batch].gather(1, (step.n_ext[:batch] - 1).unsqueeze(1)).squeeze(1)
        root = torch.where(active, last, root)
        ext = torch.where(active.unsqueeze(1), emitted, root.unsqueeze(1))
        step.ext[:batch].copy_(ext)
        step.n_ext[:batch].copy_(torch.where(active, acc, 1))
        length += acc
        produced += acc
        return acc


def _check_agreement(agreement) -> None:
    if isinstance(agreement, bool) or not isinstance(agreement, (int, float)) or not 0.0 <= agreement <= 1.0:
        raise ParameterError(f"agreement must be a number in [0, 1] (0: an unrelated draft model, 1: the target "
                             f"itself), got {agreement!r}")


def _peak(backend) -> int:
    """``max_memory_reserved`` since the last :func:`reset_peak`."""
    return int(backend.memory_stats().get("reserved_bytes.all.peak", 0))


def _device_used(backend) -> int:
    free, total = backend.mem_get_info()
    return total - free
