"""The explorer: pick a pool and a verification step; see where it borrows, and why it fits or not.

The computation is library code, runnable without Jupyter: :func:`explore` captures the
pool on a simulated device in layout-only mode (exact allocator decisions, no bytes) —
a model's graph ladder, or :func:`~graphborrow.planning.capacity.fit_policy_pool`, a pool where
the arena's fit policy decides what fits — then runs the chosen step borrowing from it
(the map shows the step's blocks at its peak) and asks the capacity planner about every
cell of the grid (:func:`~graphborrow.eagle.plan.plan_verify`). :func:`render_explorer`
draws the result; :class:`Explorer` wires ipywidgets controls to it.
"""

from __future__ import annotations

import dataclasses
import gc
import io
from collections import OrderedDict
from typing import Any, Optional

import torch

from graphborrow.core.errors import ParameterError
from graphborrow.core.sizes import MB
from graphborrow.device import get_backend
from graphborrow.eagle import MODES, eagle_verify
from graphborrow.eagle.draft_tree import DraftTree
from graphborrow.eagle.plan import VerifyPlan, describe_plan, plan_verify
from graphborrow.planning.capacity import fit_policy_pool
from graphborrow.workloads.ladder import GraphLadder, ModelShape

from .plots import capacity_map, memory_map
from .presets import PRESETS

__all__ = [
    "DRAFT_CHOICES", "FIT_POLICIES", "H200_MODEL", "LADDERS", "MODELS", "MODES", "POOLS", "PREFILLS", "TEACHING_MODEL",
    "VOCABS",
    "Explorer", "ExplorerResult", "ExplorerSettings", "explore", "figure_png", "fresh_state", "preset_settings",
    "render_explorer", "render_result",
]

_TEACHING, _H200 = PRESETS["teaching"], PRESETS["h200"]
TEACHING_MODEL = f"teaching (h{_TEACHING['HIDDEN']}, i{_TEACHING['INTERMEDIATE']})"
H200_MODEL = f"Llama-3-8B (h{_H200['HIDDEN']}, i{_H200['INTERMEDIATE']})"
# model shape -> widths and the dtype it runs in (the presets' for theirs)
MODELS = {
    "tiny (h128, i256)": dict(hidden=128, intermediate=256, dtype="bfloat16"),
    TEACHING_MODEL: dict(hidden=_TEACHING["HIDDEN"], intermediate=_TEACHING["INTERMEDIATE"], dtype=_TEACHING["DTYPE"]),
    "small (h512, i1536)": dict(hidden=512, intermediate=1536, dtype="bfloat16"),
    H200_MODEL: dict(hidden=_H200["HIDDEN"], intermediate=_H200["INTERMEDIATE"], dtype=_H200["DTYPE"]),
}
LADDERS = {
    "32 … 1": (32, 16, 8, 4, 2, 1),
    "64 … 1": (64, 32, 16, 8, 4, 2, 1),
    "16 … 1": (16, 8, 4, 2, 1),
    "8, 4, 2, 1": (8, 4, 2, 1),
    "256 … 1": (256, 128, 64, 32, 16, 8, 4, 2, 1),  # SGLang's largest default captured batch
}
POOLS = ("graph ladder", "fit-policy demo")
VOCABS = (2048, 8192, 32000, 50257, 128256)
PREFILLS = (0, 256, 512, 2048, 3072, 8192)
DRAFT_CHOICES = (1, 2, 4, 8, 16)
FIT_POLICIES = ("best", "first")


@dataclasses.dataclass(frozen=True)
class ExplorerSettings:
    """Everything the explorer draws depends on these, and on nothing else.

    ``pool``: "graph ladder" (the model, ladder and prefill settings shape it) or
    "fit-policy demo" (a 20 MiB run and a 12 MiB one: best and first fit differ).
    """

    model: str = "tiny (h128, i256)"
    layers: int = 2
    vocab: int = 8192
    ladder: str = "32 … 1"
    prefill_tokens: int = 512
    batch_size: int = 8
    draft_tokens: int = 4
    fit_policy: str = "best"
    mode: str = "standard"
    pool: str = "graph ladder"

    def __post_init__(self):
        checks = [("model", self.model, MODELS), ("ladder", self.ladder, LADDERS), ("pool", self.pool, POOLS),
                  ("fit_policy", self.fit_policy, FIT_POLICIES), ("mode", self.mode, MODES)]
        for name, value, allowed in checks:
            if value not in allowed:
                raise ParameterError(f"{name}={value!r} is not one of {list(allowed)}")
        if not 1 <= self.batch_size <= max(LADDERS[self.ladder]):
            raise ParameterError(
                f"batch_size={self.batch_size} is outside the captured ladder 1..{max(LADDERS[self.ladder])}")
        for name in ("layers", "vocab", "prefill_tokens", "draft_tokens"):
            if getattr(self, name) < (0 if name == "prefill_tokens" else 1):
                raise ParameterError(f"{name} must be positive, got {getattr(self, name)}")


