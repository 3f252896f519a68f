"""CUDA graphs on the simulated device: capture routing, replay in place, pool sharing, reset."""

import pytest
import torch

from graphborrow.sim.host import CAPTURE_INVALIDATED, DEVICES_DIFFER, NOT_PERMITTED

MiB = 2**20


def pools(backend):
    return {s["segment_pool_id"] for s in backend.memory_snapshot()}


def capture_mlp(sim, x, w, pool=None):
    warm = x[:1] @ w  # warm-up: the first matmul makes the cuBLAS handle, which a capture cannot (H200)
    del warm
    g = sim.CUDAGraph()
    with sim.graph(g, pool=pool):
        hidden = x @ w
        out = torch.softmax(hidden, dim=-1)
        del hidden
    return g, out


def test_replay_recomputes_into_the_captured_output(sim):
    x = torch.randn(32, 64, device="cuda")
    w = torch.randn(64, 64, device="cuda")
    g, out = capture_mlp(sim, x, w)
    address = sim.data_ptr(out)
    assert torch.allclose(out.cpu(), torch.softmax(x.cpu() @ w.cpu(), -1))
    x.copy_(torch.randn(32, 64))  # new static input, written in place
    g.replay()
    assert sim.data_ptr(out) == address
    assert torch.allclose(out.cpu(), torch.softmax(x.cpu() @ w.cpu(), -1))


def test_capture_allocates_in_its_private_pool(sim):
    x = torch.randn(32, 64, device="cuda")
    w = torch.randn(64, 64, device="cuda")
    g, out = capture_mlp(sim, x, w)
    assert g.pool()[0] > 0 and g.pool()[1] == 0  # a capture without a pool gets (uid, 0)
    small, workspace = sim.memory_snapshot(g.pool())
    assert {small["segment_pool_id"], workspace["segment_pool_id"]} == {g.pool()}
    states = [b["state"] for b in small["blocks"]]
    assert states.count("active_allocated") == 1  # `out`; `hidden` died inside the capture
    # the capture stream's first matmul made its cuBLAS workspace in the pool (as on an H200)
    assert [(b["size"], b["state"]) for b in workspace["blocks"]] == [(32 * MiB, "active_allocated")]
    segment = small
    after = torch.empty(10, device="cuda")  # outside the capture: default pool again
    assert sim.data_ptr(after) < segment["address"] or sim.data_ptr(after) >= segment["address"] + segment["total_size"]


def test_replay_overwrites_a_later_tensor_in_a_freed_pool_block(sim):
    x = torch.randn(32, 64, device="cuda")
    w = torch.randn(64, 64, device="cuda")
    g1, out = capture_mlp(sim, x, w)
    freed = [b["address"] for s in sim.memory_snapshot(g1.pool()) for b in s["blocks"] if b["state"] == "inactive"]
    g2 = sim.CUDAGraph()
    with sim.graph(g2, pool=g1.pool()):  # shares the pool: reuses `hidden`'s freed block
        keep = torch.zeros(32, 64, device="cuda")
    assert sim.data_ptr(keep) == freed[0]
    keep.fill_(7.0)
    g1.replay()
    assert not keep.cpu().eq(7.0).any()  # the replay wrote `hidden` right over it
    assert torch.equal(keep.cpu(), x.cpu() @ w.cpu())


def test_graphs_share_a_pool_through_a_handle(sim):
    handle = sim.graph_pool_handle()
    x = torch.randn(64, 256, device="cuda")
    w = torch.randn(256, 256, device="cuda")
    graphs, outs = [], []
    for rows in (64, 32, 16):  # largest first, so smaller captures reuse its blocks
        g, out = capture_mlp(sim, x[:rows], w, pool=handle)
        graphs.append(g)
        outs.append(out)
        if rows == 64:
            reserved = sim.memory_reserved()
    assert sim.memory_reserved() == reserved
    assert {s["segment_pool_id"] for s in sim.memory_snapshot(handle)} == {handle}
    for g, out, rows in zip(graphs, outs, (64, 32, 16)):
        x.copy_(torch.randn(64, 256))
        g.replay()
        assert torch.allclose(out.cpu(), torch.softmax(x.cpu()[:rows] @ w.cpu(), -1), atol=1e-6)


