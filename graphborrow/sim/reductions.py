"""What a CUDA reduction allocates beside its output, as torch 2.11 runs it on an H200.

Reduce.cuh's setReduceConfig lays a reduction out over blocks. When each output has many
inputs and there are few outputs, it splits every output's inputs across several blocks
(``ctas_per_output``), which then combine through global memory: the kernel launcher
allocates a staging buffer (``global_memory_size``) and one int semaphore per grid column
(``semaphore_size``) after the output (and after a converted copy of the input), and frees
them, last first, when the launch returns. Registered with the other CUDA op models when
:mod:`graphborrow.sim` is imported.
"""

from __future__ import annotations

import math

import torch

from .cuda_ops import kernels_of, temporary
from .dispatch import dispatch
from .tensor import register_cuda_model

__all__ = ["reduce_staging_bytes"]

_aten = torch.ops.aten

# reductions whose input CUDA first converts to the result's dtype (make_reduction_from_out_ty)
_CONVERTING_REDUCTIONS = {_aten.sum.default, _aten.sum.dim_IntList, _aten.mean.default, _aten.mean.dim,
                          _aten.prod.default, _aten.prod.dim_int, _aten.nansum.default}
_VALUE_REDUCTIONS = {_aten.amax.default, _aten.amin.default, _aten.max.default, _aten.min.default}
_PAIR_REDUCTIONS = {_aten.max.dim, _aten.min.dim, _aten.argmax.default, _aten.argmin.default}
_BOOL_REDUCTIONS = {_aten.any.default, _aten.any.dim, _aten.any.dims, _aten.all.default, _aten.all.dim,
                    _aten.all.dims}
_WELFORD_REDUCTIONS = {_aten.var.correction, _aten.std.correction, _aten.var_mean.correction,
                       _aten.std_mean.correction}
_NORM_REDUCTIONS = {_aten.linalg_vector_norm.default}
_WARP = 32
_MAX_THREADS = 512
_THREADS_PER_SM = 2048  # H100/H200 maxThreadsPerMultiProcessor


def _accumulate_bytes(dtype: torch.dtype) -> int:
    """``at::acc_type`` on CUDA: float for half types and float, double, int64 for integers."""
    if dtype in (torch.float16, torch.bfloat16, torch.float32):
        return 4
    if dtype.is_complex:
        return 16 if dtype == torch.complex128 else 8
    return 8


def _reduction_arg_bytes(func, x, out) -> int:
    """``sizeof(arg_t)`` of the reduction's ops (the staging buffer's element)."""
    if func in _CONVERTING_REDUCTIONS or func in _NORM_REDUCTIONS:
        return _accumulate_bytes(out.dtype)
    if func in _VALUE_REDUCTIONS:
        return x.element_size()
    if func in _PAIR_REDUCTIONS:  # (value or accumulator, int64 index)
        return 16
    if func in _BOOL_REDUCTIONS:
        return 1
    if func in _WELFORD_REDUCTIONS:  # WelfordData: mean, m2, nf of the accumulator and an int32 count
        acc = _accumulate_bytes(x.dtype)
        return 4 * acc if acc == 8 else 16
    return x.element_size()


def _last_pow2(n: int) -> int:
    return max(1, 1 << (int(n).bit_length() - 1)) if n > 0 else 1


def _reduction_geometry(shape, strides, reduced) -> tuple[list, list, int]:
    """TensorIterator's view of a reduction: dims fastest first (reduced ones first, by input stride;
    the kept ones by the output's strides), adjacent dims coalesced; returns (sizes, input strides in
    elements, number of reduced dims)."""
    kept = [d for d in range(len(shape)) if d not in reduced and shape[d] != 1]
    out_stride, acc = {}, 1
    for d in reversed(kept):
        out_stride[d] = acc
        acc *= shape[d]
    red = sorted((d for d in reduced if shape[d] != 1), key=lambda d: strides[d])
    order = red + sorted(kept, key=lambda d: (out_stride[d], strides[d]))
    sizes, in_strides, outs = [], [], []
    for d in order:
        o = 0 if d in reduced else out_stride[d]
        if sizes and (outs[-1] * sizes[-1] == o and in_strides[-1] * sizes[-1] == strides[d]) and (
                (o == 0) == (outs[-1] == 0)):
            sizes[-1] *= shape[d]
            continue
        sizes.append(shape[d])
        in_strides.append(strides[d])
        outs.append(o)
    return sizes, in_strides, sum(1 for o in outs if o == 0)


def _output_vec_size(sizes, in_strides, n_reduce: int, address_elems: int) -> int:
    """``get_output_vec_size``: 4, halved until it divides the input's address, the first kept
    size and every other input stride (in elements)."""
    vec = 4
    for n in [address_elems, sizes[n_reduce]] + [s for j, s in enumerate(in_strides) if j != n_reduce]:
        while n % vec:
            vec //= 2
    return vec


