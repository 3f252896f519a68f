"""The borrow story on a device: the real GPU (marked ``gpu``) and its simulated twin.

Every test runs twice with the same assertions: on the simulated device in CI, and on a
CUDA device with ``pytest -m gpu tests/core/test_borrow_device.py``.
"""

import gc
import sys

import pytest
import torch

from graphborrow.core.borrow import BorrowState
from graphborrow.core.errors import BorrowLeakError, PoolBusyError, WrongStreamError
from graphborrow.core.sizes import format_size

pytestmark = pytest.mark.slow

MiB = 1 << 20


def inside(ptr, nbytes, runs):
    return any(a <= ptr and ptr + nbytes <= a + n for a, n in runs)


def test_borrowed_tensors_lie_inside_runs_and_never_overlap(ladder):
    backend, state = ladder.backend, ladder.state
    runs = state.free_runs()
    assert len(runs) >= 2 and runs[0][1] >= 96 * MiB
    with state.borrow("test"):
        a = torch.empty(40 * MiB, dtype=torch.uint8, device=backend.device)
        b = torch.empty(20 * MiB, dtype=torch.uint8, device=backend.device)
        spans = sorted((backend.data_ptr(t), backend.data_ptr(t) + t.numel()) for t in (a, b))
        assert all(inside(p, e - p, runs) for p, e in spans)
        assert spans[0][1] <= spans[1][0]
        first = backend.data_ptr(a)
        del a, b
        again = torch.empty(40 * MiB, dtype=torch.uint8, device=backend.device)
        assert backend.data_ptr(again) == first  # the pool's cache reuses freed blocks
        del again
    ladder.replay()


def test_borrowing_costs_no_physical_memory_while_plain_allocation_does(ladder):
    backend, state = ladder.backend, ladder.state
    nbytes = 64 * MiB
    backend.synchronize()
    free0, _ = backend.mem_get_info()
    with state.borrow("test"):
        t = torch.empty(nbytes, dtype=torch.uint8, device=backend.device)
        t.fill_(1)
        backend.synchronize()
        free_borrowed, _ = backend.mem_get_info()
        del t
    assert free0 - free_borrowed <= 2 * MiB  # no new device memory (at most one small segment for bookkeeping)
    reserved_before = backend.memory_reserved()
    plain = torch.empty(nbytes, dtype=torch.uint8, device=backend.device)
    backend.synchronize()
    free_plain, _ = backend.mem_get_info()
    assert free0 - free_plain >= nbytes
    assert backend.memory_reserved() - reserved_before >= nbytes
    del plain


def test_replay_inside_a_borrow_raises_and_does_not_replay(ladder):
    backend, state = ladder.backend, ladder.state
    x = ladder.inputs[0]
    ladder.replay()  # capture records work, it does not run it
    assert ladder.outputs[0].cpu().tolist() == [3.0] * 8
    x.fill_(5)  # a replay would make out == 11
    with state.borrow("test"):
        with pytest.raises(PoolBusyError, match="held by 'test'"):
            ladder.replay()
    backend.synchronize()
    assert ladder.outputs[0].cpu().tolist() == [3.0] * 8
    ladder.replay()
    assert ladder.outputs[0].cpu().tolist() == [11.0] * 8


def test_capture_and_nested_borrow_are_mutually_exclusive(ladder):
    state = ladder.state
    with state.borrow("outer"):
        with pytest.raises(PoolBusyError, match="cannot start 'inner'"):
            with state.borrow("inner"):
                pass
        with pytest.raises(PoolBusyError, match="CUDA graph capture"):
            with state.capture_scope():
                pass
    assert state.holder is None


def test_a_leaked_tensor_makes_replay_raise_until_released(ladder):
    backend, state = ladder.backend, ladder.state
    with state.borrow("test"):
        leaked = torch.ones(MiB, dtype=torch.uint8, device=backend.device)
    with pytest.raises(BorrowLeakError, match=r"leak at graph replay: 1024.00 KiB \(1048576 bytes\) borrowed .* "
                                               r"still referenced, and graph replay would overwrite them"):
        ladder.replay()
    with pytest.raises(BorrowLeakError):  # stays refused while the tensor lives
        ladder.replay()
    del leaked
    gc.collect()
    ladder.replay()


