"""One validated reader for allocator snapshots in torch's format, whatever their source.

A snapshot comes as a path to a file: a pickle (``torch.cuda.memory._dump_snapshot``, or
:meth:`graphborrow.sim.SimBackend.dump_snapshot`) or the same dict as JSON (``.json``), either
gzipped when the name ends in ``.gz``; as the dict of ``torch.cuda.memory._snapshot()``;
or as the segment list of ``torch.cuda.memory_snapshot()``. :func:`load_snapshot` accepts
all of them, checks every segment and block, and returns ``{"segments": [...], ...}``
with the input's other keys kept. Anything that would make later arithmetic silently
wrong is refused with a :class:`~graphborrow.core.errors.SnapshotFormatError` that names
the segment and block and says what is wrong:

* a value of the wrong type (a size that is a string, a float, a bool, None); numpy
  integers are integers, and come back as Python ints (the segment and its blocks are
  then copies);
* a segment that runs past the end of the 64-bit address space;
* a block of zero or negative size, or with an unknown state;
* blocks that leave a gap, overlap, or do not start at the segment's address;
* block sizes that do not add up to ``total_size`` (or to ``allocated_size`` /
  ``active_size`` where those are given);
* segments that overlap without one lying wholly inside a free block of the other.

Nested segments are real: a MemPool whose pluggable allocator carves memory out of a
graph pool's free blocks (a borrow pool) shows up, in a snapshot of every pool, as
segments inside the graph pool's ``inactive`` blocks. They are kept, and
:func:`nested_in` tells which segment hosts which, so free-run discovery can leave
them out.

Trust: unpickling a file can run any code the file names. A snapshot file is therefore
read with an unpickler that builds only what a snapshot holds (dicts, lists, tuples,
strings, numbers, bools, None; torch's version string is read as a plain string) and
refuses any other object by name, before building it: a file from elsewhere cannot run
code here. A file refused that way that you made yourself and trust can be unpickled by
you and passed as the dict; the JSON form needs no trust at all.
"""

from __future__ import annotations

import bisect
import gzip
import json
import operator
import os
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .checks import ADDRESS_LIMIT
from .errors import SnapshotFormatError

__all__ = ["load_snapshot", "check_segments", "nested_in", "read_snapshot_file", "BLOCK_STATES", "FREE_STATE",
           "SNAPSHOT_GLOBALS", "TRUST"]

FREE_STATE = "inactive"
# torch's C++ emits active_pending_free; the _snapshot docstring says active_awaiting_free
BLOCK_STATES = ("active_allocated", "active_pending_free", "active_awaiting_free", FREE_STATE)
# The only objects other than built-in containers and scalars a snapshot file may name, and what
# each is read as: torch records its version as a TorchVersion (a str subclass).
SNAPSHOT_GLOBALS = {("torch.torch_version", "TorchVersion"): str}
TRUST = (
    "snapshot and trace files are read without running code: the unpickler builds only dicts, lists, tuples, "
    "strings, numbers, bools and None, and refuses any other object by name; a .json file (the same dict as JSON) "
    "needs no trust at all"
)
_INTEGER_KEYS = ("address", "total_size", "allocated_size", "active_size")
_HOW_TO_TAKE = (
    "take it with torch.cuda.memory_snapshot() (a list of segments), "
    "torch.cuda.memory._snapshot() (a dict) or torch.cuda.memory._dump_snapshot(path)"
)


def load_snapshot(source: Any, *, need_traces: bool = False, block_addresses: bool = True) -> dict:
    """Read and check a snapshot from a path, a ``_snapshot()`` dict or a segment list.

    Args:
        source: a ``str`` / ``os.PathLike`` naming a snapshot file (:func:`read_snapshot_file`),
            a dict with ``"segments"`` (and maybe ``"device_traces"``), or a list of
            segment dicts.
        need_traces: also require ``"device_traces"`` (a list per device of trace
            entries), as recorded after ``torch.cuda.memory._record_memory_history()``.
        block_addresses: require every block's ``"address"`` (torch writes it; free-run
            discovery reads it). With ``False`` a block without one is taken to start where
            the one before it ends, as in hand-built traces the replay reads.

    Returns:
        A new dict: ``"segments"`` is the checked segment list (the segment dicts
        themselves are not copied, unless a value had to become a Python int); the
        source dict's other keys are kept.

    Raises:
        SnapshotFormatError: naming the segment / block / trace entry and the problem.
        FileNotFoundError: the path does not exist.
    """
    origin = "snapshot"
    if isinstance(source, (str, os.PathLike)):
        origin = os.fspath(source)
        source = read_snapshot_file(source)
    if isinstance(source, Mapping):
        if "segments" not in source:
            raise SnapshotFormatError(
                f"{origin} is a dict with no 'segments' key (keys: {sorted(map(str, source))[:8]}); "
                f"it is not a memory snapshot: {_HOW_TO_TAKE}"
            )
        result = dict(source)
    elif isinstance(source, (list, tuple)):
        result = {"segments": source}
    else:
        raise SnapshotFormatError(
            f"{origin} is a {type(source).__name__}; expected a list of segment dicts or a dict "
            f"with 'segments': {_HOW_TO_TAKE}"
        )
    result["segments"] = check_segments(result["segments"], block_addresses=block_addresses)
    if need_traces or "device_traces" in result:
        _check_traces(result, required=need_traces)
    return result


