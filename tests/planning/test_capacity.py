"""plan_verify and the size classes, against borrows made with the real BorrowState."""

import pytest
import torch

from graphborrow.core.borrow import BorrowState
from graphborrow.core.errors import BorrowCapacityError
from graphborrow.eagle import eagle_verify, verify_bytes
from graphborrow.eagle.draft_tree import DraftTree
from graphborrow.eagle.plan import describe_plan, plan_verify
from graphborrow.planning.capacity import largest_borrowable, size_class_table, unborrowable_runs
from graphborrow.planning.planner import AllocationSequence, PoolImage, plan, record, recording, replay
from graphborrow.core.sizes import size_class
from graphborrow.sim import SimBackend

MB = 2**20


@pytest.fixture
def layout():
    device = SimBackend(capacity=2**36, backed=False, blas_workspace=0)
    yield device
    device.close()


def static_state(device, *run_sizes, precarve=False):
    """A borrow state over fresh external buffers of these sizes (runs no capture shaped)."""
    buffers = [device.external_alloc(n) for n in run_sizes]
    state = BorrowState(device, precarve=precarve)
    state.set_static_runs([(b.address, b.nbytes) for b in buffers])
    state.buffers = buffers
    return state


def borrows(state, device, nbytes) -> bool:
    try:
        with state.borrow("probe"):
            t = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            del t
        return True
    except device.OutOfMemoryError:
        return False
    finally:
        state.retire()


@pytest.mark.parametrize("run_mib,largest_mib", [(1, 0), (3, 1), (9, 1), (12, 12), (15, 14), (19, 18),
                                                 (20, 20), (21, 20), (100, 100)])
def test_largest_borrowable_tensor_by_run_size(layout, run_mib, largest_mib):
    largest = largest_borrowable(run_mib * MB)
    assert largest == largest_mib * MB
    state = static_state(layout, run_mib * MB)
    if largest:
        assert borrows(state, layout, largest)
    assert not borrows(state, layout, largest + 512)


