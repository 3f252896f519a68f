"""Replay a recorded allocator trace on the simulated allocator and measure agreement.

Input is what ``torch.cuda.memory._snapshot()`` returns after
``torch.cuda.memory._record_memory_history()`` (or a pickle of it). Each traced event is
driven into a fresh :class:`CachingAllocator` whose memory is told the segment addresses
the trace recorded. The replay checks, event by event, that the simulated allocator picks
the same block, creates a segment exactly when the trace does (same address and size),
releases the same segments in an ``empty_cache``, and keeps cross-stream frees pending
until the trace completes them. Finally the simulated segments are compared with the
snapshot's. The trace has no pool ids, so each segment's pool is inferred (see
``_plan``): from the final snapshot when the segment is still alive, as a
pluggable-allocator pool when it lies inside another live segment, else the default pool.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass, field
from typing import Any

from sortedcontainers import SortedList

from ..errors import SnapshotFormatError
from .allocator import DEFAULT_POOL, CachingAllocator
from .memory import GRANULE, PhysicalMemory
from .streams import Clockwork

_SKIPPED_ACTIONS = {"snapshot", "oom", "annotate", "user_defined"}
_EXPANDABLE_ACTIONS = {"segment_map", "segment_unmap"}
_REPLAY_BASE = 1 << 60  # undictated simulated segments land far above any traced address


@dataclass
class ReplayReport:
    """How far the simulated allocator reproduced a recorded trace."""

    agreement: float  # matching checks / checks, in 0..1
    mismatches: list[str] = field(default_factory=list)
    events: int = 0  # trace entries read
    checks: int = 0

    def __str__(self) -> str:
        head = f"agreement {self.agreement:.4f} ({self.checks - len(self.mismatches)}/{self.checks} checks, {self.events} events)"
        return "\n".join([head, *self.mismatches[:20]] + (["..."] if len(self.mismatches) > 20 else []))


def load_snapshot(snapshot: Any) -> dict:
    """A ``_snapshot()`` dict from a dict or a path to its pickle."""
    if isinstance(snapshot, (str, os.PathLike)):
        with open(snapshot, "rb") as f:
            snapshot = pickle.load(f)
    if not isinstance(snapshot, dict) or "segments" not in snapshot or "device_traces" not in snapshot:
        raise SnapshotFormatError(
            "expected the dict written by torch.cuda.memory._snapshot() (keys 'segments' and "
            "'device_traces'); record it after torch.cuda.memory._record_memory_history()"
        )
    return snapshot


# ----------------------------------------------------------------------------- planning


class _Segment:
    """One traced segment's life: where, how big, which pool, whether it sits inside another."""

    __slots__ = ("address", "size", "stream", "alloc_index", "free_index", "nested", "pool")

    def __init__(self, address: int, size: int, stream: int, alloc_index: int, nested: bool) -> None:
        self.address, self.size, self.stream = address, size, stream
        self.alloc_index, self.free_index = alloc_index, None
        self.nested = nested
        self.pool = DEFAULT_POOL

    @property
    def end(self) -> int:
        return self.address + self.size


class _LiveSegments:
    """Live traced segments by address; finds the innermost one containing an address."""

    def __init__(self) -> None:
        self._by_start = SortedList(key=lambda s: (s.address, -s.size))

    def add(self, segment: _Segment) -> None:
        self._by_start.add(segment)

    def remove(self, segment: _Segment) -> None:
        self._by_start.remove(segment)

    def find(self, address: int, size: int) -> _Segment | None:
        """The live segment with this exact address and size."""
        for segment in self._by_start.irange_key((address, -size), (address, -size)):
            return segment
        return None

    def innermost(self, start: int, end: int) -> _Segment | None:
        """The innermost live segment containing [start, end)."""
        i = self._by_start.bisect_key_right((start, float("inf")))
        for segment in reversed(self._by_start[max(0, i - 64):i]):
            if segment.address <= start and end <= segment.end:
                return segment
        for segment in reversed(self._by_start[:max(0, i - 64)]):
            if segment.address <= start and end <= segment.end:
                return segment
        return None

    def __iter__(self):
        return iter(self._by_start)


def _not_empty_at_start(index: int, what: str) -> ValueError:
    return ValueError(
        f"trace entry {index} ({what}) refers to memory allocated before the trace begins: the trace does not "
        "start at an empty allocator (its oldest entries were dropped by the ring buffer, or history was "
        "enabled after the first allocation). Call torch.cuda.memory._record_memory_history(max_entries=N) "
        "before any CUDA allocation, with N larger than the number of allocator events."
    )


