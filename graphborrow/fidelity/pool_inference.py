"""Pools the trace does not name: labels, the choices that put segments in them, and their inference.

A trace entry says which memory a segment got, never which pool it went to. A segment alive
at the end has its pool in the snapshot; for every other one the replay decides. The layout
pass (:class:`~graphborrow.fidelity.layout_pass.LayoutPass`) replays every segment in a pool
of its own and records the evidence (:class:`PoolEvidence`): which segments could not have
shared a pool, which were released together, where allocations landed. :func:`infer_pools`
turns that into a pool for each segment; the checking pass follows it and refutes the choices
later entries contradict (:class:`Decision`), after which inference runs again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from graphborrow.allocator.blocks import DEFAULT_POOL

from .lifetimes import SegmentId

__all__ = ["DEFAULT_LABEL", "Choice", "Decision", "PoolEvidence", "PoolLabel", "ReplayPool", "infer_pools"]


@dataclass(frozen=True)
class PoolLabel:
    """A pool of the replay: ``pool`` (an id the snapshot names, or the default pool), ``own`` (the
    layout pass's pool of one segment), ``inferred`` (a pool the trace implies), ``pre-trace`` (the
    pool of one segment from before the trace)."""

    kind: str
    key: Any  # the pool id, or the SegmentId of the segment the pool was made for

    @classmethod
    def of(cls, pool_id: tuple[int, int]) -> PoolLabel:
        return cls("pool", tuple(pool_id))

    @property
    def names_a_pool(self) -> bool:
        """Whether the label is a pool id torch handed out (the default pool, or one the snapshot names)."""
        return self.kind == "pool"

    def __str__(self) -> str:  # also the order of ties between labels (see infer_pools)
        if self.kind == "pool":
            return str(self.key)
        return f"{self.kind}@{self.key}"


DEFAULT_LABEL = PoolLabel.of(DEFAULT_POOL)


class ReplayPool:
    """A pool of the replay: the default pool, one the snapshot names, or one inferred."""

    __slots__ = ("id", "known", "pluggable", "released", "last_used")

    def __init__(self, pool_id: tuple[int, int], known: bool, pluggable: bool) -> None:
        self.id, self.known, self.pluggable = pool_id, known, pluggable
        self.released = False
        self.last_used = -1


@dataclass(frozen=True)
class Choice:
    """A decision the trace does not make: the pool of a new ``segment`` (by its creating entry), of
    an ``oom`` (a failed allocation, by its first entry), or of a ``pre-trace segment`` (by address)."""

    kind: str
    at: int
    size: int = 0  # (a pre-trace segment) its size, and the entry that released it
    end: int | None = None

    @property
    def segment(self) -> SegmentId | None:
        """The segment whose pool this is (None for an allocation that failed)."""
        if self.kind == "segment":
            return SegmentId(self.at)
        if self.kind == "pre-trace segment":
            return SegmentId(-1, self.at, self.size, self.end)
        return None

    @property
    def made_at(self) -> int:
        """When it was made: its entry, or before the first one for segments from before the trace."""
        return -1 if self.kind == "pre-trace segment" else self.at

    def __str__(self) -> str:
        if self.kind == "pre-trace segment":
            return f"{self.kind} {self.size} B at {self.at:#x}"
        return f"{self.kind} at event {self.at}"


@dataclass(frozen=True)
class Decision:
    """A choice and the pool it took."""

    choice: Choice
    label: PoolLabel


@dataclass
class PoolEvidence:
    """What the layout pass saw, segment by segment (each in a pool of its own)."""

    known: dict[SegmentId, tuple[int, int]] = field(default_factory=dict)  # pools the snapshot names
    landings: list[tuple[int, SegmentId]] = field(default_factory=list)  # (alloc entry, segment it landed in)
    conflicts: dict[SegmentId, set] = field(default_factory=dict)  # segments that may not share any pool
    private_conflicts: dict[SegmentId, set] = field(default_factory=dict)  # ... nor a private one
    one_pool: list[set] = field(default_factory=list)  # released together by one private pool's emptyCache
    one_pool_any: list[set] = field(default_factory=list)  # released together: one pool, default or not
    pluggable: set = field(default_factory=set)  # pluggable pools' segments

    def released_alone(self) -> set:
        """Segments that one private pool's emptyCache gave back."""
        return {identity for group in self.one_pool for identity in group if identity is not None}


class _Groups:
    """Union-find over segment identities: segments that must share a pool."""

    def __init__(self) -> None:
        self.parent: dict[Any, Any] = {}

    def root(self, x: Any) -> Any:
        while self.parent.get(x, x) != x:
            x = self.parent[x]
        return x

    def join(self, groups: list[set], known: dict) -> None:
        for group in groups:
            members = [m for m in group if m is not None]
            for other in members[1:]:
                a, b = self.root(members[0]), self.root(other)
                if a != b and not (a in known and b in known and known[a] != known[b]):
                    if b in known:
                        a, b = b, a
                    self.parent[b] = a


