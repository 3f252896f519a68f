"""Replay a recorded allocator trace on the simulated allocator and measure agreement.

Input is what ``torch.cuda.memory._snapshot()`` returns after
``torch.cuda.memory._record_memory_history()`` (a dict, or a pickle of it, gzipped or not):
its device trace, final segments and ``allocator_settings`` (the settings that were in
force; they configure the simulated allocator). The trace is driven, operation by
operation, into a fresh :class:`CachingAllocator` whose memory is told the addresses the
trace recorded, and the entries the simulated allocator writes are compared with the
recorded ones: the block each allocation got, every segment allocated, mapped, released
or unmapped (also inside an allocation: garbage collection, oversize releases, the
out-of-memory retry), cross-stream frees that stay pending until the trace completes
them, and out-of-memory failures. After the last entry the simulated segments and blocks
are compared with the snapshot's, so a trace that stops early (or contradicts its
snapshot) never replays at 1.0, and a trace with nothing to check reports 0.

What the trace does not say is decided by consistency with what it does say, and
reported (:attr:`ReplayReport.inferred`):

- **Pools.** A segment alive at the end has its pool in the snapshot. Any other new
  segment (or expandable reservation) goes to a pool that, at that moment, had no cached
  block for the request: the pool of the previous allocation, the default pool, a recent
  private pool, or a new one, in that order. A choice that later evidence contradicts (the
  simulated allocator picks a block of that segment where the real one did not, or an
  ``empty_cache`` releases it where the real one did not) is refuted, and the trace is
  replayed again without it.
- **Releases.** A run of ``segment_free`` / ``segment_unmap`` entries is part of the next
  allocation when that allocation could not have got device memory without it (memory
  fraction, garbage collection); otherwise it is an ``empty_cache``, of one pool when it
  releases only that pool's segments while others were releasable (a MemPool going away).
- **Mid-run traces** (history enabled late, or a ring buffer that overflowed): the state
  at the first entry is rebuilt from the snapshot and the trace (segments released or
  unmapped without being allocated, blocks freed without being allocated, blocks alive
  in the snapshot that the trace never allocated) and restored into the allocator;
  expandable memory as the ranges mapped at the first entry (the snapshot's, less what the
  trace mapped, plus what it unmapped), one reservation per stream, kind and pool, each
  starting at its lowest range or, below a rebuilt reservation, where the driver's
  end-to-end layout puts it (``RESERVATION_ALIGNMENT``). Pages the trace maps or unmaps
  belong to a reservation of their stream and kind only, and one from before the trace
  ends when every page it could have held is unmapped (the allocator releases it then):
  a later reservation at the same address is a new one, with the snapshot's pool.
  Where that state is a guess (the size of a block allocated before the trace, the pool of
  a segment the snapshot does not name), checks that depend on it are not made but
  counted (:attr:`ReplayReport.unverifiable`). The rule, exactly: a check is unverifiable
  when it involves a segment rebuilt with guessed blocks (until that segment is wholly
  free again), memory from before the trace that could not be rebuilt (when the expandable
  ranges mapped then fit no set of reservations, they are left out, and at the end a mapped
  range with a page the trace did not map is not compared), or a segment that
  went another way than the trace at an unverifiable check (from then on: memory one side
  placed, kept or gave back and the other did not); and a decision of the memory
  fraction's cap (out of memory, the retry's releases, garbage collection) when the
  simulator then holds other device memory than the trace says (walked back from the
  snapshot) after such a divergence. Every other check is made, so a contradiction
  elsewhere (a trace cut short, a snapshot of another moment, segments from before the
  trace that overlap, a segment the trace released that the snapshot still shows) is a
  mismatch and the trace does not replay at 1.0. A trace that starts at an empty
  allocator has no unverifiable check.
- **Failed releases.** ``segment_free`` is written before ``cudaFree`` is called; when that
  fails (a free inside a graph capture invalidates the capture) the allocator raises and
  the segment stays. After the trace's last allocation of device memory, a release whose
  segment (address, size, stream) the snapshot still shows is taken as that: the segment
  stays, ``num_device_free`` counts it, and the end compares it.

Statistics: for a trace that starts at an empty allocator and carries the real
``memory_stats()`` (the differential corpus does), every statistic is compared too
(:attr:`ReplayReport.stats_mismatches`), except ``num_sync_all_streams``: an
``empty_cache`` that releases nothing leaves no trace entry.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sortedcontainers import SortedDict

from graphborrow.allocator.caching import DEFAULT_POOL, CachingAllocator
from graphborrow.allocator.config import SIZE_MAX, AllocatorConfig
from graphborrow.allocator.memory import PhysicalMemory
from graphborrow.allocator.streams import Clockwork, Event
from graphborrow.core.errors import SnapshotFormatError
from graphborrow.core.sizes import SMALL_BUFFER, SMALL_SIZE, allocation_size, round_size
from graphborrow.core.snapshot import load_snapshot

__all__ = ["DEVICE_MEMORY", "ReplayReport", "load_trace", "replay_trace"]

# totalGlobalMem of devices the recorded traces come from: it sizes expandable segments' virtual
# ranges and, with a memory fraction, the allowed maximum. For the H200 the corpus pins it: the
# driver lays expandable segments' reservations end to end, 9/8 of the memory rounded up to 2 MiB
# apart, which leaves (150113208094, 150115072228]; 143160 MiB is the one whole MiB in it, and every
# allocation made under a memory fraction fits it (tests/fidelity/test_sim_corpus.py recomputes both).
DEVICE_MEMORY = {"NVIDIA H200": 143_160 * 2**20}
_UNKNOWN_DEVICE_MEMORY = 80 * 2**30
# the grid the driver lays virtual reservations on (cuMemAddressReserve with alignment 0): every
# expandable reservation of the H200 corpus that starts on a 2 MiB page boundary starts on it
RESERVATION_ALIGNMENT = 32 * 2**20
_SKIPPED = {"snapshot", "annotate", "user_defined"}
_RELEASES = {"segment_free", "segment_unmap"}
_DEVICE_CALLS = {"segment_alloc", "segment_map", "segment_free", "segment_unmap"}
_REPLAY_BASE = 1 << 60  # memory the trace does not place lands far above any traced address
_INFERRED_BASE = 1 << 20  # synthetic ids (0, n) of pools the trace does not name
_MAX_REPLAYS = 120
# statistics a trace does not determine: an empty_cache that releases nothing leaves no entry
# (num_sync_all_streams), and an allocation that fails with nothing releasable looks the same
# whether it was routed to a private pool or retried after emptying the cache (num_alloc_retries)
_UNOBSERVABLE_STATS = ("num_sync_all_streams", "num_alloc_retries")


@dataclass
class ReplayReport:
    """How far the simulated allocator reproduced a recorded trace."""

    agreement: float  # matching checks / checks, in 0..1; 0 when no check could be made
    mismatches: list[str] = field(default_factory=list)
    events: int = 0  # trace entries read
    checks: int = 0
    unverifiable: int = 0  # checks not made: they depend on state before a mid-run trace began
    mid_run: bool = False  # the trace did not start at an empty allocator; its start was rebuilt
    inferred: dict[str, str] = field(default_factory=dict)  # what the trace does not say, as decided
    refuted: int = 0  # pool choices that later entries contradicted (the trace was replayed again)
    stats_checked: int = 0  # memory_stats() entries compared with the recorded ones
    stats_mismatches: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        head = (f"agreement {self.agreement:.4f} ({self.checks - len(self.mismatches)}/{self.checks} checks, "
                f"{self.events} events")
        if self.mid_run:
            head += f", mid-run: {self.unverifiable} checks could not be made"
        if self.inferred:
            head += f", {len(self.inferred)} inferred, {self.refuted} refuted"
        if self.stats_checked:
            head += f", stats {self.stats_checked - len(self.stats_mismatches)}/{self.stats_checked}"
        head += ")"
        lines = [head, *self.mismatches[:20]] + (["..."] if len(self.mismatches) > 20 else [])
        return "\n".join(lines + self.stats_mismatches[:10])


def load_trace(source: Any) -> dict:
    """A ``_snapshot()`` dict with a device trace, from a dict or a path to its pickle (``.gz`` or not).

    Read and checked by :func:`graphborrow.core.snapshot.load_snapshot`, the one reader of
    snapshots: every segment, block and trace entry is checked before the replay trusts it
    (blocks may omit their addresses: the replay reads them from the sizes).
    An empty trace is accepted here; the replay then reports that it made no check.

    Args:
        source: a ``_snapshot()`` dict, or a path to its pickle.

    Returns:
        The checked snapshot dict, with ``"segments"`` and ``"device_traces"``.

    Raises:
        SnapshotFormatError: the source is malformed or has no ``"device_traces"``.
        FileNotFoundError: the path does not exist.
    """
    snapshot = load_snapshot(source, block_addresses=False)
    if "device_traces" not in snapshot:
        raise SnapshotFormatError(
            "expected the dict written by torch.cuda.memory._snapshot() (keys 'segments' and "
            "'device_traces'); record it after torch.cuda.memory._record_memory_history()"
        )
    return snapshot


# ----------------------------------------------------------------------------- plan: what the trace says


class _Life:
    """One traced segment (or expandable reservation): where, when, and the pool if the snapshot names it."""

    __slots__ = ("address", "size", "stream", "start", "end", "expandable", "pre_trace", "pool", "touched")

    def __init__(self, address: int, size: int, stream: int, start: int, expandable: bool = False,
                 pre_trace: bool = False) -> None:
        self.address, self.size, self.stream = address, size, stream
        self.start, self.end = start, None  # entry indices; start -1 for memory from before the trace
        self.expandable = expandable
        self.pre_trace = pre_trace
        self.pool: tuple[int, int] | None = None  # known from the final snapshot
        self.touched = False  # an entry of the trace falls inside it


class _Plan:
    """One pass over the trace: segment lives, what existed before the first entry, known pools."""

    def __init__(self, entries: list[dict], final: list[dict], virtual_size, large_page: int) -> None:
        self.entries = entries
        self.final = final
        self.lives: dict[int, _Life] = {}  # creating entry index -> life
        self.pre: list[_Life] = []  # segments (or reservations) from before the trace
        # id(pre life) -> [(address, size or None when only the request is known, state, entry that ends it, requested)]
        self.pre_blocks: dict[int, list] = {}
        self.problems: list[str] = []  # contradictions between the trace and its snapshot
        self.contradictions: list[str] = []  # ... that no state before the trace can explain
        self._virtual_size = virtual_size
        self._large_virtual = virtual_size(large_page, 0)
        self._start_pages: SortedDict | None = None  # (built when needed) pages mapped when the trace began
        self.failed_releases = self._failed_releases()  # entry indices of releases that did not happen
        self._walk()

    def _failed_releases(self) -> set[int]:
        """``segment_free`` entries whose segment is still in the snapshot: the release failed.

        The allocator writes the entry before it calls ``cudaFree``; when that call fails (a CUDA
        error: a free inside a graph capture invalidates it) the allocator raises and the segment
        stays. Recognised only after the trace's last allocation of device memory, with the same
        address, size and stream in the snapshot: anywhere else a segment that comes back without
        being allocated is a contradiction, and the replay reports it.
        """
        entries = self.entries
        last_made = max((i for i, e in enumerate(entries) if e.get("action") in ("segment_alloc", "segment_map")),
                        default=-1)
        still = {(s["address"], s["total_size"], s.get("stream", 0)) for s in self.final if not s.get("is_expandable")}
        failed = set()
        for i in range(last_made + 1, len(entries)):
            e = entries[i]
            if e.get("action") == "segment_free" and (e.get("addr"), e.get("size"), e.get("stream", 0)) in still:
                failed.add(i)
        return failed

    # an interval index of the lives that exist at the entry being walked
    def _find(self, live: SortedDict, address: int, end: int, stream: int | None = None,
              virtual: int | None = None) -> _Life | None:
        """The smallest life holding ``[address, end)``; with ``stream``, only an expandable
        reservation of that stream (and, with ``virtual``, of that size: of that page kind) can
        hold pages mapped or unmapped there: a reservation serves one stream and kind."""
        i = live.bisect_right(address)
        best = None
        for key in reversed(live.keys()[max(0, i - 64):i]):
            for life in live[key]:
                if stream is not None and (not life.expandable or life.stream != stream
                                           or (virtual is not None and life.size != virtual)):
                    continue
                if life.address <= address and end <= life.address + life.size:
                    if best is None or life.size < best.size:
                        best = life
        return best

    def _kind_of(self, size: int, address: int) -> int | None:
        """The virtual size of the reservation pages of ``size`` mapped at once come from; None
        when the size does not tell (a multiple of the large page: large pages, or small ones
        unmapped together)."""
        virtual = self._virtual_size(size, address)
        return None if virtual == self._large_virtual else virtual

    @staticmethod
    def _add(live: SortedDict, life: _Life) -> None:
        live.setdefault(life.address, []).append(life)

    @staticmethod
    def _remove(live: SortedDict, life: _Life) -> None:
        lives = live[life.address]
        lives.remove(life)
        if not lives:
            del live[life.address]

    def _walk(self) -> None:
        entries = self.entries
        live = SortedDict()
        mapped: dict[int, int] = {}  # reservation life id -> bytes mapped by the trace
        reservations: dict[int, _Life] = {}
        in_trace: dict[int, int] = {}  # address -> blocks allocated by the trace and not yet freed
        pending_in_trace: dict[int, int] = {}  # address -> traced frees waiting for completion
        pre_blocks: list[tuple] = []  # (address, requested, state, done_at)
        for i, entry in enumerate(entries):
            action = entry.get("action")
            addr, size, stream = entry.get("addr", 0), entry.get("size", 0), entry.get("stream", 0)
            if action == "segment_alloc":
                host = self._find(live, addr, addr + size)
                life = _Life(addr, size, stream, i)
                if host is not None:
                    host.touched = True
                self._add(live, life)
                self.lives[i] = life
            elif action == "segment_free" and i in self.failed_releases:
                continue
            elif action == "segment_free":
                life = None
                for candidate in live.get(addr, ()):
                    if candidate.size == size and not candidate.expandable:
                        life = candidate
                if life is None:  # allocated before the trace began
                    life = _Life(addr, size, stream, -1, pre_trace=True)
                    self.pre.append(life)
                else:
                    self._remove(live, life)
                life.end = i
                life.touched = True
            elif action == "segment_map":
                host = self._find(live, addr, addr + size, stream, self._kind_of(size, addr))
                if host is None or not host.expandable:
                    host = _Life(addr, self._virtual_size(size, addr), stream, i, expandable=True)
                    self._add(live, host)
                    self.lives[i] = host
                    reservations[id(host)] = host
                host.touched = True
                mapped[id(host)] = mapped.get(id(host), 0) + size
            elif action == "segment_unmap":
                host = self._find(live, addr, addr + size, stream, self._kind_of(size, addr))
                if host is None or not host.expandable:
                    host = _Life(addr, self._virtual_size(size, addr), stream, -1, expandable=True, pre_trace=True)
                    self.pre.append(host)
                    self._add(live, host)
                    reservations[id(host)] = host
                    mapped[id(host)] = self._mapped_at_start_near(host)
                host.touched = True
                mapped[id(host)] = mapped.get(id(host), 0) - size
                if mapped[id(host)] <= 0:  # the allocator releases a reservation with nothing mapped
                    self._remove(live, host)
                    host.end = i
            elif action == "alloc":
                host = self._find(live, addr, addr + max(size, 1))
                if host is not None:
                    host.touched = True
                in_trace[addr] = in_trace.get(addr, 0) + 1
            elif action == "free_requested":
                following = entries[i + 1] if i + 1 < len(entries) else {}
                plain = following.get("action") == "free_completed" and following.get("addr") == addr
                if in_trace.get(addr, 0) > 0:
                    in_trace[addr] -= 1
                    if not plain:
                        pending_in_trace[addr] = pending_in_trace.get(addr, 0) + 1
                else:
                    pre_blocks.append((addr, size, "active_allocated", i))
                    if not plain:
                        pending_in_trace[addr] = pending_in_trace.get(addr, 0) + 1
            elif action == "free_completed":
                previous = entries[i - 1] if i else {}
                if previous.get("action") == "free_requested" and previous.get("addr") == addr:
                    continue
                if pending_in_trace.get(addr, 0) > 0:
                    pending_in_trace[addr] -= 1
                else:
                    pre_blocks.append((addr, size, "active_pending_free", i))
        self.end_live = live
        self.mapped_by_trace = self._pages_mapped_by_the_trace()
        self.in_trace_at_end = in_trace
        self._final_segments(live)
        self._place_pre_blocks(pre_blocks, in_trace, pending_in_trace)
        self.freed_before = pre_blocks  # (address, requested, state, entry) of blocks the trace frees without allocating
        self.pending_in_trace = pending_in_trace

    def _mapped_at_start(self) -> dict[int, tuple]:
        """Expandable pages mapped when the trace began: page address -> (stream, whether a small
        reservation's). The snapshot's, less what the trace mapped, plus what it unmapped (pages
        unmapped in a multiple of the large page taken as large ones: ten free small pages in a row
        would be the exception)."""
        pages: dict[int, tuple] = {}
        for segment in self.final:
            if segment.get("is_expandable"):
                for page in range(segment["address"], segment["address"] + segment["total_size"], SMALL_BUFFER):
                    pages[page] = (segment.get("stream", 0), segment.get("segment_type") == "small")
        for entry in reversed(self.entries):
            action = entry.get("action")
            if action in ("segment_map", "segment_unmap"):
                for page in range(entry["addr"], entry["addr"] + entry["size"], SMALL_BUFFER):
                    if action == "segment_map":
                        pages.pop(page, None)
                    else:
                        pages[page] = (entry.get("stream", 0), self._kind_of(entry["size"], entry["addr"]) is not None)
        return pages

    def _mapped_at_start_near(self, host: _Life) -> int:
        """Bytes that may have been mapped in a reservation from before the trace when it began: the
        pages of its stream and kind within one reservation's size of it on either side, so that it
        is taken as released only when it must have been."""
        if self._start_pages is None:
            self._start_pages = SortedDict(self._mapped_at_start())
        pages = self._start_pages
        small = host.size != self._large_virtual
        low, high = host.address - host.size, host.address + host.size
        return SMALL_BUFFER * sum(1 for page in pages.irange(low, high, inclusive=(False, False))
                                  if pages[page] == (host.stream, small))

    def _pages_mapped_by_the_trace(self) -> set[int]:
        """The 2 MiB pages (by address) that a segment_map of the trace mapped and nothing unmapped since."""
        pages: set[int] = set()
        for entry in self.entries:
            action = entry.get("action")
            if action in ("segment_map", "segment_unmap"):
                span = range(entry["addr"], entry["addr"] + entry["size"], SMALL_BUFFER)
                if action == "segment_map":
                    pages.update(span)
                else:
                    pages.difference_update(span)
        return pages

    def mapped_before(self, address: int, size: int) -> bool:
        """Whether some page of this expandable range was mapped before the trace began (the trace never mapped it)."""
        return any(page not in self.mapped_by_trace for page in range(address, address + size, SMALL_BUFFER))

    def _final_segments(self, live: SortedDict) -> None:
        """Match the snapshot's segments with the lives alive at the end; the rest existed before the trace."""
        for segment in self.final:
            address, size = segment["address"], segment["total_size"]
            pool = _pool_tuple(segment.get("segment_pool_id", DEFAULT_POOL))
            if segment.get("is_expandable"):
                small = segment.get("segment_type") == "small"
                host = self._find(live, address, address + size, segment.get("stream", 0),
                                  self._virtual_size(SMALL_BUFFER, address) if small else self._large_virtual)
                if host is None or not host.expandable:
                    host = _Life(address, self._virtual_size(size, address), segment.get("stream", 0), -1,
                                 expandable=True, pre_trace=True)
                    self.pre.append(host)
                    self._add(live, host)
                host.pool = pool
                continue
            match = None
            for candidate in live.get(address, ()):
                if candidate.size == size and not candidate.expandable:
                    match = candidate
            if match is None:
                self._check_kept(address, size)
                match = _Life(address, size, segment.get("stream", 0), -1, pre_trace=True)
                self.pre.append(match)
                self._add(live, match)
            match.pool = pool

    def _check_kept(self, address: int, size: int) -> None:
        """A snapshot segment the trace never allocated lived through the whole trace: no segment the
        trace released may have shared its memory (one may lie strictly inside the other: a pluggable
        pool's segment within another pool's block). Otherwise the trace and its snapshot disagree."""
        end = address + size
        for life in [*self.lives.values(), *self.pre]:
            if life.end is None or life.expandable:
                continue
            other_end = life.address + life.size
            if life.address >= end or other_end <= address:
                continue
            inside = (address <= life.address and other_end <= end) or (life.address <= address and end <= other_end)
            if inside and (life.address, life.size) != (address, size):
                continue
            self.contradictions.append(
                f"final snapshot segment {size} B at {address:#x} was never allocated by the trace, yet the "
                f"trace released the segment {life.size} B at {life.address:#x} in its memory at event {life.end}: "
                f"the trace and its snapshot disagree (a trace cut short, or a snapshot of another moment)"
            )
            return

    def _place_pre_blocks(self, pre_blocks: list, in_trace: dict, pending_in_trace: dict) -> None:
        """Blocks that existed before the trace, in the segments that did."""
        if not self.pre:
            return
        index = SortedDict()
        for life in self.pre:
            self._add(index, life)
            self.pre_blocks[id(life)] = []
        for addr, requested, state, done_at in pre_blocks:
            life = self._find(index, addr, addr + 1)
            if life is None:
                self.problems.append(
                    f"event {done_at} frees {addr:#x}, which lies in no segment the trace or its snapshot knows"
                )
                continue
            life.touched = True
            self.pre_blocks[id(life)].append((addr, None, state, done_at, requested))
        for segment in self.final:
            cursor = segment["address"]  # blocks may omit their addresses: they tile the segment in order
            for block in segment["blocks"]:
                state, addr = block["state"], block.get("address", cursor)
                cursor = addr + block["size"]
                if state == "inactive":
                    continue
                life = self._find(index, addr, addr + block["size"])
                if life is None:
                    continue
                if state == "active_allocated" and in_trace.get(addr, 0) > 0:
                    continue  # allocated by the trace
                if state == "active_pending_free" and pending_in_trace.get(addr, 0) > 0:
                    continue
                self.pre_blocks[id(life)].append((addr, block["size"], state, None, block.get("requested_size", 0)))

    @property
    def mid_run(self) -> bool:
        return bool(self.pre)


def _identity(life: _Life) -> Any:
    """How a segment is named across replays: the entry that created it, or its address before the trace."""
    return life.start if life.start >= 0 else ("pre", life.address)


def _pool_tuple(pool_id) -> tuple[int, int]:
    first, second = pool_id
    return (int(first), int(second))


# ----------------------------------------------------------------------------- replaying


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
        self._spare += -(-nbytes // SMALL_BUFFER) * SMALL_BUFFER
        return address

    def raw_delete(self, address: int, nbytes: int, stream: int) -> None:
        pass


class _Refuted(Exception):  # noqa: N818 (a signal, not an error)
    """A pool choice contradicted by the trace: replay again without it."""

    def __init__(self, key: tuple, label: Any, reason: str) -> None:
        super().__init__(reason)
        self.key, self.label, self.reason = key, label, reason


def _route_everything(stream: int, thread: int) -> bool:
    return True


class _Pool:
    """A pool of the replay: the default pool, one the snapshot names, or one inferred."""

    __slots__ = ("id", "known", "pluggable", "released", "last_used")

    def __init__(self, pool_id: tuple[int, int], known: bool, pluggable: bool) -> None:
        self.id, self.known, self.pluggable = pool_id, known, pluggable
        self.released = False
        self.last_used = -1


class _Replayer:
    def __init__(self, snapshot: dict, entries: list[dict], final: list[dict], config: AllocatorConfig,
                 device_memory: int, fraction: float | None, refuted: set, layout: bool = False,
                 conflicts: dict | None = None, private_conflicts: dict | None = None,
                 snapshot_pools: set | None = None) -> None:
        self.entries = entries
        self.final = final
        self.snapshot_pools = snapshot_pools  # None: the snapshot holds every pool's segments
        self.config = config
        self.device_memory = device_memory
        self.refuted = refuted
        self.memory = PhysicalMemory(capacity=device_memory, backed=False, base=_REPLAY_BASE)
        self.clockwork = Clockwork()
        self.sim = CachingAllocator(self.memory, self.clockwork, config)
        if fraction is not None:
            self.sim.set_memory_fraction(fraction)
        self.sim.record_history(True, max_entries=1 << 30)
        self.plan = _Plan(entries, final, self._virtual_size, config.large_segment_size)
        # device memory reserved before each entry, as the trace and its snapshot say (None: the snapshot
        # was taken of some pools only); the decisions a memory fraction makes depend on it
        self.reserved_before = None if snapshot_pools is not None else _reserved_before(entries, final)
        self.expandable_rebuilt = False  # expandable ranges mapped before a mid-run trace were restored
        self.traced_addresses = _TracedAddresses()
        self.pools: dict[Any, _Pool] = {DEFAULT_POOL: _Pool(DEFAULT_POOL, True, False)}
        self.segment_pool: dict[int, Any] = {}  # creating entry index (or id of a pre-trace life) -> pool label
        self.decisions: dict[str, str] = {}
        self.choice_keys: dict[int, tuple] = {}  # sim segment address -> (decision key, label) of its pool
        self.blocks: dict[int, list] = {}  # traced address -> simulated blocks alive there
        self.pending: dict[int, list] = {}  # traced address -> [(block, phantom stream)] awaiting completion
        self.uncertain: set = set()  # sim segments whose layout before the trace is a guess
        self.skipped: set = set()  # traced addresses of allocations that could not be replayed (mid-run)
        self.diverged: set = set()  # sim segments that went their own way after an unverifiable decision
        self.diverged_elsewhere: list[int] = []  # traced addresses such a decision left without a sim segment
        self.blaming = True  # False in the last replay, when the patience for refutations has run out
        self.release_cause: dict[Any, tuple | None] = {}  # pool label -> choice of the segment whose release released it
        self._pending_key = None  # (decision key, pool label) of the choice the current malloc rests on
        self._oom_hint = None  # the likeliest pool of the failed allocation being replayed
        streams = [e.get("stream", 0) for e in entries] + [s.get("stream", 0) for s in final] + [0]
        self._next_phantom = max(s for s in streams if isinstance(s, int)) + 1
        self._idle_phantoms: list = []
        self._index = SortedDict()  # sim segment start -> segments (rebuilt when segments change)
        self._index_stamp = None
        self._next_inferred = _INFERRED_BASE
        self.last_label: Any = DEFAULT_POOL
        self.checks = 0
        self.unverifiable = 0
        self.mismatches: list[str] = []
        # layout mode: every segment in a pool of its own, recording which segments could not share a pool
        self.layout = layout
        self.conflicts: dict[Any, set] = {} if conflicts is None else conflicts  # may not share any pool
        self.private_conflicts: dict[Any, set] = {} if private_conflicts is None else private_conflicts
        self.released_at: dict[Any, int] = {}  # (layout mode) identity -> entry of its first release
        self.landings: list[tuple] = []  # (layout mode) (alloc entry, identity of the segment it landed in)
        self.pluggable: set = set()  # (layout mode) identities of pluggable pools' segments
        self.reservations: list = []  # (layout mode) expandable segments seen
        self.assignment: dict[Any, Any] = {}  # identity -> pool label, decided before the replay
        self.released_alone: set = set()  # identities the layout pass saw one private pool's emptyCache release
        self.one_pool: list[set] = []  # (layout mode) identities released together by one private pool's emptyCache
        self.one_pool_any: list[set] = []  # (layout mode) identities that share a pool, default or not
        self.known_pools = {_identity(life): life.pool for life in [*self.plan.lives.values(), *self.plan.pre]
                            if life.pool is not None}
        self.active_at: dict[Any, int] = {}  # (layout mode) identity -> entry of its last allocation
        self.members: dict[Any, set] = {DEFAULT_POOL: set()}  # pool label -> identities of its segments
        self.identity: dict[tuple[int, int], Any] = {}  # (layout mode) pool id -> its segment's identity
        self._groups_stamp = None
        self._groups: dict[tuple, list] = {}
        if not layout:
            for life in [*self.plan.lives.values(), *self.plan.pre]:
                if life.pool is not None:
                    self.members.setdefault(life.pool, set()).add(_identity(life))

    # --------------------------------------------------------------- bookkeeping

    def _virtual_size(self, size: int, address: int) -> int:
        """An expandable segment's virtual range for pages of this kind (as the allocator reserves it)."""
        page = SMALL_BUFFER if size % self.config.large_segment_size else self.config.large_segment_size
        total = self.device_memory
        return -(-(total + total // 8) // page) * page

    def check(self, ok: bool, message: str, uncertain: bool = False) -> None:
        if uncertain:
            self.unverifiable += 1
            return
        self.checks += 1
        if not ok:
            self.mismatches.append(message)

    def _segment_at(self, address: int):
        """The innermost simulated segment containing ``address``."""
        stamp = (self.sim.stats.num_device_alloc, self.sim.stats.num_device_free, self.sim.segment_count())
        if stamp != self._index_stamp:
            self._index = SortedDict()
            for segment in self.sim.segments():
                self._index.setdefault(segment.address, []).append(segment)
            self._index_stamp = stamp
        i = self._index.bisect_right(address)
        best = None
        for key in reversed(self._index.keys()[max(0, i - 64):i]):
            for segment in self._index[key]:
                if segment.address <= address < segment.address + segment.size:
                    if best is None or segment.size < best.size:
                        best = segment
        return best

    def _label_of(self, segment) -> Any:
        owner = segment.pool.owner
        if owner is None:
            return DEFAULT_POOL
        for label, pool in self.pools.items():
            if pool.id == owner.id:
                return label
        return owner.id

    def _is_uncertain(self, segment) -> bool:
        if segment is not None and segment in self.diverged:
            return True
        if segment is None or segment not in self.uncertain:
            return False
        head = segment.head
        if head is not None and head.next is None and head.state == "inactive":
            self.uncertain.discard(segment)  # wholly free again: its layout is exact from here on
            return False
        return True

    # --------------------------------------------------------------- pools

    def _pool(self, label: Any, pluggable: bool = False) -> _Pool:
        pool = self.pools.get(label)
        if pool is None:
            if isinstance(label, tuple):
                pool = _Pool(label, True, pluggable)
            else:
                pool = _Pool((0, self._next_inferred), False, pluggable)
                self._next_inferred += 1
            self.pools[label] = pool
        if pool.id != DEFAULT_POOL and pool.id not in self.sim.graph_pools:
            self.sim.create_or_incref_pool(pool.id, allocator=self.traced_addresses if pool.pluggable else None)
        return pool

    def _choose(self, key: tuple, known: tuple | None, nbytes: int, stream: int, pluggable: bool,
                expandable: bool, i: int) -> Any:
        """The pool label for a new segment (or an allocation that failed): known, or the first consistent one.

        Consistent: the pool had no cached block for the request on that stream (and, for a new
        expandable reservation, no reservation of that kind on that stream).
        """
        identity = key[1] if key[0] == "segment" else None
        if self.layout:
            if identity is None:
                return DEFAULT_POOL
            label = f"own@{identity}"
            self.identity[self._pool(label, pluggable).id] = identity
            return label
        if known is not None:
            self._pool(known, pluggable)
            return known
        planned = self.assignment.get(identity) if identity is not None else self.assignment.get(key)
        if planned is not None and (key, planned) not in self.refuted:
            pool = self._pool(planned, pluggable) if planned not in self.pools else self.pools[planned]
            if not pool.released and (pool.id == DEFAULT_POOL or pool.id in self.sim.graph_pools) \
                    and self.sim.cached_block_for(nbytes, stream, pool.id) is None:
                self._decide(key, planned)
                if identity is not None:
                    self.members.setdefault(planned, set()).add(identity)
                return planned
        ranked = [self.last_label, DEFAULT_POOL]
        if key[0] == "oom" and self._oom_hint is not None:
            ranked.insert(0, self._oom_hint)
        ranked += sorted((label for label in self.pools if label not in ranked),
                         key=lambda label: -self.pools[label].last_used)
        if key[0] == "oom" and self._oom_hint not in (None, DEFAULT_POOL):
            ranked = [label for label in ranked if label != DEFAULT_POOL]  # it left frees pending: not the default
        size = round_size(nbytes, self.sim.divisions)
        for label in ranked:
            pool = self.pools.get(label)
            if pool is None or pool.released or pool.pluggable != pluggable or (key, label) in self.refuted:
                continue
            if pool.id != DEFAULT_POOL and pool.id not in self.sim.graph_pools:
                continue
            if self.sim.cached_block_for(nbytes, stream, pool.id) is not None:
                continue  # the real allocator would have used that block instead
            if expandable and self._has_reservation(pool.id, size, stream):
                continue  # it would have mapped pages of that reservation instead
            members = self.members.get(label, set())
            if identity is not None and self.conflicts.get(identity, set()) & members:
                continue  # somewhere one of them had memory the other's allocation or release rules out
            if identity is not None and pool.id != DEFAULT_POOL and self.private_conflicts.get(identity, set()) & members:
                continue  # a private pool whose memory went back takes no allocation afterwards
            self._decide(key, label)
            if identity is not None:
                self.members.setdefault(label, set()).add(identity)
            return label
        label = f"inferred@{i}"
        self._pool(label, pluggable)
        self._decide(key, label)
        if identity is not None:
            self.members.setdefault(label, set()).add(identity)
        if (key, label) in self.refuted:
            self._pending_key = None  # a pool of its own was refuted too: the evidence blames another choice
        return label

    def _oom_prior(self, released: list, completed: list, stream: int) -> Any:
        """The likeliest pool of an allocation that failed, from what its failure did.

        Outside captures and MemPools the out-of-memory path first completes every pending free
        and releases what an empty_cache would; routed to a private pool it does neither.
        """
        collected = {(block.ptr, block.size) for block in self.sim.garbage_collection_victims()}
        emptied = bool(completed) or any(not (e["action"] == "segment_free" and e["size"] >= self.sim.max_split
                                               and e["stream"] == stream) and (e["addr"], e["size"]) not in collected
                                         for e in released)
        if emptied:
            return DEFAULT_POOL
        pending = any(block.state == "active_pending_free" for waiting in self.pending.values() for block, _ in waiting)
        if pending:
            if self.last_label != DEFAULT_POOL:
                return self.last_label
            private = [label for label, pool in self.pools.items() if label != DEFAULT_POOL and not pool.released]
            return max(private, key=lambda label: self.pools[label].last_used) if private else "new"
        return None

    def _has_reservation(self, pool_id: tuple[int, int], size: int, stream: int) -> bool:
        if pool_id == DEFAULT_POOL:
            block_pool = self.sim.small_blocks if size <= SMALL_SIZE else self.sim.large_blocks
        else:
            private = self.sim.graph_pools[pool_id]
            block_pool = private.small_blocks if size <= SMALL_SIZE else private.large_blocks
        return bool(block_pool.unmapped.get(stream))

    def _decide(self, key: tuple, label: Any) -> None:
        self.decisions[f"{key[0]} at event {key[1]}"] = str(self.pools[label].id)
        self._pending_key = (key, label)

    def _malloc(self, label: Any, nbytes: int, stream: int):
        pool = self.pools[label]
        if pool.id == DEFAULT_POOL:
            return self.sim.malloc(nbytes, stream)
        self.sim.begin_allocate_to_pool(pool.id, _route_everything)
        try:
            return self.sim.malloc(nbytes, stream)
        finally:
            self.sim.end_allocate_to_pool(pool.id)
            self.sim.release_pool(pool.id)

    def _reserve_unsure(self, start: int) -> bool:
        """Whether a decision of the memory fraction's cap (out of memory, the retry's releases, garbage
        collection) in the malloc whose entries begin at ``start`` rests on guessed state: in a mid-run trace, the simulator holds
        other device memory than the trace had, and an earlier decision already went another way
        (counted where it happened, as a mismatch or as unverifiable). A trace from an empty
        allocator never: there every difference is a mismatch."""
        if not self.plan.mid_run or self.reserved_before is None or self.sim.allowed_memory_maximum is None:
            return False
        went_astray = bool(self.diverged or self.diverged_elsewhere or self.mismatches)
        return went_astray and self.sim.total_allocated_memory != self.reserved_before[start]

    def _phantom_stream(self):
        """A stream that stays busy until the replay says its work is done."""
        stream = self._idle_phantoms.pop() if self._idle_phantoms else self.clockwork.new_stream(self._next_phantom)
        if stream.id == self._next_phantom:
            self._next_phantom += 1
        stream.enqueue(1.0)
        return stream

    # --------------------------------------------------------------- the run

    def run(self) -> None:
        if self.plan.mid_run:
            self._rebuild_start()
        for problem in self.plan.problems:  # memory from before the trace that nothing places
            self.check(False, problem, uncertain=self.plan.mid_run)
        for problem in self.plan.contradictions:
            self.check(False, problem)
        entries = self.entries
        i = 0
        while i < len(entries):
            action = entries[i].get("action")
            if i in self.plan.failed_releases:
                # the malloc it was part of failed with a CUDA error (its request is not in the trace); the
                # allocator counted the release before cudaFree failed, and the segment stays (the end checks it)
                self.sim.stats.num_device_free += 1
                i += 1
            elif action in ("alloc", "segment_alloc", "segment_map", "oom"):
                i = self._allocation(i, [], [])
            elif action in _RELEASES:
                i = self._releases(i, [])
            elif action == "free_requested":
                i = self._free_requested(i)
            elif action == "free_completed":
                j = i
                while j < len(entries) and entries[j].get("action") == "free_completed":
                    j += 1
                if j < len(entries) and entries[j].get("action") in _RELEASES and j not in self.plan.failed_releases:
                    i = self._releases(j, entries[i:j])  # perhaps completed by the release's synchronisation
                else:
                    self._free_completed(i)
                    i += 1
            elif action in _SKIPPED:
                i += 1
            else:
                raise SnapshotFormatError(f"trace entry {i} has an unknown action {action!r}")
        self._compare_final()

    # allocations ------------------------------------------------------------------

    def _allocation(self, i: int, released: list, completed: list) -> int:
        """One malloc: [segment_alloc | segment_map...] alloc, or an oom.

        ``released`` and ``completed`` are the entries the real allocator wrote inside this
        malloc before them: segments it released and pending frees its synchronisation completed.
        """
        entries = self.entries
        start = i
        new_segment = None
        maps = []
        going_with: dict[int, tuple] = {}  # released segment -> (pool label, choice) before this malloc
        emptied: Any = set()  # private pools this malloc's releases say had been released (then their segments)
        while i < len(entries) and entries[i].get("action") == "segment_map":
            maps.append(entries[i])
            i += 1
        if not maps and i < len(entries) and entries[i].get("action") == "segment_alloc":
            new_segment = entries[i]
            i += 1
        if i >= len(entries) or entries[i].get("action") not in ("alloc", "oom"):
            self.check(False, f"event {start}: {entries[start]['action']} is not followed by its allocation")
            return max(i, start + 1)
        entry = entries[i]
        stream = entry.get("stream", 0)
        oom = entry["action"] == "oom"
        nbytes = entry["size"]
        first = maps[0] if maps else new_segment
        if not oom and first is None and self._segment_at(entry["addr"]) is None and self.plan.mid_run:
            self.unverifiable += 2  # memory from before the trace that could not be rebuilt
            self.skipped.add(entry["addr"])
            return i + 1
        if self.layout:
            oversize = []  # with max_split_size set, a malloc over the cap first releases oversize blocks of its pool
            for e in released:
                segment = self._segment_at(e["addr"])
                if segment is not None and segment.pool.owner is not None:
                    mine = self.identity.get(segment.pool.owner.id)
                    if self.sim.max_split == SIZE_MAX:  # else it may be an oversize release of a pool in use
                        self.released_at.setdefault(mine, start)
                    elif (e["action"] == "segment_free" and e["size"] >= self.sim.max_split
                          and e["stream"] == stream and not segment.expandable):
                        oversize.append(mine)
                    self.sim.release_pool_memory(segment.pool.owner.id)
            if oversize and len(oversize) == len(released) and new_segment is not None:
                self.one_pool_any.append({start, *oversize})
            self.sim.drain_trace()
            if oom:
                return i + 1
        else:
            for e in released:  # pools whose memory went back inside this malloc were released before it,
                oversize = (e["action"] == "segment_free" and e["size"] >= self.sim.max_split
                            and e["stream"] == stream)  # unless it was an oversize release of the pool in use
                segment = self._segment_at(e["addr"])
                if segment is not None and segment.address in self.choice_keys:
                    going_with[segment.address] = (self._label_of(segment), self.choice_keys[segment.address])
                if not oversize:
                    if segment is not None and segment.pool.owner is not None:
                        emptied.add(self._label_of(segment))
                    self._mark_released(segment)
        if emptied:  # the segments of the pools marked released, to name the pool of memory released with them
            emptied = {s.address: self._label_of(s) for s in self.sim.segments()
                       if s.pool.owner is not None and self._label_of(s) in emptied}
        if oom:
            self._oom_hint = self._oom_prior(released, completed, stream)
        label, pluggable = self._route(start, first, entry, oom, {e["addr"] for e in released})
        if self.layout:
            self._record_conflicts(label, entry, stream, new_segment is not None or bool(maps), start)
        expected = [(e["action"], e["addr"], e["size"]) for e in released]
        expected += [(e["action"], e["addr"], e["size"]) for e in maps]
        if new_segment is not None:
            expected.append(("segment_alloc", new_segment["addr"], new_segment["size"]))
        self._dictate(first, pluggable)
        where = f"event {i} {'oom' if oom else 'alloc'} {nbytes} B on stream {stream} in pool {self._name(label)}"
        block, failure = None, None
        reserve_unsure = self._reserve_unsure(start - len(released))  # (the releases run inside the malloc)
        try:
            block = self._malloc(label, nbytes, stream)
        except Exception as error:  # OutOfMemoryError is a RuntimeError; a released pool raises too
            failure = error
        finally:
            self.memory.expect_next_address(None)
            self.traced_addresses.expected = None
        emitted = self.sim.drain_trace()
        self._settle(emitted, completed, where)
        got = [(e["action"], e.get("addr", 0), e["size"]) for e in emitted if e["action"] in _DEVICE_CALLS]
        uncertain = any(self._is_uncertain(self._segment_at(a)) for _, a, _ in got + expected if a)
        if (oom or released or failure is not None or got != expected) and reserve_unsure:
            uncertain = True  # the cap decided it, and what was reserved before it is not what the trace had
        calls_ok = sorted(got) == sorted(expected)
        if oom:
            ok = isinstance(failure, RuntimeError) and "out of memory" in str(failure)
            if not calls_ok and not uncertain:
                self._blame_calls(got, expected, where, going_with, emptied)
            if not ok and not uncertain:
                self._refute_pending(f"{where}: the simulator did not fail the same way")
            self.check(ok, f"{where}: expected out of memory, simulated "
                           f"{failure if failure is not None else 'an allocation at %#x' % block.ptr}", uncertain)
            self.check(calls_ok, f"{where}: expected device calls {_fmt(expected)}, simulated {_fmt(got)}", uncertain)
            if uncertain and (not ok or not calls_ok):
                self._diverge([a for _, a, _ in got + expected if a])
            if block is not None:
                self.sim.free(block)
                self.sim.drain_trace()
            self._pending_key = None
            return i + 1
        if failure is not None:
            if self.plan.mid_run and isinstance(failure, ValueError) and "overlaps" in str(failure):
                uncertain = True  # the trace places memory where the unrebuilt state before it differs
            cause = self.release_cause.get(label)
            if "cannot be used again" in str(failure) and cause is not None and cause[0][0] == "pre-trace segment":
                # the pool took memory from before the trace that was released: that memory was another pool's
                self._refute(cause[0], cause[1], f"{where}: {failure}")
            if "cannot be used again" in str(failure) or "out of memory" in str(failure):
                self._refute_pending(f"{where}: {failure}")
            if uncertain:  # the memory the trace placed here never came to be: what it held is not comparable
                self._diverge([entry["addr"]] + [a for _, a, _ in expected if a])
            self.check(False, f"{where}: simulator raised {type(failure).__name__}: {failure}", uncertain)
            self.check(False, f"{where}: no block", uncertain)
            self._pending_key = None
            return i + 1
        addr = entry["addr"]
        home = self._segment_at(addr)
        uncertain = (uncertain or self._is_uncertain(home) or self._is_uncertain(block.segment)
                     or (self.plan.mid_run and home is None))  # memory from before the trace that was not rebuilt
        if uncertain and (block.ptr != addr or not calls_ok):  # from here on these segments are not comparable
            self._diverge([block.ptr, addr] + [a for _, a, _ in got + expected if a])
        if block.ptr != addr and not uncertain:
            self._blame(block.ptr, addr, where)
        if not calls_ok and not uncertain:
            self._blame_calls(got, expected, where, going_with, emptied)
        self.check(calls_ok, f"{where}: expected device calls {_fmt(expected)}, simulated {_fmt(got)}", uncertain)
        self.check(block.ptr == addr, f"{where}: expected block at {addr:#x}, simulated {block.ptr:#x}", uncertain)
        self.blocks.setdefault(addr, []).append(block)
        self.last_label = label
        self.pools[label].last_used = i
        if self.layout and block.pool.owner is not None:
            mine = self.identity.get(block.pool.owner.id)
            self.active_at[mine] = i
            self.landings.append((i, mine))
            if block.pool.owner.allocator is not None:
                self.pluggable.add(mine)
            if maps and block.segment not in self.reservations:  # a new reservation: one per pool, stream, kind
                for other in self.reservations:
                    if other.stream == block.segment.stream and other.pool.is_small == block.segment.pool.is_small \
                            and self.sim.holds_segment(other):
                        theirs = self.identity.get(other.pool.owner.id)
                        self.conflicts.setdefault(mine, set()).add(theirs)
                        self.conflicts.setdefault(theirs, set()).add(mine)
                self.reservations.append(block.segment)
        if new_segment is not None and block.segment.address == new_segment["addr"]:
            # a new segment: the choice of a segment released from this address before no longer applies
            self.choice_keys.pop(block.segment.address, None)
        if self._pending_key is not None and (new_segment is not None or maps):
            self.choice_keys.setdefault(block.segment.address, self._pending_key)
        self._pending_key = None
        return i + 1

    def _route(self, start: int, first: dict | None, entry: dict, oom: bool, going: set) -> tuple[Any, bool]:
        """The pool a traced allocation went to: its segment's, or a choice (new segment, oom)."""
        self._pending_key = None
        stream = entry.get("stream", 0)
        if first is None and not oom:
            segment = self._segment_at(entry["addr"])
            if segment is None:
                return DEFAULT_POOL, False
            owner = segment.pool.owner
            return self._label_of(segment), owner is not None and owner.allocator is not None
        if first is not None and first["action"] == "segment_map":
            host = self._segment_at(first["addr"])
            if host is not None and host.expandable:
                return self._label_of(host), False  # more pages of a reservation the replay knows
        life = self.plan.lives.get(start) if first is not None else None
        known = life.pool if life is not None else None
        nested = False
        expandable = first is not None and first["action"] == "segment_map"
        if first is not None and first["action"] == "segment_alloc":
            host = self._segment_at(first["addr"])  # inside another segment (not going now): a pluggable pool
            nested = host is not None and host.address not in going
        key = ("segment" if first is not None else "oom", start)
        return self._choose(key, known, entry["size"], stream, nested, expandable, start), nested

    def _record_conflicts(self, label: Any, entry: dict, stream: int, new: bool, start: int) -> None:
        """(Layout mode.) Segments that had a better block for this allocation cannot share its pool."""
        pool = self.pools[label]
        mine = self.identity.get(pool.id)
        if mine is None:
            return
        nbytes = entry["size"]
        chosen = None if new else self.sim.cached_block_for(nbytes, stream, pool.id)
        small = round_size(nbytes, self.sim.divisions) <= SMALL_SIZE
        for other in self._pools_on(stream, small):
            if other == pool.id:
                continue
            best = self.sim.cached_block_for(nbytes, stream, other)
            if best is not None and (chosen is None or best.key < chosen.key):
                theirs = self.identity.get(other)
                if theirs is not None:
                    self.conflicts.setdefault(mine, set()).add(theirs)
                    self.conflicts.setdefault(theirs, set()).add(mine)

    def _pools_on(self, stream: int, small: bool) -> list:
        """Ids of the pools with segments on this stream and of this kind (layout mode: one per segment)."""
        stamp = (self.sim.stats.num_device_alloc, self.sim.stats.num_device_free, self.sim.segment_count())
        if stamp != self._groups_stamp:
            groups: dict[tuple, list] = {}
            for segment in self.sim.segments():
                owner = segment.pool.owner
                if owner is not None:
                    groups.setdefault((segment.stream, segment.pool.is_small), []).append(owner.id)
            self._groups, self._groups_stamp = groups, stamp
        return self._groups.get((stream, small), [])

    def _dictate(self, first: dict | None, pluggable: bool) -> None:
        if first is None:
            return
        if pluggable:
            self.traced_addresses.expected = first["addr"]
        elif first["action"] == "segment_alloc":  # (memory released inside this malloc may be reused)
            self.memory.expect_next_address(first["addr"])
        elif self._segment_at(first["addr"]) is None:  # a new reservation starts at its first page
            self.memory.expect_next_address(first["addr"])

    def _diverge(self, addresses: list) -> None:
        for address in addresses:
            segment = self._segment_at(address)
            if segment is not None:
                self.diverged.add(segment)
            else:
                self.diverged_elsewhere.append(address)

    def _blame(self, taken: int, expected: int, where: str) -> None:
        """The simulator took a block the real allocator did not: a pool choice may be wrong.

        The segment of the block taken is in the routed pool only because of a choice, or the
        expected segment is; the later of those choices is refuted.
        """
        mine, theirs = self._segment_at(taken), self._segment_at(expected)
        if mine is None or mine is theirs:
            return
        keys = [self.choice_keys[s.address] for s in (mine, theirs) if s is not None and s.address in self.choice_keys]
        if keys:
            key, label = max(keys, key=_made_at)
            self._refute(key, label, f"{where}: took a block of the segment at {mine.address:#x}")

    def _blame_calls(self, got: list, expected: list, where: str, going_with: dict | None = None,
                     emptied: dict | None = None) -> None:
        """An allocation released (or kept) other memory than the real one did (garbage collection,
        the out-of-memory retry): the pool of that memory may be wrong (only the default pool is
        collected, only freeable pools are emptied); else the choice this allocation rests on.

        Memory released that the real allocator kept, in a private pool that also held memory the
        real one did release: one of those segments is in that pool by a wrong choice, the later one.
        Such memory in a pool the snapshot names: the choice that put a released segment in that
        pool (which made the pool look released) is the suspect.
        """
        keys = []
        for call in set(got) ^ set(expected):
            action, addr, _ = call
            if action in _RELEASES:
                segment = self._segment_at(addr)
                base = segment.address if segment is not None else addr
                if base in self.choice_keys:
                    keys.append(self.choice_keys[base])
                    label = self.choice_keys[base][1]
                    if call in got and going_with and label != DEFAULT_POOL:
                        keys += [choice for other, choice in going_with.values() if other == label]
                    if call in got and label != DEFAULT_POOL and self.release_cause.get(label) is not None:
                        keys.append(self.release_cause[label])  # the segment whose release said the pool was released
                elif call in got and emptied and self.release_cause.get(emptied.get(base)) is not None:
                    keys.append(self.release_cause[emptied[base]])
                elif call in got and self.release_cause.get(self._known_pool(addr)) is not None:
                    keys.append(self.release_cause[self._known_pool(addr)])  # a named pool another choice released
        if keys:
            key, label = max(keys, key=_made_at)
            self._refute(key, label, f"{where}: expected device calls {_fmt(expected)}, simulated {_fmt(got)}")
        self._refute_pending(f"{where}: expected device calls {_fmt(expected)}, simulated {_fmt(got)}")

    def _known_pool(self, address: int) -> Any:
        """The pool the snapshot names for the traced segment at ``address`` alive now, if any."""
        for life in [*self.plan.lives.values(), *self.plan.pre]:
            if life.address == address and life.pool is not None and not life.expandable:
                return life.pool
        return None

    def _refute(self, key: tuple, label: Any, reason: str) -> None:
        if self.blaming:
            raise _Refuted(key, label, reason)

    def _refute_pending(self, reason: str) -> None:
        if self._pending_key is not None:
            key, label = self._pending_key
            self._refute(key, label, reason)

    def _name(self, label: Any) -> str:
        pool = self.pools.get(label)
        return str(pool.id if pool is not None else label)

    # frees ------------------------------------------------------------------

    def _take_block(self, addr: int, requested: int):
        candidates = self.blocks.get(addr)
        if not candidates:
            return None
        for j in range(len(candidates) - 1, -1, -1):
            if candidates[j].requested_size == requested and candidates[j].allocated:
                return candidates.pop(j)
        for j in range(len(candidates) - 1, -1, -1):
            if candidates[j].allocated:
                return candidates.pop(j)
        return None

    def _free_requested(self, i: int) -> int:
        entries = self.entries
        entry = entries[i]
        addr, size = entry["addr"], entry["size"]
        following = entries[i + 1] if i + 1 < len(entries) else {}
        plain = following.get("action") == "free_completed" and following.get("addr") == addr
        block = self._take_block(addr, size)
        if block is None:
            if addr in self.skipped or (self.plan.mid_run and self._segment_at(addr) is None):
                self.unverifiable += 1  # memory from before the trace that could not be rebuilt
            else:
                self.check(False, f"event {i} free_requested {addr:#x}: the simulator has no allocated block there",
                           self._is_uncertain(self._segment_at(addr)))
            return i + 2 if plain else i + 1
        if plain:
            self.sim.free(block)
            self.sim.drain_trace()
            return i + 2
        phantom = self._phantom_stream()
        self.sim.record_stream(block, phantom.id)
        self.sim.free(block)
        self.sim.drain_trace()
        self.pending.setdefault(addr, []).append((block, phantom))
        return i + 1

    def _free_completed(self, i: int) -> None:
        """A cross-stream free completed (its events were done at a malloc, or synchronised)."""
        addr = self.entries[i]["addr"]
        waiting = self.pending.get(addr)
        if not waiting:
            if addr in self.skipped or (self.plan.mid_run and self._segment_at(addr) is None):
                self.unverifiable += 1
                return
            self.check(False, f"event {i} free_completed {addr:#x}: no cross-stream free is pending there",
                       self._is_uncertain(self._segment_at(addr)))
            return
        block, phantom = waiting.pop(0)
        phantom.synchronize()
        self.sim.process_events()
        self.sim.drain_trace()
        self.check(block.state == "inactive",
                   f"event {i} free_completed {addr:#x}: the simulator kept the block {block.state}")
        self._idle_phantoms.append(phantom)

    def _settle(self, emitted: list, completed: list, where: str) -> None:
        """Pending frees the simulator completed by itself (a synchronisation) against the recorded ones."""
        done = sorted(e["addr"] for e in emitted if e["action"] == "free_completed")
        wanted = sorted(e["addr"] for e in completed)
        for addr in done:
            waiting = self.pending.get(addr)
            for j, (block, phantom) in enumerate(waiting or ()):
                if block.state == "inactive":
                    waiting.pop(j)
                    self._idle_phantoms.append(phantom)
                    break
        if done or wanted:
            self.check(done == wanted, f"{where}: expected to complete frees at {[hex(a) for a in wanted]}, "
                                       f"simulated {[hex(a) for a in done]}")

    # releases ------------------------------------------------------------------

    def _releases(self, i: int, completed: list) -> int:
        """A run of segment_free / segment_unmap entries: inside the next allocation, or an empty_cache.

        ``completed``: the free_completed entries just before it. A synchronisation (empty_cache,
        the out-of-memory path) completes every pending free; if some stay pending, these
        completed on their own (a malloc's event processing) before the releases.
        """
        entries = self.entries
        if completed:
            waiting = sorted(addr for addr, items in self.pending.items() for block, _ in items
                             if block.state == "active_pending_free")
            if sorted(e["addr"] for e in completed) != waiting:
                for k in range(len(completed)):
                    self._free_completed(i - len(completed) + k)
                completed = []
        j = i
        while j < len(entries) and entries[j].get("action") in _RELEASES and j not in self.plan.failed_releases:
            j += 1
        run = entries[i:j]
        m = j
        while m < len(entries) and entries[m].get("action") in ("segment_alloc", "segment_map"):
            m += 1
        after = entries[m].get("action") if m < len(entries) else None
        if (after == "alloc" and m > j) or (after == "oom" and m == j):  # releases inside an allocation?
            if self._released_inside(entries[m], run, j, completed):
                return self._allocation(j, run, completed)
        for k in range(len(completed)):  # completed before the empty_cache's releases
            self._free_completed(i - len(completed) + k)
        self._empty_cache(i, run)
        return j

    def _released_inside(self, entry: dict, run: list, start: int, completed: list) -> bool:
        """Whether the allocation of ``entry`` (its entries begin at ``start``) made these releases itself.

        Inside a malloc memory goes back only when device memory is over the cap (the
        out-of-memory path: oversize blocks of the pool allocated from, then, outside any
        capture or MemPool, everything an empty_cache would release) or through garbage
        collection (whole free segments of the default large pool). Otherwise the run was
        an empty_cache before it.
        """
        if entry.get("action") not in ("alloc", "oom"):
            return False
        sim = self.sim
        size = round_size(entry["size"], sim.divisions)
        life = self.plan.lives.get(start)
        pool = life.pool if life is not None and life.pool is not None else self.assignment.get(start, DEFAULT_POOL)
        private = pool != DEFAULT_POOL and not self.layout
        if entry["action"] == "oom" and not self.layout and \
                sim.cached_block_for(entry["size"], entry.get("stream", 0), DEFAULT_POOL) is not None:
            private = True  # the default pool had a block for it: the request that failed was routed elsewhere
        oversize = all(e["action"] == "segment_free" and e["size"] >= sim.max_split and e["stream"] == entry.get("stream")
                       for e in run)
        allowed = sim.allowed_memory_maximum
        over_cap = allowed is not None and sim.total_allocated_memory + allocation_size(size, sim.large_segment_size) > allowed
        if completed:  # only empty_cache and the out-of-memory path (outside routing) complete pending frees
            if sim.gc_enabled and sim.cached_block_for(entry["size"], entry.get("stream", 0), DEFAULT_POOL) is None \
                    and sim.garbage_collection_victims():
                return False  # that path collects garbage first: its releases would precede the completions
            return over_cap and not private
        if over_cap and (oversize or not private):
            return True
        if sim.gc_enabled:
            threshold = int(self.config.garbage_collection_threshold * float(sim.allowed_memory_maximum))
            if self.layout:  # no default pool to age blocks in: a run garbage collection could make proves nothing
                return sim.total_allocated_memory > threshold and all(
                    e["action"] == "segment_free" and e["size"] > SMALL_BUFFER for e in run)
            victims = {(block.ptr, block.size) for block in sim.garbage_collection_victims()}
            return bool(victims) and victims == {(e["addr"], e["size"]) for e in run if e["action"] == "segment_free"}
        return over_cap and not private  # routed to a private pool, only the two above release memory

    def _mark_released(self, segment) -> None:
        """The pool of ``segment`` gave its memory back, so it had been released (graphs reset, MemPool deleted)."""
        if segment is None or segment.pool.owner is None:
            return
        owner = segment.pool.owner
        label = self._label_of(segment)
        if owner.use_count > 0:
            self.release_cause[label] = self.choice_keys.get(segment.address)
        while owner.use_count > 0:
            self.sim.release_pool(owner.id)
        if label in self.pools:
            self.pools[label].released = True

    def _empty_cache(self, i: int, run: list) -> None:
        if self.layout:  # each segment in a pool of its own: release exactly what the trace released
            released = {self._segment_at(e["addr"]) for e in run} - {None}
            gone = {self.identity.get(s.pool.owner.id) for s in released if s.pool.owner is not None}
            kept = {self.identity.get(s.pool.owner.id) for s in self.sim.segments()
                    if s not in released and s.pool.owner is not None and _releasable(s)}
            for mine in gone - {None}:  # a pool emptied gives back all its releasable memory
                self.released_at.setdefault(mine, i)
                for theirs in kept - {None}:
                    self.conflicts.setdefault(mine, set()).add(theirs)
                    self.conflicts.setdefault(theirs, set()).add(mine)
            # empty_cache() empties the default pool and completes every pending free first; a release
            # that keeps releasable default memory, or leaves frees pending, emptied one private pool
            default_kept = any(self.known_pools.get(theirs) == DEFAULT_POOL for theirs in kept)
            pending_kept = any(block.state == "active_pending_free" and block.segment not in released
                               for waiting in self.pending.values() for block, _ in waiting)
            if (default_kept or pending_kept) and gone - {None}:
                self.one_pool.append(gone - {None})
            for segment in released:
                if segment.pool.owner is not None:
                    self.sim.release_pool_memory(segment.pool.owner.id)
            self._settle(self.sim.drain_trace(), [], "")
            return
        expected = sorted((e["action"], e["addr"], e["size"]) for e in run)
        where = f"events {i}..{i + len(run) - 1} empty_cache"
        segments = [self._segment_at(e["addr"]) for e in run]
        uncertain = any(self._is_uncertain(s) for s in segments) or (self.plan.mid_run and None in segments)
        owners = {s.pool.owner.id for s in segments if s is not None and s.pool.owner is not None}
        default = any(s is not None and s.pool.owner is None for s in segments)
        before = {s.address: (self._label_of(s), s) for s in self.sim.segments()}
        diverged = [s for _, s in before.values() if s in self.diverged]
        for segment in segments:
            self._mark_released(segment)
        only = None
        # empty_cache() completes every pending free first; a release that leaves some pending was one pool's
        pending_elsewhere = any(block.state == "active_pending_free" and
                                (block.pool.owner is None or block.pool.owner.id not in owners)
                                for waiting in self.pending.values() for block, _ in waiting)
        if len(owners) == 1 and not default and (pending_elsewhere or self._more_releasable(next(iter(owners)))):
            only = next(iter(owners))  # a MemPool going away: emptyCache(its id)
        elif pending_elsewhere and not uncertain:
            keys = [self.choice_keys[s.address] for s in segments if s is not None and s.address in self.choice_keys]
            if keys:  # the segments of one private pool went back, so the pool choices are wrong somewhere
                key, label = max(keys, key=_made_at)
                self._refute(key, label, f"{where}: released without completing pending frees: one pool's memory")
        self.sim.empty_cache(only)
        emitted = self.sim.drain_trace()
        synced = [e["addr"] for e in emitted if e["action"] == "free_completed"]
        if synced and not uncertain:  # it completed frees the real one left pending: another pool's, or no empty_cache
            keys = [self.choice_keys[s.address] for s in segments if s is not None and s.address in self.choice_keys]
            for addr in synced:
                segment = self._segment_at(addr)
                if segment is not None and segment.address in self.choice_keys:
                    keys.append(self.choice_keys[segment.address])
            if keys:
                key, label = max(keys, key=_made_at)
                self._refute(key, label, f"{where}: completed pending frees the trace kept pending")
        self._settle(emitted, [], where)
        got = sorted((e["action"], e["addr"], e["size"]) for e in emitted if e["action"] in _RELEASES)
        differ = {addr for _, addr, _ in set(got) ^ set(expected)}
        uncertain = uncertain or any(s.address <= a < s.address + s.size for s in diverged for a in differ)
        if got != expected and uncertain:  # memory one side kept and the other gave back: not comparable from here on
            self._diverge(sorted(differ))
        if got != expected and not uncertain:
            self._blame_release([g for g in got if g not in expected], segments, before, where)
        self.check(got == expected, f"{where}: expected to release {_fmt(expected)}, simulated {_fmt(got)}", uncertain)

    def _blame_release(self, extra: list, released: list, before: dict, where: str) -> None:
        """The simulator released memory the real allocator kept: a pool choice put it where it could go.

        In the default pool it could not be (the default pool is always emptied); in a private
        pool it shares that pool with a segment the trace released, and the later of the two
        choices is refuted.
        """
        for _, addr, size in extra:
            found = before.get(addr)
            if found is None:
                found = next(((label, s) for base, (label, s) in before.items()
                              if base <= addr < base + s.size and s.expandable), None)
            if found is None:
                continue
            label, segment = found
            keys = [self.choice_keys[segment.address]] if segment.address in self.choice_keys else []
            if label != DEFAULT_POOL:
                keys += [self.choice_keys[s.address] for s in released
                         if s is not None and s.address in self.choice_keys and before.get(s.address, (None,))[0] == label]
                if self.release_cause.get(label) is not None:  # the segment whose release said the pool was released
                    keys.append(self.release_cause[label])
            if keys:
                key, chosen = max(keys, key=_made_at)
                self._refute(key, chosen, f"{where}: released {size} B at {addr:#x} that the trace kept")

    def _more_releasable(self, pool_id: tuple[int, int]) -> bool:
        """Whether an empty_cache() of everything would release more than this pool's memory."""
        for segment in self.sim.segments():
            owner = segment.pool.owner
            if owner is not None and (owner.id == pool_id or owner.use_count > 0):
                continue
            for block in segment.blocks():
                if block.key is None:
                    continue
                if segment.expandable:
                    page = segment.page_size
                    offset = block.ptr - segment.address
                    if -(-offset // page) < (offset + block.size) // page:
                        return True
                elif block.prev is None and block.next is None:
                    return True
        return False

    # the state before a mid-run trace ------------------------------------------------

    def _rebuild_start(self) -> None:
        """Restore the allocator to the trace's first entry from what the plan found."""
        segments = []
        for life in self._contradicting_pre_lives():
            self.plan.pre.remove(life)
        try:
            expandable = self._expandable_at_start()
        except ValueError:  # ranges no set of reservations explains: left out, and what rests on them unverifiable
            expandable = []
        self.expandable_rebuilt = bool(expandable)
        segments.extend(expandable)
        for life in self.plan.pre:
            if life.expandable:
                if not expandable:
                    self.unverifiable += 1  # expandable memory from before the trace is not rebuilt
                continue
            pool = self._pool(life.pool).id if life.pool is not None and not self.layout else self._pre_pool(life)
            segments.append({
                "address": life.address, "total_size": life.size, "stream": life.stream,
                "segment_type": "small" if life.size == SMALL_BUFFER else "large", "segment_pool_id": pool,
                "blocks": [{"size": size, "state": state, "requested_size": requested}
                           for size, state, requested, _ in self._pre_layout(life)],
            })
        phantoms = {}

        def pending_event(address: int) -> Event:
            phantom = self._phantom_stream()
            phantoms[address] = phantom
            event = Event()
            event.record(phantom)
            return event

        restored = self.sim.restore(segments, pending=pending_event)
        for addr, block in restored.allocated.items():
            self.blocks.setdefault(addr, []).append(block)
        for addr, block in restored.pending.items():
            self.pending.setdefault(addr, []).append((block, phantoms[addr]))
        for life in self.plan.pre:  # small blocks are never handed out with slack: only large guesses are unsure
            guessed = any(size is None for _, size, *_ in self.plan.pre_blocks.get(id(life), ()))
            if not life.expandable and guessed and life.size != SMALL_BUFFER:
                segment = self._segment_at(life.address)
                if segment is not None:
                    self.uncertain.add(segment)
        self.sim.drain_trace()

    def _expandable_at_start(self) -> list[dict]:
        """The expandable ranges mapped when the trace began, as snapshot segments for :meth:`restore`.

        Pages mapped at the end (the snapshot), less those the trace mapped, plus those it
        unmapped, walking back; their blocks are those alive in the snapshot that the trace
        never allocated and those it frees without allocating (sizes exact: expandable
        segments split at 512 bytes). Ranges of one stream and kind further apart than one
        reservation are other reservations; a reservation's pool is the snapshot's, else
        chosen like that of any segment from before the trace (and refuted like it).
        """
        large_page = self.config.large_segment_size
        pages: dict[int, list] = {}  # page address -> [stream, is_small or None, pool or None]
        for segment in self.final:
            if segment.get("is_expandable"):
                for page in range(segment["address"], segment["address"] + segment["total_size"], SMALL_BUFFER):
                    pages[page] = [segment.get("stream", 0), segment.get("segment_type") == "small",
                                   _pool_tuple(segment.get("segment_pool_id", DEFAULT_POOL))]
        for entry in reversed(self.entries):
            action = entry.get("action")
            if action == "segment_map":
                for page in range(entry["addr"], entry["addr"] + entry["size"], SMALL_BUFFER):
                    pages.pop(page, None)
            elif action == "segment_unmap":
                small = True if entry["size"] % large_page else None
                for page in range(entry["addr"], entry["addr"] + entry["size"], SMALL_BUFFER):
                    pages[page] = [entry.get("stream", 0), small, None]
        if not pages:
            return []
        def group_pool(group: list) -> Any:
            return next((r[4] for r in group if r[4] is not None), None)

        known = [(addr, None, state, done_at, requested) for addr, requested, state, done_at in self.plan.freed_before]
        for segment in self.final:
            if not segment.get("is_expandable"):
                continue
            cursor = segment["address"]
            for block in segment["blocks"]:
                addr, state = block.get("address", cursor), block["state"]
                cursor = addr + block["size"]
                if state == "inactive":
                    continue
                if state == "active_allocated" and self.plan.in_trace_at_end.get(addr, 0) > 0:
                    continue
                if state == "active_pending_free" and self.plan.pending_in_trace.get(addr, 0) > 0:
                    continue
                known.append((addr, block["size"], state, None, block.get("requested_size", 0)))
        ranges = []
        for page in sorted(pages):
            stream, small, pool = pages[page]
            if ranges and ranges[-1][0] + ranges[-1][1] == page and ranges[-1][2] == stream \
                    and (small is None or ranges[-1][3] is None or ranges[-1][3] == small):
                last = ranges[-1]
                last[1] += SMALL_BUFFER
                last[3] = last[3] if last[3] is not None else small
                last[4] = last[4] if last[4] is not None else pool
            else:
                ranges.append([page, SMALL_BUFFER, stream, small, pool])
        # one reservation per stream, kind and pool: ranges further apart than its size are other reservations
        groups: list[list] = []
        for rng in ranges:
            rng[3] = bool(rng[3])
            for group in groups:
                first = group[0]
                if first[2] == rng[2] and first[3] == rng[3] and rng[0] - first[0] < self._virtual_size(
                        SMALL_BUFFER if rng[3] else large_page, rng[0]) and (rng[4] is None or group_pool(group) in (None, rng[4])):
                    group.append(rng)
                    break
            else:
                groups.append([rng])
        named = set()
        for group in groups:  # checked before any pool is chosen, so that a refusal leaves no trace
            pool, stream, small, base = group_pool(group), group[0][2], group[0][3], group[0][0]
            page = SMALL_BUFFER if small else large_page
            span = self._virtual_size(page, base)
            if any((a - base) % page or n % page or a + n > base + span for a, n, *_ in group):
                raise ValueError("ranges that one reservation cannot hold")
            if pool is not None:
                if (stream, small, pool) in named:
                    raise ValueError("two reservations of one stream, kind and pool")
                named.add((stream, small, pool))
        starts = self._reservation_starts(groups, large_page)
        out = []
        used = {(stream, small, self._pool(pool).id) for stream, small, pool in named} if not self.layout else set()
        for group in groups:
            pool = group_pool(group)
            stream, small = group[0][2], group[0][3]
            base = group[0][0]
            if pool is None or self.layout:
                life = _Life(base, self._virtual_size(SMALL_BUFFER if small else large_page, base), stream, -1,
                             expandable=True, pre_trace=True)
                pool_id = self._pre_pool(life, taken={p for s_, k_, p in used if (s_, k_) == (stream, small)})
                if pool is not None:  # (layout mode) what the snapshot says of it, as for any named segment
                    self.known_pools[_identity(life)] = pool
            else:
                pool_id = self._pool(pool).id
            used.add((stream, small, pool_id))
            for address, size, _, _, _ in group:
                inside = [k for k in known if address <= k[0] < address + size]
                out.append({"address": address, "total_size": size, "stream": stream, "is_expandable": True,
                            "reservation_address": starts[id(group)],
                            "segment_type": "small" if small else "large", "segment_pool_id": pool_id,
                            "blocks": [{"size": b, "state": st, "requested_size": rq}
                                       for b, st, rq, _ in self._layout(address, size, inside)]})
        return out

    def _reservation_starts(self, groups: list[list], large_page: int) -> dict[int, int]:
        """Where each rebuilt reservation begins: its lowest page mapped then, or below it.

        The driver lays reservations end to end on a ``RESERVATION_ALIGNMENT`` grid, each
        one its virtual size rounded up to that grid. A reservation whose lowest pages were
        unmapped when the trace began would, started at its lowest mapped page, reach into
        the next reservation and take the pages the trace maps there. Its start is taken as
        the highest address on that grid and on its page grid, at or below its lowest page,
        whose range ends at or below the start of the next rebuilt reservation above it (all
        of them existed together), walked from the top. That is never below the true start
        when the one above is not, so a range never reaches into a reservation the driver
        laid after it. Without a reservation above, or with no such address, the lowest
        mapped page (a reservation cannot be shown to start lower).
        """
        starts: dict[int, int] = {}
        above = None  # start of the rebuilt reservation just above
        for group in sorted(groups, key=lambda g: -g[0][0]):
            small = group[0][3]
            low, high = group[0][0], max(a + n for a, n, *_ in group)
            page = SMALL_BUFFER if small else large_page
            virtual = self._virtual_size(page, low)
            start = low
            if above is not None and above >= high:
                limit = min(above - virtual, low)
                candidate = limit - limit % RESERVATION_ALIGNMENT
                while candidate >= high - virtual and (low - candidate) % page:
                    candidate -= RESERVATION_ALIGNMENT
                if candidate < high - virtual:  # off the grid: the highest start on its page grid
                    candidate = low - -(-(low - limit) // page) * page
                if candidate >= high - virtual and candidate != low:
                    start = candidate
                    self.decisions[f"reservation {low:#x}"] = f"starts at {start:#x}, below the next reservation"
            starts[id(group)] = start
            above = start
        return starts

    def _layout(self, start: int, size: int, known) -> list[tuple]:
        """(size, state, requested, guessed) tiling ``[start, start + size)``: the known blocks
        (address, size or None when only the request is known, state, entry, requested), the rest free."""
        end = start + size
        layout, cursor = [], start
        known = sorted(known, key=lambda b: b[0])
        for n, (addr, bsize, state, _, requested) in enumerate(known):
            if addr < cursor or addr >= end:
                continue
            limit = known[n + 1][0] if n + 1 < len(known) else end
            guessed = bsize is None
            bsize = min(round_size(max(requested, 1), self.sim.divisions) if guessed else bsize, limit - addr)
            if bsize <= 0:
                continue
            if addr > cursor:
                layout.append((addr - cursor, "inactive", 0, False))
            layout.append((bsize, state, requested, guessed))
            cursor = addr + bsize
        if cursor < end:
            layout.append((end - cursor, "inactive", 0, False))
        merged = []
        for item in layout:
            if merged and item[1] == "inactive" and merged[-1][1] == "inactive":
                merged[-1] = (merged[-1][0] + item[0], "inactive", 0, False)
            else:
                merged.append(item)
        return merged

    def _contradicting_pre_lives(self) -> list[_Life]:
        """Segments from before the trace that overlap another one: the trace and its snapshot disagree
        (a trace cut short, or a snapshot of another moment). Each overlap is a mismatch; the one the
        trace does not release (it comes from the snapshot) is left out of the rebuilt state."""
        lives = sorted((life for life in self.plan.pre if not life.expandable), key=lambda life: life.address)
        dropped: list[_Life] = []
        last = None
        for life in lives:
            if last is not None and life.address < last.address + last.size:
                drop = life if life.end is None or last.end is not None else last
                self.check(False, f"a segment {life.size} B at {life.address:#x} and a segment {last.size} B at "
                                  f"{last.address:#x} both existed before the trace began: the trace and its "
                                  f"snapshot disagree")
                dropped.append(drop)
                last = last if drop is life else life
                continue
            last = life
        return dropped

    def _pre_layout(self, life: _Life) -> list[tuple]:
        """(size, state, requested, guessed) of the blocks of a segment from before the trace.

        Blocks alive in the snapshot are exact; a block the trace frees (or completes) without
        having allocated it gets its request's rounded size, a guess (it may have been handed
        out whole). The rest of the segment is free.
        """
        return self._layout(life.address, life.size, self.plan.pre_blocks.get(id(life), ()))

    def _pre_pool(self, life: _Life, taken: set | None = None) -> tuple[int, int]:
        """A segment from before the trace that the snapshot does not name: the default pool, else
        the pool inferred for it (from the allocations in it and the releases it took part in),
        else a pool of its own, skipping refuted choices. A segment one private pool's emptyCache
        gave back takes the inferred pool first."""
        key = ("pre-trace segment", life.address)
        if self.layout:
            label = f"own@{_identity(life)}"
            pool = self._pool(label)
            self.identity[pool.id] = _identity(life)
            return pool.id
        own = f"pre-trace@{life.address:#x}"
        order = (DEFAULT_POOL, self.assignment.get(_identity(life)))
        if _identity(life) in self.released_alone:
            order = order[::-1]
        taken = taken or set()
        label = next((choice for choice in order
                      if choice is not None and (key, choice) not in self.refuted
                      and (choice not in self.pools or self.pools[choice].id not in taken)
                      and choice not in taken), own)
        pool = self._pool(label)
        self._decide(key, label)
        self.choice_keys[life.address] = (key, label)
        self._pending_key = None
        return pool.id

    # the end ------------------------------------------------------------------

    def _compare_final(self) -> None:
        simulated = {(s["address"], s["total_size"]): s for s in self.sim.snapshot()}
        self.sim.drain_trace()
        recorded = {(s["address"], s["total_size"]): s for s in self.final}
        untouched = {(life.address, life.size) for life in self.plan.pre if not life.touched and not life.expandable}
        for key in sorted(set(simulated) | set(recorded)):
            if key in untouched:
                continue  # rebuilt from the snapshot itself: comparing it would prove nothing
            mine, theirs = simulated.get(key), recorded.get(key)
            if theirs is None and not self._in_snapshot(mine):
                continue  # a pool the snapshot was not taken of
            want = None if theirs is None else _shape(theirs)
            got = None if mine is None else _shape(mine)
            segment = self._segment_at(key[0])
            uncertain = self._is_uncertain(segment) or any(key[0] <= a < key[0] + key[1] for a in self.diverged_elsewhere)
            if theirs is not None and theirs.get("is_expandable") and self.plan.mid_run and not self.expandable_rebuilt:
                # expandable memory from before the trace is not rebuilt: a range with pages mapped then is a guess
                uncertain = uncertain or self.plan.mapped_before(key[0], key[1])
            self.check(want == got, f"final snapshot segment {_fmt_seg(key)}: expected {want}, simulated {got}",
                       uncertain)


    def _in_snapshot(self, segment: dict) -> bool:
        """Whether the snapshot would show this simulated segment (it may be one pool's snapshot)."""
        if self.snapshot_pools is None:
            return True
        return _pool_tuple(segment.get("segment_pool_id", DEFAULT_POOL)) in self.snapshot_pools


def _reserved_before(entries: list[dict], final: list[dict]) -> list[int]:
    """Device memory reserved before each entry (and after the last), walking back from the snapshot."""
    reserved = [0] * (len(entries) + 1)
    reserved[-1] = sum(segment["total_size"] for segment in final)
    for i in range(len(entries) - 1, -1, -1):
        action, size = entries[i].get("action"), entries[i].get("size", 0)
        change = size if action in ("segment_alloc", "segment_map") else -size if action in _RELEASES else 0
        reserved[i] = reserved[i + 1] - change
    return reserved


def _made_at(choice: tuple) -> int:
    """When a (decision key, label) choice was made: its entry, or before the first one for the
    pools of segments from before the trace (whose keys carry an address, not an entry)."""
    key = choice[0]
    return -1 if key[0] == "pre-trace segment" else key[1]


def _releasable(segment) -> bool:
    """Whether an empty_cache of its pool would give memory of this segment back."""
    for block in segment.blocks():
        if block.key is None:
            continue
        if not segment.expandable:
            return block.prev is None and block.next is None
        offset = block.ptr - segment.address
        if -(-offset // segment.page_size) < (offset + block.size) // segment.page_size:
            return True
    return False


def _shape(segment: dict) -> tuple:
    return (segment.get("stream", 0), segment.get("segment_type"), _pool_tuple(segment.get("segment_pool_id", (0, 0))),
            bool(segment.get("is_expandable", False)), [(b["size"], b["state"]) for b in segment["blocks"]])


def _fmt_seg(seg: tuple[int, int] | None) -> str:
    return "none" if seg is None else f"{seg[1]} B at {seg[0]:#x}"


def _fmt(calls: list) -> str:
    return "[" + ", ".join(f"{a} {s} B at {addr:#x}" for a, addr, s in calls) + "]" if calls else "none"


# ----------------------------------------------------------------------------- pool inference


def _infer_pools(layout: _Replayer, conflicts: dict, private_conflicts: dict, refuted: set) -> dict:
    """A pool for every segment the snapshot does not name, from when and where allocations happened.

    Routing comes in sessions (a capture, a ``use_mem_pool`` block): consecutive allocations
    share a pool. So each segment goes to the pool most of the allocations next to its own
    allocations went to, among the pools it may share: no conflict with their segments (a
    better block it would have been given, memory released while it was kept, an allocation
    after the pool's memory went back), no choice refuted by an earlier replay. Segments one
    release gave back together from a single private pool stay together and private. Start
    from "the pool of the allocation before it", then move segments to their neighbours'
    majority until nothing moves. Returns identity -> label (a known pool id, or a new label).
    """
    known = layout.known_pools
    landings = layout.landings
    parent: dict[Any, Any] = {}

    def root(x: Any) -> Any:
        while parent.get(x, x) != x:
            x = parent[x]
        return x

    private_only = set()
    for group in [*layout.one_pool, *layout.one_pool_any]:
        members_ = [m for m in group if m is not None]
        for other in members_[1:]:
            a, b = root(members_[0]), root(other)
            if a != b and not (a in known and b in known and known[a] != known[b]):
                if b in known:
                    a, b = b, a
                parent[b] = a
    for group in layout.one_pool:
        private_only.update(m for m in group if m is not None)
    private_only = {root(m) for m in private_only}
    known_root = {}
    for identity, label in known.items():
        known_root.setdefault(root(identity), label)
    conflict_roots: dict[Any, set] = {}
    private_roots: dict[Any, set] = {}
    for table, into in ((conflicts, conflict_roots), (private_conflicts, private_roots)):
        for a, others in table.items():
            into.setdefault(root(a), set()).update(root(b) for b in others)
    refused = {(root(key[1]), label) for key, label in refuted if key[0] in ("segment", "pre-trace segment")}
    pluggable = {root(i) for i in layout.pluggable}
    first_seen: dict[Any, int] = {}
    neighbours: dict[Any, list] = {}
    rooted = [(i, root(identity)) for i, identity in landings]
    for k, (_, mine) in enumerate(rooted):
        first_seen.setdefault(mine, k)
        for step in (-1, 1):
            j = k + step
            while 0 <= j < len(rooted) and rooted[j][1] == mine:
                j += step
            if 0 <= j < len(rooted):
                neighbours.setdefault(mine, []).append(rooted[j][1])
    assignment = dict(known_root)
    members: dict[Any, set] = {}
    for r, label in known_root.items():
        members.setdefault(label, set()).add(r)
    pluggable_labels = {label for r, label in known_root.items() if r in pluggable}

    def allowed(r: Any, label: Any) -> bool:
        if (r, label) in refused or (r in pluggable) != (label in pluggable_labels):
            return False
        if label == DEFAULT_POOL and r in private_only:
            return False
        others = members.get(label, set()) - {r}
        if conflict_roots.get(r, set()) & others:
            return False
        return label == DEFAULT_POOL or not (private_roots.get(r, set()) & others)

    def put(r: Any, label: Any) -> None:
        old = assignment.get(r)
        if old is not None:
            members[old].discard(r)
        assignment[r] = label
        members.setdefault(label, set()).add(r)
        if r in pluggable:
            pluggable_labels.add(label)

    unknown = sorted((r for r in first_seen if r not in known_root and r is not None), key=lambda r: first_seen[r])
    for r in unknown:  # the pool of the allocation before, else the default pool, else a new one
        k = first_seen[r]
        before = assignment.get(rooted[k - 1][1]) if k > 0 else None
        for label in (before, DEFAULT_POOL):
            if label is not None and allowed(r, label):
                put(r, label)
                break
        else:
            put(r, f"inferred@{r}")
    for r in sorted(private_only - set(assignment), key=str):  # released together, nothing allocated in them
        if r is not None and r not in known_root:
            put(r, f"inferred@{r}")
    for _ in range(12):  # move each segment to its neighbours' majority while that changes anything
        moved = False
        for r in unknown:
            votes: dict[Any, int] = {}
            for other in neighbours.get(r, ()):
                label = assignment.get(other)
                if label is not None:
                    votes[label] = votes.get(label, 0) + 1
            current = assignment[r]
            best, best_votes = current, votes.get(current, 0)
            for label, count in sorted(votes.items(), key=lambda kv: (-kv[1], kv[0] != DEFAULT_POOL, str(kv[0]))):
                better = count > best_votes or (count == best_votes and label == DEFAULT_POOL != current)
                if better and allowed(r, label):  # a tie goes to the default pool: sessions are short
                    best, best_votes = label, count
                    break
            if best != current:
                put(r, best)
                moved = True
        if not moved:
            break
    result = {}
    for identity in set(first_seen) | set(parent) | {i for group in layout.one_pool for i in group}:  # noqa: C401
        if identity is None or identity in known:
            continue
        label = assignment.get(root(identity))
        if label is not None:
            result[identity] = label
    return result


# ----------------------------------------------------------------------------- entry point


def replay_trace(snapshot: Any, device: int | None = None, *, memory_fraction: float | None = None,
                 device_memory: int | None = None, torch_version: str | None = None,
                 snapshot_pools: Any = None) -> ReplayReport:
    """Replay ``snapshot``'s device trace on a fresh simulated allocator; see the module docstring.

    Args:
        snapshot: a ``_snapshot()`` dict, or a path to its pickle (``.pickle`` or ``.pickle.gz``).
        device: which device's trace (default: the only one with entries).
        memory_fraction: the ``set_per_process_memory_fraction`` the program ran with.
        device_memory: the device's total memory in bytes (known devices are looked up).
        torch_version: the torch that recorded it (its parsing rules for the settings string).
            The three default to a ``corpus`` record in the snapshot, as the differential
            corpus stores one; the recorded ``allocator_settings`` always decide the settings.
        snapshot_pools: the pool ids (``(a, b)`` pairs) whose segments the snapshot holds, when
            it was taken of some pools only (``MemPool.snapshot()``, a graph pool's segments):
            at the end, simulated segments of other pools are not compared with it. Default:
            the snapshot holds every segment of the device.

    Returns:
        :class:`ReplayReport`.
    """
    snapshot = load_trace(snapshot)
    if snapshot_pools is not None:
        pools = [tuple(p) if isinstance(p, (tuple, list)) else p for p in snapshot_pools]
        if not pools or any(not isinstance(p, tuple) or len(p) != 2 or not all(isinstance(v, int) for v in p)
                            for p in pools):
            raise ValueError(f"snapshot_pools must be pool ids, (int, int) pairs such as (0, 1); got {snapshot_pools!r}")
    traces = snapshot["device_traces"]
    if device is None:
        busy = [d for d, trace in enumerate(traces) if trace]
        if len(busy) > 1:
            raise ValueError(f"the snapshot has traces for devices {busy}; pass device= to choose one")
        device = busy[0] if busy else 0
    if device >= max(len(traces), 1):
        raise ValueError(f"the snapshot has traces for {len(traces)} device(s); device {device} is not among them")
    entries = list(traces[device]) if traces else []
    final = [s for s in snapshot["segments"] if s.get("device", 0) == device]
    meta = snapshot.get("corpus") or {}
    if memory_fraction is None:
        memory_fraction = meta.get("fraction")
    if torch_version is None:
        torch_version = meta.get("torch")
    if device_memory is None:
        device_memory = DEVICE_MEMORY.get(meta.get("device"), _UNKNOWN_DEVICE_MEMORY)
    config = AllocatorConfig.from_settings(snapshot.get("allocator_settings") or {}, torch_version or "2.11")
    if snapshot_pools is not None:
        snapshot_pools = {_pool_tuple(p) for p in snapshot_pools}
        outside = sorted({_pool_tuple(s.get("segment_pool_id", DEFAULT_POOL)) for s in final} - snapshot_pools)
        if outside:
            raise ValueError(f"the snapshot holds segments of pools {outside}, which snapshot_pools={sorted(snapshot_pools)} "
                             f"leaves out; pass every pool the snapshot was taken of")
    layout = _Replayer(snapshot, entries, final, config, device_memory, memory_fraction, set(), layout=True)
    layout.run()
    conflicts = layout.conflicts
    private_conflicts: dict[Any, set] = {}
    for gone, when in layout.released_at.items():
        for other, last in layout.active_at.items():
            if gone is not None and other is not None and other != gone and last > when:
                private_conflicts.setdefault(gone, set()).add(other)
                private_conflicts.setdefault(other, set()).add(gone)
    refuted: set = set()
    replayer = None
    stuck = False
    for _ in range(_MAX_REPLAYS):
        assignment = _infer_pools(layout, conflicts, private_conflicts, refuted)
        replayer = _Replayer(snapshot, entries, final, config, device_memory, memory_fraction, refuted,
                             conflicts=conflicts, private_conflicts=private_conflicts, snapshot_pools=snapshot_pools)
        replayer.assignment = assignment
        replayer.released_alone = {i for group in layout.one_pool for i in group if i is not None}
        try:
            replayer.run()
        except _Refuted as refutation:
            if (refutation.key, refutation.label) in refuted:
                stuck = True  # the same choice again: another replay would be the same one
                break
            refuted.add((refutation.key, refutation.label))
            continue
        break
    else:
        stuck = True
    if stuck:  # out of patience: report the last replay as it stands
        replayer = _Replayer(snapshot, entries, final, config, device_memory, memory_fraction, refuted,
                             conflicts=conflicts, private_conflicts=private_conflicts, snapshot_pools=snapshot_pools)
        replayer.assignment = _infer_pools(layout, conflicts, private_conflicts, refuted)
        replayer.released_alone = {i for group in layout.one_pool for i in group if i is not None}
        replayer.blaming = False
        replayer.run()
    checks = replayer.checks
    agreement = 0.0 if checks == 0 else 1.0 - len(replayer.mismatches) / checks
    report = ReplayReport(
        agreement=agreement, mismatches=replayer.mismatches, events=len(entries), checks=checks,
        unverifiable=replayer.unverifiable, mid_run=replayer.plan.mid_run,
        inferred={k: v for k, v in replayer.decisions.items()}, refuted=len(refuted),
    )
    if checks == 0:
        report.mismatches.append("no check could be made: the trace has no entries to compare")
    recorded_stats = snapshot.get("memory_stats")
    if recorded_stats and not replayer.plan.mid_run and entries:
        mine = replayer.sim.memory_stats()
        for key in sorted(recorded_stats):
            if key in _UNOBSERVABLE_STATS or key not in mine:
                continue
            report.stats_checked += 1
            if mine[key] != recorded_stats[key]:
                report.stats_mismatches.append(f"memory_stats {key}: recorded {recorded_stats[key]}, simulated {mine[key]}")
    return report
