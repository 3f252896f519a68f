"""Run your own script, unmodified, on the simulated device: ``python -m graphborrow simulate SCRIPT.py``.

The script runs as ``__main__`` (its folder first on ``sys.path``, as ``python SCRIPT.py`` puts
it) with ``torch.cuda`` installed onto a fresh layout-only simulated H200
(:func:`graphborrow.sim.cuda_api.install`): its ``torch.cuda`` calls, graphs, streams, threads
and ``PYTORCH_CUDA_ALLOC_CONF`` (read at its first CUDA call, as torch reads it) behave as on the
GPU, as far as ``data/fuzz`` shows. When it ends (returning, raising, ``sys.exit``, ``os._exit``
or a SIGTERM, which ends it with status 143 as a shell reports it; after the threads it started
that are not daemons, as an interpreter waits for them; the working directory and environment it
changed are put back), the device's snapshot with the allocator trace is written as a pickle PyTorch's
memory_viz opens, and every graph pool it left is summarised: reserved bytes, idle runs, the
largest run, and which EAGLE verification steps the planner fits into it
(:func:`graphborrow.studies.inspection.inspect_snapshot`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import runpy
import signal
import sys
import tempfile
import threading
import traceback
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from graphborrow.core.errors import ParameterError
from graphborrow.sim import SimBackend
from graphborrow.sim.cuda_api import simulated_cuda
from graphborrow.sim.device import H200_MEMORY, MAX_CAPACITY
from graphborrow.studies.inspection import SnapshotReport, format_report, inspect_snapshot

__all__ = ["H200_MEMORY", "Simulation", "check_capacity", "check_out", "parse_bytes", "simulate_script",
           "simulate_source"]

_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6,
          "gb": 10**9, "tb": 10**12}


def parse_bytes(text: str) -> int:
    """``"80GiB"``, ``"512MiB"``, ``"150109880320"`` -> bytes.

    Raises:
        ParameterError: not a whole number of bytes with a known unit, or not a capacity the
            simulated device can have (:func:`check_capacity`).
    """
    stripped = str(text).strip().lower().replace(" ", "")
    number = stripped.rstrip("abgikmt")
    unit = stripped[len(number):]
    try:
        value = float(number) * _UNITS[unit]
    except (ValueError, KeyError):
        raise ParameterError(f"{text!r} is not a memory size; write bytes or e.g. 80GiB, 512MiB") from None
    if not math.isfinite(value) or value != int(value):
        raise ParameterError(f"{text!r} is not a whole number of bytes; write e.g. 80GiB or 150109880320")
    return check_capacity(int(value), text)


def check_capacity(capacity: int, given=None) -> int:
    """``capacity`` when the simulated device can have it (1 byte to 2**63: its addresses stay in 64 bits).

    Raises:
        ParameterError: it cannot, with the value as given.
    """
    shown = capacity if given is None else given
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
        raise ParameterError(f"capacity {shown!r}: the device needs a positive whole number of bytes, e.g. 80GiB")
    if capacity > MAX_CAPACITY:
        raise ParameterError(f"capacity {shown!r}: the simulated device holds at most 2**63 bytes (its addresses "
                             "must stay below 2**64); give less, e.g. 141GB")
    return capacity


def check_out(out: str | os.PathLike) -> Path:
    """The absolute folder for the snapshot, made if missing: resolved now, so a script that
    changes directory still writes where it was asked.

    Raises:
        ParameterError: ``out`` is a file, or cannot be made or written to.
    """
    folder = Path(out).expanduser().absolute()
    if folder.exists() and not folder.is_dir():
        raise ParameterError(f"--out {str(out)!r} is a file; give a folder for the snapshot")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ParameterError(f"--out {str(out)!r} cannot be made ({exc.strerror}); give a folder you can write to") \
            from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ParameterError(f"--out {str(out)!r} is not writable; give a folder you can write to")
    return folder


@dataclasses.dataclass
class Simulation:
    """What :func:`simulate_script` found: the snapshot (written, and in memory), one report per
    graph pool, the script's error (None when it ran to the end) and the exit status it asked for
    (``sys.exit(n)`` / ``os._exit(n)``; None when it asked for none)."""

    script: str
    snapshot_path: Path
    reports: list[SnapshotReport]
    error: Optional[str]
    device: str
    snapshot: dict = dataclasses.field(repr=False, default_factory=dict)
    exit_status: Optional[int] = None

    @property
    def status(self) -> int:
        """The process's exit status on a GPU: the one asked for, 1 after an exception, else 0."""
        if self.exit_status is not None:
            return self.exit_status
        return 1 if self.error else 0

    def summary(self) -> str:
        lines = [f"{self.script} on the {self.device}",
                 f"snapshot (open it at https://pytorch.org/memory_viz): {self.snapshot_path}"]
        if self.error:
            lines.append(f"the script stopped with: {self.error}")
        if not self.reports:
            lines.append("no CUDA graph pool: the script captured no graph (the default pool is in the snapshot)")
        for report in self.reports:
            lines += ["", format_report(report)]
        return "\n".join(lines)


class _ProcessExit(BaseException):
    """``os._exit`` (or a SIGTERM) inside the script: the snapshot is taken where it happened."""

    def __init__(self, status: int, snapshot: dict, cause: str) -> None:
        super().__init__(status)
        self.status, self.snapshot, self.cause = status, snapshot, cause


