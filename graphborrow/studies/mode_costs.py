"""What each EAGLE verification mode cost on the H200: device memory and time, side by side.

``benchmarks/eagle_verify.py`` measured every (batch, draft tokens) step four ways on an
H200 (``data/eagle_h200.json``; with top-k and top-p renorms in ``eagle_h200_renorm.json``):
the standard step allocating normally, the same step borrowing, the lean verifier (which
never materialises the ``[bs*D, V]`` probability matrices) allocating normally, and the
chunked step borrowing. Notebook 08 sets them beside each other to answer when borrowing
pays: the device memory each took (``mem_get_info``) and its device time (CUDA events).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional

from graphborrow.core.sizes import MB

__all__ = ["MEASURED_VARIANTS", "mode_costs", "plot_mode_costs", "summarize_costs"]

# the four ways benchmarks/eagle_verify.py ran each step: a verification mode (eagle.MODES), borrowing or not
MEASURED_VARIANTS = ("standard", "standard+borrow", "lean", "chunked+borrow")


def mode_costs(eagle: Mapping[str, Any]) -> list[dict]:
    """One row per (batch, draft tokens) where every mode ran: each mode's device bytes and ms.

    Args:
        eagle: a loaded ``eagle_h200*.json`` (:func:`graphborrow.studies.measured.load`).

    Returns:
        Rows with batch_size, draft_tokens and, per mode, ``<mode>_bytes`` and ``<mode>_ms``.
    """
    by_point: dict = {}
    for p in eagle["points"]:
        by_point.setdefault((p["bs"], p["draft_tokens"]), {})[p["mode"]] = p
    rows = []
    for (bs, d), modes in sorted(by_point.items()):
        if not all(modes.get(m, {}).get("ok") for m in MEASURED_VARIANTS):
            continue
        row = {"batch_size": bs, "draft_tokens": d}
        for m in MEASURED_VARIANTS:
            row[f"{m}_bytes"] = modes[m]["device_bytes"]
            row[f"{m}_ms"] = modes[m]["device_ms"]
        rows.append(row)
    if not rows:
        raise ValueError("no point of this file ran in every mode "
                         f"({', '.join(MEASURED_VARIANTS)}); is it an eagle_verify.py result?")
    return rows


def summarize_costs(rows: Iterable[Mapping]) -> dict:
    """Medians over the points: lean's bytes as a share of the standard step's, and each
    mode's time against the plain standard step (ratios within the same run). A median over
    no point with a nonzero standard step is None (nothing to compare)."""
    import statistics

    rows = list(rows)

    def median_of(key: str, base: str):
        ratios = [r[key] / r[base] for r in rows if r[base]]
        return statistics.median(ratios) if ratios else None

    out = {"points": len(rows), "lean_bytes_share": median_of("lean_bytes", "standard_bytes")}
    for m in MEASURED_VARIANTS[1:]:
        out[f"{m}_time_ratio"] = median_of(f"{m}_ms", "standard_ms")
    return out


def plot_mode_costs(rows: Iterable[Mapping], title: Optional[str] = None, draft_tokens: Optional[int] = None):
    """Two panels over batch size: device memory taken (MiB, from zero) and device time against the
    plain standard step of the same point (a ratio: the modes' times differ by a few per cent at
    milliseconds, so drawn from zero their lines lie on top of each other), one line per mode.

    Args:
        rows: from :func:`mode_costs`.
        draft_tokens: the draft-token count to draw (default: the largest in ``rows``).

    Returns:
        A matplotlib Figure.
    """
    from matplotlib.figure import Figure

    rows = list(rows)
    d = draft_tokens if draft_tokens is not None else max(r["draft_tokens"] for r in rows)
    mine = sorted((r for r in rows if r["draft_tokens"] == d), key=lambda r: r["batch_size"])
    if not mine:
        raise ValueError(f"no row has draft_tokens={d}; rows have {sorted({r['draft_tokens'] for r in rows})}")
    fig = Figure(figsize=(9, 3.4), layout="constrained")
    mem, time = fig.subplots(1, 2)
    xs = [r["batch_size"] for r in mine]
    # lines that coincide (both borrowing modes take 0 MiB) stay visible: hollow markers of different sizes
    styles = {"standard": ("#d95f02", "o", 6, "-"), "standard+borrow": ("#1b9e77", "s", 9, "--"),
              "lean": ("#7570b3", "^", 6, "-"), "chunked+borrow": ("#e7298a", "D", 5, ":")}
    for m in MEASURED_VARIANTS:
        color, marker, size, line = styles[m]
        kw = dict(marker=marker, markersize=size, color=color, linestyle=line, markerfacecolor="none", label=m)
        mem.plot(xs, [r[f"{m}_bytes"] / MB for r in mine], **kw)
        time.plot(xs, [r[f"{m}_ms"] / r["standard_ms"] if r["standard_ms"] else float("nan") for r in mine], **kw)
    time.axhline(1.0, color="grey", linewidth=0.8)
    for ax in (mem, time):
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("batch size")
        ax.grid(alpha=0.3)
    mem.set_ylim(bottom=0)  # amounts read from zero, so heights compare
    mem.set_ylabel("new device memory per step (MiB)")
    time.set_ylabel("device time / the standard step's")
    mem.legend(fontsize=8)
    mem.set_title("memory the step took")
    time.set_title("time against the plain standard step")
    fig.suptitle(title or f"EAGLE verification on the H200, {d} draft tokens")
    return fig
