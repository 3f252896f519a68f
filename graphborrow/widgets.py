"""The explorer: pick a model, a captured ladder and a verify step; see where it borrows.

The computation is library code, runnable without Jupyter: :func:`explore` captures the
ladder on a simulated device in layout-only mode (exact allocator decisions, no bytes),
then places the verify step's temporaries in the pool's free runs with the real
``BorrowState``. :func:`render_explorer` draws the result; :class:`Explorer` wires
ipywidgets controls to it. Widget callbacks only call these functions.
"""

from __future__ import annotations

import dataclasses
import gc
import io
from collections import OrderedDict
from typing import Any, Optional

import torch

from .plots import capacity_map, memory_map
from .sizes import MB

MODELS = {
    "tiny (h128, i256)": dict(hidden=128, intermediate=256),
    "small (h512, i1536)": dict(hidden=512, intermediate=1536),
    "Llama-3-8B (h4096, i14336)": dict(hidden=4096, intermediate=14336),
}
LADDERS = {
    "32 … 1": (32, 16, 8, 4, 2, 1),
    "64 … 1": (64, 32, 16, 8, 4, 2, 1),
    "16 … 1": (16, 8, 4, 2, 1),
    "8, 4, 2, 1": (8, 4, 2, 1),
}
VOCABS = (2048, 8192, 32000, 128256)
DRAFT_CHOICES = (1, 2, 4, 8, 16)
MODES = ("standard", "lean", "chunked")
FIT_POLICIES = ("best", "first")


