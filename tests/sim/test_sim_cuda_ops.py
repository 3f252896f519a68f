"""What CUDA kernels allocate while they run, on the simulated device and (gpu-marked) on a GPU.

Each test runs the same code on the ``backend`` fixture's device and asserts the same
allocator events (alloc / free_completed sizes, in order): the simulated run checks the
simulator's models (graphborrow/sim/cuda_ops.py, blas.py for the cuBLASLt workspace, cuDNN attention),
the GPU run checks that the models say what torch's CUDA kernels do.
"""

import pytest
import torch
import torch.nn.functional as F

from graphborrow.sim import SimBackend
from graphborrow.sim.cuda_ops import KernelModel, grouped_mm_argument_bytes

MiB = 2**20
BF16 = torch.bfloat16


def events(backend, run) -> list[tuple[str, int]]:
    """The alloc / free_completed events (size as requested) while ``run()`` runs."""
    device = torch.cuda.current_device() if backend.name == "cuda" else 0
    backend.synchronize()
    backend.record_memory_history(True)
    before = len(backend.full_snapshot()["device_traces"][device])
    run()
    backend.synchronize()
    trace = backend.full_snapshot()["device_traces"][device][before:]
    backend.record_memory_history(False)
    return [(e["action"], e["size"]) for e in trace if e["action"] in ("alloc", "free_completed")]


def multiprocessors(backend) -> int:
    if backend.name == "cuda":
        return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return backend.kernels.multiprocessors


def test_a_scalar_base_becomes_a_device_scalar_after_the_output(backend):
    x = torch.arange(0, 64, 2, dtype=torch.float32, device=backend.device)
    kept = []
    assert events(backend, lambda: kept.append(500000.0 ** x)) == [("alloc", 128), ("alloc", 8), ("free_completed", 8)]
    assert events(backend, lambda: kept.append(1.0 ** x)) == [("alloc", 128)]  # base 1: filled, no scalar


def test_a_small_sort_fills_its_indices_from_an_arange(backend):
    keys = torch.randint(0, 8, (1024,), device=backend.device)
    rows = torch.rand(4, 300, device=backend.device)
    kept = []
    assert events(backend, lambda: kept.append(torch.sort(keys))) == [
        ("alloc", 8192), ("alloc", 8192), ("alloc", 8192), ("free_completed", 8192)]
    # along the last of two dims: the arange covers one row (300 int64)
    assert events(backend, lambda: kept.append(torch.sort(rows, dim=1, descending=True))) == [
        ("alloc", 4800), ("alloc", 9600), ("alloc", 2400), ("free_completed", 2400)]


def test_cumsum_over_every_element_takes_cub_storage(backend):
    ids = torch.ones(8, dtype=torch.int32, device=backend.device)
    rows = torch.ones(4, 8, dtype=torch.int32, device=backend.device)
    scan = KernelModel().cub_scan_bytes(8, 4)
    kept = []
    assert events(backend, lambda: kept.append(torch.cumsum(ids, 0, dtype=torch.int32))) == [
        ("alloc", 32), ("alloc", scan), ("free_completed", scan)]
    assert events(backend, lambda: kept.append(torch.cumsum(rows, 1, dtype=torch.int32))) == [("alloc", 128)]
    # int32 summed into int64: the input is converted first, and freed after the scan
    assert events(backend, lambda: kept.append(torch.cumsum(rows, 1))) == [
        ("alloc", 256), ("alloc", 256), ("free_completed", 256)]


def test_grouped_gemm_allocates_its_arguments_and_workspace(backend):
    if backend.name == "cuda" and torch.cuda.get_device_capability()[0] not in (9, 10):
        pytest.skip("the CUTLASS grouped GEMM runs on sm90 / sm100 only")
    grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm
    a = torch.randn(64, 128, dtype=BF16, device=backend.device)
    b = torch.randn(8, 128, 256, dtype=BF16, device=backend.device)
    offs = torch.arange(8, 65, 8, dtype=torch.int32, device=backend.device)
    args, workspace = grouped_mm_argument_bytes(8), multiprocessors(backend) * 512
    kept = []
    assert events(backend, lambda: kept.append(grouped_mm(a, b, offs=offs))) == [
        ("alloc", 64 * 256 * 2), ("alloc", args), ("alloc", workspace),
        ("free_completed", workspace), ("free_completed", args)]


