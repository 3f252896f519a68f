"""The multi-extent bump arena: C source, built once per content hash, loaded with ctypes.

One compiled library serves three callers: torch's pluggable allocator on CUDA (through
``BumpArena.allocator``), the simulated device's MemPool, and direct host calls in tests.
Each ``BumpArena`` owns a slot of the library, i.e. its own extents, cursors, lock,
freed counter and record of live allocations; a process may hold up to ``MAX_SLOTS``
at once. The library is built and verified by the native-build cache
(:mod:`graphborrow.core.native`): a damaged cached build is rebuilt, never loaded.
"""

from __future__ import annotations

import ctypes
import os
import sys
import weakref
from pathlib import Path
from typing import Iterable, Sequence

from . import native
from .checks import ADDRESS_LIMIT, as_flag, as_integer
from .errors import ArenaFreeError

__all__ = ["BumpArena", "library_path", "first_overlap", "check_extents", "describe_free_error", "ADDRESS_LIMIT"]

SOURCE = Path(__file__).with_name("arena.c")
FREE_SIZE_LIMIT = 1 << 63  # the C free takes an int64 size: no allocation is this large
_ERRORS = {
    -1: "the arena slot is not acquired",
    -2: "too many extents",
    -3: "an extent size is not positive",
    -4: "an extent base is not aligned",
    -5: "extents overlap",
    -6: "alignment must be a positive power of two",
    -7: "an extent runs past the end of the 64-bit address space",
    -8: "an extent base is 0",
    -9: "the host is out of memory for the arena's allocation record",
}
FREE_NEGATIVE, FREE_UNKNOWN, FREE_TWICE, FREE_SIZE = -10, -11, -12, -13
NO_MEMORY = -9


def library_path() -> Path:
    """Build the arena library if no intact build of this source exists; return its path.

    The name carries a hash of the source and the platform; the build cache
    (:func:`graphborrow.core.native.build`) verifies it before use and publishes a new build
    atomically, so a damaged build is rebuilt, never loaded.

    Returns:
        Path of the verified library in the cache directory.

    Raises:
        RuntimeError: no C compiler was found, the cache is not writable, or the build
            failed.
    """
    tag = native.content_tag(SOURCE.read_bytes(), sys.platform.encode(), os.uname().machine.encode())
    target = native.cache_dir() / f"libgbarena-{tag}.so"

    def make(folder: Path) -> list[Path]:
        library = folder / target.name
        native.compile_command("the bump arena", [native.compiler("the bump arena"), "-O2", "-shared", "-fPIC",
                                                  "-pthread", "-o", str(library), str(SOURCE)])
        return [library]

    return native.build([target], make, "the arena build cache")[0]


_lib = None


def _library() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        lib = ctypes.CDLL(str(library_path()))
        lib.gb_arena_acquire.argtypes = [ctypes.c_size_t, ctypes.c_int]
        lib.gb_arena_release.argtypes = [ctypes.c_int]
        lib.gb_arena_set_extents.argtypes = [
            ctypes.c_int,
            ctypes.POINTER(ctypes.c_uint64),
            ctypes.POINTER(ctypes.c_size_t),
            ctypes.c_size_t,
        ]
        lib.gb_arena_set_align.argtypes = [ctypes.c_int, ctypes.c_size_t]
        lib.gb_arena_set_best_fit.argtypes = [ctypes.c_int, ctypes.c_int]
        lib.gb_arena_malloc.argtypes = [ctypes.c_int, ctypes.c_size_t]
        lib.gb_arena_malloc.restype = ctypes.c_void_p
        lib.gb_arena_free_checked.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64]
        lib.gb_arena_free_checked.restype = ctypes.c_int
        for name in ("cursor", "freed", "align", "best_fit", "num_extents", "live_count", "live_bytes", "errors"):
            fn = getattr(lib, f"gb_arena_{name}")
            fn.argtypes = [ctypes.c_int]
            fn.restype = ctypes.c_size_t
        for name in ("freed_ptr", "errors_ptr"):
            fn = getattr(lib, f"gb_arena_{name}")
            fn.argtypes = [ctypes.c_int]
            fn.restype = ctypes.c_void_p
        lib.gb_arena_last_error.argtypes = [
            ctypes.c_int,
            ctypes.POINTER(ctypes.c_uint64),
            ctypes.POINTER(ctypes.c_int64),
            ctypes.POINTER(ctypes.c_uint64),
        ]
        lib.gb_arena_extent_cursor.argtypes = [ctypes.c_int, ctypes.c_size_t]
        lib.gb_arena_extent_cursor.restype = ctypes.c_size_t
        _lib = lib
    return _lib


