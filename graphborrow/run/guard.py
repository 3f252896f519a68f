"""The results guard: fail unless every numbered notebook wrote results that show device work.

    python -m graphborrow check-results [--notebooks DIR] [--results DIR] [--since EPOCH_SECONDS]
                                        [--executed DIR]

A notebook can pass nbval by skipping every device cell; it cannot also write a results file
with ``device_work > 0``. ``--executed`` also checks the executed notebooks found under DIR
(``<name>.ipynb`` at any depth, e.g. ``output/suite`` or ``output/points``): every cell tagged
``figure`` must hold an image and no figure may show as text. ``--notebooks`` defaults to the
notebooks shipped with graphborrow (``notebooks/`` in a checkout), ``--results`` to
``<notebooks>/results``. The rules themselves are :func:`graphborrow.run.results.check_results`
and :func:`graphborrow.run.results.check_figures`; ``python -m graphborrow suite`` applies them too.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from graphborrow.studies.shipped import notebooks_dir

from .results import check_figures, check_results

__all__ = ["main"]


def main(argv=None) -> int:
    """The command line (see the module docstring); returns 0, or 1 naming every problem."""
    parser = argparse.ArgumentParser(prog="python -m graphborrow check-results",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--notebooks", type=Path, default=None, help="folder of the numbered notebooks")
    parser.add_argument("--results", type=Path, default=None,
                        help="results directory (default: <notebooks>/results)")
    parser.add_argument("--since", type=float, default=None,
                        help="reject results written before this Unix time")
    parser.add_argument("--executed", type=Path, default=None,
                        help="folder holding executed notebooks whose figures to check")
    args = parser.parse_args(argv)
    notebooks = args.notebooks or notebooks_dir()
    results = args.results or notebooks / "results"
    names = sorted(p.stem for p in notebooks.glob("[0-9][0-9]_*.ipynb"))
    problems = check_results(names, results, args.since) if names else [f"no numbered notebooks found in {notebooks}"]
    if args.executed is not None:
        executed = sorted(p for p in args.executed.rglob("*.ipynb") if p.stem[:2].isdigit() or p.parent.name[:2].isdigit())
        if not executed:
            problems.append(f"no executed notebooks under {args.executed}")
        for path in executed:
            problems += check_figures(path, str(path.relative_to(args.executed)))
    for line in problems:
        print(f"FAIL {line}", file=sys.stderr)
    if problems:
        return 1
    print(f"ok: {len(names)} notebooks wrote results with device work to {results}")
    return 0
