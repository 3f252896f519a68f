"""scaled_dot_product_attention on the simulated device, modelled on its CUDA path."""

import math

import pytest
import torch
import torch.nn.functional as F

from graphborrow.sim import SimBackend
from graphborrow.sim.attention import (
    CUDNN,
    EFFICIENT,
    FLASH,
    MATH,
    AttentionModel,
    call_signature,
    flash_num_splits,
    select_backend,
)

BF16 = torch.bfloat16


def _device(**attention):
    return SimBackend(backed=False, attention=AttentionModel(**attention))


def _allocs(backend):
    return [(e["action"], e["size"]) for e in backend.full_snapshot()["device_traces"][0]
            if e["action"] in ("alloc", "free_completed")]


def test_selection_follows_each_backends_constraints():
    m = AttentionModel(priority=(FLASH, EFFICIENT, MATH))
    q = torch.empty(2, 8, 16, 128, dtype=BF16)
    k = torch.empty(2, 8, 64, 128, dtype=BF16)
    mask = torch.ones(2, 1, 16, 64, dtype=torch.bool)
    assert select_backend(m, q, k, k, None, 0.0, False, False) == FLASH
    assert select_backend(m, q, k, k, mask, 0.0, False, False) == EFFICIENT  # flash takes no mask
    assert select_backend(m, q, k, k, None, 0.0, True, False) == EFFICIENT  # causal with seq_q != seq_k
    q32, k32 = q.float(), k.float()
    assert select_backend(m, q32, k32, k32, None, 0.0, False, False) == EFFICIENT  # flash is half precision only
    gqa_k = torch.empty(2, 2, 64, 128, dtype=BF16)
    assert select_backend(m, q, gqa_k, gqa_k, None, 0.0, False, True) == FLASH
    no_gqa = AttentionModel(priority=(FLASH, EFFICIENT, MATH), efficient_gqa=False)
    assert select_backend(no_gqa, q, gqa_k, gqa_k, mask, 0.0, False, True) == MATH
    wide = torch.empty(2, 8, 16, 320, dtype=BF16)
    assert select_backend(m, wide, wide, wide, None, 0.0, False, False) == EFFICIENT  # flash stops at 256
    assert select_backend(AttentionModel(), q, k, k, mask, 0.0, False, False) == CUDNN  # Hopper, new cuDNN
    assert select_backend(AttentionModel(forced=MATH), q, k, k, None, 0.0, False, False) == MATH


def test_model_refuses_unknown_backends():
    with pytest.raises(ValueError, match="unknown attention backend 'fa3'"):
        AttentionModel(priority=("fa3", MATH))
    with pytest.raises(ValueError, match="must end in 'math'"):
        AttentionModel(priority=(FLASH,))


def test_flash_split_heuristic():
    assert flash_num_splits(300, 264, 16) == 1  # the grid already fills the SMs
    # 8 blocks on 264 SMs, 4 key blocks: split counts 1, 2, 4 are eligible (3 repeats 2 blocks per split);
    # efficiencies 8/264, 16/264, 32/264 -> the first within 85 % of the best is 4
    assert flash_num_splits(8, 264, 4) == 4
    assert flash_num_splits(8, 264, 1) == 1


def test_efficient_attention_output_is_laid_out_bshd_and_the_mask_becomes_additive():
    b = _device(forced=EFFICIENT)
    try:
        q = torch.empty(2, 4, 8, 64, dtype=BF16, device="cuda")
        k = torch.empty(2, 4, 40, 64, dtype=BF16, device="cuda")
        mask = torch.ones(2, 1, 8, 40, dtype=torch.bool, device="cuda")
        b.record_memory_history(True)
        out = F.scaled_dot_product_attention(q, k, k, attn_mask=mask)
        assert out.shape == (2, 4, 8, 64)
        assert out.transpose(1, 2).is_contiguous()  # the caller's transpose(1, 2).contiguous() copies nothing
        sizes = [s for a, s in _allocs(b) if a == "alloc"]
        assert 2 * 8 * 40 * 2 in sizes  # where(mask, 0, -inf) in bf16
        assert sizes[-1] == 2 * 8 * 4 * 64 * 2  # the output, last
    finally:
        b.close()


def test_efficient_attention_pads_an_unaligned_mask():
    b = _device(forced=EFFICIENT)
    try:
        q = torch.empty(1, 2, 4, 64, dtype=BF16, device="cuda")
        k = torch.empty(1, 2, 13, 64, dtype=BF16, device="cuda")
        mask = torch.ones(1, 1, 4, 13, dtype=torch.bool, device="cuda")
        b.record_memory_history(True)
        F.scaled_dot_product_attention(q, k, k, attn_mask=mask)
        sizes = [s for a, s in _allocs(b) if a == "alloc"]
        assert 1 * 4 * 16 * 2 in sizes  # padded to 16 keys
    finally:
        b.close()


