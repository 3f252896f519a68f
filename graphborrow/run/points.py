"""Run the numbered notebooks at the points of their parameter space and report each failure.

    python -m graphborrow points [--only 00 01] [--labels h200 low] [--samples 1] [--seed 0]
                                 [--jobs 2] [--out output/points] [--timeout 300]

The points come from :mod:`graphborrow.run.sweep.space`: a notebook's defaults, the low and
the high corner of its ranges, the H200 preset and seeded random points. Each runs with
papermill on the simulated device (``DEVICE=sim``), ``--jobs`` at a time. A point passes when
the notebook ran to the end, wrote its results file with device work
(:func:`graphborrow.run.results.check_results`) and every cell tagged ``figure`` holds an image
(:func:`graphborrow.run.results.check_figures`). Executed notebooks land in
``<out>/<notebook>/<label>.ipynb``, the summary in ``<out>/report.json``: per point its
parameters, problems, wall seconds and the seconds its cells ran (the rest is papermill
starting a kernel and the notebook's imports). Exit status 1 when any point failed.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

from graphborrow.run.arguments import gibibytes, seconds
from graphborrow.studies.shipped import notebooks_dir

from .results import check_figures, check_results
from .sweep.execute import NotebookJob, execute
from .sweep.parameters import declared_parameters, read_notebook
from .sweep.space import notebook_points

__all__ = ["run_point", "cell_seconds", "main"]


def _failure(ran, timeout: float) -> str:
    """The failed point's message: the notebook's error, a timeout said as such, or the log's last error line."""
    log = ran.log or ""
    if "CellTimeoutError" in log or "Cell execution timed out" in log or "timed out" in (ran.error or ""):
        return f"a cell ran longer than {timeout:.0f} s (--timeout)"
    error = (ran.error or "").strip()
    if error and set(error) != {"-"}:
        return error
    lines = [ln.strip() for ln in log.splitlines() if "Error" in ln]
    return lines[-1] if lines else f"papermill exited {ran.returncode}"


def cell_seconds(notebook: bytes) -> tuple[Optional[float], Optional[float]]:
    """Seconds the executed notebook's cells ran (papermill's per-cell durations): all of them
    together, and the slowest one; ``(None, None)`` when no cell has a duration (no executed
    notebook, or none of its cells ran)."""
    try:
        nb = json.loads(notebook) if notebook else {}
    except ValueError:
        return None, None
    times = [cell.get("metadata", {}).get("papermill", {}).get("duration") for cell in nb.get("cells", [])]
    times = [t for t in times if isinstance(t, (int, float))]
    if not times:
        return None, None
    return round(sum(times), 1), round(max(times), 1)


def _seconds(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.0f} s"


def run_point(path: Path, label: str, params: dict, out: Path, timeout: float, fork: bool = True) -> dict:
    """Run one point of one notebook on the simulated device.

    Args:
        path: the notebook.
        label: the point's name ("defaults", "h200", "random-0", ...): the executed copy's file name.
        params: its parameters (``DEVICE`` defaults to ``sim``).
        out: folder for ``<notebook>/<label>.ipynb``.
        timeout: seconds one cell may run.
        fork: its kernel may come from a warm kernel server (worth it when a run has several points).

    Returns:
        The point's record: notebook, label, params, ok, problems, seconds, cell_seconds,
        slowest_cell_seconds.
    """
    declared = declared_parameters(read_notebook(path))
    job = NotebookJob(path.name, path.read_bytes(), {"DEVICE": "sim", **params}, f"{path.stem}[{label}]",
                      timeout=timeout, set_data_dir="DATA_DIR" in declared and "DATA_DIR" not in params,
                      threads=1, fork=fork)
    ran = execute(job)
    folder = out / path.stem
    folder.mkdir(parents=True, exist_ok=True)
    if ran.notebook:
        (folder / f"{label}.ipynb").write_bytes(ran.notebook)
    problems = [_failure(ran, timeout)] if ran.returncode else []
    if not problems:
        with tempfile.TemporaryDirectory() as tmp:
            for rel, data in ran.results.items():
                Path(tmp, Path(rel).name).write_bytes(data)
            problems += check_results([path.stem], tmp)
        problems += check_figures(json.loads(ran.notebook), path.stem) if ran.notebook else ["no executed notebook"]
    cells, slowest = cell_seconds(ran.notebook)
    return {"notebook": path.stem, "label": label, "params": params, "ok": not problems,
            "problems": problems, "seconds": round(ran.seconds, 1), "cell_seconds": cells,
            "slowest_cell_seconds": slowest}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m graphborrow points", description=__doc__.splitlines()[0])
    parser.add_argument("--notebooks", type=Path, default=None, help="folder of the numbered notebooks")
    parser.add_argument("--only", nargs="*", default=None, help="notebook number prefixes, e.g. 00 03")
    parser.add_argument("--samples", type=int, default=1, help="random points per notebook")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random points")
    parser.add_argument("--jobs", type=int, default=2, help="points run at the same time")
    parser.add_argument("--out", type=Path, default=Path("output/points"))
    parser.add_argument("--timeout", type=seconds, default=300, help="seconds one cell may run (inf: no limit)")
    parser.add_argument("--skip-defaults", action="store_true",
                        help="leave out the defaults point (nbval runs the defaults)")
    parser.add_argument("--labels", nargs="*", default=None,
                        help="only these points (defaults low high h200 random-0 ...)")
    parser.add_argument("--no-h200", action="store_true", help="leave out the H200-preset point")
    parser.add_argument("--memory-gb", type=gibibytes, default=6,
                        help="address-space limit of each notebook's kernel (0: none); a point that needs "
                             "more fails with a MemoryError instead of swapping a shared machine")
    return parser


