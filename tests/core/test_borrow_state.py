"""BorrowState rules that need no graph: switches, validation, capacity arithmetic, no-ops."""

import numpy as np
import pytest
import torch
from conftest import Ladder, free_while_a_side_stream_uses

from graphborrow.core.borrow import BorrowState, RetireReport, precarve_bytes
from graphborrow.core.errors import ArenaIntegrityError, PoolBusyError
from graphborrow.core.runs import find_free_runs
from graphborrow.core.sizes import MB


@pytest.fixture
def external(sim):
    buffer = sim.external_alloc(256 * MB)
    yield sim, buffer
    buffer.free()


def test_a_state_without_pool_or_runs_is_disabled_and_a_true_no_op(sim):
    state = BorrowState(sim)
    assert not state.enabled and state.free_runs() == [] and state.largest_run() == 0
    assert not state.can_fit(1)
    with state.borrow("nothing"), state.replay_scope(), state.capture_scope():
        t = torch.empty(4, device="cuda")  # nested scopes are fine when disabled: nothing is claimed
    assert state.holder is None and state.mem_pool is None and state.arena is None
    del t


def test_disable_needs_a_reason_and_enable_restores(external):
    sim, buf = external
    state = BorrowState(sim)
    state.set_static_runs([(buf.address, 64 * MB)])
    with pytest.raises(ValueError, match="needs a reason"):
        state.disable("  ")
    assert state.enabled
    state.disable("graphs live in externally managed storage")
    assert not state.enabled and state.disabled_reason.startswith("graphs live")
    state.enable()
    assert state.enabled


@pytest.mark.parametrize(
    "runs, fragment",
    [
        ([(0x1000, 0)], "static run 0 at 0x1000 has non-positive size 0"),
        ([(0, 4096)], "static run 0 has base 0x0; a base must be a positive address"),
        ([(0x1000 + 100, 4096)], "static run 0 base 0x1064 is not aligned to 512 bytes"),
        ([(1, 4096)], "not aligned to 512 bytes"),  # 1 is a positive address, only misaligned
        ([(0x10000, 8192), (0x11000, 8192)], r"static runs overlap: \[0x10000, 0x12000\) and \[0x11000, 0x13000\)"),
        ([(2**64 - 4096, 8192)], r"static run 0 \[0xfffffffffffff000, 0x10000000000001000\) runs past the end"),
        ([(2**64 + 4096, 4096)], "runs past the end of the 64-bit address space"),
    ],
)
def test_bad_static_runs_are_refused_and_lose_nothing(external, runs, fragment):
    sim, buf = external
    state = BorrowState(sim)
    state.set_static_runs([(buf.address, 64 * MB)])
    with pytest.raises(ValueError, match=fragment):
        state.set_static_runs(runs)
    assert state.static_runs == [(buf.address, 64 * MB)]


@pytest.mark.parametrize("run", [(0x10000, 4096.0), (float(0x10000), 4096), ("0x10000", 4096), (0x10000, "4096"),
                                 (True, 4096), (0x10000, True), (0x10000,), 0x10000])
def test_static_runs_are_integers_never_coerced(external, run):
    sim, buf = external
    state = BorrowState(sim)
    state.set_static_runs([(buf.address, 64 * MB)])
    with pytest.raises(TypeError, match="static run 0"):
        state.set_static_runs([run])
    assert state.static_runs == [(buf.address, 64 * MB)]
    state.set_static_runs([(np.int64(buf.address), np.int64(4096))])  # numpy integers are integers
    assert state.static_runs == [(buf.address, 4096)] and type(state.static_runs[0][0]) is int


def test_a_one_byte_static_run_is_a_positive_size_and_kept(external):
    sim, buf = external
    state = BorrowState(sim)
    state.set_static_runs([(buf.address, 1)])
    assert state.static_runs == [(buf.address, 1)] and state.enabled
    assert not state.can_fit(1)  # kept, but no 512-byte block fits in it


def test_a_replay_scope_holds_the_pool_under_its_own_name(external):
    sim, buf = external
    state = BorrowState(sim)
    state.set_static_runs([(buf.address, 64 * MB)])
    with state.replay_scope():
        assert state.holder == "CUDA graph replay"
        with pytest.raises(PoolBusyError, match="held by 'CUDA graph replay'; cannot start 'late'"):
            with state.borrow("late"):
                pass
    assert state.holder is None


