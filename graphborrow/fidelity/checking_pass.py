"""The checking pass: the trace replayed with inferred pools, every check made and counted.

Pools the snapshot names are followed; every other segment goes to the pool
:func:`~graphborrow.fidelity.pool_inference.infer_pools` gave it, if that pool had no cached block for
the request (else the real allocator would have used it), or else to the first consistent
one: the pool of the previous allocation, the default pool, a recent private pool, or a new
one. A choice that later evidence contradicts (the model picks a block of that segment where
the real one did not, or an ``empty_cache`` releases it where the real one did not) is
refuted: the pass raises :class:`Refuted`, and the trace is replayed again without it.

Releases a malloc did not make are an ``empty_cache``, of one pool when they release only
that pool's segments while others were releasable (a MemPool going away).
"""

from __future__ import annotations

from typing import Any

from graphborrow.allocator import replay_support as queries
from graphborrow.allocator.blocks import DEFAULT_POOL
from graphborrow.allocator.errors import AllocatorOutOfMemoryError, PoolReleasedError
from graphborrow.core.sizes import MIN_BLOCK_SIZE, SMALL_SIZE, allocation_size, round_size

from .passes import DIVERGED, GUESSED, NOT_REBUILT, Malloc, Outcome, ReplayPass, TraceInput, fmt_calls
from .lifetimes import Reservation, SegmentId, SegmentLife
from .pool_inference import DEFAULT_LABEL, Choice, Decision, PoolLabel

__all__ = ["CheckingPass", "Learned", "Refuted"]

NEW_POOL = PoolLabel("new", None)  # the likeliest pool of a failed allocation is one not made yet


class Refuted(Exception):  # noqa: N818 (a signal, not an error)
    """A pool choice contradicted by the trace: replay again without it."""

    def __init__(self, decision: Decision, reason: str) -> None:
        super().__init__(reason)
        self.decision, self.reason = decision, reason


class Learned(Exception):  # noqa: N818 (a signal, not an error)
    """The trace showed the size of a block from before it: rebuild the start with it and replay again.

    An allocation the model placed elsewhere than the trace, in a segment whose blocks from before
    the trace are guesses, at an address right after such a block, where a free block began: that
    block ended there. Sizes from a free (its request) are exact when the allocator split the free
    block it came from; when it handed the block out whole, it is larger by less than the split
    threshold, and the next allocation in the space after it shows by how much.
    """

    def __init__(self, address: int, size: int, exact: bool = True) -> None:
        super().__init__(f"the block at {address:#x} from before the trace is {'' if exact else 'at least '}{size} B")
        self.address, self.size, self.exact = address, size, exact


