"""What cuBLAS and cuBLASLt allocate around a GEMM on the simulated device, and how ATen composes
``linear`` and ``matmul`` into GEMMs (torch 2.11 on an H200, checked against ``data/fuzz``).

* the first cuBLAS call of the process makes its handle (``cublasCreate``), which allocates:
  inside a capture that fails and invalidates the capture (:data:`CUBLAS_CREATE_IN_CAPTURE`);
* the first GEMM on each stream allocates that stream's cuBLAS workspace, kept until
  ``torch._C._cuda_clearCublasWorkspaces`` (``SimBackend(blas_workspace=...)``);
* ``addmm``'s cuBLASLt path (the bias fused in the epilogue) keeps a cuBLASLt workspace per
  stream (``SimBackend(blaslt_workspace=...)``), allocated after the output;
* ``prepare_matrix_for_cublas`` clones a matrix operand without a usable leading dimension
  contiguous for the call's duration;
* ``F.linear`` is one ``addmm`` for rows with a bias, ``matmul`` otherwise; ``matmul`` reached
  whole folds batched operands as ATen's composite does.
"""

from __future__ import annotations

import torch

from . import host
from .tensor import SimTensor, non_overlapping_and_dense, register_cuda_model

__all__ = ["BLAS_OPS", "CUBLAS_CREATE_IN_CAPTURE", "creates_handle_in_capture", "handle_in_capture",
           "library_allocations"]

_aten = torch.ops.aten
# cuBLAS calls: the first one on a stream allocates that stream's workspace (kept forever)
BLAS_OPS = {
    _aten.mm, _aten.addmm, _aten.bmm, _aten.baddbmm, _aten.addbmm, _aten.mv, _aten.addmv,
    _aten.dot, _aten.vdot, _aten._addmm_activation,
}
# addmm's cuBLASLt path (bias fused in the epilogue): it also keeps a cuBLASLt workspace per stream
_BLASLT_OPS = {_aten.addmm.default, _aten._addmm_activation.default}
_BLASLT_DTYPES = {torch.float64, torch.float32, torch.float16, torch.bfloat16}
CUBLAS_CREATE_IN_CAPTURE = "CUDA error: CUBLAS_STATUS_NOT_INITIALIZED when calling `cublasCreate(handle)`"


def creates_handle_in_capture(backend, capture) -> bool:
    """Whether this GEMM makes the process's cuBLAS handle inside a capture (which CUDA refuses);
    outside a capture the first GEMM makes it."""
    if backend.blas_handle:
        return False
    if capture is not None:
        return True
    backend.blas_handle = True
    return False


def handle_in_capture(backend) -> RuntimeError:
    """The error ``cublasCreate`` inside a capture gives (the capture is invalidated)."""
    return host.fails_in_capture(backend, CUBLAS_CREATE_IN_CAPTURE)


def library_allocations(func, args, kwargs, backend) -> None:
    """After a GEMM's output: its operand copies, the stream's cuBLAS (and cuBLASLt) workspace on
    first use, then the copies freed as the call returns."""
    copies = _cublas_operand_copies(func, args, backend)
    if backend.blas_workspace:
        backend.ensure_blas_workspace()
    if backend.blaslt_workspace and _uses_cublaslt(func, args, kwargs):
        backend.ensure_blaslt_workspace()
    del copies


def _uses_cublaslt(func, args, kwargs) -> bool:
    """addmm_out_cuda_impl's choice of cuBLASLt (isInputCompliesAddmmCudaLt, CUDA >= 12.1)."""
    if func not in _BLASLT_OPS:
        return False
    bias, mat1, mat2 = args[:3]
    beta = kwargs.get("beta", args[3] if len(args) > 3 else 1)
    activation = func is _aten._addmm_activation.default
    fusable_bias = (bias.is_contiguous() and (bias.dim() == 1 or bias.squeeze().dim() == 1)
                    and bias.shape[-1] == mat2.shape[1])
    # torch 2.11 takes the Lt path for a single row too (data/fuzz: a 1-D input's linear with bias),
    # but not for one column of mat1 or one row or column of mat2 (cuBLASLt's heuristic refuses
    # those: data/fuzz, linear layers of one input feature)
    return (beta == 1 and (fusable_bias or (activation and bias.dim() == 2))
            and mat1.dtype in _BLASLT_DTYPES and mat1.shape[1] > 1 and mat2.shape[0] > 1 and mat2.shape[1] > 1)


_MATRIX_OPERANDS = {_aten.mm.default: (0, 1), _aten.addmm.default: (1, 2), _aten._addmm_activation.default: (1, 2)}


def _cublas_operand_copies(func, args, backend) -> list:
    """``prepare_matrix_for_cublas``: a matrix operand that is neither dense nor a strided row- or
    column-major matrix with a usable leading dimension (an ``expand``, a stride of 0) is cloned
    contiguous before the GEMM; the clones are freed when it returns."""
    positions = _MATRIX_OPERANDS.get(func)
    if positions is None:
        return []
    held = []
    for i in positions:
        m = args[i] if i < len(args) else None
        if not isinstance(m, SimTensor) or m.dim() != 2 or m.numel() == 0:
            continue
        (rows, cols), (s0, s1) = m.shape, m.stride()
        if non_overlapping_and_dense(m) or (s0 == 1 and s1 >= max(1, rows)) or (s1 == 1 and s0 >= max(1, cols)):
            continue
        held.append(backend.new_storage(m.numel() * m.element_size()))
    return held


@register_cuda_model(_aten.linear.default, torch.nn.functional.linear)
def _linear(func, args, kwargs):
    """``F.linear`` as ATen (torch 2.11) composes it: with a bias, a 2-D input is one ``addmm`` and a
    contiguous input of any other rank is flattened to rows for one (cuBLASLt fuses the bias);
    otherwise ``matmul`` and an in-place ``add_``."""
    params = dict(zip(("input", "weight", "bias"), args), **kwargs)
    x, weight, bias = params["input"], params["weight"], params.get("bias")
    if bias is not None and x.dim() == 2:
        return torch.addmm(bias, x, weight.t())
    if bias is not None and x.is_contiguous() and bias.dim() == 1:
        rows = torch.addmm(bias, x.reshape(-1, x.shape[-1]), weight.t())
        return rows.view(*x.shape[:-1], weight.shape[0])
    out = torch.matmul(x, weight.t())
    if bias is not None:
        out.add_(bias)
    return out


@register_cuda_model(_aten.matmul.default)
def _matmul(func, args, kwargs):
    """``matmul`` reached whole (inference mode): ATen's own composite, not torch's Python
    decomposition, whose folding rule differs (ATen folds a batch-expanded operand whose strides
    allow a view, then cuBLAS clones it: data/fuzz, fuzz0121)."""
    return func._op_dk(torch._C.DispatchKey.CompositeImplicitAutograd, *args, **kwargs)