def test_static_runs_may_cover_cached_free_blocks_but_no_live_block_behind_them(sim):
    """Only live blocks are checked: a free (inactive) block is what a run is made of, and
    one before a live block in the same segment must not hide the live one."""
    kib = 1024
    a = torch.empty(512 * kib, dtype=torch.uint8, device="cuda")
    b = torch.empty(512 * kib, dtype=torch.uint8, device="cuda")
    a_ptr, b_ptr = sim.data_ptr(a), sim.data_ptr(b)
    assert b_ptr == a_ptr + 512 * kib  # one small segment: [a][b][rest]
    del a  # [free][b live][rest free]
    state = BorrowState(sim)
    with pytest.raises(ValueError) as refused:
        state.set_static_runs([(b_ptr, 512 * kib)])
    assert str(refused.value) == (
        f"static run [{b_ptr:#x}, {b_ptr + 512 * kib:#x}) overlaps a live tensor's block "
        f"[{b_ptr:#x}, {b_ptr + 512 * kib:#x}) of the caching allocator; static runs are for "
        "storage the allocator does not manage (e.g. backend.external_alloc)"
    )
    assert state.static_runs is None
    state.set_static_runs([(a_ptr, 512 * kib)])  # the cached free block where a was: ends where b starts
    assert state.free_runs() == [(a_ptr, 512 * kib)]
    state.set_static_runs([(b_ptr + 512 * kib, 512 * kib)])  # free, starts where b ends
    assert state.free_runs() == [(b_ptr + 512 * kib, 512 * kib)]
    del b


def test_static_runs_are_sorted_largest_first_and_capped(external):
    sim, buf = external
    state = BorrowState(sim)
    runs = [(buf.address + i * MB, (i % 3 + 1) * 512) for i in range(70)]
    state.set_static_runs(runs)
    sizes = [n for _, n in state.free_runs()]
    assert len(sizes) == 64 and sizes == sorted(sizes, reverse=True)


def test_can_fit_applies_the_allocators_rounding(external):
    sim, buf = external
    state = BorrowState(sim)
    state.set_static_runs([(buf.address, 34 * MB)])  # below the precarve threshold
    assert state.can_fit(1)  # 512 B block in a 2 MiB small segment
    assert state.can_fit(MB)  # still small
    assert state.can_fit(MB + 1)  # a large block gets a 20 MiB segment: fits 34 MiB
    assert state.can_fit(34 * MB)  # a 2 MiB multiple segment of exactly the run
    assert not state.can_fit(34 * MB + 1)
    assert not state.can_fit(0) and not state.can_fit(-5)
    state.set_static_runs([(buf.address, 19 * MB)])
    assert not state.can_fit(MB + 1)  # a 20 MiB segment no longer fits
    assert state.can_fit(18 * MB)  # a request of 10 MiB or more gets a segment of its own size


def test_can_fit_with_precarve_matches_the_pool_it_builds(external):
    sim, buf = external
    state = BorrowState(sim)
    state.set_static_runs([(buf.address, 128 * MB)])  # precarved: one 96 MiB segment + 32 MiB reserve
    assert state.can_fit(96 * MB) and not state.can_fit(96 * MB + 1)
    with state.borrow("probe"):
        t = torch.empty(96 * MB, dtype=torch.uint8, device="cuda")
        # the seed is taken; what is left is the 32 MiB reserve, and the allocator agrees
        assert not state.can_fit(32 * MB + 1)
        with pytest.raises(sim.OutOfMemoryError):
            torch.empty(32 * MB + 1, dtype=torch.uint8, device="cuda")
        assert state.can_fit(32 * MB)
        u = torch.empty(32 * MB, dtype=torch.uint8, device="cuda")
        del t, u
    assert state.can_fit(96 * MB)  # the cached seed is free again


