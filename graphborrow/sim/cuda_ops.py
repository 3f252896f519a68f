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
* ``histc`` on integers (CUDA takes them; the CPU kernel does not);
* reductions: ``Reduce.cuh``'s global staging buffer and semaphores when an output's inputs are
  split across blocks (:func:`graphborrow.sim.reductions.reduce_staging_bytes`), and a converted copy of the input where
  the result has another dtype;
* ``softmax`` and ``topk``: the contiguous copy of a strided input;
* ``sort`` past 4096 elements per row, ``randperm`` and ``index_put_(accumulate=True)``: their
  CUB radix sorts (:func:`cub_radix_sort_pairs_bytes`) and the buffers around them.

What a library allocates but ATen's source does not say (CUB's scan storage, CUTLASS's
workspace) is a field of :class:`KernelModel` or a constant here (:data:`ONESWEEP_TILE_ITEMS`),
with the value measured on the H200.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import torch

from . import autocast, host
from .autograd import KernelFunction, records_grad, reference_grads
from .dispatch import dispatch, launch_kernel
from .tensor import SimTensor, non_overlapping_and_dense, register_cuda_model, register_factory_model
from .torch_function import torch_functions_off
from .values import keeps_values, meta_like

__all__ = ["H200_CAPABILITY", "KernelModel", "SMALL_SORT_LIMIT", "device_queries", "grouped_mm_argument_bytes",
           "histc_any_dtype", "kernels_of", "temporary"]

_aten = torch.ops.aten
SMALL_SORT_LIMIT = 4096  # should_use_small_sort: in-place sort up to this many elements along dim
_SCALAR_BYTES = {bool: 1, int: 8, float: 8, complex: 16}  # wrapped scalars: bool, int64, double, cdouble