def test_grouped_gemm_argument_buffer_matches_the_h200_traces():
    # data/models_h200: Mixtral (8 experts) and Qwen3-30B-A3B (128 experts)
    assert grouped_mm_argument_bytes(8) == 480 and grouped_mm_argument_bytes(128) == 7680
    assert grouped_mm_argument_bytes(3) == 4 * 24 + 3 * 12 + 3 * 24  # pointer arrays padded to an even count
    assert grouped_mm_argument_bytes(8, bias=True) == 480 + 64


def test_bias_fused_linear_keeps_a_cublaslt_workspace_per_stream(backend):
    x = torch.randn(16, 64, device=backend.device)
    w = torch.randn(32, 64, device=backend.device)
    bias = torch.randn(32, device=backend.device)
    backend.clear_library_workspaces()
    stream = backend.Stream()
    kept = []

    def run():
        with backend.stream(stream):
            kept.append(x @ w.t())  # cuBLAS: its workspace
            kept.append(F.linear(x, w, bias))  # addmm with a bias vector: cuBLASLt, its workspace
            kept.append(F.linear(x, w, bias))  # kept: nothing new
            kept.append(torch.addmm(bias.expand(16, 32).contiguous(), x, w.t()))  # 2-D bias: cuBLAS

    got = events(backend, run)
    assert got[:4] == [("alloc", 2048), ("alloc", 32 * MiB), ("alloc", 2048), ("alloc", MiB)]
    # the second linear; then the 2-D bias made contiguous, the addmm output, the bias copy freed
    assert got[4:] == [("alloc", 2048), ("alloc", 2048), ("alloc", 2048), ("free_completed", 2048)]


def test_a_masked_cudnn_attention_call_allocates_as_on_the_h200(backend):
    shape_q, shape_k = (1, 32, 8, 128), (1, 32, 1032, 128)  # a verify call of the recorded workloads
    q = torch.randn(shape_q, dtype=BF16, device=backend.device)
    k = torch.randn(shape_k, dtype=BF16, device=backend.device)
    mask = torch.ones(1, 1, 8, 1032, dtype=torch.bool, device=backend.device)
    kept = []
    got = events(backend, lambda: kept.append(F.scaled_dot_product_attention(q, k, k, attn_mask=mask)))
    additive, out = 8 * 1032 * 2, 32 * 8 * 128 * 2
    assert got == [
        ("alloc", 2), ("alloc", 2), ("alloc", additive), ("free_completed", 2), ("free_completed", 2),  # where()
        ("alloc", 8), ("alloc", 8), ("alloc", out), ("alloc", 256),  # RNG seed, offset, output, workspace
        ("free_completed", 256), ("free_completed", 8), ("free_completed", 8), ("free_completed", additive)]


def test_kernel_model_refuses_impossible_values():
    with pytest.raises(ValueError, match="multiprocessors must be >= 1"):
        KernelModel(multiprocessors=0)
    with pytest.raises(ValueError, match="byte counts must be >= 0"):
        KernelModel(grouped_gemm_workspace_per_sm=-1)
    with pytest.raises(ValueError, match="positive tile size"):
        KernelModel(scan_tile_items=((4, 0),))


def test_the_fallback_grouped_gemm_has_no_temporaries():
    b = SimBackend(backed=False, kernels=KernelModel(grouped_gemm_cutlass=False))
    try:
        a = torch.empty(64, 128, dtype=BF16, device="cuda")
        w = torch.empty(8, 128, 256, dtype=BF16, device="cuda")
        offs = torch.arange(8, 65, 8, dtype=torch.int32, device="cuda")
        kept = []
        assert events(b, lambda: kept.append(torch._grouped_mm(a, w, offs=offs))) == [("alloc", 64 * 256 * 2)]
    finally:
        b.close()