@dataclasses.dataclass
class ExplorerResult:
    settings: ExplorerSettings
    segments: list            # the graph pool's snapshot segments
    runs: list                # (address, nbytes) free runs, largest first
    borrowed: list            # (address, nbytes) of the step's borrowed blocks at its peak (when it ran
                              # out: the most it held before the failing request)
    plan: VerifyPlan          # the planner's answer for the chosen step
    table: list               # grid rows: batch_size, draft_tokens, bytes (the step's peak), fits
    completed: bool = True    # whether the step ran to the end borrowing from the pool

    @property
    def fits(self) -> bool:
        return self.completed

    @property
    def needed_bytes(self) -> int:
        """The step's peak: most bytes of allocator blocks it holds at once."""
        return self.plan.peak_bytes

    @property
    def status(self) -> str:
        """One line: fits, or which tensor does not and why."""
        return describe_plan(self.plan)


class _Layout:
    """A captured pool on a layout-only simulated device, kept for repeated queries."""

    def __init__(self, key: tuple):
        self.backend = get_backend("sim", backed=False, activate=False)
        pool, model, layers, vocab, ladder, prefill, draft = key
        with self.backend.activated():
            if pool == "fit-policy demo":
                self.pool = fit_policy_pool(self.backend)
            else:
                widths = dict(MODELS[model])
                dtype = getattr(torch, widths.pop("dtype"))
                shape = ModelShape(layers=layers, vocab=vocab, dtype=dtype, **widths)
                self.pool = GraphLadder(self.backend, shape, prefill_tokens=prefill, decode_batches=ladder,
                                        draft_tokens=draft).capture()
            self.state = self.pool.state
            self.segments = self.pool.snapshot()
            self.runs = self.state.free_runs()

    def fresh(self, fit_policy: str):
        """The state with no borrow pool built, borrowing by ``fit_policy`` next."""
        self.state.retire()
        self.state.best_fit = fit_policy == "best"
        return self.state

    def run_step(self, s: ExplorerSettings) -> tuple[list, bool]:
        """Run the step borrowing from the pool: its blocks at the peak, and whether it completed
        (when it ran out of borrowed memory, the blocks are the most it held before that)."""
        b = self.backend
        with b.activated():
            state = self.fresh(s.fit_policy)
            bs, d = s.batch_size, s.draft_tokens
            long = torch.empty(bs, d, dtype=torch.long, device="cuda")
            tree = DraftTree(long, long, long, long, d)
            logits = torch.empty(bs * d, s.vocab, device="cuda")
            b.record_memory_history(True, max_entries=10_000_000)
            try:
                eagle_verify(logits, None, tree, 1.0, borrow=state, mode=s.mode, validate=False)
                ran = True
            except (b.OutOfMemoryError, ParameterError, ValueError):
                ran = False
            trace = b.full_snapshot()["device_traces"][0]
            b.record_memory_history(False)
            spans = _peak_blocks(trace, b.memory_snapshot(b.pool_id(state.mem_pool)) if state.mem_pool else [])
            del logits, tree, long
            state.retire()
        return spans, ran

    def close(self):
        with self.backend.activated():
            self.state.retire()
            self.pool = self.state = None
            gc.collect()
        self.backend.close()


def _peak_blocks(trace: list[dict], pool_segments: list[dict]) -> list[tuple[int, int]]:
    """The blocks live in the borrow pool when the step held the most bytes there."""
    spans = [(s["address"], s["address"] + s["total_size"]) for s in pool_segments]
    live: dict[int, int] = {}
    held = peak = 0
    at_peak: dict[int, int] = {}
    for e in trace:
        if e["action"] not in ("alloc", "free_completed") or not any(a <= e["addr"] < z for a, z in spans):
            continue
        if e["action"] == "alloc":
            live[e["addr"]] = e["size"]
            held += e["size"]
            if held > peak:
                peak, at_peak = held, dict(live)
        elif e["addr"] in live:
            held -= live.pop(e["addr"])
    return sorted(at_peak.items())


_LAYOUTS: "OrderedDict[tuple, _Layout]" = OrderedDict()
_MAX_LAYOUTS = 3


def _layout(s: ExplorerSettings) -> _Layout:
    if s.pool == "fit-policy demo":
        key = (s.pool, None, None, None, None, None, None)
    else:
        key = (s.pool, s.model, s.layers, s.vocab, LADDERS[s.ladder], s.prefill_tokens, s.draft_tokens)
    if key in _LAYOUTS:
        _LAYOUTS.move_to_end(key)
        return _LAYOUTS[key]
    layout = _Layout(key)
    _LAYOUTS[key] = layout
    while len(_LAYOUTS) > _MAX_LAYOUTS:
        _LAYOUTS.popitem(last=False)[1].close()
    return layout


