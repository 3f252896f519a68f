"""Launching a step's kernels with little host work: compiled once per plan, then launched directly.

``kernel[grid](*args)`` is Triton's JIT front end. On every call it binds the arguments to
the kernel's parameters, derives a specialisation key from them (dtypes, 16-byte
alignment of every pointer, integers equal to 1 or divisible by 16), looks the compiled
kernel up, and its launcher then asks the CUDA driver about every tensor argument
(``cuPointerGetAttribute``). For a verification step of three launches with fifteen
pointers each that is most of the step's host time, and all of it is the same on every
call of the same shape.

A :class:`Launcher` belongs to one step plan (one shape, one form of every argument; see
:mod:`.fused`). The plan's first call goes through the JIT front end with tensors, which
compiles or finds each kernel, and the launcher keeps the compiled kernels in launch
order. Later calls hand integer device pointers and the same scalars straight to each
compiled kernel's launcher (``CompiledKernel.run``, the call the JIT front end ends with),
skipping binding, key and pointer queries. That is only sound while every argument would
specialise as on the first call: integers come from the plan's shape, so they do; the
caller's pointers are checked to be 16-byte aligned (workspace pointers always are), and
a call with any pointer off that alignment takes the JIT front end instead.

In Triton's interpreter (CPU tests) every launch takes the JIT front end with tensors:
the interpreter runs the kernels on host copies of them.
"""

from __future__ import annotations

from .probs import INTERPRETED, TRITON_AVAILABLE

if TRITON_AVAILABLE:
    from triton import knobs
    from triton.runtime import driver

__all__ = ["ALIGN", "Launcher", "PlanCache", "aligned"]

ALIGN = 16  # bytes: the pointer alignment Triton specialises on


def aligned(*pointers: int) -> bool:
    """Whether every pointer is ``ALIGN``-byte aligned (so a compiled kernel may be reused)."""
    bits = 0
    for p in pointers:
        bits |= p
    return bits % ALIGN == 0


def _launch_hooks() -> bool:
    """Whether a launch hook is installed (a profiler's): then every launch takes the JIT
    front end, which calls it. (Triton 3.6 keeps hooks in a chain, empty when none is set.)"""
    hook = knobs.runtime.launch_enter_hook
    return hook is not None and bool(getattr(hook, "calls", True))


class Launcher:
    """The compiled kernels of one step plan, in launch order, and the direct launch path.

    Use: ``direct = launcher.start(device, pointers_aligned)`` once per step; build the
    arguments with integer pointers when ``direct`` is True (tensors otherwise); then
    ``launcher.launch(fn, grid, args, options)`` for each kernel in order, and
    ``launcher.finish()``. ``args`` hold every kernel parameter positionally, constexprs
    included (the JIT front end binds them; a compiled kernel's launcher skips them).
    """

    __slots__ = ("compiled", "ready", "_bound", "_direct", "_next", "_stream", "_cacheable")

    def __init__(self):
        self.compiled: list = []  # the CompiledKernel of each launch, in order
        self.ready = False  # a whole step went through the JIT front end and filled ``compiled``
        self._bound: list = []  # (run, function handle, packed metadata) per launch, made on first use
        self._direct = False
        self._next = 0
        self._stream = 0
        self._cacheable = False

    def start(self, device: int, pointers_aligned: bool) -> bool:
        """Begin one step on CUDA device ``device``; returns whether it launches directly."""
        self._next = 0
        self._cacheable = not INTERPRETED and pointers_aligned
        self._direct = self.ready and self._cacheable and not _launch_hooks()
        if self._direct:
            if not self._bound:
                self._bound = [(k.run, k.function, k.packed_metadata) for k in self.compiled]
            self._stream = driver.active.get_current_stream(device)
        elif not self.ready:
            self.compiled.clear()  # (a step that failed half way filled part of it)
        return self._direct

    def launch(self, fn, grid: tuple, args: tuple, options: dict) -> None:
        """Launch ``fn`` over ``grid`` (three dimensions) with ``args``; ``options`` are its
        compile options (num_warps, ...), fixed for the plan."""
        if self._direct:
            run, function, metadata = self._bound[self._next]
            run(grid[0], grid[1], grid[2], self._stream, function, metadata, None, None, None, *args)
        else:
            compiled = fn[grid](*args, **options)
            if self._cacheable and not self.ready:
                self.compiled.append(compiled)
        self._next += 1

    def finish(self) -> None:
        """End a step: after its first complete JIT call the plan's kernels are known."""
        if self._cacheable and not self.ready:
            self.ready = len(self.compiled) == self._next


class PlanCache:
    """Plans by key, made on first sight by ``make(*args)``; at most ``size`` kept (the
    oldest goes first). A plan is a few hundred bytes and its compiled kernels' handles."""

    def __init__(self, make, size: int = 256):
        self.make, self.size, self.plans = make, size, {}

    def get(self, key, *args):
        """The plan for ``key``, made from ``args`` if there is none."""
        plan = self.plans.get(key)
        if plan is None:
            if len(self.plans) >= self.size:
                self.plans.pop(next(iter(self.plans)))
            plan = self.plans[key] = self.make(*args)
        return plan

    def clear(self) -> None:
        self.plans.clear()