def test_cudnn_attention_allocates_seed_offset_then_output_like_the_query():
    b = _device(forced=CUDNN)
    try:
        q = torch.empty(2, 4, 8, 64, dtype=BF16, device="cuda")
        k = torch.empty(2, 4, 40, 64, dtype=BF16, device="cuda")
        b.record_memory_history(True)
        out = F.scaled_dot_product_attention(q, k, k)
        assert out.is_contiguous()  # like the (contiguous) query
        events = _allocs(b)
        assert events[:3] == [("alloc", 8), ("alloc", 8), ("alloc", 2 * 4 * 8 * 64 * 2)]
        # the execution plan's workspace (measured on the H200: 256 bytes), freed first
        assert events[3:] == [("alloc", 256), ("free_completed", 256), ("free_completed", 8), ("free_completed", 8)]
    finally:
        b.close()
    b = _device(forced=CUDNN, cudnn_workspace=0)
    try:
        q = torch.empty(2, 4, 8, 64, dtype=BF16, device="cuda")
        k = torch.empty(2, 4, 40, 64, dtype=BF16, device="cuda")
        b.record_memory_history(True)
        F.scaled_dot_product_attention(q, k, k)
        assert [e for e in _allocs(b) if e[1] == 256] == []
    finally:
        b.close()


def test_flash_attention_splits_keys_with_fp32_accumulators_it_frees():
    b = _device(priority=(FLASH, EFFICIENT, MATH))
    try:
        q = torch.empty(2, 4, 8, 64, dtype=BF16, device="cuda")
        k = torch.empty(2, 4, 1024, 64, dtype=BF16, device="cuda")
        b.record_memory_history(True)
        out = F.scaled_dot_product_attention(q, k, k)
        assert out.is_contiguous()  # empty_like(query): the caller's transpose(1, 2).contiguous() copies
        splits = flash_num_splits(2 * 4 * 1, 132 * 2, math.ceil(1024 / 256))
        assert splits == 4
        assert _allocs(b) == [
            ("alloc", 2 * 4 * 8 * 64 * 2),  # output
            ("alloc", 2 * 4 * 8 * 4),  # log-sum-exp
            ("alloc", splits * 2 * 4 * 8 * 4),  # split log-sum-exp accumulator
            ("alloc", splits * 2 * 4 * 8 * 64 * 4),  # split output accumulator
            ("alloc", 16),  # the philox seed and offset mha_fwd returns
            ("alloc", 8),  # the empty scalar beside them
            ("free_completed", splits * 2 * 4 * 8 * 4),  # accumulators in the order made (H200, data/fuzz)
            ("free_completed", splits * 2 * 4 * 8 * 64 * 4),
            ("free_completed", 2 * 4 * 8 * 4),
            ("free_completed", 16),
            ("free_completed", 8),
        ]
    finally:
        b.close()


@pytest.mark.parametrize("backend_name", [CUDNN, FLASH, EFFICIENT, MATH])
@pytest.mark.parametrize("masked", [False, True])
def test_values_match_the_cpu_kernel(backend_name, masked):
    b = SimBackend(backed=True, attention=AttentionModel(forced=backend_name))
    try:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(2, 4, n, 16, generator=g) for n in (5, 11, 11))
        mask = torch.rand(2, 1, 5, 11, generator=g) > 0.3 if masked else None
        mask = None if mask is None else mask | torch.eye(5, 11, dtype=torch.bool)  # no fully masked row
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        dev = [t.to("cuda") for t in (q, k, v)]
        got = F.scaled_dot_product_attention(*dev, attn_mask=None if mask is None else mask.to("cuda"))
        torch.testing.assert_close(got.cpu(), expected, rtol=1e-5, atol=1e-5)
    finally:
        b.close()


def test_captured_attention_replays_into_its_output(sim):
    q = torch.randn(1, 2, 3, 8, device="cuda")
    k = torch.randn(1, 2, 6, 8, device="cuda")
    g = sim.CUDAGraph()
    with sim.graph(g):
        out = F.scaled_dot_product_attention(q, k, k)
    q.copy_(torch.randn(1, 2, 3, 8).to("cuda"))
    g.replay()
    expected = F.scaled_dot_product_attention(q.cpu(), k.cpu(), k.cpu())
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-5)


def test_simulated_tensors_report_cuda_to_python(sim):
    x = torch.empty(3, device="cuda")
    assert x.device == torch.device("cuda", 0) and x.is_cuda and not x.is_cpu
    y = torch.zeros(2, device=x.device)  # model code's idiom stays on the simulated device
    assert type(y) is type(x)
    assert (x.to(x.device) is x) or type(x.to(x.device)) is type(x)


def test_recorded_choices_decide_per_call_shape():
    q = torch.empty(2, 8, 16, 128, dtype=BF16)
    k = torch.empty(2, 8, 64, 128, dtype=BF16)
    mask = torch.ones(2, 1, 16, 64, dtype=torch.bool)
    masked = call_signature(q, k, mask, False, False)
    m = AttentionModel(recorded=((masked, MATH),))
    assert select_backend(m, q, k, k, mask, 0.0, False, False) == MATH  # what the GPU picked for this call
    assert select_backend(m, q, k, k, None, 0.0, False, False) == CUDNN  # unrecorded: the rules
    assert call_signature(q, k, mask, False, False) != call_signature(q, k, None, False, False)
    with pytest.raises(ValueError, match="unknown attention backend 'fa4'"):
        AttentionModel(recorded=((masked, "fa4"),))
