"""Run one notebook with papermill, in this process, and hand back everything it made.

This is the part of a sweep that runs on a worker, which may be another machine with no
shared file system: the notebook travels in as bytes, runs in a private temporary folder,
and the executed notebook, its results files and its log travel back as bytes for the
client to store. Limits on what comes back: the executed notebook and the results files
together at most ``GRAPHBORROW_MAX_POINT_MB`` MiB (64 by default; figures are what grows a
notebook), the log cut to its last 256 KiB.

Papermill runs in the calling thread (no papermill process per point) on a kernel of its
own: a new process for every run, forked from a warm kernel server when one can serve it
(:mod:`graphborrow.run.kernels`), else started from scratch. The kernel is always the
worker's own Python (a kernelspec written for the run), so an installed graphborrow, not
whatever a ``python3`` kernelspec points at, runs the notebook. ``MPLBACKEND`` is removed
from the kernel's environment: the kernel then uses the inline backend and the executed
notebook keeps its figures as images. The log holds the kernel's own output and the cells'
printed output, then, for a run that did not finish, the reason.

No orphans: a cancelled or interrupted point's kernel is killed at once, and kernels die
with the process that started them.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import sys
import tempfile
import threading
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from graphborrow.studies.shipped import data_dir

from .. import kernels
from ..environment import max_point_bytes

__all__ = ["NotebookJob", "Execution", "PointCancelled", "execute", "max_point_bytes", "count_images",
           "DEFAULT_CELL_TIMEOUT"]

KERNEL_NAME = "graphborrow-point"
# A sweep's limit on one cell when none is given: a point of the shipped notebooks runs in well
# under a minute, so a cell still running after ten is hung, and its sweep should go on without it.
DEFAULT_CELL_TIMEOUT = 600.0
MAX_LOG_BYTES = 256 << 10
DEAD_KERNEL = 138  # papermill's exit status for a kernel that died
RETRY_EXIT_CODES = (DEAD_KERNEL,)
RETRY_MARKERS = ("ZMQError", "Kernel didn't respond", "Address already in use")

class PointCancelled(Exception):
    """The point's future was cancelled while it ran; papermill and its kernel were killed."""


@dataclass(frozen=True)
class NotebookJob:
    """Everything a worker needs to run one point, with no file shared with the client."""

    notebook_name: str          # file name, e.g. "06_capacity_sweep.ipynb"
    notebook_source: bytes      # the notebook file as the client read it
    params: dict                # checked parameters; OUTPUT_DIR is set by the worker
    label: str                  # the point id, for messages
    timeout: float | None = None          # papermill's per-cell timeout, seconds (None or inf: no limit)
    set_data_dir: bool = False            # the notebook declares DATA_DIR and none was given
    gpu: bool = False                     # DEVICE=cuda: asks the cluster for a GPU resource
    threads: int | None = None            # OMP_NUM_THREADS for the kernel, unless already set
    fork: bool = True                     # may fork its kernel from a warm server: the process runs several


@dataclass
class Execution:
    """What one papermill run produced, as bytes, plus where it ran (``returncode`` 0: every
    cell ran; 1: the notebook failed; 138: its kernel died)."""

    returncode: int
    error: str | None
    seconds: float
    notebook: bytes = b""
    results: dict[str, bytes] = field(default_factory=dict)  # "results/<name>.json" -> bytes
    log: str = ""
    worker: str = "local"
    host: str = field(default_factory=socket.gethostname)


def count_images(notebook: bytes) -> int:
    """Image outputs (PNG, JPEG, SVG) in an executed notebook: its figures."""
    try:
        nb = json.loads(notebook) if notebook else {}
    except ValueError:
        return 0
    kinds = ("image/png", "image/jpeg", "image/svg+xml")
    return sum(any(k in out.get("data", {}) for k in kinds)
               for cell in nb.get("cells", []) for out in cell.get("outputs", []))


def _cell_seconds(timeout: float | None) -> int | None:
    """Papermill's per-cell limit (whole seconds, at least 1); None for no limit."""
    return None if timeout is None or math.isinf(timeout) else max(1, math.ceil(timeout))


def _reason(exc: BaseException, job: NotebookJob) -> str:
    """Why papermill stopped, in one line: a cell's timeout said as such, else the exception's first line."""
    from nbclient.exceptions import CellTimeoutError

    if isinstance(exc, CellTimeoutError):
        return (f"a cell ran longer than the per-cell timeout of {_cell_seconds(job.timeout)} s (CellTimeoutError); "
                "raise it with --timeout (run_sweep's timeout=)")
    first = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {first[0]}" if first else type(exc).__name__


