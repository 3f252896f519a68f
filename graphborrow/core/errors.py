"""Exceptions raised by graphborrow.

Each names the problem and the way out in its message. They subclass
RuntimeError (or ValueError for bad arguments) so callers that only know
torch's conventions still catch them.
"""

__all__ = [
    "GraphBorrowError", "PoolBusyError", "BorrowLeakError", "WrongStreamError",
    "BorrowCapacityError", "EmptyGraphPoolError", "ArenaIntegrityError", "ArenaFreeError",
    "SnapshotFormatError", "ParameterError",
]


class GraphBorrowError(RuntimeError):
    """Base class for borrow-state errors."""


class PoolBusyError(GraphBorrowError):
    """Capture, replay and borrowing share one owner slot; a second claimant got here."""


class BorrowLeakError(GraphBorrowError):
    """A borrowed tensor is still referenced when the graph pool is about to be written."""


class WrongStreamError(GraphBorrowError):
    """A borrow was entered on another stream than the one that built the borrow pool."""


class BorrowCapacityError(GraphBorrowError, ValueError):
    """A request can never fit the free runs (e.g. a chunk size of zero rows)."""


class EmptyGraphPoolError(GraphBorrowError, ValueError):
    """The pool handle holds no segments: no graph was captured into it (or it was released)."""


class ArenaIntegrityError(GraphBorrowError):
    """The borrow pool's arena refused frees (double, unknown, stale or wrongly sized)."""


class ArenaFreeError(ValueError):
    """A host call freed what the arena never handed out live, or with the wrong size."""


class SnapshotFormatError(ValueError):
    """A snapshot (dict, list or file) is not in torch's memory-snapshot format."""


class ParameterError(ValueError):
    """A notebook or sweep parameter is out of range."""