def test_an_escaped_borrow_is_overwritten_by_replay(ladder):
    """Why the leak check exists: replay writes into the runs the borrow used."""
    backend, state = ladder.backend, ladder.state
    with state.borrow("test"):
        escaped = torch.zeros(96 * MiB // 4, device=backend.device)
    backend.synchronize()
    assert escaped.sum().item() == 0
    ladder.graphs[0].replay()  # bypassing replay_scope on purpose
    backend.synchronize()
    assert escaped.abs().sum().item() > 0
    del escaped


def test_borrowing_on_another_stream_raises_and_frees_the_slot(ladder):
    backend, state = ladder.backend, ladder.state
    with state.borrow("test"):
        pass
    side = backend.Stream()
    with backend.stream(side):
        with pytest.raises(WrongStreamError, match="built on stream"):
            with state.borrow("other stream"):
                pass
    assert state.holder is None
    state.retire()
    with backend.stream(side):
        with state.borrow("rebuilt"):
            t = torch.empty(MiB, dtype=torch.uint8, device=backend.device)
            assert inside(backend.data_ptr(t), MiB, state.free_runs())
            del t
    assert state.stream == side


def test_oversized_borrow_raises_oom_then_plain_allocation_works_after_disable(ladder):
    backend, state = ladder.backend, ladder.state
    too_big = 2 * state.largest_run()
    assert not state.can_fit(too_big)
    with pytest.raises(backend.OutOfMemoryError) as refused:
        with state.borrow("test"):
            torch.empty(too_big, dtype=torch.uint8, device=backend.device)
    if sys.version_info >= (3, 11):  # the note says the borrow pool is full, not the device
        assert any(note.startswith("graphborrow: inside 'test' every allocation comes from the borrow pool, whose "
                                   f"largest free run is {format_size(state.largest_run())}")
                   for note in refused.value.__notes__)
    gc.collect()
    state.disable("oversized request: fall back to plain allocation")
    assert not state.enabled and state.mem_pool is None
    with state.borrow("disabled"):  # a true no-op
        t = torch.empty(too_big, dtype=torch.uint8, device=backend.device)
    assert t.numel() == too_big
    del t


def test_record_stream_frees_drain_before_retirement(ladder):
    backend, state = ladder.backend, ladder.state
    side = backend.Stream()
    with state.borrow("test"):
        t = torch.ones(16 * MiB, dtype=torch.uint8, device=backend.device)
        backend.sleep(side, 200_000)  # keep the side stream busy for ~0.2 s
        backend.record_stream(t, side)
        del t
    pool_id = backend.pool_id(state.mem_pool)
    states = [b["state"] for s in backend.memory_snapshot(pool_id) for b in s["blocks"]]
    assert "active_pending_free" in states
    arena = state.arena
    state.retire()
    assert state.mem_pool is None
    assert arena.freed_bytes > 0  # every segment went back to the arena
    gc.collect()
    ladder.replay()


def test_capture_retires_the_borrow_pool(ladder):
    backend, state = ladder.backend, ladder.state
    with state.borrow("test"):
        t = torch.empty(MiB, dtype=torch.uint8, device=backend.device)
        del t
    arena = state.arena
    assert state.mem_pool is not None
    x = torch.ones(MiB, device=backend.device)
    g = backend.CUDAGraph()
    with state.capture_scope(), backend.graph(g, pool=state.pool_id):
        y = x * 3
    assert state.mem_pool is None and arena.freed_bytes > 0
    g.replay()
    backend.synchronize()
    assert y[:4].cpu().tolist() == [3.0] * 4


def test_static_runs_serve_without_a_snapshot(backend):
    storage = backend.external_alloc(64 * MiB)  # storage the caching allocator does not manage
    base = storage.address
    state = BorrowState(backend)  # no graph pool at all
    assert not state.enabled
    state.set_static_runs([(base, 64 * MiB)])
    assert state.enabled and state.largest_run() == 64 * MiB
    with state.borrow("static"):
        t = torch.empty(16 * MiB, dtype=torch.uint8, device=backend.device)
        assert base <= backend.data_ptr(t) < base + 64 * MiB
        del t
    state.set_static_runs([])
    assert not state.enabled
    storage.free()


def test_static_runs_over_a_live_tensor_are_refused(backend):
    live = torch.empty(4 * MiB, dtype=torch.uint8, device=backend.device)
    state = BorrowState(backend)
    with pytest.raises(ValueError, match="overlaps a live tensor"):
        state.set_static_runs([(backend.data_ptr(live), 4 * MiB)])
    assert not state.enabled
    del live


def test_pool_is_rebuilt_when_the_arena_reports_freed_bytes(ladder):
    backend, state = ladder.backend, ladder.state
    with state.borrow("test"):
        t = torch.empty(MiB, dtype=torch.uint8, device=backend.device)
        del t
    assert state.builds == 1
    with state.borrow("still cached"):
        pass
    assert state.builds == 1
    # what the arena sees when the caching layer releases a segment back to it
    extra = state.arena.malloc(2 * MiB)
    state.arena.free(extra, 2 * MiB)
    assert state.stats()["freed_bytes"] == 2 * MiB
    with state.borrow("after a release"):
        pass
    assert state.builds == 2 and state.arena.freed_bytes == 0
