"""Dtype and storage semantics of every conversion path, on both kinds of simulated device.

Each conversion must leave the storage torch gives it (a bfloat16 weight in a block of half
the float32 one) and free the old block when torch would; the allocation sequences here are
those the H200 recorded for the same code (data/fuzz: the module conversions of the fuzz
programs and the ``fp32`` model scripts agree event for event).
"""

import pytest
import torch
import torch.nn as nn

from graphborrow.sim import SimBackend

MODES = [pytest.param(True, id="backed"), pytest.param(False, id="layout-only")]


@pytest.fixture(params=MODES)
def device(request):
    backend = SimBackend(backed=request.param, capacity=2**32)
    yield backend
    backend.close()


def live_blocks(backend) -> list[int]:
    return sorted(b["size"] for s in backend.memory_snapshot() for b in s["blocks"] if b["state"] == "active_allocated")


def test_linear_to_bfloat16_moves_its_weight_into_a_half_size_block(device):
    with torch.device("cuda"):
        lin = nn.Linear(64, 32)
    assert live_blocks(device) == [512, 8192]  # float32 weight, bias
    lin.to(torch.bfloat16)
    assert lin.weight.dtype == lin.weight.sim_inner.dtype == torch.bfloat16
    assert lin.weight.sim_storage.nbytes == 4096 and live_blocks(device) == [512, 4096]  # the old blocks are free
    out = lin(torch.zeros(4, 64, dtype=torch.bfloat16, device="cuda"))
    assert out.dtype == torch.bfloat16


@pytest.mark.parametrize("convert, dtype", [
    (lambda m: m.half(), torch.float16),
    (lambda m: m.bfloat16(), torch.bfloat16),
    (lambda m: m.float(), torch.float32),
    (lambda m: m.type(torch.float16), torch.float16),
    (lambda m: m.to(device="cuda", dtype=torch.bfloat16), torch.bfloat16),
])
def test_every_module_conversion_gives_torchs_storage(device, convert, dtype):
    with torch.device("cuda"):
        mlp = nn.Sequential(nn.Linear(256, 512), nn.SiLU(), nn.Linear(512, 256)).to(torch.float64)
    convert(mlp)
    for p in mlp.parameters():
        assert p.dtype == p.sim_inner.dtype == dtype
        assert p.sim_storage.nbytes == p.numel() * p.element_size()
    expected = sorted(max(512, -(-p.numel() * p.element_size() // 512) * 512) for p in mlp.parameters())
    assert live_blocks(device) == expected


def test_param_data_assignment_frees_the_old_storage(device):
    with torch.device("cuda"):
        lin = nn.Linear(1024, 1024, bias=False)
    lin.weight.data = lin.weight.data.to(torch.float16)
    assert lin.weight.dtype == torch.float16 and live_blocks(device) == [2 * 2**20]
    with pytest.raises(RuntimeError, match="move it with"):
        lin.weight.data = torch.zeros(4)


def test_a_host_module_moved_with_a_dtype_converts_on_the_host(device):
    lin = nn.Linear(256, 256)
    lin.to("cuda", torch.bfloat16)
    assert lin.weight.device.type == "cuda" and lin.weight.dtype == torch.bfloat16
    assert live_blocks(device) == [512, 256 * 256 * 2]  # one bfloat16 copy each, no float32 block on the device


def test_tensor_conversions_copy_views_and_keep_layouts(device):
    x = torch.ones(64, 128, device="cuda")
    assert x.to(torch.float32) is x  # nothing to convert: the same tensor, as torch gives it
    t = x.t().to(torch.bfloat16)
    assert t.dtype == torch.bfloat16 and t.stride() == (1, 128)  # a dense layout is preserved
    c = t.contiguous()
    assert c.stride() == (64, 1) and c.sim_storage is not t.sim_storage
    v = x.view(torch.int32)
    assert v.sim_storage is x.sim_storage and v.dtype == torch.int32
    half = torch.empty(64, 128, dtype=torch.float16, device="cuda")
    assert half.copy_(x) is half and half.dtype == torch.float16


def test_set_gives_a_tensor_another_storage(device):
    a = torch.zeros(16, device="cuda")
    b = torch.ones(4, 4, device="cuda")
    a.set_(b)
    assert a.shape == (4, 4) and a.sim_storage is b.sim_storage
    a.unsqueeze_(0)
    assert a.shape == (1, 4, 4) and a.sim_inner.shape == (1, 4, 4)


def test_a_tensor_set_onto_a_simulated_storage_is_refused_by_name_not_a_crash(device):
    with torch.device("cuda"):
        t = torch.ones(1024)
        storage = t.untyped_storage()  # the wrapper's placeholder, not the block in device memory
        for call in (lambda: torch.empty(0).set_(storage), lambda: torch.empty(0).set_(storage, 0, (4,), (1,))):
            with pytest.raises(NotImplementedError,
                               match=r"set_\(storage\) onto a simulated CUDA tensor .* set_\(other_tensor\)"):
                call()
        shared = torch.empty(0).set_(t)  # a tensor as the source is simulated
    assert shared.data_ptr() == t.data_ptr()
    if device.backed:
        assert shared[:4].tolist() == [1.0] * 4