def test_the_size_class_table_follows_the_allocators_rules():
    """Every 256 KiB up to 40 MiB by default. Runs under 2 MiB lend nothing (not even a small-pool
    segment), under 10 MiB small tensors only (1 MiB), from 10 MiB a large tensor of the run
    rounded down to 2 MiB (no 1-10 MiB tensor fits before 20 MiB, and from there they are smaller)."""
    rows = size_class_table()
    assert [r["run_bytes"] for r in rows] == [k * MB // 4 for k in range(1, 161)]
    for r in rows:
        run = r["run_bytes"]
        expected = 0 if run < 2 * MB else MB if run < 10 * MB else run // (2 * MB) * (2 * MB)
        assert (r["largest_bytes"], r["class"]) == (expected, "none" if run < 2 * MB else "small" if run < 10 * MB
                                                    else "large"), run
    assert largest_borrowable(0) == 0


def test_a_medium_tensor_needs_a_twenty_mib_segment(layout):
    state = static_state(layout, 15 * MB)
    assert borrows(state, layout, 12 * MB)  # large: a 12 MiB segment
    assert not borrows(state, layout, 5 * MB)  # medium: a whole 20 MiB segment
    rows = size_class_table([1 * MB, 4 * MB, 15 * MB, 40 * MB])
    assert [r["class"] for r in rows] == ["none", "small", "large", "large"]
    assert unborrowable_runs([(0x1000, 1 * MB), (0x2000000, 4 * MB)]) == [(0x1000, 1 * MB)]


def test_precarve_holds_tensors_up_to_its_seed(layout):
    """A precarved run lends its seed segment (any large tensor up to it) and the reserve behind it."""
    state = static_state(layout, 100 * MB, precarve=True)
    seeds = state.precarve_sizes([(0, 100 * MB)])
    assert seeds == [68 * MB]  # the run less the 32 MiB reserve for small-pool segments
    assert largest_borrowable(100 * MB, seeds=seeds) == 68 * MB
    assert borrows(state, layout, 68 * MB)
    assert not borrows(state, layout, 68 * MB + 512)


def test_a_step_fits_by_its_sequence_not_by_its_bytes(layout):
    """The motivating case: the step's whole peak fits the run as one tensor, the step does not:
    its small tensors take a 2 MiB small-pool segment first, and then the 1-10 MiB
    probabilities need a 20 MiB segment that no longer fits."""
    bs, d, vocab = 4, 4, 32000  # float32 probabilities [16, 32000]: 1.95 MiB each (medium)
    peak = verify_bytes(bs, d, vocab, "standard")
    state = static_state(layout, 21 * MB)
    assert state.can_fit(peak)  # the single-tensor question says yes
    p = plan_verify(state, bs, d, vocab)
    assert not p.fits and p.peak_bytes == peak
    assert "[16, 32000] float32 matrix" in p.reason and "20 MiB segment" in p.reason
    assert "largest run 21.0 MiB" in p.reason
    long = torch.empty(bs, d, dtype=torch.long, device="cuda")
    with pytest.raises(layout.OutOfMemoryError):
        eagle_verify(torch.empty(bs * d, vocab, device="cuda"), None, DraftTree(long, long, long, long, 3), 1.0,
                     borrow=state, validate=False)
    fits = plan_verify(static_state(layout, 30 * MB), bs, d, vocab)
    assert fits.fits and fits.peak_bytes == peak
    assert p.allocations < fits.allocations  # the replay stopped at the tensor that did not fit


def test_chunked_refuses_before_allocating_anything(layout):
    state = static_state(layout, 6 * MB)
    p = plan_verify(state, 8, 4, 128256, "chunked")  # one request's [4, 128256] probabilities: 2 MiB, medium
    assert not p.fits and p.requests_per_chunk == 1
    assert plan_verify(state, 8, 4, 16000, "chunked").requests_per_chunk == 2  # [8, 16000] (int64 sum terms too): small blocks
    long = torch.empty(8, 4, dtype=torch.long, device="cuda")
    logits = torch.empty(32, 128256, device="cuda")
    before = layout.memory_snapshot()
    with pytest.raises(BorrowCapacityError, match="cannot run in the borrowed runs: .*medium"):
        eagle_verify(logits, None, DraftTree(long, long, long, long, 2), 1.0, borrow=state, mode="chunked",
                     validate=False)
    assert state.mem_pool is None and state.builds == 0
    assert layout.memory_snapshot() == before


def test_plans_answer_for_a_built_pool_too(layout):
    """After a borrow the pool is built: its cached segments are restored in the model."""
    state = static_state(layout, 100 * MB)
    long = torch.empty(8, 4, dtype=torch.long, device="cuda")
    logits = torch.empty(32, 32000, device="cuda")
    tree = DraftTree(long, long, long, long, 3)
    assert plan_verify(state, 8, 4, 32000).fits
    eagle_verify(logits, None, tree, 1.0, borrow=state, validate=False)
    assert state.mem_pool is not None
    built = PoolImage.of(state)
    assert built.segments and built.largest_room < 100 * MB
    for bs, d in ((8, 4), (16, 8), (40, 8)):
        p = plan_verify(state, bs, d, 32000)
        long = torch.empty(bs, d, dtype=torch.long, device="cuda")
        try:
            eagle_verify(torch.empty(bs * d, 32000, device="cuda"), None, DraftTree(long, long, long, long, 3), 1.0,
                         borrow=state, validate=False)
            ran = True
        except layout.OutOfMemoryError:
            ran = False
        assert p.fits == ran, (bs, d, p)


def test_disabled_and_empty_cases(layout):
    state = static_state(layout, 40 * MB)
    assert plan_verify(state, 0, 4, 1000).fits
    state.disable("graph pool is externally managed")
    p = plan_verify(state, 1, 1, 10)
    assert not p.fits and "disabled: graph pool is externally managed" in p.reason
    assert "does not fit: borrowing is disabled" in describe_plan(p)


def test_bad_arguments_are_named(layout):
    state = static_state(layout, 40 * MB)
    with pytest.raises(ValueError, match="batch_size must be an int >= 0"):
        plan_verify(state, -1, 4, 1000)
    with pytest.raises(ValueError, match="mode must be one of"):
        plan_verify(state, 1, 4, 1000, mode="fast")
    with pytest.raises(ValueError, match="top_k says whether"):
        plan_verify(state, 1, 4, 1000, top_k=50)
    for bad in (True, 2.0):
        with pytest.raises(ValueError, match="batch_size must be an int >= 0"):
            plan_verify(state, bad, 4, 1000)
    with pytest.raises(ValueError, match="draft_tokens must be an int >= 1, got 0"):
        plan_verify(state, 1, 0, 1000)
    with pytest.raises(ValueError, match="vocab must be an int >= 1, got 0"):
        plan_verify(state, 1, 4, 0)
    with pytest.raises(ValueError, match="top_p says whether that renorm runs: pass True or False, got 0.9"):
        plan_verify(state, 1, 4, 1000, top_p=0.9)
    assert plan_verify(state, 1, 1, 1).fits  # the least step: one token of a one-word vocabulary
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="run_bytes must be an int >= 0"):
            largest_borrowable(bad)


def test_any_step_can_be_planned(layout):
    """The general planner: a log-softmax over chunks of logits, a user's own function."""
    state = static_state(layout, 24 * MB)
    sequence = record(lambda x: torch.log_softmax(x, dim=-1), inputs=[((64, 32000), torch.float32)])
    assert sequence.allocations == 1 and size_class(64 * 32000 * 4).name == "medium"
    assert plan(state, sequence).fits  # one 7.8 MiB output: a 20 MiB segment
    assert not plan(static_state(layout, 16 * MB), sequence).fits
    three = plan(state, lambda x: (x.exp(), x.exp(), x.exp()), inputs=[((64, 32000), torch.float32)])
    assert not three.fits and three.failed.index == 2  # two share the 20 MiB segment, the third needs another


# ----------------------------------------------------------------------------- the replay itself

BASE = 1 << 40


def seq(*events):
    """("alloc", id, nbytes) / ("free", id) shorthand on stream 0."""
    return AllocationSequence(tuple((e[0], e[1], e[2] if len(e) > 2 else 0, 0) for e in events))


