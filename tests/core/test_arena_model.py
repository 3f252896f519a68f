"""The arena's ctypes boundary against a pure-Python model of the arena, over the full integer range.

Every argument the Python class hands to C (alignments, best-fit flags, extent bases and sizes,
their count, malloc sizes, free pointers and sizes) is drawn from the whole integer line, the
64-bit edges included, plus values that are not integers at all. ctypes keeps only the low bits
of an integer that does not fit its type, so an unchecked width shows up here as the compiled
arena doing something other than the model says: taking ``align=2**32`` as 512, or a free of
``-(2**64) + 1000`` bytes as a free of 1000. The model is written from the arena's contract
(``graphborrow/core/arena.c``'s header and ``BumpArena``'s docstrings), in unbounded Python
integers; it shares no code with the arena.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
from conftest import deep_factor
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from graphborrow.core.arena import BumpArena
from graphborrow.core.errors import ArenaFreeError

WIDTH = 1 << 64  # size_t / uint64_t: every C argument must be below this
INT64 = 1 << 63  # the C free's size is an int64_t

# The edges of every width the C side uses (int, int64, size_t) and their neighbours.
EDGES = sorted({e + d for e in (0, 1 << 31, 1 << 32, 1 << 63, 1 << 64, 1 << 65) for d in (-1, 0, 1)}
               | {-(1 << 64) + 1000, -(1 << 63), -(1 << 31), -1000, 1000, 512, 4096})
any_int = st.one_of(st.sampled_from(EDGES), st.sampled_from([-e for e in EDGES]),
                    st.integers(-(1 << 70), 1 << 70), st.integers(-4096, 1 << 22))
not_int = st.sampled_from([1.5, 512.0, "4096", None, True, False, b"\x00", [512]])
numpy_int = st.sampled_from([np.int64(512), np.uint64(4096), np.int32(-1), np.uint64((1 << 64) - 1)])
argument = st.one_of(any_int, any_int, not_int, numpy_int)
powers = st.integers(0, 70).map(lambda k: 1 << k)
alignments = st.one_of(powers, argument)
flags = st.one_of(st.booleans(), st.booleans(), st.sampled_from([0, 1, 2, 1 << 32, -1, None, "yes", np.bool_(True)]))


def as_int(value):
    """The integer an argument stands for, or None when it is not an integer (bools are not)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        return None
    return int(value)


