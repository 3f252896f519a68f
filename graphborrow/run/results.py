"""Results files: what each notebook (or sweep point) measured, as JSON.

Every notebook ends with ``save(name, results, OUTPUT_DIR)`` (as ``graphborrow.save_results``). The file
records how many device allocations the run made (``device_work``), so a guard
(:func:`check_results`) can tell a notebook that really ran on the device from one that
skipped its work. Reading and checking results does not import torch.
"""

from __future__ import annotations

import json
import math
import platform
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Iterable, Mapping

from graphborrow.core.atomicfile import write_atomic

__all__ = ["save", "load", "load_all", "flatten", "path_for", "device_allocations", "check_results", "check_figures",
           "FIGURE_TAG", "SCHEMA"]

SCHEMA = 1

# Cells that draw a figure carry this tag; an executed notebook must hold an image for each.
FIGURE_TAG = "figure"
_IMAGE_KINDS = ("image/png", "image/jpeg", "image/svg+xml")


def _torch_version() -> str | None:
    torch = sys.modules.get("torch")
    if torch is not None:
        return torch.__version__
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def device_allocations(backend) -> int:
    """Allocations the backend's allocator has made so far (torch's cumulative counter)."""
    stats = backend.memory_stats()
    return int(stats.get("allocation.all.allocated", 0))


