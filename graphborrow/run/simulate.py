"""Run your own script, unmodified, on the simulated device: ``python -m graphborrow simulate SCRIPT.py``.

The script runs as ``__main__`` with ``cuda`` mapped onto a layout-only simulated H200
(:func:`graphborrow.sim.cuda_api.simulated_cuda`): its ``torch.cuda`` calls, graphs, streams
and ``PYTORCH_CUDA_ALLOC_CONF`` behave as on the GPU, as far as ``data/fuzz`` shows. When it
ends, the device's snapshot (with the allocator trace) is written as a pickle PyTorch's
memory_viz opens, and every graph pool it left is summarised: reserved bytes, idle runs, the
largest run, and which EAGLE verification steps the planner fits into it
(:func:`graphborrow.studies.inspection.inspect_snapshot`).
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import runpy
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Optional, Sequence

import torch

from graphborrow.core.errors import ParameterError
from graphborrow.sim import SimBackend
from graphborrow.sim.cuda_api import simulated_cuda
from graphborrow.studies.inspection import SnapshotReport, format_report, inspect_snapshot

__all__ = ["H200_MEMORY", "Simulation", "parse_bytes", "simulate_script", "simulate_source"]

H200_MEMORY = 150_109_880_320  # torch.cuda.mem_get_info()[1] on the H200 that recorded data/fuzz
_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9}


def parse_bytes(text: str) -> int:
    """``"80GiB"``, ``"512MiB"``, ``"150109880320"`` -> bytes.

    Raises:
        ParameterError: not a positive size with a known unit.
    """
    stripped = str(text).strip().lower().replace(" ", "")
    number = stripped.rstrip("abgikm")
    unit = stripped[len(number):]
    try:
        value = float(number) * _UNITS[unit]
    except (ValueError, KeyError):
        raise ParameterError(f"{text!r} is not a memory size; write bytes or e.g. 80GiB, 512MiB") from None
    if value <= 0:
        raise ParameterError(f"{text!r}: the device needs a positive capacity")
    return int(value)


@dataclasses.dataclass
class Simulation:
    """What :func:`simulate_script` found: the snapshot it wrote, one report per graph pool, the
    script's error (None when it ran to the end)."""

    script: str
    snapshot_path: Path
    reports: list[SnapshotReport]
    error: Optional[str]
    device: str

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


def simulate_script(script: str | os.PathLike, args: Sequence[str] = (), capacity: int = H200_MEMORY,
                    out: str | os.PathLike = "output/simulate", backed: bool = False,
                    batches: Sequence[int] = (1, 4, 16, 32, 64), draft_tokens: Sequence[int] = (4, 8),
                    vocab: int = 128256) -> Simulation:
    """Run ``script`` as ``__main__`` on a fresh simulated device and report its graph pools.

    Args:
        script: the Python file (it sees ``sys.argv == [script, *args]``).
        args: its command-line arguments.
        capacity: device memory in bytes (an H200's by default).
        out: folder for the snapshot pickle.
        backed: real bytes behind every segment (slow for large models; default layout only).
        batches, draft_tokens, vocab: the verification steps to plan against each graph pool.

    Returns:
        A :class:`Simulation`; the script's own exception, if any, is in ``error``.

    Raises:
        FileNotFoundError: ``script`` does not exist.
    """
    path = Path(script)
    if not path.is_file():
        raise FileNotFoundError(f"no script {str(script)!r}; give the path of a Python file to run")
    config = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or None
    backend = SimBackend(capacity=int(capacity), backed=backed, config=config, activate=False)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    snapshot_path = out / f"{path.stem}_snapshot.pickle"
    saved_argv, error = sys.argv, None
    try:
        with simulated_cuda(backend):
            torch.cuda.memory._record_memory_history(max_entries=1_000_000)
            sys.argv = [str(path), *args]
            namespace: dict = {}
            try:
                namespace = runpy.run_path(str(path), run_name="__main__")
            except SystemExit as exc:
                if exc.code not in (0, None):
                    error = f"SystemExit({exc.code})"
            except Exception as exc:  # the script's own failure is part of the answer
                error = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            finally:
                sys.argv = saved_argv
            snapshot = torch.cuda.memory._snapshot()  # the script's globals are still alive here
            namespace.clear()
        with open(snapshot_path, "wb") as f:
            pickle.dump(snapshot, f, protocol=4)
    finally:
        backend.close()
    private = sorted({tuple(s["segment_pool_id"]) for s in snapshot["segments"]} - {(0, 0)})
    reports = [inspect_snapshot(snapshot_path, batches=batches, draft_tokens=draft_tokens, vocab=vocab, pool_id=pool)
               for pool in private]
    return Simulation(str(script), snapshot_path, reports, error, backend.describe())


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
