"""Sweep points on disk: what identifies a point, and how a finished one is stored.

A point's *identity* is a hash of every parameter it runs with and of the notebook's code,
so a rerun after a parameter or the notebook changed runs the point again instead of
reporting stale results as done. Its folder name is readable (the axes' values) and is
only a name: the identity is stored inside and checked.

Layout of one sweep (``<out>/<sweep>/``)::

    <point-id>/<notebook>.ipynb     the executed notebook
    <point-id>/papermill.log        papermill's output (the end of it, for long logs)
    <point-id>/results/*.json       what the notebook saved with graphborrow.run.results.save
    <point-id>/point.json           status, error, parameters, identity, worker, host, file hashes
    results.csv  sweep.png          one row per point; the summary plot

A point folder is assembled under a temporary name and renamed into place, with
``point.json`` written last; on a rerun each file is checked against the hash recorded for
it, and a point whose files are missing or damaged is named and run again.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import re
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from graphborrow.core.atomicfile import write_atomic

from ..results import flatten
from .parameters import PATH_PARAMETERS

__all__ = [
    "PointResult", "PointStore", "notebook_digest", "point_identity", "point_ids", "write_csv", "read_csv",
]

SCHEMA = 2
STATUSES = ("ok", "failed", "done")  # done: completed by an earlier sweep and still valid


def notebook_digest(nb) -> str:
    """Hash of the notebook's code cells, in order (outputs and markdown do not count)."""
    h = hashlib.sha256()
    for cell in nb.cells:
        if cell.get("cell_type") == "code":
            h.update(cell.source.encode())
            h.update(b"\0cell\0")
    return h.hexdigest()


def _canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def point_identity(params: Mapping[str, Any], digest: str) -> str:
    """Hash of every parameter except the runner's folders, plus the notebook digest."""
    kept = {k: v for k, v in params.items() if k not in PATH_PARAMETERS}
    return hashlib.sha256(_canonical_json({"params": kept, "notebook": digest}).encode()).hexdigest()


def _slug(params: Mapping[str, Any], axes: Iterable[str]) -> str:
    parts = []
    for name in axes:
        value = params[name]
        text = "-".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
        parts.append(f"{name.lower()}={text}")
    return re.sub(r"[^A-Za-z0-9=._-]+", "_", "_".join(parts)) or "default"


def point_ids(points: Sequence[Mapping[str, Any]], axes: Sequence[str], identities: Sequence[str]) -> list[str]:
    """Readable folder names from the swept values, unique per identity.

    A name gets the identity's first 8 hex digits when it is long or when two different
    points would otherwise share it (values that differ only in characters a folder name
    cannot hold).
    """
    slugs = [_slug(p, axes) for p in points]
    counts: dict[str, int] = {}
    for s in slugs:
        counts[s] = counts.get(s, 0) + 1
    out = []
    for s, ident in zip(slugs, identities):
        if len(s) > 90 or counts[s] > 1:
            s = s[:80] + "-" + ident[:8]
        out.append(s)
    return out


@dataclass
class PointResult:
    """One point of a sweep as the report and ``results.csv`` show it."""

    point_id: str
    params: dict
    status: str                      # "ok", "failed", or "done" (valid from an earlier sweep)
    error: str | None = None
    seconds: float = 0.0
    results: dict = field(default_factory=dict)  # flattened results, "results.x" columns
    worker: str = ""
    host: str = ""
    note: str | None = None          # why an earlier copy was not reused (damaged, changed)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _results_columns(files: Mapping[str, bytes]) -> dict:
    """Flattened contents of the results files; ValueError names a file that is not a record."""
    out: dict = {}
    for name in sorted(files):
        record = json.loads(files[name])
        if not isinstance(record, dict):
            raise ValueError(f"{name} holds a {type(record).__name__}, not a results record")
        out.update(flatten(record))
    return out


