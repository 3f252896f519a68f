"""A borrow's setup fails at every allocator call in turn, and the state is exactly as before.

Entering ``state.borrow()`` builds the borrow pool: a fresh arena over the runs, a MemPool on
it, and one precarved segment per large run (each a pluggable-allocator call and a view of
device memory). Each of those calls is refused in turn, at the boundary the simulated device
really crosses: the pool's pluggable allocator returns 0 (out of memory, as torch's contract
has it), or the device memory behind a segment raises (memory never mapped: a static run
outside the device). After every refusal the borrow state and the device must be exactly as
they were before the borrow, and the next borrow must place its tensors where a state that
never failed places them.
"""

from __future__ import annotations

import pytest
import torch
from conftest import Ladder

from graphborrow.core.borrow import BorrowState
from graphborrow.sim import SimBackend

MiB = 1 << 20
SMALL_PRECARVE = dict(precarve_reserve=2 * MiB, precarve_min=10 * MiB)  # every run here gets a seed


class Boundary:
    """Counts the calls crossing one allocator boundary and refuses the ``fail_at``-th (1-based)."""

    def __init__(self) -> None:
        self.calls, self.fail_at = 0, None

    def refuses(self) -> bool:
        self.calls += 1
        return self.calls == self.fail_at


class RefusingAllocator:
    """The borrow pool's pluggable allocator: the real arena, except for the refused call."""

    def __init__(self, arena, boundary: Boundary) -> None:
        self.arena, self.boundary = arena, boundary

    def raw_alloc(self, nbytes: int, stream: int = 0) -> int:
        return 0 if self.boundary.refuses() else self.arena.raw_alloc(nbytes, stream)

    def raw_delete(self, address: int, nbytes: int, stream: int = 0) -> None:
        self.arena.raw_delete(address, nbytes, stream)


def guarded_device() -> tuple[SimBackend, dict[str, Boundary]]:
    """A simulated device whose borrow pools' allocator and whose memory views count their calls."""
    sim = SimBackend(capacity=1 << 30)
    boundaries = {"pluggable allocator": Boundary(), "device memory": Boundary()}
    real_pool, real_view = sim.arena_pool, sim.memory.host_view

    def arena_pool(arena):
        return real_pool(RefusingAllocator(arena, boundaries["pluggable allocator"]))

    def host_view(address: int, nbytes: int):
        if boundaries["device memory"].refuses():
            raise ValueError(f"[{address:#x}, {address + nbytes:#x}) is not mapped (refused on purpose)")
        return real_view(address, nbytes)

    sim.arena_pool, sim.memory.host_view = arena_pool, host_view
    return sim, boundaries


def static_runs(sim):
    """Two external runs, each large enough for a precarved seed."""
    buffers = [sim.external_alloc(16 * MiB), sim.external_alloc(12 * MiB)]
    state = BorrowState(sim, **SMALL_PRECARVE)
    state.set_static_runs([(b.address, b.nbytes) for b in buffers])
    return state, buffers


def graph_pool(sim):
    """Runs left in a graph pool by two captures (their intermediates)."""
    state = BorrowState(sim, pool_id=sim.graph_pool_handle(), **SMALL_PRECARVE)
    return state, Ladder(sim, state, sizes_mib=(16, 12))