class _Refused(Exception):
    """A snapshot file named an object no snapshot holds (raised before it is built)."""


class _SnapshotUnpickler(pickle.Unpickler):
    """Builds what a snapshot holds and nothing else: every object a pickle builds other than
    the built-in containers and scalars comes through ``find_class`` (extension codes too),
    and only :data:`SNAPSHOT_GLOBALS` pass it."""

    def find_class(self, module: str, name: str) -> Any:
        admitted = SNAPSHOT_GLOBALS.get((module, name))
        if admitted is None:
            raise _Refused(f"{module}.{name}")
        return admitted

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused(f"a persistent reference ({pid!r:.40})")


def read_snapshot_file(path: str | os.PathLike) -> Any:
    """The object a snapshot file holds, read without running any code from the file.

    ``.json`` (or ``.json.gz``) files are JSON; anything else is a pickle, read by an
    unpickler that builds only dicts, lists, tuples, strings, numbers, bools and None (and
    torch's version string, as a str). Files are gunzipped when their name ends in ``.gz``.

    Args:
        path: the file.

    Returns:
        What the file holds (not yet checked as a snapshot: :func:`load_snapshot` does that).

    Raises:
        FileNotFoundError: the path does not exist.
        SnapshotFormatError: the file is a directory, unreadable, not JSON / a pickle, or a
            pickle that names another kind of object (refused by name, never built).
    """
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open  # the trace corpus is stored compressed
    is_json = path.name.removesuffix(".gz").endswith(".json")
    try:
        with opener(path, "rb") as f:
            return json.load(f) if is_json else _SnapshotUnpickler(f).load()
    except FileNotFoundError:
        raise
    except IsADirectoryError:
        raise SnapshotFormatError(f"{path} is a directory; pass the snapshot file inside it") from None
    except _Refused as refused:
        raise SnapshotFormatError(
            f"{path} holds {refused}, which no memory snapshot holds; it was not built, because unpickling "
            "an object can run code the file names. If you made the file yourself and trust it, unpickle it "
            "yourself and pass the dict (load_snapshot(pickle.load(open(path, 'rb')))); for a file from "
            "elsewhere, ask for its JSON form (json.dump of torch.cuda.memory._snapshot())"
        ) from None
    except Exception as exc:  # truncated or foreign file: reading raises many kinds
        kind = "JSON" if is_json else "pickle"
        raise SnapshotFormatError(
            f"{path} is not a readable snapshot {kind} ({type(exc).__name__}: {exc}); "
            "write it with torch.cuda.memory._dump_snapshot or SimBackend.dump_snapshot"
        ) from exc


