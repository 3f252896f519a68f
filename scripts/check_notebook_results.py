"""Guard: fail unless every numbered notebook wrote a results file that shows device work.

A notebook can pass nbval by skipping every device cell; it cannot also write a results
file with ``device_work > 0``. Usage (after running the notebooks):

    python scripts/check_notebook_results.py [--notebooks notebooks] [--results notebooks/results]
                                             [--since EPOCH_SECONDS]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def check(notebooks: Path, results: Path, since: float | None = None) -> list[str]:
    """Problems found, one line each; empty when every notebook checks out."""
    names = sorted(p.stem for p in notebooks.glob("[0-9][0-9]_*.ipynb"))
    if not names:
        return [f"no numbered notebooks found in {notebooks}"]
    problems = []
    for name in names:
        path = results / f"{name}.json"
        if not path.exists():
            problems.append(f"{name}: no results file {path} (did the notebook run to the end?)")
            continue
        try:
            record = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            problems.append(f"{name}: {path} is not valid JSON ({exc})")
            continue
        work = record.get("device_work")
        if not isinstance(work, int) or work <= 0:
            problems.append(f"{name}: device_work={work!r}; the notebook did no device work")
        if since is not None and record.get("finished_at", 0) < since:
            problems.append(f"{name}: {path} is stale (written before this run started)")
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--notebooks", type=Path, default=ROOT / "notebooks")
    parser.add_argument("--results", type=Path, default=None,
                        help="results directory (default: <notebooks>/results)")
    parser.add_argument("--since", type=float, default=None,
                        help="reject results written before this Unix time")
    args = parser.parse_args(argv)
    results = args.results or args.notebooks / "results"
    problems = check(args.notebooks, results, args.since)
    for line in problems:
        print(f"FAIL {line}", file=sys.stderr)
    if problems:
        return 1
    count = len(list(args.notebooks.glob("[0-9][0-9]_*.ipynb")))
    print(f"ok: {count} notebooks wrote results with device work to {results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
