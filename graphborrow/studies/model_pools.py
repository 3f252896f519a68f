"""How real model code changes the idle pool, and what capturing prefill does to it.

Tables and a figure for the free-runs notebook and the README, computed the same way on
a GPU and on the simulated device:

* :func:`study` — one ladder's pool: reserved and idle bytes, runs under both rules
  (``runs`` and the seed's ``whole_segments``), which verification steps fit, the planner's
  boundary steps run for real on the same pool (:func:`check_boundaries`), and the device
  memory a borrowed probability set saves (``mem_get_info`` before and after);
* :func:`workload_table` — rows for several workloads side by side (the synthetic
  baseline first);
* :func:`prefill_table` — one model with no prefill graph, one prefill graph, and
  piecewise prefill graphs;
* :func:`simulate_recording` — the simulated twin of a GPU recording, for
  :func:`graphborrow.fidelity.compare.compare_recordings`.

Which steps fit is the capacity planner's answer (``graphborrow.eagle.plan.plan_verify``)
when it is installed; otherwise the fit column says ``planner unavailable`` and gives the
single-tensor answer of ``BorrowState.can_fit`` for the fp32 target probabilities,
labelled as such (it ignores the step's other tensors).
"""

from __future__ import annotations

import contextlib
import traceback
from typing import Callable, Iterable, Optional, Sequence

import torch

from graphborrow.core.errors import ParameterError
from graphborrow.core.runs import find_free_runs, summarize
from graphborrow.device import get_backend
from graphborrow.eagle.modes import MODES
from graphborrow.eagle.plan import plan_verify
from graphborrow.fidelity.compare import compare_recordings, load_recording, recording
from graphborrow.sim import SimBackend
from graphborrow.sim.attention import BACKENDS, AttentionModel
from graphborrow.workloads.ladder import build_ladder

from .capacity import boundary_cells, run_verify_step
from .inspection import inspect_snapshot
from .shipped import data_dir

__all__ = [
    "MiB",
    "borrow_saving",
    "build_workload",
    "check_boundaries",
    "markdown_table",
    "plot_workloads",
    "prefill_table",
    "readme_markers",
    "replace_between_markers",
    "segment_addresses",
    "simulate_recording",
    "study",
    "verify_fit",
    "vocab_of",
    "recorded_rows",
    "workload_table",
]

MiB = 2**20


def build_workload(model: str, backend, **kwargs):
    """A captured ladder for ``model``: ``"synthetic"`` or a name in ``graphborrow.workloads.models.MODELS``.

    Keyword arguments go to :class:`graphborrow.workloads.ladder.GraphLadder` (synthetic: ``shape``,
    ``prefill_tokens``, ``decode_batches``, ``draft_tokens``) or
    :class:`graphborrow.workloads.models.ModelLadder` (``layers``, ``decode_batches``, ``draft_tokens``,
    ``context``, ``prefill``, ``prefill_tokens``, ``tiny``).
    """
    return build_ladder(model, backend, **kwargs)


def verify_fit(state, batches: Iterable[int], draft_tokens: int, vocab: int,
               modes: Sequence[str] = MODES) -> list[dict]:
    """Which verification steps fit the borrowable runs: one row per batch size and mode."""
    rows = []
    for bs in batches:
        for mode in modes:
            row = {"batch": bs, "draft_tokens": draft_tokens, "vocab": vocab, "mode": mode,
                   "answered_by": "capacity.plan_verify"}
            try:
                plan = plan_verify(state, bs, draft_tokens, vocab, mode=mode, impl="reference")
            except Exception as e:  # a planner that refuses a shape answers "no", with its words
                rows.append(dict(row, fits=False, reason=f"{type(e).__name__}: {e}"))
                continue
            rows.append(dict(row, fits=bool(plan.fits), peak_bytes=getattr(plan, "peak_bytes", None),
                             requests_per_chunk=getattr(plan, "requests_per_chunk", None),
                             reason=getattr(plan, "reason", "")))
    return rows


