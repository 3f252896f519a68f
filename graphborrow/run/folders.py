"""Output folders, made (or refused) before any work starts.

A folder that cannot be written, found only when the first result is saved, costs the run
that produced it (and prints a traceback). Every command that writes results makes its
folder first, through :func:`output_folder`.
"""

from __future__ import annotations

import os
from pathlib import Path

from graphborrow.core.errors import ParameterError

__all__ = ["output_folder"]

_CHOOSE = "choose another one (--out on the command line, out= in Python)"


def output_folder(path: str | os.PathLike) -> Path:
    """Make ``path`` and its parents now, or say why that is impossible.

    Args:
        path: the folder results go to (``--out`` on the command line, ``out=`` in Python).

    Returns:
        The folder, absolute.

    Raises:
        ParameterError: a part of the path is a file, or the folder cannot be written; the
            message names that part and says what to pass instead.
    """
    folder = Path(path).expanduser().resolve()
    blocker = next((p for p in [folder, *folder.parents] if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise ParameterError(f"output folder {path}: {blocker} is a file, not a folder; {_CHOOSE}")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ParameterError(f"output folder {path}: cannot create it ({exc.strerror}); {_CHOOSE}") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ParameterError(f"output folder {path}: {folder} is not writable for you; {_CHOOSE}")
    return folder