def _plan(entries: list[dict], final_segments: list[dict]) -> tuple[list[_Segment], dict[int, _Segment]]:
    """Walk the trace once: segment lives, nesting, inferred pools; reject truncated traces."""
    live = _LiveSegments()
    segments: list[_Segment] = []
    by_alloc_index: dict[int, _Segment] = {}
    live_blocks: dict[int, int] = {}
    run = -1
    for i, entry in enumerate(entries):
        action = entry.get("action")
        if action in _EXPANDABLE_ACTIONS:
            raise ValueError(
                f"trace entry {i} is {action!r}: the trace was recorded with expandable segments, which the "
                "simulated allocator does not model; record it with expandable_segments:False"
            )
        addr, size = entry.get("addr", 0), entry.get("size", 0)
        if action == "segment_alloc":
            host = live.innermost(addr, addr + size)
            segment = _Segment(addr, size, entry.get("stream", 0), i, nested=host is not None)
            live.add(segment)
            segments.append(segment)
            by_alloc_index[i] = segment
        elif action == "segment_free":
            segment = live.find(addr, size)
            if segment is None:
                raise _not_empty_at_start(i, f"segment_free of {size} bytes at {addr:#x}")
            if i == 0 or entries[i - 1].get("action") != "segment_free":
                run += 1
            segment.free_index = i
            if segment.nested:
                segment.pool = (-1, run)  # one pluggable pool per release run, renamed below
            live.remove(segment)
        elif action == "alloc":
            if live.innermost(addr, addr + max(size, 1)) is None:
                raise _not_empty_at_start(i, f"alloc at {addr:#x} outside every traced segment")
            live_blocks[addr] = live_blocks.get(addr, 0) + 1
        elif action in ("free_requested", "free_completed"):
            if live_blocks.get(addr, 0) <= 0:
                raise _not_empty_at_start(i, f"{action} of {addr:#x}")
            if action == "free_completed":
                live_blocks[addr] -= 1
    final = {(s["address"], s["total_size"]): s for s in final_segments}
    for segment in live:
        info = final.pop((segment.address, segment.size), None)
        if info is not None:
            segment.pool = tuple(info.get("segment_pool_id", DEFAULT_POOL))
    if final:
        (address, size), _ = next(iter(final.items()))
        raise ValueError(
            f"the snapshot has a segment of {size} bytes at {address:#x} that the trace never allocated: the "
            "trace does not start at an empty allocator. Record with torch.cuda.memory._record_memory_history("
            "max_entries=N) enabled before the first CUDA allocation and N above the number of events."
        )
    # synthetic ids for pluggable pools that were released during the trace
    taken = {s.pool for s in segments}
    next_free = max([p[1] for p in taken] + [0]) + 1
    renamed: dict[tuple[int, int], tuple[int, int]] = {}
    for segment in segments:
        if segment.pool[0] == -1:
            if segment.pool not in renamed:
                renamed[segment.pool] = (0, next_free)
                next_free += 1
            segment.pool = renamed[segment.pool]
    return segments, by_alloc_index


# ----------------------------------------------------------------------------- replay