def test_can_fit_a_built_pool_asks_only_its_own_blocks_of_the_request_s_kind(external):
    """Once built, the pool answers from its own cached blocks, small and large kept apart
    (as the allocator keeps them), and from the arena's room; the allocator agrees."""
    sim, buf = external
    plain = torch.empty(64 * MB, dtype=torch.uint8, device="cuda")
    del plain  # a 64 MiB cached block in the default pool: no borrow may count on it
    state = BorrowState(sim)
    state.set_static_runs([(buf.address, 20 * MB)])  # room for one 20 MiB segment, no precarve
    with state.borrow("step"):
        t = torch.empty(MB + 1, dtype=torch.uint8, device="cuda")  # the 20 MiB large segment
        del t  # cached: one free 20 MiB large block, the arena full
        assert state.can_fit(MB + 1) and state.can_fit(20 * MB)
        assert not state.can_fit(20 * MB + 1)  # only the default pool has a block this large
        assert not state.can_fit(512)  # small: needs a 2 MiB small segment, and no room is left
        for nbytes in (20 * MB + 1, 512):
            with pytest.raises(sim.OutOfMemoryError):
                torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        u = torch.empty(20 * MB, dtype=torch.uint8, device="cuda")
        del u


def test_can_fit_a_small_request_from_a_cached_small_block_when_the_arena_is_full(external):
    sim, buf = external
    state = BorrowState(sim)
    state.set_static_runs([(buf.address, 2 * MB)])  # room for one 2 MiB small segment
    with state.borrow("step"):
        t = torch.empty(512, dtype=torch.uint8, device="cuda")  # the small segment fills the arena
        assert state.can_fit(MB) and not state.can_fit(MB + 1)  # large: no room for a 20 MiB segment
        u = torch.empty(MB, dtype=torch.uint8, device="cuda")  # the allocator agrees
        with pytest.raises(sim.OutOfMemoryError):
            torch.empty(MB + 1, dtype=torch.uint8, device="cuda")
        del t, u


def test_state_changes_are_refused_while_a_scope_holds_the_pool(external):
    sim, buf = external
    state = BorrowState(sim)
    state.set_static_runs([(buf.address, 64 * MB)])
    with state.borrow("step"):
        for action, words in ((lambda: state.retire(), "retire the borrow pool"),
                              (lambda: state.disable("x"), "disable borrowing"),
                              (lambda: state.set_static_runs([]), "replace the static runs"),
                              (lambda: state.clear_static_runs(), "clear the static runs")):
            with pytest.raises(PoolBusyError) as refused:
                action()
            assert str(refused.value) == (
                f"cannot {words} while the graph pool is held by 'step'; leave that scope first"
            )
            assert state.holder == "step" and state.enabled and state.static_runs == [(buf.address, 64 * MB)]
    assert state.holder is None and state.enabled


def test_stats_report_the_pool(external):
    sim, buf = external
    state = BorrowState(sim)
    state.set_static_runs([(buf.address, 64 * MB)])
    with state.borrow("step"):
        t = torch.empty(MB, dtype=torch.uint8, device="cuda")
        del t
    stats = state.stats()
    assert stats["enabled"] and stats["pool_built"] and stats["builds"] == 1
    assert stats["runs"] == 1 and stats["largest_run"] == 64 * MB
    assert stats["cursor_bytes"] > 0 and stats["high_water"] == stats["cursor_bytes"]


def test_stats_report_the_pool_and_arena(external):
    sim, buf = external
    state = BorrowState(sim)
    state.set_static_runs([(buf.address, 128 * MB), (buf.address + 128 * MB, 64 * MB)])
    before = state.stats()
    assert before == {
        "enabled": True, "disabled_reason": None, "holder": None, "runs": 2,
        "run_bytes": 192 * MB, "largest_run": 128 * MB, "pool_built": False, "builds": 0,
        "cursor_bytes": 0, "freed_bytes": 0, "arena_errors": 0, "high_water": 0,
    }
    with state.borrow("stats"):
        t = torch.empty(4 * MB, dtype=torch.uint8, device="cuda")
        inside = state.stats()
        del t
    assert inside["holder"] == "stats" and inside["pool_built"] and inside["builds"] == 1
    assert inside["cursor_bytes"] > 0 and inside["high_water"] == inside["cursor_bytes"]
    state.disable("stats test")
    after = state.stats()
    assert {k: v for k, v in after.items() if k not in ("cursor_bytes", "freed_bytes")} == {
        "enabled": False, "disabled_reason": "stats test", "holder": None, "runs": 0,
        "run_bytes": 0, "largest_run": 0, "pool_built": False, "builds": 1,
        "arena_errors": 0, "high_water": inside["cursor_bytes"],
    }


