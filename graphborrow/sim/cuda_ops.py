"""Ops whose CUDA implementation allocates differently from the CPU one, modelled for the simulator.

On the simulated device an op runs its CPU (or META) kernel, which allocates only the
outputs. Some CUDA kernels also allocate through the caching allocator while they run,
or accept inputs the CPU kernel refuses. Each model here computes the same values by a
CPU route and allocates what the CUDA implementation of torch 2.11 allocates, in the
same order (written from ATen's sources, checked against H200 allocator traces of
transformers models, ``data/models_h200``):

* ``pow(Scalar, Tensor)``: the scalar base becomes a device tensor after the output is
  made (``wrapped_scalar_tensor(base, exp.device())``), unless the base is 1;
* ``sort``: up to 4096 elements along the sorted dimension an in-place bitonic sort
  that first fills the indices from an ``arange`` temporary of that length (int64);
* ``cumsum``: the input converted to the output's dtype (and made contiguous) when it
  is not already, and, when the scanned dimension holds every element, CUB's
  ``DeviceScan`` temporary storage;
* ``_grouped_mm`` (bf16 on sm90/sm100, CUTLASS): the kernel-argument buffer (three
  pointers, a problem shape and three strides per group) and the CUTLASS workspace
  (a fixed size per multiprocessor);
* ``histc`` on integers (CUDA takes them; the CPU kernel does not).

What a library allocates but ATen's source does not say (CUB's scan storage, CUTLASS's
workspace) is a field of :class:`KernelModel`, with the value measured on the H200.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from .tensor import dispatch, register_cuda_model

__all__ = ["H200_CAPABILITY", "KernelModel", "SMALL_SORT_LIMIT", "device_queries", "grouped_mm_argument_bytes",
           "histc_any_dtype"]

_aten = torch.ops.aten
SMALL_SORT_LIMIT = 4096  # should_use_small_sort: in-place sort up to this many elements along dim
_SCALAR_BYTES = {bool: 1, int: 8, float: 8, complex: 16}  # wrapped scalars: bool, int64, double, cdouble


@dataclasses.dataclass(frozen=True)
class KernelModel:
    """Allocations of CUDA libraries that only a GPU can tell (defaults: H200, torch 2.11+cu130).

    ``multiprocessors``: SM count (H200: 132).
    ``cub_scan_bytes``: CUB ``DeviceScan`` temporary storage of a one-tile inclusive scan
    (measured: 1023 bytes for int32 scans of 8 and of 128 items on the H200, CUDA 13.0;
    longer scans and other dtypes were not measured and use the same figure).
    ``grouped_gemm_workspace_per_sm``: the CUTLASS sm90 grouped GEMM's workspace per SM
    (it keeps per-SM TMA descriptors; measured 67584 = 132 x 512 bytes for 8 and for 128
    groups, several shapes).
    ``grouped_gemm_cutlass``: whether bf16 ``_grouped_mm`` takes the CUTLASS kernel (sm90
    and sm100) or the fallback that loops over groups with ``mm`` (no temporaries).
    """

    multiprocessors: int = 132
    cub_scan_bytes: int = 1023
    grouped_gemm_workspace_per_sm: int = 512
    grouped_gemm_cutlass: bool = True

    def __post_init__(self):
        if self.multiprocessors < 1 or self.cub_scan_bytes < 0 or self.grouped_gemm_workspace_per_sm < 0:
            raise ValueError("multiprocessors must be >= 1; byte counts must be >= 0")


def _kernels(t):
    return t.sim_backend.kernels


def _named(args, kwargs, names) -> dict:
    """An op's arguments by schema name."""
    values = dict(zip(names, args))
    values.update(kwargs)
    return values


def _temporary(backend, nbytes: int):
    """A block the kernel holds while it runs (freed when the caller drops it)."""
    return backend.new_storage(nbytes) if nbytes > 0 else None


# ------------------------------------------------------------------------ pow(Scalar, Tensor)


@register_cuda_model(_aten.pow.Scalar)
def _pow_scalar_base(func, args, kwargs):
    """``base ** tensor``: structured output first, then the base as a device scalar."""
    params = _named(args, kwargs, ("self", "exponent"))
    base, exponent = params["self"], params["exponent"]
    out = dispatch(func, args, kwargs)
    if not (isinstance(base, (int, float)) and not isinstance(base, bool) and base == 1):
        scalar = _temporary(exponent.sim_backend, _SCALAR_BYTES.get(type(base), 8))
        del scalar
    return out


# --------------------------------------------------------------------------------- sort


