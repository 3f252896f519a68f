"""Build the documentation site: the pages under ``docs/`` and the executed notebooks.

    python -m graphborrow docs --notebooks output/suite --out output/site

The executed notebooks (``<name>.ipynb`` in a suite's folder, or ``<name>/h200.ipynb`` /
``<name>/defaults.ipynb`` in a points folder) are checked for their figures
(:func:`graphborrow.run.results.check_figures`), copied to ``docs/notebooks/`` and rendered by
MkDocs (Material theme, mkdocs-jupyter) with ``--strict``, so a broken internal link, a page
missing from the navigation or a notebook without its figures fails the build.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

from graphborrow.studies.shipped import numbered_notebooks

from .results import check_figures

__all__ = ["stage_notebooks", "main"]


def stage_notebooks(executed: Path, target: Path) -> list[str]:
    """Copy every numbered notebook's executed copy from ``executed`` into ``target``.

    Args:
        executed: a suite's output folder, or a points folder (one subfolder per notebook).
        target: where the site's notebook pages are read from (emptied first).

    Returns:
        Problems, one line each: a notebook with no executed copy, or one missing a figure.
    """
    problems = []
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    for notebook in numbered_notebooks():
        candidates = [executed / notebook.name, executed / notebook.stem / "defaults.ipynb",
                      executed / notebook.stem / "h200.ipynb"]
        found = next((c for c in candidates if c.is_file()), None)
        if found is None:
            problems.append(f"{notebook.stem}: no executed copy in {executed} (run the suite or make test first)")
            continue
        problems += check_figures(found, notebook.stem)
        shutil.copyfile(found, target / notebook.name)
    return problems


def main(argv=None) -> int:
    """The command line (see the module docstring); returns mkdocs' exit status, or 1 naming the problems."""
    parser = argparse.ArgumentParser(prog="python -m graphborrow docs", description=__doc__.splitlines()[0])
    parser.add_argument("--notebooks", type=Path, default=Path("output/suite"), help="folder of executed notebooks")
    parser.add_argument("--out", type=Path, default=Path("output/site"), help="where the site is written")
    parser.add_argument("--config", type=Path, default=Path("mkdocs.yml"), help="the MkDocs configuration")
    args = parser.parse_args(argv)
    if not args.config.is_file():
        print(f"error: {args.config} not found; run this from the repository's root", file=sys.stderr)
        return 2
    problems = stage_notebooks(args.notebooks, args.config.parent / "docs" / "notebooks")
    for line in problems:
        print(f"FAIL {line}", file=sys.stderr)
    if problems:
        return 1
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(args.config),
                           "-d", str(args.out.resolve())]).returncode
