"""Tensors on the simulated device: placement, aliasing, lifetime, and ops running unchanged."""

import threading

import pytest
import torch
import torch.nn.functional as F

from graphborrow.allocator.replay_support import block_at
from graphborrow.sim import SimBackend, SimLayoutOnlyError, is_sim_tensor

MiB = 2**20


def block_states(backend):
    return {b["address"]: (b["state"], b["size"]) for s in backend.memory_snapshot() for b in s["blocks"]}


def test_factory_lands_at_the_address_the_allocator_chose(sim):
    x = torch.empty(1000, device="cuda")
    assert is_sim_tensor(x) and x.shape == (1000,)
    address = sim.data_ptr(x)
    block = block_at(sim.allocator, address)
    assert block is not None and block.ptr == address and block.requested_size == 4000
    assert block_states(sim)[address] == ("active_allocated", 4096)
    y = torch.zeros(10, device="cuda")
    assert sim.data_ptr(y) == address + 4096  # best fit cuts the rest of the same segment
    assert x.data_ptr() == address  # Tensor.data_ptr reports the simulated address too


def test_values_live_in_device_memory(sim):
    x = torch.arange(6, dtype=torch.float32, device="cuda")
    raw = sim.memory.host_view(sim.data_ptr(x), 24).view(torch.float32)
    assert raw.tolist() == [0, 1, 2, 3, 4, 5]
    x.mul_(2)
    assert raw.tolist() == [0, 2, 4, 6, 8, 10]


def test_views_share_the_block_and_free_on_last_reference(sim):
    x = torch.randn(64, 32, device="cuda")
    base = sim.data_ptr(x)
    allocated = sim.memory_allocated()
    v = x[3:5]
    r = x.view(32, 64)
    t = x.t()
    d = x.detach()
    assert sim.memory_allocated() == allocated
    assert sim.data_ptr(v) == base + 3 * 32 * 4
    assert sim.data_ptr(r) == sim.data_ptr(t) == sim.data_ptr(d) == base
    del x, r, t, d
    assert block_states(sim)[base][0] == "active_allocated"  # the slice still holds it
    del v
    assert block_states(sim)[base][0] == "inactive"
    assert sim.memory_allocated() == 0


def test_in_place_ops_return_the_same_tensor(sim):
    x = torch.ones(4, device="cuda")
    assert x.add_(1) is x
    out = torch.empty(4, device="cuda")
    assert torch.mul(x, 3, out=out) is out
    assert out.tolist() == [6.0] * 4


def test_ops_match_cpu_results(sim):
    g = torch.Generator().manual_seed(0)
    hx = torch.randn(6, 16, generator=g)
    hw = torch.randn(24, 16, generator=g)
    hidx = torch.tensor([[1], [0], [5], [2], [2], [7]])

    def workload(x, w, idx):
        logits = F.linear(x, w)
        h = F.silu(logits)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        probs = torch.softmax(logits / 0.7, dim=-1)
        top = probs.topk(4, dim=-1)
        srt = probs.sort(dim=-1, descending=True)
        cum = srt.values.cumsum(-1)
        masked = torch.where(cum > 0.9, torch.zeros_like(srt.values), srt.values)
        rep = x.repeat_interleave(2, dim=0)
        picked = probs.gather(1, idx)
        scattered = torch.zeros_like(probs).scatter_(1, idx, 1.0)
        fancy = probs[[0, 2, 4]][:, idx.view(-1)[:3]]
        boolean = probs[probs > 0.1]
        y = (x @ w.t())[1:4].reshape(-1)
        return [h, top.values, top.indices, masked, rep, picked, scattered, fancy, boolean, y]

    with torch.inference_mode():
        expected = workload(hx, hw, hidx)
        got = workload(hx.to("cuda"), hw.cuda(), hidx.to("cuda"))
    for e, o in zip(expected, got):
        assert is_sim_tensor(o)
        assert torch.equal(o.cpu(), e)
    assert sim.memory_allocated() > 0


