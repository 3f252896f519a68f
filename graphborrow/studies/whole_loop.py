"""What notebook 09 shows of the whole decode loop: its runs by mode, memory over the steps,
acceptance against draft agreement, and the H200's record of the loop (``benchmarks/decode_loop.py``).

The loop itself is :class:`graphborrow.workloads.decode.DecodeLoop`; this module builds it at a
notebook's shapes on the device ``torch.cuda`` is, runs it, and turns results and records into
tables and figures.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Mapping, Optional, Sequence

import torch
from matplotlib.figure import Figure

from graphborrow.core.errors import BorrowCapacityError
from graphborrow.device import get_backend
from graphborrow.workloads.decode import BORROW_MODES, MODES, DecodeLoop, LoopResult

from .measured import load
from .presets import Setup

__all__ = ["CPU_STEPS", "LAYOUT_STEPS", "PROMPT_TOKENS", "agreement_figure", "agreement_sweep", "build_loop",
           "loop_memory_figure", "loop_record", "loop_record_rows", "mode_runs", "upstream_choice_rows"]

PROMPT_TOKENS = 32  # as benchmarks/decode_loop.py
LAYOUT_STEPS = 2  # steps of a layout-only run: what a step allocates does not depend on what it accepted
CPU_STEPS = 12  # the most steps of a run on the simulated device with bytes (a CPU computes every value)
MiB = 2 ** 20


def build_loop(setup: Setup, batch: int, new_tokens: int, agreement: float, seed: int = 0) -> DecodeLoop:
    """The loop at ``setup``'s widths, captured on the device ``torch.cuda`` is: trees of
    ``setup.draft_tokens`` nodes, a ladder of the preset's largest batch and ``batch`` (the
    largest graph shapes the pool, the run borrows from it)."""
    ladder = sorted({max(setup.ladder), batch}, reverse=True)
    return DecodeLoop(get_backend("auto"), hidden=setup.hidden, intermediate=setup.intermediate, vocab=setup.vocab,
                      layers=setup.layers, batches=ladder, draft_tokens=setup.draft_tokens,
                      prompt_tokens=PROMPT_TOKENS, max_new_tokens=new_tokens, agreement=agreement,
                      dtype=getattr(torch, setup.dtype), seed=seed).capture()


def _steps(loop: DecodeLoop) -> Optional[int]:
    """The steps a run may take here: all it needs on a GPU, at most :data:`CPU_STEPS` on the
    simulated device with bytes, exactly :data:`LAYOUT_STEPS` layout-only."""
    if loop.backend.name == "cuda":
        return None
    return CPU_STEPS if loop.backend.backed else LAYOUT_STEPS


def mode_runs(loop: DecodeLoop, batch: int, new_tokens: int, temperature: float = 1.0,
              seed: int = 0) -> dict[str, LoopResult | str]:
    """Every mode this device runs, same prompts and coins: its result, or the planner's reason
    it does not fit (the fused kernels only on a GPU)."""
    out: dict[str, LoopResult | str] = {}
    for mode in MODES:
        if mode == "fused" and loop.backend.name != "cuda":
            continue
        if mode == "upstream" and not getattr(loop.backend, "backed", True):
            out[mode] = "the reference kernel reads its probabilities' values, which a layout-only device lacks"
            continue
        try:
            out[mode] = loop.run(batch, mode, new_tokens=new_tokens, temperature=temperature, seed=seed,
                                 steps=_steps(loop))
        except BorrowCapacityError as e:
            out[mode] = str(e)
    return out


def loop_memory_figure(results: Mapping[str, LoopResult | str]) -> Figure:
    """Memory over the steps, borrowing off (``plain``) and on (each borrowing mode that ran):
    ``memory_reserved``, the graph pool, the borrow pool and the device memory in use
    (``mem_get_info``), in MiB above what the steps started from."""
    ran = {m: r for m, r in results.items() if isinstance(r, LoopResult) and (m == "plain" or m in BORROW_MODES)}
    fig = Figure(figsize=(4.2 * len(ran), 3.2), layout="constrained")
    axes = fig.subplots(1, len(ran), sharey=True, squeeze=False)[0]
    for ax, (mode, r) in zip(axes, ran.items()):
        steps = [0] + [m["step"] for m in r.memory]
        series = {
            "memory_reserved": [r.reserved_before] + [m["reserved"] for m in r.memory],
            "device in use (mem_get_info)": [r.device_before] + [m["device"] for m in r.memory],
            "borrow pool": [0] + [m["borrowed"] for m in r.memory],
        }
        for (label, values), style in zip(series.items(), ("-o", "--s", ":^")):
            base = 0 if label == "borrow pool" else values[0]
            ax.plot(steps, [(v - base) / MiB for v in values], style, label=label, markersize=4)
        ax.axhline(r.graph_pool_bytes / MiB, color="grey", linewidth=0.8)
        ax.text(0, r.graph_pool_bytes / MiB, " graph pool", va="bottom", fontsize=8, color="grey")
        ax.set_title(f"{mode}: {'borrowing' if mode in BORROW_MODES else 'no borrow'}", fontsize=10)
        ax.set_xlabel("decode step")
        ax.set_xticks(steps)
    axes[0].set_ylabel("MiB above the first step's start")
    axes[0].legend(fontsize=8)
    return fig


def agreement_sweep(loop: DecodeLoop, batch: int, new_tokens: int, agreements: Iterable[float],
                    temperature: float = 1.0, known: Optional[Mapping[float, LoopResult]] = None) -> list[dict]:
    """Mean accept length (tokens per request per step) of ``plain`` runs at each draft agreement,
    in order; ``known`` results (the loop's own agreement, run already) are used as they are. The
    loop's agreement is put back after."""
    own, known, rows = loop.agreement, dict(known or {}), []
    try:
        for a in sorted(set(agreements) | set(known)):
            if a not in known:
                loop.set_agreement(a)
                known[a] = loop.run(batch, "plain", new_tokens=new_tokens, temperature=temperature,
                                    steps=_steps(loop))
            rows.append({"agreement": a, "mean_accept_length": known[a].mean_accept_length, "steps": known[a].steps})
    finally:
        if loop.agreement != own:
            loop.set_agreement(own)
    return rows


def agreement_figure(rows: Sequence[dict], most: int) -> Figure:
    """Accept length against agreement, with the most one step can emit (``most``)."""
    fig = Figure(figsize=(4.5, 3.0), layout="constrained")
    ax = fig.add_subplot()
    ax.plot([r["agreement"] for r in rows], [r["mean_accept_length"] for r in rows], "-o")
    if not rows:
        ax.text(0.5, 0.5, "not measured: a layout-only device has no values", ha="center", va="center",
                transform=ax.transAxes, fontsize=9)
    ax.axhline(most, color="grey", linestyle=":", linewidth=0.8)
    ax.axhline(1, color="grey", linestyle=":", linewidth=0.8)
    ax.set_xlabel("draft agreement a (weights a target + (1 - a) fresh)")
    ax.set_ylabel("tokens per request per step")
    ax.set_ylim(0, most + 0.5)
    return fig


def loop_record(name: str = "decode_loop_h200", data_dir: Path | str | None = None) -> Optional[dict]:
    """The GPU's record of the loop, or None while it has not been recorded."""
    try:
        return load(name, data_dir)
    except FileNotFoundError:
        return None


def _points(record: Mapping) -> list[dict]:
    return [p for process in record["processes"] for p in process["points"]]


def loop_record_rows(record: Mapping) -> list[tuple]:
    """One row per recorded point: batch, D, mode, tokens/s, accept length, peak reserved MiB,
    device MiB the steps added, borrowed MiB; or why it did not run."""
    rows = []
    for p in sorted(_points(record), key=lambda p: (p["draft_tokens"], p["batch"], MODES.index(p["mode"]))):
        head = (p["batch"], p["draft_tokens"], p["mode"])
        if p["status"] != "ok":
            rows.append(head + ("does not fit" if p["status"] == "does_not_fit" else "failed", "", "", "", ""))
            continue
        rows.append(head + (_number(p.get("tokens_per_second_median"), ".0f"), _number(p["mean_accept_length"], ".2f"),
                            f"{p['peak_reserved'] / MiB:.0f}", f"{p['device_added'] / MiB:.0f}",
                            f"{p['borrow_pool_bytes'] / MiB:.0f}"))
    return rows


def _number(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def upstream_choice_rows(record: Mapping) -> list[dict]:
    """Per (batch, D): what not borrowing costs and saves against the fastest borrowing mode that
    ran: the device bytes the steps add, the KV tokens those bytes hold, and tokens/s. Not
    borrowing is ``plain``: the same verification code in fresh memory, as upstream now runs its
    step (the ``upstream`` row's own kernel is timed in :func:`loop_record_rows`)."""
    by_point: dict = {}
    for p in _points(record):
        by_point.setdefault((p["batch"], p["draft_tokens"]), {})[p["mode"]] = p
    kv = {pr["draft_tokens"]: pr["kv_bytes_per_token"] for pr in record["processes"]}
    out = []
    for (batch, d), modes in sorted(by_point.items()):
        upstream = modes.get("plain")
        borrowed = [modes[m] for m in BORROW_MODES if modes.get(m, {}).get("status") == "ok"
                    and "tokens_per_second_median" in modes[m]]
        if not upstream or upstream["status"] != "ok" or "tokens_per_second_median" not in upstream or not borrowed:
            continue
        best = max(borrowed, key=lambda p: p["tokens_per_second_median"])
        extra = upstream["device_added"] - best["device_added"]
        out.append({"batch": batch, "draft_tokens": d, "borrowing_mode": best["mode"], "device_bytes": extra,
                    "kv_tokens": extra // kv[d],
                    "not_borrowing_tokens_per_second": upstream["tokens_per_second_median"],
                    "borrowing_tokens_per_second": best["tokens_per_second_median"],
                    "speed_ratio": upstream["tokens_per_second_median"] / best["tokens_per_second_median"]})
    return out
