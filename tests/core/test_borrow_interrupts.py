"""Scopes under asynchronous interrupts, and the scope misuses that used to pass silently.

The stress tests fire a signal whose handler raises KeyboardInterrupt at a random
place of a decode-like step (borrow, allocate, compute, free, replay, sometimes retire)
on the simulated device, hundreds of times, and after every step checks that the state
is usable: slot free, routing off, no phantom bytes, the allocator's free lists and
statistics intact, the arena clean, replay and retire working. ``make test`` runs the one
that interrupts at a seeded random instruction (the same places every run); the timer storms,
whose landings depend on the machine's pace, run in ``make test-deep``, and ``make deep``
runs them all 50x longer.
"""

import dis
import gc
import random
import signal
import sys
import threading
import time

import pytest
import torch
from conftest import deep_factor

from graphborrow.allocator import compiled
from graphborrow.allocator.replay_support import block_at
from graphborrow.core import interrupts
from graphborrow.core.borrow import BorrowState
from graphborrow.core.errors import EmptyGraphPoolError, PoolBusyError
from graphborrow.sim import SimBackend
from graphborrow.sim import device as sim_device

pytestmark = pytest.mark.slow

MiB = 1 << 20


def _pure_allocator_module():
    return compiled.pure_model()


@pytest.fixture
def dropped(monkeypatch):
    """Count exceptions CPython drops in finalizers, and drop them as its default hook does.

    A Ctrl-C that lands in a tensor's finalizer before its critical section starts is
    dropped by CPython (printed, by default). pytest's own hook keeps the exception, and
    with it the frames above the finalizer and the borrowed tensors in them, to report it
    later: that would look like a borrow leak the library never made.
    """
    dropped = []
    monkeypatch.setattr(sys, "unraisablehook", lambda info: dropped.append(info.exc_type))
    return dropped


@pytest.fixture(params=["as installed", "pure Python"])
def device(request, monkeypatch, dropped):
    """A simulated device running the installed allocator model, and one running pure Python
    (the compiled one has fewer places where a signal handler can run)."""
    if request.param == "pure Python":
        monkeypatch.setattr(sim_device, "CachingAllocator", _pure_allocator_module().CachingAllocator)
    backend = SimBackend(capacity=2**30)
    yield backend
    gc.collect()
    backend.close()


