"""The bump arena: semantics, invariants, threads and concurrent builds."""

import ctypes
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graphborrow.core.arena import BumpArena, library_path
from graphborrow.core.native import digest_path
from graphborrow.core.native import is_intact as library_is_intact

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
        "from graphborrow.core.arena import BumpArena, library_path\n"
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
    library = Path(paths.pop())
    built = sorted(p.name for p in tmp_path.iterdir())
    assert built == [library.name, digest_path(library).name]  # no half-written leftovers
    assert library_is_intact(library)


def test_library_is_cached_by_source_hash():
    first = library_path()
    assert library_path() == first
    assert first.name.startswith("libgbarena-") and first.suffix == ".so"


# ---------------------------------------------------------------- build cache


def _run(code, cache, **env):
    full = dict(os.environ, GRAPHBORROW_CACHE_DIR=str(cache), **env)
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=120)


BUILD_AND_USE = (
    "from graphborrow.core.arena import BumpArena, library_path\n"
    "a = BumpArena(); a.set_extents([(1 << 30, 1 << 20)])\n"
    "assert a.malloc(100) == 1 << 30\n"
    "print(library_path())\n"
)


@pytest.mark.parametrize("damage", ["truncate", "empty", "garbage", "no digest"])
def test_a_damaged_cached_library_is_rebuilt_not_loaded(tmp_path, damage):
    first = _run(BUILD_AND_USE, tmp_path)
    assert first.returncode == 0, first.stderr
    library = Path(first.stdout.strip())
    data = library.read_bytes()
    if damage == "truncate":
        library.write_bytes(data[: len(data) // 2])  # loading this could raise SIGBUS
    elif damage == "empty":
        library.write_bytes(b"")
    elif damage == "garbage":
        library.write_bytes(b"\x7fELF" + b"\0" * (len(data) - 4))
    else:
        digest_path(library).unlink()
    assert not library_is_intact(library)
    second = _run(BUILD_AND_USE, tmp_path)
    assert second.returncode == 0, second.stderr  # a signal would show as a negative code
    assert library_is_intact(library) and library.read_bytes() == data


@pytest.mark.parametrize("cc", ["false", "/nonexistent/cc"])
def test_a_failed_build_names_the_problem_and_leaves_no_temporaries(tmp_path, cc):
    env = {"CC": cc}
    if cc.startswith("/nonexistent"):
        env["PATH"] = str(tmp_path / "empty-path")  # no cc, gcc or clang to fall back to
    result = _run("from graphborrow.core.arena import library_path\nlibrary_path()\n", tmp_path / "cache", **env)
    assert result.returncode == 1
    assert ("building the bump arena failed" in result.stderr) or ("no C compiler found" in result.stderr)
    assert list((tmp_path / "cache").iterdir()) == []


def test_an_unwritable_cache_names_the_setting_that_fixes_it(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    result = _run("from graphborrow.core.arena import library_path\nlibrary_path()\n", blocker / "cache")
    assert result.returncode == 1 and "GRAPHBORROW_CACHE_DIR" in result.stderr


def test_stale_build_temporaries_are_swept(tmp_path):
    old = tmp_path / ".build-dead.so"
    old.write_bytes(b"")
    os.utime(old, (0, 0))  # left by a build killed long ago
    fresh = tmp_path / ".build-running.so"
    fresh.write_bytes(b"")  # a build in progress right now: kept
    assert _run(BUILD_AND_USE, tmp_path).returncode == 0
    assert not old.exists() and fresh.exists()


# ---------------------------------------------------------------- bounds and checked frees

from graphborrow.core.arena import ADDRESS_LIMIT, _library  # noqa: E402
from graphborrow.core.errors import ArenaFreeError  # noqa: E402


def _c_set_extents(arena, extents):
    """set_extents straight into C, past the Python checks: the C checks must hold alone."""
    n = len(extents)
    bases = (ctypes.c_uint64 * n)(*[b for b, _ in extents])
    sizes = (ctypes.c_size_t * n)(*[s for _, s in extents])
    return _library().gb_arena_set_extents(arena.slot, bases, sizes, n)


@pytest.mark.parametrize("base, size", [
    (ADDRESS_LIMIT - 4096, 4096),          # ends exactly at 2**64
    (ADDRESS_LIMIT - 4096, 8192),          # wraps past it
    (1 << 30, ADDRESS_LIMIT - 512),        # a size no address space holds
])
def test_an_extent_past_the_end_of_the_address_space_is_refused(arena, base, size):
    arena.set_extents([(1 << 32, MiB)])
    with pytest.raises(ValueError, match="past the end of the 64-bit address space"):
        arena.set_extents([(base, size)])
    assert _c_set_extents(arena, [(base, size)]) == -7
    assert arena.extents == [(1 << 32, MiB)] and arena.malloc(512) == 1 << 32


def test_an_extent_past_the_end_is_refused_naming_its_range(arena):
    with pytest.raises(ValueError) as info:
        arena.set_extents([(1 << 30, MiB), (ADDRESS_LIMIT - 4096, 8192)])
    assert str(info.value) == (
        "extent 1 [0xfffffffffffff000, 0x10000000000001000) runs past the end of the 64-bit "
        "address space; every extent must end below 2**64"
    )


def test_extents_that_fit_right_below_the_end_are_accepted(arena):
    top = ADDRESS_LIMIT - 1 - 4096 - 511  # last byte below 2**64 - 1, aligned base
    top -= top % 512
    arena.set_extents([(top, 4096)])
    assert arena.malloc(4096) == top and arena.malloc(1) == 0


@pytest.mark.parametrize("nbytes", [ADDRESS_LIMIT - 1, ADDRESS_LIMIT - 511, ADDRESS_LIMIT - 512, 1 << 63])
def test_a_request_near_two_to_the_64_gets_nothing_and_takes_nothing(arena, nbytes):
    arena.set_extents([(1 << 30, MiB)])
    first = arena.malloc(4096)
    assert _library().gb_arena_malloc(arena.slot, nbytes) is None  # the C check, unaided
    assert arena.malloc(nbytes) == 0
    assert arena.cursor_bytes == 4096 and arena.live_count == 1
    second = arena.malloc(4096)
    assert second == first + 4096  # nobody else got this memory


def test_sizes_beyond_the_address_space_and_non_integers_are_refused(arena):
    arena.set_extents([(1 << 30, MiB)])
    with pytest.raises(ValueError, match="below 2\\*\\*64"):
        arena.malloc(ADDRESS_LIMIT + 4096)  # ctypes would silently keep only the low bits
    with pytest.raises(ValueError, match="negative"):
        arena.malloc(-1)
    for bad in (1.5, "4096", None):
        with pytest.raises(TypeError, match="integer"):
            arena.malloc(bad)
    with pytest.raises(TypeError, match="integer"):
        arena.set_extents([(float(1 << 30), MiB)])
    with pytest.raises(TypeError, match="pair"):
        arena.set_extents([(1 << 30,)])
    with pytest.raises(ValueError, match="past the end"):
        arena.set_extents([(ADDRESS_LIMIT + (1 << 30), MiB)])  # would wrap to 1 << 30 in ctypes
    assert arena.cursor_bytes == 0


@pytest.mark.parametrize("new_align", [1024, 4096, 1 << 20])
def test_raising_align_after_set_extents_still_gives_aligned_disjoint_pointers(arena, new_align):
    arena.set_extents([(1 << 30, 4 * MiB), ((1 << 30) + 8 * MiB + 512, 4 * MiB - 512)])
    taken = [(arena.malloc(700), 700)]  # the first extent's cursor is now 1024, a 512 multiple
    arena.align = new_align
    for n in (1, 3000, 5000, 1):
        p = arena.malloc(n)
        assert p and p % new_align == 0
        taken.append((p, n))
    taken.sort()
    for (a, n), (b, _) in zip(taken, taken[1:]):
        assert a + n <= b
    for p, n in taken:
        assert any(b <= p and p + n <= b + s for b, s in arena.extents)


def test_the_padding_an_alignment_costs_counts_against_room(arena):
    arena.set_extents([(1 << 30, 8192)])
    assert arena.malloc(512) == 1 << 30
    arena.align = 4096
    assert arena.malloc(4096) == (1 << 30) + 4096  # skips to the next 4096 boundary
    assert arena.malloc(1) == 0  # the extent is used up, padding included
    assert arena.cursor_bytes == 8192


def test_a_valid_free_counts_once_and_bad_frees_change_nothing(arena):
    arena.set_extents([(1 << 30, MiB)])
    p, q = arena.malloc(1000), arena.malloc(3000)
    arena.free(p, 1000)
    assert arena.freed_bytes == 1000 and arena.live_count == 1
    cases = [
        ((p, 1000), "double free"),
        ((p + 512, 1000), "double free"),  # inside carved memory, not a live start
        ((0x1234_0000, 1000), "never returned"),
        ((q, 2999), "made for 3000 bytes"),
        ((q, -1), "negative"),
    ]
    for args, fragment in cases:
        with pytest.raises(ArenaFreeError, match=fragment):
            arena.free(*args)
        assert arena.freed_bytes == 1000 and arena.live_count == 1
    assert arena.errors == len(cases)
    arena.free(q, 3000)  # still live after all that: frees fine
    assert arena.freed_bytes == 4000 and arena.live_count == 0


def test_frees_from_before_set_extents_are_stale(arena):
    arena.set_extents([(1 << 30, MiB)])
    old = arena.malloc(4096)
    arena.set_extents([(1 << 30, MiB)])  # same memory, new generation
    with pytest.raises(ArenaFreeError, match="stale"):
        arena.free(old + 4096, 4096)
    new = arena.malloc(4096)
    assert new == old  # the bytes were handed out again: the stale free must not count
    with pytest.raises(ArenaFreeError):
        arena.free(old, 8192)
    assert arena.freed_bytes == 0
    arena.free(new, 4096)
    assert arena.freed_bytes == 4096


def test_the_pluggable_path_counts_bad_frees_instead_of_raising(arena):
    import ctypes

    lib = _library()
    malloc = getattr(lib, f"gb_arena_malloc_{arena.slot}")
    free = getattr(lib, f"gb_arena_free_{arena.slot}")
    malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    malloc.restype = ctypes.c_void_p
    free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    arena.set_extents([(1 << 30, MiB)])
    assert malloc(-4096, 0, None) is None
    p = malloc(2 * 4096, 0, None)
    assert p == 1 << 30
    free(p, -1, 0, None)
    free(p, 4096, 0, None)
    free(p + 8192, 4096, 0, None)
    assert arena.freed_bytes == 0 and arena.errors == 3
    assert "was never returned" in arena.describe_last_error()
    free(p, 8192, 0, None)
    free(p, 8192, 0, None)
    assert arena.freed_bytes == 8192 and arena.errors == 4
    assert "double free" in arena.describe_last_error()
    arena.raw_delete(p, 8192)  # the simulated device's hook behaves like torch's
    assert arena.errors == 5 and arena.freed_bytes == 8192


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 20_000), st.integers(0, 10**6)), max_size=400))
def test_the_live_record_matches_a_model_under_random_mallocs_and_frees(ops):
    """The C record (hash table with backward-shift deletion) against a dict, op by op."""
    arena = BumpArena()
    arena.set_extents([(1 << 30, 64 * MiB), (1 << 32, 8 * MiB)])
    live, freed, errors = {}, 0, 0
    for op, size, pick in ops:
        if op <= 1 or not live:
            p = arena.malloc(size)
            if p:
                assert p not in live
                live[p] = size
        else:
            ptr = sorted(live)[pick % len(live)]
            wrong = op == 3 and pick % 3 == 0
            nbytes = live[ptr] + 1 if wrong else live[ptr]
            if wrong:
                with pytest.raises(ArenaFreeError):
                    arena.free(ptr, nbytes)
                errors += 1
            else:
                arena.free(ptr, nbytes)
                freed += nbytes
                del live[ptr]
        assert arena.live_count == len(live)
    assert arena.live_bytes == sum(live.values())
    assert arena.freed_bytes == freed and arena.errors == errors
    for ptr, size in live.items():  # every survivor is still found by the record
        arena.free(ptr, size)
    assert arena.live_count == 0 and arena.errors == errors


