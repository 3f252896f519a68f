"""Block-for-block agreement between two snapshots of the same workload, differences by cause.

The strongest test of the simulated device: run the same model code on a GPU and on the
simulator and compare the graph pools they leave. Addresses differ between devices, so
a pool is put in a canonical form first: its segments in allocation order (from the
allocator trace when there is one, else by address), each segment as its kind, size and
the ``(offset, size, state)`` of its blocks. With both traces, the traces are aligned
event by event (action, size, stream) and a segment pairs with the one the *same*
aligned ``segment_alloc`` made on the other side; without them, or for what is left,
segments pair by kind and size in allocation order. Paired segments compare block for
block:

* **agreement** — blocks (and bytes) identical in offset, size and state, over the
  larger side's count (bytes); undefined (None) when neither side has a block: nothing
  was compared;
* **differences** — every segment or block present on one side only, each named by its
  cause. Equal segments whose layouts are merely swapped between them are named as
  such (the driver's address order, see :data:`ADDRESS_ORDER`). Trace events on one
  side only are classified by where they happened (the Python frames a GPU trace
  keeps: attention, a library workspace, mixture-of-experts routing, an import, warm-up
  outside the pool, ...); a segment made for an allocation both sides made is a
  knock-on of an earlier difference, or, with none before it, left unexplained.

A *recording* is the JSON-able dict both sides produce (:func:`recording`): the pool's
segments, the compacted trace (frames reduced to a few ``file:line:function`` sites) and
the parameters that reproduce the workload.
"""

from __future__ import annotations

import collections
import dataclasses
import difflib
import gzip
import json
import os
from pathlib import Path
from typing import Iterable, Optional, Sequence

__all__ = [
    "ADDRESS_ORDER",
    "BLOCK_LAYOUT",
    "CAUSES",
    "Comparison",
    "Difference",
    "IMPORT_SIDE_EFFECT",
    "KNOCK_ON",
    "TraceAlignment",
    "align_traces",
    "canonical_segments",
    "classify",
    "compact_trace",
    "compare_recordings",
    "compare_snapshots",
    "expand_trace",
    "load_recording",
    "recording",
    "save_recording",
]

# trace actions that change what the allocator holds (free_requested is implied by free_completed)
_ACTIONS = ("segment_alloc", "alloc", "free_completed", "segment_free")
_SITE_FRAMES = 3
# frames that say how a call was made, not which code made it (the simulator's own are its "C++")
_SITE_SKIP = ("torch/utils/", "torch/nn/modules/module.py", "torch/_ops.py", "torch/overrides.py", "contextlib.py",
              "<frozen", "functools.py", "graphborrow/sim/", "graphborrow/studies/model_pools.py")


# ------------------------------------------------------------------------ recordings


def _site_of(frames: Sequence[dict]) -> str:
    """The innermost few Python frames of an allocation, as ``file.py:line:function`` < ..."""
    keep = []
    for f in frames or ():
        name = str(f.get("filename", ""))
        if not name or any(s in name for s in _SITE_SKIP) or name.endswith(".cpp") or name.endswith(".h"):
            continue
        keep.append(f"{os.path.basename(name)}:{f.get('line', 0)}:{f.get('name', '?')}")
        if len(keep) == _SITE_FRAMES:
            break
    return " < ".join(keep)


def compact_trace(entries: Iterable[dict]) -> tuple[list, list]:
    """Trace entries as rows ``[action, addr, size, stream, site]`` plus a table of sites.

    Frames shrink to a site string (index into the table, -1 for none), so a trace of tens
    of thousands of events stays a few hundred kB gzipped.
    """
    sites: list[str] = []
    index: dict[str, int] = {}
    rows = []
    for e in entries:
        action = e.get("action")
        if action not in _ACTIONS and action != "free_requested":
            continue
        site = _site_of(e.get("frames", ()))
        if site:
            if site not in index:
                index[site] = len(sites)
                sites.append(site)
            k = index[site]
        else:
            k = -1
        rows.append([action, int(e.get("addr", 0)), int(e.get("size", 0)), int(e.get("stream", 0)), k])
    return rows, sites


def expand_trace(rows: Sequence[Sequence], sites: Sequence[str] = ()) -> list[dict]:
    """The inverse of :func:`compact_trace` (sites instead of frames)."""
    out = []
    for action, addr, size, stream, k in rows:
        out.append({"action": action, "addr": addr, "size": size, "stream": stream,
                    "site": sites[k] if 0 <= k < len(sites) else ""})
    return out