def main(argv=None) -> int:
    """The command line (see the module docstring); returns the exit status."""
    args = _parser().parse_args(argv)
    for name in ("samples", "jobs"):
        least = 0 if name == "samples" else 1
        if getattr(args, name) < least:
            print(f"error: --{name} {getattr(args, name)} is too small; it must be {least} or more", file=sys.stderr)
            return 2
    # the limit is inherited by the notebooks' kernels (and their kernel server), and lifted again at the end
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if args.memory_gb:
        limit = int(args.memory_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
    try:
        return _run(args)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _run(args) -> int:
    folder = args.notebooks or notebooks_dir()
    paths = sorted(folder.glob("[0-9][0-9]_*.ipynb"))
    if args.only:
        paths = [p for p in paths if any(p.name.startswith(prefix) for prefix in args.only)]
    if not paths:
        print(f"no numbered notebooks matched in {folder}", file=sys.stderr)
        return 2
    points = [(p, pt) for p in paths for pt in notebook_points(p, args.samples, args.seed, not args.no_h200)]
    labels = list(dict.fromkeys(pt.label for _, pt in points))
    unknown = [label for label in args.labels or [] if label not in labels]
    if unknown:  # a typo must not quietly check less, or nothing, and pass
        print(f"error: --labels {' '.join(unknown)}: no point of these {len(paths)} notebooks has that name; "
              f"their points are {' '.join(labels)} (random-N up to --samples)", file=sys.stderr)
        return 2
    todo = [(p, pt) for p, pt in points
            if (args.labels is None or pt.label in args.labels)
            and not (args.skip_defaults and pt.label == "defaults")]
    if not todo:  # a run that checks nothing must not pass
        print(f"no point of {len(paths)} notebooks matched --labels {' '.join(args.labels or [])}"
              f"{' with --skip-defaults' if args.skip_defaults else ''}: nothing to run; name points the "
              f"notebooks have ({' '.join(labels)})", file=sys.stderr)
        return 2
    print(f"{len(todo)} points of {len(paths)} notebooks, {args.jobs} at a time", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    records = []
    with ThreadPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(run_point, p, pt.label, pt.params, args.out, args.timeout, len(todo) > 1)
                   for p, pt in todo]
        for (p, pt), fut in zip(todo, futures):
            rec = fut.result()
            records.append(rec)
            status = "ok  " if rec["ok"] else "FAIL"
            print(f"{status} {rec['notebook']} [{rec['label']}] {rec['seconds']:.0f} s "
                  f"(cells {_seconds(rec['cell_seconds'])})  {pt.describe()}", flush=True)
            for line in rec["problems"]:
                print(f"       {line[:400]}", flush=True)
    failed = [r for r in records if not r["ok"]]
    report = {"seconds": round(time.time() - start, 1), "points": len(records), "failed": len(failed),
              "seed": args.seed, "samples": args.samples, "records": records}
    (args.out / "report.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(f"{len(records) - len(failed)} of {len(records)} points passed in {report['seconds']:.0f} s; "
          f"report: {args.out / 'report.json'}")
    return 1 if failed else 0