def test_many_live_allocations_grow_the_record(arena):
    arena.set_extents([(1 << 30, 256 * MiB)])
    ptrs = [arena.malloc(512) for _ in range(20_000)]
    assert arena.live_count == 20_000
    for p in ptrs[::2]:
        arena.free(p, 512)
    for p in ptrs[1::2]:
        arena.free(p, 512)
    assert arena.live_count == 0 and arena.freed_bytes == 20_000 * 512 and arena.errors == 0


def test_acquire_refuses_a_bad_alignment_in_c():
    assert _library().gb_arena_acquire(1000, 1) == -6
    with pytest.raises(ValueError, match="power of two"):
        BumpArena(align=3)


def test_c_entry_points_refuse_slots_not_acquired():
    """The C functions take a slot number; a released or out-of-range one does nothing."""
    import ctypes

    lib = _library()
    fresh = BumpArena()
    slot = fresh.slot
    fresh.set_extents([(1 << 30, MiB)])
    del fresh
    import gc

    gc.collect()
    bases, sizes = (ctypes.c_uint64 * 1)(1 << 30), (ctypes.c_size_t * 1)(MiB)
    for bad in (-1, BumpArena.MAX_SLOTS, BumpArena.MAX_SLOTS + 5, slot):
        if bad == slot and BumpArena().slot == slot:  # reacquired right away: it is fresh, not stale
            continue
        assert lib.gb_arena_malloc(bad, 512) is None
        assert lib.gb_arena_set_extents(bad, bases, sizes, 1) == -1
        assert lib.gb_arena_set_align(bad, 4096) == -1
        assert lib.gb_arena_set_best_fit(bad, 0) == -1
        assert lib.gb_arena_free_checked(bad, 1 << 30, 512) == -1
        assert lib.gb_arena_cursor(bad) == 0 and lib.gb_arena_errors(bad) == 0
        assert lib.gb_arena_extent_cursor(bad, 0) == 0
        assert lib.gb_arena_freed_ptr(bad) is None and lib.gb_arena_errors_ptr(bad) is None
    assert lib.gb_arena_max_slots() == BumpArena.MAX_SLOTS and lib.gb_arena_max_extents() == BumpArena.MAX_EXTENTS


