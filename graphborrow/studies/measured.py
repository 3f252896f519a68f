"""Numbers measured on a real H200, read from ``data/``, and set beside this run's.

Every file under ``data/`` carries the torch version, the device and the command that
produced it; this module only reads them, so CPU-only readers see real numbers next to
the simulated ones.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

from graphborrow.core.borrow import precarve_bytes
from graphborrow.core.runs import find_free_runs
from graphborrow.core.sizes import MB
from graphborrow.eagle.modes import MODES
from graphborrow.eagle.plan import plan_verify
from graphborrow.planning.planner import PoolImage

from .shipped import data_dir as shipped_data_dir

__all__ = [
    "FUSED_GOALS", "capacity_against_measured", "eagle_headline", "fused_goals_missed", "fused_kernel_markdown",
    "fused_kernel_table", "fused_summary", "fused_summary_text", "goals_cell", "largest_fitting_batches", "load", "markdown_table",
    "notebook_results", "planned_capacity", "pool_rows", "savings_table",
]

def load(name: str, data_dir: Path | str | None = None) -> dict:
    """One measurement file (``core_h200``, ``eagle_h200`` ...), with a clear error if absent.

    ``data_dir`` defaults to the data shipped with the package (``data/`` in a checkout).
    """
    data_dir = shipped_data_dir() if data_dir in (None, "") else data_dir
    path = Path(data_dir) / (name if name.endswith(".json") else f"{name}.json")
    if not path.exists():
        raise FileNotFoundError(
            f"{path} is missing; it is produced on a GPU by the command documented in README.md"
        )
    return json.loads(path.read_text())


def notebook_results(data_dir: Path | str | None = None, folder: str = "notebooks_h200") -> dict[str, dict]:
    """The results each notebook wrote when the suite ran with DEVICE=cuda on the H200."""
    data_dir = shipped_data_dir() if data_dir in (None, "") else data_dir
    root = Path(data_dir) / folder
    return {p.stem: json.loads(p.read_text()) for p in sorted(root.glob("*.json"))}


def eagle_headline(eagle: Mapping[str, Any]) -> dict:
    """Bytes saved, the largest step each mode covered, and the borrow scope's host cost."""
    points = [p for p in eagle["points"] if p.get("ok")]
    plain = {(p["bs"], p["draft_tokens"]): p["device_bytes"] for p in points if p["mode"] == "standard"}
    chunked = [p for p in points if p["mode"] == "chunked+borrow"]
    best = max(chunked, key=lambda p: plain.get((p["bs"], p["draft_tokens"]), 0) - p["device_bytes"])
    covered = {}
    for p in points:
        if p["mode"] == "standard+borrow":
            d = p["draft_tokens"]
            covered[d] = max(covered.get(d, 0), p["bs"])
    return {
        "device": eagle.get("device"),
        "torch": eagle.get("torch"),
        "max_saved_bytes": plain[(best["bs"], best["draft_tokens"])] - best["device_bytes"],
        "max_saved_at": (best["bs"], best["draft_tokens"]),
        "largest_batch_standard_borrow": covered,
        "largest_batch_chunked_borrow": max(p["bs"] for p in chunked),
        "borrow_scope_host_us": eagle.get("borrow_scope_host_us"),
    }


def savings_table(eagle: Mapping[str, Any], mode: str = "chunked+borrow") -> list[dict]:
    """Per (batch, draft tokens): device bytes of the plain step, of ``mode``, and saved."""
    by_point: dict = {}
    for p in eagle["points"]:
        by_point.setdefault((p["bs"], p["draft_tokens"]), {})[p["mode"]] = p
    rows = []
    for (bs, d), modes in sorted(by_point.items()):
        plain, other = modes.get("standard"), modes.get(mode)
        if not (plain and plain.get("ok") and other and other.get("ok")):
            continue
        rows.append({"batch_size": bs, "draft_tokens": d, "plain_bytes": plain["device_bytes"],
                     "bytes": other["device_bytes"], "saved_bytes": plain["device_bytes"] - other["device_bytes"]})
    return rows


