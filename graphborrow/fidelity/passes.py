"""A pass of trace replay: the trace driven, operation by operation, into a fresh allocator model.

:class:`ReplayPass` reads the trace's entries as the operations that wrote them (a malloc
with the segments it allocated, mapped or released; a free, plain or cross-stream; a run of
releases that was an ``empty_cache``), runs each on a fresh
:class:`~graphborrow.allocator.caching.CachingAllocator` whose memory is told the addresses
the trace recorded, and compares what the model wrote with what the trace says. Where
the trace does not say which pool a new segment went to, the pass asks :meth:`ReplayPass.choose`.

Two passes share this loop (see :mod:`graphborrow.fidelity.replay`):
:class:`~graphborrow.fidelity.layout_pass.LayoutPass` puts every segment in a pool of its
own and records which could share one; :class:`~graphborrow.fidelity.checking_pass.CheckingPass`
follows the pools inferred from that and makes the checks that are reported.

Checks that depend on state guessed before a mid-run trace are not made but counted
(:meth:`ReplayPass.check` with ``uncertain``), under the reason that made them so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sortedcontainers import SortedDict

from graphborrow.allocator import replay_support as queries
from graphborrow.allocator.blocks import DEFAULT_POOL, pool_tuple
from graphborrow.allocator.caching import CachingAllocator
from graphborrow.allocator.config import AllocatorConfig
from graphborrow.allocator.errors import AddressInUseError, AllocatorOutOfMemoryError
from graphborrow.allocator.memory import PhysicalMemory
from graphborrow.allocator.restore import restore
from graphborrow.allocator.streams import Clockwork, Event
from graphborrow.core.errors import SnapshotFormatError
from graphborrow.core.sizes import SMALL_BUFFER, allocation_size, round_size

from . import prestate
from .lifetimes import RELEASES, Geometry, Reservation, SegmentLife, SegmentLifetimes, reserved_before
from .pool_inference import DEFAULT_LABEL, Choice, PoolLabel, ReplayPool

__all__ = ["STOP", "Malloc", "Outcome", "ReplayPass", "TraceInput", "fmt_calls", "releasable"]

SKIPPED = frozenset({"snapshot", "annotate", "user_defined"})
DEVICE_CALLS = frozenset({"segment_alloc", "segment_map", "segment_free", "segment_unmap"})
# why a check could not be made (ReplayReport.unverifiable_reasons counts them by these)
NOT_REBUILT = "memory from before the trace that could not be rebuilt"
GUESSED = "a segment whose blocks before the trace are a guess (a free says a block existed, not its size)"
DIVERGED = "memory that went another way than the trace after a check that could not be made"
EXPANDABLE = "expandable memory from before the trace that could not be rebuilt"
CAP = "a decision of the memory fraction's cap while the model holds other memory than the trace did"
PLACED = "the trace places memory where the state rebuilt before it differs"
REPLAY_BASE = 1 << 60  # memory the trace does not place lands far above any traced address
INFERRED_BASE = 1 << 20  # synthetic ids (0, n) of pools the trace does not name
STOP = object()  # before_route's answer: the malloc ends there (nothing more to replay of it)


@dataclass(frozen=True)
class TraceInput:
    """A trace to replay: its entries, the snapshot's segments at its end, and how it was recorded.

    ``snapshot_pools`` are the pools the snapshot was taken of (None: every pool of the device);
    ``starts_empty`` says that the trace begins at an empty allocator.
    """

    entries: list[dict]
    final: list[dict]
    config: AllocatorConfig
    device_memory: int
    fraction: float | None
    snapshot_pools: frozenset | None
    starts_empty: bool = False
    learned: dict = field(default_factory=dict)  # address -> size of blocks from before the trace, as the trace taught
    bounds: frozenset = frozenset()  # ... of them, those whose learned size is only a least size, still a guess

    @property
    def geometry(self) -> Geometry:
        return Geometry(self.device_memory, self.config.large_segment_size)


@dataclass(frozen=True)
class Malloc:
    """The entries one malloc wrote: pages it mapped or the segment it allocated, then alloc (or oom)."""

    start: int  # its first entry (a segment_map or segment_alloc, or the alloc itself)
    index: int  # the alloc or oom entry
    entry: dict
    maps: tuple
    new_segment: dict | None

    @property
    def first(self) -> dict | None:
        """The first device call it made (a map or a new segment), if any."""
        return self.maps[0] if self.maps else self.new_segment

    @property
    def oom(self) -> bool:
        return self.entry["action"] == "oom"

    @property
    def stream(self) -> int:
        return self.entry.get("stream", 0)

    @property
    def nbytes(self) -> int:
        return self.entry["size"]

    def expected(self, released: list[dict]) -> list[tuple]:
        """The device calls the trace recorded for it, releases first."""
        calls = [(e["action"], e["addr"], e["size"]) for e in released]
        calls += [(e["action"], e["addr"], e["size"]) for e in self.maps]
        if self.new_segment is not None:
            calls.append(("segment_alloc", self.new_segment["addr"], self.new_segment["size"]))
        return calls


@dataclass
class Outcome:
    """What the model did for one malloc, against what the trace says."""

    block: Any
    failure: Exception | None
    got: list[tuple]
    expected: list[tuple]
    uncertain: str | None  # why its checks cannot be made, or None
    where: str
    short: Any = None  # a guessed block the trace placed this allocation after, not where the guess ends
    after_guess: bool = False  # the model placed it right after a guessed block

    @property
    def calls_ok(self) -> bool:
        return sorted(self.got) == sorted(self.expected)

    def addresses(self) -> list[int]:
        return [a for _, a, _ in self.got + self.expected if a]


class _TracedAddresses:
    """raw_alloc / raw_delete for replayed pluggable pools: hands out the addresses the trace recorded."""

    def __init__(self) -> None:
        self.expected: int | None = None
        self.refuse = False  # the trace says this allocation ran out of memory
        self._spare = REPLAY_BASE * 2

    def raw_alloc(self, nbytes: int, stream: int) -> int:
        if self.refuse:
            return 0
        if self.expected is not None:
            address, self.expected = self.expected, None
            return address
        address = self._spare
        self._spare += -(-nbytes // SMALL_BUFFER) * SMALL_BUFFER
        return address

    def raw_delete(self, address: int, nbytes: int, stream: int) -> None:
        pass


def _route_everything(stream: int, thread: int) -> bool:
    return True


class ReplayPass:
    """One replay of a trace on a fresh allocator model; subclasses decide pools and keep evidence.

    Args:
        trace: the trace and how it was recorded.
    """

    def __init__(self, trace: TraceInput) -> None:
        self.trace = trace
        self.entries = trace.entries
        self.final = trace.final
        self.config = trace.config
        self.memory = PhysicalMemory(capacity=trace.device_memory, backed=False, base=REPLAY_BASE)
        self.clockwork = Clockwork()
        self.sim = CachingAllocator(self.memory, self.clockwork, trace.config)
        if trace.fraction is not None:
            self.sim.set_memory_fraction(trace.fraction)
        self.sim.record_history(True, max_entries=1 << 30)
        self.plan = SegmentLifetimes(trace.entries, trace.final, trace.geometry)
        # device memory reserved before each entry, as the trace and its snapshot say (None: the snapshot
        # was taken of some pools only); the decisions a memory fraction makes depend on it
        self.reserved_before = None if trace.snapshot_pools is not None else reserved_before(trace.entries, trace.final)
        self.expandable_rebuilt = False  # expandable ranges mapped before a mid-run trace were restored
        self.traced_addresses = _TracedAddresses()
        self.pools: dict[PoolLabel, ReplayPool] = {DEFAULT_LABEL: ReplayPool(DEFAULT_POOL, True, False)}
        self.decisions: dict[str, str] = {}
        self.blocks: dict[int, list] = {}  # traced address -> simulated blocks alive there
        self.pending: dict[int, list] = {}  # traced address -> [(block, phantom stream)] awaiting completion
        self.uncertain: dict = {}  # sim segment -> its blocks from before the trace whose sizes are guesses
        self.skipped: set = set()  # traced addresses of allocations that could not be replayed (mid-run)
        self.diverged: set = set()  # sim segments that went their own way after an unverifiable decision
        self.diverged_elsewhere: list[int] = []  # traced addresses such a decision left without a sim segment
        streams = [e.get("stream", 0) for e in trace.entries] + [s.get("stream", 0) for s in trace.final] + [0]
        self._next_phantom = max(s for s in streams if isinstance(s, int)) + 1
        self._idle_phantoms: list = []
        self._index = SortedDict()  # sim segment start -> segments (rebuilt when segments change)
        self._index_stamp = None
        self._next_inferred = INFERRED_BASE
        self.last_label: PoolLabel = DEFAULT_LABEL
        self.checks = 0
        self.unverifiable = 0
        self.unverifiable_reasons: dict[str, int] = {}
        self.mismatches: list[str] = []

    # --------------------------------------------------------------- what subclasses decide

    def choose(self, choice: Choice, known: tuple | None, nbytes: int, stream: int, pluggable: bool | None,
               expandable: bool) -> PoolLabel:
        """The pool of a new segment (or of an allocation that failed; ``pluggable`` None: either kind)."""
        raise NotImplementedError

    def pre_segment_pool(self, life: SegmentLife) -> tuple[int, int]:
        """The pool id of a segment from before the trace."""
        raise NotImplementedError

    def reservation_pools(self, groups: list[Reservation]) -> list[tuple[int, int]]:
        """The pool ids of the expandable reservations from before the trace, in order."""
        raise NotImplementedError

    def empty_cache(self, i: int, run: list[dict]) -> None:
        """A run of releases that was no malloc's: an ``empty_cache`` (of everything, or of one pool)."""
        raise NotImplementedError

    def before_route(self, m: Malloc, released: list[dict], completed: list[dict]) -> Any:
        """What the releases inside a malloc say, before its pool is chosen; :data:`STOP` ends the malloc there."""
        raise NotImplementedError

    def routed_privately(self, entry: dict, start: int) -> bool:
        """Whether the allocation of ``entry`` (entries from ``start``) went to a private pool, as far as known."""
        raise NotImplementedError

    def collected(self, run: list[dict]) -> bool:
        """Whether garbage collection made this run of releases inside the next malloc."""
        raise NotImplementedError

    def after_route(self, label: PoolLabel, m: Malloc) -> None:
        """Told the pool of a malloc before it runs."""

    def on_oom(self, m: Malloc, outcome: Outcome, context: Any, ok: bool) -> None:
        """Told how an allocation the trace records as failed went."""

    def on_failure(self, m: Malloc, outcome: Outcome, label: PoolLabel) -> None:
        """Told that the model raised where the trace's allocation succeeded."""

    def on_landing(self, m: Malloc, outcome: Outcome, context: Any) -> None:
        """Told where an allocation landed (in ``outcome.block``) before it is checked."""

    def on_landed(self, m: Malloc, block: Any) -> None:
        """Told of an allocation the model made, after it was checked."""

    # --------------------------------------------------------------- bookkeeping

    def check(self, ok: bool, message: str, uncertain: str | None = None) -> None:
        """Count a check: made (a mismatch when not ``ok``), or not made for the reason ``uncertain``."""
        if uncertain:
            self.not_made(uncertain)
            return
        self.checks += 1
        if not ok:
            self.mismatches.append(message)

    def not_made(self, reason: str, count: int = 1) -> None:
        """Count checks that cannot be made, and why."""
        self.unverifiable += count
        self.unverifiable_reasons[reason] = self.unverifiable_reasons.get(reason, 0) + count

    def segment_at(self, address: int):
        """The innermost simulated segment containing ``address``."""
        stamp = (self.sim.stats.num_device_alloc, self.sim.stats.num_device_free, queries.segment_count(self.sim))
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

    def label_of(self, segment) -> PoolLabel:
        owner = segment.pool.owner
        if owner is None:
            return DEFAULT_LABEL
        for label, pool in self.pools.items():
            if pool.id == owner.id:
                return label
        return PoolLabel.of(owner.id)

    def doubt(self, segment) -> str | None:
        """Why checks involving this model segment cannot be made, or None when they can."""
        if segment is not None and segment in self.diverged:
            return DIVERGED
        return None

    def after_a_guess(self, address: int) -> tuple[str | None, Any]:
        """GUESSED when ``address`` lies in a free block right after a block from before the trace whose
        size is a guess and which is still allocated (that free block's size is the guess's complement),
        with that block: placed there, the next block shows where it ends.

        Only such a free block's size is in doubt (a block freed again merges with the space after it,
        whatever its size), so only a placement that uses one, in the model or in the trace, rests on
        the guess; best fit between blocks of known sizes does not. A placement the trace makes at the
        very start of that free block (best fit takes a free block from its start) shows the guess
        right: the block is known from then on.
        """
        segment = self.segment_at(address)
        guessed = self.uncertain.get(segment) if segment is not None else None
        if not guessed:
            return None, None
        for block in guessed:
            following = block.next
            if block.allocated and following is not None and following.key is not None \
                    and following.ptr <= address < following.ptr + following.size:
                if following.ptr == address:
                    guessed.remove(block)  # the trace placed the next block where the guessed one ends
                    return None, None
                return GUESSED, block
        return None, None

    def doubt_at(self, addresses) -> str | None:
        """The first doubt about the model segments at these addresses (0 stands for none)."""
        return next((reason for reason in (self.doubt(self.segment_at(a)) for a in addresses if a) if reason), None)

    def pool(self, label: PoolLabel, pluggable: bool = False) -> ReplayPool:
        """The replay's pool of ``label``, created (in the model too) when new."""
        pool = self.pools.get(label)
        if pool is None:
            if label.names_a_pool:
                pool = ReplayPool(label.key, True, pluggable)
            else:
                pool = ReplayPool((0, self._next_inferred), False, pluggable)
                self._next_inferred += 1
            self.pools[label] = pool
        if pool.id != DEFAULT_POOL and pool.id not in self.sim.graph_pools:
            self.sim.create_or_incref_pool(pool.id, allocator=self.traced_addresses if pool.pluggable else None)
        return pool

    def malloc(self, label: PoolLabel, nbytes: int, stream: int):
        pool = self.pools[label]
        if pool.id == DEFAULT_POOL:
            return self.sim.malloc(nbytes, stream)
        self.sim.begin_allocate_to_pool(pool.id, _route_everything)
        try:
            return self.sim.malloc(nbytes, stream)
        finally:
            self.sim.end_allocate_to_pool(pool.id)
            self.sim.release_pool(pool.id)

    def reserve_unsure(self, start: int) -> bool:
        """Whether a decision of the memory fraction's cap (out of memory, the retry's releases, garbage
        collection) in the malloc whose entries begin at ``start`` rests on guessed state: in a mid-run
        trace, the simulator holds other device memory than the trace had, and an earlier decision
        already went another way (counted where it happened, as a mismatch or as unverifiable). A
        trace from an empty allocator never: there every difference is a mismatch."""
        if not self.plan.mid_run or self.reserved_before is None or self.sim.allowed_memory_maximum is None:
            return False
        went_astray = bool(self.diverged or self.diverged_elsewhere or self.mismatches)
        return went_astray and self.sim.total_allocated_memory != self.reserved_before[start]

    def phantom_stream(self):
        """A stream that stays busy until the replay says its work is done."""
        stream = self._idle_phantoms.pop() if self._idle_phantoms else self.clockwork.new_stream(self._next_phantom)
        if stream.id == self._next_phantom:
            self._next_phantom += 1
        stream.enqueue(1.0)
        return stream

    def diverge(self, addresses: list) -> None:
        for address in addresses:
            segment = self.segment_at(address)
            if segment is not None:
                self.diverged.add(segment)
            else:
                self.diverged_elsewhere.append(address)

    def pending_blocks(self):
        """Blocks whose cross-stream frees the trace has not completed yet."""
        return [block for waiting in self.pending.values() for block, _ in waiting if block.state == "active_pending_free"]

    # --------------------------------------------------------------- the run

    def run(self) -> None:
        """Replay every entry, then compare the model's segments with the snapshot's."""
        if self.plan.mid_run:
            self.rebuild_start()
        for problem in self.plan.problems:  # memory from before the trace that nothing places
            self.check(False, problem, uncertain=NOT_REBUILT if self.plan.mid_run else None)
        for problem in self.plan.contradictions:
            self.check(False, problem)
        if self.trace.starts_empty:
            for life in self.plan.pre:
                what = "expandable reservation" if life.expandable else "segment"
                self.check(False, f"a {what} at {life.address:#x} existed before the first entry of a trace that starts "
                                  "at an empty allocator: the trace and its snapshot disagree")
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
                i = self.allocation(i, [], [])
            elif action in RELEASES:
                i = self.releases(i, [])
            elif action == "free_requested":
                i = self.free_requested(i)
            elif action == "free_completed":
                i = self._completions(i)
            elif action in SKIPPED:
                i += 1
            else:
                raise SnapshotFormatError(f"trace entry {i} has an unknown action {action!r}")
        self.compare_final()

    def _completions(self, i: int) -> int:
        """A run of free_completed entries: on their own, or completed by the releases right after them."""
        entries = self.entries
        j = i
        while j < len(entries) and entries[j].get("action") == "free_completed":
            j += 1
        if j < len(entries) and entries[j].get("action") in RELEASES and j not in self.plan.failed_releases:
            return self.releases(j, entries[i:j])  # perhaps completed by the release's synchronisation
        self.free_completed(i)
        return i + 1

    # --------------------------------------------------------------- allocations

    def read_malloc(self, i: int) -> Malloc | int:
        """The malloc whose entries begin at ``i``, or the entry to go on from when they do not end in one."""
        entries = self.entries
        start = i
        maps = []
        new_segment = None
        while i < len(entries) and entries[i].get("action") == "segment_map":
            maps.append(entries[i])
            i += 1
        if not maps and i < len(entries) and entries[i].get("action") == "segment_alloc":
            new_segment = entries[i]
            i += 1
        if i >= len(entries) or entries[i].get("action") not in ("alloc", "oom"):
            self.check(False, f"event {start}: {entries[start]['action']} is not followed by its allocation")
            return max(i, start + 1)
        return Malloc(start, i, entries[i], tuple(maps), new_segment)

    def allocation(self, i: int, released: list, completed: list) -> int:
        """One malloc: [segment_alloc | segment_map...] alloc, or an oom.

        ``released`` and ``completed`` are the entries the real allocator wrote inside this
        malloc before them: segments it released and pending frees its synchronisation completed.
        """
        m = self.read_malloc(i)
        if isinstance(m, int):
            return m
        if not m.oom and m.first is None and self.segment_at(m.entry["addr"]) is None and self.plan.mid_run:
            self.not_made(NOT_REBUILT, 2)  # (the device calls and the block)
            self.skipped.add(m.entry["addr"])
            return m.index + 1
        context = self.before_route(m, released, completed)
        if context is STOP:
            return m.index + 1
        label, pluggable = self.route(m)
        self.after_route(label, m)
        outcome = self._run_malloc(m, label, pluggable, released, completed)
        if m.oom:
            self._failed_as_recorded(m, outcome, context)
        elif outcome.failure is not None:
            self._failed_unlike_the_trace(m, outcome, label)
        else:
            self._landed(m, outcome, label, context)
        return m.index + 1

    def _run_malloc(self, m: Malloc, label: PoolLabel, pluggable: bool, released: list, completed: list) -> Outcome:
        """Run the malloc in the model at the addresses the trace recorded; what it did and how sure that is."""
        expected = m.expected(released)
        self.dictate(m.first, pluggable)
        where = f"event {m.index} {'oom' if m.oom else 'alloc'} {m.nbytes} B on stream {m.stream} in pool {self.name(label)}"
        block, failure = None, None
        reserve_unsure = self.reserve_unsure(m.start - len(released))  # (the releases run inside the malloc)
        guessed, short = self.after_a_guess(m.entry["addr"]) if not m.oom and m.first is None else (None, None)
        self.traced_addresses.refuse = m.oom  # a pluggable pool's allocator failed where the trace says
        try:
            block = self.malloc(label, m.nbytes, m.stream)
        except Exception as error:  # OutOfMemoryError is a RuntimeError; a released pool raises too
            failure = error
        finally:
            self.memory.expect_next_address(None)
            self.traced_addresses.expected = None
            self.traced_addresses.refuse = False
        emitted = queries.drain_trace(self.sim)
        self.settle(emitted, completed, where)
        got = [(e["action"], e.get("addr", 0), e["size"]) for e in emitted if e["action"] in DEVICE_CALLS]
        uncertain = self.doubt_at(a for _, a, _ in got + expected) or guessed
        after_guess = block is not None and block.prev is not None and any(
            block.prev is b for b in self.uncertain.get(block.segment, ()))
        if after_guess:
            uncertain = uncertain or GUESSED  # the model placed it right after a guessed block
        if (m.oom or released or failure is not None or got != expected) and reserve_unsure:
            uncertain = CAP  # the cap decided it, and what was reserved before it is not what the trace had
        return Outcome(block, failure, got, expected, uncertain, where, short, after_guess)

    def _failed_as_recorded(self, m: Malloc, outcome: Outcome, context: Any) -> None:
        """An allocation the trace records as out of memory."""
        failure, block = outcome.failure, outcome.block
        ok = isinstance(failure, AllocatorOutOfMemoryError)
        self.on_oom(m, outcome, context, ok)
        uncertain = outcome.uncertain
        self.check(ok, f"{outcome.where}: expected out of memory, simulated "
                       f"{failure if failure is not None else 'an allocation at %#x' % block.ptr}", uncertain)
        self.check(outcome.calls_ok, f"{outcome.where}: expected device calls {fmt_calls(outcome.expected)}, simulated "
                                     f"{fmt_calls(outcome.got)}", uncertain)
        if uncertain and (not ok or not outcome.calls_ok):
            self.diverge(outcome.addresses())
        if block is not None:
            self.sim.free(block)
            queries.drain_trace(self.sim)

    def _failed_unlike_the_trace(self, m: Malloc, outcome: Outcome, label: PoolLabel) -> None:
        """The model raised where the trace's allocation succeeded."""
        failure = outcome.failure
        if self.plan.mid_run and isinstance(failure, AddressInUseError):
            outcome.uncertain = PLACED
        self.on_failure(m, outcome, label)
        if outcome.uncertain:  # the memory the trace placed here never came to be: what it held is not comparable
            self.diverge([m.entry["addr"]] + [a for _, a, _ in outcome.expected if a])
        self.check(False, f"{outcome.where}: simulator raised {type(failure).__name__}: {failure}", outcome.uncertain)
        self.check(False, f"{outcome.where}: no block", outcome.uncertain)

    def _landed(self, m: Malloc, outcome: Outcome, label: PoolLabel, context: Any) -> None:
        """The allocation succeeded in the model: where, against where the trace says."""
        block, addr = outcome.block, m.entry["addr"]
        home = self.segment_at(addr)
        before = self.plan.mid_run and home is None and m.first is None  # memory from before the trace, not rebuilt
        outcome.uncertain = outcome.uncertain or self.doubt(home) or self.doubt(block.segment) or (
            NOT_REBUILT if before else None)
        if outcome.uncertain and (block.ptr != addr or not outcome.calls_ok):  # these segments are not comparable
            self.diverge([block.ptr, addr] + outcome.addresses())
        self.on_landing(m, outcome, context)
        self.check(outcome.calls_ok, f"{outcome.where}: expected device calls {fmt_calls(outcome.expected)}, "
                                     f"simulated {fmt_calls(outcome.got)}", outcome.uncertain)
        self.check(block.ptr == addr, f"{outcome.where}: expected block at {addr:#x}, simulated {block.ptr:#x}",
                   outcome.uncertain)
        self.blocks.setdefault(addr, []).append(block)
        self.last_label = label
        self.pools[label].last_used = m.index
        self.on_landed(m, block)

    def route(self, m: Malloc) -> tuple[PoolLabel, bool]:
        """The pool a traced allocation went to: its segment's, or a choice (new segment, oom)."""
        first, entry = m.first, m.entry
        if first is None and not m.oom:
            segment = self.segment_at(entry["addr"])
            if segment is None:
                return DEFAULT_LABEL, False
            owner = segment.pool.owner
            return self.label_of(segment), owner is not None and owner.allocator is not None
        if first is not None and first["action"] == "segment_map":
            host = self.segment_at(first["addr"])
            if host is not None and host.expandable:
                return self.label_of(host), False  # more pages of a reservation the replay knows
        life = self.plan.lives.get(m.start) if first is not None else None
        known = life.pool if life is not None else None
        expandable = first is not None and first["action"] == "segment_map"
        nested = life is not None and life.pluggable  # inside another segment: a pluggable pool's
        if first is None:  # an allocation that failed: in a pluggable pool or not, the trace does not say
            label = self.choose(Choice("oom", m.start), None, entry["size"], m.stream, None, False)
            return label, self.pools[label].pluggable
        return self.choose(Choice("segment", m.start), known, entry["size"], m.stream, nested, expandable), nested

    def dictate(self, first: dict | None, pluggable: bool) -> None:
        """Tell the model's memory (or the pluggable pool) the address the next device call must get."""
        if first is None:
            return
        if pluggable:
            self.traced_addresses.expected = first["addr"]
        elif first["action"] == "segment_alloc":  # (memory released inside this malloc may be reused)
            self.memory.expect_next_address(first["addr"])
        elif self.segment_at(first["addr"]) is None:  # a new reservation starts at its first page
            self.memory.expect_next_address(first["addr"])

    def name(self, label: PoolLabel) -> str:
        pool = self.pools.get(label)
        return str(pool.id if pool is not None else label)

    # --------------------------------------------------------------- frees

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

    def free_requested(self, i: int) -> int:
        entries = self.entries
        entry = entries[i]
        addr, size = entry["addr"], entry["size"]
        following = entries[i + 1] if i + 1 < len(entries) else {}
        plain = following.get("action") == "free_completed" and following.get("addr") == addr
        block = self._take_block(addr, size)
        if block is None:
            if addr in self.skipped or (self.plan.mid_run and self.segment_at(addr) is None):
                self.not_made(NOT_REBUILT)
            else:
                self.check(False, f"event {i} free_requested {addr:#x}: the simulator has no allocated block there",
                           self.doubt(self.segment_at(addr)))
            return i + 2 if plain else i + 1
        if plain:
            self.sim.free(block)
            queries.drain_trace(self.sim)
            return i + 2
        phantom = self.phantom_stream()
        self.sim.record_stream(block, phantom.id)
        self.sim.free(block)
        queries.drain_trace(self.sim)
        self.pending.setdefault(addr, []).append((block, phantom))
        return i + 1

    def free_completed(self, i: int) -> None:
        """A cross-stream free completed (its events were done at a malloc, or synchronised)."""
        addr = self.entries[i]["addr"]
        waiting = self.pending.get(addr)
        if not waiting:
            if addr in self.skipped or (self.plan.mid_run and self.segment_at(addr) is None):
                self.not_made(NOT_REBUILT)
                return
            self.check(False, f"event {i} free_completed {addr:#x}: no cross-stream free is pending there",
                       self.doubt(self.segment_at(addr)))
            return
        block, phantom = waiting.pop(0)
        phantom.synchronize()
        self.sim.process_events()
        queries.drain_trace(self.sim)
        self.check(block.state == "inactive",
                   f"event {i} free_completed {addr:#x}: the simulator kept the block {block.state}")
        self._idle_phantoms.append(phantom)

    def settle(self, emitted: list, completed: list, where: str) -> None:
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

    # --------------------------------------------------------------- releases

    def releases(self, i: int, completed: list) -> int:
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
                    self.free_completed(i - len(completed) + k)
                completed = []
        j = i
        while j < len(entries) and entries[j].get("action") in RELEASES and j not in self.plan.failed_releases:
            j += 1
        run = entries[i:j]
        m = j
        while m < len(entries) and entries[m].get("action") in ("segment_alloc", "segment_map"):
            m += 1
        after = entries[m].get("action") if m < len(entries) else None
        if (after == "alloc" and m > j) or (after == "oom" and m == j):  # releases inside an allocation?
            if self.released_inside(entries[m], run, j, completed):
                return self.allocation(j, run, completed)
        for k in range(len(completed)):  # completed before the empty_cache's releases
            self.free_completed(i - len(completed) + k)
        self.empty_cache(i, run)
        return j

    def released_inside(self, entry: dict, run: list, start: int, completed: list) -> bool:
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
        private = self.routed_privately(entry, start)
        oversize = all(e["action"] == "segment_free" and e["size"] >= sim.max_split and e["stream"] == entry.get("stream")
                       for e in run)
        allowed = sim.allowed_memory_maximum
        over_cap = allowed is not None and sim.total_allocated_memory + allocation_size(size, sim.large_segment_size) > allowed
        if completed:  # only empty_cache and the out-of-memory path (outside routing) complete pending frees
            if sim.gc_enabled and queries.cached_block_for(sim, entry["size"], entry.get("stream", 0), DEFAULT_POOL) \
                    is None and queries.garbage_collection_victims(sim):
                return False  # that path collects garbage first: its releases would precede the completions
            return over_cap and not private
        if over_cap and (oversize or not private):
            return True
        if sim.gc_enabled:
            return self.collected(run)
        return over_cap and not private  # routed to a private pool, only the two above release memory

    # --------------------------------------------------------------- the state before a mid-run trace

    def rebuild_start(self) -> None:
        """Restore the allocator to the trace's first entry from what the plan found."""
        messages, dropped = prestate.overlapping_lives(self.plan)
        for message in messages:
            self.check(False, message)
        for life in dropped:
            self.plan.pre.remove(life)
        segments = self._expandable_at_start()
        self.expandable_rebuilt = bool(segments)
        for life in self.plan.pre:
            if life.expandable:
                if not self.expandable_rebuilt:
                    self.not_made(EXPANDABLE)
                continue
            pool = self.pre_segment_pool(life)
            layout = prestate.block_layout(life.address, life.size, self.plan.pre_blocks.get(id(life), ()),
                                           self.sim.divisions, self.trace.learned)
            segments.append({
                "address": life.address, "total_size": life.size, "stream": life.stream,
                "segment_type": "small" if life.size == SMALL_BUFFER else "large", "segment_pool_id": pool,
                "blocks": [block.as_snapshot_block() for block in layout],
            })
        phantoms = {}

        def pending_event(address: int) -> Event:
            phantom = self.phantom_stream()
            phantoms[address] = phantom
            event = Event()
            event.record(phantom)
            return event

        pluggable = {self.pools[label].id for label, pool in self.pools.items() if pool.pluggable}
        restored = restore(self.sim, segments, allocators={pool_id: self.traced_addresses for pool_id in pluggable},
                           pending=pending_event)
        for addr, block in restored.allocated.items():
            self.blocks.setdefault(addr, []).append(block)
        for addr, block in restored.pending.items():
            self.pending.setdefault(addr, []).append((block, phantoms[addr]))
        for life in self.plan.pre:  # small blocks are never handed out with slack: only large guesses are unsure
            guessed = [known.address for known in self.plan.pre_blocks.get(id(life), ())
                       if known.size is None and (known.address not in self.trace.learned
                                                  or known.address in self.trace.bounds)]
            if not life.expandable and guessed and life.size != SMALL_BUFFER:
                segment = self.segment_at(life.address)
                blocks = [restored.allocated.get(a) or restored.pending.get(a) for a in guessed]
                if segment is not None:
                    self.uncertain[segment] = [block for block in blocks if block is not None]
        queries.drain_trace(self.sim)

    def _expandable_at_start(self) -> list[dict]:
        """The expandable ranges mapped when the trace began, as snapshot segments for restore (see
        :func:`prestate.expandable_at_start`); none when they fit no set of reservations (left out,
        and what rests on them unverifiable)."""
        try:
            groups = prestate.expandable_at_start(self.plan, self.trace.geometry)
        except prestate.UnexplainedRanges:
            return []
        self.decisions.update(prestate.reservation_starts(groups, self.trace.geometry))
        messages, groups = prestate.separate_reservations(groups, self.plan, self.trace.geometry)
        for message in messages:
            self.check(False, message)
        pools = self.reservation_pools(groups)
        known = prestate.reservation_known_blocks(self.plan)
        segments = []
        for group, pool_id in zip(groups, pools):
            segments += prestate.reservation_segments(group, pool_id, known, self.sim.divisions)
        return segments

    # --------------------------------------------------------------- the end

    def compare_final(self) -> None:
        """The model's segments and blocks at the end against the snapshot's."""
        simulated = {(s["address"], s["total_size"]): s for s in self.sim.snapshot()}
        queries.drain_trace(self.sim)
        recorded = {(s["address"], s["total_size"]): s for s in self.final}
        untouched = {(life.address, life.size) for life in self.plan.pre if not life.touched and not life.expandable}
        untouched |= {(s["address"], s["total_size"]) for s in self.final if s.get("is_expandable") and self.plan.mid_run
                      and self.plan.mapped_before(s["address"], s["total_size"])
                      and not self.plan.touches(s["address"], s["total_size"])}
        for key in sorted(set(simulated) | set(recorded)):
            if key in untouched:
                continue  # rebuilt from the snapshot itself: comparing it would prove nothing
            mine, theirs = simulated.get(key), recorded.get(key)
            if theirs is None and not self._in_snapshot(mine):
                continue  # a pool the snapshot was not taken of
            want = None if theirs is None else _shape(theirs)
            got = None if mine is None else _shape(mine)
            segment = self.segment_at(key[0])
            uncertain = self.doubt(segment) or (
                DIVERGED if any(key[0] <= a < key[0] + key[1] for a in self.diverged_elsewhere) else None)
            if theirs is not None and theirs.get("is_expandable") and self.plan.mid_run and not self.expandable_rebuilt:
                # expandable memory from before the trace is not rebuilt: a range with pages mapped then is a guess
                uncertain = uncertain or (EXPANDABLE if self.plan.mapped_before(key[0], key[1]) else None)
            self.check(want == got, f"final snapshot segment {key[1]} B at {key[0]:#x}: expected {want}, simulated {got}",
                       uncertain)

    def _in_snapshot(self, segment: dict) -> bool:
        """Whether the snapshot would show this simulated segment (it may be one pool's snapshot)."""
        if self.trace.snapshot_pools is None:
            return True
        return pool_tuple(segment.get("segment_pool_id", DEFAULT_POOL)) in self.trace.snapshot_pools



def releasable(segment) -> bool:
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
    return (segment.get("stream", 0), segment.get("segment_type"), pool_tuple(segment.get("segment_pool_id", (0, 0))),
            bool(segment.get("is_expandable", False)), [(b["size"], b["state"]) for b in segment["blocks"]])


def fmt_calls(calls: list) -> str:
    return "[" + ", ".join(f"{a} {s} B at {addr:#x}" for a, addr, s in calls) + "]" if calls else "none"

