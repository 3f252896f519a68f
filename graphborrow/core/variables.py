"""The rule of each environment variable graphborrow's library reads, stated once.

A variable is read where it takes effect, deep in the library (the build cache, the allocator
model, the planner's store). Each such reader calls :func:`read`, which applies the variable's
rule from :data:`RULES` and refuses a bad value with the variable, its value and the fix, so a
Python user gets the same refusal as the command line. The command line checks every variable
before work starts (:mod:`graphborrow.run.environment`, whose table uses these same rules).
"""

from __future__ import annotations

import os
from typing import Callable, Mapping

from .errors import ParameterError

__all__ = ["RULES", "Rule", "absolute_folder", "one_of", "read"]

Rule = Callable[[str], None]  # raises ValueError naming the problem


def absolute_folder(name: str) -> Rule:
    """An absolute folder, or empty (as if unset): kernels and sweep workers run in other folders."""
    def check(value: str) -> None:
        if not value:
            return
        if not os.path.isabs(os.path.expanduser(value)):
            raise ValueError(f"{name}={value!r} is a relative path; notebook kernels and sweep workers run in "
                             "other folders, so give an absolute path")
        if os.path.exists(value) and not os.path.isdir(value):
            raise ValueError(f"{name}={value!r} is a file, not a folder; point it at a folder")
    return check


def one_of(name: str, allowed: tuple[str, ...]) -> Rule:
    """One of a few exact words: anything else is a typo, not a silent default."""
    def check(value: str) -> None:
        if value not in allowed:
            raise ValueError(f"{name}={value!r} must be one of {', '.join(repr(a) for a in allowed)}")
    return check


_SWITCH = ("", "0", "1")
RULES: dict[str, Rule] = {
    "GRAPHBORROW_CACHE_DIR": absolute_folder("GRAPHBORROW_CACHE_DIR"),
    "XDG_CACHE_HOME": absolute_folder("XDG_CACHE_HOME"),
    "GRAPHBORROW_SIM_PURE": one_of("GRAPHBORROW_SIM_PURE", _SWITCH),
    "GRAPHBORROW_SEQUENCE_CACHE": one_of("GRAPHBORROW_SEQUENCE_CACHE", _SWITCH),
    "GRAPHBORROW_FORK_KERNELS": one_of("GRAPHBORROW_FORK_KERNELS", _SWITCH),
    "TRITON_INTERPRET": one_of("TRITON_INTERPRET", _SWITCH),
}


def read(name: str, default: str | None = None, environ: Mapping[str, str] | None = None) -> str | None:
    """The variable's value, checked by its rule; ``default`` when it is unset.

    Raises:
        ParameterError: the value breaks the variable's rule (the message names both).
    """
    value = (os.environ if environ is None else environ).get(name)
    if value is None:
        return default
    try:
        RULES[name](value)
    except ValueError as exc:
        raise ParameterError(str(exc)) from None
    return value
