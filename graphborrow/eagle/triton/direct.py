"""Direct launches of compiled kernels and captured graphs, from a small C module (``direct.c``).

Triton's C launcher parses and converts every kernel argument on every call: for the
verification step about eighty positions, constexprs included. A :class:`KernelLaunch` made
here packs the kernel's trailing arguments (the workspace's addresses, the plan's sizes)
once, and each launch writes only the leading per-call ones (the caller's addresses and
numbers) before ``cuLaunchKernel``. :func:`graph_launch` launches a captured graph's
executable the same way (``cuGraphLaunch``), without ``CUDAGraph.replay``'s bookkeeping for
random-number generators: only for graphs that draw no random numbers.

The module is compiled once per content into the native-build cache
(:mod:`graphborrow.core.native`) against Python's headers only; it opens the CUDA driver
library on its first launch, so it builds, and packs arguments, on a machine without one.
Where it cannot be built (no compiler, no Python headers) :func:`module` returns None and
the callers keep Triton's launcher and ``CUDAGraph.replay``.
"""

from __future__ import annotations

import functools
from pathlib import Path

from graphborrow.core import native

__all__ = ["SOURCE", "TYPE_KINDS", "build", "graph_launch", "kernel_launch", "kinds_of", "module"]

SOURCE = Path(__file__).with_name("direct.c")
NAME = "graphborrow_direct"
# Triton's argument types -> the module's kind characters (pointers are "P", constexprs "x")
TYPE_KINDS = {"i1": "b", "i8": "b", "i16": "h", "i32": "i", "i64": "l", "u1": "B", "u8": "B", "u16": "H",
              "u32": "I", "u64": "L", "fp16": "e", "bf16": "r", "fp32": "f", "f32": "f", "fp64": "d"}
SCRATCH_KINDS = "PP"  # the two scratch pointers Triton's launchers (3.4 to 3.6) pass after the arguments


def build() -> Path:
    """Compile ``direct.c`` unless an intact build of it exists; return the built module's path.

    Raises:
        RuntimeError: no C compiler, no Python headers, or the compile failed (its message).
    """
    return native.build_extension("the direct launcher", NAME, SOURCE, native.compiler, _command)


def _command(cc: str, output: Path, include: str) -> list[str]:
    return [cc, "-O2", "-shared", "-fPIC", f"-I{include}", "-o", str(output), str(SOURCE), "-ldl"]


@functools.cache
def module():
    """The compiled module (built on first use), or None where it cannot be built."""
    try:
        path = build()
    except RuntimeError:
        return None
    return native.load_extension(NAME, path)


def kinds_of(signature) -> str | None:
    """The kind characters of a compiled kernel's argument positions (``kernel.src.signature``'s
    values, in order), the two scratch pointers after them; None for a type this module does
    not pack (tuples, tensor descriptors), which keeps Triton's launcher."""
    kinds = []
    for ty in signature:
        if ty == "constexpr":
            kinds.append("x")
        elif isinstance(ty, str) and ty.startswith("*"):
            kinds.append("P")
        elif isinstance(ty, str) and ty in TYPE_KINDS:
            kinds.append(TYPE_KINDS[ty])
        else:
            return None
    return "".join(kinds) + SCRATCH_KINDS


def kernel_launch(kernel, device: int, grid: tuple, stream: int, per_call: int, fixed: tuple):
    """A :class:`KernelLaunch` of the compiled Triton ``kernel``: ``per_call`` leading argument
    positions passed per launch, ``fixed`` the values of the rest. None where the direct path
    does not apply: no module, a kernel that needs scratch memory, clusters, a cooperative or
    programmatic-dependent launch, an argument type it does not pack, or a signature of
    another length. Then the caller keeps Triton's launcher."""
    direct = module()
    run = getattr(kernel, "run", None)
    signature = getattr(getattr(kernel, "src", None), "signature", None)
    metadata = getattr(kernel, "metadata", None)
    if direct is None or run is None or not isinstance(signature, dict) or metadata is None:
        return None
    if (getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1)
            or getattr(run, "launch_cooperative_grid", True) or getattr(run, "launch_pdl", True)
            or getattr(metadata, "num_ctas", 1) != 1):
        return None
    kinds = kinds_of(signature.values())
    if kinds is None or len(signature) != per_call + len(fixed):
        return None
    return direct.KernelLaunch(kernel.function, device, tuple(grid), 32 * metadata.num_warps, metadata.shared, stream,
                               kinds, (*fixed, 0, 0))


def graph_launch(executable: int, stream: int, device: int) -> None:
    """Launch a captured graph's executable (``CUDAGraph.raw_cuda_graph_exec()``) on the raw
    ``stream`` handle of CUDA device ``device``."""
    module().graph_launch(executable, stream, device)
