"""The layout pass: every segment in a pool of its own, recording which segments could share one.

The trace never names the pool of a segment; before the checking pass can follow inferred
pools, this pass replays the trace with each segment (and each reservation) in a private
pool of its own, releasing memory exactly when the trace does. What it sees is the evidence
:func:`~graphborrow.fidelity.pool_inference.infer_pools` reasons from (:class:`PoolEvidence`):

- two segments conflict when one had a better block for an allocation that landed in the
  other, when an ``empty_cache`` released one and kept the other (releasable) one, or when
  two reservations of one stream and kind were alive together;
- segments one release gave back together belong to one pool (to one private pool when that
  release kept default-pool memory or left frees pending: a MemPool going away);
- a private pool whose memory went back takes no allocation afterwards;
- allocations land in order (``landings``): routing comes in sessions.
"""

from __future__ import annotations

from typing import Any

from graphborrow.allocator import replay_support as queries
from graphborrow.allocator.config import SIZE_MAX
from graphborrow.core.sizes import SMALL_BUFFER, SMALL_SIZE, round_size

from .passes import STOP, Malloc, ReplayPass, TraceInput, releasable
from .lifetimes import Reservation, SegmentId, SegmentLife
from .pool_inference import DEFAULT_LABEL, Choice, PoolEvidence, PoolLabel

__all__ = ["LayoutPass"]


