"""Parameter sweeps over a notebook: papermill runs each point on a kernel of its own, points on Dask.

    python -m graphborrow sweep --grid notebooks/sweep_example.yaml
    python -m graphborrow sweep 06_capacity_sweep -p vocab 2048,4096 -p mode standard,lean --workers 2
    python -m graphborrow sweep --grid big.yaml --scheduler tcp://10.0.0.5:8786

Or from Python::

    from graphborrow.run.sweep import Grid, run_sweep
    report = run_sweep("06_capacity_sweep", Grid(axes={"MODE": ["standard", "lean", "chunked"]}), workers=2)
    print(report.summary())

Every value is checked against :data:`PARAMETERS` and the notebook's parameters cell before
anything runs. Each point is stored under ``<out>/<sweep>/<point-id>/`` (see
:mod:`.points`); a rerun reuses the points that finished with the same parameters and
notebook code and runs the rest; a failing point is recorded while the others finish;
``results.csv`` and ``sweep.png`` are written at the end. One sweep of a name runs at a
time: a second one waits for the first and then finds its points done.
"""

from __future__ import annotations

import io
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from graphborrow.core.atomicfile import write_atomic
from graphborrow.core.errors import ParameterError
from graphborrow.studies.shipped import find_notebook

from ..environment import check_environment
from ..folders import output_folder
from .cluster import check_scheduler_address
from .execute import DEFAULT_CELL_TIMEOUT, Execution, NotebookJob
from .grid import Grid, check_sweep_name, parse_cli_values, parse_value
from .parameters import (
    PARAMETERS,
    argument_type,
    canonical,
    declared_parameters,
    read_notebook,
    validate,
)
from .points import (
    PointResult,
    PointStore,
    notebook_digest,
    point_identity,
    point_ids,
    read_csv,
    write_csv,
)

__all__ = [
    "run_sweep", "SweepReport", "Grid", "PointResult", "PARAMETERS", "validate", "canonical", "argument_type",
    "declared_parameters", "parse_value", "parse_cli_values", "read_csv", "write_csv", "DEFAULT_OUT",
    "DEFAULT_CELL_TIMEOUT", "check_sweep",
]

DEFAULT_OUT = Path("output")


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclass
class SweepReport:
    """What a sweep did: every point in grid order, and where the table and plot are."""

    directory: Path
    points: list[PointResult]
    csv_path: Path
    plot_path: Path | None

    @property
    def failed(self) -> list[PointResult]:
        return [p for p in self.points if p.status == "failed"]

    def summary(self) -> str:
        """The sweep in a few lines, for a terminal.

        Returns:
            Counts of points that ran, were already done and failed, where the table and
            plot are, and one line per failed point with its error.
        """
        counts = {s: sum(p.status == s for p in self.points) for s in ("ok", "done", "failed")}
        n = len(self.points)
        lines = [f"{n} point{'s' if n != 1 else ''}: {counts['ok']} ran, {counts['done']} already done, "
                 f"{counts['failed']} failed", f"table: {self.csv_path}"]
        if self.plot_path:
            lines.append(f"plot:  {self.plot_path}")
        lines += [f"FAILED {p.point_id}: {p.error}" for p in self.failed]
        return "\n".join(lines)


def _acquire(lock, name: str, directory: Path, log: Callable[[str], None]) -> None:
    from filelock import Timeout

    try:
        lock.acquire(timeout=0)
    except Timeout:
        log(f"another sweep named {name!r} is running in {directory}; waiting for it to finish")
        lock.acquire()


@dataclass(frozen=True)
class _Plan:
    """A sweep checked and ready to run: the notebook, its points and their names."""

    nb_path: Path
    known: set[str]
    points: list[dict]
    sweep_name: str
    digest: str
    identities: list[str]
    ids: list[str]
    scheduler: str | None
    timeout: float