def _error_from(notebook: bytes, log: str) -> str:
    """The executed notebook's first error output as ``Name: value``, else the log's last line
    that is not a separator."""
    try:
        nb = json.loads(notebook) if notebook else {}
        for cell in nb.get("cells", []):
            for out in cell.get("outputs", []):
                if out.get("output_type") == "error":
                    return f"{out.get('ename')}: {out.get('evalue')}"
    except ValueError:
        pass
    lines = [ln for ln in log.strip().splitlines() if ln.strip() and set(ln.strip()) - set("-=")]
    return lines[-1] if lines else "papermill failed without output"


def _write_kernelspec(folder: Path) -> None:
    spec = folder / "kernels" / KERNEL_NAME
    spec.mkdir(parents=True)
    argv = [sys.executable, *(["-Xfrozen_modules=off"] if sys.version_info >= (3, 11) else []),
            "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(json.dumps(
        {"argv": argv, "display_name": "Python 3 (graphborrow point)", "language": "python"}))


class _Canceller:
    """Polls ``should_stop`` about twice a second while a notebook runs; kills its kernel when it says so."""

    def __init__(self, should_stop: Callable[[], bool] | None):
        self.should_stop, self.km, self.fired = should_stop, None, False
        self._done = threading.Event()
        if should_stop is not None:
            threading.Thread(target=self._watch, name="graphborrow-point-cancel", daemon=True).start()

    def _watch(self) -> None:
        while not self._done.wait(0.5):
            if self.should_stop():
                self.fired = True
                self.kill()
                return

    def kill(self) -> None:
        if self.km is not None:
            kernels.kill_kernel(self.km)

    def done(self) -> None:
        self._done.set()


def _settle_cancelled_tasks() -> None:
    """Let the tasks a stopped cell left behind finish on this thread's event loop.

    nbclient cancels its output poll when a cell times out, but the loop stops before the
    cancellation runs; the task is then destroyed pending ("Task was destroyed but it is
    pending!" on stderr). Everything on this loop belonged to that notebook client.
    """
    import asyncio

    from jupyter_core.utils import ensure_event_loop

    loop = ensure_event_loop()
    if loop.is_running():
        return
    pending = [task for task in asyncio.all_tasks(loop) if not task.done()]
    for task in pending:
        task.cancel()
    if pending:
        loop.run_until_complete(asyncio.wait(pending, timeout=5))


def _engine() -> str:
    """Papermill's nbclient engine, on a kernel manager the caller started and nbclient stops."""
    from papermill.clientwrap import PapermillNotebookClient
    from papermill.engines import NBClientEngine, papermill_engines
    from papermill.log import logger

    class Engine(NBClientEngine):
        @classmethod
        def execute_managed_notebook(cls, nb_man, kernel_name, log_output=False, stdout_file=None,
                                     stderr_file=None, start_timeout=60, execution_timeout=None, **kwargs):
            client = PapermillNotebookClient(
                nb_man, km=kwargs["km"], timeout=execution_timeout, startup_timeout=start_timeout,
                kernel_name=kernel_name, log=logger, log_output=log_output, stdout_file=stdout_file,
                stderr_file=stderr_file, shutdown_kernel="immediate")
            try:
                return client.execute(cleanup_kc=True)  # kills the kernel and closes the channels
            except BaseException:
                _settle_cancelled_tasks()
                raise

    papermill_engines.register("graphborrow", Engine)
    return "graphborrow"


@contextmanager
def _papermill_messages(text) -> Iterator[None]:
    """Papermill's own messages from this thread (an unknown parameter, ...) go to the run's log."""
    from papermill.log import logger

    handler = logging.StreamHandler(text)
    thread = threading.get_ident()
    handler.addFilter(lambda record: record.thread == thread)
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)


def _papermill(source: Path, executed: Path, params: dict, job: NotebookJob, tmp: Path, env: Mapping[str, str],
               log_path: Path, should_stop: Callable[[], bool] | None) -> tuple[int, str, str | None]:
    """Run papermill once on a new kernel; (its status, the log, why it stopped unless a cell raised)."""
    import papermill
    from nbclient.exceptions import DeadKernelError
    from papermill.exceptions import PapermillExecutionError

    cancel, km, reason = _Canceller(should_stop), None, None
    with open(log_path, "ab") as log, open(log_path, "a", encoding="utf-8", errors="replace") as text, \
            _papermill_messages(text):
        try:
            warm = job.fork and not job.gpu and kernels.wants_warm_kernel(job.notebook_source)
            km, how = kernels.start_kernel([str(tmp / "jupyter" / "kernels")], KERNEL_NAME, cwd=tmp, env=env,
                                           log=log, runtime_dir=tmp / "runtime", fork=warm)
            cancel.km = km
            text.write(f"kernel {km.provisioner.pid}: {how}\n")
            text.flush()
            if cancel.fired:
                cancel.kill()
            papermill.execute_notebook(
                str(source), str(executed), parameters=params, engine_name=_engine(), kernel_name=KERNEL_NAME,
                progress_bar=False, stdout_file=text, stderr_file=text, start_timeout=60,
                execution_timeout=_cell_seconds(job.timeout), km=km)
            code = 0
        except PapermillExecutionError:
            code = 1  # a cell raised: the executed notebook holds the error
        except BaseException as exc:  # noqa: BLE001 - the kernel died, a cell timed out, Ctrl-C
            text.write(traceback.format_exc())
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            code = DEAD_KERNEL if isinstance(exc, DeadKernelError) else 1
            reason = _reason(exc, job)
        finally:
            cancel.done()
            if km is not None and km.has_kernel:  # nbclient did not get to stop it
                kernels.stop_kernel(km)
    if cancel.fired:
        raise PointCancelled("the point was cancelled while it ran")
    data = log_path.read_bytes()
    return code, data[-MAX_LOG_BYTES:].decode(errors="replace"), reason


