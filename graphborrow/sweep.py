"""Parameter sweeps over a notebook with papermill: one CLI subprocess per point.

    python -m graphborrow sweep 06_capacity_sweep --grid notebooks/sweep_example.yaml
    python -m graphborrow sweep 02_borrowing -p batch_size 1,8,32 -p draft_tokens 4,8

Each point runs in ``runs/<sweep>/<point-id>/`` (output notebook, log, results JSON,
``point.json`` with status and error). A rerun skips points already completed; a failing
point is recorded and the others still run. At the end the points are aggregated into
``results.csv`` and ``sweep.png``. Every value is checked against :data:`PARAMETERS`
before anything runs.
"""

from __future__ import annotations

import csv
import hashlib
import itertools
import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import yaml

from .errors import ParameterError
from .listsyntax import split_top_level
from .results import flatten

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
DEFAULT_RUNS = Path("runs")
RETRY_EXIT_CODES = (138,)  # papermill's "dead kernel"
RETRY_MARKERS = ("ZMQError", "Kernel didn't respond", "Address already in use")


@dataclass(frozen=True)
class Range:
    """Numbers in ``[lo, hi]``; ``integer`` rejects fractions; ``none_ok`` allows None."""

    lo: float
    hi: float
    integer: bool = True
    none_ok: bool = False

    def check(self, name: str, value: Any) -> None:
        if value is None and self.none_ok:
            return
        kind = "an integer" if self.integer else "a number"
        ok_type = isinstance(value, int) if self.integer else isinstance(value, (int, float))
        if isinstance(value, bool) or not ok_type:
            raise ParameterError(f"{name}={value!r} must be {kind} in [{self.lo}, {self.hi}]")
        if not self.lo <= value <= self.hi:
            raise ParameterError(f"{name}={value!r} is out of range; allowed: {self.lo} to {self.hi}")

    def describe(self) -> str:
        return f"{self.lo}..{self.hi}" + (" or None" if self.none_ok else "")


@dataclass(frozen=True)
class Choice:
    values: tuple

    def check(self, name: str, value: Any) -> None:
        if value not in self.values:
            raise ParameterError(f"{name}={value!r} is not allowed; choose one of {list(self.values)}")

    def describe(self) -> str:
        return "|".join(map(str, self.values))


@dataclass(frozen=True)
class IntList:
    """A non-empty list of integers, each in ``[lo, hi]`` (e.g. a captured batch ladder)."""

    lo: int
    hi: int

    def check(self, name: str, value: Any) -> None:
        if not isinstance(value, (list, tuple)) or not value:
            raise ParameterError(f"{name}={value!r} must be a non-empty list of integers in [{self.lo}, {self.hi}]")
        for v in value:
            if isinstance(v, bool) or not isinstance(v, int) or not self.lo <= v <= self.hi:
                raise ParameterError(
                    f"{name} entry {v!r} is out of range; allowed: integers {self.lo} to {self.hi}")

    def describe(self) -> str:
        return f"[{self.lo}..{self.hi}, ...]"


class Text:
    def check(self, name: str, value: Any) -> None:
        if not isinstance(value, str) or not value:
            raise ParameterError(f"{name}={value!r} must be a non-empty string")

    def describe(self) -> str:
        return "text"


# Every notebook parameter a sweep may set, in one place (notebooks spell them in upper case).
PARAMETERS: dict[str, Any] = {
    "DEVICE": Choice(("auto", "cuda", "sim")),
    "OUTPUT_DIR": Text(),
    "SEED": Range(0, 2**31 - 1),
    "HIDDEN": Range(16, 32768),
    "INTERMEDIATE": Range(16, 131072),
    "LAYERS": Range(1, 256),
    "VOCAB": Range(16, 1_048_576),
    "LADDER": IntList(1, 4096),
    "PREFILL_TOKENS": Range(1, 131072),
    "BATCH_SIZE": Range(1, 4096),
    "BATCH_SIZES": IntList(1, 4096),
    "DRAFT_TOKENS": Range(1, 64),
    "DRAFT_TOKENS_LIST": IntList(1, 64),
    "TOPK": Range(1, 16),
    "FIT_POLICY": Choice(("best", "first")),
    "RUN_POLICY": Choice(("runs", "whole_segments")),
    "MODE": Choice(("standard", "lean", "chunked")),
    "CHUNK_ROWS": Range(1, 1 << 24, none_ok=True),
    "TEMPERATURE": Range(1e-3, 100.0, integer=False),
    "TOP_K": Range(1, 1_048_576, none_ok=True),
    "TOP_P": Range(1e-6, 1.0, integer=False, none_ok=True),
    "SAMPLES": Range(1, 10_000_000),
    "LAYOUT_ONLY": Choice((True, False)),
    "SWEEP_DIR": Text(),
    "DATA_DIR": Text(),
}