def _plan(notebook: str | Path, grid: Grid, name: str | None, scheduler: str | None,
          timeout: float | None) -> _Plan:
    """Every check of a sweep's input, before anything is written or connected to."""
    check_environment()
    if timeout is None:
        timeout = DEFAULT_CELL_TIMEOUT
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ParameterError(f"timeout={timeout!r} must be a positive number of seconds per cell "
                             "(math.inf for no limit)")
    if scheduler is not None:
        scheduler = check_scheduler_address(scheduler)
    nb_path = find_notebook(notebook)
    nb = read_notebook(nb_path)
    known = declared_parameters(nb)
    if "OUTPUT_DIR" not in known:
        raise ParameterError(f"{nb_path.name} declares no OUTPUT_DIR parameter; a sweep needs it")
    for axis, values in grid.axes.items():
        if not values:
            raise ParameterError(f"axis {axis} has no values; give at least one value")
    points = grid.validated_points(known)
    if not points:
        raise ParameterError("the grid has no points; give every axis at least one value")
    sweep_name = check_sweep_name(name or grid.name or nb_path.stem)
    digest = notebook_digest(nb)
    identities = [point_identity(p, digest) for p in points]
    if len(set(identities)) != len(identities):
        raise ParameterError("the grid has duplicate points; list each value once per axis")
    ids = point_ids(points, list(grid.axes), identities)
    return _Plan(nb_path, known, points, sweep_name, digest, identities, ids, scheduler, float(timeout))


def check_sweep(notebook: str | Path, grid: Grid, *, name: str | None = None, scheduler: str | None = None,
                timeout: float | None = None) -> list[dict]:
    """Every check :func:`run_sweep` makes before it runs anything, and nothing more.

    Writes nothing and connects to nothing (a scheduler address is checked for its form only).

    Args:
        notebook: a path to an ``.ipynb`` or a shipped notebook's name.
        grid: fixed parameters and axes (:class:`Grid`).
        name: the sweep's name (default: the grid's, else the notebook's).
        scheduler: a Dask scheduler address (its form).
        timeout: the per-cell timeout in seconds (None: the default).

    Returns:
        The points the sweep would run, each a dict of parameters.

    Raises:
        ParameterError: as :func:`run_sweep` does.
    """
    return _plan(notebook, grid, name, scheduler, timeout).points


def run_sweep(notebook: str | Path, grid: Grid, *, name: str | None = None, out: str | Path = DEFAULT_OUT,
              workers: int = 1, scheduler: str | None = None, timeout: float | None = None,
              plot_y: str | None = None, progress: bool = True,
              log: Callable[[str], None] = _stderr) -> SweepReport:
    """Run ``notebook`` at every point of ``grid``; everything is validated first.

    Args:
        notebook: a path to an ``.ipynb`` or a shipped notebook's name (``06_capacity_sweep``).
        grid: fixed parameters and axes (:class:`Grid`).
        name: the sweep's folder under ``out`` (default: the grid's name, else the notebook's).
        out: the folder holding sweeps.
        workers: processes of the embedded Dask cluster (ignored with ``scheduler``).
        scheduler: address of an existing Dask scheduler to run the points on
            (``tcp://HOST:PORT``, ``HOST:PORT`` or ``tls://HOST:PORT``).
        timeout: papermill's per-cell timeout in seconds (default
            :data:`~.execute.DEFAULT_CELL_TIMEOUT`, 600; ``math.inf``: no limit). A point whose
            cell runs longer is recorded failed with that reason, and the others go on.
        plot_y: the results column ``sweep.png`` shows (default: the grid's, else the first
            numeric ``results.*`` column).
        progress: show a progress bar driven by completed points.
        log: where messages (rerun reasons, waiting for a lock) go.

    Returns:
        A :class:`SweepReport`. Points that failed are in it, not raised.

    Raises:
        ParameterError: a bad grid, value, notebook, environment variable, output folder or
            cluster, before any point runs.
    """
    plan = _plan(notebook, grid, name, scheduler, timeout)
    nb_path, known, points, sweep_name = plan.nb_path, plan.known, plan.points, plan.sweep_name
    digest, identities, ids, scheduler, timeout = plan.digest, plan.identities, plan.ids, plan.scheduler, plan.timeout
    directory = output_folder(Path(out) / sweep_name)

    from filelock import FileLock
    from tqdm.auto import tqdm

    lock = FileLock(str(directory / ".sweep.lock"))
    _acquire(lock, sweep_name, directory, log)
    try:
        store = PointStore(directory)
        store.clear_leftovers()
        results: list[PointResult | None] = [None] * len(points)
        todo = []
        for i, (pid, ident) in enumerate(zip(ids, identities)):
            results[i], why = store.load(pid, ident, points[i], nb_path.name)
            if results[i] is None:
                todo.append(i)
                if why:
                    log(why)
        bar = tqdm(total=len(points), initial=len(points) - len(todo), desc=sweep_name, unit="point",
                   disable=not progress)
        try:
            if todo:
                _run_points(nb_path, nb_path.read_bytes(), digest, known, [points[i] for i in todo],
                            [ids[i] for i in todo], [identities[i] for i in todo], store, timeout,
                            workers, scheduler, lambda k, r: _finish(results, todo[k], r, bar))
        finally:
            bar.close()
        ordered = [r for r in results if r is not None]
        csv_path = write_csv(directory / "results.csv", ordered)
        plot_path = _plot(directory / "sweep.png", ordered, list(grid.axes), plot_y or grid.plot_y, log)
    finally:
        lock.release()
    return SweepReport(directory, ordered, csv_path, plot_path)


