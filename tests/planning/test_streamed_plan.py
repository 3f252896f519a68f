"""A step that cannot fit is refused at its first request the pool cannot serve, however large the batch.

The planner records a phase it does not know yet while the replay listens, and stops the
recording there. The work is counted on the recording device itself (its allocator's
count of allocations, which every recorded tensor goes through), never timed.
"""

import pytest

from graphborrow.eagle import StepShape, verify_bytes
from graphborrow.eagle.plan import plan_verify
from graphborrow.eagle.sequence import PREPARE, ROWS, plan_step, requests_per_chunk, verify_sequence
from graphborrow.planning import planner
from graphborrow.planning.planner import PoolImage
from graphborrow.planning.stored import STORE_ENV

MB = 2**20


@pytest.fixture(autouse=True)
def record_afresh(monkeypatch):
    """Every phase is recorded in the test (none read from the store on disk or kept in memory)."""
    monkeypatch.setenv(STORE_ENV, "0")
    for store in (PREPARE, ROWS):
        store.cache_clear()
    yield
    for store in (PREPARE, ROWS):
        store.cache_clear()


def recorded_allocations(run) -> int:
    """How many allocations the recording device served while ``run()`` ran."""
    device = planner._layout_device()
    before = device.memory_stats()["allocation.all.allocated"]
    run()
    return device.memory_stats()["allocation.all.allocated"] - before


@pytest.mark.parametrize("mode", ["standard", "lean"])
def test_the_refusal_does_the_same_work_for_any_batch(mode):
    """A 64 MiB pool and steps of [bs*D, V] float32 probabilities far beyond it: the first matrix
    is refused, and the step's rows (walked 131 at a time at V = 32000) are never recorded."""
    image = PoolImage.from_runs([(1 << 40, 64 * MB)])
    counts, plans = [], []
    for bs in (10**3, 10**4, 10**5):
        counts.append(recorded_allocations(lambda: plans.append(plan_verify(image, bs, 4, 32000, mode))))
    assert not any(p.fits for p in plans)
    assert len({p.allocations for p in plans}) == 1, "refused at the same request"
    assert "32000] float32 matrix" in plans[-1].reason
    assert counts[0] == counts[1] == counts[2], f"recorded allocations grew with the batch: {counts}"
    assert counts[0] < 200


def test_a_stopped_recording_keeps_nothing_and_leaves_no_tensor_behind():
    shape = StepShape(2000, 4, 32000, False, False)
    device = planner._layout_device()
    refused = plan_step(PoolImage.from_runs([(1 << 40, 64 * MB)]), shape, "standard")
    assert not refused.fits
    assert (shape, "standard") not in ROWS._memory, "an incomplete recording was kept"
    assert device.memory_stats()["allocated_bytes.all.current"] == 0, "the stopped step's tensors went back"
    # the step's peak is the whole step's, recorded when asked for, and plans that fit still see every request
    assert refused.peak_bytes == verify_bytes(2000, 4, 32000, "standard")
    roomy = plan_step(PoolImage.from_runs([(1 << 40, 4096 * MB)]), shape, "standard")
    assert roomy.fits and roomy.replay.allocations == verify_sequence(shape, "standard").allocations


def test_a_step_refused_in_its_last_request_is_kept_whole():
    """A phase whose last request is the one refused completes: it is kept, and a later plan reads it."""
    shape = StepShape(3, 2, 1000, False, False)
    whole = verify_sequence(shape, "standard")
    ROWS.cache_clear()
    PREPARE.cache_clear()
    before = planner.replay(whole, PoolImage.from_runs([(1 << 40, 64 * MB)]))
    assert before.fits
    assert plan_step(PoolImage.from_runs([(1 << 40, 64 * MB)]), shape, "standard").replay == before
    assert (shape, "standard") in ROWS._memory


def test_chunked_stops_searching_when_prepare_does_not_fit():
    """prepare's [bs, D] tensors come before any group: when they do not fit, no group size does, and
    the search ends after one try (the fallback plan for one request per group is the second)."""
    image = PoolImage.from_runs([(1 << 40, 2 * MB)])
    shape = StepShape(10**5, 4, 1000, False, False)
    standard = recorded_allocations(lambda: plan_step(image, shape, "standard"))
    found = []
    chunked = recorded_allocations(lambda: found.append(requests_per_chunk(image, shape)))
    assert not found[0].fits and found[0].requests_per_chunk == 1
    assert found[0].replay.failed.index < PREPARE(10**5, 4, False, False)[0].allocations
    assert chunked <= 2 * standard, (chunked, standard)


@pytest.mark.parametrize("run_mib", [3, 12, 24, 48])
def test_the_chunked_search_finds_the_largest_group_that_fits(run_mib):
    """Against trying every group size from the whole batch down."""
    image = PoolImage.from_runs([(1 << 40, run_mib * MB), (2 << 40, 2 * MB)])
    shape = StepShape(24, 4, 32000, False, False)
    fitting = [per for per in range(shape.batch_size, 0, -1) if plan_step(image, shape, "chunked", per).fits]
    found = requests_per_chunk(image, shape)
    assert found.fits == bool(fitting)
    assert found.requests_per_chunk == (fitting[0] if fitting else 1)
