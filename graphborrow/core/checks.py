"""Argument checks shared by the core's public calls: integers and switches, stated once.

A float, a string or a bool passed where a byte count, an address or an alignment is
expected is refused here instead of being coerced (``int(1.5)`` is 1, ``int(True)`` is 1,
and ctypes would keep only the low bits of an integer too wide for its C type).
"""

from __future__ import annotations

import operator
from typing import Any

__all__ = ["as_integer", "as_flag", "ADDRESS_LIMIT"]

ADDRESS_LIMIT = 1 << 64  # device addresses, and the ends of ranges of them, lie below this


def as_integer(value: Any, what: str) -> int:
    """``value`` as a Python int; numpy integers are integers, bools and floats are not.

    Args:
        value: the argument.
        what: its name in the message, e.g. ``"malloc size"``.

    Returns:
        The integer.

    Raises:
        TypeError: naming ``what`` and the value's type.
    """
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an integer number of bytes, got a bool ({value!r})")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(
            f"{what} must be an integer, got {type(value).__name__} ({value!r}); "
            "pass addresses and sizes as ints"
        ) from None


def as_flag(value: Any, what: str) -> bool:
    """``value`` if it is True or False; anything else is refused, not read as truthy.

    Args:
        value: the argument.
        what: its name in the message.

    Returns:
        The bool.

    Raises:
        TypeError: naming ``what`` and the value.
    """
    if isinstance(value, bool):
        return value
    raise TypeError(f"{what} must be True or False, got {type(value).__name__} ({value!r})")