class CheckingPass(ReplayPass):
    """Replays a trace with the pools inferred for it and makes the reported checks.

    Args:
        trace: the trace and how it was recorded.
        assignment: segment -> pool label, from :func:`~graphborrow.fidelity.pool_inference.infer_pools`.
        evidence: the layout pass's :class:`~graphborrow.fidelity.pool_inference.PoolEvidence`.
        refuted: decisions refuted by earlier replays (not made again).
        blaming: raise :class:`Refuted` on a contradiction (False in the last replay, when the
            patience for refutations has run out).
        learning: raise :class:`Learned` when the trace shows the size of a guessed block.
    """

    def __init__(self, trace: TraceInput, assignment: dict, evidence, refuted: set[Decision],
                 blaming: bool = True, learning: bool = True) -> None:
        super().__init__(trace)
        self.assignment = assignment
        self.conflicts = evidence.conflicts
        self.private_conflicts = evidence.private_conflicts
        self.released_alone = evidence.released_alone()
        self.refuted = refuted
        self.blaming = blaming
        self.learning = learning
        self.choice_keys: dict[int, Decision] = {}  # sim segment address -> the decision of its pool
        self.release_cause: dict[PoolLabel, Decision | None] = {}  # pool -> decision of the segment whose release released it
        self._pending: Decision | None = None  # the decision the current malloc rests on
        self._oom_hint: Any = None  # the likeliest pool of the failed allocation being replayed
        self.members: dict[PoolLabel, set] = {DEFAULT_LABEL: set()}  # pool -> identities of its segments
        for life in self.plan.all_lives():
            if life.pool is not None:
                self.members.setdefault(PoolLabel.of(life.pool), set()).add(life.identity)

    # --------------------------------------------------------------- choosing pools

    def choose(self, choice: Choice, known: tuple | None, nbytes: int, stream: int, pluggable: bool | None,
               expandable: bool) -> PoolLabel:
        """The pool label for a new segment (or an allocation that failed): known, or the first consistent one.

        Consistent: the pool had no cached block for the request on that stream (and, for a new
        expandable reservation, no reservation of that kind on that stream).
        """
        identity = choice.segment if choice.kind == "segment" else None
        if pluggable is None:  # an allocation failed: with no cap, and device memory to spare, a pluggable allocator's
            pluggable = self.sim.allowed_memory_maximum is None and self._had_room(choice, nbytes)
        if known is not None:
            label = PoolLabel.of(known)
            self.pool(label, pluggable)
            return label
        planned = self.assignment.get(identity) if identity is not None else None
        if planned is not None and Decision(choice, planned) not in self.refuted:
            pool = self.pool(planned, pluggable) if planned not in self.pools else self.pools[planned]
            if not pool.released and (pool.id == DEFAULT_POOL or pool.id in self.sim.graph_pools) \
                    and queries.cached_block_for(self.sim, nbytes, stream, pool.id) is None:
                return self._take(choice, planned, identity)
        for label in self._ranked(choice):
            if self._consistent(choice, label, identity, nbytes, stream, pluggable, expandable):
                return self._take(choice, label, identity)
        label = PoolLabel("inferred", SegmentId(choice.at))
        self.pool(label, bool(pluggable))
        self._take(choice, label, identity)
        if Decision(choice, label) in self.refuted:
            self._pending = None  # a pool of its own was refuted too: the evidence blames another choice
        return label

    def _ranked(self, choice: Choice) -> list[PoolLabel]:
        """The pools to try, likeliest first: the previous allocation's, the default, recent private ones."""
        ranked = [self.last_label, DEFAULT_LABEL]
        if choice.kind == "oom" and self._oom_hint is not None:
            ranked.insert(0, self._oom_hint)
        ranked += sorted((label for label in self.pools if label not in ranked),
                         key=lambda label: -self.pools[label].last_used)
        if choice.kind == "oom" and self._oom_hint not in (None, DEFAULT_LABEL):
            ranked = [label for label in ranked if label != DEFAULT_LABEL]  # it left frees pending: not the default
        return ranked

    def _consistent(self, choice: Choice, label: PoolLabel, identity: SegmentId | None, nbytes: int, stream: int,
                    pluggable: bool | None, expandable: bool) -> bool:
        pool = self.pools.get(label)
        if pool is None or pool.released or Decision(choice, label) in self.refuted:
            return False
        if pluggable is not None and pool.pluggable != pluggable:
            return False
        if pool.id != DEFAULT_POOL and pool.id not in self.sim.graph_pools:
            return False
        if queries.cached_block_for(self.sim, nbytes, stream, pool.id) is not None:
            return False  # the real allocator would have used that block instead
        if expandable and self._has_reservation(pool.id, round_size(nbytes, self.sim.divisions), stream):
            return False  # it would have mapped pages of that reservation instead
        members = self.members.get(label, set())
        if identity is not None and self.conflicts.get(identity, set()) & members:
            return False  # somewhere one of them had memory the other's allocation or release rules out
        if identity is not None and pool.id != DEFAULT_POOL and self.private_conflicts.get(identity, set()) & members:
            return False  # a private pool whose memory went back takes no allocation afterwards
        return True

    def _had_room(self, choice: Choice, nbytes: int) -> bool:
        """Whether the device had room for a new segment for ``nbytes`` when the allocation of ``choice``
        failed (the ``device_free`` its oom entry recorded, cudaMemGetInfo's)."""
        size = allocation_size(round_size(nbytes, self.sim.divisions), self.sim.large_segment_size)
        failed = next(e for e in self.entries[choice.at:] if e.get("action") == "oom")
        return failed.get("device_free", 0) >= size

    def _take(self, choice: Choice, label: PoolLabel, identity: SegmentId | None) -> PoolLabel:
        self._decide(choice, label)
        if identity is not None:
            self.members.setdefault(label, set()).add(identity)
        return label

    def _decide(self, choice: Choice, label: PoolLabel) -> None:
        self.decisions[str(choice)] = str(self.pools[label].id)
        self._pending = Decision(choice, label)

    def _has_reservation(self, pool_id: tuple[int, int], size: int, stream: int) -> bool:
        if pool_id == DEFAULT_POOL:
            block_pool = self.sim.small_blocks if size <= SMALL_SIZE else self.sim.large_blocks
        else:
            private = self.sim.graph_pools[pool_id]
            block_pool = private.small_blocks if size <= SMALL_SIZE else private.large_blocks
        return bool(block_pool.unmapped.get(stream))

    def _oom_prior(self, released: list, completed: list, stream: int) -> Any:
        """The likeliest pool of an allocation that failed, from what its failure did.

        Outside captures and MemPools the out-of-memory path first completes every pending free
        and releases what an empty_cache would; routed to a private pool it does neither.
        """
        collected = {(block.ptr, block.size) for block in queries.garbage_collection_victims(self.sim)}
        emptied = bool(completed) or any(not (e["action"] == "segment_free" and e["size"] >= self.sim.max_split
                                               and e["stream"] == stream) and (e["addr"], e["size"]) not in collected
                                         for e in released)
        if emptied:
            return DEFAULT_LABEL
        if self.pending_blocks():
            if self.last_label != DEFAULT_LABEL:
                return self.last_label
            private = [label for label, pool in self.pools.items() if label != DEFAULT_LABEL and not pool.released]
            return max(private, key=lambda label: self.pools[label].last_used) if private else NEW_POOL
        return None

    def pre_segment_pool(self, life: SegmentLife) -> tuple[int, int]:
        if life.pool is not None:
            return self.pool(PoolLabel.of(life.pool), life.pluggable).id
        if life.pluggable:  # a pluggable pool's memory the snapshot does not name: a pool of its own
            return self.pool(PoolLabel("pre-trace", life.identity), pluggable=True).id
        return self._pre_pool(life)

    def reservation_pools(self, groups: list[Reservation]) -> list[tuple[int, int]]:
        named = {(group.stream, group.small, group.pool) for group in groups if group.pool is not None}
        used = {(stream, small, self.pool(PoolLabel.of(pool)).id) for stream, small, pool in named}
        pools = []
        for group in groups:
            if group.pool is None:
                life = group.life(self.trace.geometry)
                taken = {p for s, k, p in used if (s, k) == (group.stream, group.small)}
                pool_id = self._pre_pool(life, taken)
            else:
                pool_id = self.pool(PoolLabel.of(group.pool)).id
            used.add((group.stream, group.small, pool_id))
            pools.append(pool_id)
        return pools

    def _pre_pool(self, life: SegmentLife, taken: set | None = None) -> tuple[int, int]:
        """A segment from before the trace that the snapshot does not name: the default pool, else
        the pool inferred for it (from the allocations in it and the releases it took part in),
        else a pool of its own, skipping refuted choices. A segment one private pool's emptyCache
        gave back takes the inferred pool first."""
        choice = Choice("pre-trace segment", life.address, life.size, life.end)
        order = (DEFAULT_LABEL, self.assignment.get(life.identity))
        if life.identity in self.released_alone:
            order = order[::-1]
        taken = taken or set()
        label = next((c for c in order if c is not None and Decision(choice, c) not in self.refuted
                      and (c not in self.pools or self.pools[c].id not in taken)
                      and not (c.names_a_pool and c.key in taken)), PoolLabel("pre-trace", life.identity))
        pool = self.pool(label)
        self._decide(choice, label)
        self.choice_keys[life.address] = Decision(choice, label)
        self._pending = None
        return pool.id

    def routed_privately(self, entry: dict, start: int) -> bool:
        life = self.plan.lives.get(start)
        if life is not None and life.pool is not None:
            private = life.pool != DEFAULT_POOL
        else:
            private = self.assignment.get(SegmentId(start), DEFAULT_LABEL) != DEFAULT_LABEL
        if entry["action"] == "oom" and \
                queries.cached_block_for(self.sim, entry["size"], entry.get("stream", 0), DEFAULT_POOL) is not None:
            private = True  # the default pool had a block for it: the request that failed was routed elsewhere
        return private

    def collected(self, run: list[dict]) -> bool:
        victims = {(block.ptr, block.size) for block in queries.garbage_collection_victims(self.sim)}
        return bool(victims) and victims == {(e["addr"], e["size"]) for e in run if e["action"] == "segment_free"}

    # --------------------------------------------------------------- allocations

    def before_route(self, m: Malloc, released: list[dict], completed: list[dict]) -> Any:
        """Pools whose memory went back inside this malloc were released before it (unless it was an
        oversize release of the pool in use). Returns what the blame needs: the released segments'
        pools and decisions, and the segments of the pools the releases marked released."""
        going_with: dict[int, tuple] = {}  # released segment -> (pool label, decision) before this malloc
        emptied: Any = set()
        for e in released:
            oversize = e["action"] == "segment_free" and e["size"] >= self.sim.max_split and e["stream"] == m.stream
            segment = self.segment_at(e["addr"])
            if segment is not None and segment.address in self.choice_keys:
                going_with[segment.address] = (self.label_of(segment), self.choice_keys[segment.address])
            if not oversize:
                if segment is not None and segment.pool.owner is not None:
                    emptied.add(self.label_of(segment))
                self._mark_released(segment)
        if emptied:  # the segments of the pools marked released, to name the pool of memory released with them
            emptied = {s.address: self.label_of(s) for s in self.sim.segments()
                       if s.pool.owner is not None and self.label_of(s) in emptied}
        if m.oom:
            self._oom_hint = self._oom_prior(released, completed, m.stream)
        return going_with, emptied

    def on_oom(self, m: Malloc, outcome: Outcome, context: Any, ok: bool) -> None:
        if not outcome.calls_ok and not outcome.uncertain:
            self._blame_calls(outcome, *context)
        if not ok and not outcome.uncertain:
            self._refute_pending(f"{outcome.where}: the simulator did not fail the same way")
        self._pending = None

    def on_failure(self, m: Malloc, outcome: Outcome, label: PoolLabel) -> None:
        failure = outcome.failure
        cause = self.release_cause.get(label)
        released = isinstance(failure, PoolReleasedError)
        if released and cause is not None and cause.choice.kind == "pre-trace segment":
            # the pool took memory from before the trace that was released: that memory was another pool's
            self._refute(cause, f"{outcome.where}: {failure}")
        if released or isinstance(failure, AllocatorOutOfMemoryError):
            self._refute_pending(f"{outcome.where}: {failure}")
        self._pending = None

    def on_landing(self, m: Malloc, outcome: Outcome, context: Any) -> None:
        block, addr = outcome.block, m.entry["addr"]
        if block.ptr != addr and outcome.short is not None and self.learning:
            self._learn(outcome.short, addr)
        if block.ptr != addr and outcome.after_guess and outcome.uncertain == GUESSED:
            if block.segment.address in self.choice_keys:  # the guessed block's segment may be in another pool
                self._refute(self.choice_keys[block.segment.address], f"{outcome.where}: took the space after a "
                                                                      f"guessed block of the segment at {block.segment.address:#x}")
            if self.learning:
                self._widen(block.prev, block, round_size(m.nbytes, self.sim.divisions))
        if block.ptr != addr and not outcome.uncertain:
            self._blame(block.ptr, addr, outcome.where)
        if not outcome.calls_ok and not outcome.uncertain:
            self._blame_calls(outcome, *context)

    def on_landed(self, m: Malloc, block: Any) -> None:
        if m.new_segment is not None and block.segment.address == m.new_segment["addr"]:
            # a new segment: the choice of a segment released from this address before no longer applies
            self.choice_keys.pop(block.segment.address, None)
        if self._pending is not None and (m.new_segment is not None or m.maps):
            self.choice_keys.setdefault(block.segment.address, self._pending)
        self._pending = None

    def _learn(self, guessed: Any, address: int) -> None:
        """The trace put a block at ``address``, in the free space after the ``guessed`` block from before
        it: the guessed block ends there, when the allocator's rules allow a block of that size."""
        size = address - guessed.ptr
        slack = size - round_size(max(guessed.requested_size, 1), self.sim.divisions)
        if 0 < slack <= SMALL_SIZE or self.sim.max_split <= size:  # handed out whole, unsplit
            raise Learned(guessed.ptr, size)

    def _widen(self, guessed: Any, placed: Any, size: int) -> None:
        """The model placed a block of ``size`` in the free space after the ``guessed`` block, the trace
        elsewhere: the guessed block is larger, so much that the space after it was too small. The least
        size that makes it so, within the rules (the slack of a block handed out whole is at most the
        split threshold; a free block of the large pool is larger than it), is a lower bound: the block
        stays a guess, and only placements after it are not checked."""
        end, following = guessed.ptr + guessed.size, placed
        while following is not None and (following is placed or following.key is not None):
            following = following.next
        room = (following.ptr if following is not None else placed.segment.address + placed.segment.size) - end
        widened = guessed.size + room - size + MIN_BLOCK_SIZE
        if size - MIN_BLOCK_SIZE <= SMALL_SIZE:
            widened = guessed.size + room  # a free block that small cannot be: it took all of the space
        slack = widened - round_size(max(guessed.requested_size, 1), self.sim.divisions)
        if guessed.size < widened and slack <= SMALL_SIZE and not guessed.pool.is_small:
            raise Learned(guessed.ptr, widened, exact=False)

    # --------------------------------------------------------------- blame

    def _refute(self, decision: Decision, reason: str) -> None:
        if self.blaming:
            raise Refuted(decision, reason)

    def _refute_pending(self, reason: str) -> None:
        if self._pending is not None:
            self._refute(self._pending, reason)

    def _blame(self, taken: int, expected: int, where: str) -> None:
        """The simulator took a block the real allocator did not: a pool choice may be wrong.

        The segment of the block taken is in the routed pool only because of a choice, or the
        expected segment is; the later of those choices is refuted.
        """
        mine, theirs = self.segment_at(taken), self.segment_at(expected)
        if mine is None or mine is theirs:
            return
        keys = [self.choice_keys[s.address] for s in (mine, theirs) if s is not None and s.address in self.choice_keys]
        if keys:
            self._refute(_latest(keys), f"{where}: took a block of the segment at {mine.address:#x}")

    def _blame_calls(self, outcome: Outcome, going_with: dict | None = None, emptied: dict | None = None) -> None:
        """An allocation released (or kept) other memory than the real one did (garbage collection,
        the out-of-memory retry): the pool of that memory may be wrong (only the default pool is
        collected, only freeable pools are emptied); else the choice this allocation rests on.

        Memory released that the real allocator kept, in a private pool that also held memory the
        real one did release: one of those segments is in that pool by a wrong choice, the later one.
        Such memory in a pool the snapshot names: the choice that put a released segment in that
        pool (which made the pool look released) is the suspect.
        """
        got, expected = outcome.got, outcome.expected
        keys = []
        for call in set(got) ^ set(expected):
            action, addr, _ = call
            if action not in ("segment_free", "segment_unmap"):
                continue
            segment = self.segment_at(addr)
            base = segment.address if segment is not None else addr
            if base in self.choice_keys:
                keys.append(self.choice_keys[base])
                label = self.choice_keys[base].label
                if call in got and going_with and label != DEFAULT_LABEL:
                    keys += [decision for other, decision in going_with.values() if other == label]
                if call in got and label != DEFAULT_LABEL and self.release_cause.get(label) is not None:
                    keys.append(self.release_cause[label])  # the segment whose release said the pool was released
            elif call in got and emptied and self.release_cause.get(emptied.get(base)) is not None:
                keys.append(self.release_cause[emptied[base]])
            elif call in got and self.release_cause.get(self._known_pool(addr)) is not None:
                keys.append(self.release_cause[self._known_pool(addr)])  # a named pool another choice released
        reason = f"{outcome.where}: expected device calls {fmt_calls(expected)}, simulated {fmt_calls(got)}"
        if keys:
            self._refute(_latest(keys), reason)
        self._refute_pending(reason)

    def _known_pool(self, address: int) -> PoolLabel | None:
        """The pool the snapshot names for the traced segment at ``address`` alive now, if any."""
        for life in self.plan.all_lives():
            if life.address == address and life.pool is not None and not life.expandable:
                return PoolLabel.of(life.pool)
        return None

    # --------------------------------------------------------------- empty_cache

    def _mark_released(self, segment) -> None:
        """The pool of ``segment`` gave its memory back, so it had been released (graphs reset, MemPool deleted)."""
        if segment is None or segment.pool.owner is None:
            return
        owner = segment.pool.owner
        label = self.label_of(segment)
        if owner.use_count > 0:
            self.release_cause[label] = self.choice_keys.get(segment.address)
        while owner.use_count > 0:
            self.sim.release_pool(owner.id)
        if label in self.pools:
            self.pools[label].released = True

    def empty_cache(self, i: int, run: list[dict]) -> None:
        """Replay the releases as ``empty_cache()``, or as one MemPool's ``emptyCache(id)``, and compare."""
        expected = sorted((e["action"], e["addr"], e["size"]) for e in run)
        where = f"events {i}..{i + len(run) - 1} empty_cache"
        segments = [self.segment_at(e["addr"]) for e in run]
        uncertain = next((reason for reason in map(self.doubt, segments) if reason), None) or (
            NOT_REBUILT if self.plan.mid_run and None in segments else None)
        owners = {s.pool.owner.id for s in segments if s is not None and s.pool.owner is not None}
        default = any(s is not None and s.pool.owner is None for s in segments)
        before = {s.address: (self.label_of(s), s) for s in self.sim.segments()}
        diverged = [s for _, s in before.values() if s in self.diverged]
        for segment in segments:
            self._mark_released(segment)
        only = None
        # empty_cache() completes every pending free first; a release that leaves some pending was one pool's
        pending_elsewhere = any(block.pool.owner is None or block.pool.owner.id not in owners
                                for block in self.pending_blocks())
        if len(owners) == 1 and not default and (pending_elsewhere or self._more_releasable(next(iter(owners)))):
            only = next(iter(owners))  # a MemPool going away: emptyCache(its id)
        elif pending_elsewhere and not uncertain:
            keys = [self.choice_keys[s.address] for s in segments if s is not None and s.address in self.choice_keys]
            if keys:  # the segments of one private pool went back, so the pool choices are wrong somewhere
                self._refute(_latest(keys), f"{where}: released without completing pending frees: one pool's memory")
        self.sim.empty_cache(only)
        emitted = queries.drain_trace(self.sim)
        self._blame_synchronised(emitted, segments, uncertain, where)
        self.settle(emitted, [], where)
        got = sorted((e["action"], e["addr"], e["size"]) for e in emitted if e["action"] in ("segment_free", "segment_unmap"))
        differ = {addr for _, addr, _ in set(got) ^ set(expected)}
        uncertain = uncertain or (DIVERGED if any(s.address <= a < s.address + s.size for s in diverged for a in differ)
                                  else None)
        if got != expected and uncertain:  # memory one side kept and the other gave back: not comparable from here on
            self.diverge(sorted(differ))
        if got != expected and not uncertain:
            self._blame_release([g for g in got if g not in expected], segments, before, where)
        self.check(got == expected, f"{where}: expected to release {fmt_calls(expected)}, simulated {fmt_calls(got)}",
                   uncertain)

    def _blame_synchronised(self, emitted: list, segments: list, uncertain: str | None, where: str) -> None:
        """It completed frees the real one left pending: another pool's, or no empty_cache at all."""
        synced = [e["addr"] for e in emitted if e["action"] == "free_completed"]
        if not synced or uncertain:
            return
        keys = [self.choice_keys[s.address] for s in segments if s is not None and s.address in self.choice_keys]
        for addr in synced:
            segment = self.segment_at(addr)
            if segment is not None and segment.address in self.choice_keys:
                keys.append(self.choice_keys[segment.address])
        if keys:
            self._refute(_latest(keys), f"{where}: completed pending frees the trace kept pending")

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
            if label != DEFAULT_LABEL:
                keys += [self.choice_keys[s.address] for s in released
                         if s is not None and s.address in self.choice_keys and before.get(s.address, (None,))[0] == label]
                if self.release_cause.get(label) is not None:  # the segment whose release said the pool was released
                    keys.append(self.release_cause[label])
            if keys:
                self._refute(_latest(keys), f"{where}: released {size} B at {addr:#x} that the trace kept")

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


def _latest(decisions: list[Decision]) -> Decision:
    """The decision made last (the likelier to be wrong when two rest on each other)."""
    return max(decisions, key=lambda decision: decision.choice.made_at)