def reduce_staging_bytes(shape, strides, reduced, arg_bytes: int, multiprocessors: int = 132,
                         address_elems: int = 0) -> tuple[int, int]:
    """The staging buffer and semaphores of CUDA's reduction kernel (Reduce.cuh, setReduceConfig).

    Args:
        shape, strides: the input's sizes and strides (elements).
        reduced: the reduced dims (non-negative).
        arg_bytes: ``sizeof(arg_t)`` of the reduction.
        multiprocessors: SM count.
        address_elems: the input's address in elements (decides the output vector size).

    Returns:
        ``(buffer bytes, semaphore bytes)``; ``(0, 0)`` when the blocks need not combine through
        global memory.
    """
    sizes, in_strides, n_reduce = _reduction_geometry(list(shape), list(strides), set(reduced))
    numel = math.prod(shape)
    if not sizes or numel == 0 or n_reduce == 0:
        return 0, 0
    num_outputs = math.prod(sizes[n_reduce:])
    inputs = numel // num_outputs
    fastest = n_reduce == len(sizes) or in_strides[0] < in_strides[n_reduce]
    vec_out = 1
    if fastest:
        dim0, dim1, moving = inputs, num_outputs, in_strides[0]
    else:
        dim0, dim1, moving = num_outputs, inputs, in_strides[n_reduce]
    if moving == 1:
        if fastest and dim0 > 128 and n_reduce == 1:
            dim0 //= 4  # vectorised along the input
        elif not fastest:
            vec_out = _output_vec_size(sizes, in_strides, n_reduce, address_elems)
            dim0 //= vec_out
    max_threads = _MAX_THREADS // vec_out
    pow0 = _last_pow2(dim0) if dim0 < max_threads else max_threads
    pow1 = _last_pow2(dim1) if dim1 < max_threads else max_threads
    width = min(pow0, _WARP)
    height = min(pow1, max_threads // width)
    width = min(pow0, max_threads // height)
    step_input, step_output = 1, 1
    if fastest:
        step_input *= width
    else:
        step_output *= width
    block_x_reduce = fastest
    warp_split = -(-inputs // step_input) >= min(height * 16, 256)
    if warp_split:
        step_input *= height
    else:
        step_output *= height
    grid = -(-(num_outputs // vec_out) // step_output)
    target = multiprocessors * (_THREADS_PER_SM // (width * height))
    values = -(-inputs // step_input)
    if not (warp_split and values >= 256 and grid <= target):
        return 0, 0
    ctas = max(min(-(-target // grid), -(-values // 16)), -(-values // 256))
    if ctas <= 1:
        return 0, 0
    size = arg_bytes * num_outputs * ctas
    if not block_x_reduce:
        size *= width * vec_out
    return size, 4 * grid


def _reduced_dims(func, args, kwargs, x) -> list:
    schema = func._schema
    names = [a.name for a in schema.arguments]
    values = dict(zip(names, args))
    values.update(kwargs)
    dim = values.get("dim")
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0 and func not in (_aten.sum.dim_IntList,
                                                                                           _aten.mean.dim)):
        return list(range(x.dim()))
    if isinstance(dim, int):
        dim = [dim]
    if len(dim) == 0:
        return list(range(x.dim()))
    return sorted({d % max(x.dim(), 1) for d in dim})


@register_cuda_model(*(_CONVERTING_REDUCTIONS | _VALUE_REDUCTIONS | _PAIR_REDUCTIONS | _BOOL_REDUCTIONS
                       | _WELFORD_REDUCTIONS | _NORM_REDUCTIONS))
def _reduction(func, args, kwargs):
    """A reduction: its outputs; a converted copy of the input where CUDA makes one (a reduction into
    another dtype, ``bool.sum()`` giving int64, except half types into float32, which the kernel
    reads as they are); then Reduce.cuh's staging buffer and semaphores when the blocks of an output
    combine through global memory (:func:`reduce_staging_bytes`)."""
    out = dispatch(func, args, kwargs)
    x = args[0]
    first = out[0] if isinstance(out, (tuple, list)) else out
    backend = x.sim_backend
    converted = None
    if func in _CONVERTING_REDUCTIONS and first.dtype != x.dtype and x.numel() and not (
            x.dtype in (torch.float16, torch.bfloat16) and first.dtype == torch.float32):
        converted = temporary(backend, x.numel() * first.element_size())
    if x.dim() and x.numel() > 1:
        reduced = _reduced_dims(func, args, kwargs, x)
        strides = x.stride() if converted is None else _contiguous(x.shape)
        address = 0 if converted is not None else backend.data_ptr(x) // x.element_size()
        buffer_bytes, semaphore_bytes = reduce_staging_bytes(
            tuple(x.shape), tuple(strides), reduced, _reduction_arg_bytes(func, x, first),
            kernels_of(x).multiprocessors, address)
        if buffer_bytes:
            buffer = temporary(backend, buffer_bytes)
            semaphores = temporary(backend, semaphore_bytes)
            del semaphores, buffer
    del converted
    return out


def _contiguous(shape) -> tuple:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))
