"""Write a simulated device's memory history in the file format of PyTorch's memory_viz."""

from __future__ import annotations

import os
import pickle

__all__ = ["dump_snapshot"]


def dump_snapshot(backend, path: str | os.PathLike) -> str:
    """Pickle ``backend.full_snapshot()`` like ``torch.cuda.memory._dump_snapshot``.

    Open the file at https://pytorch.org/memory_viz (or with torch's ``_memory_viz``).
    Call ``backend.record_memory_history()`` first to get a trace, not only segments.
    Returns the path written.
    """
    path = os.fspath(path)
    folder = os.path.dirname(path) or "."
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"cannot write {path!r}: folder {folder!r} does not exist; create it first")
    snapshot = backend.full_snapshot()
    with open(path, "wb") as f:
        pickle.dump(snapshot, f, protocol=4)
    return path