def simulate_script(script: str | os.PathLike, args: Sequence[str] = (), capacity: int = H200_MEMORY,
                    out: str | os.PathLike = "output/simulate", backed: bool = False,
                    batches: Sequence[int] = (1, 4, 16, 32, 64), draft_tokens: Sequence[int] = (4, 8),
                    vocab: int = 128256,
                    at_process_exit: Optional[Callable[["Simulation"], None]] = None) -> Simulation:
    """Run ``script`` as ``__main__`` on a fresh simulated device and report its graph pools.

    Args:
        script: the Python file (it sees ``sys.argv == [script, *args]``).
        args: its command-line arguments.
        capacity: device memory in bytes (an H200's by default).
        out: folder for the snapshot pickle (resolved before the script runs).
        backed: real bytes behind every segment (slow for large models; default layout only).
        batches, draft_tokens, vocab: the verification steps to plan against each graph pool.
        at_process_exit: when the script calls ``os._exit(n)``: None stops the script there (the
            snapshot is the device at that call; the script's ``finally`` blocks still run as the
            stop unwinds it) and returns; a function ends the process as ``os._exit`` does, after
            calling it with the :class:`Simulation` (the command line prints its summary).

    Returns:
        A :class:`Simulation`; the script's own exception, if any, is in ``error``.

    Raises:
        FileNotFoundError: ``script`` does not exist.
        ParameterError: ``capacity`` or ``out`` is unusable (checked before the script runs).
    """
    path = Path(script)
    if not path.is_file():
        raise FileNotFoundError(f"no script {str(script)!r}; give the path of a Python file to run")
    path = path.absolute()
    folder = check_out(out)
    snapshot_path = folder / f"{path.stem}_snapshot.pickle"
    if snapshot_path.is_dir():
        raise ParameterError(f"{snapshot_path} is a folder; the snapshot is written there as a file")
    backend = SimBackend(capacity=check_capacity(capacity), backed=backed, config=None, activate=False)

    def finish(snapshot: dict, error: Optional[str], status: Optional[int]) -> Simulation:
        private = sorted({tuple(s["segment_pool_id"]) for s in snapshot["segments"]} - {(0, 0)})
        reports = [inspect_snapshot(snapshot, batches=batches, draft_tokens=draft_tokens, vocab=vocab, pool_id=pool)
                   for pool in private]
        return Simulation(str(script), snapshot_path, reports, error, backend.describe(), snapshot, status)

    def process_exit(status: int = 0, cause: Optional[str] = None) -> None:
        snapshot = backend.dump_snapshot(snapshot_path)
        cause = cause or (None if status == 0 else f"os._exit({status})")
        if at_process_exit is None:
            raise _ProcessExit(status, snapshot, cause)
        at_process_exit(finish(snapshot, cause, status))
        real_exit(status)

    def terminated(signum: int, _frame) -> None:  # the process would end here: the device as it is now
        process_exit(128 + signum, f"terminated by {signal.Signals(signum).name}")

    saved = sys.argv, list(sys.path), os.getcwd(), dict(os.environ)
    real_exit, error, status, snapshot = os._exit, None, None, None
    try:
        with simulated_cuda(backend) as sim:
            torch.cuda.memory._record_memory_history(max_entries=1_000_000)
            sys.argv = [str(script), *args]
            sys.path.insert(0, str(path.parent))
            namespace: dict = {}
            os._exit = process_exit
            main = threading.current_thread() is threading.main_thread()
            old_term = signal.signal(signal.SIGTERM, terminated) if main else None
            try:
                namespace = runpy.run_path(str(path), run_name="__main__")
            except SystemExit as exc:
                status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
                if status:
                    error = f"SystemExit({exc.code})"
            except _ProcessExit as exc:
                status, snapshot, error = exc.status, exc.snapshot, exc.cause
            except Exception as exc:  # the script's own failure is part of the answer
                error = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            finally:
                os._exit = real_exit
                if main:
                    signal.signal(signal.SIGTERM, old_term)
                sys.argv, sys.path[:] = saved[0], saved[1]
            if snapshot is None:
                for thread in list(sim.threads):  # as the interpreter waits for them before it exits
                    if not thread.daemon and thread.is_alive():
                        thread.join()
                snapshot = backend.dump_snapshot(snapshot_path)  # the script's globals are still alive here
            namespace.clear()
    finally:  # what the script's own process would have taken with it
        os.chdir(saved[2])
        if dict(os.environ) != saved[3]:
            os.environ.clear()
            os.environ.update(saved[3])
        backend.close()
    return finish(snapshot, error, status)


def simulate_source(source: str, name: str = "script", **kwargs) -> Simulation:
    """:func:`simulate_script` for code given as text (a notebook cell's string).

    Args:
        source: the Python source of a script written for a GPU.
        name: the script's file name stem (the snapshot is ``<out>/<name>_snapshot.pickle``).
        **kwargs: passed to :func:`simulate_script`.

    Returns:
        The :class:`Simulation`.
    """
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"{name}.py"
        path.write_text(source)
        return simulate_script(path, **kwargs)