def test_replay_counts_peak_carved_bytes_and_allocations():
    image = PoolImage.from_runs([(BASE, 64 * MB)])
    r = replay(seq(("alloc", 1, 1000), ("alloc", 2, 15 * MB), ("free", 2), ("alloc", 3, 12 * MB)), image)
    assert (r.fits, r.allocations, r.failed, r.disabled) == (True, 3, None, None)
    # blocks as the allocator hands them out: 1000 B -> 1024; 15 MiB takes its whole 16 MiB segment
    # (1 MiB would remain, and a large block splits only when more than 1 MiB remains)
    assert r.peak_bytes == 1024 + 16 * MB
    assert r.carved_bytes == 2 * MB + 16 * MB  # a small-pool segment and a 16 MiB one


def test_a_failed_request_is_described_with_what_the_pool_had_left():
    image = PoolImage.from_runs([(BASE, 30 * MB)])
    r = replay(seq(("alloc", 1, 1000), ("alloc", 2, 15 * MB), ("free", 2), ("alloc", 3, 25 * MB)), image,
               describe=lambda n: "the big one" if n == 25 * MB else "")
    assert (r.fits, r.allocations, r.carved_bytes, r.peak_bytes) == (False, 2, 18 * MB, 1024 + 16 * MB)
    f = r.failed
    assert (f.index, f.held_bytes, f.largest_cached, f.largest_room, f.largest_run, f.label) == (
        2, 1024, 16 * MB, 12 * MB, 30 * MB, "the big one")
    assert f.size == size_class(25 * MB) and (f.size.name, f.size.segment_bytes) == ("large", 26 * MB)
    assert r.reason.startswith("the step's allocation #3, the big one (25.0 MiB), does not fit")
    assert "the largest cached free block is 16.0 MiB" in r.reason and "(largest 12.0 MiB; largest run 30.0 MiB" in r.reason
    small = replay(seq(("alloc", 1, 4096)), PoolImage.from_runs([(BASE, 1 * MB)]))
    assert small.failed.size.name == "small" and small.failed.largest_cached == 0
    assert "no cached free block is large enough" in small.reason and "2.0 MiB small-pool segment" in small.reason


def test_the_fit_policy_of_the_image_decides():
    image = PoolImage.from_runs([(BASE, 20 * MB), (BASE + 64 * MB, 12 * MB)], best_fit=True)
    steps = seq(("alloc", 1, 1000), ("alloc", 2, 5 * MB))
    assert replay(steps, image).fits
    first = replay(steps, PoolImage.from_runs(image.runs, best_fit=False))
    assert not first.fits and first.failed.largest_room == 18 * MB


def test_a_precarve_that_does_not_fit_fails_the_build():
    r = replay(seq(("alloc", 1, 1000)), PoolImage.from_runs([(BASE, 40 * MB)], seeds=[30 * MB, 20 * MB]))
    assert (r.fits, r.allocations, r.carved_bytes, r.peak_bytes) == (False, 0, 30 * MB, 0)
    assert (r.failed.index, r.failed.held_bytes, r.failed.size.nbytes) == (-1, 0, 30 * MB)  # the step held nothing yet
    assert r.reason.startswith("building the borrow pool (its precarve), a 30.0 MiB tensor, does not fit")


def test_a_disabled_state_replays_nothing():
    r = replay(seq(("alloc", 1, 1000)), PoolImage(disabled="externally managed"))
    assert (r.fits, r.peak_bytes, r.carved_bytes, r.allocations, r.failed) == (False, 0, 0, 0, None)
    assert r.reason == "borrowing is disabled: externally managed"


def test_the_devices_allocator_settings_carry_into_the_plan():
    """17 MiB rounds to an 18 MiB segment by default, to 20 MiB with power-of-two divisions."""
    results = []
    for config in (None, "roundup_power2_divisions:4"):
        device = SimBackend(capacity=2**34, backed=False, blas_workspace=0, config=config)
        try:
            state = static_state(device, 19 * MB)
            image = PoolImage.of(state)
            assert image.config is device.allocator.config
            results.append(plan(state, seq(("alloc", 1, 17 * MB))).fits)
        finally:
            device.close()
    assert results == [True, False]


def test_the_plan_peak_is_the_steps_peak_on_the_device_with_every_renorm(layout):
    """Top-k and top-p add their own temporaries: the plan's peak follows the device's peak while
    the step runs (the device's also holds the step's outputs: the same blocks every time)."""
    state = static_state(layout, 64 * MB)
    bs, d, vocab = 64, 8, 1000
    long = torch.empty(bs, d, dtype=torch.long, device="cuda")
    tree = DraftTree(long, long, long, long, 3)
    logits = torch.empty(bs * d, vocab, device="cuda")
    planned, outputs = {}, set()
    for top_k, top_p in ((False, False), (True, False), (False, True), (True, True)):
        p = plan_verify(state, bs, d, vocab, top_k=top_k, top_p=top_p)
        layout.allocator.reset_peak_memory_stats()
        before = layout.memory_stats()["allocated_bytes.all.current"]
        eagle_verify(logits, None, tree, 0.7, top_ks=50 if top_k else None, top_ps=0.9 if top_p else None,
                     borrow=state, validate=False)
        outputs.add(layout.memory_stats()["allocated_bytes.all.peak"] - before - p.peak_bytes)
        planned[top_k, top_p] = p.peak_bytes
    assert len(outputs) == 1 and 0 < outputs.pop() < 64 * 1024
    assert planned[False, False] < min(planned[True, False], planned[False, True]) < planned[True, True]


