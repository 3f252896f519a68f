"""Command line: ``python -m graphborrow {run,demo,sweep,suite,build} ...``."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import yaml

from .errors import ParameterError


def _demo(args: argparse.Namespace) -> int:
    from .demo import main as demo_main

    return demo_main(args.rest) or 0


def _sweep(args: argparse.Namespace) -> int:
    from . import sweep as sw

    grid = sw.Grid.from_yaml(args.grid) if args.grid else sw.Grid()
    grid.add_cli(args.param or [])
    notebook = args.notebook or grid.notebook
    if not notebook:
        print("error: name a notebook (argument or 'notebook:' in the grid file)", file=sys.stderr)
        return 2
    report = sw.sweep(notebook, grid, name=args.name, runs_dir=args.runs_dir, jobs=args.jobs,
                      timeout=args.timeout, plot_y=args.plot_y or grid.plot_y, progress=not args.quiet)
    print(report.summary())
    return 1 if report.failed else 0


def _suite(args: argparse.Namespace) -> int:
    from . import sweep as sw

    out = Path(args.out).resolve()
    results = out / "results"
    notebooks = sorted(sw.NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
    if args.only:
        notebooks = [nb for nb in notebooks if any(nb.stem.startswith(o) for o in args.only)]
    if not notebooks:
        print(f"error: no numbered notebooks in {sw.NOTEBOOKS}", file=sys.stderr)
        return 2
    extra = sw.validate({name: yaml.safe_load(value) for name, value in (getattr(args, "param", None) or [])})
    params = sw.validate({"DEVICE": args.device, "OUTPUT_DIR": str(results)})
    failed = 0
    for nb in notebooks:
        start = time.time()
        declared = sw.declared_parameters(nb)  # each notebook gets the overrides it declares
        nb_params = {**params, **{k: v for k, v in extra.items() if k in declared}}
        code, log, output_nb = sw.run_notebook(nb, out, nb_params, timeout=args.timeout)
        status = "ok" if code == 0 else "FAILED"
        print(f"{status:6} {nb.stem:28} {time.time() - start:6.1f} s  {output_nb}", flush=True)
        if code != 0:
            failed += 1
            print(f"       {sw._error_from(output_nb, log)}", file=sys.stderr)
    print(f"executed notebooks: {out}\nresults (JSON):     {results}")
    return 1 if failed else 0


def _run(args: argparse.Namespace) -> int:
    """The main job: the core demo, every notebook, and the example sweep."""
    from .demo import run_demo

    print("== core demo ==", flush=True)
    run_demo(args.device)
    print("\n== notebook suite ==", flush=True)
    suite_args = argparse.Namespace(out=str(Path(args.out) / "suite"), device=args.device, only=None,
                                    timeout=args.timeout, param=None)
    failed = _suite(suite_args)
    print("\n== example sweep ==", flush=True)
    sweep_args = argparse.Namespace(grid=str(Path(__file__).resolve().parents[1] / "notebooks" / "sweep_example.yaml"),
                                    param=None, notebook=None, name=None, runs_dir=args.out, jobs=1,
                                    timeout=args.timeout, plot_y=None, quiet=False)
    failed |= _sweep(sweep_args)
    print(f"\nall results under {Path(args.out).resolve()}")
    return failed


def _build(args: argparse.Namespace) -> int:
    from .sim import compiled

    existed = compiled.verify(compiled.build_path()) is None
    try:
        path = compiled.build(force=args.force, quiet=not args.verbose)
    except RuntimeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"compiled allocator model: {path}" + (" (already built)" if existed and not args.force else ""))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m graphborrow",
                                     description="graphborrow: borrow idle CUDA-graph pool memory")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="the main job: demo, every notebook, and the example sweep")
    run.add_argument("--out", default="runs", help="where executed notebooks and results go")
    run.add_argument("--device", default="auto", help="auto, cuda or sim")
    run.add_argument("--timeout", type=float, default=None)
    run.set_defaults(func=_run)

    demo = sub.add_parser("demo", help="a short end-to-end demonstration")
    demo.add_argument("rest", nargs=argparse.REMAINDER)
    demo.set_defaults(func=_demo)

    sweep = sub.add_parser("sweep", help="run a notebook over a parameter grid with papermill")
    sweep.add_argument("notebook", nargs="?", help="path, or name under notebooks/ (e.g. 06_capacity_sweep)")
    sweep.add_argument("--grid", help="YAML grid file (see notebooks/sweep_example.yaml)")
    sweep.add_argument("-p", "--param", nargs=2, action="append", metavar=("NAME", "VALUES"),
                       help="a parameter and comma-separated values, e.g. -p batch_size 1,8,32")
    sweep.add_argument("--name", help="sweep name (directory under --runs-dir)")
    sweep.add_argument("--runs-dir", default="runs")
    sweep.add_argument("--jobs", type=int, default=1, help="points run at once (one process each)")
    sweep.add_argument("--timeout", type=float, default=None, help="per-cell timeout, seconds")
    sweep.add_argument("--plot-y", help="results column to plot (default: the first numeric one)")
    sweep.add_argument("--quiet", action="store_true", help="no progress bar")
    sweep.set_defaults(func=_sweep)

    suite = sub.add_parser("suite", help="run every numbered notebook once")
    suite.add_argument("--out", default="runs/suite", help="executed notebooks and results go here")
    suite.add_argument("--device", default="auto", help="auto, cuda or sim")
    suite.add_argument("--only", nargs="*", help="notebook name prefixes, e.g. 01 02")
    suite.add_argument("--timeout", type=float, default=None)
    suite.add_argument("-p", "--param", nargs=2, action="append", metavar=("NAME", "VALUE"),
                       help="override a parameter in every notebook that declares it, e.g. -p VOCAB 128256")
    suite.set_defaults(func=_suite)

    build = sub.add_parser("build", help="compile the simulated allocator with Cython (no-op when built)")
    build.add_argument("--force", action="store_true", help="rebuild even if a build of these sources exists")
    build.add_argument("--verbose", action="store_true", help="show Cython's and the compiler's output")
    build.set_defaults(func=_build)
    return parser


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["demo"]:  # the demo owns its options
        from .demo import main as demo_main

        return demo_main(argv[1:]) or 0
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ParameterError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