# ---------------------------------------------- kernels measured in data/fuzz (H200, torch 2.11)


def test_a_full_reduction_over_many_elements_stages_partials_in_global_memory(backend):
    x = torch.randn(64, 6000, device=backend.device)
    got = events(backend, lambda: x.argmax())
    # output, then (pair<float, int64>) x 47 blocks and one semaphore, freed last first
    assert got == [("alloc", 8), ("alloc", 752), ("alloc", 4), ("free_completed", 4),
                   ("free_completed", 752), ("free_completed", 8)]


def test_reduce_staging_follows_set_reduce_config():
    from graphborrow.sim.reductions import reduce_staging_bytes

    assert reduce_staging_bytes((64, 2048), (2048, 1), [0, 1], 4) == (64, 4)  # 16 blocks of floats
    assert reduce_staging_bytes((64, 4096), (4096, 1), [0, 1], 1) == (32, 4)  # any(): bools
    assert reduce_staging_bytes((8, 8192), (8192, 1), [0, 1], 8) == (0, 0)  # 128 values a thread: one block
    assert reduce_staging_bytes((64, 8192), (8192, 1), [1], 4) == (0, 0)  # 64 outputs, a warp each


def test_softmax_copies_a_strided_input_after_its_output(backend):
    x = torch.randn(64, 256, device=backend.device)
    view = x.t()
    got = events(backend, lambda: view.softmax(-1))
    assert got == [("alloc", 65536), ("alloc", 65536), ("free_completed", 65536), ("free_completed", 65536)]


def test_randperm_sorts_random_keys_with_cub(backend):
    got = events(backend, lambda: torch.randperm(3000, device=backend.device))
    assert got == [("alloc", 24000), ("alloc", 8), ("free_completed", 8), ("alloc", 24000), ("alloc", 12000),
                   ("alloc", 12000), ("alloc", 45823), ("free_completed", 45823), ("free_completed", 12000),
                   ("free_completed", 12000), ("free_completed", 24000), ("free_completed", 24000)]


def test_sort_past_4096_per_row_uses_cub_segmented_sort(backend):
    x = torch.randn(128, 4097, device=backend.device)
    got = events(backend, lambda: torch.sort(x, dim=-1, descending=True))
    assert got[:6] == [("alloc", 2097664), ("alloc", 4195328), ("alloc", 4195328), ("alloc", 6293247),
                       ("free_completed", 6293247), ("free_completed", 4195328)]


def test_index_put_with_accumulate_sorts_its_indices(backend):
    x = torch.zeros(1000, 1, device=backend.device)
    i = torch.randint(0, 1000, (10000,), device=backend.device)
    v = torch.ones(10000, 1, device=backend.device)
    got = events(backend, lambda: x.index_put_((i,), v, accumulate=True))
    assert got == [("alloc", 8), ("alloc", 1), ("free_completed", 1), ("free_completed", 8)] * 2 + [
        ("alloc", 80000), ("alloc", 80000), ("free_completed", 80000), ("alloc", 80000), ("alloc", 80000),
        ("alloc", 80000), ("alloc", 167935), ("free_completed", 167935)] + [("free_completed", 80000)] * 4


def test_topk_over_long_rows_splits_each_row_across_blocks(backend):
    x = torch.randn(128, 6000, device=backend.device)
    kept = []
    got = events(backend, lambda: kept.append(torch.topk(x, 1024, dim=-1)))
    made = [512, 1024, 1024, 393216, 131072, 3072, 3072]  # 6 blocks a row (probe_sort, H200)
    assert got == ([("alloc", 524288), ("alloc", 1048576)] + [("alloc", n) for n in made]
                   + [("alloc", 1279), ("free_completed", 1279)] * 2 + [("free_completed", n) for n in reversed(made)])