def first_overlap(ranges: Iterable[Sequence[int]]):
    """The first two ``(base, nbytes)`` ranges that share a byte, in address order, else None.

    Args:
        ranges: ``(base, nbytes)`` pairs in bytes, in any order.

    Returns:
        ``((base, nbytes), (base, nbytes))``, the lower range first, or None when the ranges
        are disjoint (touching ranges do not overlap).
    """
    ordered = sorted((int(b), int(n)) for b, n in ranges)
    for first, second in zip(ordered, ordered[1:]):
        if second[0] < first[0] + first[1]:
            return first, second
    return None


def check_extents(extents: Iterable[Sequence[int]], align: int, noun: str = "extent") -> list[tuple[int, int]]:
    """``extents`` as ``(base, nbytes)`` int pairs, or an error naming the first bad one.

    The rules of the arena's extents, stated once: the borrow state's static runs obey
    them too. Every value is checked against the 64-bit width the C library takes before
    it reaches ctypes, which would otherwise keep only the low bits.

    Args:
        extents: ``(base, nbytes)`` pairs in bytes.
        align: each base must be a multiple of this.
        noun: what the caller calls an extent, for messages ("static run").

    Returns:
        The pairs as Python ints, in the given order.

    Raises:
        TypeError: an extent is not a pair of integers (bools and floats are not).
        ValueError: an extent is empty, not at a positive address, misaligned, not below
            2**64 or overlapping another.
    """
    checked = []
    for i, extent in enumerate(extents):
        try:
            base, nbytes = extent
        except (TypeError, ValueError):
            raise TypeError(f"{noun} {i} is {extent!r}; each {noun} is a (base, nbytes) pair") from None
        checked.append((as_integer(base, f"{noun} {i} base"), as_integer(nbytes, f"{noun} {i} size")))
    for i, (base, nbytes) in enumerate(checked):
        if nbytes <= 0:
            raise ValueError(f"{noun} {i} at {base:#x} has non-positive size {nbytes}")
        if base <= 0:
            raise ValueError(f"{noun} {i} has base {base:#x}; a base must be a positive address")
        if base + nbytes >= ADDRESS_LIMIT:
            raise ValueError(
                f"{noun} {i} [{base:#x}, {base + nbytes:#x}) runs past the end of the 64-bit "
                f"address space; every {noun} must end below 2**64"
            )
        if base % align:
            raise ValueError(
                f"{noun} {i} base {base:#x} is not aligned to {align} bytes; "
                "round the base up (and the size down to match)"
            )
    overlap = first_overlap(checked)
    if overlap:
        (b0, n0), (b1, n1) = overlap
        raise ValueError(
            f"{noun}s overlap: [{b0:#x}, {b0 + n0:#x}) and [{b1:#x}, {b1 + n1:#x}); "
            f"each byte may belong to one {noun} only: merge them or pass disjoint ranges"
        )
    return checked


def _check(code: int, what: str) -> None:
    if code != 0:
        raise ValueError(f"{what}: {_ERRORS.get(code, f'error {code}')}")


