"""Replay a folder of recorded traces and keep the agreement of each run: ``python -m graphborrow replay-corpus``.

The differential corpus (``data/traces/corpus``) and the wrapped-trace corpus
(``data/traces/wrapped``) are folders of ``_snapshot()`` pickles recorded on a GPU. Replaying
all of them gives one row per trace (agreement, checks, the checks that could not be made
and why, the first mismatch, CPU time) and their distribution in bands (1.0, [0.99, 1),
[0.9, 0.99), below 0.9, refused). :func:`record_run` adds a run under a label to a JSON file
that keeps one entry per labelled run: the agreement before and after each change of the model.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Callable, Iterable

from graphborrow.core.atomicfile import write_atomic

from .replay import load_trace, replay_trace

__all__ = ["BANDS", "STATS_DISAGREE", "check_record", "current_commit", "default_corpus", "record_run", "replay_corpus",
           "replay_file", "strip_frames", "summarize", "trace_files"]

BANDS = (("1.0", 1.0, 1.01), ("[0.99, 1)", 0.99, 1.0), ("[0.9, 0.99)", 0.9, 0.99), ("< 0.9", -1.0, 0.9))
# every check agreed, but the recorded memory_stats() did not: not counted as 1.0
STATS_DISAGREE = "1.0, statistics disagree"
_CHECKOUT = Path(__file__).resolve().parents[2]


def default_corpus() -> Path:
    """The checkout's differential corpus (``data/traces/corpus`` beside the package), wherever the
    command runs from; ``data/traces/corpus`` under the current folder for an installed package."""
    shipped = _CHECKOUT / "data" / "traces" / "corpus"
    return shipped if shipped.is_dir() else Path("data/traces/corpus")


def strip_frames(snapshot: dict) -> dict:
    """``snapshot`` (a ``_snapshot()`` dict) without its stack frames, as a corpus stores it; returns it.

    Args:
        snapshot: changed in place: segments' and blocks' ``frames`` emptied, trace entries' dropped.

    Returns:
        The same dict.
    """
    for segment in snapshot.get("segments", []):
        segment["frames"] = []
        for block in segment.get("blocks", []):
            block["frames"] = []
    for trace in snapshot.get("device_traces", []):
        for entry in trace:
            entry.pop("frames", None)
    return snapshot


def trace_files(folder: Path, only: Iterable[str] | None = None) -> list[Path]:
    """The traces (``*.pickle.gz``, ``*.pickle``) in ``folder``, by name; with ``only``, those named.

    Args:
        folder: the corpus folder.
        only: trace names (the file name before its first dot) to keep.

    Returns:
        The paths, sorted.

    Raises:
        FileNotFoundError: the folder does not exist or holds no trace (of those named).
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder of traces; pass --corpus with the folder that holds "
                                f"the *.pickle.gz traces (the checkout's corpus is {default_corpus().resolve()})")
    paths = sorted(p for p in folder.iterdir() if p.name.endswith((".pickle.gz", ".pickle")))
    if only is not None:
        wanted = {name.strip() for name in only if name.strip()}
        paths = [p for p in paths if p.name.split(".")[0] in wanted]
    if not paths:
        raise FileNotFoundError(f"no traces (*.pickle.gz, *.pickle){' of those named' if only else ''} in {folder}")
    return paths


def replay_file(path: Path) -> dict:
    """Replay one trace file; its row. A file the reader cannot read as a trace (junk, truncated, code
    in a pickle) gets ``unreadable`` and the reason, a trace the replay refuses gets ``refused``, and
    the corpus goes on.

    Args:
        path: a ``_snapshot()`` pickle, gzipped or not, perhaps with a ``corpus`` record.

    Returns:
        ``name`` (the file's, before its first dot), ``variant``, ``settings``, ``fraction`` and one of
        ``unreadable``, ``refused`` or ``agreement`` (None when no check could be made; ``unchecked`` says why),
        ``checks``, ``mismatches`` (a count), ``first_mismatch``, ``unverifiable``,
        ``unverifiable_reasons``, ``stats_checked``, ``stats_mismatches`` (a count), ``inferred`` (a
        count) and ``cpu_s``.
    """
    row = {"name": Path(path).name.split(".")[0], "variant": None, "settings": None, "fraction": None}
    start = time.process_time()
    try:
        snapshot = load_trace(Path(path))  # the restricted reader: a corpus from elsewhere runs no code
    except Exception as error:  # not a trace at all (junk, truncated, code in a pickle): named apart
        row["unreadable"] = f"{type(error).__name__}: {str(error)[:300]}"
        return row
    try:
        meta = snapshot.get("corpus") or {}
        row.update(variant=meta.get("variant"), settings=meta.get("settings"), fraction=meta.get("fraction"))
        report = replay_trace(snapshot)
    except Exception as error:  # a refusal is a result of the run, recorded with its reason
        row["refused"] = f"{type(error).__name__}: {str(error)[:300]}"
        return row
    row.update(agreement=report.agreement, checks=report.checks, mismatches=len(report.mismatches),
               first_mismatch=report.mismatches[0][:300] if report.mismatches else None, unchecked=report.unchecked,
               unverifiable=report.unverifiable, unverifiable_reasons=dict(report.unverifiable_reasons),
               stats_checked=report.stats_checked, stats_mismatches=len(report.stats_mismatches),
               first_stats_mismatch=report.stats_mismatches[0][:300] if report.stats_mismatches else None,
               inferred=len(report.inferred), cpu_s=round(time.process_time() - start, 3))
    return row


