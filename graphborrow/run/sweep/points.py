"""Sweep points on disk: what identifies a point, and how a finished one is stored.

A point's *identity* is a hash of every parameter it runs with and of the notebook's code,
so a rerun after a parameter or the notebook changed runs the point again instead of
reporting stale results as done. Its folder name is readable (the axes' values) and is
only a name: the identity is stored inside and checked.

Layout of one sweep (``<out>/<sweep>/``)::

    <point-id>/<notebook>.ipynb     the executed notebook
    <point-id>/papermill.log        the run's log: the kernel's output, the cells' printed output, why it
                                    stopped (the end of it, for long logs)
    <point-id>/results/*.json       what the notebook saved with graphborrow.run.results.save
    <point-id>/point.json           status, error, parameters, identity, worker, host, file hashes,
                                    and a checksum of the record itself
    _superseded/<point-id>-<id8>/   a finished point whose parameters or notebook changed since
    results.csv  sweep.png          one row per point; the summary plot

A point folder is assembled under a temporary name and renamed into place, with
``point.json`` written last. On a rerun the whole point is verified before it counts as
done: the record's own checksum, the type of every field, its identity recomputed from the
parameters it lists (they must be the point's), the hash of every file it lists, and no file
it does not list. A point that fails any check is named and run again; a finished point whose
parameters or notebook changed is run again and its earlier folder kept under
``_superseded/``, never deleted.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import math
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

SCHEMA = 3
STATUSES = ("ok", "failed", "done")  # done: completed by an earlier sweep and still valid
SUPERSEDED = "_superseded"  # finished points whose parameters or notebook changed, kept
RECORD = "point.json"
CHECKSUM = "record_sha256"


def notebook_digest(nb) -> str:
    """Hash of the notebook's code cells, in order (outputs and markdown do not count).

    Args:
        nb: the notebook node (``nbformat``).

    Returns:
        The SHA-256 in hex.
    """
    h = hashlib.sha256()
    for cell in nb.cells:
        if cell.get("cell_type") == "code":
            h.update(cell.source.encode())
            h.update(b"\0cell\0")
    return h.hexdigest()


def _canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def _computed(params: Mapping[str, Any]) -> dict:
    """The parameters that decide what a point computes (not the runner's folders)."""
    return {k: v for k, v in params.items() if k not in PATH_PARAMETERS}


def point_identity(params: Mapping[str, Any], digest: str) -> str:
    """Hash of every parameter except the runner's folders, plus the notebook digest.

    Args:
        params: the point's parameters.
        digest: :func:`notebook_digest` of the notebook.

    Returns:
        The SHA-256 in hex: equal for two points exactly when they compute the same thing.
    """
    return hashlib.sha256(_canonical_json({"params": _computed(params), "notebook": digest}).encode()).hexdigest()


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

    Args:
        points: each point's parameters.
        axes: the swept parameters, whose values make the name.
        identities: each point's :func:`point_identity`.

    Returns:
        One folder name per point, in order, all different.
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


def _record_checksum(info: Mapping[str, Any]) -> str:
    """The hash of a point record's every field but the checksum itself."""
    return _sha256(_canonical_json({k: v for k, v in info.items() if k != CHECKSUM}).encode())


def _is_digest(value: Any) -> bool:
    return isinstance(value, str) and re.fullmatch(r"[0-9a-f]{64}", value) is not None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# Every field of point.json and what it must hold; a record with any other field, or without
# one of these, is not one this version wrote.
_FIELDS = {
    "schema": lambda v: v == SCHEMA,
    "point_id": lambda v: isinstance(v, str),
    "identity": _is_digest,
    "notebook": lambda v: isinstance(v, str),
    "notebook_digest": _is_digest,
    "params": lambda v: isinstance(v, dict) and all(isinstance(k, str) for k in v),
    "status": lambda v: v in ("ok", "failed"),
    "error": lambda v: v is None or isinstance(v, str),
    "seconds": lambda v: _is_number(v) and v >= 0,
    "returncode": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "worker": lambda v: isinstance(v, str),
    "host": lambda v: isinstance(v, str),
    "finished_at": _is_number,
    "files": lambda v: isinstance(v, dict) and all(isinstance(k, str) and _is_digest(d) for k, d in v.items()),
    CHECKSUM: _is_digest,
}


def _record_problem(info: Any) -> str | None:
    """What is wrong with a parsed point.json as a record, or None."""
    if not isinstance(info, dict):
        return f"holds a {type(info).__name__}, not a point record"
    if info.get("schema") != SCHEMA:
        return "is from another version of graphborrow"
    missing = [k for k in _FIELDS if k not in info]
    extra = [k for k in info if k not in _FIELDS]
    if missing or extra:
        return f"lacks {missing} or has unknown fields {extra}"
    if info[CHECKSUM] != _record_checksum(info):
        return "was edited or damaged (its checksum does not match its contents)"
    wrong = [k for k, ok in _FIELDS.items() if not ok(info[k])]
    if wrong:
        return f"holds values of the wrong kind in {', '.join(wrong)}"
    if point_identity(info["params"], info["notebook_digest"]) != info["identity"]:
        return "lists parameters its identity was not computed from"
    if info["status"] == "ok" and (info["returncode"] != 0 or info["error"] is not None):
        return "says ok but records an error or a non-zero return code"
    return None


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

    def load(self, point_id: str, identity: str, params: Mapping[str, Any] | None = None,
             notebook_name: str | None = None) -> tuple[PointResult | None, str | None]:
        """A finished, intact, still-valid point, or (None, why it must run again).

        The whole point is verified (see the module docstring); nothing in it is trusted
        before that.

        Args:
            point_id: the point's folder name.
            identity: what :func:`point_identity` gives for the point's parameters and the
                notebook as it is now.
            params: the point's parameters; a record listing others is not this point.
            notebook_name: the notebook's file name; a record of another notebook is not this point.

        Returns:
            ``(result, None)`` for a point to reuse (status "done"); ``(None, None)`` for a
            point never run; otherwise ``(None, why)``, ``why`` naming the file and the
            problem, or saying that the parameters or the notebook changed, or that the
            point failed before.
        """
        folder = self.directory / point_id
        marker = folder / RECORD
        if not marker.exists():
            return None, None
        try:
            info = json.loads(marker.read_text())
        except (OSError, ValueError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            return None, f"{marker} is damaged (not readable JSON: {exc}); running it again"
        problem = _record_problem(info)
        if problem is not None:
            return None, f"{marker} {problem}; running {folder.name} again"
        if info["identity"] != identity:
            return None, (f"{folder} was run with other parameters or another version of the notebook; running "
                          f"it again (a finished run moves to {self._superseded_path(point_id, info['identity'])})")
        if params is not None and _canonical_json(_computed(info["params"])) != _canonical_json(_computed(params)):
            return None, f"{marker} lists parameters other than this point's; running {folder.name} again"
        if info["point_id"] != point_id or (notebook_name is not None and info["notebook"] != notebook_name):
            return None, f"{marker} describes another point ({info['point_id']} of {info['notebook']}); running it again"
        if info["status"] != "ok":
            return None, f"{folder.name} failed last time ({info['error']}); running it again"
        results, problem = self._verified_files(folder, info["files"])
        if problem is not None:
            return None, problem
        return PointResult(point_id, info["params"], "done", None, info["seconds"], results,
                           info["worker"], info["host"]), None

    def _verified_files(self, folder: Path, files: Mapping[str, str]) -> tuple[dict, str | None]:
        """The results columns of a point's files, after checking each against its hash, or a problem."""
        results_files: dict[str, bytes] = {}
        for rel, digest in files.items():
            if Path(rel).is_absolute() or ".." in Path(rel).parts:
                return {}, f"{folder / RECORD} is damaged (lists {rel!r} outside the point); running {folder.name} again"
            path = folder / rel
            try:
                data = path.read_bytes()
            except OSError:
                return {}, f"{path} is missing; running {folder.name} again"
            if _sha256(data) != digest:
                return {}, f"{path} is damaged (its contents changed since the point ran); running {folder.name} again"
            if rel.startswith("results/"):
                results_files[rel] = data
        listed = set(files) | {RECORD}
        unlisted = sorted(rel for rel in (str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
                          if rel not in listed and not any(part.startswith(".") for part in Path(rel).parts))
        if unlisted:
            return {}, f"{folder} holds {unlisted[0]}, which its record does not list; running {folder.name} again"
        try:
            results = _results_columns(results_files)
        except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            return {}, f"a results file of {folder.name} is not readable ({exc}); running it again"
        if not results:
            return {}, f"{folder.name} has no results file; running it again"
        return results, None

    def _superseded_path(self, point_id: str, identity: str) -> Path:
        return self.directory / SUPERSEDED / f"{point_id}-{identity[:8]}"

    def _finished_run(self, folder: Path) -> str | None:
        """The identity of the intact, finished point in ``folder`` (whatever its parameters), else None."""
        try:
            info = json.loads((folder / RECORD).read_text())
        except (OSError, ValueError):
            return None
        if _record_problem(info) is not None or info["status"] != "ok":
            return None
        return info["identity"]

    def save(self, point_id: str, identity: str, params: Mapping[str, Any], execution, *,
             notebook_name: str, notebook_digest: str) -> PointResult:
        """Store one execution (from a worker, possibly on another machine) as a point folder.

        A finished point already in the folder with another identity (its parameters or the
        notebook changed) is moved under ``_superseded/``; any other earlier copy is replaced.

        Args:
            point_id: the folder name.
            identity: :func:`point_identity` of ``params`` and ``notebook_digest``.
            params: the parameters the point ran with.
            execution: a :class:`~graphborrow.run.sweep.execute.Execution`.
            notebook_name: the notebook's file name.
            notebook_digest: :func:`notebook_digest` of the notebook that ran.

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
            "notebook_digest": notebook_digest, "params": json.loads(_canonical_json(dict(params))),
            "status": status, "error": error, "seconds": round(float(execution.seconds), 3),
            "returncode": int(execution.returncode), "worker": str(execution.worker), "host": str(execution.host),
            "finished_at": time.time(), "files": {rel: _sha256(data) for rel, data in files.items()},
        }
        info[CHECKSUM] = _record_checksum(info)
        staging = self.directory / f".point-{uuid.uuid4().hex[:12]}"
        for rel, data in files.items():
            write_atomic(staging / rel, data)
        write_atomic(staging / RECORD, json.dumps(info, indent=2) + "\n")
        final = self.directory / point_id
        if final.exists():
            earlier = self._finished_run(final)
            if earlier is not None and earlier != identity:
                kept = self._superseded_path(point_id, earlier)
                shutil.rmtree(kept, ignore_errors=True)  # the same earlier run, kept before
                kept.parent.mkdir(exist_ok=True)
                final.rename(kept)
            else:
                retired = self.directory / f".point-{uuid.uuid4().hex[:12]}-old"
                final.rename(retired)
                shutil.rmtree(retired, ignore_errors=True)
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
