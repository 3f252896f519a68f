"""SimBackend: the CudaBackend API on the simulated device (streams, pools, snapshots, arena)."""

import pickle
import threading

import pytest
import torch

from graphborrow.fidelity.replay import load_trace
from graphborrow.sim import SimBackend, is_sim_tensor

MiB = 2**20


def state_at(backend, address, pool_id=None):
    for segment in backend.memory_snapshot(pool_id):
        for block in segment["blocks"]:
            if block["address"] == address:
                return block["state"]
    return None


def segment_of(backend, address):
    for segment in backend.memory_snapshot():
        if segment["address"] <= address < segment["address"] + segment["total_size"]:
            return segment
    return None


def test_streams_are_thread_local_contexts(sim):
    side = sim.Stream()
    assert sim.current_stream() is sim.clock.default_stream
    with sim.stream(side):
        assert sim.current_stream() is side and sim.current_stream_key() == side.id
        x = torch.empty(10, device="cuda")
    assert sim.current_stream().id == 0
    assert segment_of(sim, sim.data_ptr(x))["stream"] == side.id
    y = torch.empty(10, device="cuda")
    assert segment_of(sim, sim.data_ptr(y))["stream"] == 0  # blocks never cross streams
    with pytest.raises(TypeError, match="simulated Stream"):
        sim.stream(object())


def test_record_stream_defers_the_free_until_the_stream_catches_up(sim):
    side = sim.Stream()
    x = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")
    address = sim.data_ptr(x)
    sim.sleep(side, 500.0)
    sim.record_stream(x, side)
    del x
    assert state_at(sim, address) == "active_pending_free"
    sim.touch()  # the side stream is still busy: the event has not completed
    assert state_at(sim, address) == "active_pending_free"
    assert sim.memory_allocated() == 0  # allocated_bytes dropped at free_requested
    sim.synchronize()
    assert state_at(sim, address) == "active_pending_free"  # nothing processes events yet
    sim.touch()
    assert state_at(sim, address) == "inactive"


def test_events_complete_with_their_stream(sim):
    side = sim.Stream()
    x = torch.ones(100, device="cuda")
    sim.sleep(side, 50.0)
    sim.record_stream(x, side)
    event = sim.Event()
    event.record(side)
    assert not event.query()
    address = sim.data_ptr(x)
    del x
    assert state_at(sim, address) == "active_pending_free"
    event.synchronize()
    assert event.query()
    sim.touch()
    assert state_at(sim, address) == "inactive"


def test_use_mem_pool_routes_only_the_calling_thread(sim):
    pool = sim.MemPool()
    seen = {}

    def worker():
        with sim.activated():
            seen["tensor"] = torch.empty(1000, device="cuda")

    with sim.use_mem_pool(pool):
        mine = torch.empty(1000, device="cuda")
        t = threading.Thread(target=worker)
        t.start()
        t.join()
    after = torch.empty(1000, device="cuda")
    assert segment_of(sim, sim.data_ptr(mine))["segment_pool_id"] == pool.id
    assert segment_of(sim, sim.data_ptr(seen["tensor"]))["segment_pool_id"] == (0, 0)
    assert segment_of(sim, sim.data_ptr(after))["segment_pool_id"] == (0, 0)
    assert [s["address"] for s in pool.snapshot()] == [segment_of(sim, sim.data_ptr(mine))["address"]]
    assert sim.pool_id(pool) == pool.id and pool.id[0] == 0 and pool.id[1] > 0


def test_closing_a_mem_pool_returns_its_memory(sim):
    pool = sim.MemPool()
    with sim.use_mem_pool(pool):
        x = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")
    del x
    assert sim.memory_reserved() == 20 * MiB
    pool.close()
    assert sim.memory_reserved() == 0
    assert sim.mem_get_info()[0] == 2**30


def test_mem_get_info_counts_segments_and_oom_names_the_request():
    backend = SimBackend(capacity=100 * MiB)
    try:
        assert backend.mem_get_info() == (100 * MiB, 100 * MiB)
        a = torch.empty(30 * MiB, dtype=torch.uint8, device="cuda")
        assert backend.mem_get_info()[0] == 70 * MiB
        with pytest.raises(torch.OutOfMemoryError, match=r"Tried to allocate 80\.00 MiB"):
            torch.empty(80 * MiB, dtype=torch.uint8, device="cuda")
        del a
        backend.empty_cache()
        assert backend.mem_get_info()[0] == 100 * MiB
    finally:
        backend.close()


