"""How many programs of a compiled kernel the GPU holds at once: the grid of a persistent launch.

A persistent kernel's programs take work from a queue until it is empty, so programs beyond
what the GPU holds at once would only start once others finished, to find nothing left.
Before a kernel is compiled its grid is a guess per SM; once it is, its registers, shared
memory and warps per program decide.
"""

from __future__ import annotations

import functools

import torch

from .runtime import INTERPRETED

__all__ = ["INTERPRETED_PROGRAMS", "program_cap", "resident_programs"]

INTERPRETED_PROGRAMS = 3  # the interpreter runs programs one after another: program 0 does every item
GUESSED_SMS = 132  # compiling without a GPU: an H200's


@functools.cache
def _properties(device: int):
    return torch.cuda.get_device_properties(device)


def program_cap(device: int, per_sm: int) -> int:
    """The grid before the kernel is compiled: ``per_sm`` programs per SM of ``device``."""
    if INTERPRETED:
        return INTERPRETED_PROGRAMS
    if device < 0 or not torch.cuda.is_available():
        return GUESSED_SMS * per_sm
    return _properties(device).multi_processor_count * per_sm


def resident_programs(kernel, device: int, warps: int) -> int:
    """Programs of the compiled ``kernel`` the GPU holds at once (by its registers, shared
    memory and warps per program; ``warps`` where its metadata has none), or 0 when unknown."""
    if device < 0 or not torch.cuda.is_available():
        return 0
    props = _properties(device)
    threads = 32 * int(getattr(kernel.metadata, "num_warps", warps))
    per_sm = getattr(props, "max_threads_per_multi_processor", 2048) // threads
    regs = int(getattr(kernel, "n_regs", 0) or 0)
    if regs:
        per_sm = min(per_sm, getattr(props, "regs_per_multiprocessor", 65536) // (-(-regs // 8) * 8 * threads))
    shared = int(getattr(kernel.metadata, "shared", 0) or 0)
    if shared:
        per_sm = min(per_sm, getattr(props, "shared_memory_per_multiprocessor", 233472) // (shared + 1024))
    return props.multi_processor_count * max(per_sm, 1)