# ---------------------------------------------------------------- build helpers, in process

from graphborrow.core import arena as arena_module  # noqa: E402
from graphborrow.core import native  # noqa: E402


def test_the_compiler_comes_from_cc_then_the_usual_names(monkeypatch):
    found = {"gcc": "/usr/bin/gcc", "clang": "/usr/bin/clang", "mycc": "/opt/mycc"}
    monkeypatch.setattr(native.shutil, "which", lambda name: found.get(name))  # (the rule lives in native)
    monkeypatch.setenv("CC", "mycc -pthread -O2")
    assert native.compiler("the bump arena") == "mycc"  # the flags of $CC are not part of its name
    monkeypatch.setenv("CC", "missing-cc")
    assert native.compiler("the bump arena") == "gcc"  # cc is absent here: gcc is next
    del found["gcc"]
    assert native.compiler("the bump arena") == "clang"
    del found["clang"]
    with pytest.raises(RuntimeError, match="no C compiler found to build the bump arena.*set CC"):
        native.compiler("the bump arena")


def test_repr_and_describe_report_the_state(arena):
    arena.set_extents([(1 << 30, MiB)])
    p = arena.malloc(1000)
    assert arena.describe_last_error() == "no error" and arena.last_error() == (0, 0, 0, 0)
    with pytest.raises(ArenaFreeError):
        arena.free(p, 999)
    assert arena.last_error() == (-13, p, 999, 1000)
    text = repr(arena)
    for part in ("extents=1", f"capacity={MiB}", "cursor=1024", "freed=0", "live=1", "errors=1", "best_fit=True", "align=512"):
        assert part in text
    assert arena.capacity_bytes == MiB and arena.live_bytes == 1000