def _plain(value: Any) -> Any:
    """JSON-able copy: tuples to lists, tensors and numpy scalars to numbers, NaN to None."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_plain(v) for v in value]
    torch = sys.modules.get("torch")  # a tensor can only exist if torch is imported
    if torch is not None and isinstance(value, torch.Tensor):
        return _plain(value.detach().cpu().tolist())
    if hasattr(value, "item") and callable(value.item) and not isinstance(value, (str, bytes)):
        return _plain(value.item())
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, Path):
        return str(value)
    raise TypeError(
        f"cannot store a {type(value).__name__} in a results file; convert it to a number, "
        "string, list or dict first"
    )


def path_for(name: str, output_dir: str | Path = "results") -> Path:
    """Where ``save(name, ..., output_dir)`` writes."""
    return Path(output_dir) / f"{name}.json"


def save(
    name: str,
    data: Mapping[str, Any],
    output_dir: str | Path = "results",
    *,
    backend=None,
    device_work: int | None = None,
) -> Path:
    """Write ``output_dir/<name>.json`` holding ``data`` plus run metadata.

    Pass the ``backend`` the run used (its allocation counter becomes ``device_work``), or
    ``device_work`` directly; with neither, ``torch.cuda``'s counter is read (the GPU, or the
    simulated device :func:`graphborrow.use_device` installed). A run that made no device
    allocation is refused here already.
    """
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"results name must be a plain file stem like '01_free_runs', got {name!r}")
    if device_work is None and backend is None:
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available():
            from graphborrow.device import get_backend  # torch is imported already: reading results does not

            backend = get_backend("auto")  # the device torch.cuda is
    if device_work is None:
        if backend is None:
            raise ValueError(
                "save() needs backend= (the backend the notebook used), device_work= (allocations made "
                "on the device) or a CUDA device (graphborrow.use_device) so the guard can tell the work ran"
            )
        device_work = device_allocations(backend)
    if int(device_work) <= 0:
        raise ValueError(
            f"results {name!r} show no device work (device_work={device_work}); the run "
            "skipped everything it was meant to measure"
        )
    record = {
        "name": name,
        "schema": SCHEMA,
        "device_work": int(device_work),
        "device": backend.describe() if backend is not None else None,
        "backend": backend.name if backend is not None else None,
        "torch": _torch_version(),
        "python": platform.python_version(),
        "finished_at": time.time(),
        "results": _plain(data),
    }
    return write_atomic(path_for(name, output_dir), json.dumps(record, indent=2, sort_keys=False) + "\n")


def load(name_or_path: str | Path, output_dir: str | Path = "results") -> dict:
    """Read a results file back (the whole record: metadata plus ``results``)."""
    path = Path(name_or_path)
    if path.suffix != ".json":
        path = path_for(str(name_or_path), output_dir)
    if not path.exists():
        raise FileNotFoundError(f"no results file at {path}; run the notebook that writes it first")
    return json.loads(path.read_text())


def load_all(output_dir: str | Path = "results") -> dict[str, dict]:
    """Every results file in ``output_dir`` by name."""
    return {p.stem: json.loads(p.read_text()) for p in sorted(Path(output_dir).glob("*.json"))}


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Scalar leaves of nested dicts as ``a.b.c`` keys (lists are skipped): one CSV row."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, name + "."))
        elif isinstance(value, (str, int, float, bool)) or value is None:
            out[name] = value
    return out


def check_results(names: Iterable[str], results_dir: str | Path, since: float | None = None) -> list[str]:
    """Problems with the results files the named notebooks should have written, one line each.

    Args:
        names: notebook stems (``01_free_runs``); each must have written ``<name>.json``.
        results_dir: the folder they wrote to.
        since: a Unix time; files finished before it are stale (left by an earlier run).

    Returns:
        Empty when every notebook wrote a readable record showing device work.
    """
    results_dir = Path(results_dir)
    problems = []
    for name in names:
        path = results_dir / f"{name}.json"
        if not path.exists():
            problems.append(f"{name}: no results file {path} (did the notebook run to the end?)")
            continue
        try:
            record = json.loads(path.read_text())
        except ValueError as exc:
            problems.append(f"{name}: {path} is not valid JSON ({exc})")
            continue
        if not isinstance(record, dict):
            problems.append(f"{name}: {path} holds a {type(record).__name__}, not a results record")
            continue
        work = record.get("device_work")
        if not isinstance(work, int) or isinstance(work, bool) or work <= 0:
            problems.append(f"{name}: device_work={work!r}; the notebook did no device work")
        finished = record.get("finished_at")
        if since is not None and not (isinstance(finished, (int, float)) and finished >= since):
            problems.append(f"{name}: {path} is stale (written before this run started)")
    return problems


def check_figures(notebook: Mapping | str | Path, name: str = "notebook") -> list[str]:
    """Problems with the figures of an executed notebook, one line each.

    Every code cell tagged :data:`FIGURE_TAG` must have produced an image output, and no
    output may be a figure shown as text ("<Figure size 900x240 with 1 Axes>", which is what
    a reader sees when the inline backend is not on or the figure was not displayed).

    Args:
        notebook: the executed notebook (path, JSON text or parsed dict).
        name: how messages call it.

    Returns:
        Empty when every tagged cell shows its figure.
    """
    if isinstance(notebook, Path) or (isinstance(notebook, str) and not notebook.lstrip().startswith("{")):
        notebook = Path(notebook).read_text()
    nb = json.loads(notebook) if isinstance(notebook, str) else notebook
    problems = []
    tagged = 0
    for index, cell in enumerate(nb.get("cells", [])):
        if cell.get("cell_type") != "code":
            continue
        outputs = cell.get("outputs", [])
        for out in outputs:
            text = out.get("data", {}).get("text/plain", "")
            text = "".join(text) if isinstance(text, list) else text
            if text.startswith("<Figure size") and not any(k in out.get("data", {}) for k in _IMAGE_KINDS):
                problems.append(f"{name}: cell {index} shows a figure as text ({text.strip()[:60]}); "
                                "run %matplotlib inline in the first code cell and end the cell with the figure")
        if FIGURE_TAG in cell.get("metadata", {}).get("tags", []):
            tagged += 1
            if not any(k in out.get("data", {}) for out in outputs for k in _IMAGE_KINDS):
                problems.append(f"{name}: cell {index} is tagged {FIGURE_TAG!r} but produced no image "
                                "(did it run, and does it end with the figure?)")
    return problems