def capture_ladder(backend, state):
    graphs, keep = [], []
    for nbytes in (5 * MiB // 4, 9 * MiB // 8):  # large-pool tensors: their 20 MiB segment is left idle
        x = torch.ones(nbytes // 4, device="cuda")
        g = backend.CUDAGraph()
        with state.capture_scope(), backend.graph(g, pool=state.pool_id):
            t = x * 2
            u = t + 1
            out = u[:8].clone()
            del t, u
        graphs.append(g)
        keep += [x, out]
    backend.synchronize()
    return graphs, keep


def step(backend, state, graphs, rng):
    """Mostly scope and allocator work, where the critical sections are."""
    with state.borrow("verify"):
        for _ in range(3):
            a = torch.empty(rng.choice((256, 4096, 70_000)), device="cuda")
            b = torch.empty(rng.choice((512, 300_000, 900_000)), dtype=torch.uint8, device="cuda")
            del a, b
        x = torch.ones(16, 16, device="cuda")
        y = (x + 1).sum()
        del x, y
    with state.replay_scope():
        graphs[rng.randrange(len(graphs))].replay()
    if rng.random() < 0.1:
        state.retire()


def settle():
    """Let a signal carried past a scope's entry or a finalizer arrive (it is posted shortly)."""
    deadline = time.perf_counter() + 5.0
    count = 0
    while True:
        try:
            while time.perf_counter() < deadline:
                stats = interrupts.gate_stats()
                if not (stats["waiting"] or stats["posting"]):
                    break
                time.sleep(0.001)
            time.sleep(0.002)
            return count
        except KeyboardInterrupt:
            count = 1


class OneInterruptPerStep:
    """The SIGALRM handler of the storms: KeyboardInterrupt at most once per step, and only
    while the step is armed, so it is raised inside the step's ``try``.

    The handler disarms itself as it raises. A signal that lands once the step is over (the
    timer firing as it is stopped, or one a critical section carried past the scope's entry
    and its helper thread posted later) is counted in ``late`` instead of raised, where it
    would escape the loop. Counting it is right: the interrupt did land in that step.
    """

    def __init__(self):
        self.armed = False
        self.late = 0

    def __call__(self, signum, frame):
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt
        self.late += 1


def disarm():
    """Stop the timer; a signal it sent just before is raised here (counted as an interrupt)."""
    try:
        signal.setitimer(signal.ITIMER_REAL, 0)
    except KeyboardInterrupt:
        return 1
    return 0


def check_allocator(alloc):
    """The model's own invariants: blocks tile their segments, free lists hold exactly the
    free blocks under the right keys, statistics match a recount."""
    reserved = allocated = active = 0
    free_blocks = set()
    for segment in alloc.segments():
        at, total = segment.address, 0
        for block in segment.blocks():
            assert block.ptr == at and block.size > 0 and block.segment is segment
            at += block.size
            total += block.size
            state = block.state
            if state == "inactive":
                free_blocks.add(block)
                assert block.key == (block.size << 64 | block.ptr)
            else:
                assert block.key is None
                active += block.size
                if state == "active_allocated":
                    allocated += block.size
        assert total == segment.size
        reserved += segment.size
    listed = set()
    pools = [alloc.small_blocks, alloc.large_blocks]
    for private in alloc.graph_pools.values():
        pools += [private.small_blocks, private.large_blocks]
    for pool in pools:
        for free in pool.free.values():
            free.keys._check()
            assert sorted(free.blocks) == list(free.keys)
            for key, block in free.blocks.items():
                assert block.key == key and block not in listed
                listed.add(block)
    assert listed == free_blocks, "free lists and free blocks disagree"
    assert reserved == alloc.memory_reserved()
    assert allocated == alloc.memory_allocated()
    assert active == alloc.memory_stats()["active_bytes.all.current"]


def check_snapshot_tiles(backend):
    """Integrity either device can show: blocks tile their segments and the snapshot's
    totals equal the allocator's counters (a free half applied breaks one or the other)."""
    reserved = allocated = 0
    for segment in backend.memory_snapshot():
        at = segment["address"]
        for block in segment["blocks"]:
            assert block["address"] == at and block["size"] > 0, "blocks do not tile their segment"
            at += block["size"]
            allocated += block["size"] if block["state"] == "active_allocated" else 0
        assert at == segment["address"] + segment["total_size"], "blocks do not tile their segment"
        reserved += segment["total_size"]
    assert reserved == backend.memory_reserved()
    assert allocated == backend.memory_allocated()


def check_usable(backend, state, graphs, baseline, alarm):
    assert state.holder is None, f"slot left held by {state.holder!r}"
    assert backend.allocator.captures_underway == [], "routing left on"
    backend.memory_snapshot()  # an allocator call: frees whose finalizer was cut short complete here
    assert state.live_borrowed_bytes() == 0, "phantom borrowed bytes"
    assert backend.memory_allocated() == baseline, "phantom bytes"
    check_allocator(backend.allocator)
    assert state.arena is None or state.arena.errors == 0
    assert interrupts.gate_stats()["depth"] == 0
    assert signal.getsignal(signal.SIGALRM) is alarm and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with state.replay_scope():
        graphs[0].replay()


@pytest.mark.property
@pytest.mark.stress
@pytest.mark.deep  # where a timer lands depends on the machine's pace: make test-deep (the next test is make test's)
@pytest.mark.parametrize("seed", [0, 1])
def test_random_timer_interrupts_leave_the_state_usable(device, seed):
    backend = device
    rng = random.Random(seed)
    state = BorrowState(backend, pool_id=backend.graph_pool_handle())
    graphs, keep = capture_ladder(backend, state)

    alarm = OneInterruptPerStep()
    previous = signal.signal(signal.SIGALRM, alarm)
    try:
        step(backend, state, graphs, rng)  # warm: pool built, workspaces made
        gc.collect()
        baseline = backend.memory_allocated()
        durations = []
        for _ in range(5):
            start = time.perf_counter()
            step(backend, state, graphs, rng)
            durations.append(time.perf_counter() - start)
        interrupted = 0
        iterations = 120 * deep_factor()
        for _ in range(iterations):
            duration = sorted(durations[-9:])[len(durations[-9:]) // 2]  # this machine's pace, now
            late_before = alarm.late
            try:
                alarm.armed = True
                signal.setitimer(signal.ITIMER_REAL, rng.uniform(1e-6, 1.5 * duration))
                start = time.perf_counter()
                step(backend, state, graphs, rng)
                durations.append(time.perf_counter() - start)
                time.sleep(0)  # a last chance for the timer inside this iteration
                alarm.armed = False
            except KeyboardInterrupt:
                interrupted += 1
            finally:
                interrupted += disarm()
            interrupted += settle()
            interrupted += alarm.late > late_before  # carried past the step's end: an interrupt all the same
            check_usable(backend, state, graphs, baseline, alarm)
        state.retire()
        assert interrupted >= iterations // 5, f"only {interrupted} of {iterations} steps were interrupted"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    del keep


_CALLS = {"CALL", "CALL_FUNCTION", "CALL_FUNCTION_EX", "CALL_FUNCTION_KW", "CALL_METHOD", "CALL_KW"}
_CHECKED = {"RESUME", "JUMP_BACKWARD"}


def _check_points(code):
    """Offsets of the instructions where CPython may run a pending signal handler: a
    function's start, a loop's back edge, right after a call returns, and a call itself
    (a C function may check for signals before it acts, as ``signal.signal`` does)."""
    points, previous = set(), None
    for ins in dis.get_instructions(code):
        if ins.opname in _CHECKED or ins.opname in _CALLS or previous in _CALLS:
            points.add(ins.offset)
        previous = ins.opname
    return points


class Injector:
    """Sends SIGALRM to the main thread at the k-th place where CPython checks for pending
    signals (``sys.settrace`` opcode events), so an interrupt lands at a uniformly random
    such place of the step, critical sections included in proportion to their code, not
    to the little time they take."""

    def __init__(self):
        self.count, self.target = 0, -1
        self.main = threading.main_thread().ident
        self.points = {}

    def __call__(self, frame, event, arg):
        frame.f_trace_opcodes = True
        if event == "opcode":
            code = frame.f_code
            points = self.points.get(code)
            if points is None:
                points = self.points[code] = _check_points(code)
            if frame.f_lasti in points:
                self.count += 1
                if self.count == self.target:
                    signal.pthread_kill(self.main, signal.SIGALRM)
        return self

    def run(self, fn, target):
        self.count, self.target = 0, target
        sys.settrace(self)
        try:
            fn()
        finally:
            sys.settrace(None)
        return self.count


@pytest.mark.property
@pytest.mark.stress
def test_interrupts_at_random_instructions_leave_the_state_usable(device):
    backend = device
    rng = random.Random(7)
    state = BorrowState(backend, pool_id=backend.graph_pool_handle())
    graphs, keep = capture_ladder(backend, state)

    alarm = OneInterruptPerStep()
    previous = signal.signal(signal.SIGALRM, alarm)
    injector = Injector()
    try:
        step(backend, state, graphs, rng)
        gc.collect()
        baseline = backend.memory_allocated()
        length = injector.run(lambda: step(backend, state, graphs, rng), target=-1)
        deferred0 = interrupts.gate_stats()["deferred"]
        interrupted = 0
        for _ in range(40 * deep_factor()):
            late_before = alarm.late
            try:
                alarm.armed = True
                injector.run(lambda: step(backend, state, graphs, rng), rng.randrange(1, length))
                alarm.armed = False
            except KeyboardInterrupt:
                interrupted += 1
            interrupted += settle()
            interrupted += alarm.late > late_before  # carried past the step's end: an interrupt all the same
            check_usable(backend, state, graphs, baseline, alarm)
        assert interrupted >= 20
        assert interrupts.gate_stats()["deferred"] - deferred0 >= 3, "too few landed in critical sections"
    finally:
        sys.settrace(None)
        signal.signal(signal.SIGALRM, previous)
    del keep


def test_a_scope_dropped_before_its_exit_ran_is_left_when_collected(sim):
    """An interrupt on the instruction boundary before __exit__ acts: the with statement
    drops the scope without leaving it. Simulated by entering by hand and dropping it."""
    state = BorrowState(sim, pool_id=sim.graph_pool_handle())
    graphs, keep = capture_ladder(sim, state)
    scope = state.borrow("abandoned")
    scope.__enter__()
    assert state.holder == "abandoned" and sim.allocator.captures_underway
    del scope  # collected: __del__ leaves it
    assert state.holder is None and sim.allocator.captures_underway == []
    assert state.check_pending
    with state.replay_scope():
        graphs[0].replay()


def abandon_with_its_finalizer_cut_short(state):
    """Enter a borrow scope by hand and drop it without its __del__ running, as if interrupted."""
    scope = state.borrow("abandoned")
    scope.__enter__()
    type(scope).__del__, saved = (lambda self: None), type(scope).__del__
    try:
        del scope
        gc.collect()
    finally:
        type(state.borrow("x")).__del__ = saved
    assert state.holder == "abandoned"  # nobody left it yet


def test_a_dead_holder_whose_finalizer_was_cut_short_is_reclaimed_by_the_next_claimant(sim):
    state = BorrowState(sim, pool_id=sim.graph_pool_handle())
    graphs, keep = capture_ladder(sim, state)
    abandon_with_its_finalizer_cut_short(state)
    with state.borrow("next"):  # the holder is gone: reclaimed, routing stopped first
        assert state.holder == "next"
        assert len(sim.allocator.captures_underway) == 1
    assert state.holder is None and sim.allocator.captures_underway == []


def test_a_dead_holder_is_reclaimed_by_a_state_change_too(sim):
    state = BorrowState(sim, pool_id=sim.graph_pool_handle())
    graphs, keep = capture_ladder(sim, state)
    abandon_with_its_finalizer_cut_short(state)
    report = state.retire()  # the holder is gone: reclaimed, not refused as busy
    assert report.built and state.holder is None and state.mem_pool is None
    assert sim.allocator.captures_underway == []


def test_a_live_holder_is_never_reclaimed(sim):
    state = BorrowState(sim, pool_id=sim.graph_pool_handle())
    graphs, keep = capture_ladder(sim, state)
    outer = state.borrow("outer")
    outer.__enter__()
    with pytest.raises(PoolBusyError, match="held by 'outer'"):
        with state.replay_scope():
            pass
    outer.__exit__(None, None, None)
    assert state.holder is None


@pytest.mark.parametrize("user", [None, "", "   ", 3, b"verify", ("a",)])
def test_borrow_needs_a_name_that_claims_the_slot(sim, user):
    state = BorrowState(sim, pool_id=sim.graph_pool_handle())
    capture_ladder(sim, state)
    with pytest.raises(TypeError, match="non-empty string naming the borrower"):
        state.borrow(user)


def test_a_replay_inside_any_borrow_is_refused(sim):
    """borrow(None) used to leave the slot looking free, so a replay ran over live borrows."""
    state = BorrowState(sim, pool_id=sim.graph_pool_handle())
    graphs, keep = capture_ladder(sim, state)
    with state.borrow("named"):
        t = torch.full((1024,), 7.0, device="cuda")
        with pytest.raises(PoolBusyError):
            with state.replay_scope():
                graphs[0].replay()
        assert t.eq(7).all().item()
        del t


def test_borrowing_from_a_pool_with_no_captured_graph_is_refused(sim):
    """The simulated device answers a snapshot of an unknown pool with every segment; the
    borrow state must not turn the default pool's free blocks into runs."""
    state = BorrowState(sim, pool_id=sim.graph_pool_handle())
    plain = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")
    del plain  # a free block in the default pool: what a plain allocation gets next
    assert state.free_runs() == [] and state.largest_run() == 0 and not state.can_fit(4096)
    with pytest.raises(EmptyGraphPoolError, match="holds no segments"):
        with state.borrow("too early"):
            pass
    assert state.holder is None and sim.allocator.captures_underway == []
    graphs, keep = capture_ladder(sim, state)  # after a capture, borrowing works
    with state.borrow("now"):
        t = torch.empty(MiB, dtype=torch.uint8, device="cuda")
        owner = block_at(sim.allocator, sim.data_ptr(t)).pool.owner
        assert owner is not None and owner.id == state.backend.pool_id(state.mem_pool)
        del t


def test_runs_come_only_from_the_state_s_own_pool(sim):
    state = BorrowState(sim, pool_id=sim.graph_pool_handle())
    capture_ladder(sim, state)
    other = BorrowState(sim, pool_id=sim.graph_pool_handle())
    capture_ladder(sim, other)
    mine = {s["address"] for s in sim.memory_snapshot(state.pool_id)}
    for address, nbytes in state.free_runs():
        assert any(a <= address < a + 1 for a in mine) or any(
            s["address"] <= address < s["address"] + s["total_size"] for s in sim.memory_snapshot(state.pool_id)
        )
    theirs = other.free_runs()
    assert not set(state.free_runs()) & set(theirs)


@pytest.mark.property
@pytest.mark.stress
@pytest.mark.deep  # timer landings vary from run to run: make test-deep and make test-gpu run it
def test_timer_interrupts_leave_the_state_usable_on_either_device(ladder, dropped):
    """The same storm on the real GPU (``gpu`` marker) and its simulated twin, with checks
    that need no simulator internals: slot free, new tensors outside the borrow pool
    (routing off), nothing borrowed still allocated, arena clean, replay and retire work."""
    backend, state = ladder.backend, ladder.state
    rng = random.Random(3)

    def one_step():
        # Scope entries and exits, allocations and frees: the windows an unprotected scope
        # leaves open. Replays stay outside the timed step (on the simulator they are slow
        # enough to take most of the timer's landings).
        for _ in range(3):
            with state.borrow("verify"):
                a = torch.empty(rng.choice((1024, 300_000, 3 * MiB)), dtype=torch.uint8, device=backend.device)
                b = torch.softmax(torch.ones(8, 512, device=backend.device), -1)
                del a, b

    alarm = OneInterruptPerStep()
    previous = signal.signal(signal.SIGALRM, alarm)
    try:
        one_step()
        gc.collect()
        backend.synchronize()
        baseline = backend.memory_allocated()
        durations = []
        for _ in range(5):
            start = time.perf_counter()
            one_step()
            durations.append(time.perf_counter() - start)
        interrupted = 0
        for i in range(100 * deep_factor()):
            late_before = alarm.late
            try:
                alarm.armed = True
                signal.setitimer(signal.ITIMER_REAL, rng.uniform(1e-6, 1.5 * sorted(durations)[len(durations) // 2]))
                one_step()
                time.sleep(0)
                alarm.armed = False
            except KeyboardInterrupt:
                interrupted += 1
            finally:
                interrupted += disarm()
            interrupted += settle()
            interrupted += alarm.late > late_before  # carried past the step's end: an interrupt all the same
            assert state.holder is None
            probe = torch.empty(4096, dtype=torch.uint8, device=backend.device)
            address = backend.data_ptr(probe)
            assert not any(a <= address < a + n for a, n in (state.arena.extents if state.arena else ())), \
                "a plain allocation landed in the borrow pool: routing left on"
            del probe
            backend.synchronize()
            assert state.live_borrowed_bytes() == 0
            assert backend.memory_allocated() == baseline
            check_snapshot_tiles(backend)
            assert state.arena is None or state.arena.errors == 0
            if i % 8 == 7:
                ladder.replay(rng.randrange(len(ladder.graphs)))
                state.retire()
        assert interrupted >= 8
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
