"""Triton as the fused kernels use it: compiled for CUDA, or its interpreter on a machine without CUDA.

Importing this module on a machine without CUDA selects Triton's interpreter
(``TRITON_INTERPRET=1``), which must happen before anything imports triton, and patches
the interpreter so the kernels' arithmetic is the compiled code's: torch's CPU ``exp`` for
``tl.exp``, and one-element scalars usable as loop bounds. Every kernel module imports
triton through here.
"""

from __future__ import annotations

import os

import numpy as np
import torch

if not torch.cuda.is_available():  # run the kernels on CPU tensors in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch formulation and the workspace (on the simulated device) still work
    triton = tl = None

__all__ = ["FMA_ROUNDS_ONCE", "INTERPRETED", "TRITON_AVAILABLE", "capturing_now", "compile_options",
           "current_stream"]

TRITON_AVAILABLE = triton is not None
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Whether the current CUDA stream is capturing a graph: torch.cuda.is_current_stream_capturing
# without its Python frame (the eager paths ask on every call)
capturing_now = getattr(torch._C, "_cuda_isCurrentStreamCapturing", torch.cuda.is_current_stream_capturing)
# The raw handle of a device's current CUDA stream, as Triton's launcher reads it
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream",
                      lambda device: torch.cuda.current_stream(device).cuda_stream)


def current_stream(device: int) -> int:
    """The raw handle of the current CUDA stream of ``device`` (0 in the interpreter): what
    a launch goes to, and what an eager call's cached workspace is kept by."""
    return 0 if INTERPRETED else _raw_stream(device)


def compile_options() -> dict:
    """No denormal flushing in libdevice and no fused multiply-add: torch's kernels use neither."""
    if INTERPRETED:
        return {}
    return {"enable_fp_fusion": False, "enable_reflect_ftz": False}


def _fma_rounds_once() -> bool:
    """Compiled code's fma rounds once; Triton's interpreter's does from the release whose
    C ``fma_fp32`` it calls (3.9), while earlier ones round twice, which could flip the last
    bit of :func:`~graphborrow.eagle.triton.formula.exp_y_minus_m`, so there rows divide."""
    if not (TRITON_AVAILABLE and INTERPRETED):
        return TRITON_AVAILABLE
    from triton._C.libtriton import interpreter

    return hasattr(interpreter, "fma_fp32")


FMA_ROUNDS_ONCE = _fma_rounds_once()


def _patch_interpreter_scalars() -> None:
    """Triton's interpreter turns one-element scalars into loop bounds with ``int(array)``,
    which NumPy >= 2.4 refuses for 1-d arrays; index the element instead."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_graphborrow", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._graphborrow = True
    interpreter._patch_lang_tensor = patched


def _torch_exp(data: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(data)).exp().numpy()


def _patch_interpreter_exp() -> None:
    """The interpreter's ``tl.exp`` is numpy's, which differs from torch's CPU exp in the last
    bit for about a third of float32 inputs; use torch's, as the CUDA build shares expf with torch."""
    from triton.runtime.interpreter import InterpreterBuilder

    if getattr(InterpreterBuilder.create_exp, "_graphborrow", False):
        return

    def create_exp(self, arg):
        return self.unary_op(arg, _torch_exp)

    create_exp._graphborrow = True
    InterpreterBuilder.create_exp = create_exp


if TRITON_AVAILABLE and INTERPRETED:
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(tl.max, InterpretedFunction):
        raise RuntimeError("triton.language was imported before TRITON_INTERPRET=1 was set, so its library "
                           "functions cannot run in the interpreter; set TRITON_INTERPRET=1 in the environment "
                           "(or import graphborrow.eagle.triton.runtime before triton)")
    _patch_interpreter_scalars()
    _patch_interpreter_exp()
