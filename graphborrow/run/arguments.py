"""The command line's argument types: argparse converters whose errors name the value and the rule."""

from __future__ import annotations

import argparse
import math

__all__ = ["gibibytes", "seconds", "whole_number"]


def _number(text: str, what: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None


def seconds(text: str) -> float:
    """A time limit: a positive number of seconds (inf: no limit)."""
    value = _number(text, "a number of seconds")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} must be a positive number of seconds (inf: no limit)")
    return value


def whole_number(text: str) -> int:
    """A count of 1 or more."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} must be 1 or more")
    return value


def gibibytes(text: str) -> float:
    """A memory limit: a finite number of GiB, 0 for none."""
    value = _number(text, "a number of GiB")
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"{text} must be a number of GiB, 0 or more (0: no limit)")
    return value