def _strip_frames(segments: list[dict]) -> list[dict]:
    out = []
    for s in segments:
        s = dict(s, frames=[])
        s["blocks"] = [dict(b, frames=[]) for b in s.get("blocks", ())]
        if isinstance(s.get("segment_pool_id"), tuple):
            s["segment_pool_id"] = list(s["segment_pool_id"])
        out.append(s)
    return out


def recording(segments: list[dict], trace_entries: Optional[Iterable[dict]] = None, **fields) -> dict:
    """A JSON-able record of one run: pool segments (frames stripped), compact trace, fields."""
    rec = dict(fields)
    rec["segments"] = _strip_frames(segments)
    if trace_entries is not None:
        rec["trace"], rec["sites"] = compact_trace(trace_entries)
    return rec


def save_recording(rec: dict, path: str | Path) -> Path:
    """Write ``rec`` as gzipped JSON (``.json.gz``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt", encoding="utf-8") as f:
        json.dump(rec, f, separators=(",", ":"), default=str)
    return path


def load_recording(path: str | Path) -> dict:
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        rec = json.load(f)
    if "segments" not in rec:
        raise ValueError(f"{path} is not a pool recording: it has no 'segments' (keys: {sorted(rec)[:8]})")
    return rec


# ------------------------------------------------------------------ canonical form


@dataclasses.dataclass(frozen=True)
class CanonSegment:
    """A segment without its address: kind, size and its blocks as (offset, size, state)."""

    kind: str
    total_size: int
    blocks: tuple
    address: int

    @property
    def signature(self) -> tuple:
        return (self.kind, self.total_size)


def canonical_segments(segments: Sequence[dict], trace: Optional[Sequence[dict]] = None) -> list[CanonSegment]:
    """Segments in allocation order (the trace's last ``segment_alloc`` of each address)."""
    order: dict[int, int] = {}
    if trace:
        for i, e in enumerate(trace):
            if e["action"] == "segment_alloc":
                order[e["addr"]] = i
    canon = []
    for s in segments:
        base = int(s["address"])
        blocks, offset = [], 0
        listed = s["blocks"]
        if all("address" in b for b in listed):  # offsets from the blocks' own addresses
            listed = sorted(listed, key=lambda b: int(b["address"]))
        for b in listed:
            offset = int(b["address"]) - base if "address" in b else offset
            blocks.append((offset, int(b["size"]), b["state"]))
            offset += int(b["size"])
        canon.append(CanonSegment(s.get("segment_type", "?"), int(s["total_size"]), tuple(blocks), base))
    return sorted(canon, key=lambda c: (order.get(c.address, float("inf")), c.address))


# ------------------------------------------------------------------------- causes


@dataclasses.dataclass(frozen=True)
class Difference:
    """Something one side has and the other does not, with the reason."""

    where: str
    reference: str
    candidate: str
    cause: str


def _in_attention(site: str) -> bool:
    return "sdpa_attention" in site or "scaled_dot_product_attention" in site or "attention" in site.split(":")[0]


def _own_or_neighbour(e: dict, c: dict) -> str:
    """An event's own site; the nearest aligned events' sites only when it has none."""
    return e["site"] or c["neighbour_site"]


IMPORT_SIDE_EFFECT = ("import side effect: a module-level tensor a library creates when it is first imported, "
                      "here inside the model's torch.device('cuda') block (not an allocation of the workload)")


def _cause_rules():
    # (name, predicate(event, context)) in order; the first that holds names the cause
    return [
        (IMPORT_SIDE_EFFECT,
         lambda e, c: e["action"] == "alloc" and e["site"].split(" < ")[0].endswith(":<module>")),
        ("cuBLAS/cuBLASLt workspace: the first matmul on a stream allocates it through the caching "
         "allocator and keeps it",
         lambda e, c: e["action"] in ("alloc", "segment_alloc") and c["never_freed"]
         and e["size"] in c["workspace_sizes"]),
        ("RNG state: a graph capture registers the generator's seed and offset (8-byte device tensors)",
         lambda e, c: e["action"] == "alloc" and e["size"] == 8
         and ("graphs.py" in e["site"] or not (e["site"] or _in_attention(c["neighbour_site"])))),
        ("attention kernel: outputs, temporaries or workspace of the chosen sdpa backend",
         lambda e, c: _in_attention(_own_or_neighbour(e, c))),
        ("mixture-of-experts routing: sort / histogram / scan (CUB temporaries) or grouped-GEMM arguments",
         lambda e, c: any(k in _own_or_neighbour(e, c) for k in ("moe.py", "grouped_mm", "experts", "router"))),
        ("model construction: weights and buffers created by transformers",
         lambda e, c: any(k in e["site"] for k in ("from_config", "_init_weights", "modeling_utils", "__init__"))),
        ("warm-up outside the pool: an allocation of the eager warm-up runs on the capture stream",
         lambda e, c: not c["in_pool"]),
    ]


BLOCK_LAYOUT = "block layout differs inside a segment both sides have (see the trace causes)"
ADDRESS_ORDER = ("segment address order: equal segments hold the same layouts between them, in another order. "
                 "The driver chose other addresses for them, and the allocator's best fit takes the lowest-addressed "
                 "of equal free blocks (compare with the reference's addresses followed: "
                 "PhysicalMemory.follow_addresses)")
KNOCK_ON = ("knock-on: a segment made or released because an earlier difference changed where "
            "allocations fit")
CAUSES = tuple(name for name, _ in _cause_rules()) + (KNOCK_ON, ADDRESS_ORDER, BLOCK_LAYOUT)


def classify(event: dict, context: dict) -> str:
    """The cause of a one-sided trace event (see :data:`CAUSES`), or 'unexplained: <site>'."""
    for name, rule in _cause_rules():
        if rule(event, context):
            return name
    return f"unexplained: {event['action']} of {event['size']} bytes at {event['site'] or 'no Python frame'}"


# ---------------------------------------------------------------------- comparison


@dataclasses.dataclass
class Comparison:
    """Agreement between a reference pool (e.g. the GPU) and a candidate (the simulator)."""

    segments: tuple[int, int, int]  # reference, candidate, paired with identical size and kind
    blocks: tuple[int, int, int]  # reference, candidate, identical
    bytes: tuple[int, int, int]  # reference, candidate, in identical blocks
    differences: list[Difference]
    trace_events: tuple[int, int, int] = (0, 0, 0)  # reference, candidate, aligned

    @property
    def agreement_blocks(self) -> Optional[float]:
        """Identical blocks over the larger side's count; None when neither side has a block."""
        return _share(*self.blocks)

    @property
    def agreement_bytes(self) -> Optional[float]:
        """Bytes in identical blocks over the larger side's bytes; None when neither side has a block."""
        return _share(*self.bytes)

    @property
    def compared(self) -> bool:
        """Whether either pool has a block (else there was nothing to compare block for block)."""
        return self.agreement_blocks is not None

    @property
    def identical(self) -> bool:
        """No difference: every block of either side has its twin (two empty pools are identical)."""
        return self.agreement_blocks in (None, 1.0) and self.agreement_bytes in (None, 1.0) and not self.differences

    def causes(self) -> dict[str, int]:
        """How many differences each cause explains."""
        out: dict[str, int] = {}
        for d in self.differences:
            out[d.cause] = out.get(d.cause, 0) + 1
        return out

    def row(self) -> dict:
        """One table row (for README tables and notebooks)."""
        return {
            "segments (ref / cand / paired)": "%d / %d / %d" % self.segments,
            "blocks identical": f"{self.blocks[2]} of {max(self.blocks[0], self.blocks[1])}",
            "agreement (blocks)": None if self.agreement_blocks is None else round(self.agreement_blocks, 4),
            "agreement (bytes)": None if self.agreement_bytes is None else round(self.agreement_bytes, 4),
            "trace events aligned": "%d of %d / %d" % (self.trace_events[2], *self.trace_events[:2]),
            "differences": len(self.differences),
            "causes": "; ".join(f"{n}x {c.split(':')[0]}" for c, n in sorted(self.causes().items())),
        }

    def summary(self) -> str:
        if self.compared:
            blocks = (f"blocks identical: {self.blocks[2]} of {max(self.blocks[:2])} (agreement "
                      f"{self.agreement_blocks:.4f}); bytes {self.agreement_bytes:.4f}")
        else:
            blocks = "blocks: agreement n/a, nothing to compare (neither pool has a block)"
        lines = [
            f"segments: {self.segments[0]} reference, {self.segments[1]} candidate, {self.segments[2]} paired",
            blocks,
            f"trace events: {self.trace_events[0]} reference, {self.trace_events[1]} candidate, "
            f"{self.trace_events[2]} aligned",
        ]
        for cause, n in sorted(self.causes().items(), key=lambda kv: -kv[1]):
            lines.append(f"  {n:4d}  {cause}")
        return "\n".join(lines)


def _share(reference: int, candidate: int, same: int) -> Optional[float]:
    """``same`` over the larger side; None when both sides are empty."""
    larger = max(reference, candidate)
    return same / larger if larger else None


def _pool_ranges(segments: Sequence[dict]) -> list[tuple[int, int]]:
    return sorted((int(s["address"]), int(s["address"]) + int(s["total_size"])) for s in segments)


def _inside(addr: int, ranges) -> bool:
    return any(lo <= addr < hi for lo, hi in ranges)


def _canonical_streams(trace: Sequence[dict]) -> dict[int, int]:
    names: dict[int, int] = {0: 0}
    for e in trace:
        if e["stream"] not in names:
            names[e["stream"]] = len(names)
    return names


def _never_freed(trace: Sequence[dict]) -> set[int]:
    """Indices of alloc / segment_alloc events whose address is never freed afterwards."""
    live: dict[tuple[str, int], int] = {}
    for i, e in enumerate(trace):
        if e["action"] in ("alloc", "segment_alloc"):
            live[(e["action"], e["addr"])] = i
        elif e["action"] == "free_completed":
            live.pop(("alloc", e["addr"]), None)
        elif e["action"] == "segment_free":
            live.pop(("segment_alloc", e["addr"]), None)
    return set(live.values())


def _normalised(trace: Sequence[dict]) -> list[dict]:
    return [{"action": e["action"], "addr": int(e.get("addr", 0)), "size": int(e.get("size", 0)),
             "stream": int(e.get("stream", 0)), "site": e.get("site", "")}
            for e in trace if e.get("action") in _ACTIONS]


def _segment_owner(events: Sequence[dict], k: int) -> Optional[int]:
    """The alloc a segment_alloc was made for (the next alloc at its address), or None."""
    addr = events[k]["addr"]
    for j in range(k + 1, min(k + 4, len(events))):
        if events[j]["action"] == "alloc" and events[j]["addr"] == addr:
            return j
    return None


@dataclasses.dataclass
class TraceAlignment:
    """Two allocator traces aligned event by event on (action, size, stream).

    Addresses are left out of the key (they differ between devices); streams are
    renamed by first appearance. ``matched`` maps each aligned reference event to its
    candidate event (indices into ``reference`` / ``candidate``, the traces' allocator
    events in order).
    """

    reference: list[dict]
    candidate: list[dict]
    opcodes: list[tuple]
    matched: dict[int, int]

    @property
    def counts(self) -> tuple[int, int, int]:
        return len(self.reference), len(self.candidate), len(self.matched)


def align_traces(reference: Sequence[dict], candidate: Sequence[dict]) -> TraceAlignment:
    """Align two traces (expanded, see :func:`expand_trace`) event by event."""
    ref, cand = _normalised(reference), _normalised(candidate)
    rs, cs = _canonical_streams(ref), _canonical_streams(cand)
    a = [(e["action"], e["size"], rs[e["stream"]]) for e in ref]
    b = [(e["action"], e["size"], cs[e["stream"]]) for e in cand]
    opcodes = difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes()
    matched = {}
    for tag, i1, i2, j1, _ in opcodes:
        if tag == "equal":
            matched.update(zip(range(i1, i2), range(j1, j1 + i2 - i1)))
    return TraceAlignment(ref, cand, opcodes, matched)


def _trace_differences(alignment: TraceAlignment, ref_segments, cand_segments, workspace_sizes):
    ref, cand = alignment.reference, alignment.candidate
    rs, cs = _canonical_streams(ref), _canonical_streams(cand)
    a = [(e["action"], e["size"], rs[e["stream"]]) for e in ref]
    b = [(e["action"], e["size"], cs[e["stream"]]) for e in cand]
    aligned = {"reference": set(alignment.matched), "candidate": set(alignment.matched.values())}
    ranges = {"reference": _pool_ranges(ref_segments), "candidate": _pool_ranges(cand_segments)}
    never = {"reference": _never_freed(ref), "candidate": _never_freed(cand)}
    diffs: list[Difference] = []
    segment_causes: dict[str, dict[int, str]] = {"reference": {}, "candidate": {}}
    named_before = False
    for tag, i1, i2, j1, j2 in alignment.opcodes:
        if tag == "equal":
            continue
        # the sites of the nearest aligned events name the code around a one-sided event
        neighbour = " | ".join(
            events[k]["site"] for events, k in ((ref, i1 - 1), (ref, i2), (cand, j1 - 1), (cand, j2))
            if 0 <= k < len(events) and events[k].get("site")
        )
        # the same event on both sides of a replaced stretch was only reordered: not a difference
        shared = collections.Counter(a[i1:i2]) & collections.Counter(b[j1:j2])
        for side, events, keys, lo in (("reference", ref, a, i1), ("candidate", cand, b, j1)):
            hi = i2 if side == "reference" else j2
            reordered = collections.Counter(shared)

            def cause_of(k, action):
                e = events[k]
                cause = classify(e, {
                    "never_freed": k in never[side],
                    "workspace_sizes": workspace_sizes,
                    "in_pool": _inside(e["addr"], ranges[side]),
                    "neighbour_site": neighbour,
                })
                # segments come and go with where earlier allocations landed
                if cause.startswith("unexplained") and named_before and action != "alloc":
                    return KNOCK_ON
                return cause

            for k in range(lo, hi):
                e = events[k]
                if reordered[keys[k]] > 0:
                    reordered[keys[k]] -= 1
                    continue
                if e["action"] == "free_completed":
                    continue  # the matching alloc carries the difference
                if e["action"] == "segment_alloc":  # made for the alloc that follows it
                    owner = _segment_owner(events, k)
                    if owner is not None and owner in aligned[side]:
                        # both sides made that allocation and only one needed a new segment: an
                        # earlier difference explains it, or else the allocators disagree
                        cause = KNOCK_ON if named_before else (
                            f"unexplained: segment_alloc of {e['size']} bytes for an allocation both sides made "
                            f"(an allocator difference? replay the trace with graphborrow.fidelity.replay.replay_trace)")
                    else:
                        cause = cause_of(owner if owner is not None else k, e["action"])
                    segment_causes[side][e["addr"]] = cause
                elif e["action"] == "segment_free":  # released: whatever made it explains it
                    cause = segment_causes[side].get(e["addr"]) or cause_of(k, e["action"])
                else:
                    cause = cause_of(k, e["action"])
                text = f"{e['action']} {e['size']} B on stream {e['stream']}"
                text += f" at {e['site']}" if e["site"] else ""
                diffs.append(Difference(
                    where=f"trace event {k}",
                    reference=text if side == "reference" else "",
                    candidate=text if side == "candidate" else "",
                    cause=cause,
                ))
        named_before = named_before or any(not d.cause.startswith("unexplained") for d in diffs)
    return diffs


def _live_segment_events(events: Sequence[dict]) -> dict[int, int]:
    """Address -> index of the segment_alloc that made the segment living there at the end."""
    live: dict[int, int] = {}
    for i, e in enumerate(events):
        if e["action"] == "segment_alloc":
            live[e["addr"]] = i
        elif e["action"] == "segment_free":
            live.pop(e["addr"], None)
    return live


def _swapped_layouts(pairs) -> set:
    """Signatures whose paired segments differ, yet hold the same layouts between them."""
    by_signature: dict[tuple, tuple[list, list]] = {}
    for r, c in pairs:
        if r.blocks != c.blocks:
            by_signature.setdefault(r.signature, ([], []))
    for r, c in pairs:
        if r.signature in by_signature:
            by_signature[r.signature][0].append(r.blocks)
            by_signature[r.signature][1].append(c.blocks)
    return {sig for sig, (a, b) in by_signature.items() if sorted(a) == sorted(b)}


def _pair_by_trace(ref: list[CanonSegment], cand: list[CanonSegment], alignment: TraceAlignment):
    """Segments whose making cudaMalloc is the same aligned trace event on both sides."""
    ref_made = _live_segment_events(alignment.reference)
    cand_by_event = {i: a for a, i in _live_segment_events(alignment.candidate).items()}
    cand_at = {c.address: c for c in cand}
    pairs = []
    for r in ref:
        j = alignment.matched.get(ref_made.get(r.address, -1))
        c = cand_at.get(cand_by_event.get(j, -1)) if j is not None else None
        if c is not None and c.signature == r.signature:
            pairs.append((r, c))
    return pairs


def _pair_by_signature(ref: list[CanonSegment], cand: list[CanonSegment]):
    """Segments paired by kind and size: in allocation order first, then in any order."""
    matcher = difflib.SequenceMatcher(None, [s.signature for s in ref], [s.signature for s in cand], autojunk=False)
    pairs, left_ref, left_cand = [], [], []
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            pairs.extend(zip(ref[i1:i2], cand[j1:j2]))
        else:
            left_ref.extend(ref[i1:i2])
            left_cand.extend(cand[j1:j2])
    for r in list(left_ref):
        c = next((c for c in left_cand if c.signature == r.signature), None)
        if c is not None:
            left_ref.remove(r)
            left_cand.remove(c)
            pairs.append((r, c))
    return pairs


def compare_snapshots(reference: Sequence[dict], candidate: Sequence[dict],
                      reference_trace: Optional[Sequence[dict]] = None,
                      candidate_trace: Optional[Sequence[dict]] = None,
                      workspace_sizes: Iterable[int] = (32 * 2**20,)) -> Comparison:
    """Compare two pools' segments block for block; traces (expanded) name the causes.

    Segments pair by the trace when both are given (the segment made by the same aligned
    ``segment_alloc`` on both sides), else, and for any left over, by kind and size in
    allocation order. Paired segments agree block for block when every block has the
    same offset, size and state.

    Args:
        reference, candidate: torch-format snapshot segments of the same pool on two devices.
        reference_trace, candidate_trace: their allocator traces as dicts with ``action``,
            ``addr``, ``size``, ``stream`` and optionally ``site`` (:func:`expand_trace`).
        workspace_sizes: allocation sizes that, never freed, are library workspaces.
    Returns:
        A :class:`Comparison`; ``identical`` means every block agrees and no event differs.
    """
    ref = canonical_segments(reference, reference_trace)
    cand = canonical_segments(candidate, candidate_trace)
    alignment = None
    if reference_trace is not None and candidate_trace is not None:
        alignment = align_traces(reference_trace, candidate_trace)
    pairs = _pair_by_trace(ref, cand, alignment) if alignment is not None else []
    paired_ref = {id(r) for r, _ in pairs}
    paired_cand = {id(c) for _, c in pairs}
    pairs += _pair_by_signature([r for r in ref if id(r) not in paired_ref],
                                [c for c in cand if id(c) not in paired_cand])
    paired_ref = {id(r) for r, _ in pairs}
    paired_cand = {id(c) for _, c in pairs}
    differences: list[Difference] = []
    blocks_same = bytes_same = 0
    swapped = _swapped_layouts(pairs)
    for r, c in sorted(pairs, key=lambda p: ref.index(p[0])):
        same = set(r.blocks) & set(c.blocks)
        blocks_same += len(same)
        bytes_same += sum(size for _, size, _ in same)
        for off, size, state in sorted(set(r.blocks) ^ set(c.blocks)):
            mine = (off, size, state) in r.blocks
            text = f"{state} block of {size} B at offset {off}"
            differences.append(Difference(
                where=f"{r.kind} segment of {r.total_size} B (#{ref.index(r)} in allocation order)",
                reference=text if mine else "", candidate="" if mine else text,
                cause=ADDRESS_ORDER if r.signature in swapped else BLOCK_LAYOUT,
            ))
    for side, segs in (("reference", [r for r in ref if id(r) not in paired_ref]),
                       ("candidate", [c for c in cand if id(c) not in paired_cand])):
        for s in segs:
            text = f"{s.kind} segment of {s.total_size} B with {len(s.blocks)} blocks"
            differences.append(Difference(
                where="segment on one side only",
                reference=text if side == "reference" else "", candidate=text if side == "candidate" else "",
                cause="segment only on one side (see the trace causes)",
            ))
    trace_events = (0, 0, 0)
    if alignment is not None:
        differences.extend(_trace_differences(alignment, reference, candidate, set(workspace_sizes)))
        trace_events = alignment.counts
    n_blocks = (sum(len(s.blocks) for s in ref), sum(len(s.blocks) for s in cand), blocks_same)
    n_bytes = (sum(s.total_size for s in ref), sum(s.total_size for s in cand), bytes_same)
    return Comparison((len(ref), len(cand), len(pairs)), n_blocks, n_bytes, differences, trace_events)


def compare_recordings(reference: dict, candidate: dict) -> Comparison:
    """:func:`compare_snapshots` on two recordings (their compact traces expanded)."""
    def trace(rec):
        return expand_trace(rec["trace"], rec.get("sites", ())) if "trace" in rec else None

    sizes = {32 * 2**20, 2**20}  # torch 2.11's cuBLAS and cuBLASLt workspaces, unless recorded otherwise
    for rec in (reference, candidate):
        for key in ("blas_workspace_bytes", "blaslt_extra_bytes"):
            if rec.get(key):
                sizes.add(int(rec[key]))
    return compare_snapshots(reference["segments"], candidate["segments"], trace(reference), trace(candidate),
                             workspace_sizes=sizes)
