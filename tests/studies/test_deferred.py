"""Retirement's pending-free report, the early-release hazard, graph write ranges, borrowable ladders."""

import pytest
import torch
from conftest import free_while_a_side_stream_uses

from graphborrow.core.sizes import MB
from graphborrow.device import get_backend
from graphborrow.planning.capacity import largest_borrowable
from graphborrow.studies.deferred import early_release_hazard
from graphborrow.workloads.ladder import (
    GraphLadder,
    ModelShape,
    borrowable_ladder,
    notebook_dtype,
)

SMALL = ModelShape(hidden=256, intermediate=512, layers=2, vocab=4096, dtype=torch.float32)


def _ladder(backend, shape=SMALL, **kw):
    args = dict(prefill_tokens=512, decode_batches=(8, 4, 2, 1), draft_tokens=4)
    args.update(kw)
    return GraphLadder(backend, shape, **args).capture()


@pytest.fixture
def sim():
    b = get_backend("sim")
    yield b
    b.close()


def test_written_ranges_cover_what_replay_changes(sim):
    ladder = _ladder(sim)
    g = ladder.graphs["prefill"]
    ranges = g.written_ranges()
    assert ranges and ranges == sorted(ranges)
    assert all(a + n < b for (a, n), (b, _) in zip(ranges, ranges[1:])), "merged: no touching spans"
    out = ladder.outputs["prefill"]
    a = sim.data_ptr(out)
    assert any(s <= a and a + out.numel() * out.element_size() <= s + n for s, n in ranges), "the output is written"


def test_written_ranges_layout_only_match_backed():
    spans = []
    for backed in (True, False):
        b = get_backend("sim", backed=backed)
        ladder = _ladder(b)
        spans.append([n for _, n in ladder.graphs["prefill"].written_ranges()])
        b.close()
    assert spans[0] == spans[1] and spans[0]


def test_retire_reports_pending_bytes_before_and_after(sim):
    state = _ladder(sim).state
    free_while_a_side_stream_uses(sim, state, MB)
    assert state.pending_free_bytes() == MB
    report = state.retire()
    assert (report.pending_before, report.pending_after, report.built) == (MB, 0, True)
    again = state.retire()
    assert (again.pending_before, again.built) == (0, False)


def test_early_release_hazard_finds_the_replay_that_overwrites(sim):
    ladder = _ladder(sim)
    state = ladder.state
    size = max(largest_borrowable(n, state.precarve_sizes([(0, n)])) for _, n in state.free_runs()) // 4 * 4
    report = early_release_hazard(ladder, size, busy_us=2000)
    assert report.pending_bytes >= size and report.side_busy_us == pytest.approx(2000)
    assert report.overwritten > 0 and report.writers
    assert state.mem_pool is None, "the pool was retired properly afterwards"
    with pytest.raises(ValueError, match="multiple of 4"):
        early_release_hazard(ladder, 3)


def test_borrowable_ladder_falls_back_only_when_nothing_is_borrowable():
    b = get_backend("sim", backed=False)
    assert notebook_dtype(b) == torch.bfloat16
    tiny = _ladder(b, ModelShape(hidden=16, intermediate=16, layers=1, vocab=16, dtype=notebook_dtype(b)),
                   prefill_tokens=1, decode_batches=(1,), draft_tokens=1)
    used, note = borrowable_ladder(tiny)
    assert used is not tiny and "No idle run" in note and "largest run" in note
    assert any(largest_borrowable(n) for _, n in used.state.free_runs())
    again, note2 = borrowable_ladder(used)
    assert again is used and note2 == ""
    b.close()
    assert notebook_dtype(get_backend("sim")) == torch.float32