def canonical(name: str) -> str:
    """The notebook spelling of a parameter name (``batch_size`` -> ``BATCH_SIZE``)."""
    return name.strip().upper()


def validate(params: Mapping[str, Any], known: Iterable[str] | None = None) -> dict[str, Any]:
    """Check names and values; return them with canonical names. Raises ParameterError."""
    known = set(known) if known is not None else None
    out = {}
    for raw, value in params.items():
        name = canonical(raw)
        if name not in PARAMETERS:
            raise ParameterError(
                f"unknown parameter {raw!r}; sweepable parameters: {', '.join(sorted(PARAMETERS))}")
        if known is not None and name not in known:
            raise ParameterError(
                f"parameter {name} is not declared in the notebook's parameters cell; "
                f"it declares {', '.join(sorted(known)) or 'nothing'}")
        PARAMETERS[name].check(name, value)
        out[name] = value
    return out


def parse_value(text: str) -> Any:
    """One CLI value: YAML scalar or list (``8``, ``0.9``, ``best``, ``[64, 32]``, ``null``)."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ParameterError(f"cannot read value {text!r}: {exc}") from exc


def parse_cli_values(text: str) -> list:
    """``1,2,4`` -> [1, 2, 4]; a bracketed list stays one value: ``[64,32]`` -> [[64, 32]]."""
    return [parse_value(part) for part in split_top_level(text)]


def _is_axis(name: str, value: Any) -> bool:
    """A YAML list is an axis, except a flat list of ints for a list-valued parameter."""
    if not isinstance(value, list):
        return False
    list_valued = isinstance(PARAMETERS.get(name), IntList)
    return not (list_valued and all(isinstance(v, int) for v in value))


@dataclass
class Grid:
    """Fixed parameters plus axes; points are the cartesian product of the axes."""

    axes: dict[str, list] = field(default_factory=dict)
    fixed: dict[str, Any] = field(default_factory=dict)
    name: str | None = None
    notebook: str | None = None
    plot_y: str | None = None  # the results column the summary plot shows

    @classmethod
    def from_yaml(cls, path: str | Path) -> "Grid":
        """Either ``{name?, notebook?, plot_y?, parameters?: {...}, grid: {...}}`` or a plain
        mapping where list values are axes and scalars are fixed."""
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"grid file {path} does not exist")
        data = yaml.safe_load(path.read_text()) or {}
        if not isinstance(data, dict):
            raise ParameterError(f"{path}: a grid file must be a mapping of parameter -> values")
        if "grid" in data:
            grid = cls(name=data.get("name"), notebook=data.get("notebook"), plot_y=data.get("plot_y"),
                       fixed={canonical(k): v for k, v in (data.get("parameters") or {}).items()})
            items = (data["grid"] or {}).items()
        else:
            grid, items = cls(), data.items()
        for key, value in items:
            if _is_axis(canonical(key), value):
                grid.axes[canonical(key)] = value
            else:
                grid.fixed[canonical(key)] = value
        return grid

    def add_cli(self, pairs: Sequence[Sequence[str]]) -> None:
        for name, text in pairs:
            values = parse_cli_values(text)
            if len(values) == 1:
                self.fixed[canonical(name)] = values[0]
                self.axes.pop(canonical(name), None)
            else:
                self.axes[canonical(name)] = values
                self.fixed.pop(canonical(name), None)

    def points(self) -> list[dict[str, Any]]:
        names = list(self.axes)
        combos = itertools.product(*(self.axes[n] for n in names)) if names else [()]
        return [{**self.fixed, **dict(zip(names, combo))} for combo in combos]


def point_id(params: Mapping[str, Any], axes: Iterable[str]) -> str:
    """A stable directory name from the swept values (hash suffix when it gets long)."""
    parts = []
    for name in axes:
        value = params[name]
        text = "-".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
        parts.append(f"{name.lower()}={text}")
    slug = re.sub(r"[^A-Za-z0-9=._-]+", "_", "_".join(parts)) or "default"
    if len(slug) > 90:
        digest = hashlib.sha1(json.dumps(dict(params), sort_keys=True, default=str).encode()).hexdigest()
        slug = slug[:80] + "-" + digest[:8]
    return slug


def resolve_notebook(name: str | Path) -> Path:
    """A path, or a name under notebooks/ (``06``, ``06_capacity_sweep``, with or without .ipynb)."""
    path = Path(name)
    if path.suffix == ".ipynb" and path.exists():
        return path.resolve()
    stem = path.name.removesuffix(".ipynb")
    matches = sorted(NOTEBOOKS.glob(f"{stem}.ipynb")) or sorted(NOTEBOOKS.glob(f"{stem}_*.ipynb"))
    if len(matches) == 1:
        return matches[0]
    available = ", ".join(p.stem for p in sorted(NOTEBOOKS.glob("*.ipynb")))
    raise FileNotFoundError(f"no single notebook matches {name!r}; available: {available or 'none'}")


def declared_parameters(notebook: Path) -> set[str]:
    """Names assigned in the notebook's cell tagged ``parameters``."""
    import nbformat

    nb = nbformat.read(notebook, as_version=4)
    cells = [c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    if len(cells) != 1:
        raise ParameterError(f"{notebook.name} must have exactly one cell tagged 'parameters', has {len(cells)}")
    return set(re.findall(r"^([A-Za-z_][A-Za-z0-9_]*)\s*(?::[^=]*)?=", cells[0].source, re.M))


@dataclass
class PointResult:
    point_id: str
    params: dict
    status: str            # "ok", "failed", "skipped" (completed in an earlier run)
    error: str | None = None
    seconds: float = 0.0
    results: dict = field(default_factory=dict)


def _error_from(output_nb: Path, log: str) -> str:
    """The notebook's first error output as ``Name: value``, else the log's last line."""
    try:
        import nbformat

        nb = nbformat.read(output_nb, as_version=4)
        for cell in nb.cells:
            for out in cell.get("outputs", []):
                if out.get("output_type") == "error":
                    return f"{out.get('ename')}: {out.get('evalue')}"
    except Exception:
        pass
    lines = [ln for ln in log.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "papermill failed without output"


def run_notebook(notebook: Path, out_dir: Path, params: Mapping[str, Any], *,
                 timeout: float | None = None, retries: int = 1,
                 env: Mapping[str, str] | None = None) -> tuple[int, str, Path]:
    """Run one papermill subprocess; return (exit code, log text, output notebook path)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    output_nb = out_dir / notebook.name
    cmd = [sys.executable, "-m", "papermill", str(notebook), str(output_nb),
           "-k", "python3", "--cwd", str(notebook.parent), "--no-progress-bar", "--log-output",
           "-y", yaml.safe_dump(dict(params), default_flow_style=True)]
    if timeout:
        cmd += ["--execution-timeout", str(int(timeout))]
    run_env = {**os.environ, "MPLBACKEND": "Agg", "PYTHONUNBUFFERED": "1", **(env or {})}
    for attempt in range(retries + 1):
        proc = subprocess.run(cmd, capture_output=True, text=True, env=run_env)
        log = proc.stdout + proc.stderr
        retry = proc.returncode in RETRY_EXIT_CODES or any(m in log for m in RETRY_MARKERS)
        if proc.returncode == 0 or not retry:
            break
    (out_dir / "papermill.log").write_text(log)
    return proc.returncode, log, output_nb


def _run_point(notebook: Path, point_dir: Path, pid: str, params: dict,
               timeout: float | None) -> PointResult:
    results_dir = point_dir / "results"
    params = {**params, "OUTPUT_DIR": str(results_dir.resolve())}
    start = time.time()
    code, log, output_nb = run_notebook(notebook, point_dir, params, timeout=timeout)
    seconds = time.time() - start
    results = {}
    for path in sorted(results_dir.glob("*.json")):
        results.update(flatten(json.loads(path.read_text())))
    if code == 0 and results:
        status, error = "ok", None
    elif code == 0:
        status, error = "failed", "the notebook finished but wrote no results file"
    else:
        status, error = "failed", _error_from(output_nb, log)
    result = PointResult(pid, params, status, error, seconds, results)
    (point_dir / "point.json").write_text(json.dumps(
        {"point_id": pid, "params": params, "status": status, "error": error,
         "seconds": round(seconds, 3), "returncode": code}, indent=2, default=str) + "\n")
    return result


def _completed(point_dir: Path) -> PointResult | None:
    marker = point_dir / "point.json"
    if not marker.exists():
        return None
    info = json.loads(marker.read_text())
    if info.get("status") != "ok":
        return None
    results = {}
    for path in sorted((point_dir / "results").glob("*.json")):
        results.update(flatten(json.loads(path.read_text())))
    if not results:
        return None
    return PointResult(info["point_id"], info["params"], "skipped", None, 0.0, results)


@dataclass
class SweepReport:
    directory: Path
    points: list[PointResult]
    csv_path: Path
    plot_path: Path | None

    @property
    def failed(self) -> list[PointResult]:
        return [p for p in self.points if p.status == "failed"]

    def summary(self) -> str:
        counts = {s: sum(p.status == s for p in self.points) for s in ("ok", "skipped", "failed")}
        lines = [f"{len(self.points)} points: {counts['ok']} ran, {counts['skipped']} already done, "
                 f"{counts['failed']} failed", f"table: {self.csv_path}"]
        if self.plot_path:
            lines.append(f"plot:  {self.plot_path}")
        lines += [f"FAILED {p.point_id}: {p.error}" for p in self.failed]
        return "\n".join(lines)


def sweep(notebook: str | Path, grid: Grid, *, name: str | None = None,
          runs_dir: str | Path = DEFAULT_RUNS, jobs: int = 1, timeout: float | None = None,
          plot_y: str | None = None, progress: bool = True) -> SweepReport:
    """Run ``notebook`` at every grid point; validate everything first."""
    nb_path = resolve_notebook(notebook)
    known = declared_parameters(nb_path)
    points = grid.points()
    axes = list(grid.axes)
    for p in points:
        validate(p, known)
    if "OUTPUT_DIR" not in known:
        raise ParameterError(f"{nb_path.name} declares no OUTPUT_DIR parameter; a sweep needs it")
    points = [validate(p) for p in points]
    sweep_name = name or grid.name or nb_path.stem
    directory = Path(runs_dir) / sweep_name
    directory.mkdir(parents=True, exist_ok=True)
    ids = [point_id(p, axes) for p in points]
    if len(set(ids)) != len(ids):
        raise ParameterError("the grid has duplicate points; list each value once per axis")

    from tqdm.auto import tqdm

    bar = tqdm(total=len(points), desc=sweep_name, unit="point", disable=not progress)
    out: dict[str, PointResult] = {}

    def one(pid: str, params: dict) -> PointResult:
        done = _completed(directory / pid)
        result = done or _run_point(nb_path, directory / pid, pid, params, timeout)
        bar.update(1)
        bar.set_postfix_str(f"{pid}: {result.status}")
        return result

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        for result in pool.map(lambda a: one(*a), zip(ids, points)):
            out[result.point_id] = result
    bar.close()
    ordered = [out[i] for i in ids]
    csv_path = write_csv(directory / "results.csv", ordered)
    plot_path = _plot(directory / "sweep.png", ordered, axes, plot_y)
    return SweepReport(directory, ordered, csv_path, plot_path)


def write_csv(path: Path, points: Sequence[PointResult]) -> Path:
    rows = []
    for p in points:
        row = {"point_id": p.point_id, "status": "ok" if p.status in ("ok", "skipped") else p.status,
               "error": p.error or ""}
        row.update({k: (json.dumps(v) if isinstance(v, (list, dict)) else v)
                    for k, v in p.params.items() if k != "OUTPUT_DIR"})
        row.update(p.results)
        rows.append(row)
    columns = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    return path


def read_csv(path: str | Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _plot(path: Path, points: Sequence[PointResult], axes: Sequence[str], plot_y: str | None) -> Path | None:
    ok = [p for p in points if p.status in ("ok", "skipped")]
    if not ok or not axes:
        return None
    if plot_y is None:
        numeric = [k for k, v in ok[0].results.items()
                   if k.startswith("results.") and isinstance(v, (int, float)) and not isinstance(v, bool)]
        if not numeric:
            return None
        plot_y = numeric[0]
    from .plots import sweep_plot

    rows = [{**{k: v for k, v in p.params.items()}, **p.results, "status": "ok"} for p in ok]
    fig = sweep_plot(rows, x=axes[0], y=plot_y, hue=axes[1] if len(axes) > 1 else None,
                     title=f"{path.parent.name}: {plot_y}")
    fig.savefig(path, dpi=110)
    return path