def check_boundaries(state, fit: Sequence[dict]) -> list[dict]:
    """The planner's boundary steps run for real, borrowing from the pool it was asked about.

    Per mode, the largest batch the planner fits and the smallest it does not
    (:func:`graphborrow.studies.capacity.boundary_cells`) are the cells a wrong planner gets
    wrong first. Each runs as ``eagle_verify`` (the reference path, whose allocations the
    planner replays) on the ladder's own pool. A chunked step planned not to fit is left
    out: ``eagle_verify`` refuses it before allocating, so running it would check nothing.

    Args:
        state: the ladder's :class:`~graphborrow.core.borrow.BorrowState`.
        fit: rows of :func:`verify_fit` answered by the planner.

    Returns:
        One row per step run: batch, draft_tokens, vocab, mode, planned, ran, agrees.
    """
    cells = [{"batch_size": r["batch"], "draft_tokens": r["draft_tokens"], "vocab": r["vocab"],
              "mode": r["mode"], "fits": r["fits"]}
             for r in fit if r["answered_by"] == "capacity.plan_verify"]
    out = []
    for draft_tokens in sorted({c["draft_tokens"] for c in cells}):
        for cell in boundary_cells(cells, draft_tokens):
            if cell["mode"] == "chunked" and not cell["fits"]:
                continue
            ran = run_verify_step(state, cell["batch_size"], draft_tokens, cell["vocab"], cell["mode"])
            out.append({"batch": cell["batch_size"], "draft_tokens": draft_tokens, "vocab": cell["vocab"],
                        "mode": cell["mode"], "planned": cell["fits"], "ran": ran,
                        "agrees": ran == cell["fits"]})
    return out


def borrow_saving(state, logits: torch.Tensor, backend) -> dict:
    """Device memory a verification probability set takes plain and borrowed (``mem_get_info``).

    The set is what the standard verifier materialises: fp32 target probabilities over the
    vocabulary for every draft token, and a draft-probability buffer of the same shape.
    ``inside_runs`` says whether the borrowed set landed inside the pool's free runs.
    """
    rows, vocab = logits.reshape(-1, logits.shape[-1]).shape

    def probability_set():
        target = torch.softmax(logits.reshape(rows, vocab).float(), dim=-1)
        return target, torch.zeros_like(target)

    backend.synchronize()
    backend.empty_cache()
    free0, _ = backend.mem_get_info()
    held = probability_set()
    backend.synchronize()
    free1, _ = backend.mem_get_info()
    del held
    backend.synchronize()
    backend.empty_cache()
    plain = free0 - free1
    free0, _ = backend.mem_get_info()
    result = {"rows": rows, "vocab": vocab, "tensor_bytes": 2 * rows * vocab * 4, "plain_device_bytes": plain}
    try:
        with state.borrow("probability set"):
            held = probability_set()
            runs = state.free_runs()
            inside = all(any(a <= backend.data_ptr(t) < a + n for a, n in runs) for t in held)
            backend.synchronize()
            free1, _ = backend.mem_get_info()
            del held
    except backend.OutOfMemoryError as e:  # the runs cannot hold the set: nothing is saved
        return dict(result, borrowed_device_bytes=None, saved_bytes=0, inside_runs=False,
                    error=str(e).splitlines()[0])
    borrowed = free0 - free1
    return dict(result, borrowed_device_bytes=borrowed, saved_bytes=plain - borrowed, inside_runs=inside)


def vocab_of(ladder) -> int:
    """The vocabulary of a ladder's head: a real model's config, or the synthetic shape."""
    config = getattr(ladder, "config", None)
    return config.vocab_size if config is not None else ladder.shape.vocab


def study(ladder, label: str = "", measure_saving: bool = True, saving_batch: Optional[int] = None,
          check_plan: bool = True) -> dict:
    """The pool of a captured ladder: summary, runs by rule, verify fit, memory a borrow saves.

    Args:
        ladder: a captured ladder (synthetic or a transformers model).
        label: the workload's name in the tables (default: the ladder's).
        measure_saving: measure the device memory a borrowed probability set saves.
        saving_batch: the batch whose probability set is measured (default: the largest
            captured batch whose standard step fits, else the smallest batch).
        check_plan: run the planner's boundary steps for real (:func:`check_boundaries`).

    Returns:
        workload, pool (:func:`graphborrow.core.runs.summarize`), runs_by_rule, verify_fit,
        and, as asked, borrow_saving and planner_checked.
    """
    segments = ladder.snapshot()
    summary = summarize(segments)
    vocab = vocab_of(ladder)
    batches = sorted(ladder.decode_batches)
    fit = verify_fit(ladder.state, batches, ladder.draft_tokens, vocab)
    result = {
        "workload": label or getattr(ladder, "name", "synthetic"),
        "pool": summary,
        "runs_by_rule": {rule: [n for _, n in find_free_runs(segments, rule)] for rule in ("runs", "whole_segments")},
        "verify_fit": fit,
    }
    if measure_saving:
        # the largest batch whose probability set really borrows (tried from the planner's answer down)
        fitting = [r["batch"] for r in fit if r["fits"] and r["mode"] == "standard"]
        start = saving_batch or (max(fitting) if fitting else batches[0])
        for bs in [b for b in reversed(batches) if b <= start] or [batches[0]]:
            saving = dict(borrow_saving(ladder.state, ladder.decode(bs), ladder.backend), batch=bs)
            if saving["borrowed_device_bytes"] is not None or saving_batch:
                break
        result["borrow_saving"] = saving
    if check_plan:
        result["planner_checked"] = check_boundaries(ladder.state, fit)
    return result