def round_up(n: int, align: int) -> int:
    return -(-n // align) * align


@st.composite
def extent_lists(draw):
    """Lists of (base, nbytes): disjoint aligned layouts at every height of the address space,
    of every count around the limit of 64, sometimes with one entry spoiled."""
    count = draw(st.one_of(st.integers(0, 6), st.sampled_from([63, 64, 65, 70])))
    unit = 1 << draw(st.integers(0, 24))
    at = draw(st.sampled_from([unit, 1 << 30, 1 << 47, 1 << 63, WIDTH - (1 << 34), WIDTH - 64 * unit]))
    at = max(unit, round_up(at, unit))
    extents = []
    for _ in range(count):
        at += unit * draw(st.integers(0, 3))
        size = unit * draw(st.integers(1, 8)) - draw(st.sampled_from([0, 0, 0, 1]))
        extents.append((at, size))
        at += round_up(size, unit)
    if extents and draw(st.booleans()):
        i = draw(st.integers(0, len(extents) - 1))
        base, size = extents[i]
        spoiled = draw(st.sampled_from(["base", "size", "shape", "overlap"]))
        if spoiled == "base":
            extents[i] = (draw(argument), size)
        elif spoiled == "size":
            extents[i] = (base, draw(argument))
        elif spoiled == "shape":
            extents[i] = draw(st.sampled_from([(base,), (base, size, 1), base, None, "ab"]))
        else:
            extents.append((base + draw(st.integers(0, max(0, size - 1))), size))
    return extents


class ArenaModel:
    """The bump arena's contract in plain Python (unbounded integers, no ctypes)."""

    def __init__(self, align: int, best_fit: bool):
        self.align, self.best_fit = align, best_fit
        self.extents: list[tuple[int, int]] = []
        self.cursors: list[int] = []
        self.live: dict[int, int] = {}
        self.freed = self.errors = 0
        self.last_error = (0, 0, 0, 0)

    @staticmethod
    def alignment_error(value):
        align = as_int(value)
        if align is None:
            return TypeError
        if align <= 0 or align & (align - 1) or align >= WIDTH:
            return ValueError
        return None

    @staticmethod
    def flag_error(value):
        return None if isinstance(value, bool) else TypeError

    def set_extents(self, extents):
        """Apply an extent list as the arena must; returns the error class it must raise (None: applied)."""
        if len(extents) > 64:
            return ValueError
        pairs = []
        for extent in extents:
            if not isinstance(extent, tuple) or len(extent) != 2:
                return TypeError
            base, size = as_int(extent[0]), as_int(extent[1])
            if base is None or size is None:
                return TypeError
            pairs.append((base, size))
        for base, size in pairs:
            if size <= 0 or base <= 0 or base + size >= WIDTH or base % self.align:
                return ValueError
        for i, (b0, n0) in enumerate(pairs):
            if any(b0 < b1 + n1 and b1 < b0 + n0 for b1, n1 in pairs[:i]):
                return ValueError
        self.extents = pairs
        self.cursors = [0] * len(pairs)
        self.live.clear()
        self.freed = 0
        return None

    def malloc(self, nbytes: int) -> int:
        need = round_up(max(nbytes, 1), self.align)
        if need >= WIDTH:
            return 0
        pick = None
        for i, ((base, size), cursor) in enumerate(zip(self.extents, self.cursors)):
            start, end = round_up(base + cursor, self.align), base + size
            if start >= WIDTH or start > end or end - start < need:
                continue
            room = end - start - need
            if pick is None or room < pick[1]:
                pick = (i, room, start)
            if not self.best_fit:
                break
        if pick is None:
            return 0
        i, _, start = pick
        self.cursors[i] = start - self.extents[i][0] + need
        self.live[start] = nbytes
        return start

    def free(self, ptr: int, nbytes: int) -> int:
        """The error code of a free (0: freed); errors change nothing but their record."""
        size = nbytes if 0 <= nbytes < INT64 else -1
        live_size = 0
        if size < 0:
            code = -10
        elif ptr not in self.live:
            carved = any(base <= ptr < base + cursor for (base, _), cursor in zip(self.extents, self.cursors))
            code = -12 if carved else -11
        elif self.live[ptr] != size:
            code, live_size = -13, self.live[ptr]
        else:
            del self.live[ptr]
            self.freed += size
            return 0
        self.errors += 1
        self.last_error = (code, ptr, size, live_size)
        return code


def free_argument_error(ptr, nbytes):
    p, n = as_int(ptr), as_int(nbytes)
    if p is None or n is None:
        return TypeError
    if not 0 <= p < WIDTH:
        return ValueError
    return None


class ArenaBoundary(RuleBasedStateMachine):
    """Random calls of every BumpArena method; the arena and the model must agree after each."""

    @initialize(align=alignments, best_fit=flags)
    def create(self, align, best_fit):
        self.arena, self.model = None, None
        self.new_arena(align, best_fit)

    def _expect(self, error, call):
        """Run ``call``; it must raise ``error`` (None: must not raise). Returns its result."""
        if error is None:
            return call()
        with pytest.raises(error):
            call()
        return None

    def teardown(self):
        # An arena's slot comes back when the arena is collected; the tracebacks of the refused calls
        # hold this example's arenas in cycles. Collect them here, or the examples together use up
        # the library's 64 slots (and Hypothesis reports the failing replay as a flaky strategy).
        self.arena = None
        gc.collect()

    @rule(align=alignments, best_fit=flags)
    def new_arena(self, align, best_fit):
        error = ArenaModel.alignment_error(align) or ArenaModel.flag_error(best_fit)
        arena = self._expect(error, lambda: BumpArena(align=align, best_fit=best_fit))
        if arena is not None:
            self.arena, self.model = arena, ArenaModel(int(align), best_fit)
        elif self.arena is None:
            self.arena, self.model = BumpArena(), ArenaModel(512, True)

    @rule(extents=extent_lists())
    def set_extents(self, extents):
        before = self._observe()
        error = self.model.set_extents(extents)
        self._expect(error, lambda: self.arena.set_extents(extents))
        if error is not None:
            assert self._observe() == before, "a refused extent list changes nothing"

    @rule(nbytes=st.one_of(argument, st.integers(0, 1 << 26), st.integers(0, 1 << 26)))
    def malloc(self, nbytes):
        n = as_int(nbytes)
        error = TypeError if n is None else ValueError if not 0 <= n < WIDTH else None
        got = self._expect(error, lambda: self.arena.malloc(nbytes))
        if error is None:
            assert got == self.model.malloc(n)

    @rule(data=st.data(), raw=st.booleans())
    def free(self, data, raw):
        live = sorted(self.model.live.items())
        if live and data.draw(st.booleans()):
            ptr, size = data.draw(st.sampled_from(live))
            ptr += data.draw(st.sampled_from([0, 0, 0, 1, 512, -512]))
            nbytes = size + data.draw(st.sampled_from([0, 0, 0, 1, -1, -WIDTH, WIDTH, INT64]))
        else:
            ptr, nbytes = data.draw(argument), data.draw(argument)
        error = free_argument_error(ptr, nbytes)
        if error is not None:
            self._expect(error, lambda: (self.arena.raw_delete if raw else self.arena.free)(ptr, nbytes))
            return
        code = self.model.free(int(ptr), int(nbytes))
        if raw:  # the pluggable path never raises: a bad free is only counted
            self.arena.raw_delete(ptr, nbytes)
        else:
            self._expect(ArenaFreeError if code else None, lambda: self.arena.free(ptr, nbytes))
        assert self.arena.last_error() == self.model.last_error

    @rule(align=alignments)
    def set_align(self, align):
        error = ArenaModel.alignment_error(align)
        self._expect(error, lambda: setattr(self.arena, "align", align))
        if error is None:
            self.model.align = int(align)

    @rule(best_fit=flags)
    def set_best_fit(self, best_fit):
        error = ArenaModel.flag_error(best_fit)
        self._expect(error, lambda: setattr(self.arena, "best_fit", best_fit))
        if error is None:
            self.model.best_fit = best_fit

    def _observe(self):
        a = self.arena
        return (a.extents, a.extent_cursors(), a.cursor_bytes, a.freed_bytes, a.errors, a.live_count,
                a.live_bytes, a.align, a.best_fit, a.last_error())

    @invariant()
    def agrees_with_the_model(self):
        m = self.model
        assert self._observe() == (m.extents, m.cursors, sum(m.cursors), m.freed, m.errors, len(m.live),
                                   sum(m.live.values()), m.align, m.best_fit, m.last_error)


# 40 runs of 40 calls each in CI, 50 times as many runs under `make deep` (the C arena's own
# unit tests check each rule once; this machine is the long search for a combination they miss)
ArenaBoundary.TestCase.settings = settings(max_examples=40 * deep_factor(), stateful_step_count=40)
test_the_arena_agrees_with_its_model_over_the_full_integer_range = pytest.mark.property(ArenaBoundary.TestCase)


# The reported cases, as examples the property covers.

NARROWED = [("align", a, ValueError, "align must be a power of two below 2\\*\\*64")
            for a in (1 << 64, (1 << 64) + (1 << 31), (1 << 32) + 512, 3, 0, -512)]
NARROWED += [("best_fit", f, TypeError, "best_fit must be True or False") for f in (1 << 32, 2, 0, 1, None, "no")]


@pytest.mark.parametrize("name, value, error, message", NARROWED)
def test_a_value_the_c_side_would_narrow_is_refused_by_constructor_and_setter(name, value, error, message):
    with pytest.raises(error, match=message):
        BumpArena(**{name: value})
    arena = BumpArena()
    before = getattr(arena, name)
    with pytest.raises(error, match=message):
        setattr(arena, name, value)
    assert getattr(arena, name) == before


@pytest.mark.parametrize("align", [1 << 31, 1 << 32, 1 << 63])
def test_a_wide_alignment_is_kept_exactly(align):
    arena = BumpArena(align=align)
    assert arena.align == align  # 2**31 was taken as "no slot left", 2**32 as 512
    if align < 1 << 62:
        arena.set_extents([(align, 2 * align)])
        assert arena.malloc(1) == align and arena.malloc(1) == 2 * align and arena.malloc(1) == 0
    else:  # a 2**63 block fits no extent below 2**64 but one starting at 2**63 with 2**63 bytes
        arena.set_extents([(1 << 63, (1 << 63) - 1)])
        assert arena.malloc(1) == 0 and arena.cursor_bytes == 0


@pytest.mark.parametrize("nbytes", [-(1 << 64) + 1000, -(1 << 64), -1, 1 << 63, (1 << 64) + 1000])
def test_a_free_size_outside_int64_is_refused_on_both_paths(nbytes):
    arena = BumpArena()
    arena.set_extents([(1 << 30, 1 << 20)])
    p = arena.malloc(1000)
    with pytest.raises(ArenaFreeError, match="negative size"):
        arena.free(p, nbytes)
    arena.raw_delete(p, nbytes)
    assert arena.errors == 2 and arena.freed_bytes == 0 and arena.live_count == 1
    assert arena.last_error() == (-10, p, -1, 0)
    arena.free(p, 1000)
    assert arena.freed_bytes == 1000
