"""plan_verify and the size classes, against borrows made with the real BorrowState."""

import pytest
import torch

from graphborrow.borrow import BorrowState
from graphborrow.capacity import describe_plan, largest_borrowable, plan_verify, size_class_table, unborrowable_runs
from graphborrow.draft_tree import DraftTree
from graphborrow.eagle import eagle_verify, verify_bytes
from graphborrow.errors import BorrowCapacityError
from graphborrow.planner import AllocationSequence, PoolImage, plan, record, replay, size_class
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
    assert plan_verify(state, 8, 4, 32000, "chunked").requests_per_chunk == 2  # [8, 32000]: small blocks
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
    assert (r.fits, r.allocations, r.carved_bytes) == (False, 2, 18 * MB)
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
    assert (r.fits, r.allocations, r.carved_bytes) == (False, 0, 30 * MB)
    assert r.failed.index == -1 and r.reason.startswith("building the borrow pool (its precarve)")


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


def test_the_plan_echoes_its_step_and_its_replay(layout):
    state = static_state(layout, 64 * MB)
    p = plan_verify(state, 2, 4, 32000, "lean", top_k=True)
    assert (p.fits, p.mode, p.batch_size, p.draft_tokens, p.vocab, p.top_k, p.top_p) == (
        True, "lean", 2, 4, 32000, True, False)
    assert (p.requests_per_chunk, p.largest_run, p.reason) == (2, 64 * MB, "")
    assert p.carved_bytes >= 2 * MB and p.allocations > 0 and p.peak_bytes > 2 * 4 * 32000
    empty = plan_verify(state, 0, 4, 32000, "lean", top_p=True)
    assert empty == type(empty)(True, 0, 0, "", "lean", 0, 4, 32000, False, True, largest_run=64 * MB)


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