def _largest_fit(fit: list[dict], mode: str = "standard") -> Optional[int]:
    """The largest batch of ``fit`` whose step fits; None when none does."""
    return max((r["batch"] for r in fit if r["fits"] and r["mode"] == mode), default=None)


def workload_table(studies: Sequence[dict]) -> list[dict]:
    """One row per studied workload: the numbers a reader compares across models."""
    rows = []
    for s in studies:
        p = s["pool"]
        row = {
            "workload": s["workload"],
            "reserved MiB": round(p["reserved_bytes"] / MiB, 1),
            "idle MiB": round(p["run_bytes"] / MiB, 1),
            "runs": p["runs"],
            "largest run MiB": round(p["largest_run"] / MiB, 1),
            "whole-segment rule MiB": round(p["whole_segment_bytes"] / MiB, 1),
            "largest fitting verify batch": _largest_fit(s["verify_fit"]),
        }
        saving = s.get("borrow_saving")
        if saving:
            row["saved MiB (batch)"] = f"{saving['saved_bytes'] / MiB:.1f} ({saving['batch']})"
        rows.append(row)
    return rows


def prefill_table(model: str, prefill_tokens: Optional[int] = None,
                  modes: Sequence[str] = ("none", "graph", "piecewise"), make_backend: Optional[Callable[[], object]] = None,
                  **ladder_kwargs) -> list[dict]:
    """The same model's pool with no prefill graph, one prefill graph and piecewise prefill.

    Each row is captured on a fresh device from ``make_backend`` (default: a layout-only
    simulated device, so full widths take seconds and the notebook's own device is untouched).
    """
    make_backend = make_backend or (lambda: get_backend("sim", backed=False, activate=False))
    studies = []
    for mode in modes:
        backend = make_backend()
        context = backend.activated() if hasattr(backend, "activated") else contextlib.nullcontext()
        with context:
            ladder = build_workload(model, backend, prefill=mode, prefill_tokens=prefill_tokens, **ladder_kwargs).capture()
            s = study(ladder, label=f"{model}, prefill {mode}", measure_saving=False, check_plan=False)
            studies.append(s)
            del ladder
            backend.empty_cache()
    return workload_table(studies)


def plot_workloads(rows: Sequence[dict], ax=None):
    """Reserved against idle MiB per workload (bars), the whole-segment rule as a marker."""
    import matplotlib.pyplot as plt

    if not rows:
        raise ParameterError("plot_workloads needs at least one row (from workload_table)")
    if ax is None:
        _, ax = plt.subplots(figsize=(1.6 + 1.3 * len(rows), 3.4))
    names = [r["workload"] for r in rows]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["reserved MiB"] for r in rows], width=0.4, color="#9e9e9e", label="reserved")
    ax.bar([i + 0.2 for i in x], [r["idle MiB"] for r in rows], width=0.4, color="#43a047", label="idle (free runs)")
    ax.scatter([i + 0.2 for i in x], [r["whole-segment rule MiB"] for r in rows], marker="_", s=400,
               color="black", label="whole-segment rule", zorder=3)
    ax.set_xticks(list(x))
    ax.set_xticklabels(names, rotation=20, ha="right")
    ax.set_ylabel("MiB")
    ax.set_title("graph pool: reserved and idle")
    ax.legend(fontsize=8)
    return ax


def _record_sites(backend) -> list:
    """Keep the Python frames of every simulated allocation, as a GPU trace does.

    Every tensor, workspace and RNG-state allocation of the simulated device goes through
    ``new_storage``; wrapping it on this one instance records frames in allocation order.
    """
    sites: list = []
    new_storage = backend.new_storage

    def recorded(nbytes):
        stack = traceback.extract_stack(limit=40)[:-1]
        sites.append([{"filename": f.filename, "line": f.lineno, "name": f.name} for f in reversed(stack)])
        return new_storage(nbytes)

    backend.new_storage = recorded
    return sites


def segment_addresses(rec: dict) -> list[tuple[int, int]]:
    """``(bytes, address)`` of every cudaMalloc in a recording's trace, in order."""
    return [(int(row[2]), int(row[1])) for row in rec.get("trace", ()) if row[0] == "segment_alloc"]


