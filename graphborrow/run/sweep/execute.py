"""Run one notebook with papermill in a child process and hand back everything it made.

This is the part of a sweep that runs on a worker, which may be another machine with no
shared file system: the notebook travels in as bytes, runs in a private temporary folder,
and the executed notebook, its results files and papermill's log travel back as bytes
for the client to store. Limits on what comes back: the executed notebook and the results
files together at most ``GRAPHBORROW_MAX_POINT_MB`` MiB (64 by default; figures are what
grows a notebook), papermill's log cut to its last 256 KiB.

The kernel is always the worker's own Python (a kernelspec written for the run), so an
installed graphborrow, not whatever a ``python3`` kernelspec points at, runs the notebook.
``MPLBACKEND`` is removed from the kernel's environment: the kernel then uses the inline
backend and the executed notebook keeps its figures as images.

No orphans: papermill runs in its own session and is killed with its kernel when the
point is cancelled or interrupted, and on Linux it dies with the process that started it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import yaml

from graphborrow.studies.shipped import data_dir

from ..environment import max_point_bytes

__all__ = ["NotebookJob", "Execution", "PointCancelled", "execute", "max_point_bytes", "count_images"]

KERNEL_NAME = "graphborrow-point"
MAX_LOG_BYTES = 256 << 10
RETRY_EXIT_CODES = (138,)  # papermill's "dead kernel"
RETRY_MARKERS = ("ZMQError", "Kernel didn't respond", "Address already in use")

# Started instead of papermill itself: ask Linux to kill this process when the thread that
# started it dies (a worker killed mid-point), then become papermill.
_CHILD = """\
import ctypes, os, signal, sys
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
except (AttributeError, OSError):
    pass
if os.getppid() != int(sys.argv[1]):
    sys.exit(137)  # the parent died before the request took effect
os.execv(sys.executable, [sys.executable, "-m", "papermill"] + sys.argv[2:])
"""


class PointCancelled(Exception):
    """The point's future was cancelled while it ran; papermill and its kernel were killed."""


@dataclass(frozen=True)
class NotebookJob:
    """Everything a worker needs to run one point, with no file shared with the client."""

    notebook_name: str          # file name, e.g. "06_capacity_sweep.ipynb"
    notebook_source: bytes      # the notebook file as the client read it
    params: dict                # checked parameters; OUTPUT_DIR is set by the worker
    label: str                  # the point id, for messages
    timeout: float | None = None          # papermill's per-cell timeout, seconds
    set_data_dir: bool = False            # the notebook declares DATA_DIR and none was given
    gpu: bool = False                     # DEVICE=cuda: asks the cluster for a GPU resource
    threads: int | None = None            # OMP_NUM_THREADS for the kernel, unless already set


@dataclass
class Execution:
    """What one papermill run produced, as bytes, plus where it ran."""

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


def _error_from(notebook: bytes, log: str) -> str:
    """The executed notebook's first error output as ``Name: value``, else the log's last line."""
    try:
        nb = json.loads(notebook) if notebook else {}
        for cell in nb.get("cells", []):
            for out in cell.get("outputs", []):
                if out.get("output_type") == "error":
                    return f"{out.get('ename')}: {out.get('evalue')}"
    except ValueError:
        pass
    lines = [ln for ln in log.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "papermill failed without output"


def _write_kernelspec(folder: Path) -> None:
    spec = folder / "kernels" / KERNEL_NAME
    spec.mkdir(parents=True)
    argv = [sys.executable, *(["-Xfrozen_modules=off"] if sys.version_info >= (3, 11) else []),
            "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(json.dumps(
        {"argv": argv, "display_name": "Python 3 (graphborrow point)", "language": "python"}))


def _kill_tree(proc: subprocess.Popen) -> None:
    """Kill papermill and every process under it (its kernel runs in a session of its own)."""
    try:
        import psutil

        children = psutil.Process(proc.pid).children(recursive=True)
    except Exception:  # psutil missing, or papermill already gone
        children = []
    for child in children:
        try:
            child.kill()
        except Exception:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _wait(proc: subprocess.Popen, should_stop: Callable[[], bool] | None) -> int:
    last_check = time.monotonic()
    while True:
        try:
            return proc.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            if should_stop is not None and time.monotonic() - last_check >= 0.5:
                last_check = time.monotonic()
                if should_stop():
                    _kill_tree(proc)
                    raise PointCancelled("the point was cancelled while it ran") from None
        except BaseException:  # KeyboardInterrupt, SystemExit: take papermill down with us
            _kill_tree(proc)
            raise


def _papermill(cmd: list[str], env: Mapping[str, str], cwd: Path, log_path: Path,
               should_stop: Callable[[], bool] | None) -> tuple[int, str]:
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(os.getpid()), *cmd], stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=dict(env),
                                cwd=cwd, start_new_session=True)
        code = _wait(proc, should_stop)
    data = log_path.read_bytes()
    return code, data[-MAX_LOG_BYTES:].decode(errors="replace")


def execute(job: NotebookJob, *, should_stop: Callable[[], bool] | None = None, worker: str = "local",
            gpu_index: str | None = None, retries: int = 1) -> Execution:
    """Run ``job``'s notebook once (twice when the kernel failed to start) in a temp folder.

    Args:
        job: the notebook and its parameters.
        should_stop: polled about twice a second; True kills papermill and its kernel and
            raises :class:`PointCancelled`.
        worker: the name recorded as the point's worker.
        gpu_index: becomes ``CUDA_VISIBLE_DEVICES`` for the kernel (one GPU per worker).

    Returns:
        The :class:`Execution`; a notebook that raised gives a non-zero ``returncode`` and
        its first error as ``error``, never an exception here.
    """
    start = time.time()
    limit = max_point_bytes()  # a bad setting on this worker fails the point before its notebook runs
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
        cmd = [str(source), str(executed), "-k", KERNEL_NAME, "--cwd", str(tmp), "--no-progress-bar",
               "--log-output", "-y", yaml.safe_dump(params, default_flow_style=True)]
        if job.timeout:
            cmd += ["--execution-timeout", str(int(job.timeout))]
        for _ in range(retries + 1):
            code, log = _papermill(cmd, env, tmp, tmp / "papermill.log", should_stop)
            retry = code in RETRY_EXIT_CODES or any(m in log for m in RETRY_MARKERS)
            if code == 0 or not retry:
                break
        notebook = _restore_kernelspec(executed.read_bytes(), job.notebook_source) if executed.exists() else b""
        results = {f"results/{p.name}": p.read_bytes() for p in sorted(results_dir.glob("*.json"))}
    error = None if code == 0 else _error_from(notebook, log)
    if code != 0 and "No module named papermill" in log:
        error = (f"papermill is not installed for {sys.executable} on {socket.gethostname()}; "
                 "install graphborrow[sweep] there")
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