def summarize(rows: list[dict]) -> dict:
    """How many rows fall in each agreement band, how many were unreadable or refused, how many made no check
    (agreement undefined: counted apart, never in a band), how many agreed at every check while their
    recorded statistics did not (:data:`STATS_DISAGREE`, never in the 1.0 band), and how many in all.

    Args:
        rows: rows of :func:`replay_file`.

    Returns:
        ``{band: count, STATS_DISAGREE: count, "refused": count, "unchecked": count, "unreadable": count,
        "traces": count}``.
    """
    summary = {label: 0 for label, _, _ in BANDS}
    summary[STATS_DISAGREE] = summary["refused"] = summary["unchecked"] = summary["unreadable"] = 0
    for row in rows:
        if "unreadable" in row:
            summary["unreadable"] += 1
            continue
        if "refused" in row:
            summary["refused"] += 1
            continue
        if row["agreement"] is None:
            summary["unchecked"] += 1
            continue
        if row["agreement"] == 1.0 and row.get("stats_mismatches"):
            summary[STATS_DISAGREE] += 1
            continue
        for label, low, high in BANDS:
            if low <= row["agreement"] < high:
                summary[label] += 1
                break
    summary["traces"] = len(rows)
    return summary


def replay_corpus(paths: list[Path], progress: Callable[[dict], None] | None = None) -> list[dict]:
    """Replay every trace, in order; ``progress`` is told each row as it is made.

    Args:
        paths: trace files (see :func:`trace_files`).
        progress: called with each row.

    Returns:
        The rows.
    """
    rows = []
    for path in paths:
        row = replay_file(path)
        rows.append(row)
        if progress is not None:
            progress(row)
    return rows


def current_commit(repo: Path) -> str:
    """The short commit of ``repo``'s HEAD, or ``"unknown"`` outside a git checkout."""
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True)
    except OSError:
        return "unknown"
    return done.stdout.strip() or "unknown"


def check_record(path: Path) -> dict:
    """The record of runs at ``path`` (an empty one when the file does not exist yet), checked before
    any replay so that a run is never lost to a file it cannot be added to.

    Raises:
        ValueError: the path is a folder, or a file that is not a record of runs.
    """
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path} is a folder; name a JSON file (new or a record of runs) with --json")
    if not path.exists():
        return {"runs": []}
    try:
        record = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} cannot be read as a record of replay runs ({type(error).__name__}: {error}); "
                         "name another file with --json") from None
    if not isinstance(record, dict) or not isinstance(record.get("runs"), list):
        raise ValueError(f"{path} is not a record of replay runs (a JSON object with a 'runs' list); "
                         "name another file with --json")
    return record


def record_run(path: Path, label: str, commit: str, command: str, rows: list[dict]) -> dict:
    """Add a run to the JSON file of labelled runs (replacing a run of the same label), atomically.

    Args:
        path: the JSON file (created when missing).
        label: the run's name.
        commit: the model's commit.
        command: the command that made the run.
        rows: rows of :func:`replay_file`.

    Returns:
        The run as recorded.

    Raises:
        ValueError: the file exists but is not a record of runs.
    """
    path = Path(path)
    record = check_record(path)
    run = {"label": label, "commit": commit, "command": command, "summary": summarize(rows), "traces": rows}
    record["runs"] = [r for r in record["runs"] if r.get("label") != label] + [run]
    write_atomic(path, json.dumps(record, indent=1) + "\n")
    return run