def test_reset_releases_the_pool_to_empty_cache(sim):
    x = torch.randn(32, 64, device="cuda")
    baseline = sim.memory_reserved()
    g = sim.CUDAGraph()
    with sim.graph(g):
        tmp = x * 2
        out = torch.softmax(tmp, dim=-1)
        del tmp
    pool = g.pool()
    assert sim.memory_reserved() > baseline
    del out
    sim.empty_cache()
    assert pool in pools(sim)  # the graph still holds its pool
    g.reset()
    sim.empty_cache()
    assert pool not in pools(sim)
    # the RNG's graph-safe seed and offset go with the last graph that registered them (as the
    # H200 frees them when a program's last graph is deleted: data/fuzz, fuzz0001)
    assert sim.memory_reserved() == baseline
    with pytest.raises(RuntimeError, match="without a preceding successful capture"):
        g.replay()


def test_a_captured_blas_workspace_outlives_reset(sim):
    x = torch.randn(32, 64, device="cuda")
    w = torch.randn(64, 64, device="cuda")
    g, out = capture_mlp(sim, x, w)
    del out
    g.reset()
    sim.empty_cache()
    # measured on an H200 (torch 2.11): the 32 MiB segment stays, in the graph's pool
    assert [(s["segment_pool_id"], s["total_size"]) for s in sim.memory_snapshot(g.pool())] == [(g.pool(), 32 * MiB)]


def test_the_first_matmul_inside_a_capture_fails_as_cublas_create_does(sim):
    x = torch.randn(8, 8, device="cuda")
    g = sim.CUDAGraph()
    with pytest.raises(torch.AcceleratorError, match="previous error during capture"):
        with sim.graph(g):
            try:
                x @ x
            except RuntimeError as e:  # cublasCreate needs device memory the capture refuses (data/fuzz)
                assert "CUBLAS_STATUS_NOT_INITIALIZED" in str(e)
                raise
    x @ x  # outside a capture the handle is made, and later captures may matmul
    with sim.graph(sim.CUDAGraph()):
        x @ x


def test_capture_errors_are_clear(sim):
    g = sim.CUDAGraph()
    with pytest.raises(RuntimeError, match="non-default stream"):
        g.capture_begin()
    with pytest.raises(RuntimeError, match="without a preceding successful capture"):
        g.replay()
    x = torch.randn(8, device="cuda")
    host = torch.randn(8)
    with pytest.raises(RuntimeError, match=DEVICES_DIFFER):
        with sim.graph(sim.CUDAGraph()):
            x + host
    for wait in (lambda: (x * 2).sum().item(), sim.synchronize):
        # a host wait invalidates the capture: leaving it fails, raised while handling the first error
        with pytest.raises(torch.AcceleratorError, match=CAPTURE_INVALIDATED) as failed:
            with sim.graph(sim.CUDAGraph()):
                wait()
        assert str(failed.value.__context__) == NOT_PERMITTED
    assert sim.allocator.captures_underway == []  # failed captures ended their routing
    assert sim.current_stream().id == 0
    with pytest.raises(TypeError, match="simulated CUDAGraph"):
        sim.graph(object())
    g2 = sim.CUDAGraph()
    with sim.graph(g2):
        y = x * 2
    with pytest.raises(RuntimeError, match="already owns a captured graph"):
        with sim.graph(g2):
            pass
    del y


def test_capture_synchronises_and_empties_the_cache_first(sim):
    side = sim.Stream()
    sim.sleep(side, 100.0)
    junk = torch.empty(5 * MiB, dtype=torch.uint8, device="cuda")
    del junk
    assert sim.memory_reserved() == 20 * MiB
    g = sim.CUDAGraph()
    with sim.graph(g):
        assert side.query()
        assert 20 * MiB not in [s["total_size"] for s in sim.memory_snapshot()]
        y = torch.ones(4, device="cuda")
    assert y.tolist() == [1.0] * 4


def test_factories_and_in_place_ops_replay(sim):
    counter = torch.zeros(4, device="cuda")
    g = sim.CUDAGraph()
    with sim.graph(g):
        counter.add_(1)
        fresh = torch.full((4,), 2.0, device="cuda")
        total = counter * fresh
    for _ in range(3):
        g.replay()
    assert counter.tolist() == [4.0] * 4
    assert total.tolist() == [8.0] * 4
