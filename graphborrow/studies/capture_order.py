"""Does the order in which graphs are captured change the pool's size? Capture the same ladder
both ways, each on a fresh device, and say what happened in words (notebook 01).
"""

from __future__ import annotations

from typing import Callable

from graphborrow.core.runs import summarize
from graphborrow.core.sizes import MB

__all__ = ["reserved_for", "order_verdict"]


def reserved_for(make_backend: Callable[[], object], capture: Callable[[object, str], object], order: str,
                 restore: object | None = None) -> int | None:
    """Reserved bytes of the ladder ``capture(backend, order)`` builds on a fresh device.

    Args:
        make_backend: a fresh device of the notebook's kind.
        capture: captures the ladder on the device given, in the order given; returns it.
        order: ``"largest_first"`` or ``"smallest_first"``.
        restore: a simulated device to make active again afterwards (the notebook's own).

    Returns:
        The pool's reserved bytes, or None when that order ran out of device memory.
    """
    fresh = make_backend()
    try:
        ladder = capture(fresh, order)
        reserved = summarize(ladder.snapshot())["reserved_bytes"]
        del ladder
    except fresh.OutOfMemoryError as exc:
        print("out of memory:", str(exc).splitlines()[0][:160])
        reserved = None
    if fresh is not restore and hasattr(fresh, "close"):
        fresh.close()
        if restore is not None and hasattr(restore, "activate"):
            restore.activate()
    return reserved


def order_verdict(largest_first: int, smallest_first: int | None, device_bytes: int) -> str:
    """One sentence (Markdown) saying which order reserved less, by how much, or that one ran out.

    Args:
        largest_first: reserved bytes captured largest first.
        smallest_first: the same smallest first; None when it ran out of memory.
        device_bytes: the device's memory (for the out-of-memory sentence).
    """
    if smallest_first is None:
        return (f"Here capture order decides whether the ladder fits at all: smallest first **ran out of the "
                f"device's {device_bytes / 2**30:.0f} GiB**, largest first reserved {largest_first / MB:.1f} MiB.")
    difference = smallest_first - largest_first
    if difference > 0:
        return (f"Here capture order matters: smallest first reserved **{difference / MB:.1f} MiB more** "
                f"({smallest_first / MB:.1f} against {largest_first / MB:.1f} MiB).")
    if difference < 0:
        return (f"Here smallest first reserved **{-difference / MB:.1f} MiB less** ({smallest_first / MB:.1f} "
                f"against {largest_first / MB:.1f} MiB): at these shapes the segment rounding favours that order.")
    return f"Here both orders reserved the same {largest_first / MB:.1f} MiB: every graph's blocks fit the same segments."