@dataclasses.dataclass(frozen=True)
class KernelModel:
    """Allocations of CUDA libraries that only a GPU can tell (defaults: H200, torch 2.11+cu130).

    ``multiprocessors``: SM count (H200: 132).
    ``scan_tile_items``: items per tile of CUB's ``DeviceScan`` by value size in bytes: its
    temporary storage is the decoupled look-back state of ``ceil(n / tile)`` tiles (see
    :meth:`cub_scan_bytes`; fitted to every cumsum of ``data/fuzz``'s ``probe_scan``, 1 to
    10**6 items of bf16, fp32 and int64 on the H200, CUDA 13.0).
    ``grouped_gemm_workspace_per_sm``: the CUTLASS sm90 grouped GEMM's workspace per SM
    (it keeps per-SM TMA descriptors; measured 67584 = 132 x 512 bytes for 8 and for 128
    groups, several shapes).
    ``grouped_gemm_cutlass``: whether bf16 ``_grouped_mm`` takes the CUTLASS kernel (sm90
    and sm100) or the fallback that loops over groups with ``mm`` (no temporaries).
    """

    multiprocessors: int = 132
    scan_tile_items: tuple = ((2, 3840), (4, 3840), (8, 1344))
    grouped_gemm_workspace_per_sm: int = 512
    grouped_gemm_cutlass: bool = True

    def __post_init__(self):
        if self.multiprocessors < 1 or self.grouped_gemm_workspace_per_sm < 0:
            raise ValueError("multiprocessors must be >= 1; byte counts must be >= 0")
        if any(items < 1 for _, items in self.scan_tile_items):
            raise ValueError("scan_tile_items must give a positive tile size for every value size")

    def cub_scan_bytes(self, items: int, itemsize: int) -> int:
        """CUB ``DeviceScan::InclusiveScan`` temporary storage for ``items`` values of ``itemsize`` bytes.

        The tile state has ``tiles + 32`` entries (a warp of padding): 16-byte descriptors for
        4-byte values, 24-byte ones for 8-byte values, and for 2-byte values three arrays (4-byte
        status, partial and inclusive values), each 256-aligned in a blob with 255 bytes of
        slack; the scan then aligns the state the same way.
        """
        tile = dict(self.scan_tile_items).get(itemsize, dict(self.scan_tile_items)[4])
        entries = -(-items // tile) + 32
        if itemsize == 4:
            state = entries * 16
        elif itemsize == 8:
            state = entries * 24
        else:
            state = _align256(4 * entries) + 2 * _align256(itemsize * entries) + 255
        return _align256(state) + 255


def _align256(nbytes: int) -> int:
    return -(-nbytes // 256) * 256


def kernels_of(t):
    return t.sim_backend.kernels


def _named(args, kwargs, names) -> dict:
    """An op's arguments by schema name."""
    values = dict(zip(names, args))
    values.update(kwargs)
    return values


def temporary(backend, nbytes: int):
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
        scalar = temporary(exponent.sim_backend, _SCALAR_BYTES.get(type(base), 8))
        del scalar
    return out


# --------------------------------------------------------------------------------- sort


@register_cuda_model(_aten.sort.default, _aten.sort.stable)
def _sort(func, args, kwargs):
    """Values and indices, then what CUDA's sort allocates: up to 4096 elements along the dim an
    in-place bitonic sort that first fills the indices from an ``arange`` temporary of that length
    (int64); past it the stable sort (Sort.cu, :func:`_long_sort`)."""
    names = ("self", "dim", "descending") if func is _aten.sort.default else ("self", "stable", "dim", "descending")
    params = _named(args, kwargs, names)
    x = params["self"]
    dim = params.get("dim", -1)
    out = dispatch(func, args, kwargs)
    if x.dim() and x.numel() and x.shape[dim] <= SMALL_SORT_LIMIT:
        arange = temporary(x.sim_backend, x.shape[dim] * 8)  # fillSliceWithIndex: at::arange(n, indices' int64)
        del arange
    elif x.dim() and x.numel():
        _long_sort(x, dim % x.dim(), out[0], out[1])
    return out


def _dense_dim_last_strides(shape, dim: int) -> tuple:
    order = [d for d in range(len(shape)) if d != dim] + [dim]
    strides, acc = [0] * len(shape), 1
    for d in reversed(order):
        strides[d] = acc
        acc *= max(shape[d], 1)
    return tuple(strides)


def _long_sort(x, dim: int, values, indices) -> None:
    """``sort_stable_kernel`` past 4096 elements per row: the input made dense with the sorted dim
    innermost (a copy unless it already is), value and index outputs in that layout (temporaries
    when the outputs' strides differ), then by rows: one row (or a million elements per row) is
    CUB-sorted row by row against an ``arange``; under 128 rows all rows are sorted at once
    with their row number packed beside each index and sorted again by row; otherwise CUB's
    segmented sort against reversed indices. Everything goes when it returns, last made first."""
    backend = x.sim_backend
    n = x.numel()
    nsort = x.shape[dim]
    nsegments = n // nsort
    elt = x.element_size()
    held = []
    dense = _dense_dim_last_strides(tuple(x.shape), dim)
    if not (x.stride(dim) == 1 and non_overlapping_and_dense(x)):
        held.append(temporary(backend, n * elt))  # self_ = empty_strided(dim last).copy_(self)
        layout = dense
    else:
        layout = tuple(x.stride())
    if tuple(values.stride()) != layout or len(held):
        held.append(temporary(backend, n * elt))  # values_tmp
    if tuple(indices.stride()) != layout:
        held.append(temporary(backend, n * 8))  # indices_tmp
    bits = elt * 8
    if nsegments == 1 or nsort >= 1_000_000:
        held.append(temporary(backend, nsort * 8))  # the arange each row's indices come from
        for _ in range(nsegments):
            storage = temporary(backend, cub_radix_sort_pairs_bytes(nsort, elt, 8, bits))
            del storage
    elif nsegments < 128:
        held.append(temporary(backend, n * 8))  # indices and row numbers (int2)
        held.append(temporary(backend, n * 8))  # their sorted copy
        keys_out = temporary(backend, n * elt)
        storage = temporary(backend, cub_radix_sort_pairs_bytes(n, elt, 8, bits))
        del storage, keys_out
        segment_bits = max(1, math.ceil(math.log2(nsegments)))
        storage = temporary(backend, cub_radix_sort_pairs_bytes(n, 8, 0, segment_bits))
        del storage
    else:
        held.append(temporary(backend, n * 8))  # reverse indices
        storage = temporary(backend, _align256(n * elt) + _align256(n * 8) + 255)  # alternate keys, values
        del storage
    while held:
        held.pop()


def topk_uses_multiblock(num_slices: int, slice_size: int) -> bool:
    """``should_use_multiblock`` (TensorTopK.cu): the row lengths, by row count, past which top-k
    splits each row across blocks."""
    return ((num_slices <= 20 and slice_size >= 20000) or (20 < num_slices <= 40 and slice_size >= 10000)
            or (40 < num_slices <= 80 and slice_size >= 8000) or (80 < num_slices < 200 and slice_size >= 5000)
            or (200 <= num_slices < 800 and slice_size >= 3000) or (800 <= num_slices <= 4000 and slice_size >= 800)
            or (num_slices > 4000 and slice_size >= 400))


# the multi-block radix select's CUB temporary storage, measured on the H200 for 1 to 8000 rows
# (data/fuzz: probe_sort, fuzz0015, fuzz0186, fuzz0203, fuzz0204)
TOPK_MULTIBLOCK_SCAN_BYTES = 1279


def topk_multiblock_buffers(num_slices: int, slice_size: int, itemsize: int, multiprocessors: int = 132) -> list:
    """The buffers ``mbtopk::launch`` allocates, in order: the k-th values, a 64-bit counter per row,
    the digits searched (two radix words per row), 256 short digit counts per block, 256 int
    cumulative counts per row and two int counters per block. Blocks per row follow
    ``get_items_per_thread``: 256 threads, 4 to 64 items each, six blocks of 40 registers a thread
    resident per SM (65536 registers)."""
    threads, blocks_per_sm = 256, 65536 // (40 * 256)
    items = max(4, min(64, -(-(num_slices * slice_size) // (multiprocessors * blocks_per_sm * threads))))
    blocks = num_slices * -(-slice_size // (items * threads))
    radix = 8 if itemsize == 8 else 4
    return [num_slices * itemsize, num_slices * 8, num_slices * 2 * radix, blocks * 256 * 2, num_slices * 256 * 4,
            blocks * 4, blocks * 4]


@register_cuda_model(_aten.topk.default)
def _topk(func, args, kwargs):
    """``topk``: values and indices, then ``launch_gather_topk_kernel`` works on ``self.contiguous()``
    (a copy of a strided input); past ``should_use_multiblock``'s row lengths the multi-block radix
    select's buffers (:func:`topk_multiblock_buffers`) and CUB's storage, twice; everything goes
    when it returns, last made first."""
    params = _named(args, kwargs, ("self", "k", "dim", "largest", "sorted"))
    x = params["self"]
    out = dispatch(func, args, kwargs)
    if not x.dim() or not x.numel() or not params["k"]:
        return out
    backend = x.sim_backend
    held = []
    if not x.is_contiguous():
        held.append(temporary(backend, x.numel() * x.element_size()))
    slice_size = x.shape[params.get("dim", -1)]
    num_slices = x.numel() // slice_size
    if topk_uses_multiblock(num_slices, slice_size):
        held.extend(temporary(backend, n) for n in topk_multiblock_buffers(
            num_slices, slice_size, x.element_size(), kernels_of(x).multiprocessors))
        for _ in range(2):
            storage = temporary(backend, TOPK_MULTIBLOCK_SCAN_BYTES)
            del storage
    while held:
        held.pop()
    return out


# ------------------------------------------------------------------- CUB radix sort, randperm


# items per tile of CUB's one-sweep radix sort on the H200 (256 threads times 22, 21 or 18 items
# with 8-byte values), by (key bytes, value bytes; 0: keys only), fitted to the look-back storage
# of data/fuzz's sorts: bfloat16 rows sorted all at once (16384 to 4.1 million keys), randperm
# (int32 and int64 keys), probe_sort's full sort of 1.6 million float keys and of their int64
# segment keys
ONESWEEP_TILE_ITEMS = {(2, 8): 5632, (4, 8): 5376, (8, 8): 4608, (8, 0): 5760}


def cub_radix_sort_pairs_bytes(items: int, key_bytes: int, value_bytes: int, bits: int,
                               single_tile_items: int = 2304) -> int:
    """Temporary storage of CUB's ``DeviceRadixSort::SortPairs`` / ``SortKeys`` (keys and values in
    separate buffers, as ATen's ``radix_sort_pairs`` and ``radix_sort_keys`` call them) on the H200.

    Up to one tile (``single_tile_items``) CUB sorts in one block and asks for 1 byte. Past it,
    the one-sweep sort keeps, each array aligned to 256 bytes in a blob with 255 bytes of
    slack: a 256-digit histogram per pass of 8 bits (8-byte offsets), a look-back of 256 4-byte
    counters per tile (:data:`ONESWEEP_TILE_ITEMS`), the alternate keys and values when there
    is more than one pass, and a 4-byte counter per pass. Checked on every randperm of data/fuzz
    (1 byte up to 2048 items; 45823, 58879, 96767, 109055 bytes at 3000, 4096, 7168, 8192 items
    with int32 keys; 1074687 at 65536 with int64 keys) and probe_sort's full sorts.

    Args:
        items: keys to sort.
        key_bytes, value_bytes: sizes of a key and of a value (0: keys only).
        bits: the key bits sorted on.
        single_tile_items: the most items CUB sorts in one block.
    """
    if items <= single_tile_items:
        return 1
    passes = -(-bits // 8)
    tile = ONESWEEP_TILE_ITEMS.get((key_bytes, value_bytes), ONESWEEP_TILE_ITEMS[(4, 8)])
    tiles = -(-items // tile)
    parts = [passes * 256 * 8, tiles * 256 * 4]
    if passes > 1:
        parts += [items * key_bytes, items * value_bytes]
    parts.append(passes * 4)
    return sum(_align256(p) for p in parts) + 255


def randperm_key_bits(n: int) -> int:
    """Bits of the random keys ``randperm`` sorts (Randperm.cu: duplicates under 10 % likely)."""
    return min(64, math.ceil(math.log2(n - (6 * n * n + 1) / (12 * math.log(0.9)))))


@register_factory_model(torch.randperm)
def _randperm(backend, args, kwargs, result):
    """``randperm_out_cuda`` after the output: ``check_supported_max_int_with_precision`` makes a
    device scalar of the output's dtype and drops it; then the ``arange`` it permutes, the random
    keys (int32 when 32 bits suffice, else int64) and their sorted copy, and CUB's radix sort
    storage; the storage, the keys and the arange go when it returns."""
    n = int(args[0]) if args else int(kwargs.get("n", 0))
    itemsize = result.element_size()
    scalar = temporary(backend, itemsize)
    del scalar
    if n <= 0:
        return
    bits = randperm_key_bits(n)
    key_bytes = 4 if bits <= 32 else 8
    arange = temporary(backend, n * itemsize)
    keys = temporary(backend, n * key_bytes)
    sorted_keys = temporary(backend, n * key_bytes)
    storage = temporary(backend, cub_radix_sort_pairs_bytes(n, key_bytes, itemsize, bits))
    del storage, sorted_keys, keys, arange


# ------------------------------------------------------------------------------- cumsum


def _scan_temporaries(x, out, dim: int) -> list:
    """What ``cumsum`` allocates after its output: a converted (contiguous) input, CUB storage."""
    backend = x.sim_backend
    held = []
    if x.dim() == 0 or x.numel() == 0:
        return held
    converted = x.dtype != out.dtype or not x.is_contiguous()
    if converted:  # self.to(result dtype), then expect_contiguous
        held.append(temporary(backend, x.numel() * out.element_size()))
    if x.numel() == x.shape[dim]:  # the scan holds every element: cub::DeviceScan::InclusiveScan
        scan = temporary(backend, kernels_of(x).cub_scan_bytes(x.numel(), out.element_size()))
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
    kernels = kernels_of(a)
    bf16 = a.dtype == b.dtype == torch.bfloat16 and (out_dtype in (None, torch.bfloat16))
    if kernels.grouped_gemm_cutlass and bf16:
        if a.dim() == 2 and b.dim() == 2:
            groups = offs.shape[0]
        elif a.dim() == 2:
            groups = b.shape[0]
        else:
            groups = a.shape[0]
        backend = a.sim_backend
        arguments = temporary(backend, grouped_mm_argument_bytes(groups, bias is not None))
        workspace = temporary(backend, kernels.multiprocessors * kernels.grouped_gemm_workspace_per_sm)
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


# -------------------------------------------------------------------------- indexing


def _contiguous_indices(indices: list) -> tuple[list, list]:
    """CUDA's ``AdvancedIndex``: two or more index tensors whose broadcast strides differ are each
    made contiguous (one temporary per index, in order) before the kernel; returns the indices
    to use and the temporaries (freed, last first, when the kernel returns)."""
    present = [i for i in indices if i is not None]
    if len(present) < 2:
        return indices, []
    shape = torch.broadcast_shapes(*(i.shape for i in present))
    expanded = [i.expand(shape) for i in present]
    if all(e.stride() == expanded[0].stride() for e in expanded):
        return indices, []
    held = [e.contiguous() for e in expanded]
    it = iter(held)
    return [None if i is None else next(it) for i in indices], held


def nonzero_temporary_bytes(items: int) -> tuple[int, int]:
    """CUB's temporaries of ``nonzero`` over ``items`` elements: (the count's reduction, the selection).

    Measured on the H200 (``probe_index`` of data/fuzz: 10, 1000, 4096, 65536 and 10**6 items):
    1 and 1023 bytes up to 4096 items, 21503 and 1023 at 65536, 21503 and 2815 at 10**6; sizes
    between the measured points take the next measured one.
    """
    reduce_bytes = 1 if items <= 4096 else 21503
    select_bytes = 1023 if items <= 65536 else 2815
    return reduce_bytes, select_bytes


@register_cuda_model(_aten.nonzero.default)
def _nonzero(func, args, kwargs):
    """``nonzero``: an int32 count and CUB's reduction storage, then (after the host waited for the
    count: refused in a capture) the output and CUB's selection storage."""
    x = args[0]
    backend = x.sim_backend
    reduce_bytes, select_bytes = nonzero_temporary_bytes(x.numel())
    count = temporary(backend, 4)
    storage = temporary(backend, reduce_bytes)
    del storage
    out = dispatch(func, args, kwargs)  # the capture check (a host wait) happens here
    storage = temporary(backend, select_bytes)
    del storage, count
    return out


@register_cuda_model(_aten._unique2.default)
def _unique(func, args, kwargs):
    """``torch.unique`` (sorted, CUDA's ``unique_cuda_template``): a contiguous copy of a strided
    input, the sorted keys and CUB's radix sort storage (keys only, every bit), then the output at
    the input's full length (the result is its first ``count`` elements), the count on the device
    and CUB's unique-selection storage (as ``nonzero``'s); the sorted keys go when it returns."""
    params = _named(args, kwargs, ("self", "sorted", "return_inverse", "return_counts"))
    x = params["self"]
    if (params.get("return_inverse") or params.get("return_counts") or not x.numel()
            or x.sim_inner.is_meta):  # (a shape-only input: dispatch says the count needs values)
        return dispatch(func, args, kwargs)
    backend = x.sim_backend
    n, itemsize = x.numel(), x.element_size()
    held = []
    if not x.is_contiguous():
        held.append(temporary(backend, n * itemsize))
    held.append(temporary(backend, n * itemsize))  # sorted keys
    storage = temporary(backend, cub_radix_sort_pairs_bytes(n, itemsize, 0, itemsize * 8))
    del storage
    with torch_functions_off():
        values = torch.unique(x.sim_inner)
        host = torch.zeros(n, dtype=x.dtype)
        host[:values.numel()] = values
    full = backend.place(host if (backend.backed or keeps_values(host)) else meta_like(host))
    count = temporary(backend, 8)
    storage = temporary(backend, nonzero_temporary_bytes(n)[1])
    del storage, count
    result = full[:values.numel()]
    empty = [backend.place(torch.empty(0, dtype=torch.int64, device="meta"), copy=False) for _ in range(2)]
    while held:
        held.pop()
    return result, empty[0], empty[1]


@register_cuda_model(_aten.masked_select.default)
def _masked_select(func, args, kwargs):
    """``masked_select``: the mask's ``nonzero``, then the selected values, as CUDA composes it."""
    x, mask = args[0], args[1]
    if mask.shape != x.shape:
        x, mask = torch.broadcast_tensors(x, mask)
    where = torch.nonzero(mask)
    return x[tuple(where.unbind(1))]


def _without_masks(indices: list) -> list:
    """Boolean masks among the indices become the ``nonzero`` columns CUDA indexes with."""
    out = []
    for i in indices:
        if isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8):
            out.extend(torch.nonzero(i).unbind(1))
        else:
            out.append(i)
    return out


@register_cuda_model(_aten.index.Tensor)
def _index(func, args, kwargs):
    """``x[i, j]``: masks become ``nonzero`` columns, the contiguous index temporaries, then the output."""
    params = _named(args, kwargs, ("self", "indices"))
    indices, held = _contiguous_indices(_without_masks(list(params["indices"])))
    out = dispatch(func, (params["self"], indices), {})
    while held:
        held.pop()
    return out


@register_cuda_model(_aten.index_put_.default, _aten.index_put.default, _aten._index_put_impl_.default)
def _index_put(func, args, kwargs):
    """``x[i] = 0.0`` and ``index_put_``: a host scalar value (what ``__setitem__`` makes of a Python
    number for a CUDA tensor) is copied to the device first (``value.to(self.device())``, an
    element-sized block: refused inside a capture as any pageable copy, after the block was
    allocated), then the kernel runs; the copy dies with the call. With ``accumulate=True`` the
    kernel sorts the indices first (:func:`_index_put_with_sort`)."""
    names = ("self", "indices", "values", "accumulate", "unsafe")
    params = _named(args, kwargs, names)
    value = params["values"]
    on_device = None
    if not isinstance(value, SimTensor) and value.dim() == 0:
        backend = params["self"].sim_backend
        on_device = backend.from_host(value)
        try:
            host.check_host_to_device(backend, value, non_blocking=False)
        except BaseException:
            del on_device  # the destination block goes back as the error unwinds
            raise
        position = names.index("values")
        if position < len(args):
            args = args[:position] + (on_device,) + args[position + 1:]
        else:
            kwargs = dict(kwargs, values=on_device)
        params["values"] = on_device
    if not params.get("accumulate", False):
        return dispatch(func, args, kwargs)
    if func is _aten.index_put.default:  # the functional form: a clone, then the in-place op
        out = params["self"].clone()
        _index_put_with_sort(out, list(params["indices"]), params["values"], bool(params.get("unsafe", False)))
        return out
    _index_put_with_sort(params["self"], list(params["indices"]), params["values"], bool(params.get("unsafe", False)))
    return params["self"]


def _index_put_with_sort(x, indices, value, unsafe: bool) -> None:
    """``index_put_with_sort_kernel`` (Indexing.cu): a contiguous copy of a strided ``x``; the linear
    index (for each index, two asynchronous bounds checks, each a reduced int64 scalar and a bool,
    then its remainder and the product by the stride, the remainder going at once); the value
    expanded and made contiguous (a copy when it must); sorted and original positions, an
    ``arange`` and CUB's radix sort storage over the bits the largest row number needs; then the
    values are accumulated (computed here on the CPU). All go when it returns, last made first."""
    backend = x.sim_backend
    held = []
    if not x.is_contiguous():
        held.append(temporary(backend, x.numel() * x.element_size()))
    indices = _without_masks(indices)
    present = [i for i in indices if i is not None]
    shape = torch.broadcast_shapes(*(i.shape for i in present)) if present else ()
    n = math.prod(shape)
    for i in present:
        if i.numel() and not unsafe:
            for _ in range(2):  # _assert_async(index.max() < size), _assert_async(index.min() >= -size)
                reduced = temporary(backend, 8)
                check = temporary(backend, 1)
                del check, reduced
    linear = None
    for i in present:
        remainder = temporary(backend, n * 8)
        scaled = temporary(backend, n * 8)
        del remainder
        if linear is None:
            linear = scaled
    held.append(linear)
    slice_size = math.prod(x.shape[len(indices):]) if len(indices) <= x.dim() else 1
    before = math.prod(x.shape[:next((k for k, i in enumerate(indices) if i is not None), 0)])
    if value.numel() < n * before * slice_size or not value.is_contiguous():
        held.append(temporary(backend, n * before * slice_size * value.element_size()))
    if n and slice_size:
        held.append(temporary(backend, n * 8))  # sorted indices
        held.append(temporary(backend, n * 8))  # original positions
        held.append(temporary(backend, n * 8))  # arange
        largest = max(x.numel() - 1, 0) // max(slice_size, 1)
        bits = max(1, int(largest).bit_length())
        storage = temporary(backend, cub_radix_sort_pairs_bytes(n, 8, 8, bits))
        del storage
    dispatch(_aten.index_put_.default, (x, indices, value, True), {})
    while held:
        held.pop()


# ------------------------------------------------------------------------------ norms


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _empty(backend, shape, dtype):
    return backend.place(torch.empty(shape, dtype=dtype, device="meta"), copy=False)


def _compute_into(outs, fn, *inputs) -> None:
    """The kernel that writes ``outs``: ``fn(*inputs)`` (computed on the CPU tensors behind them) into
    ``outs`` (one output, or a tuple the result matches) when they have values, and have a capture
    replay it."""
    many = isinstance(outs, tuple)
    targets = outs if many else (outs,)
    launch_kernel(targets[0].sim_backend)
    if any(o.sim_inner.is_meta for o in targets) or any(
            getattr(t, "sim_inner", None) is not None and t.sim_inner.is_meta for t in inputs):
        return
    inner = [t.sim_inner if isinstance(t, SimTensor) else t for t in inputs]
    with torch_functions_off():
        results = fn(*inner)
        for o, r in zip(targets, results if many else (results,)):
            o.sim_inner.copy_(r)
    capture = targets[0].sim_backend.capture_for_current_stream()
    if capture is not None:
        capture.record_op(fn, tuple(inner), {}, [(i if many else -1, o.sim_inner) for i, o in enumerate(targets)])


def _kernel_copy(x):
    """``input.expect_contiguous()`` inside a kernel, before its outputs: a copy of a strided input,
    held until the kernel returns (None for a contiguous one)."""
    if x.dim() and x.numel() and not x.is_contiguous():
        return temporary(x.sim_backend, x.numel() * x.element_size())
    return None


def _autocast_first(op, args):
    """CUDA's autocast kernel for ``op`` runs before autograd decomposes it, and the models below call
    the kernels under it: with autocast on, its casts and then ``op`` (None: autocast leaves it)."""
    if autocast.enabled():
        return autocast.plan_call(op, args, {}, SimTensor)
    return None


_FUSED_RMS_NORM = getattr(_aten, "_fused_rms_norm", None)


@register_cuda_model(_aten.rms_norm.default, torch.rms_norm, torch.nn.functional.rms_norm)
def _rms_norm(func, args, kwargs):
    """``F.rms_norm``: ATen's composite calls CUDA's fused kernel (``_fused_rms_norm``) unless the
    weight's dtype differs from the input's (then it composes the norm, as here: torch's composite).
    The fused kernel is a CPU composite, so it is modelled here, as an autograd node when autograd
    records it."""
    params = _named(args, kwargs, ("input", "normalized_shape", "weight", "eps"))
    x, shape, weight, eps = params["input"], tuple(params["normalized_shape"]), params.get("weight"), params.get("eps")
    planned = _autocast_first(_aten.rms_norm.default, (x, list(shape), weight, eps))
    if planned is not None:
        return planned()
    if _FUSED_RMS_NORM is None or (weight is not None and weight.dtype != x.dtype):
        with torch_functions_off(subclasses_only=True):
            return torch.rms_norm(x, shape, weight, eps)
    rule = _FusedRmsNorm(shape, eps)
    if records_grad(x, weight):
        return KernelFunction.apply(rule, x, weight)[0]
    return rule.forward(x, weight)[0][0]


class _FusedRmsNorm:
    """``_fused_rms_norm`` and its backward as the CUDA kernels run them."""

    differentiable = 1

    def __init__(self, shape: tuple, eps) -> None:
        self.shape, self.eps = shape, eps

    def reference(self, x, weight):
        return torch.rms_norm(x, self.shape, weight, self.eps)

    def forward(self, x, weight):
        """The copy of a strided input, the output like the input, a per-row ``rstd`` (float for half
        types); the derivative keeps the input, the weight and ``rstd``."""
        backend = x.sim_backend
        held = _kernel_copy(x)
        out = _empty(backend, x.shape, x.dtype)
        stats = x.shape[:x.dim() - len(self.shape)] + (1,) * len(self.shape)
        rstd = _empty(backend, stats, _acc_dtype(x.dtype))
        _compute_into(out, lambda a, w: self.reference(a, w), x, weight)
        del held
        return (out, rstd), (x, weight, rstd), None

    def backward(self, state, grads, saved, needs):
        """The input's gradient like it, then the weight's."""
        x, weight, _ = saved
        grad = grads[0]
        if grad is None:
            return None, None
        backend = x.sim_backend
        dx = _empty(backend, x.shape, x.dtype) if needs[0] else None
        dw = _empty(backend, weight.shape, weight.dtype) if weight is not None and needs[1] else None
        made = tuple(g for g in (dx, dw) if g is not None)
        if made:
            _compute_into(made, lambda a, w, g: reference_grads(self.reference, (a, w), (g,),
                                                                (dx is not None, dw is not None)), x, weight, grad)
        return dx, dw


@register_cuda_model(_aten.layer_norm.default, torch.layer_norm, torch.nn.functional.layer_norm)
def _layer_norm(func, args, kwargs):
    """``F.layer_norm``: ATen's composite, ``native_layer_norm``, through the dispatcher (so autograd
    records it and keeps its mean and rstd); the composite keeps only the output."""
    params = _named(args, kwargs, ("input", "normalized_shape", "weight", "bias", "eps"))
    x, shape = params["input"], tuple(params["normalized_shape"])
    planned = _autocast_first(_aten.layer_norm.default, (x, list(shape), params.get("weight"), params.get("bias"),
                                                          params.get("eps", 1e-5)))
    if planned is not None:
        return planned()
    return _aten.native_layer_norm.default(x, shape, params.get("weight"), params.get("bias"),
                                           params.get("eps", 1e-5))[0]


@register_cuda_model(_aten.native_layer_norm.default)
def _native_layer_norm(func, args, kwargs):
    """``native_layer_norm`` as ``layer_norm_cuda`` runs it: the copy of a strided input, the output
    like the input, then a per-row mean and rstd (float for half types), which the CPU kernel makes
    in the input's dtype."""
    params = _named(args, kwargs, ("input", "normalized_shape", "weight", "bias", "eps"))
    x, shape = params["input"], tuple(params["normalized_shape"])
    weight, bias, eps = params.get("weight"), params.get("bias"), params.get("eps", 1e-5)
    backend = x.sim_backend
    held = _kernel_copy(x)
    out = _empty(backend, x.shape, x.dtype)
    stats = x.shape[:x.dim() - len(shape)] + (1,) * len(shape)
    mean = _empty(backend, stats, _acc_dtype(x.dtype))
    rstd = _empty(backend, stats, _acc_dtype(x.dtype))
    _compute_into((out, mean, rstd), lambda a, w, b: torch.native_layer_norm(a.contiguous(), shape, w, b, eps),
                  x, weight, bias)
    del held
    return out, mean, rstd


@register_cuda_model(_aten.native_layer_norm_backward.default)
def _native_layer_norm_backward(func, args, kwargs):
    """``layer_norm_backward_cuda``: the gradients of the input, weight and bias it is asked for, in
    that order, like them; the CPU kernel, which computes the values, takes the float statistics
    of a half input in the input's dtype."""
    names = ("grad_out", "input", "normalized_shape", "mean", "rstd", "weight", "bias", "output_mask")
    params = _named(args, kwargs, names)
    x, weight, bias, mask = params["input"], params.get("weight"), params.get("bias"), params["output_mask"]
    backend = x.sim_backend
    shape = tuple(params["normalized_shape"])
    like = (x, weight, bias)
    grads = tuple(_empty(backend, t.shape, t.dtype) if wanted and t is not None else None
                  for wanted, t in zip(mask, like))
    made = tuple(g for g in grads if g is not None)

    def compute(dy, a, mean, rstd, w, b):
        out = _aten.native_layer_norm_backward.default(dy, a, shape, mean.to(a.dtype), rstd.to(a.dtype), w, b, mask)
        return tuple(o for o, g in zip(out, grads) if g is not None)

    if made:
        _compute_into(made, compute, params["grad_out"], x, params["mean"], params["rstd"], weight, bias)
    return grads


@register_cuda_model(_aten.dropout.default)
def _dropout(func, args, kwargs):
    """``F.dropout`` outside training (or with ``p=0``) gives back its input itself, as ATen does
    (the CPU decomposition would copy it)."""
    params = _named(args, kwargs, ("input", "p", "train"))
    if not params["train"] or params["p"] == 0:
        return params["input"]
    return dispatch(func, args, kwargs)


_LOG_SOFTMAX = {_aten.log_softmax.int, torch.log_softmax, torch.Tensor.log_softmax, torch.nn.functional.log_softmax}


@register_cuda_model(_aten.softmax.int, _aten.log_softmax.int, torch.softmax, torch.log_softmax, torch.Tensor.softmax,
                     torch.Tensor.log_softmax, torch.nn.functional.softmax, torch.nn.functional.log_softmax)
def _softmax(func, args, kwargs):
    """``softmax(x, dim, dtype=float32)`` of a half tensor: ATen's composite on CUDA calls the kernel
    that converts as it goes (``_softmax(x, dim, half_to_float=True)``); other conversions copy the
    input first. Both through the dispatcher, so autograd records the kernel call."""
    functional = func in (torch.nn.functional.softmax, torch.nn.functional.log_softmax)
    names = ("self", "dim", "_stacklevel", "dtype") if functional else ("self", "dim", "dtype")
    params = _named(args, {("self" if k == "input" else k): v for k, v in kwargs.items()}, names)
    x, dim, dtype = params["self"], params.get("dim"), params.get("dtype")
    kernel = _aten._log_softmax.default if func in _LOG_SOFTMAX else _aten._softmax.default
    if dim is None:
        dim = 0 if x.dim() in (0, 1, 3) else 1  # torch's legacy implicit dim
    planned = _autocast_first(_aten.log_softmax.int if func in _LOG_SOFTMAX else _aten.softmax.int,
                              (x, dim) if dtype is None else (x, dim, dtype))
    if planned is not None:
        return planned()
    if x.dtype == torch.float16 and dtype == torch.float32:
        return kernel(x, dim, True)
    return kernel(x if dtype is None else x.to(dtype), dim, False)


@register_cuda_model(_aten._softmax.default, _aten._log_softmax.default)
def _softmax_kernel(func, args, kwargs):
    """``host_softmax``: the output, then a contiguous copy of a strided input (a chunk, a transposed
    view, a conversion that kept such strides), freed when the kernel returns; with
    ``half_to_float`` a float32 output of a half input, which the CPU kernel refuses."""
    params = _named(args, kwargs, ("self", "dim", "half_to_float"))
    x, dim = params["self"], params["dim"]
    if params.get("half_to_float"):
        out = _empty(x.sim_backend, x.shape, torch.float32)
        op = torch.log_softmax if func is _aten._log_softmax.default else torch.softmax
        _compute_into(out, lambda a: op(a.float(), dim), x)
    else:
        out = dispatch(func, args, kwargs)
    _contiguous_input(x)
    return out


def _contiguous_input(x) -> None:
    """``input_.contiguous()`` inside a kernel: a copy of a non-contiguous input, dropped on return."""
    if x.dim() and x.numel() and not x.is_contiguous():
        copy = temporary(x.sim_backend, x.numel() * x.element_size())
        del copy


# ------------------------------------------------------------------- copies with the host


@register_cuda_model(_aten.copy_.default)
def _copy(func, args, kwargs):
    """``dst.copy_(src)`` where one side is host memory: CUDA's capture rules, then the copy."""
    params = _named(args, kwargs, ("self", "src", "non_blocking"))
    dst, src, non_blocking = params["self"], params["src"], bool(params.get("non_blocking", False))
    if isinstance(dst, SimTensor) and not isinstance(src, SimTensor) and src.dim() > 0:
        host.check_host_to_device(dst.sim_backend, src, non_blocking)
    elif not isinstance(dst, SimTensor):
        return host.to_host(src, non_blocking, into=dst)
    return dispatch(func, args, kwargs)


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