def _integer(value: Any, where: str, key: str) -> int:
    """An integer field as a Python int (numpy integers become ints; bools and floats are refused)."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise SnapshotFormatError(
        f"{where}: {key!r} is {value!r} ({type(value).__name__}); it must be an integer"
    )


def check_segments(segments: Any, *, block_addresses: bool = True) -> list:
    """Check a segment list (see the module docstring); return it as a list.

    Args:
        segments: a list (or tuple) of segment dicts in torch's snapshot format.
        block_addresses: require every block's ``"address"``; with False a block without
            one starts where the one before it ends (see :func:`load_snapshot`).

    Returns:
        The same segment dicts in a new list (the dicts are not copied).

    Raises:
        SnapshotFormatError: naming the first segment or block that is wrong.
    """
    if isinstance(segments, Mapping) or not isinstance(segments, (list, tuple)):
        raise SnapshotFormatError(
            f"'segments' is a {type(segments).__name__}; expected a list of segment dicts"
        )
    segments = [_check_segment(i, segment, block_addresses) for i, segment in enumerate(segments)]
    nested_in(segments)  # refuses partial overlaps and segments nested in live blocks
    return segments


def _as_ints(record: Mapping, keys) -> Mapping:
    """``record`` itself when its integer fields are Python ints, else a copy where they are."""
    odd = [k for k in keys if k in record and type(record[k]) is not int]
    if not odd:
        return record
    copy = dict(record)
    for k in odd:
        copy[k] = operator.index(copy[k])  # checked to be an integer already
    return copy


def _check_segment(i: int, segment: Any, block_addresses: bool = True) -> Mapping:
    """Check one segment; returns it, or a copy whose integers are Python ints."""
    where = f"segment {i}"
    if not isinstance(segment, Mapping):
        raise SnapshotFormatError(f"{where} is a {type(segment).__name__}, not a dict")
    for key in ("address", "total_size", "blocks"):
        if key not in segment:
            hint = (
                "; take the snapshot with torch.cuda.memory_snapshot(), which lists blocks per segment"
                if key == "blocks" else ""
            )
            raise SnapshotFormatError(f"{where} has no {key!r}{hint}")
    address = _integer(segment["address"], where, "address")
    if address <= 0:
        raise SnapshotFormatError(f"{where}: address {address} is not a positive device address")
    where = f"segment {i} (address {address:#x})"
    total = _integer(segment["total_size"], where, "total_size")
    if total <= 0:
        raise SnapshotFormatError(f"{where}: total_size {total} is not positive")
    if address + total >= ADDRESS_LIMIT:  # a range's end lies below the limit too, as the arena's extents
        raise SnapshotFormatError(
            f"{where}: its {total} bytes run past the end of the 64-bit address space "
            f"(to {address + total:#x}); no device address lies there")
    pool = segment.get("segment_pool_id")
    if pool is not None and (not isinstance(pool, (list, tuple)) or len(pool) != 2
                             or any(isinstance(x, bool) or not hasattr(type(x), "__index__") for x in pool)):
        raise SnapshotFormatError(f"{where}: segment_pool_id {pool!r:.60} is not a pool id; torch writes two "
                                  "integers, e.g. (0, 1)")
    blocks = segment["blocks"]
    if not isinstance(blocks, (list, tuple)) or not blocks:
        raise SnapshotFormatError(f"{where}: 'blocks' must be a non-empty list, got {blocks!r:.60}")
    at = address
    allocated = active = 0
    converted = False  # a block held a numpy integer: the blocks become copies with ints
    for j, block in enumerate(blocks):
        here = f"{where} block {j}"
        if not isinstance(block, Mapping):
            raise SnapshotFormatError(f"{here} is a {type(block).__name__}, not a dict")
        needed = ("address", "size", "state") if block_addresses else ("size", "state")
        missing = [k for k in needed if k not in block]
        if missing:
            raise SnapshotFormatError(
                f"{here} lacks {', '.join(repr(k) for k in missing)}; "
                f"every block needs {', '.join(repr(k) for k in needed)}"
            )
        start = _integer(block["address"], here, "address") if "address" in block else at
        size = _integer(block["size"], here, "size")
        converted = converted or type(block["size"]) is not int or type(block.get("address", 0)) is not int
        state = block["state"]
        if size <= 0:
            raise SnapshotFormatError(f"{here} has size {size}; block sizes are positive")
        if state not in BLOCK_STATES:
            raise SnapshotFormatError(f"{here} has state {state!r}; known states: {', '.join(BLOCK_STATES)}")
        if start != at:
            if j == 0:
                problem = f"starts at {start:#x}, not at its segment's address"
            elif start > at:
                problem = f"starts {start - at} bytes after block {j - 1} ends: a gap no block covers"
            else:
                problem = f"starts {at - start} bytes inside block {j - 1}: blocks overlap"
            raise SnapshotFormatError(f"{here} (address {start:#x}) {problem}")
        at = start + size
        if state == "active_allocated":
            allocated += size
        if state != FREE_STATE:
            active += size
    if at - address != total:
        raise SnapshotFormatError(
            f"{where}: its blocks cover {at - address} bytes but total_size is {total}"
        )
    for key, value in (("allocated_size", allocated), ("active_size", active)):
        if key in segment and _integer(segment[key], where, key) != value:
            raise SnapshotFormatError(
                f"{where}: {key} is {segment[key]} but its blocks add up to {value}"
            )
    if converted:
        segment = {**segment, "blocks": [_as_ints(b, ("address", "size")) for b in blocks]}
    return _as_ints(segment, _INTEGER_KEYS)


def nested_in(segments: list) -> dict[int, int]:
    """``{inner index: host index}`` for segments lying inside another's free block.

    Expects checked segments. Raises SnapshotFormatError for two segments that overlap
    otherwise: partly, or with the inner one over a block that is not free.

    Args:
        segments: checked segment dicts (see :func:`check_segments`).

    Returns:
        For each nested segment's index, the index of the segment whose free block holds
        it; empty when no segment is nested. Free-run discovery cuts these out of the
        host's runs so no byte counts twice.

    Raises:
        SnapshotFormatError: two segments overlap without one nesting in a free block.
    """
    def wholly_free(k: int) -> bool:
        blocks = segments[k]["blocks"]
        return len(blocks) == 1 and blocks[0]["state"] == FREE_STATE

    # by address, larger first; of two equal ranges, the wholly free one is the host
    order = sorted(
        range(len(segments)),
        key=lambda k: (segments[k]["address"], -segments[k]["total_size"], not wholly_free(k)),
    )
    hosts: dict[int, int] = {}
    starts: dict[int, list[int]] = {}  # a host's block starts, for bisection (built when first needed)
    open_: list[int] = []  # segments containing the current address, outermost first
    for k in order:
        start = segments[k]["address"]
        end = start + segments[k]["total_size"]
        while open_ and segments[open_[-1]]["address"] + segments[open_[-1]]["total_size"] <= start:
            open_.pop()
        if open_:
            host = open_[-1]
            h = segments[host]
            if end > h["address"] + h["total_size"]:
                raise SnapshotFormatError(
                    f"segment {k} [{start:#x}, {end:#x}) and segment {host} "
                    f"[{h['address']:#x}, {h['address'] + h['total_size']:#x}) overlap partly; "
                    "segments are disjoint, or one lies inside a free block of the other"
                )
            if (start, end) == (h["address"], h["address"] + h["total_size"]) and \
                    tuple(segments[k].get("segment_pool_id", ())) == tuple(h.get("segment_pool_id", ())):
                raise SnapshotFormatError(
                    f"segment {k} repeats segment {host} [{start:#x}, {end:#x}) in the same pool; a snapshot lists "
                    "each segment once (were two snapshots joined?)")
            block, at = _block_at(h, start, starts)
            if block["state"] != FREE_STATE or end > at + block["size"]:
                raise SnapshotFormatError(
                    f"segment {k} [{start:#x}, {end:#x}) lies inside segment {host} but not inside "
                    f"one of its free blocks (block at {at:#x} is {block['state']}, "
                    f"{block['size']} bytes); memory cannot belong to two live blocks"
                )
            hosts[k] = host
        open_.append(k)
    return hosts


def _block_at(segment: Mapping, address: int, starts: dict) -> tuple[Mapping, int]:
    """The block of a checked segment that holds ``address``, and the block's start.

    ``starts`` caches each segment's block starts (keyed by ``id``), so a host with many
    nested segments is bisected, not walked once per nested segment."""
    key = id(segment)
    if key not in starts:
        at, mine = segment["address"], []
        for block in segment["blocks"]:
            mine.append(at)
            at += block["size"]
        starts[key] = mine
    j = bisect.bisect_right(starts[key], address) - 1
    if j < 0 or address >= starts[key][j] + segment["blocks"][j]["size"]:
        raise AssertionError("address outside a checked segment")
    return segment["blocks"][j], starts[key][j]


_TRACE_NEEDS = {"oom": ("device_free", "size"), "annotate": ()}


def _check_traces(snapshot: dict, required: bool) -> None:
    traces = snapshot.get("device_traces")
    if traces is None:
        raise SnapshotFormatError(
            "the snapshot has no 'device_traces'; call torch.cuda.memory._record_memory_history() "
            "before the work, then take torch.cuda.memory._snapshot() (segments alone hold no history)"
        )
    if not isinstance(traces, (list, tuple)) or not all(isinstance(t, (list, tuple)) for t in traces):
        raise SnapshotFormatError("'device_traces' must be a list (one per device) of lists of trace entries")
    if required and not any(traces):
        raise SnapshotFormatError(
            "'device_traces' is empty: no history was recorded; call "
            "torch.cuda.memory._record_memory_history() before the work you want traced"
        )
    checked = []
    for d, entries in enumerate(traces):
        out = []
        for e, entry in enumerate(entries):
            where = f"device_traces[{d}][{e}]"
            if not isinstance(entry, Mapping) or not isinstance(entry.get("action"), str):
                raise SnapshotFormatError(f"{where} is not a trace entry (a dict with an 'action' string)")
            keys = _TRACE_NEEDS.get(entry["action"], ("addr", "size", "stream"))
            for key in keys:
                if key not in entry:
                    raise SnapshotFormatError(f"{where} ({entry['action']}) lacks {key!r}")
                if _integer(entry[key], f"{where} ({entry['action']})", key) < 0:
                    raise SnapshotFormatError(f"{where} ({entry['action']}) has {key} {entry[key]}; addresses, "
                                              "sizes and streams in a trace are never negative")
            entry = _as_ints(entry, keys)
            if "addr" in keys and "size" in keys and entry["addr"] + entry["size"] >= ADDRESS_LIMIT:
                raise SnapshotFormatError(
                    f"{where} ({entry['action']}): [{entry['addr']:#x}, +{entry['size']}) runs past the end "
                    "of the 64-bit address space; no device address lies there")
            out.append(entry)
        checked.append(out)
    snapshot["device_traces"] = checked