def preset_settings(preset: str = "teaching", **changes: Any) -> ExplorerSettings:
    """Where the explorer starts for a notebook ``PRESET``: that preset's model, vocabulary, prefill,
    ladder, batch and draft tokens (:data:`graphborrow.studies.presets.PRESETS`), so its pool is
    the one every other notebook captures.

    Args:
        preset: ``"teaching"`` or ``"h200"``.
        changes: fields to replace, e.g. ``batch_size=4``.

    Raises:
        ParameterError: an unknown preset, or settings the explorer cannot draw.
    """
    if preset not in PRESETS:
        raise ParameterError(f"PRESET={preset!r} is not a preset; choose one of {list(PRESETS)}")
    values = PRESETS[preset]
    ladder = next((name for name, sizes in LADDERS.items() if list(sizes) == values["LADDER"]), None)
    if ladder is None:
        raise ParameterError(f"the {preset} preset's ladder {values['LADDER']} is not one of the explorer's "
                             f"{list(LADDERS)}; add it to LADDERS")
    start = ExplorerSettings(model=TEACHING_MODEL if preset == "teaching" else H200_MODEL, layers=values["LAYERS"],
                             vocab=values["VOCAB"], ladder=ladder, prefill_tokens=values["PREFILL_TOKENS"],
                             batch_size=values["BATCH_SIZE"], draft_tokens=values["DRAFT_TOKENS"])
    start = dataclasses.replace(start, **{k: v for k, v in changes.items() if v is not None and k != "batch_size"})
    batch = changes.get("batch_size") or start.batch_size
    if batch > max(LADDERS[start.ladder]):  # a larger batch needs a ladder that captured it
        holding = [name for name, sizes in LADDERS.items() if max(sizes) >= batch]
        if not holding:
            raise ParameterError(f"batch_size={batch} is larger than every ladder the explorer captures "
                                 f"(at most {max(max(v) for v in LADDERS.values())})")
        start = dataclasses.replace(start, ladder=min(holding, key=lambda name: max(LADDERS[name])))
    return dataclasses.replace(start, batch_size=batch)


def fresh_state(settings: ExplorerSettings):
    """The borrow state of the pool ``settings`` draw, with no borrow pool built and the settings'
    fit policy: what ``plan_verify`` should be asked about to check the explorer's answer."""
    return _layout(settings).fresh(settings.fit_policy)


def explore(settings: ExplorerSettings | None = None, **changes: Any) -> ExplorerResult:
    """Capture (cached), run the chosen step borrowing from the pool, plan every grid cell.

    Args:
        settings: the starting settings (default: :class:`ExplorerSettings`).
        changes: fields to replace, e.g. ``batch_size=16``.

    Returns:
        An :class:`ExplorerResult`.
    """
    s = dataclasses.replace(settings or ExplorerSettings(), **changes)
    layout = _layout(s)
    with layout.backend.activated():
        state = layout.fresh(s.fit_policy)
        plan = plan_verify(state, s.batch_size, s.draft_tokens, s.vocab, s.mode)
        table = []
        for bs in sorted(LADDERS[s.ladder]):
            for d in DRAFT_CHOICES:
                cell = plan_verify(state, bs, d, s.vocab, s.mode)
                table.append({"batch_size": bs, "draft_tokens": d, "bytes": cell.peak_bytes, "fits": cell.fits})
    borrowed, completed = layout.run_step(s)
    return ExplorerResult(s, layout.segments, layout.runs, borrowed, plan, table, completed)


def render_explorer(settings: ExplorerSettings | None = None, **changes: Any):
    """The explorer's figure: the pool's memory map with the borrow, and the capacity grid."""
    return render_result(explore(settings, **changes))


