"""Figures for allocator snapshots, capacity tables and sweeps.

Every function takes plain data (torch-format snapshot segments, lists of dicts) and
returns a matplotlib Figure, so the same code draws a real H200 snapshot, a simulated
one, or a sweep's CSV. Patches carry a ``gid`` ("block:<state>", "run", "borrowed") so
tests and readers can find them again.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping, Sequence

import matplotlib
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from graphborrow.core.snapshot import load_snapshot
from graphborrow.planning.capacity import unborrowable_runs

__all__ = ["BORROWED_COLOR", "RUN_COLOR", "STATE_COLORS", "UNBORROWABLE_COLOR", "WRITTEN_COLOR", "bar_policy_comparison",
           "capacity_map", "largest_borrowable_plot", "memory_map", "stream_timeline", "sweep_plot"]

STATE_COLORS = {
    "active_allocated": "#d95f02",
    "active_pending_free": "#7570b3",
    "inactive": "#d9d9d9",
}
RUN_COLOR = "#1b9e77"
UNBORROWABLE_COLOR = "#a6761d"
BORROWED_COLOR = "#e7298a"
WRITTEN_COLOR = "#1f78b4"
MiB = 2**20


def _new_axes(ax, figsize):
    if ax is not None:
        return ax.figure, ax
    fig = Figure(figsize=figsize, layout="constrained")
    return fig, fig.add_subplot()


def _segment_list(segments: Any) -> list[Mapping]:
    """The checked segments of any snapshot form (see :func:`graphborrow.core.snapshot.load_snapshot`)."""
    return sorted(load_snapshot(segments)["segments"], key=lambda s: s["address"])


def _unit(max_bytes: int) -> tuple[float, str]:
    if max_bytes >= MiB:
        return float(MiB), "MiB"
    if max_bytes >= 2**10:
        return 1024.0, "KiB"
    return 1.0, "B"


def _segment_size(seg: Mapping) -> int:
    return seg.get("total_size") or sum(b["size"] for b in seg["blocks"])


def _locate(segments: Sequence[Mapping], address: int) -> int | None:
    for row, seg in enumerate(segments):
        if seg["address"] <= address < seg["address"] + _segment_size(seg):
            return row
    return None


def memory_map(
    segments: Any,
    runs: Iterable[tuple[int, int]] | None = None,
    borrowed: Iterable[tuple[int, int]] | None = None,
    ax=None,
    title: str | None = None,
    pool_id: tuple[int, int] | None = None,
    written: Iterable[tuple[int, int]] | None = None,
) -> Figure:
    """Draw each segment as a row of blocks coloured by state.

    ``runs`` are ``(address, nbytes)`` free runs, outlined: solid where a borrow can use
    them, dashed where it never can (too small for even a 2 MiB small-pool segment; see
    :func:`graphborrow.planning.capacity.unborrowable_runs`). ``borrowed`` are ``(address,
    nbytes)`` of borrowed tensors, hatched. ``written`` are ``(address, nbytes)`` ranges a
    replay writes, drawn as a strip along the top of their segment's row. ``pool_id`` keeps
    only the segments of one private pool. Offsets are measured from each segment's start.
    """
    segs = _segment_list(segments)
    if pool_id is not None:
        segs = [s for s in segs if tuple(s.get("segment_pool_id", ())) == tuple(pool_id)]
    biggest = max((_segment_size(s) for s in segs), default=0)
    scale, unit = _unit(biggest)
    fig, ax = _new_axes(ax, (9, 0.6 + 0.45 * max(len(segs), 1)))

    for row, seg in enumerate(segs):
        for block in seg["blocks"]:
            state = block.get("state", "inactive")
            offset = (block["address"] - seg["address"]) / scale
            ax.add_patch(Rectangle(
                (offset, row - 0.4), block["size"] / scale, 0.8,
                facecolor=STATE_COLORS.get(state, "white"), edgecolor="white",
                linewidth=0.5, gid=f"block:{state}",
            ))

    def outline(spans, **style):
        for address, nbytes in spans or ():
            row = _locate(segs, address)
            if row is None:
                continue
            offset = (address - segs[row]["address"]) / scale
            ax.add_patch(Rectangle((offset, row - 0.45), nbytes / scale, 0.9, **style))

    runs = list(runs) if runs is not None else None
    unusable = set(unborrowable_runs(runs)) if runs else set()
    outline([r for r in runs or () if tuple(r) not in unusable], fill=False, edgecolor=RUN_COLOR, linewidth=2.0,
            gid="run")
    outline(sorted(unusable), fill=False, edgecolor=UNBORROWABLE_COLOR, linewidth=1.5, linestyle="--",
            gid="run:unborrowable")
    outline(borrowed, fill=False, edgecolor=BORROWED_COLOR, hatch="///", linewidth=1.0,
            gid="borrowed")
    written = list(written) if written is not None else None
    for row, seg in enumerate(segs):  # each range clipped to every segment it crosses
        start, end = seg["address"], seg["address"] + _segment_size(seg)
        for address, nbytes in written or ():
            lo, hi = max(address, start), min(address + nbytes, end)
            if hi > lo:
                ax.add_patch(Rectangle(((lo - start) / scale, row - 0.45), (hi - lo) / scale, 0.22,
                                       facecolor=WRITTEN_COLOR, edgecolor="none", alpha=0.85, gid="written"))

    ax.set_xlim(0, max(biggest / scale, 1e-9) * 1.02)
    ax.set_ylim(len(segs) - 0.5, -0.5)
    ax.set_yticks(range(len(segs)))
    ax.set_yticklabels([
        f"{s['address']:#x} ({_segment_size(s) / scale:.3g} {unit})" for s in segs
    ], fontsize=7)
    ax.set_xlabel(f"offset in segment ({unit})")
    legend = [Patch(facecolor=c, label=s.replace("_", " ")) for s, c in STATE_COLORS.items()]
    if runs is not None:
        legend.append(Patch(fill=False, edgecolor=RUN_COLOR, linewidth=2, label="free run"))
    if unusable:
        legend.append(Patch(fill=False, edgecolor=UNBORROWABLE_COLOR, linestyle="--", linewidth=1.5,
                            label="free run too small to borrow"))
    if borrowed is not None:
        legend.append(Patch(fill=False, edgecolor=BORROWED_COLOR, hatch="///", label="borrowed"))
    if written is not None:
        legend.append(Patch(facecolor=WRITTEN_COLOR, alpha=0.85, label="written by a replay"))
    # outside the axes, right of the map: a legend inside would hide the widest segments
    ax.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, framealpha=0.9, borderaxespad=0)
    ax.set_title(title or f"{len(segs)} segments")
    return fig


def capacity_map(
    table: Iterable[Mapping],
    x: str = "draft_tokens",
    y: str = "batch_size",
    value: str = "bytes",
    fits: str = "fits",
    ax=None,
    title: str | None = None,
    limits: tuple[float, float] | None = None,
    colorbar: bool = True,
) -> Figure:
    """A batch size × draft tokens grid: colour = bytes needed (log), hatched = does not fit.

    ``table`` rows are dicts with keys ``x``, ``y``, ``value`` and ``fits``. ``limits`` fixes
    the colour scale (bytes, low and high) so several grids share one; ``colorbar`` draws its key.
    """
    rows = list(table)
    if not rows:
        raise ValueError("capacity_map needs at least one row")
    for key in (x, y, value, fits):
        if key not in rows[0]:
            raise KeyError(f"capacity_map: rows have no {key!r} column; columns are {sorted(rows[0])}")
    xs = sorted({r[x] for r in rows})
    ys = sorted({r[y] for r in rows})
    fig, ax = _new_axes(ax, (1.6 + 0.8 * len(xs), 1.2 + 0.45 * len(ys)))
    cmap = matplotlib.colormaps["viridis"]
    values = [max(r[value], 1) for r in rows]
    lo, hi = (math.log10(max(v, 1)) for v in (limits or (min(values), max(values))))
    for r in rows:
        i, j = xs.index(r[x]), ys.index(r[y])
        level = 0.5 if hi == lo else min(1.0, max(0.0, (math.log10(max(r[value], 1)) - lo) / (hi - lo)))
        ok = bool(r[fits])
        ax.add_patch(Rectangle(
            (i - 0.5, j - 0.5), 1, 1, facecolor=cmap(level), edgecolor="white",
            hatch=None if ok else "xx", gid="fits" if ok else "no-fit",
        ))
        ax.text(i, j, f"{r[value] / MiB:.0f}" if r[value] >= MiB else f"{r[value] / MiB:.2f}",
                ha="center", va="center", fontsize=7,
                color="white" if level < 0.6 else "black")
    ax.set_xlim(-0.5, len(xs) - 0.5)
    ax.set_ylim(-0.5, len(ys) - 0.5)
    ax.set_xticks(range(len(xs)), [str(v) for v in xs])
    ax.set_yticks(range(len(ys)), [str(v) for v in ys])
    ax.set_xlabel(x.replace("_", " "))
    ax.set_ylabel(y.replace("_", " "))
    ax.set_title(title or f"{value} (MiB) needed; hatched: does not fit")
    if colorbar:
        norm = matplotlib.colors.LogNorm(10 ** lo / MiB, max(10 ** hi, 10 ** lo * 1.0001) / MiB)
        bar = fig.colorbar(matplotlib.cm.ScalarMappable(norm=norm, cmap=cmap), ax=ax, shrink=0.9)
        bar.set_label("MiB (log scale)")
    return fig


def stream_timeline(lanes: Mapping[str, Sequence[tuple[float, float, str]]],
                    marks: Sequence[tuple[float, str]] = (), unit: str = "ms", ax=None,
                    title: str | None = None) -> Figure:
    """What each stream (or block) does over time: one lane per name, bars from time zero.

    Args:
        lanes: lane name -> ``(start, end, label)`` intervals, in ``unit``.
        marks: ``(time, label)`` moments drawn as vertical lines across every lane.
        unit: the time unit of the axis.
        ax: an axes to draw into, else a new figure.
        title: the figure's title.
    """
    if not lanes:
        raise ValueError("stream_timeline needs at least one lane")
    fig, ax = _new_axes(ax, (9, 0.9 + 0.6 * len(lanes)))
    palette = ("#66a61e", "#7570b3", "#e6ab02", "#d95f02", "#1f78b4")
    end = max([e for spans in lanes.values() for _, e, _ in spans] + [t for t, _ in marks] + [1e-9])
    for row, (name, spans) in enumerate(lanes.items()):
        for k, (a, b, label) in enumerate(spans):  # a block state keeps its memory-map colour
            colour = STATE_COLORS.get(label, palette[k % len(palette)])
            ax.add_patch(Rectangle((a, row - 0.35), max(b - a, end * 0.004), 0.7, facecolor=colour,
                                   edgecolor="white", gid=f"lane:{name}"))
            ax.text(a + max(b - a, end * 0.004) / 2, row, label, ha="center", va="center", fontsize=8)
    for t, label in marks:
        ax.axvline(t, color="#333333", linestyle="--", linewidth=1)
        ax.text(t, -0.55, label, ha="center", va="bottom", fontsize=8)
    ax.set_xlim(0, end * 1.05)
    ax.set_ylim(len(lanes) - 0.5, -0.9)
    ax.set_yticks(range(len(lanes)), list(lanes))
    ax.set_xlabel(f"time since the borrowed tensor was written ({unit})")
    ax.set_title(title or "streams over time")
    return fig


def largest_borrowable_plot(rows: Iterable[Mapping], ax=None, title: str | None = None) -> Figure:
    """The largest tensor a run can lend against the run's size, by size class.

    ``rows`` come from :func:`graphborrow.planning.capacity.size_class_table` (``run_bytes``,
    ``largest_bytes``, ``class``). The staircase shows the allocator's rules: nothing
    under 2 MiB, small blocks only (up to 1 MiB) until 10 MiB, no 1-10 MiB tensor
    (it needs a 20 MiB segment) until 20 MiB, then the run rounded down to 2 MiB.
    """
    rows = sorted(rows, key=lambda r: r["run_bytes"])
    if not rows:
        raise ValueError("largest_borrowable_plot needs at least one row")
    fig, ax = _new_axes(ax, (6.5, 3.8))
    xs = [r["run_bytes"] / MiB for r in rows]
    ax.step(xs, [r["largest_bytes"] / MiB for r in rows], where="post", color=RUN_COLOR, gid="largest")
    ax.plot(xs, xs, color="#999999", linestyle=":", linewidth=1, label="the whole run")
    for start, end, label in ((0, 2, "nothing"), (2, 10, "small only"), (10, 20, "no 1-10 MiB tensor")):
        ax.axvspan(start, min(end, max(xs)), alpha=0.08, color="#444444", gid=f"band:{label}")
        ax.text((start + min(end, max(xs))) / 2, max(xs) * 0.92, label, ha="center", va="top", fontsize=7)
    ax.set_xlabel("free run (MiB)")
    ax.set_ylabel("largest borrowable tensor (MiB)")
    ax.set_xlim(0, max(xs))
    ax.set_ylim(0, max(xs))
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(title or "largest borrowable tensor against run size")
    return fig


def bar_policy_comparison(
    values: Mapping[str, Mapping[str, float] | float],
    ylabel: str = "MiB",
    ax=None,
    title: str | None = None,
) -> Figure:
    """Grouped bars: one bar per policy, one group per metric.

    ``values`` maps policy -> number, or policy -> {metric: number}.
    """
    if not values:
        raise ValueError("bar_policy_comparison needs at least one policy")
    table = {p: (v if isinstance(v, Mapping) else {"": v}) for p, v in values.items()}
    metrics = list(dict.fromkeys(m for v in table.values() for m in v))
    fig, ax = _new_axes(ax, (1.5 + 1.2 * len(metrics) * max(len(table), 1) / 2, 3.2))
    width = 0.8 / len(table)
    for k, (policy, per_metric) in enumerate(table.items()):
        xs = [i - 0.4 + width * (k + 0.5) for i in range(len(metrics))]
        heights = [per_metric.get(m, 0.0) for m in metrics]
        bars = ax.bar(xs, heights, width, label=policy, gid=f"policy:{policy}")
        ax.bar_label(bars, fmt="%.4g", fontsize=7)
    ax.set_xticks(range(len(metrics)), metrics)
    ax.set_ylabel(ylabel)
    if len(table) > 4:  # many policies: beside the bars, where it hides none of them
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
        fig.tight_layout()
    else:
        ax.legend(fontsize=8)
    if title:
        ax.set_title(title)
    return fig


def _number(v) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(f) else f


def sweep_plot(
    csv_rows: Iterable[Mapping],
    x: str,
    y: str,
    hue: str | None = None,
    ax=None,
    title: str | None = None,
    scale: float = 1.0,
    ylabel: str | None = None,
) -> Figure:
    """``y`` against ``x``, one line per ``hue`` value; rows that failed or lack numbers are skipped.

    ``scale`` divides ``y`` (``2**20`` plots bytes as MiB); ``ylabel`` names the axis (default ``y``).
    """
    rows = [r for r in csv_rows if r.get("status", "ok") == "ok"]
    fig, ax = _new_axes(ax, (6, 3.6))
    groups: dict[Any, list[tuple[float, float]]] = {}
    for r in rows:
        xv, yv = _number(r.get(x)), _number(r.get(y))
        if xv is None or yv is None:
            continue
        groups.setdefault(r.get(hue) if hue else None, []).append((xv, yv / scale))
    for key in sorted(groups, key=lambda k: (_number(k) is None, _number(k) or 0, str(k))):
        pts = sorted(groups[key])
        label = f"{hue}={key}" if hue else y
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax.set_xlabel(x)
    ax.set_ylabel(ylabel or y)
    ax.set_ylim(bottom=0)
    if groups:
        ax.legend(fontsize=8)
    ax.set_title(title or f"{ylabel or y} vs {x}")
    return fig