@dataclasses.dataclass(frozen=True)
class ExplorerSettings:
    """Everything the explorer draws depends on these, and on nothing else."""

    model: str = "tiny (h128, i256)"
    layers: int = 2
    vocab: int = 8192
    ladder: str = "32 … 1"
    prefill_tokens: int = 512
    batch_size: int = 8
    draft_tokens: int = 4
    fit_policy: str = "best"
    mode: str = "standard"
    chunk_rows: Optional[int] = None

    def __post_init__(self):
        from .errors import ParameterError

        checks = [("model", self.model, MODELS), ("ladder", self.ladder, LADDERS),
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
    borrowed: Optional[list]  # (address, nbytes) where the temporaries landed; None: no fit
    needed_bytes: int         # temporary bytes of the verify step
    table: list               # capacity rows: batch_size, draft_tokens, bytes, fits

    @property
    def fits(self) -> bool:
        return self.borrowed is not None


def temporaries(batch_size: int, draft_tokens: int, vocab: int, mode: str,
                chunk_rows: Optional[int] = None) -> list[int]:
    """Byte sizes of the verify step's temporaries, as probability matrices.

    The total is :func:`graphborrow.eagle.verify_bytes`; it is cut into matrices of the
    rows the mode holds at once (all rows, one chunk, or one row per request for lean),
    so placement sees tensors of realistic sizes rather than one block.
    """
    from .eagle import verify_bytes

    rows = {"standard": batch_size * draft_tokens, "lean": batch_size,
            "chunked": min(batch_size * draft_tokens, chunk_rows or draft_tokens)}[mode]
    total = verify_bytes(batch_size, draft_tokens, vocab, mode,
                         chunk_rows=chunk_rows if mode == "chunked" else None)
    matrix = rows * vocab * 4
    count = total // matrix
    sizes = [matrix] * count
    if total - matrix * count > 0:
        sizes.append(total - matrix * count)
    return sizes


class _Layout:
    """A captured ladder on a layout-only simulated device, kept for repeated queries."""

    def __init__(self, model: str, layers: int, vocab: int, ladder: tuple, prefill: int, draft: int):
        from .backend import get_backend
        from .workload import GraphLadder, ModelShape

        self.backend = get_backend("sim", backed=False, activate=False)
        shape = ModelShape(layers=layers, vocab=vocab, dtype=torch.bfloat16, **MODELS[model])
        with self.backend.activated():
            self.ladder = GraphLadder(self.backend, shape, prefill_tokens=prefill,
                                      decode_batches=ladder, draft_tokens=draft).capture()
            self.state = self.ladder.state
            self.segments = self.ladder.snapshot()
            self.runs = self.state.free_runs()

    def place(self, sizes: list[int], fit_policy: str) -> Optional[list]:
        """Borrow tensors of ``sizes`` at once; their (address, nbytes), or None if they don't fit."""
        with self.backend.activated():
            self.state.best_fit = fit_policy == "best"
            self.state.retire()
            spans, held = [], []
            try:
                with self.state.borrow("explorer"):
                    for n in sizes:
                        held.append(torch.empty(n, dtype=torch.uint8, device=self.backend.device))
                        spans.append((self.backend.data_ptr(held[-1]), n))
                    held.clear()
            except self.backend.OutOfMemoryError:
                held.clear()
                return None
            return spans

    def close(self):
        with self.backend.activated():
            self.state.retire()
            self.ladder = self.state = None
            gc.collect()
        self.backend.close()


_LAYOUTS: "OrderedDict[tuple, _Layout]" = OrderedDict()
_MAX_LAYOUTS = 3


def _layout(s: ExplorerSettings) -> _Layout:
    key = (s.model, s.layers, s.vocab, LADDERS[s.ladder], s.prefill_tokens, s.draft_tokens)
    if key in _LAYOUTS:
        _LAYOUTS.move_to_end(key)
        return _LAYOUTS[key]
    layout = _Layout(*key)
    _LAYOUTS[key] = layout
    while len(_LAYOUTS) > _MAX_LAYOUTS:
        _LAYOUTS.popitem(last=False)[1].close()
    return layout


def explore(settings: ExplorerSettings | None = None, **changes: Any) -> ExplorerResult:
    """Capture (cached), then place this step's temporaries and every grid cell's."""
    s = dataclasses.replace(settings or ExplorerSettings(), **changes)
    layout = _layout(s)
    def sizes(bs, d):
        return temporaries(bs, d, s.vocab, s.mode, s.chunk_rows)

    own = sizes(s.batch_size, s.draft_tokens)
    borrowed = layout.place(own, s.fit_policy)
    table = []
    for bs in sorted(LADDERS[s.ladder]):
        for d in DRAFT_CHOICES:
            need = sizes(bs, d)
            fits = bool(layout.place(need, s.fit_policy)) if sum(need) <= sum(n for _, n in layout.runs) else False
            table.append({"batch_size": bs, "draft_tokens": d, "bytes": sum(need), "fits": fits})
    return ExplorerResult(s, layout.segments, layout.runs, borrowed, sum(own), table)


def render_explorer(settings: ExplorerSettings | None = None, **changes: Any):
    """The explorer's figure: the pool's memory map with the borrow, and the capacity grid."""
    return render_result(explore(settings, **changes))


def render_result(r: ExplorerResult):
    """Draw an :class:`ExplorerResult` (see :func:`render_explorer`)."""
    from matplotlib.figure import Figure

    s = r.settings
    fig = Figure(figsize=(11, 4.2 + 0.3 * len(r.segments)), layout="constrained")
    left, right = fig.subfigures(1, 2, width_ratios=(1.7, 1))
    verdict = "fits in the free runs" if r.fits else "does NOT fit: nothing is borrowed"
    memory_map(r.segments, runs=r.runs, borrowed=r.borrowed or [], ax=left.add_subplot(),
               title=f"graph pool, ladder {s.ladder}, prefill {s.prefill_tokens} tokens")
    left.suptitle(f"verify bs={s.batch_size}, D={s.draft_tokens}, V={s.vocab}, {s.mode}: "
                  f"{r.needed_bytes / MB:.1f} MiB, {verdict}", fontsize=10)
    capacity_map(r.table, ax=right.add_subplot(),
                 title=f"MiB needed ({s.mode}, {s.fit_policy} fit); hatched: no fit")
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
            "model": w.Dropdown(options=list(MODELS), value=s.model, description="model shape", style=style),
            "layers": w.IntSlider(value=s.layers, min=1, max=8, description="layers", style=style),
            "vocab": w.Dropdown(options=list(VOCABS), value=s.vocab, description="vocabulary", style=style),
            "ladder": w.Dropdown(options=list(LADDERS), value=s.ladder, description="captured ladder", style=style),
            "prefill_tokens": w.Dropdown(options=[0, 256, 512, 2048, 8192], value=s.prefill_tokens,
                                         description="prefill tokens", style=style),
            "batch_size": w.IntSlider(value=s.batch_size, min=1, max=max(LADDERS[s.ladder]),
                                      description="batch size", style=style, continuous_update=False),
            "draft_tokens": w.SelectionSlider(options=list(DRAFT_CHOICES), value=s.draft_tokens,
                                              description="draft tokens", style=style, continuous_update=False),
            "fit_policy": w.ToggleButtons(options=list(FIT_POLICIES), value=s.fit_policy,
                                          description="fit policy", style=style),
            "mode": w.ToggleButtons(options=list(MODES), value=s.mode, description="verify mode", style=style),
        }
        self.image = w.Image(format="png")
        self.status = w.HTML()
        for control in self.controls.values():
            control.observe(self._changed, names="value")
        self.widget = w.VBox([w.HBox([w.VBox(list(self.controls.values())[:5]),
                                      w.VBox(list(self.controls.values())[5:])]),
                              self.status, self.image])
        self.figure = None
        self.result: Optional[ExplorerResult] = None
        self.redraw()

    def settings(self) -> ExplorerSettings:
        values = {k: c.value for k, c in self.controls.items()}
        values["batch_size"] = min(values["batch_size"], max(LADDERS[values["ladder"]]))
        return ExplorerSettings(**values)

    @property
    def backend(self):
        """The layout-only simulated device the current picture was computed on."""
        return _layout(self.result.settings).backend

    def _changed(self, change) -> None:
        if change["owner"] is self.controls["ladder"]:
            self.controls["batch_size"].max = max(LADDERS[change["new"]])
        self.redraw()

    def redraw(self) -> None:
        self.result = explore(self.settings())
        self.figure = render_result(self.result)
        self.image.value = figure_png(self.figure)
        verdict = "fits" if self.result.fits else "does not fit"
        self.status.value = (f"<b>{self.result.needed_bytes / MB:.1f} MiB</b> of temporaries, "
                             f"largest free run {self.result.runs[0][1] / MB if self.result.runs else 0:.1f} MiB: "
                             f"<b>{verdict}</b>")