class PointStore:
    """The folder of one sweep: reads finished points back, stores new ones atomically."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)

    def clear_leftovers(self) -> None:
        """Remove half-assembled point folders an interrupted sweep left (call under the lock)."""
        for tmp in self.directory.glob(".point-*"):
            shutil.rmtree(tmp, ignore_errors=True)

    def load(self, point_id: str, identity: str) -> tuple[PointResult | None, str | None]:
        """A finished, intact, still-valid point, or (None, why it must run again).

        ``why`` is None for a point never run; otherwise it names the file and the damage,
        or says the parameters or the notebook changed, or that the point failed before.
        """
        folder = self.directory / point_id
        marker = folder / "point.json"
        if not marker.exists():
            return None, None
        try:
            info = json.loads(marker.read_text())
            if not isinstance(info, dict) or info.get("schema") != SCHEMA:
                return None, f"{marker} is from another version of graphborrow; running it again"
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return None, f"{marker} is damaged (not valid JSON: {exc}); running it again"
        if info.get("identity") != identity:
            return None, f"{folder} was run with other parameters or another version of the notebook; running it again"
        if info.get("status") != "ok":
            return None, f"{folder.name} failed last time ({info.get('error')}); running it again"
        files = info.get("files")
        if not isinstance(files, dict) or not isinstance(info.get("params"), dict):
            return None, f"{marker} is damaged (no file list or parameters); running {folder.name} again"
        results_files: dict[str, bytes] = {}
        for rel, digest in files.items():
            if Path(rel).is_absolute() or ".." in Path(rel).parts:
                return None, f"{marker} is damaged (lists {rel!r} outside the point); running {folder.name} again"
            path = folder / rel
            try:
                data = path.read_bytes()
            except OSError:
                return None, f"{path} is missing; running {folder.name} again"
            if _sha256(data) != digest:
                return None, f"{path} is damaged (its contents changed since the point ran); running {folder.name} again"
            if rel.startswith("results/"):
                results_files[rel] = data
        try:
            results = _results_columns(results_files)
        except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            return None, f"a results file of {folder.name} is not readable ({exc}); running it again"
        if not results:
            return None, f"{folder.name} has no results file; running it again"
        return PointResult(point_id, info["params"], "done", None, info.get("seconds", 0.0), results,
                           info.get("worker", ""), info.get("host", "")), None

    def save(self, point_id: str, identity: str, params: Mapping[str, Any], execution, *,
             notebook_name: str) -> PointResult:
        """Store one execution (from a worker, possibly on another machine) as a point folder.

        Args:
            execution: a :class:`~graphborrow.run.sweep.execute.Execution`.

        Returns:
            The point as the report shows it: "ok" only when the notebook finished and saved
            at least one readable results file.
        """
        status, error = ("ok", None) if execution.returncode == 0 else ("failed", execution.error)
        results: dict = {}
        if status == "ok":
            try:
                results = _results_columns(execution.results)
            except ValueError as exc:
                status, error = "failed", f"the notebook wrote a results file that is not readable ({exc})"
            if status == "ok" and not results:
                status, error = "failed", "the notebook finished but wrote no results file"
        files = dict(execution.results)
        if execution.notebook:
            files[notebook_name] = execution.notebook
        files["papermill.log"] = execution.log.encode()
        info = {
            "schema": SCHEMA, "point_id": point_id, "identity": identity, "notebook": notebook_name,
            "params": dict(params), "status": status, "error": error, "seconds": round(execution.seconds, 3),
            "returncode": execution.returncode, "worker": execution.worker, "host": execution.host,
            "finished_at": time.time(), "files": {rel: _sha256(data) for rel, data in files.items()},
        }
        staging = self.directory / f".point-{uuid.uuid4().hex[:12]}"
        for rel, data in files.items():
            write_atomic(staging / rel, data)
        write_atomic(staging / "point.json", json.dumps(info, indent=2, default=str) + "\n")
        final = self.directory / point_id
        if final.exists():
            retired = self.directory / f".point-{uuid.uuid4().hex[:12]}-old"
            final.rename(retired)
            staging.rename(final)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            staging.rename(final)
        return PointResult(point_id, dict(params), status, error, execution.seconds, results,
                           execution.worker, execution.host)


def _cell(value: Any) -> Any:
    return json.dumps(value) if isinstance(value, (list, dict)) else value


def write_csv(path: str | Path, points: Sequence[PointResult]) -> Path:
    """One row per point: id, status, error, worker, host, seconds, parameters, results.

    Written atomically, so a reader never sees half a table.

    Args:
        path: where the CSV goes.
        points: the sweep's points, in the order the rows should have.

    Returns:
        The path written.
    """
    rows = []
    for p in points:
        row = {"point_id": p.point_id, "status": "ok" if p.status in ("ok", "done") else p.status,
               "error": p.error or "", "worker": p.worker, "host": p.host, "seconds": round(p.seconds, 3)}
        row.update({k: _cell(v) for k, v in p.params.items() if k not in PATH_PARAMETERS})
        row.update(p.results)
        rows.append(row)
    columns = list(dict.fromkeys(k for r in rows for k in r)) or ["point_id", "status", "error", "worker", "host"]
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns)
    writer.writeheader()
    writer.writerows(rows)
    return write_atomic(path, buffer.getvalue())


def read_csv(path: str | Path) -> list[dict[str, str]]:
    """The rows of a sweep's ``results.csv`` (all values as text, as csv gives them).

    Args:
        path: the CSV file.

    Returns:
        One dict per row, column name to text.
    """
    with open(path, newline="") as f:
        return list(csv.DictReader(f))