def _finish(results: list, index: int, result: PointResult, bar) -> None:
    results[index] = result
    bar.set_postfix_str(f"{result.point_id}: {result.status}", refresh=False)
    bar.update(1)


def _run_points(nb_path: Path, source: bytes, digest: str, known: set[str], points: Sequence[dict], ids: Sequence[str],
                identities: Sequence[str], store: PointStore, timeout: float | None, workers: int,
                scheduler: str | None, done: Callable[[int, PointResult], None]) -> None:
    import dataclasses

    from .cluster import dask_client, free_slots, run_jobs

    threads = None if scheduler else max(1, (os.cpu_count() or 1) // max(1, workers))
    jobs = [NotebookJob(nb_path.name, source, dict(p), pid, timeout,
                        set_data_dir="DATA_DIR" in known and "DATA_DIR" not in p,
                        gpu=p.get("DEVICE") == "cuda", threads=threads)
            for p, pid in zip(points, ids)]

    def on_done(k: int, execution: Execution | None, failure: str | None) -> None:
        if execution is None:
            execution = Execution(returncode=-1, error=failure, seconds=0.0, worker="", host="")
        done(k, store.save(ids[k], identities[k], points[k], execution, notebook_name=nb_path.name,
                           notebook_digest=digest))

    with dask_client(scheduler, workers, gpu=any(j.gpu for j in jobs)) as client:
        # a warm kernel server pays for itself from a worker's second point on
        several = len(jobs) > free_slots(client, False)
        run_jobs(client, [dataclasses.replace(j, fork=several) for j in jobs], on_done)


def _plot(path: Path, points: Sequence[PointResult], axes: Sequence[str], plot_y: str | None,
          log: Callable[[str], None]) -> Path | None:
    ok = [p for p in points if p.status in ("ok", "done")]
    if not ok or not axes:
        return None
    if plot_y is not None and not any(plot_y in p.results or plot_y in p.params for p in ok):
        columns = sorted({k for p in ok for k in [*p.results, *p.params]})
        log(f"no plot: no point has a column {plot_y!r} (--plot-y / plot_y); its columns are "
            f"{', '.join(columns) or 'none'}")
        return None
    if plot_y is None:
        numeric = [k for k, v in ok[0].results.items()
                   if k.startswith("results.") and isinstance(v, (int, float)) and not isinstance(v, bool)]
        if not numeric:
            log("no plot: the points saved no numeric results.* value (save_results); name a column to plot "
                "with --plot-y")
            return None
        plot_y = numeric[0]
    from graphborrow.studies.plots import sweep_plot

    rows = [{**p.params, **p.results, "status": "ok"} for p in ok]
    fig = sweep_plot(rows, x=axes[0], y=plot_y, hue=axes[1] if len(axes) > 1 else None,
                     title=f"{path.parent.name}: {plot_y}")
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    return write_atomic(path, buffer.getvalue())
