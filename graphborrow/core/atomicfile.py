"""Atomic file writes: a reader sees the old file or the new one, never half of either.

Each write goes to a uniquely named temporary file in the same folder, is flushed to disk,
and is then renamed over the target (``os.replace`` is atomic within one file system).
Two writers of the same path never share a temporary file; the last rename wins.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["write_atomic"]


def write_atomic(path: str | Path, data: bytes | str) -> Path:
    """Write ``data`` (text is UTF-8 encoded) to ``path`` atomically; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = data.encode() if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o644)  # mkstemp's 0600 would hide results from other users
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path