def simulate_recording(rec: dict, addresses: bool = True):
    """Run a recorded workload again on a layout-only simulated device; its recording.

    The simulated device takes the recording's measured facts: the cuBLAS and cuBLASLt
    workspace sizes, the attention backend torch picked for each call shape and, with
    ``addresses``, the addresses the driver gave each cudaMalloc (the allocator breaks
    ties between equal free blocks by address, so segment order decides which of them a
    request takes; see :meth:`graphborrow.allocator.memory.PhysicalMemory.follow_addresses`).
    Returns the candidate recording for :func:`graphborrow.fidelity.compare.compare_recordings`.
    """
    params = dict(rec.get("params") or {})
    if not params:
        raise ParameterError("this recording has no 'params' to reproduce its workload with")
    attention = AttentionModel(recorded=tuple((c["call"], c["backend"]) for c in rec.get("sdpa_choices", ())
                                              if "call" in c and c["backend"] in BACKENDS))
    backends = {c["backend"] for c in rec.get("sdpa_choices", ())}
    if len(backends) == 1 and backends <= set(BACKENDS) and not attention.recorded:
        attention = AttentionModel(forced=backends.pop())  # one backend, no call shapes: use it throughout
    backend = SimBackend(backed=False, blas_workspace=int(rec.get("blas_workspace_bytes") or 32 * MiB),
                         blaslt_workspace=int(rec.get("blaslt_extra_bytes") or MiB), attention=attention)
    try:
        if addresses:
            backend.memory.follow_addresses(segment_addresses(rec))
        backend.record_memory_history(True)
        sites = _record_sites(backend)
        ladder = build_workload(rec["model"], backend, **params).capture()
        full = backend.full_snapshot()
        trace = full["device_traces"][0]
        allocs = [e for e in trace if e["action"] == "alloc"]
        if len(allocs) == len(sites):  # one alloc event per storage, in order
            for e, frames in zip(allocs, sites):
                e["frames"] = frames
        return recording(ladder.snapshot(), trace, model=rec["model"], params=params,
                         source={"device": backend.describe()}, blas_workspace_bytes=backend.blas_workspace,
                         blaslt_extra_bytes=backend.blaslt_workspace, addresses_followed=addresses,
                         attention={"priority": list(attention.priority), "forced": attention.forced,
                                    "recorded": [list(r) for r in attention.recorded]})
    finally:
        backend.close()


def readme_markers(name: str = "model-pools") -> tuple[str, str]:
    """The README comments that enclose a generated table: ``model-pools`` (the H200 run)
    or ``model-pools-sim`` (the simulated device's run)."""
    return (f"<!-- {name}:begin (scripts/model_pools_table.py writes this table) -->", f"<!-- {name}:end -->")


README_BEGIN, README_END = readme_markers()


def planned_largest_batch(recording_path, verify_fit: list) -> Optional[int]:
    """The largest batch whose standard verification step the capacity planner fits into the
    recorded pool, over the batches and draft tokens of a study's ``verify_fit`` rows (None: none)."""
    rec = load_recording(recording_path)
    batches = sorted({r["batch"] for r in verify_fit})
    draft_tokens = verify_fit[0]["draft_tokens"]
    report = inspect_snapshot(rec["segments"], batches=batches, draft_tokens=[draft_tokens],
                              vocab=verify_fit[0]["vocab"], modes=("standard",))
    return report.largest_fitting_batch(draft_tokens, "standard")


