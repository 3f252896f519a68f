"""Bring your own snapshot: what a recorded allocator state offers a borrow.

A serving engine's ``torch.cuda.memory._snapshot()`` (pickled by
``torch.cuda.memory._dump_snapshot``) holds every cached segment of every pool. This
module reads one and answers the questions the notebooks ask of a pool they build
themselves: which pools are there, where their free runs are under both rules
(:mod:`graphborrow.core.runs`), and which EAGLE verification steps would fit a borrow over the
graph pool's runs. The fit comes from the capacity planner, which rebuilds a fresh borrow
pool over the runs in the simulated allocator (with the snapshot's own allocator settings)
and replays each step's allocation sequence against it (:func:`graphborrow.eagle.plan.plan_verify`).

    report = inspect_snapshot("my_engine.pickle", batches=(1, 8, 32), draft_tokens=(8,))
    print(format_report(report))
    plot_report(report)          # the graph pool's memory map, runs outlined

The command line is ``python -m graphborrow inspect SNAPSHOT.pickle``.

Snapshot files are read without running code from them (:func:`graphborrow.core.snapshot.read_snapshot_file`):
a pickle may hold only what a snapshot holds, and the same dict as ``.json`` is read too.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

from graphborrow.allocator.config import AllocatorConfig
from graphborrow.core.borrow import precarve_bytes
from graphborrow.core.errors import ParameterError, SnapshotFormatError
from graphborrow.core.runs import find_free_runs, load_snapshot
from graphborrow.core.sizes import MB
from graphborrow.eagle.modes import MODES
from graphborrow.eagle.plan import MAX_STEP_BYTES
from graphborrow.planning.planner import PoolImage

from .capacity import plan_table
from .plots import memory_map

__all__ = ["PoolSummary", "SnapshotReport", "format_report", "inspect_snapshot", "plot_report", "read_snapshot"]

DEFAULT_POOL = (0, 0)
MAX_RUNS = 64  # borrow states keep at most this many runs (largest first)


@dataclasses.dataclass(frozen=True)
class PoolSummary:
    """One memory pool of a snapshot: its segments and free runs under both rules.

    ``pool_id`` is torch's ``segment_pool_id``: (0, 0) is the default pool, anything else
    a private pool (CUDA graphs capture into one; a ``MemPool`` is one too).
    """

    pool_id: tuple
    segments: int
    reserved_bytes: int
    allocated_bytes: int
    inactive_bytes: int
    runs: tuple          # (address, nbytes), largest first, "runs" rule
    whole_segment_runs: tuple  # the same under the "whole_segments" rule

    @property
    def private(self) -> bool:
        return self.pool_id != DEFAULT_POOL

    @property
    def largest_run(self) -> int:
        return self.runs[0][1] if self.runs else 0


@dataclasses.dataclass(frozen=True)
class SnapshotReport:
    """What :func:`inspect_snapshot` found.

    ``pools``: every pool, private pools first, largest idle first. ``planned_pool``: the
    pool the fit table borrows from. ``fit``: one row per (draft_tokens, batch_size, mode)
    with ``fits``, ``requests_per_chunk``, ``peak_bytes`` and ``reason``. ``notes``: what
    the reader should know about how the answer was reached.
    """

    source: str
    segments: list
    pools: tuple
    planned_pool: tuple
    vocab: int
    fit: list
    notes: tuple = ()

    def pool(self, pool_id: Sequence[int]) -> PoolSummary:
        for p in self.pools:
            if p.pool_id == tuple(pool_id):
                return p
        raise KeyError(f"no pool {tuple(pool_id)} in {self.source}; pools: {[p.pool_id for p in self.pools]}")

    def largest_fitting_batch(self, draft_tokens: int, mode: str = "standard") -> Optional[int]:
        """Largest batch of the table whose step fits (None: none does)."""
        return max((r["batch_size"] for r in self.fit
                    if r["draft_tokens"] == draft_tokens and r["mode"] == mode and r["fits"]), default=None)


def read_snapshot(snapshot: Any) -> tuple[list, dict, str]:
    """Segments, allocator settings and a name for a snapshot given as a path, dict or segment list.

    Raises:
        SnapshotFormatError: naming what is wrong and how to record a proper one.
        FileNotFoundError: for a path that does not exist.
    """
    if isinstance(snapshot, (str, Path)):
        source = str(snapshot)
        data = load_snapshot(snapshot)
    else:
        source = "snapshot"
        data = snapshot
    if isinstance(data, (list, tuple)):
        data = {"segments": list(data)}
    if not isinstance(data, Mapping) or "segments" not in data:
        raise SnapshotFormatError(
            f"{source} is a {type(data).__name__} without 'segments'; pass torch.cuda.memory._snapshot(), "
            "its pickle (torch.cuda.memory._dump_snapshot) or torch.cuda.memory_snapshot()'s list")
    segments = data["segments"]
    if not isinstance(segments, (list, tuple)):
        raise SnapshotFormatError(f"{source}: 'segments' is a {type(segments).__name__}, not a list of segment dicts")
    for i, seg in enumerate(segments):
        if not isinstance(seg, Mapping):
            raise SnapshotFormatError(f"{source}: segment {i} is a {type(seg).__name__}, not a dict")
        missing = [k for k in ("address", "blocks") if k not in seg]
        if missing:
            raise SnapshotFormatError(
                f"{source}: segment {i} lacks {', '.join(map(repr, missing))}; record the snapshot with "
                "torch.cuda.memory._snapshot(), which lists each segment's blocks")
    if not segments:
        raise SnapshotFormatError(
            f"{source} holds no segments: nothing was cached when it was taken. Take it after the engine "
            "has captured its CUDA graphs (and before it exits)")
    settings = data.get("allocator_settings") or {}
    return list(segments), dict(settings), source


def _pool_id(segment: Mapping) -> tuple:
    return tuple(segment.get("segment_pool_id") or DEFAULT_POOL)


def _summaries(segments: list) -> tuple:
    by_pool: dict[tuple, list] = {}
    for seg in segments:
        by_pool.setdefault(_pool_id(seg), []).append(seg)
    pools = []
    for pool_id, segs in by_pool.items():
        blocks = [b for s in segs for b in s["blocks"]]
        pools.append(PoolSummary(
            pool_id=pool_id, segments=len(segs),
            reserved_bytes=sum(b["size"] for b in blocks),
            allocated_bytes=sum(b["size"] for b in blocks if b["state"] == "active_allocated"),
            inactive_bytes=sum(b["size"] for b in blocks if b["state"] == "inactive"),
            runs=tuple(find_free_runs(segs, "runs")),
            whole_segment_runs=tuple(find_free_runs(segs, "whole_segments"))))
    pools.sort(key=lambda p: (not p.private, -sum(n for _, n in p.runs), p.pool_id))
    return tuple(pools)


def _config(settings: dict):
    """The recorded allocator's settings as the simulator's config (None: torch's defaults)."""
    if not settings:
        return None

    try:
        return AllocatorConfig.from_settings(settings)
    except (TypeError, ValueError) as exc:
        raise SnapshotFormatError(f"the snapshot's allocator_settings cannot be read ({exc})") from exc


def _steps(batches: Iterable[int], draft_tokens: Iterable[int], vocab: int,
           modes: Optional[Iterable[str]]) -> tuple[list, list, list]:
    """The steps to plan as lists, each value checked (before any snapshot is read)."""
    batches, draft_tokens, modes = list(batches), list(draft_tokens), list(MODES if modes is None else modes)
    for name, values in (("batches", batches), ("draft_tokens", draft_tokens), ("modes", modes)):
        if not values:
            raise ParameterError(f"{name} is empty: name at least one")
    for name, values in (("batches", batches), ("draft_tokens", draft_tokens), ("vocab", [vocab])):
        bad = next((v for v in values if isinstance(v, bool) or not isinstance(v, int) or v < 1), None)
        if bad is not None:
            raise ParameterError(f"{name}: {bad!r} is not a whole number of 1 or more")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ParameterError(f"unknown mode {unknown[0]!r}; choose from {', '.join(MODES)}")
    largest = 4 * max(batches) * max(draft_tokens) * vocab
    if largest > MAX_STEP_BYTES:
        raise ParameterError(
            f"batch {max(batches)} x {max(draft_tokens)} draft tokens x vocab {vocab}: the step's float32 "
            f"probabilities alone would take {largest / 2**40:.3g} TiB, more than any GPU holds; plan smaller steps")
    return batches, draft_tokens, modes


def inspect_snapshot(snapshot: Any, batches: Iterable[int] = (1, 4, 16, 32, 64, 128),
                     draft_tokens: Iterable[int] = (4, 8, 16), vocab: int = 128256,
                     modes: Optional[Iterable[str]] = None, pool_id: Optional[Sequence[int]] = None,
                     top_k: bool = False, top_p: bool = False, best_fit: bool = True,
                     precarve: bool = True) -> SnapshotReport:
    """Pools, free runs and the verification steps that fit a borrow, from a recorded snapshot.

    Args:
        snapshot: a path to a pickle of ``torch.cuda.memory._snapshot()`` (what
            ``_dump_snapshot`` writes), the dict itself, or ``torch.cuda.memory_snapshot()``'s list.
        batches, draft_tokens, modes: the verification steps to plan (modes: all of ``eagle.MODES`` by default).
        vocab: the target model's vocabulary (float32 probabilities, as samplers read them).
        pool_id: the pool to borrow from; default: the private pool with the most idle run
            bytes (a CUDA graph pool), else the default pool.
        top_k, top_p: whether those renorms run in the step.
        best_fit, precarve: the borrow state's settings (its defaults).

    Returns:
        A :class:`SnapshotReport`.

    Raises:
        ParameterError: a bad batch, draft-token count, vocabulary or mode, or steps no device
            could hold; checked before the snapshot is read.
        SnapshotFormatError: the input is not an allocator snapshot, or names a pool it lacks.
    """
    batches, draft_tokens, modes = _steps(batches, draft_tokens, vocab, modes)
    segments, settings, source = read_snapshot(snapshot)
    pools = _summaries(segments)
    notes = []
    if pool_id is None:
        chosen = pools[0]
        if not chosen.private:
            notes.append("the snapshot has no private pool (no CUDA graph was captured, or it was taken with "
                         "memory_snapshot() of another pool); planned against the default pool's free runs")
    else:
        wanted = tuple(int(v) for v in pool_id)
        chosen = next((p for p in pools if p.pool_id == wanted), None)
        if chosen is None:
            raise SnapshotFormatError(f"{source} has no pool {wanted}; its pools are {[p.pool_id for p in pools]}")
    runs = list(chosen.runs[:MAX_RUNS])
    if len(chosen.runs) > MAX_RUNS:
        notes.append(f"only the {MAX_RUNS} largest of {len(chosen.runs)} runs are lent, as a borrow state does")
    seeds = [s for s in (precarve_bytes(n) for _, n in runs) if s] if precarve else []
    image = dataclasses.replace(PoolImage.from_runs(runs, best_fit=best_fit, seeds=seeds), config=_config(settings))
    if settings:
        notes.append("allocator rounding and splitting as the snapshot's allocator_settings record them")
    fit = plan_table(image, batches, draft_tokens, vocab, modes, top_k, top_p)
    return SnapshotReport(source, segments, pools, chosen.pool_id, vocab, fit, tuple(notes))


def _mib(nbytes: int) -> str:
    return f"{nbytes / MB:.1f} MiB"


def format_report(report: SnapshotReport) -> str:
    """The report as text for a terminal: pools, runs under both rules, the fit table."""
    lines = [f"snapshot: {report.source}", "", "pools:"]
    for p in report.pools:
        kind = "private" if p.private else "default"
        mark = "  <- borrowed from" if p.pool_id == report.planned_pool else ""
        lines.append(f"  {p.pool_id} {kind}: {p.segments} segments, {_mib(p.reserved_bytes)} reserved, "
                     f"{_mib(p.allocated_bytes)} allocated, {_mib(p.inactive_bytes)} idle{mark}")
        lines.append(f"    free runs (any segment):   {len(p.runs)}, {_mib(sum(n for _, n in p.runs))}, "
                     f"largest {_mib(p.largest_run)}")
        whole = p.whole_segment_runs
        lines.append(f"    wholly free segments only: {len(whole)}, {_mib(sum(n for _, n in whole))}, "
                     f"largest {_mib(whole[0][1] if whole else 0)}")
    pool = report.pool(report.planned_pool)
    lines += ["", f"verification steps against pool {report.planned_pool} "
                  f"(vocab {report.vocab}; fits = the step completes in a borrow over its runs):"]
    modes = list(dict.fromkeys(r["mode"] for r in report.fit))
    header = f"  {'draft':>5} {'batch':>6}  " + "  ".join(f"{m:>22}" for m in modes)
    lines.append(header)
    cells: dict[tuple, dict] = {(r["draft_tokens"], r["batch_size"], r["mode"]): r for r in report.fit}
    for d, bs in dict.fromkeys((r["draft_tokens"], r["batch_size"]) for r in report.fit):
        row = []
        for m in modes:
            r = cells[(d, bs, m)]
            if r["fits"]:
                text = f"fits, {_mib(r['peak_bytes'])}"
                if m == "chunked":
                    text += f" /{r['requests_per_chunk']}"
            else:
                text = "no"
            row.append(f"{text:>22}")
        lines.append(f"  {d:>5} {bs:>6}  " + "  ".join(row))
    lines.append("  (peak: MiB of blocks the step holds at once; chunked: /requests per group)")
    for d in dict.fromkeys(r["draft_tokens"] for r in report.fit):
        best = {m: report.largest_fitting_batch(d, m) for m in modes}
        lines.append(f"  largest batch that fits at {d} draft tokens: "
                     + ", ".join(f"{m} {b or 'none'}" for m, b in best.items()))
    first_miss = next((r for r in report.fit if not r["fits"] and r["reason"]), None)
    if first_miss is not None:
        lines.append(f"  why bs={first_miss['batch_size']} x {first_miss['draft_tokens']} {first_miss['mode']} "
                     f"does not fit: {first_miss['reason']}")
    if not pool.runs:
        lines.append("  the pool has no free run: nothing can be borrowed from it")
    for note in report.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def plot_report(report: SnapshotReport, ax=None):
    """The borrowed-from pool's memory map: blocks by state, free runs outlined.

    Returns:
        A matplotlib Figure.
    """
    pool = report.pool(report.planned_pool)
    segments = [s for s in report.segments if _pool_id(s) == report.planned_pool]
    title = (f"{Path(report.source).name}: pool {report.planned_pool}, {_mib(pool.reserved_bytes)} reserved, "
             f"{_mib(sum(n for _, n in pool.runs))} in {len(pool.runs)} free runs")
    return memory_map(segments, runs=list(pool.runs), ax=ax, title=title)