def test_stats_count_the_frees_the_arena_refused_and_retirement_reports_them(external):
    sim, buf = external
    state = BorrowState(sim)
    state.set_static_runs([(buf.address, 64 * MB)])
    with state.borrow("step"):
        t = torch.empty(MB, dtype=torch.uint8, device="cuda")
        del t
    state.arena.raw_delete(buf.address + 200 * MB, 4096)  # never handed out: refused and counted
    assert state.stats()["arena_errors"] == 1
    with pytest.raises(ArenaIntegrityError, match=r"at borrow-pool retirement: the borrow pool's arena refused 1 free\(s\)"):
        state.retire()
    assert state.mem_pool is None  # retired all the same; the refusal is reported once, not again
    with state.borrow("next"):
        t = torch.empty(MB, dtype=torch.uint8, device="cuda")
        del t
    assert state.retire().built and state.stats()["arena_errors"] == 1  # the same arena, counted once


def test_clearing_static_runs_goes_back_to_the_pool_and_is_refused_while_held(external):
    sim, buf = external
    state = BorrowState(sim)
    state.set_static_runs([(buf.address, 64 * MB)])
    with state.borrow("held"):
        with pytest.raises(PoolBusyError, match="clear the static runs"):
            state.clear_static_runs()
    assert state.static_runs == [(buf.address, 64 * MB)] and state.mem_pool is not None
    state.clear_static_runs()
    assert state.static_runs is None and state.mem_pool is None and not state.enabled


def test_runs_come_only_from_the_state_s_pool_whatever_the_snapshot_holds(sim, monkeypatch):
    """A pool's snapshot is filtered again by ``segment_pool_id``: a backend that answers
    with every pool's segments still yields only this pool's runs, and segments that carry
    no pool id (a hand-made snapshot) are taken as the pool's."""
    state = BorrowState(sim, pool_id=sim.graph_pool_handle())
    Ladder(sim, state, sizes_mib=(24, 12))
    own = state.free_runs()
    plain = torch.empty(8 * MB, dtype=torch.uint8, device="cuda")
    del plain  # a free 20 MiB segment of the default pool: never a run
    assert own and any(tuple(s["segment_pool_id"]) != tuple(state.pool_id) for s in sim.memory_snapshot())
    every = sim.allocator.snapshot(None)
    monkeypatch.setattr(sim, "memory_snapshot", lambda pool_id=None: every)
    assert BorrowState(sim, pool_id=state.pool_id).free_runs() == own
    unlabelled = [{k: v for k, v in s.items() if k != "segment_pool_id"}
                  for s in sim.allocator.snapshot(tuple(state.pool_id))]
    monkeypatch.setattr(sim, "memory_snapshot", lambda pool_id=None: unlabelled)
    assert BorrowState(sim, pool_id=state.pool_id).free_runs() == own


def test_the_precarved_seed_is_the_run_less_the_reserve_in_2_mib_steps_from_the_minimum_up():
    assert precarve_bytes(96 * MB) == 64 * MB  # exactly the 64 MiB minimum: precarved
    assert precarve_bytes(96 * MB - 1) == 0  # 62 MiB once rounded down: none
    assert precarve_bytes(129 * MB) == 96 * MB
    assert precarve_bytes(40 * MB, reserve=8 * MB, minimum=32 * MB) == 32 * MB


