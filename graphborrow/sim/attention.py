"""Scaled-dot-product attention as CUDA runs it, on the simulated device.

On a CPU build ``F.scaled_dot_product_attention`` decomposes into CPU kernels whose
outputs have other layouts and whose temporaries differ from the CUDA ones, so model
code (transformers' ``sdpa`` attention) would allocate differently on the simulated
device than on a GPU. This module replaces the op on simulated tensors with a model of
the CUDA path, written from PyTorch's ``attention.cpp`` / ``attention.cu`` /
``sdp_utils.cpp`` and flash-attention's ``flash_api.cpp``:

1. pick a backend as ``select_sdp_backend`` does: a priority order (cuDNN first on
   Hopper with a recent cuDNN, else flash, memory-efficient, math) and each backend's
   constraints (masks, dtypes, head dims, grouped-query heads);
2. convert a boolean mask into an additive one (a device scalar and one ``where``), pad
   it to a multiple of 8 for the memory-efficient kernel;
3. allocate what the chosen kernel allocates, in order: its output (in the kernel's
   layout, which decides whether the caller's ``.transpose(1, 2).contiguous()`` copies),
   its auxiliary outputs (flash's log-sum-exp, cuDNN's RNG seed and offset) and its
   temporaries (flash's split-KV accumulators, the memory-efficient kernel's fp32
   accumulator for head dims over 128, a cuDNN workspace), freed when CUDA frees them.

The values (on a backed device) come from the math kernel on the CPU; a captured graph
re-runs that into the output's address on replay. What is uncertain without a GPU (which
backend a given torch and cuDNN pick, cuDNN's workspace size) is a field of
:class:`AttentionModel`; ``benchmarks/model_pools.py`` records the real choice.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from . import host
from .autograd import KernelFunction, records_grad, reference_grads
from .dispatch import launch_kernel
from .tensor import SimTensor, non_overlapping_and_dense, register_cuda_model
from .torch_function import torch_functions_off

__all__ = [
    "AttentionModel",
    "BACKENDS",
    "CUDNN",
    "EFFICIENT",
    "FLASH",
    "MATH",
    "call_signature",
    "cudnn_workspace_bytes",
    "math_attention",
    "flash_num_splits",
    "select_backend",
]

CUDNN, FLASH, EFFICIENT, MATH = "cudnn", "flash", "efficient", "math"
BACKENDS = (CUDNN, FLASH, EFFICIENT, MATH)
_LOW_PRECISION = (torch.float16, torch.bfloat16)


@dataclasses.dataclass(frozen=True)
class AttentionModel:
    """What the simulated device's attention depends on (defaults: an H200, torch 2.11).

    ``priority``: backends in the order torch tries them. Torch prefers cuDNN on sm90
    when the runtime cuDNN is newer than 9.15 (the CUDA 13 wheels); give
    ``(FLASH, EFFICIENT, MATH)`` for older stacks.
    ``forced``: always use this backend, bypassing selection.
    ``recorded``: ``(call_signature(...), backend)`` pairs a GPU run recorded; a call with a
    recorded signature uses that backend, any other call is selected by the rules.
    ``multiprocessors``: SM count, for flash's split-KV heuristic (H200: 132).
    ``cudnn_workspace``: bytes of the cuDNN execution plan's workspace per call, allocated
    after the output and freed before the RNG tensors (256: measured on the H200, torch
    2.11+cu130, cuDNN 9.19, for every call shape of ``data/models_h200``: 8 or 1024 query
    tokens against 1032 keys, batch 1 to 64, 28 or 32 heads of 128).
    ``efficient_gqa``: whether the memory-efficient kernel accepts fewer KV heads (it does not in
    torch 2.11: ``enable_gqa`` calls with fewer KV heads found no kernel on the H200, data/fuzz).
    ``cudnn_max_head_dim``: the largest head dimension cuDNN takes (256 on the H200, cuDNN 9.19).
    ``cudnn_decode_splits``, ``cudnn_decode_split_keys``: a single query per head against this many
    keys or more is split into that many blocks, whose partial results take workspace (see
    :func:`cudnn_workspace_bytes`; measured in data/fuzz: 8 splits at 1025 keys for 1, 2 and 6
    heads; none at 9 and 101 keys; lengths between were not recorded).
    """

    priority: tuple = (CUDNN, FLASH, EFFICIENT, MATH)
    forced: str | None = None
    multiprocessors: int = 132
    cudnn_workspace: int = 256
    efficient_gqa: bool = False
    cudnn_max_head_dim: int = 256
    cudnn_decode_splits: int = 8
    cudnn_decode_split_keys: int = 1024
    recorded: tuple = ()

    def __post_init__(self):
        recorded = tuple(b for _, b in self.recorded)
        for name in self.priority + ((self.forced,) if self.forced else ()) + recorded:
            if name not in BACKENDS:
                raise ValueError(f"unknown attention backend {name!r}; choose from {BACKENDS}")
        if MATH not in self.priority and self.forced is None:
            raise ValueError("the priority order must end in 'math' (the backend that always applies)")
        if self.multiprocessors < 1 or self.cudnn_workspace < 0:
            raise ValueError("multiprocessors must be >= 1 and cudnn_workspace >= 0")
        if self.cudnn_decode_splits < 1 or self.cudnn_decode_split_keys < 1:
            raise ValueError("cudnn_decode_splits and cudnn_decode_split_keys must be >= 1")


def _head_counts_ok(q, k, v, enable_gqa: bool, gqa_supported: bool) -> bool:
    hq, hk, hv = q.shape[-3], k.shape[-3], v.shape[-3]
    if hq == hk == hv:
        return True
    return enable_gqa and gqa_supported and hk == hv and hq % hk == 0


def call_signature(q, k, mask, is_causal: bool, enable_gqa: bool) -> str:
    """What identifies an attention call across devices: shapes, dtypes, mask, flags."""
    m = None if mask is None else (str(mask.dtype), tuple(mask.shape))
    return repr((tuple(q.shape), tuple(k.shape), str(q.dtype), m, bool(is_causal), bool(enable_gqa)))


NO_KERNEL = "No available kernel. Aborting execution."
_ENABLED = {CUDNN: torch.backends.cuda.cudnn_sdp_enabled, FLASH: torch.backends.cuda.flash_sdp_enabled,
            EFFICIENT: torch.backends.cuda.mem_efficient_sdp_enabled, MATH: torch.backends.cuda.math_sdp_enabled}


def _fits(name: str, model: AttentionModel, q, k, v, mask, is_causal: bool, enable_gqa: bool) -> bool:
    """Whether backend ``name`` takes these inputs (sdp_utils.cpp's constraints for it)."""
    d_q, d_k, d_v = q.shape[-1], k.shape[-1], v.shape[-1]
    last_dim_contiguous = all(t.stride(-1) == 1 for t in (q, k, v))
    low_precision = q.dtype in _LOW_PRECISION
    if name == CUDNN:  # head dims up to 256 on sm90 (cuDNN 9.19), not one key (data/fuzz)
        return (low_precision and d_q == d_k and d_q % 8 == 0 and d_v % 8 == 0 and d_q <= model.cudnn_max_head_dim
                and d_v <= model.cudnn_max_head_dim and k.shape[-2] > 1 and last_dim_contiguous
                and _head_counts_ok(q, k, v, enable_gqa, True))
    if name == FLASH:
        return (low_precision and mask is None and d_q == d_k == d_v and d_q <= 256
                and not (is_causal and q.shape[-2] != k.shape[-2]) and last_dim_contiguous
                and _head_counts_ok(q, k, v, enable_gqa, True))
    if name == EFFICIENT:
        align = 8 if low_precision else 4
        return (q.dtype in _LOW_PRECISION + (torch.float32,) and d_q == d_k and d_q % align == 0
                and d_v % align == 0 and last_dim_contiguous
                and _head_counts_ok(q, k, v, enable_gqa, model.efficient_gqa))
    return True


def select_backend(model: AttentionModel, q, k, v, mask, dropout_p: float, is_causal: bool,
                   enable_gqa: bool) -> str:
    """The backend CUDA's ``select_sdp_backend`` would pick for these (4-D, dense) inputs.

    Backends switched off (``torch.nn.attention.sdpa_kernel``, ``torch.backends.cuda.enable_*_sdp``)
    are passed over, as on CUDA.

    Raises:
        RuntimeError: no enabled backend takes the inputs (torch's message, :data:`NO_KERNEL`).
    """
    if model.forced is not None:
        return model.forced
    if model.recorded:
        found = dict(model.recorded).get(call_signature(q, k, mask, is_causal, enable_gqa))
        if found is not None:
            return found
    for name in model.priority:
        if _ENABLED[name]() and _fits(name, model, q, k, v, mask, is_causal, enable_gqa):
            return name
    if MATH not in model.priority and _ENABLED[MATH]():
        return MATH
    raise RuntimeError(NO_KERNEL)


def flash_num_splits(batch_heads_mblocks: int, num_sms: int, num_n_blocks: int, max_splits: int = 128) -> int:
    """flash-attention 2's split-KV heuristic: split the keys when the grid leaves SMs idle.

    Picks the smallest split count whose wave efficiency (work per wave over a full wave)
    is within 85 % of the best, counting only split counts that change the blocks per split.
    """
    if batch_heads_mblocks >= 0.8 * num_sms:
        return 1
    max_splits = min(max_splits, num_sms, num_n_blocks)

    def eligible(n):
        return n == 1 or math.ceil(num_n_blocks / n) != math.ceil(num_n_blocks / (n - 1))

    efficiency = {}
    for n in range(1, max_splits + 1):
        if eligible(n):
            waves = batch_heads_mblocks * n / num_sms
            efficiency[n] = waves / math.ceil(waves)
    if not efficiency:
        return 1
    best = max(efficiency.values())
    for n in sorted(efficiency):
        if efficiency[n] >= 0.85 * best:
            return n
    return 1


# ----------------------------------------------------------------------- the op itself


CUDNN_PLAN_IN_CAPTURE = "cuDNN error: CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED"


def _cudnn_graph_key(q, k, v, mask, is_causal: bool) -> tuple:
    """What torch's cuDNN attention caches a built graph under: shapes, strides, dtype, causality, bias."""
    bias = None if mask is None else (tuple(mask.shape), tuple(mask.stride()), mask.dtype)
    return (tuple(q.shape), tuple(q.stride()), tuple(k.shape), tuple(k.stride()), tuple(v.shape),
            tuple(v.stride()), q.dtype, bool(is_causal), bias)


def cudnn_workspace_bytes(model: AttentionModel, heads: int, queries: int, keys: int, head_dim_v: int) -> int:
    """The workspace cuDNN's attention plan asks for (H200, cuDNN 9.19, data/fuzz).

    Prefill and verification (more than one query per head) take ``model.cudnn_workspace`` (256
    bytes). A single query per head takes none, unless the keys are split across
    ``model.cudnn_decode_splits`` blocks (``model.cudnn_decode_split_keys`` keys or more): then
    the partial outputs (float32, ``head_dim_v`` each) and their two softmax statistics per
    split and head, each array aligned to 128 bytes, and the 256 bytes.

    Args:
        model: the attention model (its cuDNN fields).
        heads: batch times query heads.
        queries: queries per head.
        keys: keys per head.
        head_dim_v: the value head dimension.

    Returns:
        Bytes (0: no workspace is allocated).
    """
    if queries > 1:
        return model.cudnn_workspace
    if keys < model.cudnn_decode_split_keys:
        return 0
    splits = model.cudnn_decode_splits
    return _align(heads * splits * head_dim_v * 4, 128) + _align(heads * splits * 2 * 4, 128) + model.cudnn_workspace


def _align(n: int, to: int) -> int:
    return -(-n // to) * to


def _parse(args, kwargs):
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
    values = dict(zip(names, args))
    values.update(kwargs)
    return (values["query"], values["key"], values["value"], values.get("attn_mask"),
            float(values.get("dropout_p", 0.0)), bool(values.get("is_causal", False)),
            values.get("scale"), bool(values.get("enable_gqa", False)))


def _additive_mask(mask, dtype):
    """``convert_boolean_attn_mask``: a device scalar, then ``where(mask, 0, -inf)``."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    neg_inf = _empty(mask.sim_backend, (), (), dtype)
    if mask.sim_backend.backed:
        neg_inf.fill_(float("-inf"))
    return torch.where(mask, 0.0, neg_inf)


def _padded_bias(mask, alignment: int = 8):
    """The memory-efficient kernel's ``preprocess_mask``: pad the last dim unless aligned."""
    if mask is None:
        return None
    aligned = mask.stride(-1) == 1 and all(s % alignment == 0 for s in mask.stride()[:-1])
    if aligned:
        return mask
    length = mask.shape[-1]
    padded = torch.nn.functional.pad(mask, (0, alignment - length % alignment))
    return padded[..., :length]


def _empty(backend, size, stride, dtype) -> SimTensor:
    template = torch.empty_strided(size, stride, dtype=dtype, device="meta")
    return backend.place(template, copy=False)


def _contiguous_strides(size):
    strides, acc = [], 1
    for n in reversed(size):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


def _bshd_strides(b, h, s, d):
    """Strides of a (b, h, s, d) view of memory laid out (b, s, h, d)."""
    return (s * h * d, d, h * d, 1)


def _like_query(q, shape):
    """``empty_like`` of the query keeps its strides when it is dense, else contiguous."""
    if tuple(q.shape) == tuple(shape) and non_overlapping_and_dense(q):
        return tuple(q.stride())
    return _contiguous_strides(shape)


def _values(q, k, v, mask, is_causal, scale, enable_gqa):
    """Attention values by the math kernel on plain CPU tensors (backed devices, replay)."""
    with torch_functions_off():
        return torch.ops.aten._scaled_dot_product_attention_math(
            q, k, v, mask, 0.0, is_causal, None, scale=scale, enable_gqa=enable_gqa
        )[0]


def _fill(backend, out: SimTensor, q, k, v, mask, is_causal, scale, enable_gqa) -> None:
    """The kernel: write the values into ``out`` and, during a capture, record that for replay."""
    launch_kernel(backend)
    if not backend.backed:
        return
    inner = [t.sim_inner if t is not None else None for t in (q, k, v, mask)]
    with torch_functions_off():
        out.sim_inner.copy_(_values(*inner, is_causal, scale, enable_gqa))
    capture = backend.capture_for_current_stream()
    if capture is not None:
        capture.record_op(_values, (*inner, is_causal, scale, enable_gqa), {}, [(-1, out.sim_inner)])


@register_cuda_model(torch.ops.aten._safe_softmax.default)
def _safe_softmax(func, args, kwargs):
    """``_safe_softmax``: a softmax whose rows of only ``-inf`` give zeros. CUDA composes it (torch
    2.11) as the softmax, ``isneginf`` of the input, ``all`` over the dim (keepdim), a device zero
    of the output's dtype and a ``where`` written into the softmax's own output; the temporaries
    go in reverse order."""
    names = ("self", "dim", "dtype")
    params = dict(zip(names, args))
    params.update(kwargs)
    x, dim = params["self"], params["dim"]
    out = torch.softmax(x, dim, dtype=params.get("dtype"))
    masked = torch.isneginf(x)
    rows = masked.all(dim, keepdim=True)
    zero = out.new_zeros(())
    torch.where(rows, zero, out, out=out)
    del zero, rows, masked
    return out


def _expand_heads(query, key, value, enable_gqa: bool):
    """``pre_process_group_query_attention_input``: fewer KV heads are repeated (one copy each)."""
    if not enable_gqa or query.shape[-3] == key.shape[-3] == value.shape[-3]:
        return key, value
    return (key.repeat_interleave(query.shape[-3] // key.shape[-3], -3),
            value.repeat_interleave(query.shape[-3] // value.shape[-3], -3))


def math_attention(q, k, v, mask, is_causal: bool, scale, enable_gqa: bool, dropout_p: float = 0.0):
    """``_scaled_dot_product_attention_math`` as torch 2.11 runs it on CUDA; returns ``(out, weights)``.

    Half inputs are upcast to float32 (query, key, value: three copies); the query and the
    transposed key are each scaled by the square root of the scale; a causal mask is made on the
    device (``ones``, ``tril``, made additive like a boolean mask); fewer KV heads are repeated;
    the scores get the mask added in place and a ``_safe_softmax``; the returned pair is made
    right to left as GCC evaluates ``make_tuple``'s arguments (the weights cast back first, then
    the output), and the locals die in reverse order of declaration. ``mask`` is already
    additive (:func:`_additive_mask`).
    """
    origin = q.dtype
    upcast = origin in _LOW_PRECISION
    q_acc = q.to(torch.float32) if upcast else q
    k_acc = k.to(torch.float32) if upcast else k
    v_acc = v.to(torch.float32) if upcast else v
    negative = scale is not None and scale < 0
    factor = math.sqrt(abs(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1]))
    query = q_acc * (-factor if negative else factor)
    if is_causal:
        causal = q.new_ones((q.shape[-2], k.shape[-2]), dtype=torch.bool).tril()
        mask = _additive_mask(causal, query.dtype)
        del causal
    key_expanded, value_expanded = _expand_heads(query, k_acc, v_acc, enable_gqa)
    scores = torch.matmul(query, key_expanded.transpose(-2, -1) * factor)
    if mask is not None:
        scores.add_(mask)
    weights = torch.ops.aten._safe_softmax.default(scores, -1)
    del scores
    if dropout_p > 0.0:  # training: at::dropout of the weights (their mask kept for the backward)
        weights = torch.dropout(weights, dropout_p, True)
    weights_out = weights.to(origin)
    out = torch.matmul(weights, value_expanded).to(origin)
    del weights, key_expanded, value_expanded, query, mask, v_acc, k_acc, q_acc
    return out, weights_out


@register_cuda_model(torch.ops.aten.scaled_dot_product_attention.default,
                     torch.nn.functional.scaled_dot_product_attention)
def scaled_dot_product_attention(func, args, kwargs):
    """The CUDA composite ``scaled_dot_product_attention`` on simulated tensors."""
    q, k, v, mask, dropout_p, is_causal, scale, enable_gqa = _parse(args, kwargs)
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise NotImplementedError(
            "the simulated device models scaled_dot_product_attention for 4-D (batch, heads, "
            f"seq, dim) inputs; got {q.dim()}-D / {k.dim()}-D / {v.dim()}-D"
        )
    training = records_grad(q, k, v, mask)
    if dropout_p > 0.0 and not training:
        raise NotImplementedError("the simulated device models attention with dropout only where autograd records "
                                  "it (training); pass dropout_p=0.0 for inference")
    backend = q.sim_backend
    model = backend.attention
    choice = select_backend(model, q, k, v, mask, dropout_p, is_causal, enable_gqa)
    mask = _additive_mask(mask, q.dtype)
    if training:
        if choice == MATH:
            return math_attention(q, k, v, mask, is_causal, scale, enable_gqa, dropout_p)[0]
        return KernelFunction.apply(_FusedAttention(choice, is_causal, scale, enable_gqa, dropout_p), q, k, v, mask)[0]
    if choice == MATH:
        out, weights = math_attention(q, k, v, mask, is_causal, scale, enable_gqa)
        del weights  # the composite keeps only the output; the weights go last
        return out
    b, h, s_q, _ = q.shape
    d_v = v.shape[-1]
    out_shape = (b, h, s_q, d_v)
    f32 = torch.float32
    if choice == FLASH:
        out = _empty(backend, out_shape, _like_query(q, out_shape), q.dtype)
        lse = _empty(backend, (b, h, s_q), _contiguous_strides((b, h, s_q)), f32)
        d = q.shape[-1]
        block_n = 256 if d <= 64 else 128 if d <= 128 else 64
        splits = flash_num_splits(b * h * math.ceil(s_q / 64), model.multiprocessors * 2,
                                  math.ceil(k.shape[-2] / block_n))
        accumulators = []
        if splits > 1:
            rounded = (d + 31) // 32 * 32
            accumulators.append(backend.new_storage(splits * b * h * s_q * 4))  # softmax_lse_accum
            accumulators.append(backend.new_storage(splits * b * h * s_q * rounded * 4))  # out_accum
        rng_state = backend.new_storage(16)  # uint64[2] philox seed and offset, on the device
        unused = backend.new_storage(8)  # the empty uint64 scalar mha_fwd returns beside it
        _fill(backend, out, q, k, v, mask, is_causal, scale, enable_gqa)
        while accumulators:  # freed when mha_fwd returns, in the order they were made (H200)
            accumulators.pop(0)
        del lse, rng_state, unused  # the composite keeps only the output; the rest go in order
        return out
    if choice == EFFICIENT:
        mask = _padded_bias(mask)
        if mask is not None:
            mask = mask.expand(b, h, s_q, k.shape[-2])
        seed = offset = None
        if backend.capture_for_current_stream() is not None:  # a capture keeps the philox seed and offset
            seed = _empty(backend, (), (), torch.int64)  # on the device, before the output (H200)
            offset = _empty(backend, (), (), torch.int64)
        out = _empty(backend, out_shape, _bshd_strides(b, h, s_q, d_v), q.dtype)
        if q.shape[-1] > 128 and q.dtype != f32:  # kernels past kMaxK=128 accumulate in fp32 memory
            accum = backend.new_storage(b * s_q * h * d_v * 4)
            del accum
        _fill(backend, out, q, k, v, mask, is_causal, scale, enable_gqa)
        del seed, offset
        return out
    # cuDNN: RNG seed and offset on the device, output in the query's layout, the graph, workspace
    seed = _empty(backend, (1,), (1,), torch.int64)  # at::zeros on the device
    offset = _empty(backend, (1,), (1,), torch.int64)
    out = _empty(backend, out_shape, _like_query(q, out_shape), q.dtype)
    graph = _cudnn_graph_key(q, k, v, mask, is_causal)
    if graph not in backend.cudnn_graphs:
        # cuDNN allocates device memory the first time it builds a plan in a process, which a capture
        # refuses; later plans, of any shape, build inside a capture (data/fuzz: the model scripts'
        # captures build plans for the mask shapes their warm-up never used, and succeed on the H200)
        if not backend.cudnn_graphs and backend.capture_for_current_stream() is not None:
            del seed, offset, out  # as the error unwinds
            raise host.fails_in_capture(backend, CUDNN_PLAN_IN_CAPTURE)
        backend.cudnn_graphs.add(graph)
    workspace_bytes = cudnn_workspace_bytes(model, b * h, s_q, k.shape[-2], d_v)
    if workspace_bytes:
        workspace = backend.new_storage(workspace_bytes)
        del workspace
    _fill(backend, out, q, k, v, mask, is_causal, scale, enable_gqa)
    del seed, offset
    return out


# ------------------------------------------------------------------ training: forward and backward


class _FusedAttention:
    """A fused attention kernel as an autograd node (:class:`graphborrow.sim.autograd.KernelFunction`):
    the forward keeps what the backward reads (the log-sum-exp, the RNG state), the backward
    allocates the gradients and the kernel's buffers. Written from ATen's ``attention_backward.cu``
    and flash-attention's ``mha_bwd``; the buffers' sizes are checked against the H200's
    training recordings (``data/fuzz``, ``train_probe_attention``)."""

    differentiable = 1

    def __init__(self, choice: str, is_causal: bool, scale, enable_gqa: bool, dropout_p: float) -> None:
        self.choice, self.is_causal, self.scale, self.enable_gqa, self.dropout_p = (
            choice, is_causal, scale, enable_gqa, dropout_p)

    def reference(self, q, k, v, mask):
        return torch.ops.aten._scaled_dot_product_attention_math(
            q, k, v, mask, 0.0, self.is_causal, None, scale=self.scale, enable_gqa=self.enable_gqa)[0]

    def forward(self, q, k, v, mask):
        backend = q.sim_backend
        b, h, s_q, d = q.shape
        out_shape = (b, h, s_q, v.shape[-1])
        f32 = torch.float32
        if self.choice == FLASH:
            out = _empty(backend, out_shape, _like_query(q, out_shape), q.dtype)
            lse = _empty(backend, (b, h, s_q), _contiguous_strides((b, h, s_q)), f32)
            block_n = 256 if d <= 64 else 128 if d <= 128 else 64
            splits = 1 if self.dropout_p > 0 else flash_num_splits(
                b * h * math.ceil(s_q / 64), backend.attention.multiprocessors * 2, math.ceil(k.shape[-2] / block_n))
            accumulators = []
            if splits > 1:
                rounded = (d + 31) // 32 * 32
                accumulators.append(backend.new_storage(splits * b * h * s_q * 4))
                accumulators.append(backend.new_storage(splits * b * h * s_q * rounded * 4))
            seed = _empty(backend, (2,), (1,), torch.int64)  # the philox seed and offset
            offset = _empty(backend, (), (), torch.int64)  # the empty scalar returned beside it
            del accumulators
            aux = (lse, seed, offset)
        elif self.choice == EFFICIENT:
            bias = _padded_bias(mask)
            seed = offset = None
            if backend.capture_for_current_stream() is not None:
                seed = _empty(backend, (), (), torch.int64)
                offset = _empty(backend, (), (), torch.int64)
            out = _empty(backend, out_shape, _bshd_strides(b, h, s_q, v.shape[-1]), q.dtype)
            if d > 128 and q.dtype != f32:
                accum = backend.new_storage(b * s_q * h * v.shape[-1] * 4)
                del accum
            rows = -(-s_q // 32) * 32
            lse = _empty(backend, (b, h, rows), _contiguous_strides((b, h, rows)), f32)
            aux = tuple(t for t in (lse, seed, offset, bias) if t is not None)
        else:  # cuDNN
            seed = _empty(backend, (1,), (1,), torch.int64)
            offset = _empty(backend, (1,), (1,), torch.int64)
            out = _empty(backend, out_shape, _like_query(q, out_shape), q.dtype)
            lse = _empty(backend, (b, h, s_q, 1), _contiguous_strides((b, h, s_q, 1)), f32)
            workspace_bytes = cudnn_workspace_bytes(backend.attention, b * h, s_q, k.shape[-2], v.shape[-1])
            if workspace_bytes:
                workspace = backend.new_storage(workspace_bytes)
                del workspace
            aux = (seed, offset, lse)
        _fill(backend, out, q, k, v, mask, self.is_causal, self.scale, self.enable_gqa)
        return (out,) + aux, (q, k, v, mask, out) + aux, None

    def backward(self, state, grads, saved, needs):
        grad = grads[0]
        q, k, v, mask = saved[:4]
        if grad is None:
            return None, None, None, None
        backend = q.sim_backend
        b, h, s_q, d = q.shape
        held = []
        if grad.stride(-1) != 1:  # the kernels read the output's gradient with a unit last stride
            held.append(backend.new_storage(grad.numel() * grad.element_size()))
        dq, dk, dv = (_empty(backend, t.shape, _like_query(t, t.shape), t.dtype) for t in (q, k, v))
        if self.choice == FLASH:
            rows = -(-s_q // 128) * 128
            held.append(backend.new_storage(b * h * rows * 4))  # softmax_d
            held.append(backend.new_storage(b * rows * h * (-(-d // 32) * 32) * 4))  # dq_accum
            if k.shape[-3] != h:  # grouped keys: gradients for every query head, then summed
                held.append(backend.new_storage(b * k.shape[-2] * h * d * k.element_size()))
                held.append(backend.new_storage(b * v.shape[-2] * h * v.shape[-1] * v.element_size()))
        elif self.choice == EFFICIENT:
            held.append(backend.new_storage(b * h * s_q * 4))  # delta
        elif backend.attention.cudnn_workspace:
            held.append(backend.new_storage(backend.attention.cudnn_workspace))
        wanted = tuple(bool(n) for n in needs[:3]) + (False,)
        _fill_grads((dq, dk, dv), self.reference, (q, k, v, mask), grad, wanted)
        del held
        return (dq if needs[0] else None, dk if needs[1] else None, dv if needs[2] else None, None)


def _fill_grads(targets, reference, inputs, grad, wanted) -> None:
    """The backward kernel; on backed devices the gradients' values, from torch's autograd of the CPU
    reference."""
    launch_kernel(grad.sim_backend)
    if not grad.sim_backend.backed:
        return
    inner = [t.sim_inner if t is not None else None for t in inputs]
    outs = [t.sim_inner for t, want in zip(targets, wanted) if want]

    def compute(*args):
        return reference_grads(reference, args[:-1], (args[-1],), wanted)

    with torch_functions_off():
        for target, value in zip(outs, compute(*inner, grad.sim_inner)):
            target.copy_(value)
    capture = grad.sim_backend.capture_for_current_stream()
    if capture is not None:  # a replayed backward graph computes them again
        capture.record_op(compute, (*inner, grad.sim_inner), {}, list(enumerate(outs)))
