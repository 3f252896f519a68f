"""Command line: ``python -m graphborrow {run,demo,sweep,suite,points,check-results,inspect,simulate,build,replay-corpus} ...``.

Each command is a thin layer over a public function: :func:`graphborrow.run.demo.run_demo`,
:func:`graphborrow.run.suite.run_suite`, :func:`graphborrow.run.sweep.run_sweep`,
:func:`graphborrow.studies.inspection.inspect_snapshot`, :func:`graphborrow.run.simulate.simulate_script`,
:func:`graphborrow.fidelity.corpus.replay_corpus`. Bad arguments, environment variables and output
folders exit with status 2 and one line naming the problem, before any work; Ctrl-C exits with 130
and says what a rerun does.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from graphborrow.core.errors import ParameterError
from graphborrow.core.snapshot import TRUST
from graphborrow.run.arguments import seconds, whole_number
from graphborrow.run.folders import output_folder

DEVICES = ("auto", "cuda", "sim")
DEFAULT_OUT = Path("output")


def _check_device(device: str) -> None:
    """``cuda`` on a machine where torch sees no GPU: say so before anything starts."""
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ParameterError("--device cuda: torch sees no CUDA device here; use --device sim "
                                 "(the simulated device) or --device auto")


def _demo(args: argparse.Namespace) -> int:
    from graphborrow.run.demo import main as demo_main

    return demo_main(args.rest) or 0


def _overrides(pairs) -> dict:
    from graphborrow.run.sweep import parse_value

    return {name: parse_value(value) for name, value in (pairs or [])}


def _sweep_grid(args: argparse.Namespace) -> tuple:
    """The notebook and the :class:`~graphborrow.run.sweep.Grid` a ``sweep`` command line names
    (their values are checked by run_sweep)."""
    from graphborrow.run.sweep import Grid
    from graphborrow.studies.shipped import example_grid

    if args.scheduler and args.workers is not None:
        raise ParameterError("--workers sizes the local cluster; with --scheduler the cluster's own "
                             "workers run the points (start more with 'dask worker ADDRESS')")
    grid = Grid.from_yaml(args.grid) if args.grid else Grid()
    grid.add_cli(args.param or [])
    notebook = args.notebook or grid.notebook
    if not notebook:
        raise ParameterError(f"name a notebook (argument, or 'notebook:' in the grid file, as in {example_grid()})")
    return notebook, grid


def _sweep(args: argparse.Namespace) -> int:
    from graphborrow.run.sweep import run_sweep

    notebook, grid = _sweep_grid(args)
    report = run_sweep(notebook, grid, name=args.name, out=args.out, workers=args.workers or 1,
                       scheduler=args.scheduler, timeout=args.timeout, plot_y=args.plot_y,
                       progress=not args.quiet)
    print(report.summary())
    return 1 if report.failed else 0


def _suite(args: argparse.Namespace) -> int:
    from graphborrow.run.suite import run_suite

    _check_device(args.device)
    report = run_suite(args.out, device=args.device, only=args.only, params=_overrides(args.param),
                       timeout=args.timeout)
    print(report.summary())
    return 1 if report.failed else 0


def _run(args: argparse.Namespace) -> int:
    """The main job: the core demo, every notebook, and the example sweep."""
    from graphborrow.run.demo import freeze_imports, run_demo
    from graphborrow.run.suite import run_suite
    from graphborrow.run.sweep import Grid, run_sweep
    from graphborrow.studies.shipped import example_grid

    _check_device(args.device)
    out = output_folder(args.out)
    print("== core demo ==", flush=True)
    freeze_imports()
    run_demo(args.device)
    print("\n== example sweep ==", flush=True)  # first: notebook 06 shows its results
    grid = Grid.from_yaml(example_grid())
    sweep = run_sweep(grid.notebook, grid, out=out, workers=2, timeout=args.timeout)
    print(sweep.summary())
    print("\n== notebook suite ==", flush=True)
    from graphborrow.device.select import cuda_available

    on_gpu = args.device == "cuda" or (args.device == "auto" and cuda_available())
    suite = run_suite(out / "suite", device=args.device, timeout=args.timeout, jobs=1 if on_gpu else 2,
                      params={"SWEEP_DIR": str((out / grid.name).resolve())} if not sweep.failed else None)
    print(suite.summary())
    print(f"\nall results under {out.resolve()}")
    return 1 if suite.failed or sweep.failed else 0


def _int_list(text: str) -> list[int]:
    """A comma-separated list of whole numbers, each 1 or more (``--batches 1,4,16``)."""
    return [whole_number(part) for part in text.split(",")]


def _modes(text: str) -> list[str]:
    from graphborrow.eagle.modes import MODES

    modes = [m.strip() for m in text.split(",")]
    wrong = [m for m in modes if m not in MODES]
    if wrong:
        raise argparse.ArgumentTypeError(f"unknown mode {wrong[0]!r}; choose from {', '.join(MODES)}")
    return modes


def _pool(text: str) -> tuple[int, int]:
    try:
        a, b = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a pool id; write it as two numbers, e.g. 0,1") from None
    return a, b


def _inspect(args: argparse.Namespace) -> int:
    """Pools, free runs, fitting verification steps and the memory map of a recorded snapshot."""
    import json

    from graphborrow.core.errors import SnapshotFormatError
    from graphborrow.studies.inspection import (
        format_report,
        inspect_snapshot,
        plot_report,
    )

    out = output_folder(args.out)
    stem = Path(args.snapshot).stem
    figure, table = out / f"{stem}_memory_map.png", out / f"{stem}_fit.json"
    for target in (figure, table):  # before the work: its results must have a place to go
        if target.is_dir():
            raise ParameterError(f"{target} is a folder, where inspect writes a file; move it, or choose another "
                                 "--out")
    try:
        report = inspect_snapshot(args.snapshot, batches=args.batches, draft_tokens=args.draft_tokens,
                                  vocab=args.vocab, modes=args.modes, pool_id=args.pool,
                                  top_k=args.top_k, top_p=args.top_p)
    except SnapshotFormatError as exc:
        raise ParameterError(str(exc)) from None
    print(format_report(report))
    plot_report(report).savefig(figure, dpi=110)
    table.write_text(json.dumps({"snapshot": str(args.snapshot), "pool": list(report.planned_pool),
                                 "vocab": report.vocab, "fit": report.fit}, indent=1))
    print(f"\nmemory map: {figure}\nfit table:  {table}")
    return 0


def _simulate(args: argparse.Namespace) -> int:
    """An unmodified script on the simulated device: snapshot, graph pools, fitting verification steps."""
    from graphborrow.run.simulate import parse_bytes, simulate_script

    result = simulate_script(args.script, args.args, capacity=parse_bytes(args.capacity), out=args.out,
                             backed=args.backed, at_process_exit=lambda done: print(done.summary(), flush=True))
    print(result.summary())
    return result.status


def _build(args: argparse.Namespace) -> int:
    from graphborrow.allocator import compiled

    existed = compiled.problem() is None
    try:
        paths = compiled.build(force=args.force, quiet=not args.verbose)
    except RuntimeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    names = ", ".join(path.name for path in paths.values())
    folder = next(iter(paths.values())).parent
    print(f"compiled allocator model: {names} in {folder}" + (" (already built)" if existed and not args.force else ""))
    return 0


def _replay_corpus(args: argparse.Namespace) -> int:
    """Replay every trace of a corpus folder on the simulated allocator; print and record the agreement."""
    from graphborrow.fidelity import corpus

    paths = corpus.trace_files(Path(args.corpus) if args.corpus else corpus.default_corpus(),
                               args.only.split(",") if args.only else None)
    if args.json:
        try:
            corpus.check_record(Path(args.json))  # before the replay: its result must have a place to go
        except ValueError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2

    def show(row: dict) -> None:
        if "unreadable" in row:
            result = f"unreadable: {row['unreadable']}"
        elif "refused" in row:
            result = f"refused: {row['refused']}"
        else:
            agreement = "undefined" if row["agreement"] is None else f"{row['agreement']:.4f}"
            result = f"{agreement} ({row['checks']} checks, {row['unverifiable']} not made"
            if row["stats_checked"]:
                result += f", stats {row['stats_checked'] - row['stats_mismatches']}/{row['stats_checked']}"
            result += ")"
        print(f"{row['name']:<24} {row['variant'] or '':<14} {result}", flush=True)

    rows = corpus.replay_corpus(paths, progress=show)
    summary = corpus.summarize(rows)
    print(json.dumps(summary))
    if args.json:
        command = "python -m graphborrow replay-corpus " + shlex.join(args.argv)
        commit = args.commit or corpus.current_commit(Path.cwd())
        corpus.record_run(Path(args.json), args.label, commit, command, rows)
        print(f"wrote {args.json} (run {args.label!r})")
    if summary["unreadable"]:
        print(f"error: {summary['unreadable']} of {len(rows)} files are not traces (above: 'unreadable'); move them "
              "out of the corpus folder, or name the traces with --only", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m graphborrow",
                                     description="graphborrow: borrow idle CUDA-graph pool memory")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="the main job: demo, every notebook, and the example sweep")
    run.add_argument("--out", default=str(DEFAULT_OUT), help="where executed notebooks and results go")
    run.add_argument("--device", default="auto", choices=DEVICES)
    run.add_argument("--timeout", type=seconds, default=None, help="per-cell timeout, seconds")
    run.set_defaults(func=_run)

    demo = sub.add_parser("demo", help="a short end-to-end demonstration", add_help=False)
    demo.add_argument("rest", nargs=argparse.REMAINDER)
    demo.set_defaults(func=_demo)

    sweep = sub.add_parser("sweep", help="run a notebook over a parameter grid with papermill")
    sweep.add_argument("notebook", nargs="?", help="an .ipynb path, or a shipped notebook's name (e.g. 06_capacity_sweep)")
    sweep.add_argument("--grid", help="YAML grid file (see notebooks/sweep_example.yaml)")
    sweep.add_argument("-p", "--param", nargs=2, action="append", metavar=("NAME", "VALUES"),
                       help="a parameter and comma-separated values, e.g. -p VOCAB 2048,4096")
    sweep.add_argument("--name", help="sweep name (its folder under --out)")
    sweep.add_argument("--out", default=str(DEFAULT_OUT), help="folder holding sweeps (default: output)")
    sweep.add_argument("--workers", type=whole_number, default=None,
                       help="processes of the local Dask cluster, each running one point at a time (default 1)")
    sweep.add_argument("--scheduler", metavar="ADDRESS",
                       help="run the points on an existing Dask cluster: tcp://HOST:PORT (or HOST:PORT, "
                            "tls://HOST:PORT), e.g. tcp://10.0.0.5:8786; waits for it as long as "
                            "DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT says (30 s)")
    sweep.add_argument("--timeout", type=seconds, default=None,
                       help="per-cell timeout in seconds (default 600; inf: no limit); a point whose cell runs "
                            "longer is recorded failed and the others go on")
    sweep.add_argument("--plot-y", help="results column to plot (default: the first numeric one)")
    sweep.add_argument("--quiet", action="store_true", help="no progress bar")
    sweep.set_defaults(func=_sweep)

    suite = sub.add_parser("suite", help="run every numbered notebook once")
    suite.add_argument("--out", default=str(DEFAULT_OUT / "suite"), help="executed notebooks and results go here")
    suite.add_argument("--device", default="auto", choices=DEVICES)
    suite.add_argument("--only", nargs="+", help="notebook name prefixes, e.g. 01 02")
    suite.add_argument("--timeout", type=seconds, default=None, help="per-cell timeout, seconds")
    suite.add_argument("-p", "--param", nargs=2, action="append", metavar=("NAME", "VALUE"),
                       help="override a parameter in every notebook that declares it, e.g. -p VOCAB 128256")
    suite.set_defaults(func=_suite)

    inspect = sub.add_parser("inspect", help="pools, free runs and fitting verification steps of your own snapshot",
                             description="Pools, free runs and the verification steps that fit a borrow, read "
                                         "from a recorded allocator snapshot.",
                             epilog=f"Trust: {TRUST}. A refused file you made yourself can be unpickled by you "
                                    "and passed to graphborrow.studies.inspection.inspect_snapshot as the dict.")
    inspect.add_argument("snapshot", help="the pickle torch.cuda.memory._dump_snapshot writes, or the same dict as "
                                          ".json (either may be .gz); read without running code from the file")
    inspect.add_argument("--batches", type=_int_list, default=[1, 4, 16, 32, 64, 128],
                         help="batch sizes to plan, comma-separated (default 1,4,16,32,64,128)")
    inspect.add_argument("--draft-tokens", type=_int_list, default=[4, 8, 16],
                         help="draft tokens per request, comma-separated (default 4,8,16)")
    inspect.add_argument("--vocab", type=whole_number, default=128256, help="target vocabulary (default 128256)")
    inspect.add_argument("--modes", type=_modes, default=None,
                         help="verification modes, comma-separated (default: all of them)")
    inspect.add_argument("--pool", type=_pool, default=None,
                         help="pool to borrow from, e.g. 0,1 (default: the private pool with the most idle runs)")
    inspect.add_argument("--top-k", action="store_true", help="the step runs the top-k renorm")
    inspect.add_argument("--top-p", action="store_true", help="the step runs the top-p renorm")
    inspect.add_argument("--out", default=str(DEFAULT_OUT / "inspect"),
                         help="where the memory map and fit table go (default output/inspect)")
    inspect.set_defaults(func=_inspect)

    simulate = sub.add_parser("simulate", help="run your own script, unmodified, on the simulated device")
    simulate.add_argument("script", help="a Python script written for a GPU (cuda is the simulated H200)")
    simulate.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    simulate.add_argument("--capacity", default="150109880320", help="device memory, e.g. 80GiB (default: an H200)")
    simulate.add_argument("--out", default=str(DEFAULT_OUT / "simulate"), help="where the snapshot pickle goes")
    simulate.add_argument("--backed", action="store_true", help="real bytes behind every segment (small models)")
    simulate.set_defaults(func=_simulate)

    for name, text in (("points", "run the notebooks at the points of their parameter space"),
                       ("check-results", "check that every notebook wrote results showing device work"),
                       ("docs", "build the documentation site from docs/ and executed notebooks")):
        own = sub.add_parser(name, help=text, add_help=False)  # each owns its options (see main)
        own.add_argument("rest", nargs=argparse.REMAINDER)

    build = sub.add_parser("build", help="compile the simulated allocator with Cython (no-op when built)")
    build.add_argument("--force", action="store_true", help="rebuild even if a build of these sources exists")
    build.add_argument("--verbose", action="store_true", help="show Cython's and the compiler's output")
    build.set_defaults(func=_build)

    replay = sub.add_parser("replay-corpus", help="replay a folder of recorded traces on the simulated allocator")
    replay.add_argument("--corpus", default=None,
                        help="the folder of traces (default: the checkout's data/traces/corpus, from any folder)")
    replay.add_argument("--json", help="add this run to a JSON file of labelled runs (e.g. data/traces/corpus_agreement.json)")
    replay.add_argument("--label", default="current", help="the run's name in that file (replaces a run of that name)")
    replay.add_argument("--commit", help="the simulator's commit, when it is not this checkout's HEAD")
    replay.add_argument("--only", help="comma-separated trace names, e.g. seed001,seed002_late")
    replay.set_defaults(func=_replay_corpus)
    return parser


def _check_environment() -> None:
    """Every environment variable graphborrow reads, before any work (imports torch: after parsing)."""
    from graphborrow.run.environment import check_environment

    check_environment()


# What a rerun after Ctrl-C does, per command (the suite says it itself: SuiteInterrupted).
_AFTER_CTRL_C = {
    "sweep": "finished points are stored; run the same command again to finish the rest",
    "run": "the example sweep's finished points are stored; running the same command again repeats the demo and "
           "the notebook suite, then finishes the sweep",
}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv else None
    try:
        if command == "demo":  # the demo owns its options
            _check_environment()
            from graphborrow.run.demo import main as demo_main

            return demo_main(argv[1:]) or 0
        if argv[:1] in (["points"], ["check-results"], ["docs"]):  # so do the notebook checks and the site
            from graphborrow.run import docs, guard, points

            return {"points": points, "check-results": guard, "docs": docs}[argv[0]].main(argv[1:])
        args = build_parser().parse_args(argv)  # --help and usage errors first: they need no torch
        args.argv = argv[1:]
        _check_environment()
        return args.func(args)
    except (ParameterError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        advice = getattr(exc, "advice", None)
        if command == "suite" and advice is not None:
            print(advice(), file=sys.stderr)
        else:
            after = _AFTER_CTRL_C.get(command)
            print(f"interrupted: {after}" if after else "interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