def _alignment(value) -> int:
    """A valid alignment as an int: a power of two, below 2**64 (the C library's size_t)."""
    align = as_integer(value, "align")
    if align <= 0 or align & (align - 1) or align >= ADDRESS_LIMIT:
        raise ValueError(f"align must be a power of two below 2**64, got {align}")
    return align


def describe_free_error(code: int, ptr: int, nbytes: int, live_size: int = 0) -> str:
    """What an arena error code means, for one free (or malloc) call.

    Args:
        code: the C library's error code (negative; see :meth:`BumpArena.last_error`).
        ptr: the address the call passed.
        nbytes: the size the call passed, in bytes.
        live_size: for a wrongly sized free, the size the allocation was made with.

    Returns:
        One sentence naming the call, what was wrong and what to pass instead.
    """
    call = f"free({ptr:#x}, {nbytes})"
    if code == FREE_NEGATIVE:
        return f"{call}: a negative size is never valid; pass the size malloc was asked for"
    if code == FREE_TWICE:
        return (
            f"{call}: {ptr:#x} lies in memory this arena handed out but is not a live allocation: "
            "it was freed already (double free) or is not the start of an allocation"
        )
    if code == FREE_UNKNOWN:
        return (
            f"{call}: {ptr:#x} was never returned by this arena since its last set_extents "
            "(an unknown pointer, or a stale one from before the extents were replaced)"
        )
    if code == FREE_SIZE:
        return f"{call}: that allocation was made for {live_size} bytes; free it with that size"
    if code == NO_MEMORY:
        return f"malloc({nbytes}) failed: {_ERRORS[NO_MEMORY]}"
    return f"{call}: {_ERRORS.get(code, f'error {code}')}"