def test_library_path_builds_verifies_and_rebuilds_in_process(monkeypatch, tmp_path):
    """The same rules as the subprocess tests above, where a mutation tool can see them."""
    cache = tmp_path / "not" / "yet" / "there"
    monkeypatch.setenv("GRAPHBORROW_CACHE_DIR", str(cache))
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and shm.stat().st_dev != tmp_path.stat().st_dev:
        # temporaries in another file system could not be renamed into place: build beside the target
        monkeypatch.setattr(native.tempfile, "tempdir", str(shm))
    built = library_path()
    assert built.parent == cache and built.name.startswith("libgbarena-") and built.suffix == ".so"
    assert len(built.name) == len("libgbarena-") + 16 + len(".so")
    assert library_is_intact(built)
    # a loadable library, not just a file with a digest; loaded in a child process, since this
    # test later damages the file, and a damaged library mapped here would crash this one at exit
    subprocess.run([sys.executable, "-c", f"import ctypes; ctypes.CDLL({str(built)!r}).gb_arena_set_extents"],
                   check=True)
    assert sorted(p.name for p in cache.iterdir()) == [built.name, built.name + ".sha256"]
    tmp_path = cache
    stamp = built.stat().st_mtime_ns
    assert library_path() == built and built.stat().st_mtime_ns == stamp  # intact: not rebuilt
    good = built.read_bytes()
    built.write_bytes(good[: len(good) // 3])
    assert library_path() == built and built.read_bytes() == good  # damaged: rebuilt
    digest_path(built).unlink()
    assert library_path() == built and library_is_intact(built)  # digest lost: rebuilt
    other_source = tmp_path / "elsewhere.c"
    other_source.write_text(arena_module.SOURCE.read_text() + "\n/* another version */\n")
    monkeypatch.setattr(arena_module, "SOURCE", other_source)
    assert library_path() != built  # another source, another name


def test_a_failing_compiler_raises_with_its_output_and_leaves_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv("GRAPHBORROW_CACHE_DIR", str(tmp_path / "cache"))
    broken = tmp_path / "broken.c"
    broken.write_text("this is not C\n")
    monkeypatch.setattr(arena_module, "SOURCE", broken)
    with pytest.raises(RuntimeError, match="building the bump arena failed.*broken.c") as info:
        library_path()
    compiler_output = str(info.value).split(":\n", 1)[1]
    assert "error" in compiler_output, "the compiler's own diagnostics are in the message"
    assert compiler_output.startswith(str(broken)), "as the compiler printed them (text, not a bytes repr)"
    assert list((tmp_path / "cache").iterdir()) == []


def test_an_unwritable_cache_raises_naming_the_setting(monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("GRAPHBORROW_CACHE_DIR", str(blocker / "cache"))
    monkeypatch.setattr(arena_module, "SOURCE", arena_module.SOURCE)
    with pytest.raises(RuntimeError, match=r"cannot write the arena build cache .*GRAPHBORROW_CACHE_DIR"):
        library_path()


def test_every_free_error_message_names_the_call_and_the_way_out():
    d = arena_module.describe_free_error
    assert d(-10, 0x1000, -4) == "free(0x1000, -4): a negative size is never valid; pass the size malloc was asked for"
    assert d(-12, 0x1000, 512) == (
        "free(0x1000, 512): 0x1000 lies in memory this arena handed out but is not a live allocation: "
        "it was freed already (double free) or is not the start of an allocation"
    )
    assert d(-11, 0x1000, 512) == (
        "free(0x1000, 512): 0x1000 was never returned by this arena since its last set_extents "
        "(an unknown pointer, or a stale one from before the extents were replaced)"
    )
    assert d(-13, 0x1000, 512, 1024) == "free(0x1000, 512): that allocation was made for 1024 bytes; free it with that size"
    assert d(-9, 0, 4096) == "malloc(4096) failed: the host is out of memory for the arena's allocation record"
    assert d(-7, 0x1000, 512) == "free(0x1000, 512): an extent runs past the end of the 64-bit address space"
    assert d(-99, 0x1000, 512) == "free(0x1000, 512): error -99"


def test_host_frees_report_exactly_what_was_passed(arena):
    arena.set_extents([(1 << 30, MiB)])
    p = arena.malloc(1000)
    with pytest.raises(ArenaFreeError) as info:
        arena.free(p, 999)
    assert str(info.value) == f"free({p:#x}, 999): that allocation was made for 1000 bytes; free it with that size"
    assert arena.describe_last_error() == str(info.value)
    with pytest.raises(ArenaFreeError, match="never returned"):
        arena.free(0, 512)  # the null pointer is a pointer the arena never returned
    with pytest.raises(ValueError, match=r"free\(18446744073709551616, 512\): a pointer is an address in \[0, 2\*\*64\)"):
        arena.free(ADDRESS_LIMIT, 512)
    with pytest.raises(ArenaFreeError, match="negative size"):
        arena.free(p, 2**63)  # no allocation is that large: counted like a negative size
    with pytest.raises(ArenaFreeError, match="negative size"):
        arena.free(p, 2**64 + 1000)  # not 1000 once ctypes kept the low 64 bits: p stays live
    with pytest.raises(TypeError, match="free pointer must be an integer"):
        arena.free("0x1000", 512)
    with pytest.raises(TypeError, match="free size must be an integer"):
        arena.free(p, 1000.0)
    arena.free(p, 1000)


def test_runs_total_adds_the_sizes():
    from graphborrow.core.runs import runs_total

    assert runs_total([(1 << 30, 4096), (2 << 30, 512)]) == 4608 and runs_total([]) == 0


def test_a_null_free_is_unknown_and_never_matches_an_empty_record_entry(arena):
    arena.set_extents([(1 << 30, MiB)])
    p = arena.malloc(512)
    for size in (0, 512):
        with pytest.raises(ArenaFreeError, match="never returned"):
            arena.free(0, size)
    assert _library().gb_arena_free_checked(arena.slot, None, 0) == -11
    assert arena.live_count == 1 and arena.freed_bytes == 0
    arena.free(p, 512)
    assert arena.live_count == 0


def test_extent_limits_at_their_exact_boundaries():
    wide = BumpArena()
    wide.set_extents([((k + 1) << 30, 4096) for k in range(BumpArena.MAX_EXTENTS)])  # exactly the maximum
    assert wide.extents[-1] == (64 << 30, 4096)
    tiny = BumpArena()
    tiny.set_extents([(1 << 30, 1)])  # one byte is a positive size
    assert tiny.malloc(1) == 0  # but no aligned allocation fits in it
    unaligned = BumpArena(align=1)
    unaligned.set_extents([(1, 4096)])  # address 1 is a positive address when nothing needs alignment
    assert unaligned.malloc(10) == 1 and unaligned.malloc(10) == 11
    with pytest.raises(ValueError, match="below 2"):
        tiny.malloc(ADDRESS_LIMIT)  # would be 0 once ctypes kept the low 64 bits


def test_the_live_record_survives_churn_in_a_small_crowded_table(arena):
    """Between 20 and 31 live allocations keep the record at its first size (64 entries, up
    to half full), where probe chains often wrap around its end: thousands of random frees
    there exercise every case of the backward-shift deletion."""
    import random

    rng = random.Random(11)
    arena.set_extents([(1 << 30, 1 << 40)])
    live = {}
    for _ in range(20):
        p = arena.malloc(512)
        live[p] = 512
    for _ in range(6000):
        if len(live) < 31 and (len(live) <= 20 or rng.random() < 0.5):
            size = rng.randrange(1, 4096)
            p = arena.malloc(size)
            live[p] = size
        else:
            p = rng.choice(list(live))
            arena.free(p, live.pop(p))  # raises if the record lost it
        assert arena.live_count == len(live)
    for p, size in live.items():
        arena.free(p, size)
    assert arena.live_count == 0 and arena.errors == 0


def test_the_c_checks_refuse_overlaps_and_serve_zero_byte_requests(arena):
    import ctypes

    assert _c_set_extents(arena, [(1 << 30, 2 * MiB), ((1 << 30) + MiB, MiB)]) == -5
    assert _c_set_extents(arena, [((1 << 30) + MiB, MiB), (1 << 30, 2 * MiB)]) == -5
    assert _c_set_extents(arena, [(1 << 30, MiB), ((1 << 30) + MiB, MiB)]) == 0  # touching is fine
    malloc = getattr(_library(), f"gb_arena_malloc_{arena.slot}")
    malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    malloc.restype = ctypes.c_void_p
    assert malloc(0, 0, None) == 1 << 30  # a zero-byte request still gets its own aligned address
    assert malloc(0, 0, None) == (1 << 30) + 512


def test_a_new_arena_has_no_extents_and_no_capacity(arena):
    assert arena.extents == [] and arena.capacity_bytes == 0 and arena.extent_cursors() == []
    assert "extents=0" in repr(arena) and "capacity=0" in repr(arena)


def test_refused_integers_name_the_argument(arena):
    with pytest.raises(TypeError, match=r"^extent 0 base must be an integer, got float"):
        arena.set_extents([(float(1 << 30), MiB)])
    with pytest.raises(TypeError, match=r"^extent 1 size must be an integer, got str"):
        arena.set_extents([(1 << 30, MiB), (1 << 31, "4096")])
    with pytest.raises(TypeError, match=r"^malloc size must be an integer number of bytes, got a bool \(True\)"):
        arena.malloc(True)