def test_arena_pool_places_tensors_inside_the_extents(sim):
    from graphborrow.core.arena import BumpArena

    buffer = sim.external_alloc(8 * MiB)
    arena = BumpArena()
    arena.set_extents([(buffer.address + 2 * MiB, 4 * MiB)])
    pool = sim.arena_pool(arena)
    with sim.use_mem_pool(pool):
        a = torch.full((1000,), 3.0, device="cuda")
        b = torch.empty(200_000, dtype=torch.uint8, device="cuda")
    for t in (a, b):
        assert buffer.address + 2 * MiB <= sim.data_ptr(t) < buffer.address + 6 * MiB
    assert arena.cursor_bytes == 2 * MiB  # one small segment asked of the arena
    view = sim.memory.host_view(sim.data_ptr(a), 4000).view(torch.float32)
    assert view.eq(3.0).all()  # the arena's bytes are the external buffer's bytes
    del a, b, t
    pool.close()
    assert arena.freed_bytes == 2 * MiB
    buffer.free()


def test_stats_snapshot_and_memory_viz_file(sim, tmp_path):
    sim.record_memory_history(max_entries=1000)
    x = torch.randn(1000, device="cuda")
    y = x * 2
    del x
    stats = sim.memory_stats()
    assert stats["allocated_bytes.all.current"] == sim.memory_allocated() == 4096
    assert stats["reserved_bytes.all.current"] == sim.memory_reserved() == 2 * MiB
    path = tmp_path / "snap.pickle"
    assert sim.dump_snapshot(path)["segments"] == pickle.loads(path.read_bytes())["segments"]
    raw = open(path, "rb").read()
    assert raw[:2] == b"\x80\x04"  # pickle protocol 4
    snap = pickle.loads(raw)
    assert set(snap) >= {"segments", "device_traces", "allocator_settings"}
    actions = [e["action"] for e in snap["device_traces"][0]]
    assert actions[:3] == ["segment_alloc", "alloc", "alloc"]
    assert "free_requested" in actions and "free_completed" in actions
    assert load_trace(path)["segments"][0]["blocks"][1]["size"] == 4096
    del y


def test_describe_and_repr(sim):
    assert "simulated" in sim.describe() and ("real bytes" in sim.describe()) == sim.backed
    layout = SimBackend(capacity=2**30, backed=False)
    try:
        assert "layout only" in layout.describe()
        assert is_sim_tensor(torch.empty(3, device="cuda"))
    finally:
        layout.close()


def test_exported_snapshot_opens_in_pytorchs_memory_viz(sim, tmp_path):
    """torch.cuda._memory_viz (what `python -m torch.cuda._memory_viz` and the HTML viewer use)
    reads the simulated device's pickle like one from a GPU."""
    from torch.cuda import _memory_viz

    sim.record_memory_history(max_entries=1000)
    keep = torch.ones(3 * MiB // 4, device="cuda")
    tmp = keep * 2
    del tmp
    path = tmp_path / "viz.pickle"
    sim.dump_snapshot(path)
    with open(path, "rb") as f:
        data = pickle.load(f)
    summary = _memory_viz.segsum(data)
    assert "segments: 1" in summary and "total_reserved: 20.0MiB" in summary
    assert "total_allocated: 3.0MiB" in summary
    events = _memory_viz.trace(data)
    assert "cudaMalloc" in events and "del" in events
    html = _memory_viz.trace_plot(data)
    assert "<html" in html.lower() or "<script" in html.lower()
    del keep


def test_storages_collected_in_one_cycle_are_each_freed_once(sim):
    """A garbage collection clears the storages' weak references before their finalizers run, so
    a free between two finalizers frees the second block through its owner record first."""
    import gc
    import sys

    class Node:
        pass

    unraisable, hook = [], sys.unraisablehook
    sys.unraisablehook = unraisable.append
    try:
        node = Node()
        node.me, node.a, node.b = node, torch.empty(128, device="cuda"), torch.empty(128, device="cuda")
        del node
        gc.collect()
    finally:
        sys.unraisablehook = hook
    assert [str(u.exc_value) for u in unraisable] == [] and sim.memory_allocated() == 0
