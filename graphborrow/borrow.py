"""Borrowing the idle free runs of a CUDA-graph pool for step-local tensors.

A ``BorrowState`` belongs to one runtime (one device, one shared graph pool). Capture,
replay and borrowing share one owner slot, because a replay silently overwrites whatever
sits in the pool's free blocks and a capture re-carves them. Inside ``borrow()`` new
tensors come from a MemPool whose segments a bump arena carves out of the free runs;
nothing the borrow creates may outlive the scope.

    state = BorrowState(backend, pool_id=backend.graph_pool_handle())
    with state.capture_scope(), backend.graph(g, pool=state.pool_id):
        ...
    with state.borrow("EAGLE verify"):
        probs = torch.softmax(logits, -1)   # lives in the graph pool's idle runs
        ...                                  # every borrowed tensor dies here
    with state.replay_scope():
        g.replay()                          # raises if a borrowed tensor survived
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterable, Iterator, Optional, Sequence

import torch

from .arena import BumpArena, first_overlap
from .errors import BorrowLeakError, PoolBusyError, WrongStreamError
from .runs import find_free_runs
from .sizes import MB, allocation_size, is_small, round_size

CAPTURE_USER = "CUDA graph capture"
REPLAY_USER = "CUDA graph replay"


def precarve_bytes(run: int, reserve: int = 32 * MB, minimum: int = 64 * MB) -> int:
    """The seed segment a fresh borrow pool precarves in a run of ``run`` bytes (0: none):
    the run less ``reserve`` (room for small-pool segments), rounded down to 2 MiB, if at
    least ``minimum``."""
    seed = (run - reserve) // (2 * MB) * (2 * MB)
    return seed if seed >= minimum else 0


@dataclasses.dataclass(frozen=True)
class RetireReport:
    """What :meth:`BorrowState.retire` found: ``pending_before`` bytes of the borrow pool were
    still waiting for another stream when retirement began, ``pending_after`` after it
    synchronised and drained them; ``built`` is False when there was no pool to retire."""

    pending_before: int
    pending_after: int
    built: bool = True


@dataclasses.dataclass(eq=False)
class BorrowState:
    """Owner slot, free-run cache and borrow pool of one runtime.

    ``precarve`` fills each run of at least ``precarve_min`` bytes with one cached
    segment (less ``precarve_reserve``, left for 2 MiB small-pool segments), so a tensor
    as large as the run can land there without the allocator's 2 MiB segment rounding
    spreading it over several runs.
    """

    backend: Any
    pool_id: Optional[tuple] = None
    policy: str = "runs"
    best_fit: bool = True
    precarve: bool = True
    precarve_reserve: int = 32 * MB
    precarve_min: int = 64 * MB

    holder: Optional[str] = dataclasses.field(default=None, init=False)
    disabled_reason: Optional[str] = dataclasses.field(default=None, init=False)
    static_runs: Optional[list] = dataclasses.field(default=None, init=False)
    arena: Optional[BumpArena] = dataclasses.field(default=None, init=False)
    mem_pool: Any = dataclasses.field(default=None, init=False)
    stream: Any = dataclasses.field(default=None, init=False)
    check_pending: bool = dataclasses.field(default=False, init=False)
    _high_water: int = dataclasses.field(default=0, init=False, repr=False)
    builds: int = dataclasses.field(default=0, init=False)
    stream_key: Any = dataclasses.field(default=None, init=False, repr=False)
    _runs: Optional[list] = dataclasses.field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        # bound once: checked and entered on every borrow
        self._stream_key = self.backend.current_stream_key
        self._route = self.backend.route_to_pool

    # ------------------------------------------------------------------ switches
    @property
    def enabled(self) -> bool:
        if self.disabled_reason is not None:
            return False
        if self.static_runs is not None:
            return len(self.static_runs) > 0
        return self.pool_id is not None

    def disable(self, reason: str) -> None:
        """Turn borrowing off for good reason (e.g. graphs saved to external storage)."""
        if not reason or not str(reason).strip():
            raise ValueError("disable() needs a reason, e.g. disable('graph pool is externally managed')")
        self._require_idle("disable borrowing")
        self._retire()
        self.disabled_reason = str(reason)

    def enable(self) -> None:
        self.disabled_reason = None

    def set_static_runs(self, runs: Iterable[Sequence[int]]) -> None:
        """Borrow from fixed ``(address, nbytes)`` ranges instead of snapshot runs.

        For externally managed storage whose addresses never move. The largest
        ``BumpArena.MAX_EXTENTS`` are kept; an empty list disables borrowing.
        """
        runs = [(int(a), int(n)) for a, n in runs]
        for a, n in runs:
            if n <= 0 or a <= 0:
                raise ValueError(f"static run ({a:#x}, {n}) needs a positive address and size")
            if a % 512:
                raise ValueError(
                    f"static run at {a:#x} is not 512-byte aligned; round its start up to a "
                    "multiple of 512 (and shrink its size to match)"
                )
        overlap = first_overlap(runs)
        if overlap:
            (a0, n0), (a1, n1) = overlap
            raise ValueError(
                f"static runs [{a0:#x}, {a0 + n0:#x}) and [{a1:#x}, {a1 + n1:#x}) overlap; "
                "merge them into one run or pass disjoint ranges"
            )
        self._refuse_live_overlap(runs)
        self._require_idle("replace the static runs")
        self._retire()
        runs.sort(key=lambda r: (-r[1], r[0]))
        self.static_runs = runs[: BumpArena.MAX_EXTENTS]

    def _refuse_live_overlap(self, runs: list) -> None:
        """Static runs must not cover blocks the caching allocator still hands out."""
        if not runs:
            return
        for segment in self.backend.memory_snapshot():
            for block in segment["blocks"]:
                if block["state"] == "inactive":
                    continue
                b0, b1 = block["address"], block["address"] + block["size"]
                for a, n in runs:
                    if a < b1 and b0 < a + n:
                        raise ValueError(
                            f"static run [{a:#x}, {a + n:#x}) overlaps a live tensor's block "
                            f"[{b0:#x}, {b1:#x}) of the caching allocator; static runs are for "
                            "storage the allocator does not manage (e.g. backend.external_alloc)"
                        )

    def clear_static_runs(self) -> None:
        self._require_idle("clear the static runs")
        self._retire()
        self.static_runs = None

    @property
    def high_water(self) -> int:
        """Most arena bytes any borrow pool of this state has carved so far."""
        return max(self._high_water, self.arena.cursor_bytes if self.arena else 0)

    # ------------------------------------------------------------------ capacity
    def free_runs(self) -> list[tuple[int, int]]:
        """The runs a new borrow pool would use, largest first (cached until retirement)."""
        if not self.enabled:
            return []
        if self.static_runs is not None:
            return list(self.static_runs)
        if self._runs is None:
            segments = self.backend.memory_snapshot(self.pool_id)
            self._runs = find_free_runs(segments, self.policy)[: BumpArena.MAX_EXTENTS]
        return list(self._runs)

    def largest_run(self) -> int:
        runs = self.free_runs()
        return runs[0][1] if runs else 0

    def _precarve_bytes(self, run: int) -> int:
        if not self.precarve:
            return 0
        return precarve_bytes(run, self.precarve_reserve, self.precarve_min)

    def precarve_sizes(self, runs: Sequence[Sequence[int]]) -> list[int]:
        """The seed segments a fresh borrow pool over ``runs`` allocates (and frees), in order."""
        return [s for s in (self._precarve_bytes(n) for _, n in runs) if s]

    def can_fit(self, nbytes: int) -> bool:
        """Could one more tensor of ``nbytes`` be borrowed right now? (The single-tensor question:
        whether a whole step fits depends on its allocation sequence; ask
        :func:`graphborrow.capacity.plan_verify` or :func:`graphborrow.planner.plan`.)

        Applies the allocator's rounding: a request gets a 512-byte-rounded block, from a
        cached free block of the borrow pool (a precarved segment included), or in a new
        segment of 2 MiB, 20 MiB or a 2 MiB multiple that the arena must still have room
        for. Before the first borrow it answers for the pool that borrow would build.
        """
        if nbytes <= 0 or not self.enabled:
            return False
        size = round_size(nbytes)
        segment = allocation_size(size)
        if self.mem_pool is None:
            for _, run in self.free_runs():
                seed = self._precarve_bytes(run)
                if (seed and size <= seed) or segment <= run - seed:
                    return True
            return False
        kind = "small" if is_small(size) else "large"  # the two pools never lend to each other
        pool_segments = self.backend.memory_snapshot(self.backend.pool_id(self.mem_pool))
        if any(
            b["state"] == "inactive" and b["size"] >= size
            for s in pool_segments if s.get("segment_type", kind) == kind
            for b in s["blocks"]
        ):
            return True
        rooms = (n - cursor for (_, n), cursor in zip(self.arena.extents, self.arena.extent_cursors()))
        return any(room >= segment for room in rooms)

    # ------------------------------------------------------------------ scopes
    def _take_slot(self, user: str) -> None:
        if self.holder is not None:
            raise PoolBusyError(
                f"the graph pool is held by {self.holder!r}; cannot start {user!r}. "
                "Capture, replay and borrowing never overlap: leave the first scope "
                "(and let every borrowed tensor die) before entering the next."
            )
        self.holder = user

    @contextlib.contextmanager
    def _claim(self, user: str) -> Iterator[None]:
        self._take_slot(user)
        try:
            yield
        finally:
            self.holder = None

    def _require_idle(self, action: str) -> None:
        if self.holder is not None:
            raise PoolBusyError(
                f"cannot {action} while the graph pool is held by {self.holder!r}; "
                "leave that scope first"
            )

    @contextlib.contextmanager
    def capture_scope(self) -> Iterator[None]:
        """Wrap a graph capture into the shared pool: retires the borrow pool first."""
        if not self.enabled:
            yield
            return
        with self._claim(CAPTURE_USER):
            self._retire()
            try:
                yield
            finally:
                self._runs = None  # the capture re-carved the free space

    @contextlib.contextmanager
    def replay_scope(self) -> Iterator[None]:
        """Wrap a graph replay: refuses while any borrowed byte is still referenced."""
        if not self.enabled:
            yield
            return
        with self._claim(REPLAY_USER):
            if self.check_pending:
                self._raise_on_live_borrows("graph replay")
            yield

    def borrow(self, user: str = "borrow") -> "BorrowScope":
        """Route new tensors of this thread into the graph pool's free runs.

        A request no run can hold raises the backend's OutOfMemoryError; nothing falls
        back silently to fresh device memory.
        """
        return BorrowScope(self, user)

    # ------------------------------------------------------------------ pool life
    def _build(self) -> None:
        runs = self.free_runs()
        if self.arena is None:
            self.arena = BumpArena(best_fit=self.best_fit)
        self.arena.best_fit = self.best_fit
        self.arena.set_extents(runs)
        self.mem_pool = self.backend.arena_pool(self.arena)
        self.stream = self.backend.current_stream()
        self.stream_key = self._stream_key()
        self.builds += 1
        seeds = self.precarve_sizes(runs)
        if seeds:
            # hold every seed until all exist: a freed seed would otherwise serve the next
            with self.backend.use_mem_pool(self.mem_pool):
                held = [torch.empty(s, dtype=torch.uint8, device=self.backend.device) for s in seeds]
                held.clear()

    def live_borrowed_bytes(self) -> int:
        """Bytes of the borrow pool still allocated to live tensors."""
        if self.mem_pool is None:
            return 0
        segments = self.backend.memory_snapshot(self.backend.pool_id(self.mem_pool))
        return sum(
            b["size"] for s in segments for b in s["blocks"] if b["state"] == "active_allocated"
        )

    def _raise_on_live_borrows(self, event: str) -> None:
        live = self.live_borrowed_bytes()
        if live:
            raise BorrowLeakError(
                f"graph-pool borrow leak at {event}: {live} bytes borrowed from the graph pool "
                f"are still referenced, and {event} would overwrite them. Delete (or copy out "
                "of the scope) every tensor created inside the borrow before this point."
            )
        self.check_pending = False

    def retire(self) -> "RetireReport":
        """Drop the borrow pool: leak check, synchronise, drain deferred frees, release.

        Returns:
            A :class:`RetireReport`: the borrow pool's ``active_pending_free`` bytes before
            the synchronise and after the drain (always 0 after: that is the point).
        """
        self._require_idle("retire the borrow pool")
        return self._retire()

    def pending_free_bytes(self) -> int:
        """Bytes of the borrow pool still ``active_pending_free`` (freed in Python, waiting for
        another stream's event); 0 without a pool."""
        if self.mem_pool is None:
            return 0
        segments = self.backend.memory_snapshot(self.backend.pool_id(self.mem_pool))
        return sum(b["size"] for seg in segments for b in seg["blocks"] if b["state"] == "active_pending_free")

    def _retire(self) -> "RetireReport":
        self._runs = None
        if self.mem_pool is None:
            return RetireReport(0, 0, built=False)
        if self.check_pending:
            self._raise_on_live_borrows("borrow-pool retirement")
        # frees recorded on other streams wait for events; complete them, then one
        # allocation outside any pool lets the allocator process those events, so every
        # block is inactive before the pool and its segments go away
        before = self.pending_free_bytes()
        self.backend.synchronize()
        self.backend.touch()
        after = self.pending_free_bytes()
        if after:
            raise RuntimeError(f"{after} bytes of the borrow pool are still pending a cross-stream free "
                               "after synchronising; the device did not complete its events")
        self._high_water = self.high_water
        self.mem_pool = None
        self.stream = self.stream_key = None
        return RetireReport(before, after, built=True)

    # ------------------------------------------------------------------ reporting
    def stats(self) -> dict:
        runs = self.free_runs() if self.enabled else []
        return {
            "enabled": self.enabled,
            "disabled_reason": self.disabled_reason,
            "holder": self.holder,
            "runs": len(runs),
            "run_bytes": sum(n for _, n in runs),
            "largest_run": runs[0][1] if runs else 0,
            "pool_built": self.mem_pool is not None,
            "builds": self.builds,
            "cursor_bytes": self.arena.cursor_bytes if self.arena else 0,
            "freed_bytes": self.arena.freed_bytes if self.arena else 0,
            "high_water": self.high_water,
        }


class BorrowScope:
    """The context manager of ``BorrowState.borrow``; a class, not a generator, because
    it runs every decode step and its host cost is measured against use_mem_pool's."""

    __slots__ = ("state", "user", "_pool_ctx")

    def __init__(self, state: BorrowState, user: str):
        self.state, self.user, self._pool_ctx = state, user, None

    def __enter__(self) -> None:
        s = self.state
        if not s.enabled:
            return
        s._take_slot(self.user)
        try:
            if s.mem_pool is not None:
                if s._stream_key() != s.stream_key:
                    raise WrongStreamError(
                        f"{self.user!r} borrows on stream {s.backend.current_stream()} but the "
                        f"borrow pool was built on stream {s.stream}; borrow on that stream, or "
                        "call retire() first so the next borrow builds a pool on the new one"
                    )
                s.backend.touch()  # lets the allocator finish completed cross-stream frees
                if s.arena.freed_bytes:
                    # the caching layer released arena segments (empty_cache); a bump arena
                    # cannot hand those bytes out again, so start over from fresh runs
                    s._retire()
            if s.mem_pool is None:
                s._build()
            ctx = s._route(s.mem_pool)
            ctx.__enter__()
            self._pool_ctx = ctx
        except BaseException:
            s.holder = None
            raise

    def __exit__(self, *exc) -> bool:
        ctx = self._pool_ctx
        if ctx is None:
            return False
        self._pool_ctx = None
        s = self.state
        try:
            ctx.__exit__(*exc)
        finally:
            s.check_pending = True  # even on error: a tensor may have escaped
            s.holder = None
        return False