def test_the_plan_echoes_its_step_and_its_replay(layout):
    state = static_state(layout, 64 * MB)
    p = plan_verify(state, 2, 4, 32000, "lean", top_k=True)
    assert (p.fits, p.mode, p.batch_size, p.draft_tokens, p.vocab, p.top_k, p.top_p) == (
        True, "lean", 2, 4, 32000, True, False)
    assert (p.requests_per_chunk, p.largest_run, p.reason) == (2, 64 * MB, "")
    assert p.carved_bytes >= 2 * MB and p.allocations > 0 and p.peak_bytes > 2 * 4 * 32000
    empty = plan_verify(state, 0, 4, 32000, "lean", top_p=True)
    assert empty == type(empty)(True, 0, "", "lean", 0, 4, 32000, False, True, largest_run=64 * MB)
    assert empty.peak_bytes == 0
    assert plan_verify(state, 0, 4, 32000, impl="fused").impl == "fused"  # an empty step names its path too


def test_the_pool_image_of_a_state_fresh_and_built(layout):
    state = static_state(layout, 100 * MB, 30 * MB, precarve=True)
    state.best_fit = False
    fresh = PoolImage.of(state)
    runs = tuple(state.free_runs())
    assert (fresh.extents, fresh.runs, fresh.best_fit, fresh.align, fresh.segments, fresh.stream) == (
        runs, runs, False, 512, (), 0)
    assert fresh.seeds == tuple(state.precarve_sizes(runs)) == (68 * MB,)
    assert fresh.config is layout.allocator.config and fresh.disabled is None
    assert (fresh.largest_run, fresh.largest_room) == (100 * MB, 100 * MB)
    with state.borrow("build"):
        t = torch.empty(5 * MB, dtype=torch.uint8, device="cuda")
        del t
    state.best_fit = True  # applies to the next build, not to the built pool
    built = PoolImage.of(state)
    cursors = state.arena.extent_cursors()
    assert built.extents == tuple((b + c, n - c) for (b, n), c in zip(state.arena.extents, cursors) if n > c)
    assert built.best_fit is False and built.seeds == () and built.runs == runs
    assert built.segments and built.stream == built.segments[0]["stream"]


def run_fused_allocations(state, device, bs, d, vocab, renorm) -> bool:
    """The fused path's body as eagle_verify runs it, without launching: its allocations, in the borrow scope."""
    from graphborrow.eagle.step import VerifyResult
    from graphborrow.eagle.step import VerifyStep
    from graphborrow.eagle.triton import fused

    long = torch.empty(bs, d, dtype=torch.long, device="cuda")
    tree = DraftTree(long, long, long, long, 3)
    step = VerifyStep(torch.empty(bs * d, vocab, device="cuda"), long, tree, 1.0,
                      torch.full((bs,), 50) if renorm else None, torch.full((bs,), 0.9) if renorm else None)
    out = VerifyResult(long.new_zeros(bs * d, dtype=torch.int32), long.new_zeros((bs, 3), dtype=torch.int32),
                       long.new_zeros(bs, dtype=torch.int32))
    try:
        with state.borrow("EAGLE verify"):
            fused.run_step(step, out, launch=False)
        return True
    except device.OutOfMemoryError:
        return False
    finally:
        state.retire()


@pytest.mark.parametrize("bs,d,vocab,renorm", [(4, 4, 32000, False), (32, 8, 128256, True), (128, 16, 128256, True)])
def test_fused_plan_fits_exactly_when_the_fused_allocations_succeed(layout, bs, d, vocab, renorm):
    """impl="fused" plans the fused step's own workspace (recorded with launch=False), not the
    reference's matrices: the plan holds against the same allocations made on the device."""
    outcomes = set()
    for run_mib in (1.5, 3, 21, 23):
        state = static_state(layout, int(run_mib * MB))
        p = plan_verify(state, bs, d, vocab, "standard", renorm, renorm, impl="fused")
        ran = run_fused_allocations(state, layout, bs, d, vocab, renorm)
        assert p.fits == ran, (run_mib, p)
        assert p.impl == "fused" and p.requests_per_chunk == bs
        outcomes.add(ran)
    assert outcomes == {True, False}  # every shape meets a run too small for it


def test_the_plan_follows_the_implementation_that_will_run(layout):
    """The fused step holds no [rows, V] matrix: it fits runs where the reference cannot; on the
    simulated device "auto" plans the reference, which is what eagle_verify runs there."""
    state = static_state(layout, 3 * MB)
    fused = plan_verify(state, 32, 8, 128256, impl="fused")
    reference = plan_verify(state, 32, 8, 128256, impl="reference")
    assert fused.fits and not reference.fits
    assert fused.peak_bytes < 64 * 1024 < reference.peak_bytes
    assert plan_verify(state, 32, 8, 128256) == reference  # auto on the simulated device
    chunked = plan_verify(state, 32, 8, 128256, "chunked", impl="fused")
    assert chunked.fits and chunked.requests_per_chunk == 32  # the fused step never splits the batch
    with pytest.raises(ValueError, match="impl must be one of"):
        plan_verify(state, 32, 8, 128256, impl="triton")


