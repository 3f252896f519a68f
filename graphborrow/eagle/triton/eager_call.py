"""The eager short path compiled: a C++ :class:`Router` (``eager_call.cpp``) that makes
:func:`~graphborrow.eagle.triton.eager.short_path`'s call without reading tensors through Python.

``short_path()`` reads about sixty tensor attributes per call (shape, dtype, contiguity,
device, address), each a Python call into torch, and cuts its outputs through torch's
Python binding: on the H200's host that is most of the call's 20-40 µs. The Router reads
them from each tensor's C++ object. ``short_path()`` registers a *route* (the plan's key,
the stream, the workspace's addresses, the launches) once it has launched a plan on a
stream, and :func:`~graphborrow.eagle.triton.eager.eager` asks the Router first on every
later call; the Router returns None wherever ``short_path()`` would not take the call the
same way, and ``short_path()`` (then the general path) takes it.

The module is compiled once per content and torch version into the native-build cache
(:mod:`graphborrow.core.native`) against the running torch's headers; about 10-30 s, so
``python -m graphborrow build`` makes it ahead of time, and otherwise the first eager call
does. Where it cannot be built (no C++ compiler, no torch or Python headers) :func:`module`
returns None and ``short_path()`` takes every call. ``GRAPHBORROW_DIRECT_LAUNCH=0`` turns it
off with the direct launcher.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from graphborrow.core import native

__all__ = ["SOURCE", "build", "build_command", "module"]

SOURCE = Path(__file__).with_name("eager_call.cpp")
NAME = "graphborrow_eager_call"


def build_command(cxx: str, output: Path, include: str) -> list[str]:
    """The compile command: torch's headers as system headers (their warnings are not ours),
    torch's libraries linked by name and found again at load time (rpath)."""
    from torch.utils import cpp_extension

    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", 1))
    includes = [f"-isystem{p}" for p in cpp_extension.include_paths()]
    libraries = cpp_extension.library_paths()
    return [cxx, "-O2", "-shared", "-fPIC", "-std=c++17", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *includes,
            f"-I{include}", "-o", str(output), str(SOURCE),
            *[f"-L{p}" for p in libraries], *[f"-Wl,-rpath,{p}" for p in libraries],
            "-lc10", "-ltorch_cpu", "-ltorch", "-ltorch_python", "-ldl"]


def build() -> Path:
    """Compile ``eager_call.cpp`` for this torch unless an intact build exists; return its path.

    Raises:
        RuntimeError: no C++ compiler, no Python or torch headers, or the compile failed (its message).
    """
    return native.build_extension("the compiled eager path", NAME, SOURCE, native.cxx_compiler, build_command,
                                  torch.__version__.encode(), str(Path(torch.__file__).parent).encode())


@functools.cache
def module():
    """The compiled module (built on first use), or None where it cannot be built or loaded."""
    try:
        return native.load_extension(NAME, build())
    except (RuntimeError, ImportError, OSError):
        return None