def markdown_table(summary: dict, directory, compare: bool = True) -> str:
    """A Markdown table of a ``benchmarks/model_pools.py`` run, with the simulator's agreement.

    ``summary``: that run's ``summary.json``; ``directory``: where its recordings are.
    With ``compare``, each recording is rebuilt on the simulated device and compared block
    for block (:func:`graphborrow.fidelity.compare.compare_recordings`).
    """
    from pathlib import Path

    header = ["workload", "reserved MiB", "idle MiB (runs)", "largest run MiB", "whole-segment rule MiB",
              "largest fitting verify batch", "borrow saves MiB (batch)"]
    single_tensor = any(r["answered_by"].startswith("planner unavailable")
                        for w in summary["workloads"] for r in w["study"]["verify_fit"])
    if single_tensor:
        header.insert(6, "largest fitting verify batch (planner, recorded pool)")
    checked = any("planner_checked" in w["study"] for w in summary["workloads"])
    if checked:
        header.insert(header.index("largest fitting verify batch") + 1, "planner's boundary steps run: as planned")
    if compare:
        header.append("simulator agreement: blocks / bytes / trace events")
    causes: dict[str, int] = {}
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for w in summary["workloads"]:
        row = workload_table([w["study"]])[0]
        cells = [w["workload"], f"{row['reserved MiB']:.1f}", f"{row['idle MiB']:.1f} ({row['runs']})",
                 f"{row['largest run MiB']:.1f}", f"{row['whole-segment rule MiB']:.1f}",
                 str(row["largest fitting verify batch"] or "none"), row.get("saved MiB (batch)", "-")]
        if single_tensor:
            cells.insert(6, str(planned_largest_batch(Path(directory) / f"{w['workload']}.json.gz",
                                                      w["study"]["verify_fit"]) or "none"))
        if checked:
            runs = w["study"].get("planner_checked", [])
            cells.insert(header.index("largest fitting verify batch") + 1,
                         f"{sum(r['agrees'] for r in runs)} of {len(runs)}" if runs else "-")
        if compare:
            rec = load_recording(Path(directory) / f"{w['workload']}.json.gz")
            c = compare_recordings(rec, simulate_recording(rec))
            ref_events, cand_events, aligned = c.trace_events
            blocks = f"{c.agreement_blocks:.3f} / {c.agreement_bytes:.3f}" if c.compared else "n/a, no blocks / n/a"
            cells.append(f"{blocks} / {aligned} of {max(ref_events, cand_events)}")
            for cause, n in c.causes().items():
                causes[cause.split(":")[0]] = causes.get(cause.split(":")[0], 0) + n
        lines.append("| " + " | ".join(cells) + " |")
    for name, error in summary.get("errors", {}).items():
        lines.append(f"| {name} | failed: {error.splitlines()[0][:80]} |" + " |" * (len(header) - 2))
    lines.append("")
    if compare:
        lines.append("Agreement: each recording rebuilt on the layout-only simulated device from its parameters, "
                     "with the GPU's attention backends, library workspace sizes and cudaMalloc addresses "
                     "(`graphborrow.studies.model_pools.simulate_recording`), compared block for block and event by event "
                     "(`graphborrow.fidelity.compare`). Events that differ, by cause: "
                     + ("; ".join(f"{n} {c}" for c, n in sorted(causes.items())) or "none") + "."
                     + (" Each is explained in `known_differences.json` beside the recordings."
                        if causes and (Path(directory) / "known_differences.json").exists() else ""))
    fits = [r for w in summary["workloads"] for r in w["study"]["verify_fit"]]
    if any(r["answered_by"].startswith("planner unavailable") for r in fits):
        lines.append("Fit column: largest batch whose fp32 target probabilities alone fit a run "
                     "(`BorrowState.can_fit`); the capacity planner was not installed for this run. "
                     "The planner's column replays each standard step against the recorded pool "
                     "(`graphborrow.studies.inspection.inspect_snapshot`, on the CPU), as it agreed with the "
                     "H200 in every step of `data/capacity_h200.json`.")
    if checked:
        lines.append("Fit column: the largest batch whose standard step the capacity planner fits "
                     "(`capacity.plan_verify`, reference path, D = "
                     f"{fits[0]['draft_tokens']}); the next column runs each mode's boundary steps (the largest "
                     "batch planned to fit, the smallest planned not to) for real on the same pool "
                     "(`pool_study.check_boundaries`) and counts those that ran as planned.")
    lines.append(f"{summary['device']}, torch {summary['torch']}, transformers {summary['transformers']}; "
                 f"`{summary['command']}`")
    return "\n".join(lines)


def replace_between_markers(text: str, table: str, name: str = "model-pools") -> str:
    """``text`` with the part between the README markers called ``name`` replaced by ``table``."""
    begin, end_marker = readme_markers(name)
    start, end = text.find(begin), text.find(end_marker)
    if start < 0 or end < start:
        raise ParameterError(f"the markers {begin!r} and {end_marker!r} are not both in the file; "
                             "put them around the table to be replaced")
    return text[: start + len(begin)] + "\n" + table + "\n" + text[end:]


def recorded_rows(directory=None) -> Optional[list[dict]]:
    """The table rows a GPU run of ``benchmarks/model_pools.py`` recorded, or None without one.

    ``directory`` defaults to the repository's ``data/models_h200``; the rows have the
    columns of :func:`workload_table`, so a notebook shows them beside its own.
    """
    import json
    from pathlib import Path

    directory = Path(directory) if directory is not None else data_dir() / "models_h200"
    summary = directory / "summary.json"
    if not summary.exists():
        return None
    data = json.loads(summary.read_text())
    return workload_table([w["study"] for w in data["workloads"]])