# ----------------------------------------------------------------------------- what the replay must model

def runs_out(state, device, *steps, stream=None) -> bool:
    """Borrow once and allocate ``(nbytes, stream)`` steps in order; True when the pool ran out.

    The borrow pool stays built afterwards (no retire), so later plans see it as it is."""
    try:
        with state.borrow("probe"):
            held = []
            for nbytes, on in steps:
                with device.stream(on):
                    held.append(torch.empty(nbytes, dtype=torch.uint8, device="cuda"))
            del held
        return False
    except device.OutOfMemoryError:
        return True


def test_a_free_still_pending_on_another_stream_is_not_counted_on(layout):
    """A borrowed tensor that escaped the scope, used on a busy side stream (record_stream) and
    deleted outside any borrow stays active_pending_free until that stream's work is done: the
    next borrow cannot reuse its block, and the plan must not count on it."""
    state = static_state(layout, 24 * MB)
    side = layout.Stream()
    with state.borrow("keep"):
        t = torch.empty(5 * MB, dtype=torch.uint8, device="cuda")  # medium: the run's one 20 MiB segment
    layout.sleep(side, 10**9)
    layout.record_stream(t, side)
    del t
    image = PoolImage.of(state)
    assert [b["state"] for s in image.segments for b in s["blocks"]] == ["active_pending_free", "inactive"]
    # 16 MiB would fit the segment if the pending 5 MiB counted as free; its 15 MiB remainder is too small
    large, small = seq(("alloc", 1, 16 * MB)), seq(("alloc", 1, 4096))
    assert not plan(state, large).fits and plan(state, small).fits
    assert runs_out(state, layout, (16 * MB, None))  # the device agrees: the pending block is not reused
    assert not runs_out(state, layout, (4096, None))  # and the 4 MiB left still take a small-pool segment
    layout.synchronize()  # the side stream's work is done: the next borrow frees the block first
    assert plan(state, large).fits and not runs_out(state, layout, (16 * MB, None))


def test_a_free_deferred_inside_the_borrow_is_done_when_the_next_one_starts(layout):
    """record_stream and the free inside the borrow: the free waits until the routing ends (the
    snapshot says active_pending_free), and the next borrow's first allocator call completes it
    (stream uses recorded while a pool routes are dropped, as for a graph capture)."""
    state = static_state(layout, 24 * MB)
    side = layout.Stream()
    with state.borrow("keep"):
        t = torch.empty(5 * MB, dtype=torch.uint8, device="cuda")
        layout.sleep(side, 10**9)
        layout.record_stream(t, side)
        del t
    states = [b["state"] for s in layout.memory_snapshot(layout.pool_id(state.mem_pool)) for b in s["blocks"]]
    assert states == ["active_pending_free", "inactive"]
    assert plan(state, seq(("alloc", 1, 16 * MB))).fits
    assert not runs_out(state, layout, (16 * MB, None))


def test_blocks_are_reused_on_their_own_stream_only(layout):
    """The allocator hands a cached block only to requests of the stream that freed it: a step
    whose second request comes on a side stream needs a segment of its own."""
    side = layout.Stream()
    one_stream = AllocationSequence((("alloc", 1, 5 * MB, 0), ("free", 1, 0, 0), ("alloc", 2, 5 * MB, 0)))
    two_streams = AllocationSequence((("alloc", 1, 5 * MB, 0), ("free", 1, 0, 0), ("alloc", 2, 5 * MB, 7)))
    state = static_state(layout, 30 * MB)
    assert plan(state, one_stream).fits and not plan(state, two_streams).fits
    assert not runs_out(state, layout, (5 * MB, None), (5 * MB, None))
    state.retire()
    assert runs_out(state, layout, (5 * MB, None), (5 * MB, side))
    state.retire()
    recorded = AllocationSequence((("alloc", 1, 5 * MB, 3), ("alloc", 2, 5 * MB, 4)))  # two side streams, both live
    assert plan(static_state(layout, 40 * MB), recorded).fits  # each takes its own 20 MiB segment


def test_a_pool_built_on_a_side_stream_is_replayed_on_that_stream(layout):
    """The built pool's cached blocks belong to the stream that borrowed; a step on that stream
    reuses them (and the model must replay it there, not on the default stream)."""
    side = layout.Stream()
    state = static_state(layout, 24 * MB)
    with layout.stream(side):
        assert not runs_out(state, layout, (5 * MB, None))
        image = PoolImage.of(state)
        assert image.segments and image.stream == side.id != 0
        again = seq(("alloc", 1, 5 * MB))
        assert plan(state, again).fits  # the cached 20 MiB segment takes it
        assert not runs_out(state, layout, (5 * MB, None))