class _TracedAddresses:
    """raw_alloc / raw_delete for replayed pluggable pools: hands out the addresses the trace recorded."""

    def __init__(self) -> None:
        self.expected: int | None = None
        self._spare = _REPLAY_BASE * 2

    def raw_alloc(self, nbytes: int, stream: int) -> int:
        if self.expected is not None:
            address, self.expected = self.expected, None
            return address
        address = self._spare
        self._spare += -(-nbytes // GRANULE) * GRANULE
        return address

    def raw_delete(self, address: int, nbytes: int, stream: int) -> None:
        pass


def _route_everything(stream: int, thread: int) -> bool:
    return True


class _Replayer:
    def __init__(self, entries: list[dict], final_segments: list[dict]) -> None:
        self.entries = entries
        self.final_segments = final_segments
        self.segments, self.by_alloc_index = _plan(entries, final_segments)
        self.pluggable = {s.pool for s in self.segments if s.nested}
        self.memory = PhysicalMemory(capacity=2**62, backed=False, base=_REPLAY_BASE)
        self.clockwork = Clockwork()
        self.sim = CachingAllocator(self.memory, self.clockwork)
        self.traced_addresses = _TracedAddresses()
        self.live = _LiveSegments()
        self.blocks: dict[int, list] = {}  # traced address -> simulated blocks alive there
        self.pending: dict[int, list] = {}  # traced address -> [(block, phantom stream)] awaiting completion
        streams = [e.get("stream", 0) for e in entries] + [0]
        self._next_phantom = max(s for s in streams if isinstance(s, int)) + 1
        self._idle_phantoms: list = []
        self.checks = 0
        self.mismatches: list[str] = []

    def check(self, ok: bool, message: str) -> None:
        self.checks += 1
        if not ok:
            self.mismatches.append(message)

    # --------------------------------------------------------------- pools

    def _ensure_pool(self, pool_id: tuple[int, int]) -> None:
        if pool_id != DEFAULT_POOL and pool_id not in self.sim.graph_pools:
            allocator = self.traced_addresses if pool_id in self.pluggable else None
            self.sim.create_or_incref_pool(pool_id, allocator=allocator)

    def _malloc(self, pool_id: tuple[int, int], size: int, stream: int):
        if pool_id == DEFAULT_POOL:
            return self.sim.malloc(size, stream)
        self._ensure_pool(pool_id)
        self.sim.begin_allocate_to_pool(pool_id, _route_everything)
        try:
            return self.sim.malloc(size, stream)
        finally:
            self.sim.end_allocate_to_pool(pool_id)
            self.sim.release_pool(pool_id)

    def _phantom_stream(self):
        """A stream that stays busy until the replay says its work is done."""
        stream = self._idle_phantoms.pop() if self._idle_phantoms else self.clockwork.new_stream(self._next_phantom)
        if stream.id == self._next_phantom:
            self._next_phantom += 1
        stream.enqueue(1.0)
        return stream

    # --------------------------------------------------------------- events

    def run(self) -> ReplayReport:
        entries = self.entries
        i = 0
        while i < len(entries):
            entry = entries[i]
            action = entry.get("action")
            if action == "segment_alloc":
                i = self._alloc(i)
            elif action == "alloc":
                i = self._alloc(i)
            elif action == "free_requested":
                self._free_requested(i)
            elif action == "free_completed":
                self._free_completed(i)
            elif action == "segment_free":
                i = self._segment_free_run(i)
                continue
            elif action not in _SKIPPED_ACTIONS:
                raise SnapshotFormatError(f"trace entry {i} has an unknown action {action!r}")
            i += 1
        self._compare_final()
        agreement = 1.0 if self.checks == 0 else 1.0 - len(self.mismatches) / self.checks
        return ReplayReport(agreement, self.mismatches, len(entries), self.checks)

    def _alloc(self, i: int) -> int:
        entries = self.entries
        traced_segment = None
        if entries[i]["action"] == "segment_alloc":
            traced_segment = self.by_alloc_index[i]
            self.live.add(traced_segment)
            i += 1
            if i >= len(entries) or entries[i].get("action") != "alloc":
                # a segment without its allocation (e.g. an OOM later in the same malloc)
                self.check(False, f"event {i - 1} segment_alloc: no alloc follows; cannot replay it")
                return i - 1
            self._dictate(traced_segment, i - 1)
        entry = entries[i]
        addr, size, stream = entry["addr"], entry["size"], entry.get("stream", 0)
        if traced_segment is not None:
            pool_id = traced_segment.pool
        else:
            host = self.live.innermost(addr, addr + max(size, 1))
            pool_id = host.pool if host is not None else DEFAULT_POOL
        segments_before = self.sim.stats.num_device_alloc
        try:
            block = self._malloc(pool_id, size, stream)
        except (RuntimeError, ValueError) as error:  # OutOfMemoryError is a RuntimeError
            self.check(False, f"event {i} alloc {size} B on stream {stream} in pool {pool_id}: simulator raised {error}")
            return i
        finally:
            self.memory.expect_next_address(None)
            self.traced_addresses.expected = None
        created = self.sim.stats.num_device_alloc != segments_before
        expected_seg = None if traced_segment is None else (traced_segment.address, traced_segment.size)
        simulated_seg = (block.segment.address, block.segment.size) if created else None
        self.check(
            expected_seg == simulated_seg,
            f"event {i} alloc {size} B on stream {stream} in pool {pool_id}: expected new segment "
            f"{_fmt_seg(expected_seg)}, simulated {_fmt_seg(simulated_seg)}",
        )
        self.check(
            block.ptr == addr,
            f"event {i} alloc {size} B on stream {stream} in pool {pool_id}: expected block at {addr:#x}, "
            f"simulated {block.ptr:#x}",
        )
        self.blocks.setdefault(addr, []).append(block)
        return i

    def _dictate(self, segment: _Segment, i: int) -> None:
        if segment.pool in self.pluggable:
            self.traced_addresses.expected = segment.address
            return
        if self.memory.overlaps(segment.address, -(-segment.size // GRANULE) * GRANULE):
            self.check(False, f"event {i} segment_alloc at {segment.address:#x}: the simulator still holds memory there")
            return
        self.memory.expect_next_address(segment.address)

    def _take_block(self, addr: int, requested: int):
        candidates = self.blocks.get(addr)
        if not candidates:
            return None
        for j in range(len(candidates) - 1, -1, -1):
            if candidates[j].requested_size == requested and candidates[j].allocated:
                return candidates.pop(j)
        return candidates.pop()

    def _free_requested(self, i: int) -> None:
        entry = self.entries[i]
        addr, size = entry["addr"], entry["size"]
        block = self._take_block(addr, size)
        if block is None or not block.allocated:
            self.check(False, f"event {i} free_requested {addr:#x}: the simulator has no allocated block there")
            return
        following = self.entries[i + 1] if i + 1 < len(self.entries) else {}
        if following.get("action") == "free_completed" and following.get("addr") == addr:
            self.sim.free(block)  # a plain free: completes at once
            return
        phantom = self._phantom_stream()
        self.sim.record_stream(block, phantom.id)
        self.sim.free(block)
        self.pending.setdefault(addr, []).append((block, phantom))

    def _free_completed(self, i: int) -> None:
        entry = self.entries[i]
        previous = self.entries[i - 1] if i else {}
        addr = entry["addr"]
        if previous.get("action") == "free_requested" and previous.get("addr") == addr:
            return  # the plain free handled at free_requested
        waiting = self.pending.get(addr)
        if not waiting:
            self.check(False, f"event {i} free_completed {addr:#x}: no cross-stream free is pending there")
            return
        block, phantom = waiting.pop(0)
        self.check(
            block.state == "active_pending_free",
            f"event {i} free_completed {addr:#x}: expected the block pending until now, simulated {block.state}",
        )
        phantom.synchronize()
        if not self.sim.captures_underway:
            self.sim.process_events()
        self._idle_phantoms.append(phantom)

    def _segment_free_run(self, i: int) -> int:
        entries = self.entries
        j = i
        expected = set()
        pools = set()
        while j < len(entries) and entries[j].get("action") == "segment_free":
            segment = self.live.find(entries[j]["addr"], entries[j]["size"])
            self.live.remove(segment)
            expected.add((segment.address, segment.size))
            pools.add(segment.pool)
            j += 1
        for pool_id in pools:
            private = self.sim.graph_pools.get(pool_id)
            if private is not None and private.use_count > 0:
                self.sim.release_pool(pool_id)  # the trace shows this pool being given back
        before = {(s.address, s.size) for s in self.sim.segments()}
        only = next(iter(pools)) if len(pools) == 1 and DEFAULT_POOL not in pools else None
        try:
            self.sim.empty_cache(only)
        except RuntimeError as error:
            self.check(False, f"events {i}..{j - 1} segment_free: simulator raised {error}")
            return j
        after = {(s.address, s.size) for s in self.sim.segments()}
        released = before - after
        self.check(
            released == expected,
            f"events {i}..{j - 1} empty_cache: expected to release {_fmt_set(expected)}, simulated {_fmt_set(released)}",
        )
        return j

    def _compare_final(self) -> None:
        simulated = {(s["address"], s["total_size"]): s for s in self.sim.snapshot()}
        for segment in self.final_segments:
            key = (segment["address"], segment["total_size"])
            mine = simulated.get(key)
            want = [(b["size"], b["state"]) for b in segment["blocks"]]
            got = None if mine is None else [(b["size"], b["state"]) for b in mine["blocks"]]
            self.check(
                want == got,
                f"final snapshot segment {_fmt_seg(key)}: expected blocks {want}, simulated {got}",
            )


def _fmt_seg(seg: tuple[int, int] | None) -> str:
    return "none" if seg is None else f"{seg[1]} B at {seg[0]:#x}"


def _fmt_set(segments: set) -> str:
    return "{" + ", ".join(_fmt_seg(s) for s in sorted(segments)) + "}"


def replay_trace(snapshot: Any, device: int | None = None) -> ReplayReport:
    """Replay ``snapshot``'s device trace on a fresh simulated allocator; see the module docstring.

    Raises ValueError when the trace does not start at an empty allocator (ring buffer
    overflow or history enabled late) or was recorded with expandable segments.
    """
    snapshot = load_snapshot(snapshot)
    traces = snapshot["device_traces"]
    if device is None:
        busy = [d for d, trace in enumerate(traces) if trace]
        if len(busy) > 1:
            raise ValueError(f"the snapshot has traces for devices {busy}; pass device= to choose one")
        device = busy[0] if busy else 0
    if device >= len(traces):
        raise ValueError(f"the snapshot has traces for {len(traces)} device(s); device {device} is not among them")
    entries = list(traces[device])
    final_segments = [s for s in snapshot["segments"] if s.get("device", 0) == device]
    return _Replayer(entries, final_segments).run()
