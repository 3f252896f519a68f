"""The multi-extent bump arena: C source, built once per content hash, loaded with ctypes.

One compiled library serves three callers: torch's pluggable allocator on CUDA (through
``BumpArena.allocator``), the simulated device's MemPool, and direct host calls in tests.
Each ``BumpArena`` owns a slot of the library, i.e. its own extents, cursors, lock and
freed counter; a process may hold up to ``MAX_SLOTS`` at once.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import weakref
from pathlib import Path
from typing import Iterable, Sequence

SOURCE = Path(__file__).with_name("arena.c")
_ERRORS = {
    -1: "the arena slot is not acquired",
    -2: "too many extents",
    -3: "an extent size is not positive",
    -4: "an extent base is not aligned",
    -5: "extents overlap",
    -6: "alignment must be a positive power of two",
}


def cache_dir() -> Path:
    """Where built libraries live: $GRAPHBORROW_CACHE_DIR, else ~/.cache/graphborrow."""
    env = os.environ.get("GRAPHBORROW_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "graphborrow"


def _compiler() -> str:
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    cc = cc.split()[0]
    if shutil.which(cc) is None:
        for fallback in ("cc", "gcc", "clang"):
            if shutil.which(fallback):
                return fallback
        raise RuntimeError(
            "no C compiler found to build the bump arena; install gcc (or set CC)"
        )
    return cc


def library_path() -> Path:
    """Build the arena library if this source has not been built yet; return its path.

    The name carries a hash of the source and the platform, and the file appears by an
    atomic rename, so concurrent processes either find a complete library or build their
    own private copy and race harmlessly on the rename.
    """
    source = SOURCE.read_bytes()
    tag = hashlib.sha256(source + sys.platform.encode() + os.uname().machine.encode()).hexdigest()[:16]
    target = cache_dir() / f"libgbarena-{tag}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=target.parent)
    os.close(fd)
    cmd = [_compiler(), "-O2", "-shared", "-fPIC", "-pthread", "-o", tmp, str(SOURCE)]
    try:
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(
                f"building the bump arena failed ({' '.join(cmd)}):\n{result.stderr}"
            )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


_lib = None


def _library() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        lib = ctypes.CDLL(str(library_path()))
        lib.gb_arena_acquire.argtypes = [ctypes.c_int, ctypes.c_int]
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
        lib.gb_arena_free.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t]
        for name in ("cursor", "freed", "align", "best_fit", "num_extents"):
            fn = getattr(lib, f"gb_arena_{name}")
            fn.argtypes = [ctypes.c_int]
            fn.restype = ctypes.c_size_t
        lib.gb_arena_freed_ptr.argtypes = [ctypes.c_int]
        lib.gb_arena_freed_ptr.restype = ctypes.c_void_p
        lib.gb_arena_extent_cursor.argtypes = [ctypes.c_int, ctypes.c_size_t]
        lib.gb_arena_extent_cursor.restype = ctypes.c_size_t
        _lib = lib
    return _lib


def first_overlap(ranges: Iterable[Sequence[int]]):
    """The first two ``(base, nbytes)`` ranges that share a byte, in address order, else None."""
    ordered = sorted((int(b), int(n)) for b, n in ranges)
    for first, second in zip(ordered, ordered[1:]):
        if second[0] < first[0] + first[1]:
            return first, second
    return None


def _check(code: int, what: str) -> None:
    if code != 0:
        raise ValueError(f"{what}: {_ERRORS.get(code, f'error {code}')}")


class BumpArena:
    """Carves aligned allocations out of caller-owned extents; never reuses freed bytes.

    ``best_fit`` defaults to True: free runs arrive largest first, and first fit would
    carve small segments out of the run a large probability matrix needs.
    """

    MAX_EXTENTS = 64
    MAX_SLOTS = 64

    def __init__(self, align: int = 512, best_fit: bool = True) -> None:
        if align <= 0 or align & (align - 1):
            raise ValueError(f"align must be a positive power of two, got {align}")
        self._lib = _library()
        self.slot = self._lib.gb_arena_acquire(align, int(best_fit))
        if self.slot < 0:
            raise RuntimeError(
                f"all {self.MAX_SLOTS} bump-arena slots of this process are in use; "
                "drop BumpArena instances (and their MemPools) you no longer need"
            )
        self._finalizer = weakref.finalize(self, self._lib.gb_arena_release, self.slot)
        self._freed = ctypes.c_size_t.from_address(self._lib.gb_arena_freed_ptr(self.slot))
        self._extents: list[tuple[int, int]] = []
        self._allocator = None

    # extents
    def set_extents(self, extents: Iterable[Sequence[int]]) -> None:
        """Hand over ``(base, nbytes)`` ranges; resets every cursor and the freed counter."""
        extents = [(int(b), int(n)) for b, n in extents]
        if len(extents) > self.MAX_EXTENTS:
            raise ValueError(
                f"{len(extents)} extents given, at most {self.MAX_EXTENTS} are supported; "
                "pass the largest ones (free runs come sorted largest first)"
            )
        align = self.align
        for i, (base, nbytes) in enumerate(extents):
            if nbytes <= 0:
                raise ValueError(f"extent {i} at {base:#x} has non-positive size {nbytes}")
            if base <= 0:
                raise ValueError(f"extent {i} has base {base:#x}; a base must be a positive address")
            if base % align:
                raise ValueError(
                    f"extent {i} base {base:#x} is not aligned to {align} bytes; "
                    f"round the base up (and the size down) or lower BumpArena.align"
                )
        overlap = first_overlap(extents)
        if overlap:
            (b0, n0), (b1, n1) = overlap
            raise ValueError(
                f"extents overlap: [{b0:#x}, {b0 + n0:#x}) and [{b1:#x}, {b1 + n1:#x}); "
                "each byte may belong to one extent only"
            )
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
        """Address of ``nbytes`` rounded up to ``align``; 0 when no extent has room."""
        if nbytes < 0:
            raise ValueError(f"cannot allocate a negative size ({nbytes})")
        return self._lib.gb_arena_malloc(self.slot, nbytes) or 0

    def free(self, ptr: int, nbytes: int) -> None:
        """Count ``nbytes`` as freed. The bytes are not reused until set_extents."""
        self._lib.gb_arena_free(self.slot, ptr, nbytes)

    # state
    @property
    def cursor_bytes(self) -> int:
        return self._lib.gb_arena_cursor(self.slot)

    def extent_cursors(self) -> list[int]:
        return [self._lib.gb_arena_extent_cursor(self.slot, i) for i in range(len(self._extents))]

    @property
    def freed_bytes(self) -> int:
        return self._freed.value  # read in place: checked on every borrow

    @property
    def best_fit(self) -> bool:
        return bool(self._lib.gb_arena_best_fit(self.slot))

    @best_fit.setter
    def best_fit(self, value: bool) -> None:
        _check(self._lib.gb_arena_set_best_fit(self.slot, int(bool(value))), "best_fit")

    @property
    def align(self) -> int:
        return self._lib.gb_arena_align(self.slot)

    @align.setter
    def align(self, value: int) -> None:
        if value <= 0 or value & (value - 1):
            raise ValueError(f"align must be a positive power of two, got {value}")
        _check(self._lib.gb_arena_set_align(self.slot, value), "align")

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
        """The simulated device's pluggable-allocator hook (same C function as torch's)."""
        return self.malloc(nbytes)

    def raw_delete(self, address: int, nbytes: int, stream: int = 0) -> None:
        self.free(address, nbytes)

    def __repr__(self) -> str:
        return (
            f"BumpArena(slot={self.slot}, extents={len(self._extents)}, "
            f"capacity={self.capacity_bytes}, cursor={self.cursor_bytes}, "
            f"freed={self.freed_bytes}, best_fit={self.best_fit}, align={self.align})"
        )