def test_random_numbers_follow_the_cpu_generator(sim):
    a = torch.rand(5, device="cuda", generator=torch.Generator().manual_seed(3))
    b = torch.rand(5, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a.cpu(), b)
    torch.manual_seed(4)
    c = torch.rand_like(a)
    torch.manual_seed(4)
    assert torch.equal(c.cpu(), torch.rand(5))


def test_host_copies_are_plain_tensors(sim):
    x = torch.tensor([1.5, 2.5], device="cuda")
    for host in (x.cpu(), x.to("cpu"), x.to(torch.device("cpu"), torch.float64)):
        assert type(host) is torch.Tensor and not is_sim_tensor(host)
    host = x.cpu()
    host.zero_()
    assert x.tolist() == [1.5, 2.5]  # a copy, not a view of device memory
    assert x.to("cuda") is x and x.cuda() is x
    assert x.sum().item() == 4.0
    assert "device='sim'" in repr(x)
    assert is_sim_tensor(x.to(torch.float16))
    with pytest.raises(TypeError, match="Tensor.cpu"):
        x.numpy()


def test_unsupported_device_index_is_rejected(sim):
    with pytest.raises(RuntimeError, match="single GPU"):
        torch.empty(3, device="cuda:1")


def test_oom_past_capacity_uses_torch_error():
    backend = SimBackend(capacity=64 * MiB)
    try:
        keep = torch.empty(40 * MiB, dtype=torch.uint8, device="cuda")
        with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory"):
            torch.empty(40 * MiB, dtype=torch.uint8, device="cuda")
        assert backend.mem_get_info()[0] < 64 * MiB
        del keep
    finally:
        backend.close()


def test_layout_only_mode_places_blocks_like_backed_mode():
    """Llama-sized shapes without their bytes (its speed: benchmarks/layout_only.py)."""
    def run(backend):
        with torch.inference_mode():
            x = torch.empty(64, 4096, dtype=torch.bfloat16, device="cuda")
            w = torch.empty(14336, 4096, dtype=torch.bfloat16, device="cuda")
            h = F.silu(x @ w.t())
            head = torch.empty(128256, 4096, dtype=torch.bfloat16, device="cuda")
            logits = x @ head.t()
            probs = logits.float().softmax(-1)
            del h
            top = probs.topk(8, dim=-1)
        return [(b["address"], b["size"], b["state"]) for s in backend.memory_snapshot() for b in s["blocks"]], top

    layout = SimBackend(capacity=80 * 2**30, backed=False)
    try:
        blocks_layout, top = run(layout)
        assert top.indices.shape == (64, 8)
        with pytest.raises(SimLayoutOnlyError, match="backed=True"):
            top.values[0, 0].item()
        with pytest.raises(SimLayoutOnlyError):
            top.values.cpu()
        assert "layout_only" in repr(top.values)
    finally:
        layout.close()
    # the same sequence with real bytes, at shapes a CPU can multiply quickly
    backed = SimBackend(capacity=80 * 2**30, backed=True)
    try:
        with torch.inference_mode():
            x = torch.empty(64, 4096, dtype=torch.bfloat16, device="cuda")
        blocks = [(b["address"], b["size"]) for s in backed.memory_snapshot() for b in s["blocks"]]
        assert blocks[0] == (blocks_layout[0][0], blocks_layout[0][1])
        del x
    finally:
        backed.close()


def test_layout_and_backed_modes_allocate_identical_blocks():
    def run(backend):
        x = torch.randn(48, 96, device="cuda")
        w = torch.randn(300, 96, device="cuda")
        y = (x @ w.t()).softmax(-1)
        z = y[:, :100].contiguous()
        del x
        s = z.sum(0)
        keep = [y, z, s]
        return [(b["address"], b["size"], b["state"]) for s in backend.memory_snapshot() for b in s["blocks"]], keep

    results = []
    for backed in (True, False):
        backend = SimBackend(capacity=2**30, backed=backed)
        try:
            results.append(run(backend)[0])
        finally:
            backend.close()
    assert results[0] == results[1]