@register_cuda_model(_aten.sort.default, _aten.sort.stable)
def _sort(func, args, kwargs):
    """Values and indices; a small sort fills the indices from an ``arange`` temporary."""
    names = ("self", "dim", "descending") if func is _aten.sort.default else ("self", "stable", "dim", "descending")
    params = _named(args, kwargs, names)
    x = params["self"]
    dim = params.get("dim", -1)
    out = dispatch(func, args, kwargs)
    if x.dim() and x.numel() and x.shape[dim] <= SMALL_SORT_LIMIT:
        arange = _temporary(x.sim_backend, x.shape[dim] * 8)  # fillSliceWithIndex: at::arange(n, indices' int64)
        del arange
    return out


# ------------------------------------------------------------------------------- cumsum


def _scan_temporaries(x, out, dim: int) -> list:
    """What ``cumsum`` allocates after its output: a converted (contiguous) input, CUB storage."""
    backend = x.sim_backend
    held = []
    if x.dim() == 0 or x.numel() == 0:
        return held
    converted = x.dtype != out.dtype or not x.is_contiguous()
    if converted:  # self.to(result dtype), then expect_contiguous
        held.append(_temporary(backend, x.numel() * out.element_size()))
    if x.numel() == x.shape[dim]:  # the scan holds every element: cub::DeviceScan::InclusiveScan
        scan = _temporary(backend, _kernels(x).cub_scan_bytes)
        del scan
    return held


@register_cuda_model(_aten.cumsum.default, _aten.cumsum_.default)
def _cumsum(func, args, kwargs):
    """``cumsum`` and its in-place form take the same arguments and allocate alike."""
    params = _named(args, kwargs, ("self", "dim", "dtype"))
    x = params["self"]
    out = dispatch(func, args, kwargs)
    held = _scan_temporaries(x, out, params["dim"])
    del held
    return out


# ------------------------------------------------------------------------- grouped GEMM


def grouped_mm_argument_bytes(groups: int, bias: bool = False) -> int:
    """The CUTLASS grouped GEMM's argument buffer: A, B, D pointers (group count aligned to
    2), one problem shape (3 x int32) and three 8-byte strides per group, bias pointers."""
    aligned = -(-groups // 2) * 2
    return aligned * 3 * 8 + groups * 12 + 3 * groups * 8 + (aligned * 8 if bias else 0)


@register_cuda_model(_aten._grouped_mm.default)
def _grouped_mm(func, args, kwargs):
    params = _named(args, kwargs, ("self", "mat2", "offs", "bias", "out_dtype"))
    a, b = params["self"], params["mat2"]
    offs, bias, out_dtype = params.get("offs"), params.get("bias"), params.get("out_dtype")
    out = dispatch(func, args, kwargs)
    kernels = _kernels(a)
    bf16 = a.dtype == b.dtype == torch.bfloat16 and (out_dtype in (None, torch.bfloat16))
    if kernels.grouped_gemm_cutlass and bf16:
        if a.dim() == 2 and b.dim() == 2:
            groups = offs.shape[0]
        elif a.dim() == 2:
            groups = b.shape[0]
        else:
            groups = a.shape[0]
        backend = a.sim_backend
        arguments = _temporary(backend, grouped_mm_argument_bytes(groups, bias is not None))
        workspace = _temporary(backend, kernels.multiprocessors * kernels.grouped_gemm_workspace_per_sm)
        del workspace, arguments  # freed in reverse order when the kernel launcher returns
    return out


# -------------------------------------------------------------------------------- histc


def histc_any_dtype(x, bins=100, min=0, max=0):
    """``torch.histc`` for integer inputs too (CUDA supports them; the CPU kernel does not)."""
    if x.is_floating_point():
        return torch.histc(x, bins=bins, min=min, max=max)
    return torch.histc(x.double(), bins=bins, min=min, max=max).to(x.dtype)


@register_cuda_model(_aten.histc.default)
def _histc(func, args, kwargs):
    return dispatch(histc_any_dtype, args, kwargs)


H200_CAPABILITY = (9, 0)


@contextlib.contextmanager
def device_queries(capability: tuple[int, int] = H200_CAPABILITY):
    """Answer ``torch.cuda.get_device_capability`` as the simulated GPU would, for a block.

    Model code asks it to choose kernels (transformers' grouped GEMM needs sm80+); a CPU
    build has no CUDA to ask. Only this query is answered: everything else about CUDA
    stays unavailable, so nothing else silently takes a GPU path.
    """
    original = torch.cuda.get_device_capability

    def get_device_capability(device=None):
        return capability

    torch.cuda.get_device_capability = get_device_capability
    try:
        yield
    finally:
        torch.cuda.get_device_capability = original
