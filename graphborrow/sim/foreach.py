"""``torch.optim`` and ``clip_grad_norm_`` choose CUDA's kernels for simulated tensors.

Optimizers and ``clip_grad_norm_`` take the foreach kernels by default for tensors of the
types torch lists (``torch.Tensor``, ``Parameter``) on a CUDA device, and group their tensors
by the device the dispatcher reports. A simulated tensor is another type, reported as ``cpu``
to the dispatcher, so without this AdamW would run its per-parameter loop (other temporaries,
in another order) and ``clip_grad_norm_`` would move its scale to the host. Here simulated
tensors join the foreach types and their groups are keyed by the simulated ``cuda:0``, so every
default is the one a GPU takes.
"""

from __future__ import annotations

import torch
import torch.optim.optimizer as optimizer
import torch.utils._foreach_utils as foreach_utils

from .tensor import SimTensor

__all__ = ["install"]

_SIM_CUDA = torch.device("cuda", 0)
_original_group = torch._C._group_tensors_by_device_and_dtype


def _group(tensorlistlist, with_indices=False):
    grouped = _original_group(tensorlistlist, with_indices)
    if not any(isinstance(t, SimTensor) for tensors in tensorlistlist for t in tensors if t is not None):
        return grouped
    return {(_SIM_CUDA if device.type == "cpu" else device, dtype): value for (device, dtype), value in grouped.items()}


def install() -> None:
    """Make the foreach defaults and groups those of a GPU for simulated tensors (idempotent)."""
    for supported in (foreach_utils._foreach_supported_types, optimizer._foreach_supported_types):
        if SimTensor not in supported:  # the list torch.optim asks, and the one clip_grad_norm_ asks
            supported.append(SimTensor)
    torch._C._group_tensors_by_device_and_dtype = _group


install()