class BumpArena:
    """Carves aligned allocations out of caller-owned extents; never reuses freed bytes.

    ``best_fit`` defaults to True: free runs arrive largest first, and first fit would
    carve small segments out of the run a large probability matrix needs.

    Every allocation since the last ``set_extents`` is recorded, so frees are checked.
    A host call to :meth:`free` raises :class:`ArenaFreeError` for a double, unknown,
    stale, wrongly sized or negative free and changes nothing. torch's pluggable path
    (and the simulated device's, :meth:`raw_delete`) cannot raise: such frees are
    counted in :attr:`errors` and described by :meth:`last_error`, and the borrow state
    refuses to go on with an arena that reports them.

    Args:
        align: every allocation starts at a multiple of this many bytes (a power of two;
            512 matches the caching allocator's block rounding).
        best_fit: place an allocation in the extent with the least room that holds it,
            instead of the first one that does.

    Raises:
        TypeError: ``align`` is not an integer or ``best_fit`` not a bool.
        ValueError: ``align`` is not a power of two below 2**64.
        RuntimeError: all ``MAX_SLOTS`` arenas of this process are in use.
    """

    MAX_EXTENTS = 64
    MAX_SLOTS = 64

    def __init__(self, align: int = 512, best_fit: bool = True) -> None:
        align, best_fit = _alignment(align), as_flag(best_fit, "best_fit")
        self._lib = _library()
        self.slot = self._lib.gb_arena_acquire(align, int(best_fit))
        if self.slot < 0:
            raise RuntimeError(
                f"all {self.MAX_SLOTS} bump-arena slots of this process are in use; "
                "drop BumpArena instances (and their MemPools) you no longer need"
            )
        self._finalizer = weakref.finalize(self, self._lib.gb_arena_release, self.slot)
        self._freed = ctypes.c_size_t.from_address(self._lib.gb_arena_freed_ptr(self.slot))
        self._errors = ctypes.c_size_t.from_address(self._lib.gb_arena_errors_ptr(self.slot))
        self._extents: list[tuple[int, int]] = []
        self._allocator = None

    # extents
    def set_extents(self, extents: Iterable[Sequence[int]]) -> None:
        """Hand over ``(base, nbytes)`` ranges; resets every cursor, the freed counter and
        the record of live allocations. A rejected list changes nothing.

        The caller keeps owning the memory: the arena only hands out addresses inside it,
        so the extents must stay valid until they are replaced.

        Args:
            extents: at most ``MAX_EXTENTS`` ``(base, nbytes)`` pairs of ints, in bytes;
                each base a positive multiple of ``align``, no two overlapping.

        Raises:
            TypeError: an extent is not a pair of integers.
            ValueError: too many extents, or one is empty, misaligned, past 2**64 or
                overlapping another (see :func:`check_extents`).
        """
        extents = list(extents)
        if len(extents) > self.MAX_EXTENTS:
            raise ValueError(
                f"{len(extents)} extents given, at most {self.MAX_EXTENTS} are supported; "
                "pass the largest ones (free runs come sorted largest first)"
            )
        extents = check_extents(extents, self.align)
        n = len(extents)
        bases = (ctypes.c_uint64 * max(n, 1))(*[b for b, _ in extents])
        sizes = (ctypes.c_size_t * max(n, 1))(*[s for _, s in extents])
        _check(self._lib.gb_arena_set_extents(self.slot, bases, sizes, n), "set_extents")
        self._extents = extents

    @property
    def extents(self) -> list[tuple[int, int]]:
        return list(self._extents)

    @property
    def capacity_bytes(self) -> int:
        return sum(n for _, n in self._extents)

    # allocation (host calls of the same C functions torch calls)
    def malloc(self, nbytes: int) -> int:
        """Address of ``nbytes`` rounded up to ``align``; 0 when no extent has room.

        Returning 0 rather than raising is the pluggable-allocator contract: torch turns it
        into an ordinary out-of-memory error.

        Args:
            nbytes: bytes wanted (an int, 0 or more).

        Returns:
            The address, or 0 when nothing fits.

        Raises:
            TypeError: ``nbytes`` is not an integer.
            ValueError: ``nbytes`` is negative or not below 2**64.
        """
        nbytes = as_integer(nbytes, "malloc size")
        if nbytes < 0:
            raise ValueError(f"cannot allocate a negative size ({nbytes})")
        if nbytes >= ADDRESS_LIMIT:
            raise ValueError(f"cannot allocate {nbytes} bytes: sizes must be below 2**64")
        return self._lib.gb_arena_malloc(self.slot, nbytes) or 0

    def free(self, ptr: int, nbytes: int) -> None:
        """Count ``nbytes`` as freed (the bytes are not reused until set_extents).

        Raises ArenaFreeError, changing nothing, unless ``ptr`` is a live allocation of
        this arena and ``nbytes`` the size malloc was asked for.

        Args:
            ptr: an address :meth:`malloc` returned since the last :meth:`set_extents`.
            nbytes: the size that malloc call asked for (not the aligned size).

        Raises:
            ArenaFreeError: a double, unknown, stale, wrongly sized or negative free.
        """
        code = self._free(ptr, nbytes)
        if code:
            raise ArenaFreeError(describe_free_error(code, int(ptr), int(nbytes), self._last_live_size()))

    def _free(self, ptr, nbytes) -> int:
        ptr, nbytes = as_integer(ptr, "free pointer"), as_integer(nbytes, "free size")
        if not 0 <= ptr < ADDRESS_LIMIT:
            raise ValueError(f"free({ptr}, {nbytes}): a pointer is an address in [0, 2**64)")
        if not 0 <= nbytes < FREE_SIZE_LIMIT:
            # outside the int64 the C call takes, ctypes would keep the low 64 bits (-(2**64) + 1000
            # would free 1000 bytes); no allocation has such a size: refused as a negative one
            nbytes = -1
        return self._lib.gb_arena_free_checked(self.slot, ptr, nbytes)

    def _last_live_size(self) -> int:
        return self.last_error()[3]

    # state
    @property
    def cursor_bytes(self) -> int:
        return self._lib.gb_arena_cursor(self.slot)

    def extent_cursors(self) -> list[int]:
        """How far each extent has been carved, for room checks (extent size minus cursor).

        Returns:
            Bytes used from the start of each extent, in the order of :attr:`extents`.
        """
        return [self._lib.gb_arena_extent_cursor(self.slot, i) for i in range(len(self._extents))]

    @property
    def freed_bytes(self) -> int:
        return self._freed.value  # read in place: checked on every borrow

    @property
    def errors(self) -> int:
        """Frees (and record failures) the arena refused since it was created."""
        return self._errors.value  # read in place: checked on every borrow

    def last_error(self) -> tuple[int, int, int, int]:
        """``(code, ptr, nbytes, live_size)`` of the most recent refused call (code 0: none).

        Returns:
            The C library's error code, the pointer and size the call passed, and for a
            wrongly sized free the size the allocation was made with.
        """
        ptr, size, live = ctypes.c_uint64(), ctypes.c_int64(), ctypes.c_uint64()
        code = self._lib.gb_arena_last_error(self.slot, ctypes.byref(ptr), ctypes.byref(size), ctypes.byref(live))
        return code, ptr.value, size.value, live.value

    def describe_last_error(self) -> str:
        """The most recent refused call in words, for error messages.

        Returns:
            :func:`describe_free_error`'s sentence, or ``"no error"``.
        """
        code, ptr, size, live = self.last_error()
        return describe_free_error(code, ptr, size, live) if code else "no error"

    @property
    def live_count(self) -> int:
        """Allocations handed out since set_extents and not yet freed."""
        return self._lib.gb_arena_live_count(self.slot)

    @property
    def live_bytes(self) -> int:
        """Bytes asked for by those allocations (before alignment)."""
        return self._lib.gb_arena_live_bytes(self.slot)

    @property
    def best_fit(self) -> bool:
        return bool(self._lib.gb_arena_best_fit(self.slot))

    @best_fit.setter
    def best_fit(self, value: bool) -> None:
        _check(self._lib.gb_arena_set_best_fit(self.slot, int(as_flag(value, "best_fit"))), "best_fit")

    @property
    def align(self) -> int:
        return self._lib.gb_arena_align(self.slot)

    @align.setter
    def align(self, value: int) -> None:
        """Applies to later allocations: each starts at a multiple of the new alignment."""
        _check(self._lib.gb_arena_set_align(self.slot, _alignment(value)), "align")

    # torch
    @property
    def allocator(self):
        """torch's pluggable allocator over this arena, for ``torch.cuda.MemPool`` (CUDA only)."""
        if self._allocator is None:
            import torch

            self._allocator = torch.cuda.memory.CUDAPluggableAllocator(
                str(library_path()), f"gb_arena_malloc_{self.slot}", f"gb_arena_free_{self.slot}"
            ).allocator()
        return self._allocator

    def raw_alloc(self, nbytes: int, stream: int = 0) -> int:
        """The simulated device's pluggable-allocator hook (same C function as torch's).

        Args:
            nbytes: bytes wanted.
            stream: the stream the allocation is for; ignored, as the C allocator ignores it.

        Returns:
            The address, or 0 when nothing fits.
        """
        return self.malloc(nbytes)

    def raw_delete(self, address: int, nbytes: int, stream: int = 0) -> None:
        """Like torch's pluggable free: an invalid free is counted in ``errors``, not raised.

        Args:
            address: an address :meth:`raw_alloc` returned.
            nbytes: the size it was asked for.
            stream: the stream of the free; ignored, as the C allocator ignores it.
        """
        self._free(address, nbytes)

    def __repr__(self) -> str:
        return (
            f"BumpArena(slot={self.slot}, extents={len(self._extents)}, "
            f"capacity={self.capacity_bytes}, cursor={self.cursor_bytes}, "
            f"freed={self.freed_bytes}, live={self.live_count}, errors={self.errors}, "
            f"best_fit={self.best_fit}, align={self.align})"
        )
