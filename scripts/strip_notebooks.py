"""Strip outputs and execution counts from notebooks, so git holds only the source.

    python scripts/strip_notebooks.py [--check] [NOTEBOOK ...]   (default: notebooks/*.ipynb)

``--check`` changes nothing and exits 1 listing the notebooks that are not clean.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
VOLATILE_METADATA = ("execution", "papermill", "collapsed", "scrolled")


def strip(nb) -> bool:
    """Strip ``nb`` in place; True when anything changed."""
    changed = False
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        if cell.get("outputs") or cell.get("execution_count") is not None:
            cell.outputs, cell.execution_count = [], None
            changed = True
        for key in VOLATILE_METADATA:
            if key in cell.metadata:
                del cell.metadata[key]
                changed = True
    for key in ("papermill", "widgets"):
        if key in nb.metadata:
            del nb.metadata[key]
            changed = True
    return changed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=Path)
    parser.add_argument("--check", action="store_true", help="report, do not modify")
    args = parser.parse_args(argv)
    paths = args.notebooks or sorted((ROOT / "notebooks").glob("*.ipynb"))
    dirty = []
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        if strip(nb):
            dirty.append(path)
            if not args.check:
                nbformat.write(nb, path)
    if args.check and dirty:
        for path in dirty:
            print(f"not stripped: {path} (run: python scripts/strip_notebooks.py)", file=sys.stderr)
        return 1
    if not args.check:
        print(f"stripped {len(dirty)} of {len(paths)} notebooks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