FUSED_GOALS = ("<= upstream", "<= 3x softmax", "no [bs*D, V] temporaries")


def fused_goals_missed(step_us: float, upstream_us: float | None, softmax_us: float,
                       full_vocab_temporaries: bool = False) -> list[str]:
    """Which of :data:`FUSED_GOALS` one fused step misses at ``step_us`` (an empty list: all met).

    A point without an upstream measurement misses "<= upstream": it cannot be shown met."""
    missed = []
    if upstream_us is None or step_us > upstream_us:
        missed.append(FUSED_GOALS[0])
    if step_us > 3 * softmax_us:
        missed.append(FUSED_GOALS[1])
    if full_vocab_temporaries:
        missed.append(FUSED_GOALS[2])
    return missed


def fused_kernel_table(verify: Mapping[str, Any]) -> list[dict]:
    """Per (batch, draft tokens) of ``verify_kernels_h200``: the fused step replayed from a CUDA
    graph and launched eagerly, one softmax pass, the upstream step, and the goals judged
    for each launch separately (``goals_missed_replayed`` / ``goals_missed_eager``: lists of
    :data:`FUSED_GOALS` missed), each against the upstream step launched the same way where
    the record has both (``replayed_us`` on the upstream row). The eager launch pays its host
    time (``host_us`` in the record), so at small batches it misses goals the replayed step
    meets. With top-k 50 / top-p 0.9 (replayed) too where it was measured."""
    by_point: dict = {}
    for r in verify["rows"]:
        by_point.setdefault((r["bs"], r["draft_tokens"]), {})[r["impl"]] = r
    rows = []
    for (bs, d), impls in sorted(by_point.items()):
        fused, upstream = impls.get("fused", {}), impls.get("upstream", {})
        if not fused.get("ok"):
            continue
        softmax, upstream_us = fused["softmax_us"], upstream.get("device_us")
        upstream_replayed = upstream.get("replayed_us", upstream_us)
        wide = bool(fused.get("full_vocab_temporaries", False))
        softmax_t = fused.get("softmax_with_temperature_us")  # softmax(logits / T): what upstream's step computes
        row = {"batch_size": bs, "draft_tokens": d, "replayed_us": fused["graph_us"], "eager_us": fused["device_us"],
               "softmax_us": softmax, "softmax_t_us": softmax_t, "upstream_us": upstream_us,
               "upstream_replayed_us": upstream_replayed, "vs_softmax": fused["graph_us"] / softmax,
               "vs_softmax_t": fused["graph_us"] / softmax_t if softmax_t else None,
               "eager_vs_softmax": fused["device_us"] / softmax, "agrees": fused.get("agrees"),
               "temporary_bytes": max(fused.get("temporary_bytes") or 0, fused.get("workspace_bytes") or 0),
               "goals_missed_replayed": fused_goals_missed(fused["graph_us"], upstream_replayed, softmax, wide),
               "goals_missed_eager": fused_goals_missed(fused["device_us"], upstream_us, softmax, wide)}
        renorm = impls.get("fused_renorm", {})
        if renorm.get("ok"):
            row["renorm_us"] = renorm["graph_us"]
        rows.append(row)
    return rows


def goals_cell(missed: list[str]) -> str:
    """'met', or which goals were missed."""
    return "met" if not missed else "missed " + ", ".join(missed)


