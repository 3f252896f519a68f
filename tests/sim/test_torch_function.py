"""Torch functions turned off for a block come back on, even when the block never started."""

import gc

import torch

from graphborrow.sim.torch_function import torch_functions_off

State = torch._C._TorchFunctionState


def state():
    return torch._C._get_torch_function_state()


def test_the_block_runs_with_torch_functions_off_and_the_state_comes_back():
    with torch_functions_off():
        assert state() == State.ALL_DISABLED
    with torch_functions_off(subclasses_only=True):
        assert state() == State.SUBCLASSES_DISABLED
    assert state() == State.ENABLED


def test_an_interrupt_between_entry_and_the_block_leaves_torch_functions_on():
    """What an interrupt on the instruction after ``__enter__`` does to a ``with`` statement:
    the block is never protected and ``__exit__`` never runs. Torch's own C guard stays set then."""
    guard = torch._C.DisableTorchFunctionSubclass()
    guard.__enter__()
    del guard
    gc.collect()
    left_off = state()
    torch._C._set_torch_function_state(State.ENABLED)
    assert left_off == State.SUBCLASSES_DISABLED  # the failure this module exists for

    for subclasses_only in (False, True):
        scope = torch_functions_off(subclasses_only=subclasses_only)
        scope.__enter__()
        assert state() != State.ENABLED
        del scope  # dropped as the exception unwinds
        assert state() == State.ENABLED


def test_inside_a_wider_block_the_narrower_one_does_not_turn_modes_back_on():
    with torch_functions_off():
        with torch_functions_off(subclasses_only=True):
            assert state() == State.ALL_DISABLED
        assert state() == State.ALL_DISABLED
    assert state() == State.ENABLED
