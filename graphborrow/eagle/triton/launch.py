"""Launching a step's kernels with little host work: compiled once per plan, then launched directly.

``kernel[grid](*args)`` is Triton's JIT front end. On every call it binds the arguments to
the kernel's parameters, derives a specialisation key from them (dtypes, 16-byte
alignment of every pointer, integers equal to 1 or divisible by 16), looks the compiled
kernel up, and its launcher then asks the CUDA driver about every tensor argument
(``cuPointerGetAttribute``). For the verification step, then three launches with fifteen
pointers each, that was most of its host time (about 0.4 ms on the H200's host), and all
of it is the same on every call of the same shape.

A :class:`Launcher` belongs to one step plan (one shape, one form of every argument; see
:mod:`.fused`). The plan's first call goes through the JIT front end with tensors, which
compiles or finds each kernel, and the launcher keeps the compiled kernels in launch
order. Later calls hand integer device pointers and the same scalars straight to each
compiled kernel's C launcher (the call the JIT front end ends with), skipping binding,
key and pointer queries. That is only sound while every argument would specialise as on
the first call: integers come from the plan's shape, so they do; the caller's pointers
are checked to be 16-byte aligned (workspace pointers always are), and a call with any
pointer off that alignment takes the JIT front end instead, as does every call while a
launch hook (a profiler's) is installed.

In Triton's interpreter (CPU tests) every launch takes the JIT front end with tensors:
the interpreter runs the kernels on host copies of them.
"""

from __future__ import annotations

import os

import torch

from .probs import INTERPRETED, TRITON_AVAILABLE

if TRITON_AVAILABLE:
    from triton import knobs
    from triton.runtime import driver

    try:  # the C launcher's argument layout, where this Triton has the one this module knows (3.4 to 3.6)
        from triton.backends.nvidia.driver import _BASE_ARGS_FORMAT
    except ImportError:
        _BASE_ARGS_FORMAT = None
else:
    _BASE_ARGS_FORMAT = None

__all__ = ["ALIGN", "DIRECT_ENV", "Launcher", "PlanCache", "aligned", "bound_call", "capturing_now", "current_stream",
           "direct_disabled", "launch_hooks"]

ALIGN = 16  # bytes: the pointer alignment Triton specialises on
RAW_FORMAT = "iiiKKppOOOOOO"  # grid x3, stream, function, cooperative, pdl, two scratch buffers, metadata, hooks
# Whether the current CUDA stream is capturing a graph: torch.cuda.is_current_stream_capturing
# without its Python frame (the eager paths ask on every call)
capturing_now = getattr(torch._C, "_cuda_isCurrentStreamCapturing", torch.cuda.is_current_stream_capturing)


DIRECT_ENV = "GRAPHBORROW_DIRECT_LAUNCH"  # "0": keep Triton's launcher and CUDAGraph.replay (:mod:`.direct`)


def direct_disabled() -> bool:
    """Whether ``GRAPHBORROW_DIRECT_LAUNCH=0`` asks for Triton's C launcher and
    ``CUDAGraph.replay`` in place of :mod:`.direct`'s launches (read when a plan's
    launches or a graph entry are made)."""
    return os.environ.get(DIRECT_ENV, "1") == "0"


def aligned(*pointers: int) -> bool:
    """Whether every pointer is ``ALIGN``-byte aligned (so a compiled kernel may be reused)."""
    bits = 0
    for p in pointers:
        bits |= p
    return bits % ALIGN == 0


def launch_hooks() -> bool:
    """Whether a launch hook is installed (a profiler's): then every launch takes the JIT
    front end, which calls it. (Triton 3.6 keeps hooks in a chain, empty when none is set.)"""
    hook = knobs.runtime.launch_enter_hook
    return hook is not None and bool(getattr(hook, "calls", True))


def current_stream(device: int) -> int:
    """The raw handle of the current CUDA stream of ``device`` (what a launch goes to)."""
    return driver.active.get_current_stream(device)


def bound_call(kernel) -> tuple:
    """``(call, leading arguments)`` that launch a compiled kernel as
    ``call(grid_x, grid_y, grid_z, stream, *leading, *kernel_args)``: its C launcher itself
    where the layout is known and the kernel needs no scratch memory, else the Python
    launcher object the JIT front end calls."""
    run = kernel.run
    raw = getattr(run, "launch", None)
    if (raw is not None and _BASE_ARGS_FORMAT == RAW_FORMAT and getattr(run, "global_scratch_size", 1) == 0
            and getattr(run, "profile_scratch_size", 1) == 0):
        return raw, (kernel.function, run.launch_cooperative_grid, run.launch_pdl, None, None,
                     kernel.packed_metadata, None, None, None)
    return run, (kernel.function, kernel.packed_metadata, None, None, None)


class Launcher:
    """The compiled kernels of one step plan, in launch order, and the direct launch path.

    Use: ``direct = launcher.direct(device, pointers_aligned)`` once per step; build the
    launches, ``(kernel, grid, args, options)`` each, with integer pointers when ``direct``
    is True (tensors otherwise); then ``launcher.run(launches)``. ``args`` hold every kernel
    parameter positionally, constexprs included (the JIT front end binds them; a compiled
    kernel's launcher skips them); ``grid`` has three dimensions; ``options`` are the
    kernel's compile options (num_warps, ...), fixed for the plan.
    """

    __slots__ = ("compiled", "ready", "_bound", "_direct", "_stream", "_cacheable")

    def __init__(self):
        self.compiled: list = []  # the CompiledKernel of each launch, in order
        self.ready = False  # a whole step went through the JIT front end and filled ``compiled``
        self._bound: list = []  # bound_call of each, made on the first direct step
        self._direct = False
        self._stream = 0
        self._cacheable = False

    def direct(self, device: int, pointers_aligned: bool) -> bool:
        """Begin one step on CUDA device ``device``; returns whether it launches directly."""
        self._cacheable = not INTERPRETED and pointers_aligned
        self._direct = self.ready and self._cacheable and not launch_hooks()
        if self._direct:
            if not self._bound:
                self._bound = [bound_call(k) for k in self.compiled]
            self._stream = current_stream(device)
        return self._direct

    def run(self, launches: list) -> None:
        """Launch the step's kernels in order (see the class docstring)."""
        if self._direct:
            stream = self._stream
            for (call, leading), (_, grid, args, _) in zip(self._bound, launches):
                call(grid[0], grid[1], grid[2], stream, *leading, *args)
            return
        compiled = [fn[grid](*args, **options) for fn, grid, args, options in launches]
        if self._cacheable and not self.ready:
            self.compiled, self.ready = compiled, True


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