def test_tensors_remember_their_device():
    first = SimBackend(capacity=2**30)
    a = torch.ones(3, device="cuda")
    second = SimBackend(capacity=2**30)  # becomes the active one on this thread
    try:
        assert not first.is_active and second.is_active
        b = torch.ones(3, device="cuda")
        assert b.sim_backend is second and a.sim_backend is first
        assert (a * 2).sim_backend is first
        with pytest.raises(RuntimeError, match="two different simulated devices"):
            a + b
        assert first.memory_allocated() == 512 and second.memory_allocated() == 512
    finally:
        second.close()
        first.close()


def test_activation_is_per_thread(sim):
    seen = {}

    def worker():
        try:  # not active here: a CPU build refuses, a GPU machine makes a real CUDA tensor
            seen["inactive"] = is_sim_tensor(torch.empty(3, device="cuda"))
        except (RuntimeError, AssertionError):
            seen["inactive"] = False
        with sim.activated():
            seen["active"] = is_sim_tensor(torch.empty(3, device="cuda"))
        seen["after"] = sim.is_active

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == {"inactive": False, "active": True, "after": False}
    assert sim.is_active


def test_inference_mode_views_and_parameters(sim):
    w = torch.nn.Linear(16, 8, device="cuda")
    assert is_sim_tensor(w.weight)
    with torch.inference_mode():
        x = torch.randn(4, 16, device="cuda")
        y = w(x)
        assert is_sim_tensor(y) and y.shape == (4, 8)
        assert torch.allclose(y.cpu(), F.linear(x.cpu(), w.weight.cpu(), w.bias.cpu()))


# alloc (+) / free_requested (-) sizes of `_mlp_and_sampling` on an H200, torch 2.11.0+cu130,
# recorded with torch.cuda.memory._record_memory_history. The +2048/-2048 pair right after the
# sort's outputs is the small sort's index temporary (arange over the 256-wide rows, int64).
H200_TRACE = [
    65536, 32768, -65536, 1441792, 720896, -1441792, 720896, 360448, -720896, 512, 65536, 65536,
    -65536, 256, -65536, 256, -256, 256, -256, 128, -256, 32768, -128, 32768, -32768, 180224,
    33554432, 90112, 90112, -90112, 32768, -90112, 32768, -32768, 65536, 65536, -65536, 65536,
    -65536, 65536, 131072, 2048, -2048, 65536, 2048, 4096, 131072, 16, 2048, -16, 16384, 4, 65536, -4, -16384,
    256, 8, 2048, 65536, -32768, -180224, 32768, -32768, -720896, -360448, -512, -32768, -65536,
    -65536, -131072, -65536, -2048, -4096, -131072, -2048, -65536, -256, -8, -2048, -65536, -32768,
]


def _mlp_and_sampling(dev):
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        x = torch.randn(64, 256, generator=g).to(dev).to(torch.bfloat16)
        w = torch.randn(1408, 256, generator=g).to(dev).to(torch.bfloat16)
        d = torch.randn(256, 704, generator=g).to(dev).to(torch.bfloat16)
        n = torch.ones(256, device=dev, dtype=torch.bfloat16)
        h = x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5).to(x.dtype) * n
        gu = F.linear(h, w)
        a, b = gu.chunk(2, -1)
        y = x + F.linear(F.silu(a) * b, d)
        p = torch.softmax(y.float() / 0.7, -1)
        s = p.sort(-1, descending=True)
        c = s.values.cumsum(-1)
        t = p.topk(8, -1)
        r = p.repeat_interleave(2, 0)
        i = p[torch.tensor([0, 2], device=dev)]
        m = torch.where(c > 0.9, 0.0, s.values)
        q = torch.rand(64, device=dev)
        k = q.argmax()
        z = p.gather(1, t.indices)
        e = torch.zeros_like(p).scatter_(1, t.indices, 1.0)
        del h, gu, a, b
        u = y.reshape(-1).view(64, 256).t().contiguous()  # noqa: F841 (locals die at return, in order)


def test_allocation_sequence_matches_a_real_h200(sim):
    sim.record_memory_history()
    _mlp_and_sampling("cuda")
    trace = sim.full_snapshot()["device_traces"][0]
    sizes = [e["size"] if e["action"] == "alloc" else -e["size"] for e in trace
             if e["action"] in ("alloc", "free_requested")]
    assert sizes == H200_TRACE