class LayoutPass(ReplayPass):
    """Replays a trace with one pool per segment and collects :class:`PoolEvidence` (see the module)."""

    def __init__(self, trace: TraceInput) -> None:
        super().__init__(trace)
        self.evidence = PoolEvidence(known={life.identity: life.pool for life in self.plan.all_lives()
                                            if life.pool is not None})
        self.released_at: dict[SegmentId, int] = {}  # identity -> entry of its first release
        self.active_at: dict[SegmentId, int] = {}  # identity -> entry of its last allocation
        self.reservations: list = []  # expandable segments seen
        self.identity: dict[tuple[int, int], SegmentId] = {}  # pool id -> its segment's identity
        self._groups_stamp = None
        self._groups: dict[tuple, list] = {}

    def result(self) -> PoolEvidence:
        """The evidence, with the private-pool conflicts the release and allocation times imply."""
        private = self.evidence.private_conflicts
        for gone, when in self.released_at.items():
            for other, last in self.active_at.items():
                if gone is not None and other is not None and other != gone and last > when:
                    private.setdefault(gone, set()).add(other)
                    private.setdefault(other, set()).add(gone)
        return self.evidence

    def _conflict(self, mine: Any, theirs: Any) -> None:
        conflicts = self.evidence.conflicts
        conflicts.setdefault(mine, set()).add(theirs)
        conflicts.setdefault(theirs, set()).add(mine)

    def _own(self, identity: SegmentId, pluggable: bool = False) -> PoolLabel:
        label = PoolLabel("own", identity)
        self.identity[self.pool(label, pluggable).id] = identity
        return label

    # --------------------------------------------------------------- pools

    def choose(self, choice: Choice, known: tuple | None, nbytes: int, stream: int, pluggable: bool | None,
               expandable: bool) -> PoolLabel:
        identity = choice.segment if choice.kind == "segment" else None
        if identity is None:
            return DEFAULT_LABEL
        return self._own(identity, bool(pluggable))

    def pre_segment_pool(self, life: SegmentLife) -> tuple[int, int]:
        return self.pools[self._own(life.identity, life.pluggable)].id

    def reservation_pools(self, groups: list[Reservation]) -> list[tuple[int, int]]:
        pools = []
        for group in groups:
            life = group.life(self.trace.geometry)
            pools.append(self.pools[self._own(life.identity)].id)
            if group.pool is not None:  # what the snapshot says of it, as for any named segment
                self.evidence.known[life.identity] = group.pool
        return pools

    def routed_privately(self, entry: dict, start: int) -> bool:
        return False  # every segment is in a private pool of its own: the routing says nothing

    def collected(self, run: list[dict]) -> bool:
        # no default pool to age blocks in: a run garbage collection could make proves nothing
        sim = self.sim
        threshold = int(self.config.garbage_collection_threshold * float(sim.allowed_memory_maximum))
        return sim.total_allocated_memory > threshold and all(
            e["action"] == "segment_free" and e["size"] > SMALL_BUFFER for e in run)

    # --------------------------------------------------------------- allocations

    def before_route(self, m: Malloc, released: list[dict], completed: list[dict]) -> Any:
        """Release exactly what the trace released inside the malloc; with max_split_size set, a
        malloc over the cap first releases oversize blocks of its own pool (one pool)."""
        oversize = []
        for e in released:
            segment = self.segment_at(e["addr"])
            if segment is not None and segment.pool.owner is not None:
                mine = self.identity.get(segment.pool.owner.id)
                if self.sim.max_split == SIZE_MAX:  # else it may be an oversize release of a pool in use
                    self.released_at.setdefault(mine, m.start)
                elif (e["action"] == "segment_free" and e["size"] >= self.sim.max_split
                      and e["stream"] == m.stream and not segment.expandable):
                    oversize.append(mine)
                queries.release_pool_memory(self.sim, segment.pool.owner.id)
        if oversize and len(oversize) == len(released) and m.new_segment is not None:
            self.evidence.one_pool_any.append({SegmentId(m.start), *oversize})
        queries.drain_trace(self.sim)
        return STOP if m.oom else None

    def after_route(self, label: PoolLabel, m: Malloc) -> None:
        """Segments that had a better block for this allocation cannot share its pool."""
        pool = self.pools[label]
        mine = self.identity.get(pool.id)
        if mine is None:
            return
        new = m.new_segment is not None or bool(m.maps)
        chosen = None if new else queries.cached_block_for(self.sim, m.nbytes, m.stream, pool.id)
        small = round_size(m.nbytes, self.sim.divisions) <= SMALL_SIZE
        for other in self._pools_on(m.stream, small):
            if other == pool.id:
                continue
            best = queries.cached_block_for(self.sim, m.nbytes, m.stream, other)
            if best is not None and (chosen is None or best.key < chosen.key):
                theirs = self.identity.get(other)
                if theirs is not None:
                    self._conflict(mine, theirs)

    def _pools_on(self, stream: int, small: bool) -> list:
        """Ids of the pools with segments on this stream and of this kind (one per segment)."""
        stamp = (self.sim.stats.num_device_alloc, self.sim.stats.num_device_free, queries.segment_count(self.sim))
        if stamp != self._groups_stamp:
            groups: dict[tuple, list] = {}
            for segment in self.sim.segments():
                owner = segment.pool.owner
                if owner is not None:
                    groups.setdefault((segment.stream, segment.pool.is_small), []).append(owner.id)
            self._groups, self._groups_stamp = groups, stamp
        return self._groups.get((stream, small), [])

    def on_landed(self, m: Malloc, block: Any) -> None:
        """Where it landed; a new reservation conflicts with the live ones of its stream and kind."""
        if block.pool.owner is None:
            return
        mine = self.identity.get(block.pool.owner.id)
        self.active_at[mine] = m.index
        self.evidence.landings.append((m.index, mine))
        if block.pool.owner.allocator is not None:
            self.evidence.pluggable.add(mine)
        if m.maps and block.segment not in self.reservations:  # a new reservation: one per pool, stream, kind
            for other in self.reservations:
                if other.stream == block.segment.stream and other.pool.is_small == block.segment.pool.is_small \
                        and queries.holds_segment(self.sim, other):
                    self._conflict(mine, self.identity.get(other.pool.owner.id))
            self.reservations.append(block.segment)

    # --------------------------------------------------------------- empty_cache

    def empty_cache(self, i: int, run: list[dict]) -> None:
        """Release exactly what the trace released; note what was kept and what went together."""
        released = {self.segment_at(e["addr"]) for e in run} - {None}
        gone = {self.identity.get(s.pool.owner.id) for s in released if s.pool.owner is not None}
        kept = {self.identity.get(s.pool.owner.id) for s in self.sim.segments()
                if s not in released and s.pool.owner is not None and releasable(s)}
        for mine in gone - {None}:  # a pool emptied gives back all its releasable memory
            self.released_at.setdefault(mine, i)
            for theirs in kept - {None}:
                self._conflict(mine, theirs)
        # empty_cache() empties the default pool and completes every pending free first; a release
        # that keeps releasable default memory, or leaves frees pending, emptied one private pool
        default_kept = any(self.evidence.known.get(theirs) == DEFAULT_LABEL.key for theirs in kept)
        pending_kept = any(block.segment not in released for block in self.pending_blocks())
        if (default_kept or pending_kept) and gone - {None}:
            self.evidence.one_pool.append(gone - {None})
        for segment in released:
            if segment.pool.owner is not None:
                queries.release_pool_memory(self.sim, segment.pool.owner.id)
        self.settle(queries.drain_trace(self.sim), [], "")
