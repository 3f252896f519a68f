"""The bump arena: semantics, invariants, threads and concurrent builds."""

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graphborrow.arena import BumpArena, library_path

MiB = 1 << 20


@pytest.fixture
def arena():
    return BumpArena()


def test_defaults(arena):
    assert arena.align == 512
    assert arena.best_fit is True
    assert BumpArena.MAX_EXTENTS == 64
    assert arena.cursor_bytes == 0 and arena.freed_bytes == 0


def test_nothing_fits_without_extents(arena):
    assert arena.malloc(1) == 0


def test_sizes_round_up_to_alignment(arena):
    arena.set_extents([(1 << 30, 4096)])
    assert arena.malloc(1) == 1 << 30
    assert arena.malloc(512) == (1 << 30) + 512
    assert arena.malloc(513) == (1 << 30) + 1024
    assert arena.cursor_bytes == 2048
    assert arena.malloc(2049) == 0  # 2560 needed, 2048 left
    assert arena.malloc(2048) == (1 << 30) + 2048
    assert arena.malloc(1) == 0


def test_best_fit_takes_least_room_earliest_on_tie(arena):
    arena.set_extents([(1 << 30, 8 * MiB), (2 << 30, 2 * MiB), (3 << 30, 2 * MiB), (4 << 30, 4 * MiB)])
    assert arena.malloc(MiB) == 2 << 30  # the 2 MiB extents tie; the earlier wins
    assert arena.malloc(MiB) == (2 << 30) + MiB  # it now has the least room that fits
    assert arena.malloc(MiB) == 3 << 30  # full; the other 2 MiB extent is next
    assert arena.malloc(3 * MiB) == 4 << 30  # only the 4 and 8 MiB extents fit; 4 is tighter
    assert arena.extent_cursors() == [0, 2 * MiB, MiB, 3 * MiB]


def test_first_fit_takes_list_order(arena):
    arena.best_fit = False
    arena.set_extents([(1 << 30, 8 * MiB), (2 << 30, 2 * MiB)])
    assert arena.malloc(MiB) == 1 << 30
    assert arena.malloc(MiB) == (1 << 30) + MiB


def test_set_extents_resets_cursors_and_freed(arena):
    arena.set_extents([(1 << 30, MiB)])
    p = arena.malloc(4096)
    arena.free(p, 4096)
    assert arena.freed_bytes == 4096 and arena.cursor_bytes == 4096
    arena.set_extents([(1 << 30, MiB)])
    assert arena.freed_bytes == 0 and arena.cursor_bytes == 0
    assert arena.malloc(4096) == 1 << 30  # reused only after a reset


def test_free_does_not_reuse(arena):
    arena.set_extents([(1 << 30, 1024)])
    p = arena.malloc(1024)
    arena.free(p, 1024)
    assert arena.malloc(512) == 0


def test_instances_have_their_own_state():
    a, b = BumpArena(), BumpArena()
    assert a.slot != b.slot
    a.set_extents([(1 << 30, MiB)])
    assert b.malloc(1) == 0
    b.best_fit = False
    assert a.best_fit is True
    a.malloc(1000)
    assert b.cursor_bytes == 0


def test_slots_are_returned_when_an_arena_dies():
    slots = {BumpArena().slot for _ in range(3 * BumpArena.MAX_SLOTS)}
    assert len(slots) <= BumpArena.MAX_SLOTS


@pytest.mark.parametrize(
    "extents, fragment",
    [
        ([(1 << 30, MiB)] * 65, "at most 64"),
        ([(1 << 30, 0)], "non-positive size"),
        ([(1 << 30, -5)], "non-positive size"),
        ([((1 << 30) + 100, MiB)], "not aligned"),
        ([(1 << 30, 2 * MiB), ((1 << 30) + MiB, MiB)], "overlap"),
        ([(0, MiB)], "positive address"),
    ],
)
def test_invalid_extents_are_rejected_and_lose_nothing(arena, extents, fragment):
    arena.set_extents([(1 << 32, MiB)])
    arena.malloc(4096)
    with pytest.raises(ValueError, match=fragment):
        arena.set_extents(extents)
    assert arena.extents == [(1 << 32, MiB)]
    assert arena.cursor_bytes == 4096


def test_alignment_is_settable_and_validated(arena):
    arena.align = 4096
    arena.set_extents([(1 << 30, MiB)])
    arena.malloc(1)
    assert arena.malloc(1) == (1 << 30) + 4096
    with pytest.raises(ValueError, match="power of two"):
        arena.align = 1000
    with pytest.raises(ValueError, match="not aligned"):
        arena.set_extents([((1 << 30) + 512, MiB)])


extent_lists = st.lists(
    st.tuples(st.integers(1, 64), st.integers(1, 4096)), min_size=1, max_size=12
)


@settings(max_examples=150, deadline=None)
@given(extent_lists, st.lists(st.integers(0, 300_000), max_size=60), st.booleans(), st.sampled_from([512, 4096]))
def test_allocations_never_overlap_stay_inside_and_are_aligned(layout, sizes, best_fit, align):
    arena = BumpArena(align=align, best_fit=best_fit)
    extents, base = [], 1 << 30
    for gap_pages, npages in layout:  # disjoint by construction, with gaps
        base += gap_pages * align
        extents.append((base, npages * align))
        base += npages * align
    arena.set_extents(extents)
    taken = []
    for n in sizes:
        p = arena.malloc(n)
        if p == 0:
            need = -(-max(n, 1) // align) * align
            rooms = [size - cur for (_, size), cur in zip(extents, arena.extent_cursors())]
            assert max(rooms) < need  # refusing is only allowed when nothing fits
            continue
        assert p % align == 0
        end = p + max(n, 1)
        assert any(b <= p and end <= b + s for b, s in extents)
        taken.append((p, end))
    taken.sort()
    for (a0, a1), (b0, _) in zip(taken, taken[1:]):
        assert a1 <= b0


def test_threads_calling_malloc_concurrently_get_disjoint_blocks(arena):
    arena.set_extents([(1 << 30, 64 * MiB), (1 << 31, 64 * MiB)])
    results = [[] for _ in range(8)]

    def worker(out):
        for _ in range(2000):
            out.append(arena.malloc(4096))

    threads = [threading.Thread(target=worker, args=(r,)) for r in results]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ptrs = [p for r in results for p in r]
    assert 0 not in ptrs
    assert len(set(ptrs)) == len(ptrs) == 16000
    assert arena.cursor_bytes == 16000 * 4096


def test_two_processes_build_the_library_at_once(tmp_path):
    code = (
        "from graphborrow.arena import BumpArena, library_path\n"
        "a = BumpArena(); a.set_extents([(1 << 30, 1 << 20)])\n"
        "assert a.malloc(100) == 1 << 30\n"
        "print(library_path())\n"
    )
    env = dict(os.environ, GRAPHBORROW_CACHE_DIR=str(tmp_path))
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e for _, e in outs]
    paths = {o.strip() for o, _ in outs}
    assert len(paths) == 1
    built = list(tmp_path.iterdir())
    assert [p.name for p in built] == [Path(paths.pop()).name]  # no half-written leftovers


def test_library_is_cached_by_source_hash():
    first = library_path()
    assert library_path() == first
    assert first.name.startswith("libgbarena-") and first.suffix == ".so"
