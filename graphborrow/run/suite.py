"""The notebook suite: every numbered notebook once, headless, on one device.

    python -m graphborrow suite --device sim --out output/suite

Each notebook runs with papermill on a kernel of its own (the same runner as a sweep point,
here on this machine; :mod:`graphborrow.run.sweep.execute`) and is written executed to
``<out>/<notebook>.ipynb``, its results to
``<out>/results/<notebook>.json``. A notebook counts as passed only if papermill finished
*and* its results file shows device work (:func:`graphborrow.run.results.check_results`), so
none can pass by skipping its cells.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from graphborrow.core.atomicfile import write_atomic
from graphborrow.core.errors import ParameterError
from graphborrow.studies.shipped import numbered_notebooks

from .environment import check_environment
from .folders import output_folder
from .results import check_results
from .sweep.execute import NotebookJob, count_images, execute
from .sweep.parameters import declared_parameters, read_notebook, validate

__all__ = ["run_suite", "SuiteReport", "NotebookRun", "SuiteInterrupted"]


@dataclass
class NotebookRun:
    """One notebook of the suite: how it went and where its executed copy is."""

    name: str
    status: str          # "ok" or "failed"
    seconds: float
    notebook: Path
    error: str | None = None
    figures: int = 0     # image outputs in the executed notebook


class SuiteInterrupted(KeyboardInterrupt):
    """Ctrl-C during the suite: which notebooks finished, and the ``--only`` names of the rest."""

    def __init__(self, out: Path, finished: Sequence[str], remaining: Sequence[str]):
        super().__init__(f"{len(finished)} notebooks finished, {len(remaining)} not")
        self.out, self.finished, self.remaining = out, list(finished), list(remaining)

    def advice(self) -> str:
        """What to run next, for the command line.

        Returns:
            Where the finished notebooks are and the command that runs only the others (a
            plain rerun runs every notebook again).
        """
        prefixes = " ".join(name.split("_", 1)[0] for name in self.remaining)
        return (f"interrupted: {len(self.finished)} notebook(s) finished, in {self.out}; running the same command "
                f"again runs every notebook again. To run only the rest: python -m graphborrow suite "
                f"--only {prefixes} --out {self.out} (with the same --device and -p)")


@dataclass
class SuiteReport:
    out: Path
    results_dir: Path
    notebooks: list[NotebookRun] = field(default_factory=list)

    @property
    def failed(self) -> list[NotebookRun]:
        return [n for n in self.notebooks if n.status != "ok"]

    def summary(self) -> str:
        lines = [f"{len(self.notebooks) - len(self.failed)} of {len(self.notebooks)} notebooks passed",
                 f"executed notebooks: {self.out}", f"results (JSON):     {self.results_dir}"]
        return "\n".join(lines + [f"FAILED {n.name}: {n.error}" for n in self.failed])


def select_notebooks(only: Sequence[str] | None = None) -> list[Path]:
    """The shipped numbered notebooks, or those whose names start with one of ``only``."""
    notebooks = numbered_notebooks()
    if not notebooks:
        raise FileNotFoundError("graphborrow's package data holds no numbered notebooks; reinstall graphborrow")
    if not only:
        return notebooks
    unmatched = [o for o in only if not any(nb.stem.startswith(o) for nb in notebooks)]
    if unmatched:
        raise ParameterError(f"--only {' '.join(unmatched)} matches no notebook; the notebooks are "
                             f"{', '.join(nb.stem for nb in notebooks)}")
    return [nb for nb in notebooks if any(nb.stem.startswith(o) for o in only)]


def run_suite(out: str | Path = Path("output") / "suite", *, device: str = "auto",
              only: Sequence[str] | None = None, params: Mapping[str, Any] | None = None,
              timeout: float | None = None, echo: Callable[[str], None] = print, jobs: int = 1) -> SuiteReport:
    """Run the numbered notebooks, ``jobs`` at a time, each on a kernel of its own.

    Args:
        out: folder for the executed notebooks (``results/`` inside holds their JSON).
        device: ``auto``, ``cuda`` or ``sim`` for every notebook.
        only: notebook name prefixes (``["01", "02"]``); None runs all.
        params: overrides, each given to every notebook that declares it.
        timeout: papermill's per-cell timeout in seconds.
        echo: gets one line per notebook, in the notebooks' order.
        jobs: notebooks run at the same time (one per core suits the simulated device; on a GPU
            keep 1, the notebooks share the device).

    Returns:
        A :class:`SuiteReport`; failed notebooks are in it, not raised.

    Raises:
        ParameterError: a bad timeout, job count, device, parameter, environment variable or
            output folder, before any notebook runs.
        SuiteInterrupted: Ctrl-C; it says which notebooks finished.
    """
    check_environment()
    if timeout is not None and not timeout > 0:
        raise ParameterError(f"timeout={timeout!r} must be a positive number of seconds per cell")
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ParameterError(f"jobs={jobs!r} must be a whole number of notebooks at a time, 1 or more")
    base = validate({"DEVICE": device})
    extra = validate(dict(params or {}))
    notebooks = select_notebooks(only)
    declared = {nb: declared_parameters(read_notebook(nb)) for nb in notebooks}
    unused = [k for k in extra if not any(k in names for names in declared.values())]
    if unused:
        raise ParameterError(f"{', '.join(unused)}: declared by none of the notebooks run "
                             f"({', '.join(nb.stem for nb in notebooks)})")
    out = output_folder(out)
    report = SuiteReport(out, out / "results")
    jobs_for = {nb: NotebookJob(nb.name, nb.read_bytes(), {k: v for k, v in {**base, **extra}.items()
                                                            if k in declared[nb]},
                                nb.stem, timeout, set_data_dir="DATA_DIR" in declared[nb] and "DATA_DIR" not in extra,
                                threads=1 if jobs > 1 else None,  # one core each when they run side by side
                                fork=len(notebooks) > 1)  # a warm kernel server pays off from the second
                for nb in notebooks}
    done: list[str] = []
    stop = threading.Event()  # Ctrl-C: the running notebooks' kernels are killed, not waited for
    with ThreadPoolExecutor(jobs) as pool:
        started = time.time()
        futures = [pool.submit(execute, jobs_for[nb], should_stop=stop.is_set) for nb in notebooks]
        try:
            for nb, future in zip(notebooks, futures):
                run = _store(nb, future.result(), report, started)
                done.append(nb.stem)
                echo(f"{'ok' if run.status == 'ok' else 'FAILED':6} {nb.stem:28} {run.seconds:6.1f} s  "
                     f"{run.figures:2} figures  {run.notebook}")
                if run.error:
                    echo(f"       {run.error}")
        except KeyboardInterrupt:
            stop.set()
            for future in futures:
                future.cancel()
            raise SuiteInterrupted(out, done, [nb.stem for nb in notebooks if nb.stem not in done]) from None
    return report


def _store(nb: Path, execution, report: SuiteReport, started: float) -> NotebookRun:
    """Write one notebook's executed copy, log and results; check its results file; add it to ``report``."""
    out, results_dir = report.out, report.results_dir
    executed = out / nb.name
    if execution.notebook:
        write_atomic(executed, execution.notebook)
    write_atomic(out / f"{nb.stem}.log", execution.log)
    stale = results_dir / f"{nb.stem}.json"
    if stale.exists():
        stale.unlink()  # a file from an earlier run must not pass for this one
    for rel, data in execution.results.items():
        write_atomic(out / rel, data)
    error = execution.error
    if execution.returncode == 0:
        problems = check_results([nb.stem], results_dir, since=started)
        error = "; ".join(problems) or None
    run = NotebookRun(nb.stem, "ok" if error is None else "failed", execution.seconds, executed, error,
                      count_images(execution.notebook))
    report.notebooks.append(run)
    return run
