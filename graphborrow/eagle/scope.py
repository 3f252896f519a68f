"""The borrow scope a verification step's temporaries live and die in, named once.

Both implementations (the reference modes and the fused kernels) run their step's work
through :func:`run_borrowing`, so every temporary is made and released inside the borrow.
"""

from __future__ import annotations

import traceback

__all__ = ["BORROW_USER", "run_borrowing"]

BORROW_USER = "EAGLE verify"  # the owner-slot name a verification step's borrow holds


def run_borrowing(borrow, body, *args) -> None:
    """``body(*args)`` inside the step's borrow scope when ``borrow`` is enabled, so every
    temporary it makes lives in the borrowed runs; a failed step's temporaries die inside
    the scope too. Without an enabled borrow, just the call.

    Args:
        borrow: a :class:`~graphborrow.core.borrow.BorrowState`, or None.
        body: the step's work; what it returns is dropped (its outputs are made before the scope).
        args: passed to ``body``.
    """
    if borrow is None or not borrow.enabled:
        body(*args)
        return
    with borrow.borrow(BORROW_USER):
        try:
            body(*args)
        except BaseException as exc:
            traceback.clear_frames(exc.__traceback__)  # the failed step's temporaries die here too
            raise