def test_a_failed_small_request_names_the_small_pools_cached_block():
    """600 KiB twice leave 848 KiB free in the 2 MiB small-pool segment; a 1 MiB request (still
    small) cannot use it, and the run's last 0.5 MiB cannot take a second small-pool segment."""
    image = PoolImage.from_runs([(BASE, 5 * MB // 2)])
    r = replay(seq(("alloc", 1, 600 * 1024), ("alloc", 2, 600 * 1024), ("alloc", 3, 1 * MB)), image)
    assert (r.fits, r.allocations, r.failed.index, r.failed.size.name) == (False, 2, 2, "small")
    assert r.failed.largest_cached == 848 * 1024 and r.failed.largest_room == MB // 2
    assert r.reason == (
        "the step's allocation #3, a 1.0 MiB tensor, does not fit. It is small (up to 1 MiB): a block of a "
        "2 MiB small-pool segment; the largest cached free block is 0.8 MiB, and a new 2.0 MiB small-pool "
        "segment does not fit the room the free runs have left (largest 0.5 MiB; largest run 2.5 MiB, the "
        "step already holds 1.2 MiB)")


def test_the_first_request_failing_is_allocation_one_and_sizes_read_in_kib():
    r = replay(seq(("alloc", 1, 100 * 1024)), PoolImage.from_runs([(BASE, MB)]))
    assert r.failed.index == 0 and r.failed.held_bytes == 0
    assert r.reason.startswith("the step's allocation #1, a 100.0 KiB tensor, does not fit.")
    large = replay(seq(("alloc", 1, 30 * MB)), PoolImage.from_runs([(BASE, 16 * MB)]))
    assert ("It is large (10 MiB and more): a cached large block, or a new segment of its size rounded up to "
            "2 MiB (30.0 MiB); no cached free block is large enough, and a new 30.0 MiB segment does not fit") in large.reason
    medium = replay(seq(("alloc", 1, 3 * MB)), PoolImage.from_runs([(BASE, 16 * MB)]))
    assert ("It is medium (1-10 MiB): a cached large block, or a whole new 20 MiB segment; no cached free block "
            "is large enough, and a new 20.0 MiB segment does not fit") in medium.reason


def test_a_pool_with_no_room_left_fails_with_nothing_to_offer():
    r = replay(seq(("alloc", 1, 4096)), PoolImage.from_runs([]))
    assert not r.fits and (r.failed.largest_room, r.failed.largest_cached, r.failed.largest_run) == (0, 0, 0)
    assert "(largest 0 B; largest run 0 B" in r.reason


def test_a_run_just_short_of_the_segment_is_named_in_bytes():
    r = replay(seq(("alloc", 1, 100)), PoolImage.from_runs([(BASE, 2 * MB - 512)]))
    assert not r.fits
    assert r.reason.startswith("the step's allocation #1, a 100 B tensor, does not fit.")
    assert "a new 2.0 MiB small-pool segment does not fit" in r.reason
    assert f"largest run 2.0 MiB ({2 * MB - 512} B)" in r.reason, "one decimal alone would read 2.0 MiB against 2.0 MiB"


def test_size_classes_at_their_boundaries():
    """The allocator's classes by rounded block: up to 1 MiB small (2 MiB segments), under 10 MiB
    medium (20 MiB segments), from 10 MiB large (rounded up to 2 MiB)."""
    cases = {1: ("small", 512, 2 * MB), MB: ("small", MB, 2 * MB), MB + 1: ("medium", MB + 512, 20 * MB),
             10 * MB - 512: ("medium", 10 * MB - 512, 20 * MB), 10 * MB - 1: ("large", 10 * MB, 10 * MB),
             10 * MB: ("large", 10 * MB, 10 * MB), 11 * MB: ("large", 11 * MB, 12 * MB)}
    for nbytes, (name, block, segment) in cases.items():
        assert size_class(nbytes) == type(size_class(1))(name, nbytes, block, segment), nbytes


def test_a_pool_that_ran_out_is_planned_as_the_rebuild_the_next_borrow_makes():
    """With max_split_size_mb, running out makes the allocator hand the pool's oversize cached
    segments back to the arena, which cannot lend them again: the next borrow starts over from
    the runs, and so does the plan."""
    device = SimBackend(capacity=2**34, backed=False, blas_workspace=0, config="max_split_size_mb:21")
    try:
        state = static_state(device, 64 * MB)
        assert not runs_out(state, device, (30 * MB, None))  # leaves a cached (oversize) 30 MiB segment
        forty = seq(("alloc", 1, 40 * MB))
        assert not plan(state, forty).fits and runs_out(state, device, (40 * MB, None))
        assert state.mem_pool is not None and state.arena.freed_bytes == 30 * MB
        image = PoolImage.of(state)
        assert (image.extents, image.segments) == (tuple(state.free_runs()), ())
        assert plan(state, forty).fits and not runs_out(state, device, (40 * MB, None))
    finally:
        device.close()


def test_a_retired_pool_is_planned_as_the_fresh_build_the_next_borrow_makes(layout):
    """After retire() the next borrow builds a new pool over the runs (the old arena stays, empty)."""
    state = static_state(layout, 24 * MB)
    with state.borrow("nothing"):
        pass
    state.retire()
    assert state.mem_pool is None and state.arena is not None and state.arena.freed_bytes == 0
    image = PoolImage.of(state)
    assert (image.extents, image.segments) == (tuple(state.free_runs()), ())
    twenty = seq(("alloc", 1, 20 * MB))
    assert plan(state, twenty).fits and not runs_out(state, layout, (20 * MB, None))


def test_planning_inside_a_borrow_leaves_the_pool_as_it_is(layout):
    """A plan only reads the pool the step is borrowing from (no allocation routes into it)."""
    state = static_state(layout, 24 * MB)
    with state.borrow("step"):
        held = torch.empty(5 * MB, dtype=torch.uint8, device="cuda")
        before = layout.memory_snapshot()
        assert plan_verify(state, 4, 4, 1000).fits
        assert layout.memory_snapshot() == before
        del held


def test_why_a_state_lends_nothing():
    device = SimBackend(capacity=2**34, backed=False, blas_workspace=0)
    try:
        no_pool = BorrowState(device)
        assert PoolImage.of(no_pool).disabled == "no graph pool"
        no_runs = BorrowState(device)
        no_runs.set_static_runs([])
        assert PoolImage.of(no_runs).disabled == "no static runs"
        assert plan_verify(no_runs, 1, 1, 10).reason == "borrowing is disabled: no static runs"
    finally:
        device.close()


def test_a_built_pool_keeps_the_devices_allocator_settings():
    """17 MiB takes an 18 MiB segment by default, 20 MiB with power-of-two divisions: after a
    borrow built the pool, the plan still rounds the device's way (the run has 19 MiB)."""
    for config, fits in ((None, True), ("roundup_power2_divisions:4", False)):
        device = SimBackend(capacity=2**34, backed=False, blas_workspace=0, config=config)
        try:
            state = static_state(device, 19 * MB)
            with state.borrow("build"):
                pass
            image = PoolImage.of(state)
            assert image.config is device.allocator.config and image.runs == ((state.static_runs[0]), )
            assert plan(state, seq(("alloc", 1, 17 * MB))).fits is fits
            assert runs_out(state, device, (17 * MB, None)) is not fits
        finally:
            device.close()


def test_a_used_up_extent_is_not_room():
    """Best fit puts the step's 2 MiB small-pool segment into the 2 MiB run, filling it: the built
    pool's image lists only what the arena can still carve."""
    layout = SimBackend(capacity=2**34, backed=False, blas_workspace=0)
    try:
        state = static_state(layout, 40 * MB, 2 * MB)
        assert not runs_out(state, layout, (4096, None))
        assert state.arena.extent_cursors() == [0, 2 * MB]
        big, _ = state.static_runs
        assert PoolImage.of(state).extents == (big,)
    finally:
        layout.close()


def test_the_arena_alignment_of_the_image_applies():
    """The arena rounds every carve up to its alignment: with 4 MiB, a 2 MiB small-pool segment
    takes 4 MiB and no longer fits a run of 2 MiB and 512 bytes."""
    small = seq(("alloc", 1, 4096))
    assert replay(small, PoolImage.from_runs([(BASE, 2 * MB + 512)])).fits
    assert not replay(small, PoolImage.from_runs([(BASE, 2 * MB + 512)], align=4 * MB)).fits
    assert PoolImage.from_runs([(BASE, MB)]).best_fit is True  # the arena's default policy


def test_plans_take_an_image_and_name_the_request(layout):
    state = static_state(layout, 16 * MB)
    image = PoolImage.of(state)
    medium = seq(("alloc", 1, 5 * MB))
    r = plan(image, medium, describe=lambda n: "the probabilities")
    assert not r.fits and r.failed.label == "the probabilities" and "the probabilities (5.0 MiB)" in r.reason
    assert plan_verify(image, 4, 4, 32000) == plan_verify(state, 4, 4, 32000)


def test_the_status_line_says_what_was_planned():
    layout = SimBackend(capacity=2**36, backed=False, blas_workspace=0)
    try:
        roomy, tight = static_state(layout, 64 * MB), static_state(layout, 1 * MB)
        chunked = plan_verify(roomy, 2, 4, 32000, "chunked")
        assert describe_plan(chunked) == (
            f"bs=2 x D=4, V=32000, chunked fits in groups of 2: peak {chunked.peak_bytes / MB:.1f} MiB of blocks")
        lean = plan_verify(roomy, 2, 4, 32000, "lean")
        assert describe_plan(lean) == f"bs=2 x D=4, V=32000, lean fits: peak {lean.peak_bytes / MB:.1f} MiB of blocks"
        fused = plan_verify(roomy, 32, 8, 128256, "chunked", impl="fused")
        assert describe_plan(fused) == (
            f"bs=32 x D=8, V=128256, chunked (fused kernels) fits: peak {fused.peak_bytes / MB:.1f} MiB of blocks")
        miss = plan_verify(tight, 32, 8, 128256, impl="fused")
        assert describe_plan(miss) == f"bs=32 x D=8, V=128256, standard (fused kernels) does not fit: {miss.reason}"
        assert miss.reason.startswith("the step's allocation #1")
    finally:
        layout.close()


def test_the_fit_policy_pool_has_the_runs_it_promises():
    """A 20 MiB run and a 12 MiB one, and slivers under 2 MiB that can never hold a borrow; a step
    whose small tensors come first and that then needs a 20 MiB segment fits under best fit only,
    and the device agrees."""
    from graphborrow.core.runs import find_free_runs
    from graphborrow.planning.capacity import fit_policy_pool

    device = SimBackend(capacity=2**34, backed=False, blas_workspace=0)
    try:
        demo = fit_policy_pool(device)
        runs = demo.state.free_runs()
        assert find_free_runs(demo.snapshot()) == runs
        assert [n for _, n in runs[:2]] == [20 * MB, 12 * MB]
        assert runs[2:] and all(n < 2 * MB for _, n in runs[2:]) and unborrowable_runs(runs) == runs[2:]
        assert demo.state.precarve is False and len(demo.graphs) == len(demo.outputs) == 2
        step = seq(("alloc", 1, 1000), ("alloc", 2, 5 * MB))
        for best_fit in (True, False):
            demo.state.retire()
            demo.state.best_fit = best_fit
            assert plan(demo.state, step).fits is best_fit
            assert runs_out(demo.state, device, (1000, None), (5 * MB, None)) is not best_fit
        demo.state.retire()
    finally:
        device.close()


# ----------------------------------------------------------------------------- recordings


def test_a_recording_is_the_steps_requests_in_order():
    """(ALLOC, id, bytes, stream) and (FREE, id, 0, stream); what the step returns is released
    after the recording; the inputs keep their dtype."""
    steps = record(lambda x: (x * 2).sum(), inputs=[((1024,), torch.float32)]).events
    assert [(kind, nbytes, stream) for kind, _, nbytes, stream in steps] == [
        ("alloc", 4096, 0), ("alloc", 4, 0), ("free", 0, 0)]
    assert steps[2][1] == steps[0][1] != steps[1][1]
    doubled = record(lambda x: x * 2, inputs=[((1000,), torch.float64)])
    assert [e[2] for e in doubled.events] == [8000]


def test_a_free_waiting_on_another_stream_is_recorded_when_it_completes():
    """A block freed while a busy stream still uses it is not free for the step's next request:
    the recording frees it at free_completed, not at free_requested."""
    with recording() as rec:
        side = rec.device.Stream()
        x = torch.empty(1024, device="cuda")
        with rec.phase() as events:
            y = x * 2
            rec.device.sleep(side, 10**9)
            rec.device.record_stream(y, side)
            del y
            z = x * 3
            del z
        with rec.phase() as before:
            del x  # a block from before the recording is not the step's
    sequence = AllocationSequence(tuple(events))
    assert [e[0] for e in sequence.events] == ["alloc", "alloc", "free"] and sequence.peak_bytes == 2 * 4096
    assert before == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run: pytest -m gpu tests/ on a GPU machine)")
def test_auto_plans_the_fused_kernels_on_cuda():
    """On a CUDA device with Triton, eagle_verify(impl="auto") runs the fused kernels, so the plan
    is the fused step's; the plan holds against the same allocations made on the device."""
    from graphborrow.device import get_backend
    from graphborrow.eagle.step import fused_available

    backend = get_backend("cuda")
    buffer = backend.external_alloc(3 * MB)
    state = BorrowState(backend, precarve=False)
    state.set_static_runs([(buffer.address, buffer.nbytes)])
    auto = plan_verify(state, 32, 8, 128256)
    assert auto.impl == ("fused" if fused_available() else "reference")
    assert auto == plan_verify(state, 32, 8, 128256, impl=auto.impl)
    assert auto.fits is fused_available()  # 3 MiB: the fused step's workspace fits, the reference's matrices do not
    if fused_available():
        assert run_fused_allocations(state, backend, 32, 8, 128256, False)


def test_a_free_of_what_the_sequence_never_allocated_is_refused():
    with pytest.raises(ValueError, match="frees id 7, which it has not allocated"):
        replay(seq(("alloc", 1, 1000), ("free", 1), ("free", 7)), PoolImage.from_runs([(BASE, 4 * MB)]))
    with pytest.raises(ValueError, match="frees id 1, which it has not allocated .or has freed already"):
        replay(seq(("alloc", 1, 1000), ("free", 1), ("free", 1)), PoolImage.from_runs([(BASE, 4 * MB)]))


def test_the_recording_device_is_layout_only_never_runs_out_and_stays_its_own(monkeypatch):
    """A fresh recording device: a step of a size no GPU has records (no bytes behind it), a matmul
    records its output only (no cuBLAS workspace of the recording device's own), and device="cuda"
    keeps meaning the caller's device after the recording."""
    from graphborrow.planning import planner

    monkeypatch.setattr(planner, "_DEVICE", None)
    device = SimBackend(capacity=2**34, backed=False, blas_workspace=0)  # active: "cuda" is this device
    try:
        huge = record(lambda x: x * 2, inputs=[((2**35,), torch.float32)])  # 128 GiB in, 128 GiB out
        assert [e[2] for e in huge.events] == [2**37]
        matmul = record(lambda a, b: a @ b, inputs=[((64, 64), torch.float32)] * 2)
        assert [e[2] for e in matmul.events] == [64 * 64 * 4]
        before = device.memory_stats()["allocation.all.current"]
        t = torch.empty(4, device="cuda")
        assert device.memory_stats()["allocation.all.current"] == before + 1
        del t
    finally:
        if planner._DEVICE is not None:
            planner._DEVICE.close()
        device.close()
