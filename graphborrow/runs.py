"""Free-run discovery: where a graph pool is idle, read from an allocator snapshot.

A *run* is a maximal stretch of consecutive ``inactive`` blocks inside one segment.
Runs never cross segments (segments need not be adjacent in address space) and never
cover ``active_allocated`` or ``active_pending_free`` blocks (the latter still wait for
another stream's work). Two policies:

``"runs"``            every segment counts, mixed ones included.
``"whole_segments"``  only segments with nothing allocated (the first upstream rule);
                      one live block hides its whole segment.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any, Iterable, Mapping

from .errors import SnapshotFormatError

POLICIES = ("runs", "whole_segments")
_BLOCK_KEYS = ("state", "size", "address")


def _segments_of(snapshot: Any) -> list[Mapping]:
    if isinstance(snapshot, (str, Path)):
        snapshot = load_snapshot(snapshot)
    if isinstance(snapshot, Mapping):
        if "segments" not in snapshot:
            raise SnapshotFormatError(
                "snapshot dict has no 'segments' key; pass torch.cuda.memory_snapshot() "
                "or the dict of torch.cuda.memory._snapshot()"
            )
        snapshot = snapshot["segments"]
    if not isinstance(snapshot, (list, tuple)):
        raise SnapshotFormatError(
            f"expected a list of segment dicts, got {type(snapshot).__name__}"
        )
    return list(snapshot)


def load_snapshot(path: str | Path) -> dict:
    """Read a pickle written by ``torch.cuda.memory._dump_snapshot`` (or ours)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            data = pickle.load(f)
    except FileNotFoundError:
        raise
    except Exception as exc:  # truncated or foreign file
        raise SnapshotFormatError(
            f"{path} is not a readable snapshot pickle ({type(exc).__name__}: {exc}); "
            "write it with torch.cuda.memory._dump_snapshot or graphborrow.sim.export.dump_snapshot"
        ) from exc
    if isinstance(data, list):
        data = {"segments": data}
    if not isinstance(data, dict) or "segments" not in data:
        raise SnapshotFormatError(f"{path} holds no 'segments'; it is not a memory snapshot")
    return data


def _check_segment(i: int, segment: Mapping) -> None:
    if not isinstance(segment, Mapping):
        raise SnapshotFormatError(f"segment {i} is a {type(segment).__name__}, not a dict")
    if "blocks" not in segment:
        raise SnapshotFormatError(
            f"segment {i} (address {segment.get('address', '?')}) has no 'blocks'; "
            "take the snapshot with torch.cuda.memory_snapshot(), which lists blocks per segment"
        )
    for j, block in enumerate(segment["blocks"]):
        missing = [k for k in _BLOCK_KEYS if k not in block]
        if missing:
            raise SnapshotFormatError(
                f"segment {i} block {j} lacks {', '.join(repr(k) for k in missing)}; "
                "every block needs 'address', 'size' and 'state'"
            )


def find_free_runs(segments: Any, policy: str = "runs") -> list[tuple[int, int]]:
    """``(address, nbytes)`` of every free run, largest first (lowest address on ties)."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    runs: list[tuple[int, int]] = []
    for i, segment in enumerate(_segments_of(segments)):
        _check_segment(i, segment)
        blocks = segment["blocks"]
        if policy == "whole_segments" and any(b["state"] != "inactive" for b in blocks):
            continue
        start, length = 0, 0
        for block in blocks:
            if block["state"] == "inactive":
                if length == 0:
                    start = block["address"]
                length += block["size"]
            elif length:
                runs.append((start, length))
                length = 0
        if length:
            runs.append((start, length))
    runs.sort(key=lambda r: (-r[1], r[0]))
    return runs


def summarize(segments: Any) -> dict[str, int]:
    """Reserved, allocated and free bytes of a segment list, and the runs by policy."""
    segs = _segments_of(segments)
    for i, s in enumerate(segs):
        _check_segment(i, s)
    reserved = sum(b["size"] for s in segs for b in s["blocks"])
    inactive = sum(b["size"] for s in segs for b in s["blocks"] if b["state"] == "inactive")
    runs = find_free_runs(segs, "runs")
    whole = find_free_runs(segs, "whole_segments")
    return {
        "segments": len(segs),
        "reserved_bytes": reserved,
        "inactive_bytes": inactive,
        "runs": len(runs),
        "run_bytes": sum(n for _, n in runs),
        "largest_run": runs[0][1] if runs else 0,
        "whole_segment_runs": len(whole),
        "whole_segment_bytes": sum(n for _, n in whole),
    }


def runs_total(runs: Iterable[tuple[int, int]]) -> int:
    return sum(n for _, n in runs)
