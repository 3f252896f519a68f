"""Numbers measured on a real H200, read from ``data/``, and set beside this run's.

Every file under ``data/`` carries the torch version, the device and the command that
produced it; this module only reads them, so CPU-only readers see real numbers next to
the simulated ones.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Mapping

from .package_data import data_dir as shipped_data_dir
from .sizes import MB


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