def test_a_refused_free_is_reported_at_the_start_of_the_next_borrow_which_then_did_not_happen(external):
    sim, buf = external
    state = BorrowState(sim)
    state.set_static_runs([(buf.address, 64 * MB)])
    with state.borrow():  # the default name
        assert state.holder == "borrow"
        t = torch.empty(MB, dtype=torch.uint8, device="cuda")
        del t
    state.arena.raw_delete(buf.address + 200 * MB, 4096)  # never handed out: refused and counted
    with pytest.raises(ArenaIntegrityError, match=r"^at the start of 'verify': the borrow pool's arena refused 1 free"):
        with state.borrow("verify"):
            pass
    assert state.holder is None and sim.allocator.captures_underway == []
    with state.borrow("verify"):  # reported once: the next one goes ahead
        assert state.holder == "verify"
    for _ in range(2):
        state.arena.raw_delete(buf.address + 200 * MB, 4096)
    with pytest.raises(ArenaIntegrityError, match=r"^at the start of 'again': the borrow pool's arena refused 2 free"):
        with state.borrow("again"):  # counts only the refusals since the last report
            pass


def test_equal_static_runs_come_lowest_address_first_whatever_order_they_are_given_in(external):
    sim, buf = external
    state = BorrowState(sim)
    state.set_static_runs([(buf.address + 2 * MB, MB), (buf.address + 8 * MB, 2 * MB), (buf.address, MB)])
    assert state.free_runs() == [(buf.address + 8 * MB, 2 * MB), (buf.address, MB), (buf.address + 2 * MB, MB)]


def test_the_whole_segments_policy_reaches_the_runs_a_state_finds(sim):
    """The seed's rule (only wholly free segments) is what a state built with it borrows."""
    pool = sim.graph_pool_handle()
    merged = BorrowState(sim, pool_id=pool)
    Ladder(sim, merged, sizes_mib=(24, 12))
    graph = sim.CUDAGraph()
    with merged.capture_scope(), sim.graph(graph, pool=pool):
        kept = torch.zeros(4 * MB, dtype=torch.uint8, device="cuda")  # lives in one free segment
    whole = BorrowState(sim, pool_id=pool, policy="whole_segments")
    segments = sim.allocator.snapshot(tuple(pool))
    assert whole.free_runs() == find_free_runs(segments, "whole_segments")
    assert merged.free_runs() == find_free_runs(segments, "runs")
    assert whole.free_runs() != merged.free_runs(), "the two rules differ on this pool"
    del kept


def test_retire_reports_what_it_found(external):
    """No pool: nothing to report and built False. A pool whose borrowed tensor was last used
    on a side stream: its bytes were pending before the synchronise and none after."""
    sim, buf = external
    state = BorrowState(sim)
    assert state.retire() == RetireReport(0, 0, built=False)
    state.set_static_runs([(buf.address, 64 * MB)])
    with state.borrow():
        t = torch.empty(MB, dtype=torch.uint8, device="cuda")
        del t
    assert state.retire() == RetireReport(0, 0, built=True)
    free_while_a_side_stream_uses(sim, state, MB)
    assert state.retire() == RetireReport(MB, 0, built=True)