def infer_pools(evidence: PoolEvidence, refuted: set[Decision]) -> dict[SegmentId, PoolLabel]:
    """A pool for every segment the snapshot does not name, from when and where allocations happened.

    Routing comes in sessions (a capture, a ``use_mem_pool`` block): consecutive allocations
    share a pool. So each segment goes to the pool most of the allocations next to its own
    allocations went to, among the pools it may share: no conflict with their segments (a
    better block it would have been given, memory released while it was kept, an allocation
    after the pool's memory went back), no choice refuted by an earlier replay. Segments one
    release gave back together from a single private pool stay together and private. Start
    from "the pool of the allocation before it", then move segments to their neighbours'
    majority until nothing moves.

    Args:
        evidence: what the layout pass recorded.
        refuted: decisions earlier replays refuted.

    Returns:
        Segment -> label (of a pool the snapshot names, or an inferred one).
    """
    known = {identity: PoolLabel.of(pool) for identity, pool in evidence.known.items()}
    groups = _Groups()
    groups.join([*evidence.one_pool, *evidence.one_pool_any], known)
    root = groups.root
    private_only = {root(m) for group in evidence.one_pool for m in group if m is not None}
    known_root: dict[Any, PoolLabel] = {}
    for identity, label in known.items():
        known_root.setdefault(root(identity), label)
    conflict_roots: dict[Any, set] = {}
    private_roots: dict[Any, set] = {}
    for table, into in ((evidence.conflicts, conflict_roots), (evidence.private_conflicts, private_roots)):
        for a, others in table.items():
            into.setdefault(root(a), set()).update(root(b) for b in others)
    refused = {(root(d.choice.segment), d.label) for d in refuted if d.choice.kind == "segment"}
    rooted = [(i, root(identity)) for i, identity in evidence.landings]
    first_seen, neighbours = _neighbours(rooted)
    state = _Assignment(known_root, {root(i) for i in evidence.pluggable}, private_only, conflict_roots,
                        private_roots, refused)
    unknown = sorted((r for r in first_seen if r not in known_root and r is not None), key=lambda r: first_seen[r])
    for r in unknown:  # the pool of the allocation before, else the default pool, else a new one
        k = first_seen[r]
        before = state.assignment.get(rooted[k - 1][1]) if k > 0 else None
        for label in (before, DEFAULT_LABEL):
            if label is not None and state.allowed(r, label):
                state.put(r, label)
                break
        else:
            state.put(r, PoolLabel("inferred", r))
    for r in sorted(private_only - set(state.assignment), key=str):  # released together, nothing allocated in them
        if r is not None and r not in known_root:
            state.put(r, PoolLabel("inferred", r))
    for _ in range(12):  # move each segment to its neighbours' majority while that changes anything
        if not state.move_to_majorities(unknown, neighbours):
            break
    result = {}
    identities = set(first_seen) | set(groups.parent) | {i for group in evidence.one_pool for i in group}
    for identity in identities:
        if identity is None or identity in known:
            continue
        label = state.assignment.get(root(identity))
        if label is not None:
            result[identity] = label
    return result


def _neighbours(rooted: list[tuple[int, Any]]) -> tuple[dict[Any, int], dict[Any, list]]:
    """For each segment: where it first appears among the landings, and the segments landed in just
    before and after each of its runs of landings."""
    first_seen: dict[Any, int] = {}
    neighbours: dict[Any, list] = {}
    for k, (_, mine) in enumerate(rooted):
        first_seen.setdefault(mine, k)
        for step in (-1, 1):
            j = k + step
            while 0 <= j < len(rooted) and rooted[j][1] == mine:
                j += step
            if 0 <= j < len(rooted):
                neighbours.setdefault(mine, []).append(rooted[j][1])
    return first_seen, neighbours


class _Assignment:
    """Segment roots -> labels, with the rules that say which label a root may take."""

    def __init__(self, known_root: dict, pluggable: set, private_only: set, conflicts: dict, private_conflicts: dict,
                 refused: set) -> None:
        self.assignment: dict[Any, PoolLabel] = dict(known_root)
        self.members: dict[PoolLabel, set] = {}
        for r, label in known_root.items():
            self.members.setdefault(label, set()).add(r)
        self.pluggable = pluggable
        self.pluggable_labels = {label for r, label in known_root.items() if r in pluggable}
        self.private_only, self.conflicts, self.private_conflicts = private_only, conflicts, private_conflicts
        self.refused = refused

    def allowed(self, r: Any, label: PoolLabel) -> bool:
        if (r, label) in self.refused or (r in self.pluggable) != (label in self.pluggable_labels):
            return False
        if label == DEFAULT_LABEL and r in self.private_only:
            return False
        others = self.members.get(label, set()) - {r}
        if self.conflicts.get(r, set()) & others:
            return False
        return label == DEFAULT_LABEL or not (self.private_conflicts.get(r, set()) & others)

    def put(self, r: Any, label: PoolLabel) -> None:
        old = self.assignment.get(r)
        if old is not None:
            self.members[old].discard(r)
        self.assignment[r] = label
        self.members.setdefault(label, set()).add(r)
        if r in self.pluggable:
            self.pluggable_labels.add(label)

    def move_to_majorities(self, unknown: list, neighbours: dict) -> bool:
        """One round: each segment to its neighbours' majority pool, where allowed. Whether any moved."""
        moved = False
        for r in unknown:
            votes: dict[PoolLabel, int] = {}
            for other in neighbours.get(r, ()):
                label = self.assignment.get(other)
                if label is not None:
                    votes[label] = votes.get(label, 0) + 1
            current = self.assignment[r]
            best, best_votes = current, votes.get(current, 0)
            for label, count in sorted(votes.items(), key=lambda kv: (-kv[1], kv[0] != DEFAULT_LABEL, str(kv[0]))):
                better = count > best_votes or (count == best_votes and label == DEFAULT_LABEL != current)
                if better and self.allowed(r, label):  # a tie goes to the default pool: sessions are short
                    best, best_votes = label, count
                    break
            if best != current:
                self.put(r, best)
                moved = True
        return moved
