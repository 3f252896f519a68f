"""How the notebooks state what they computed: prose rendered from the values, sizes in a unit
that shows them.

A notebook's markdown cells hold no hand-typed numbers (``tests/run/test_notebook_prose.py``);
every number, and every comparison, is a Markdown display from a code cell, so it follows the
parameters. :func:`prose` displays such a paragraph; :func:`size_text` writes a byte count so
that the allocator's rules stay visible (a run of 1.9995 MiB is not "2.0 MiB": below 2 MiB it
holds no segment at all, so it prints in KiB).
"""

from __future__ import annotations

import textwrap

__all__ = ["prose", "size_text", "sizes_text", "share_text"]

_KIB, _MIB, _GIB = 1024, 1024**2, 1024**3


def size_text(nbytes: int | float) -> str:
    """``nbytes`` in words: GiB from 10 GiB, MiB (two decimals) from 2 MiB, KiB (one decimal) from
    1 KiB, bytes below; a size just under 2 MiB is never rounded up to look like 2 MiB (an exact
    1 MiB, which no rounding hides, stays "1.00 MiB").

    Raises:
        ValueError: a negative size.
    """
    if nbytes < 0:
        raise ValueError(f"a size is never negative, got {nbytes}")
    if nbytes >= 10 * _GIB:
        return f"{nbytes / _GIB:.2f} GiB"
    if nbytes >= 2 * _MIB or nbytes == _MIB:
        return f"{nbytes / _MIB:.2f} MiB"
    if nbytes >= _KIB:
        return f"{nbytes / _KIB:.1f} KiB"
    return f"{int(nbytes)} B"


def sizes_text(sizes, limit: int = 8) -> str:
    """A list of sizes, largest first as given, in words (:func:`size_text`); past ``limit`` the
    rest are counted ("… and 3 more")."""
    sizes = list(sizes)
    shown = ", ".join(size_text(n) for n in sizes[:limit])
    return shown + (f" … and {len(sizes) - limit} more" if len(sizes) > limit else "")


def share_text(part: float, whole: float) -> str:
    """``part`` as a percentage of ``whole``; of nothing, no percentage ("n/a: nothing to compare")."""
    return f"{100 * part / whole:.0f} %" if whole else "n/a: nothing to compare"


def prose(text: str) -> None:
    """Display ``text`` (Markdown, typically an f-string of computed values) as the cell's output;
    outside IPython it is printed. Returns None, so a cell ending with it shows the text once."""
    text = textwrap.dedent(text).strip()
    try:
        from IPython import get_ipython
        from IPython.display import Markdown, display
    except ImportError:  # plain Python: the words still reach the reader
        get_ipython = None
    if get_ipython is None or get_ipython() is None:
        print(text)
        return
    display(Markdown(text))