def fused_kernel_markdown(table: Iterable[Mapping[str, Any]]) -> str:
    """The README's (and notebook 05's) table of :func:`fused_kernel_table` rows."""
    def us(v):
        return "-" if v is None else f"{v:.0f}"

    header = ("bs", "D", "fused, replayed (us)", "fused, eager (us)", "softmax pass (us)", "replayed / softmax",
              "eager / softmax", "upstream step (us)", "goals (replayed)", "goals (eager)", "same tokens",
              "top-k 50 + top-p 0.9, replayed (us)")
    return markdown_table([(r["batch_size"], r["draft_tokens"], us(r["replayed_us"]), us(r["eager_us"]),
                            us(r["softmax_us"]), f"{r['vs_softmax']:.2f}x", f"{r['eager_vs_softmax']:.2f}x",
                            us(r["upstream_us"]), goals_cell(r["goals_missed_replayed"]),
                            goals_cell(r["goals_missed_eager"]), "yes" if r["agrees"] else "NO", us(r.get("renorm_us")))
                           for r in table], header)


def fused_summary(verify: Mapping[str, Any]) -> dict:
    """The fused path's headline from ``verify_kernels_h200``: goals met per launch kind,
    the largest temporaries of any point, and the standalone top-p renorm against its goal.

    ``renorm`` is None where the benchmark did not record it; its ``replayed_us`` is judged
    against ``goal_us`` (2x flashinfer's published class at that width)."""
    table = fused_kernel_table(verify)
    renorm = verify.get("top_p_renorm") or {}
    renorm_out = None
    if "goal_us" in renorm and "fused_graph_us" in renorm:
        renorm_out = {"rows": renorm["rows"], "vocab": renorm["vocab"], "top_p": renorm["top_p"],
                      "replayed_us": renorm["fused_graph_us"], "eager_us": renorm["fused_us"],
                      "reference_us": renorm["reference_us"], "goal_us": renorm["goal_us"],
                      "meets_goal": renorm["fused_graph_us"] <= renorm["goal_us"]}
    return {"points": len(table),
            "goals_met_replayed": sum(not r["goals_missed_replayed"] for r in table),
            "goals_met_eager": sum(not r["goals_missed_eager"] for r in table),
            "max_temporary_bytes": max((r["temporary_bytes"] or 0 for r in table), default=None),
            "renorm": renorm_out}


def fused_summary_text(summary: Mapping[str, Any]) -> str:
    """Markdown bullets stating :func:`fused_summary`'s result as recorded: the goals per
    launch kind, the standalone renorm against its goal, and how little the fused path
    leaves to borrow."""
    n = summary["points"]
    if n:
        goals = ", ".join(FUSED_GOALS)
        lines = [f"- Fused verification on the H200: every goal ({goals}) met at {summary['goals_met_replayed']} of {n} points "
                 f"replayed from a CUDA graph, at {summary['goals_met_eager']} of {n} launched eagerly (at small "
                 "batches the eager step is launch-bound: its host time, not the kernels, sets its time)."]
    else:
        lines = ["- Fused verification on the H200: n/a, no point of the record ran the fused step (nothing to "
                 "compare with its goals)."]
    renorm = summary["renorm"]
    if renorm is None:
        lines.append("- Standalone top-p renorm: not recorded.")
    else:
        verdict = "met" if renorm["meets_goal"] else "missed"
        lines.append(f"- Standalone top-p renorm of {renorm['rows']} x {renorm['vocab']} (top-p {renorm['top_p']}): "
                     f"{renorm['replayed_us']:.0f} us replayed against a goal of {renorm['goal_us']:.0f} us "
                     f"({verdict}); the reference takes {renorm['reference_us']:.0f} us.")
    if summary["max_temporary_bytes"] is not None:
        lines.append(f"- The fused step needs at most {summary['max_temporary_bytes'] / 1024:.1f} KiB of temporaries: "
                     "it never builds the [bs·D, V] matrices, so it leaves almost nothing to borrow. Borrowing pays "
                     "for the reference path, which materialises them.")
    return "\n".join(lines)