def execute(job: NotebookJob, *, should_stop: Callable[[], bool] | None = None, worker: str = "local",
            gpu_index: str | None = None, retries: int = 1) -> Execution:
    """Run ``job``'s notebook once (twice when the kernel failed to start) in a temp folder.

    Args:
        job: the notebook and its parameters.
        should_stop: polled about twice a second; True kills the notebook's kernel and raises
            :class:`PointCancelled`.
        worker: the name recorded as the point's worker.
        gpu_index: becomes ``CUDA_VISIBLE_DEVICES`` for the kernel (one GPU per worker).

    Returns:
        The :class:`Execution`; a notebook that raised gives a non-zero ``returncode`` and
        its first error as ``error``, never an exception here.
    """
    start = time.time()
    limit = max_point_bytes()  # a bad setting on this worker fails the point before its notebook runs
    try:
        import papermill  # noqa: F401
    except ImportError:
        return Execution(1, f"papermill is not installed for {sys.executable} on {socket.gethostname()}; "
                         "install graphborrow[sweep] there", time.time() - start, worker=worker)
    with tempfile.TemporaryDirectory(prefix="graphborrow-point-") as tmp_name:
        tmp = Path(tmp_name)
        source = tmp / "input" / job.notebook_name
        source.parent.mkdir()
        source.write_bytes(job.notebook_source)
        executed = tmp / job.notebook_name
        results_dir = tmp / "results"
        params: dict[str, Any] = {**job.params, "OUTPUT_DIR": str(results_dir)}
        if job.set_data_dir:
            params["DATA_DIR"] = str(data_dir())
        _write_kernelspec(tmp / "jupyter")
        (tmp / "runtime").mkdir()
        env = {k: v for k, v in os.environ.items() if k != "MPLBACKEND"}
        env.update(PYTHONUNBUFFERED="1", JUPYTER_RUNTIME_DIR=str(tmp / "runtime"),
                   JUPYTER_PATH=os.pathsep.join(filter(None, [str(tmp / "jupyter"), env.get("JUPYTER_PATH")])))
        if job.threads and "OMP_NUM_THREADS" not in env:
            env["OMP_NUM_THREADS"] = str(job.threads)
        if gpu_index is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu_index
        for _ in range(retries + 1):
            code, log, reason = _papermill(source, executed, params, job, tmp, env, tmp / "papermill.log",
                                           should_stop)
            retry = code in RETRY_EXIT_CODES or any(m in log for m in RETRY_MARKERS)
            if code == 0 or not retry:
                break
        notebook = _restore_kernelspec(executed.read_bytes(), job.notebook_source) if executed.exists() else b""
        results = {f"results/{p.name}": p.read_bytes() for p in sorted(results_dir.glob("*.json"))}
    error = None if code == 0 else (reason or _error_from(notebook, log))
    size = len(notebook) + sum(map(len, results.values()))
    if size > limit:
        code, notebook, results = (code or 1), b"", {}
        error = (f"the executed notebook and results are {size / 2**20:.1f} MiB, more than the "
                 f"{limit / 2**20:.0f} MiB one point may send back; make its figures smaller or raise "
                 "GRAPHBORROW_MAX_POINT_MB on the workers")
    return Execution(code, error, time.time() - start, notebook, results, log, worker)


def _restore_kernelspec(executed: bytes, original: bytes) -> bytes:
    """Give the executed notebook back the kernelspec it came with (not the run's own)."""
    try:
        nb, src = json.loads(executed), json.loads(original)
    except ValueError:
        return executed
    spec = src.get("metadata", {}).get("kernelspec")
    if spec is None:
        nb.get("metadata", {}).pop("kernelspec", None)
    else:
        nb.setdefault("metadata", {})["kernelspec"] = spec
    return (json.dumps(nb, indent=1, ensure_ascii=False) + "\n").encode()