def rebuilt_after_retire(sim):
    """A state whose first pool was used and retired: the failed build must keep its arena and counters."""
    state, keep = static_runs(sim)
    with sim.activated(), state.borrow("first"):
        t = torch.ones(3 * MiB // 4, device="cuda")
        del t
    state.retire()
    return state, keep


SCENARIOS = {"static runs": static_runs, "graph pool": graph_pool, "rebuild after retire": rebuilt_after_retire}


def observe(state: BorrowState, sim: SimBackend) -> dict:
    """Everything the state holds and reports, and the device's allocator state."""
    return {
        "holder": state.holder, "enabled": state.enabled, "arena": state.arena, "pool": state.mem_pool,
        "stream": state.stream, "stream_key": state.stream_key, "builds": state.builds,
        "static_runs": state.static_runs, "check_pending": state.check_pending, "runs": state.free_runs(),
        "stats": state.stats(), "routing": state._routing,
        "segments": sim.memory_snapshot(), "allocated": sim.memory_allocated(), "reserved": sim.memory_reserved(),
    }


def borrow_and_place(state: BorrowState, sim: SimBackend) -> list[int]:
    """One borrow whose tensors span a seed and a fresh segment; where they landed."""
    with sim.activated(), state.borrow("step"):
        held = [torch.ones(n // 4, device="cuda") for n in (5 * MiB, 512, 2 * MiB)]
        placed = [sim.data_ptr(t) for t in held]
        del held
    return placed


def setup_calls(scenario) -> dict[str, int]:
    """How many calls cross each boundary while a borrow is entered (no refusal)."""
    sim, boundaries = guarded_device()
    try:
        state, _keep = scenario(sim)
        for b in boundaries.values():
            b.calls = 0
        with state.borrow("count"):
            counted = {name: b.calls for name, b in boundaries.items()}
        return counted
    finally:
        sim.close()


def cases():
    for name, scenario in SCENARIOS.items():
        for boundary, calls in setup_calls(scenario).items():
            for k in range(1, calls + 1):
                yield pytest.param(scenario, boundary, k, id=f"{name}-{boundary}-call{k}")


@pytest.mark.parametrize("scenario, boundary, k", list(cases()))
def test_a_refused_call_in_a_borrows_setup_leaves_everything_as_it_was(scenario, boundary, k):
    sim, boundaries = guarded_device()
    twin = None
    try:
        state, _keep = scenario(sim)
        before = observe(state, sim)
        boundaries[boundary].calls, boundaries[boundary].fail_at = 0, k
        with pytest.raises((torch.OutOfMemoryError, ValueError)) as refused:
            with state.borrow("refused"):
                pytest.fail("the borrow's setup was refused; its body must not run")
        assert boundaries[boundary].calls == k, "the refusal happened inside the setup"
        # checked while the error and its traceback are still held, as a notebook holds the last one
        assert refused.value.__traceback__ is not None and observe(state, sim) == before
        del refused
        boundaries[boundary].fail_at = None
        twin = SimBackend(capacity=1 << 30)
        twin_state, _twin_keep = scenario(twin)
        assert borrow_and_place(state, sim) == borrow_and_place(twin_state, twin)
        assert state.builds == twin_state.builds and state.stats() == twin_state.stats()
    finally:
        sim.close()
        if twin is not None:
            twin.close()


def test_every_scenario_crosses_both_boundaries_in_its_setup():
    """The loop above is not vacuous: each setup makes pluggable calls and memory views."""
    for name, scenario in SCENARIOS.items():
        calls = setup_calls(scenario)
        assert calls["pluggable allocator"] >= 2 and calls["device memory"] >= 2, (name, calls)


def test_a_static_run_outside_device_memory_fails_the_borrow_and_leaves_no_block_behind():
    """Issue 24, bad case 3: memory the device never mapped. The borrow fails, and afterwards
    nothing is held: retire, capture, new static runs and clearing them all work."""
    sim = SimBackend(capacity=1 << 30)
    try:
        state = BorrowState(sim)
        state.set_static_runs([(0x1000_0000_0000, 64 * MiB)])
        with pytest.raises(ValueError, match="does not lie inside one cudaMalloc'd range"):
            with state.borrow("probe"):
                torch.empty(256, device="cuda")
        assert state.live_borrowed_bytes() == 0 and state.holder is None
        assert state.retire().built
        with state.capture_scope():
            pass
        buffer = sim.external_alloc(8 * MiB)
        state.set_static_runs([(buffer.address, buffer.nbytes)])
        with state.borrow("after"):
            t = torch.ones(256, device="cuda")
            assert buffer.address <= sim.data_ptr(t) < buffer.address + buffer.nbytes
            del t
        state.clear_static_runs()
        state.disable("done")
    finally:
        sim.close()