def pool_rows(h200_pool: Mapping[str, int], here_pool: Mapping[str, int]) -> list[tuple[str, str, str]]:
    """(metric, H200, this run) rows for two ``runs.summarize`` dicts."""
    def mib(v):
        return f"{v / MB:.1f} MiB"

    spec = [
        ("pool reserved", "reserved_bytes", mib),
        ("idle bytes in free runs", "run_bytes", mib),
        ("free runs", "runs", str),
        ("largest run", "largest_run", mib),
        ("whole-segment rule finds", "whole_segment_bytes", mib),
    ]
    return [(label, fmt(h200_pool[key]), fmt(here_pool[key])) for label, key, fmt in spec]


def markdown_table(rows: Iterable[tuple], header: tuple) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- planned capacity

MEASURED_MODES = {"standard": "standard+borrow", "chunked": "chunked+borrow"}  # eagle_h200.json's borrowed modes


def planned_capacity(segments: Any, batches: Iterable[int] = (1, 4, 16, 32, 64, 128),
                     draft_tokens: Iterable[int] = (4, 8, 16), modes: Iterable[str] | None = None,
                     vocab: int = 128256, top_k: bool = False, top_p: bool = False, best_fit: bool = True,
                     precarve: bool = True) -> list[dict]:
    """The capacity planner's table for a recorded pool: which (bs, D, mode) steps fit its runs.

    Args:
        segments: the pool's snapshot (a path, a ``_snapshot()`` dict or a segment list),
            e.g. ``data/h200_ladder_segments.pickle``, the Llama-3-8B ladder of the H200 runs.
        batches, draft_tokens, modes: the grid (modes: all of ``eagle.MODES`` by default).
        vocab, top_k, top_p: the step's vocabulary and renorms.
        best_fit, precarve: the borrow state's settings (its defaults: as on the H200).

    Returns:
        One row per point: batch_size, draft_tokens, mode, fits, requests_per_chunk, peak_bytes, reason.
    """
    modes = MODES if modes is None else modes
    runs = find_free_runs(segments)[:64]
    seeds = [s for s in (precarve_bytes(n) for _, n in runs) if s] if precarve else []
    image = PoolImage.from_runs(runs, best_fit=best_fit, seeds=seeds)
    rows = []
    for d in draft_tokens:
        for bs in batches:
            for mode in modes:
                p = plan_verify(image, bs, d, vocab, mode, top_k, top_p)
                rows.append({"batch_size": bs, "draft_tokens": d, "mode": mode, "fits": p.fits,
                             "requests_per_chunk": p.requests_per_chunk, "peak_bytes": p.peak_bytes,
                             "reason": p.reason})
    return rows


def largest_fitting_batches(rows: Iterable[Mapping], mode: str = "standard") -> dict[int, Optional[int]]:
    """Per draft-token count, the largest batch whose step plans as fitting (None: none)."""
    best: dict[int, Optional[int]] = {}
    for r in rows:
        if r["mode"] == mode:
            best.setdefault(r["draft_tokens"], None)
            if r["fits"]:
                best[r["draft_tokens"]] = max(best[r["draft_tokens"]] or 0, r["batch_size"])
    return best


def capacity_against_measured(rows: Iterable[Mapping], eagle: Mapping[str, Any]) -> list[dict]:
    """The planned rows beside what ran on the GPU (``eagle_h200.json`` points), where it measured them.

    Returns:
        Rows with batch_size, draft_tokens, mode, planned (fits), ran (the GPU step finished),
        and for chunked mode the planned and the GPU run's requests per group.
    """
    measured = {(p["bs"], p["draft_tokens"], p["mode"]): p for p in eagle["points"]}
    out = []
    for r in rows:
        point = measured.get((r["batch_size"], r["draft_tokens"], MEASURED_MODES.get(r["mode"])))
        if point is None or point.get("error", "").startswith("skipped"):
            continue
        out.append({"batch_size": r["batch_size"], "draft_tokens": r["draft_tokens"], "mode": r["mode"],
                    "planned": r["fits"], "ran": bool(point["ok"]), "planned_per_chunk": r["requests_per_chunk"],
                    "measured_per_chunk": point.get("chunk_requests")})
    return out