def test_pending_and_live_bytes_count_only_the_borrow_pool(external):
    sim, buf = external
    state = BorrowState(sim)
    assert state.pending_free_bytes() == 0 and state.live_borrowed_bytes() == 0  # no pool yet
    state.set_static_runs([(buf.address, 64 * MB)])
    with state.borrow():
        t = torch.empty(MB, dtype=torch.uint8, device="cuda")
        del t
    side = sim.Stream()
    plain = torch.ones(MB // 4, device="cuda")  # in the default pool, freed pending the side stream
    sim.sleep(side, 1000)
    sim.record_stream(plain, side)
    del plain
    everywhere = [b["state"] for seg in sim.memory_snapshot() for b in seg["blocks"]]
    assert "active_pending_free" in everywhere, "a free is pending outside the borrow pool"
    assert state.pending_free_bytes() == 0 and state.live_borrowed_bytes() == 0
    sim.synchronize()


def test_a_clean_replay_clears_the_pending_leak_check(external):
    """The leak check costs a snapshot, so it runs at the first replay after a borrow, not at every one."""
    sim, buf = external
    state = BorrowState(sim)
    state.set_static_runs([(buf.address, 64 * MB)])
    with state.borrow():
        t = torch.empty(MB, dtype=torch.uint8, device="cuda")
        del t
    assert state.check_pending
    with state.replay_scope():
        pass
    assert not state.check_pending


def test_retire_refuses_to_drop_a_pool_whose_frees_the_device_never_completes(external, monkeypatch):
    sim, buf = external
    state = BorrowState(sim)
    state.set_static_runs([(buf.address, 64 * MB)])
    side = sim.Stream()
    with state.borrow():
        t = torch.ones(MB // 4, device="cuda")
        sim.sleep(side, 1000)
        with sim.stream(side):
            t.mul_(2)
        sim.record_stream(t, side)
        del t
    monkeypatch.setattr(sim, "touch", lambda: None)  # no allocation processes the completed events
    with pytest.raises(RuntimeError, match=rf"^{MB} bytes of the borrow pool are still pending a cross-stream free"):
        state.retire()
    assert state.mem_pool is not None, "the pool is kept while a free is pending"


def test_runs_read_inside_a_capture_are_read_again_after_it(sim):
    """A capture re-carves the free space: runs a caller read while it ran (a notebook showing
    the pool mid-capture) must not be what the state lends once it ends."""
    pool = sim.graph_pool_handle()
    state = BorrowState(sim, pool_id=pool)
    Ladder(sim, state, sizes_mib=(24, 12))
    graph = sim.CUDAGraph()
    with state.capture_scope(), sim.graph(graph, pool=pool):
        during = state.free_runs()
        kept = torch.zeros(4 * MB, dtype=torch.uint8, device="cuda")
    after = find_free_runs(sim.allocator.snapshot(tuple(pool)), "runs")
    assert after != during and state.free_runs() == after
    del kept


def test_stats_report_the_bytes_the_arena_got_back(external):
    """Retiring hands the pool's segments back to the arena; stats say how many bytes came back."""
    sim, buf = external
    state = BorrowState(sim)
    state.set_static_runs([(buf.address, 64 * MB)])
    with state.borrow("step"):
        t = torch.empty(4 * MB, dtype=torch.uint8, device="cuda")
        del t
    state.retire()
    assert state.arena.freed_bytes > 0 and state.stats()["freed_bytes"] == state.arena.freed_bytes


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(backend=object()), TypeError, "backend must be a device, get_backend('cuda') or get_backend('sim'); got object"),
    (dict(pool_id=5), TypeError, "pool_id must be a graph pool handle, the pair of ints"),
    (dict(pool_id=(0, 1.5)), TypeError, "pool_id must be a graph pool handle"),
    (dict(pool_id=(0, 1, 2)), TypeError, "pool_id must be a graph pool handle"),
    (dict(policy="largest"), ValueError, "policy must be one of ('runs', 'whole_segments'), got 'largest'"),
    (dict(best_fit=1), TypeError, "best_fit must be True or False, got int (1)"),
    (dict(precarve="yes"), TypeError, "precarve must be True or False, got str ('yes')"),
    (dict(precarve_reserve=-64 * MB), ValueError, "precarve_reserve=-67108864 must be a number of bytes in [0, 2**64)"),
    (dict(precarve_reserve=1.5), TypeError, "precarve_reserve must be an integer, got float"),
    (dict(precarve_min=2**64), ValueError, "precarve_min=18446744073709551616 must be a number of bytes"),
    (dict(precarve_min=MB), ValueError, "precarve_min=1048576 is below 10 MiB"),
])
def test_every_constructor_argument_is_checked(sim, kwargs, error, message):
    kwargs = {"backend": sim, **kwargs}
    with pytest.raises(error) as refused:
        BorrowState(**kwargs)
    assert message in str(refused.value)


def test_a_valid_pool_handle_is_kept_as_a_tuple_of_ints(sim):
    handle = sim.graph_pool_handle()
    state = BorrowState(sim, pool_id=list(handle), precarve_reserve=np.int64(0))
    assert state.pool_id == tuple(handle) and type(state.precarve_reserve) is int


@pytest.mark.parametrize("nbytes", [True, 1.5, "4096", None])
def test_can_fit_takes_a_size_in_bytes_only(external, nbytes):
    sim, buf = external
    state = BorrowState(sim)
    state.set_static_runs([(buf.address, 64 * MB)])
    with pytest.raises(TypeError, match="can_fit's nbytes must be an integer"):
        state.can_fit(nbytes)
    assert state.can_fit(np.int64(4096))
