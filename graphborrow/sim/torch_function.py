"""Torch functions turned off for a block, in a way an interrupt cannot leave them off.

Note [torch functions off under interrupts]
``with torch._C.DisableTorchFunction():`` enters in C and leaves in ``__exit__``. A signal
handler that raises (Ctrl-C, a notebook's interrupt, a timer) can run on the instruction
boundary between the two, after the state changed and before the ``with`` statement
protects the block: ``__exit__`` never runs and torch functions stay off for the rest of
the process. On the simulated device that is silent and total: ``SimTensor``'s
overrides stop running, ``Tensor.data_ptr()`` answers 0, ``.cpu()`` returns the shape-only
inner tensor. (The random-instruction interrupt test found it.)

Here the state change happens inside a generator's ``try``: if the ``with`` statement never
took the block, the generator is dropped as the exception unwinds and its ``finally`` puts
the state back. The hot path, ``SimTensor.__torch_function__``, calls
``torch._C._disabled_torch_function_impl`` instead, whose guard lives in C++ and cannot be
split by a Python signal handler at all.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

__all__ = ["torch_functions_off"]

_STATE = torch._C._TorchFunctionState


@contextlib.contextmanager
def torch_functions_off(subclasses_only: bool = False) -> Iterator[None]:
    """Turn off ``__torch_function__`` (of subclasses only, or modes too) for the block.

    Like ``torch._C.DisableTorchFunction`` (``DisableTorchFunctionSubclass`` with
    ``subclasses_only``), and never weaker than the state it finds.
    """
    before = torch._C._get_torch_function_state()
    try:
        if not subclasses_only:
            torch._C._set_torch_function_state(_STATE.ALL_DISABLED)
        elif before == _STATE.ENABLED:
            torch._C._set_torch_function_state(_STATE.SUBCLASSES_DISABLED)
        yield
    finally:
        torch._C._set_torch_function_state(before)