def render_result(r: ExplorerResult):
    """Draw an :class:`ExplorerResult` (see :func:`render_explorer`): the pool's memory map with
    the step's blocks at its peak on the left, the capacity grid on the right, the verdict on top."""
    from matplotlib.figure import Figure

    s = r.settings
    fig = Figure(figsize=(13, 4.4 + 0.32 * len(r.segments)), layout="constrained")
    left, right = fig.subfigures(1, 2, width_ratios=(1.75, 1))
    held = sum(n for _, n in r.borrowed)
    verdict = ("fits in the free runs" if r.fits else
               f"does NOT fit: it ran out holding {held / MB:.1f} MiB (hatched)" if held else
               "does NOT fit: its first borrowed request found no room")
    chunks = f", {r.plan.requests_per_chunk} requests per group" if s.mode == "chunked" and r.fits else ""
    where = "fit-policy demo pool" if s.pool == "fit-policy demo" else \
        f"graph pool: ladder {s.ladder}, prefill {s.prefill_tokens} tokens"
    fig.suptitle(f"verify bs={s.batch_size} x D={s.draft_tokens}, V={s.vocab}, {s.mode} ({s.fit_policy} fit): "
                 f"peak {r.needed_bytes / MB:.1f} MiB, {verdict}{chunks}", fontsize=11)
    ax = left.add_subplot()
    memory_map(r.segments, runs=r.runs, borrowed=r.borrowed, ax=ax, title=where)
    legend = ax.get_legend()
    if legend is not None:  # below the map, where it hides no block
        ax.legend(handles=legend.legend_handles, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3,
                  fontsize=8, frameon=False)
    grid = right.add_subplot()
    capacity_map(r.table, ax=grid, title=f"peak MiB per step ({s.mode})\nhatched: does not fit")
    for text in grid.texts:  # readable over hatching and dark cells alike
        text.set_color("black")
        text.set_bbox({"facecolor": "white", "alpha": 0.75, "edgecolor": "none", "pad": 1.0})
    return fig


def figure_png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)
    return buf.getvalue()


class Explorer:
    """ipywidgets controls around :func:`render_explorer`; ``.widget`` is what to display."""

    def __init__(self, settings: ExplorerSettings | None = None):
        import ipywidgets as w

        s = settings or ExplorerSettings()
        style = {"description_width": "110px"}
        self.controls = {
            "pool": w.ToggleButtons(options=list(POOLS), value=s.pool, description="pool", style=style),
            "model": w.Dropdown(options=list(MODELS), value=s.model, description="model shape", style=style),
            "layers": w.IntSlider(value=s.layers, min=1, max=8, description="layers", style=style),
            "vocab": w.Dropdown(options=sorted({*VOCABS, s.vocab}), value=s.vocab, description="vocabulary", style=style),
            "ladder": w.Dropdown(options=list(LADDERS), value=s.ladder, description="captured ladder", style=style),
            "prefill_tokens": w.Dropdown(options=sorted({*PREFILLS, s.prefill_tokens}), value=s.prefill_tokens,
                                         description="prefill tokens", style=style),
            "batch_size": w.IntSlider(value=s.batch_size, min=1, max=max(LADDERS[s.ladder]),
                                      description="batch size", style=style, continuous_update=False),
            "draft_tokens": w.SelectionSlider(options=sorted({*DRAFT_CHOICES, s.draft_tokens}), value=s.draft_tokens,
                                              description="draft tokens", style=style, continuous_update=False),
            "fit_policy": w.ToggleButtons(options=list(FIT_POLICIES), value=s.fit_policy,
                                          description="fit policy", style=style),
            "mode": w.ToggleButtons(options=list(MODES), value=s.mode, description="verify mode", style=style),
        }
        self.image = w.Image(format="png")
        self.status = w.HTML()
        for control in self.controls.values():
            control.observe(self._changed, names="value")
        self.widget = w.VBox([w.HBox([w.VBox(list(self.controls.values())[:6]),
                                      w.VBox(list(self.controls.values())[6:])]),
                              self.status, self.image])
        self.figure = None
        self.result: Optional[ExplorerResult] = None
        self._held = False
        self.redraw()

    def settings(self) -> ExplorerSettings:
        values = {k: c.value for k, c in self.controls.items()}
        values["batch_size"] = min(values["batch_size"], max(LADDERS[values["ladder"]]))
        return ExplorerSettings(**values)

    @property
    def backend(self):
        """The layout-only simulated device the current picture was computed on."""
        return _layout(self.result.settings).backend

    def update(self, **values: Any) -> None:
        """Move several controls at once and redraw once (moving them one by one redraws each time).

        Args:
            values: control name -> value, e.g. ``vocab=128256, draft_tokens=16``.
        """
        unknown = sorted(set(values) - set(self.controls))
        if unknown:
            raise ParameterError(f"{unknown} are not explorer controls; they are {sorted(self.controls)}")
        self._held = True
        try:
            if "ladder" in values:
                self.controls["batch_size"].max = max(LADDERS[values["ladder"]])
            for name, value in values.items():
                self.controls[name].value = value
        finally:
            self._held = False
        self.redraw()

    def _changed(self, change) -> None:
        if change["owner"] is self.controls["ladder"]:
            self.controls["batch_size"].max = max(LADDERS[change["new"]])
        if not self._held:
            self.redraw()

    def redraw(self) -> None:
        self.result = explore(self.settings())
        self.figure = render_result(self.result)
        self.image.value = figure_png(self.figure)
        runs = self.result.runs
        self.status.value = (f"largest free run {runs[0][1] / MB if runs else 0:.1f} MiB. "
                             f"<b>{_escape(self.result.status)}</b>")


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
