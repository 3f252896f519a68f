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

Scopes are safe against asynchronous interrupts: a Ctrl-C lands before or after a state
change, never inside one (Note [interrupt-safe scopes] in :mod:`graphborrow.core.interrupts`).
"""

from __future__ import annotations

import bisect
import dataclasses
import traceback
import weakref
from typing import Any, Iterable, Optional, Sequence

import torch

from .arena import BumpArena, check_extents
from .checks import ADDRESS_LIMIT, as_flag, as_integer
from .device_api import DeviceAPI
from .errors import (
    ArenaIntegrityError,
    BorrowLeakError,
    EmptyGraphPoolError,
    PoolBusyError,
    WrongStreamError,
)
from .interrupts import CRITICAL, CRITICAL_ENTRY
from .runs import POLICIES, find_free_runs
from .sizes import LARGE_BUFFER, MB, MIN_BLOCK_SIZE, MIN_LARGE_ALLOC, allocation_size, format_size, is_small, round_size

__all__ = ["BorrowState", "BorrowScope", "CaptureScope", "ReplayScope", "CAPTURE_USER", "REPLAY_USER"]

CAPTURE_USER = "CUDA graph capture"
REPLAY_USER = "CUDA graph replay"


def precarve_bytes(run: int, reserve: int = 32 * MB, minimum: int = 64 * MB) -> int:
    """The seed segment a fresh borrow pool precarves in a run of ``run`` bytes (0: none):
    the run less ``reserve`` (room for small-pool segments), rounded down to 2 MiB, if at
    least ``minimum``."""
    seed = (run - reserve) // (2 * MB) * (2 * MB)
    return seed if seed >= minimum else 0


def _pool_handle(value: Any) -> tuple[int, int]:
    """A graph pool handle as ``backend.graph_pool_handle()`` gives it: a pair of ints."""
    try:
        first, second = value
        return as_integer(first, "pool_id[0]"), as_integer(second, "pool_id[1]")
    except (TypeError, ValueError):
        raise TypeError(f"pool_id must be a graph pool handle, the pair of ints backend.graph_pool_handle() "
                        f"returns (or None); got {value!r}") from None


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

    Args:
        backend: the device, a :class:`~graphborrow.device.cuda.CudaBackend` or a
            :class:`~graphborrow.sim.SimBackend` (see :func:`graphborrow.device.get_backend`).
        pool_id: the shared graph pool's handle (``backend.graph_pool_handle()``) whose idle
            runs are borrowed; None leaves borrowing off until static runs are set.
        policy: how free runs are found, ``"runs"`` (merged inactive blocks) or
            ``"whole_segments"`` (the seed's rule); see :data:`graphborrow.core.runs.POLICIES`.
        best_fit: the arena places a segment in the smallest run that holds it (False: the
            first, largest first).
        precarve: seed each large run with one cached segment when the borrow pool is built.
        precarve_reserve: bytes of each run left out of its seed segment, for small-pool
            segments.
        precarve_min: smallest seed segment worth carving, in bytes.

    Raises:
        TypeError: ``backend`` is not a device, ``pool_id`` not a pair of ints, a switch not a
            bool or a size not an int.
        ValueError: an unknown ``policy``, a negative size (or one not below 2**64), or a
            ``precarve_min`` below 10 MiB (such a seed would take a 20 MiB segment).
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
    _pool_segments: int = dataclasses.field(default=0, init=False, repr=False)
    # the scope holding the slot (a weak reference: an abandoned scope must be collectable)
    _holder_ref: Any = dataclasses.field(default=None, init=False, repr=False)
    _routing: Any = dataclasses.field(default=None, init=False, repr=False)  # the borrow's routing context
    _arena_errors_seen: int = dataclasses.field(default=0, init=False, repr=False)
    _earlier_arena_errors: int = dataclasses.field(default=0, init=False, repr=False)  # of arenas replaced

    def __post_init__(self) -> None:
        if not isinstance(self.backend, DeviceAPI):
            raise TypeError(f"backend must be a device, get_backend('cuda') or get_backend('sim'); got "
                            f"{type(self.backend).__name__}")
        if self.pool_id is not None:
            self.pool_id = _pool_handle(self.pool_id)
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        for name in ("best_fit", "precarve"):
            as_flag(getattr(self, name), name)
        for name in ("precarve_reserve", "precarve_min"):
            value = as_integer(getattr(self, name), name)
            if not 0 <= value < ADDRESS_LIMIT:
                raise ValueError(f"{name}={value} must be a number of bytes in [0, 2**64)")
            setattr(self, name, value)
        if self.precarve_min < MIN_LARGE_ALLOC:
            raise ValueError(
                f"precarve_min={self.precarve_min} is below {MIN_LARGE_ALLOC // MB} MiB: a seed that small is a "
                f"medium request, which the allocator serves from a {LARGE_BUFFER // MB} MiB segment its run "
                f"may not hold; pass precarve_min >= {MIN_LARGE_ALLOC} (or precarve=False)")
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
        """Turn borrowing off for good reason (e.g. graphs saved to external storage).

        Disabling is explicit so that a log or ``stats()`` can say why nothing is borrowed;
        the borrow pool is retired first, and every scope becomes a true no-op.

        Args:
            reason: a non-empty sentence saying why, kept in ``disabled_reason``.

        Raises:
            ValueError: ``reason`` is empty or not a string.
            PoolBusyError: a capture, replay or borrow scope holds the pool.
        """
        if not isinstance(reason, str) or not reason.strip():
            raise ValueError("disable() needs a reason, e.g. disable('graph pool is externally managed')")
        with CRITICAL:
            self._require_idle("disable borrowing")
            self._retire()
            self.disabled_reason = reason

    def enable(self) -> None:
        """Undo :meth:`disable`; the next borrow builds a fresh pool from the current runs."""
        self.disabled_reason = None

    def set_static_runs(self, runs: Iterable[Sequence[int]]) -> None:
        """Borrow from fixed ``(address, nbytes)`` ranges instead of snapshot runs.

        For externally managed storage whose addresses never move. The largest
        ``BumpArena.MAX_EXTENTS`` are kept; an empty list disables borrowing.

        Args:
            runs: ``(address, nbytes)`` pairs in bytes; each address 512-byte aligned, no two
                ranges overlapping, none covering a block the caching allocator hands out
                (use memory from ``backend.external_alloc``).

        Raises:
            TypeError: a range is not a pair of ints (floats, strings and bools are refused).
            ValueError: a range is empty, misaligned, not below 2**64, overlaps another or a
                live block (the arena's rules: :func:`~graphborrow.core.arena.check_extents`).
            PoolBusyError: a scope holds the pool.
        """
        runs = check_extents(runs, MIN_BLOCK_SIZE, "static run")
        self._refuse_live_overlap(runs)
        runs.sort(key=lambda r: (-r[1], r[0]))
        with CRITICAL:
            self._require_idle("replace the static runs")
            self._retire()
            self.static_runs = runs[: BumpArena.MAX_EXTENTS]

    def _refuse_live_overlap(self, runs: list) -> None:
        """Static runs must not cover blocks the caching allocator still hands out.

        The runs are disjoint, so sorted by address their ends ascend too: each block needs
        one bisection, not a pass over every run."""
        if not runs:
            return
        ordered = sorted(runs)
        ends = [a + n for a, n in ordered]
        for segment in self.backend.memory_snapshot():
            for block in segment["blocks"]:
                if block["state"] == "inactive":
                    continue
                b0, b1 = block["address"], block["address"] + block["size"]
                i = bisect.bisect_right(ends, b0)  # the first run ending after the block starts
                if i < len(ordered):
                    a, n = ordered[i]
                    if a < b1:
                        raise ValueError(
                            f"static run [{a:#x}, {a + n:#x}) overlaps a live tensor's block "
                            f"[{b0:#x}, {b1:#x}) of the caching allocator; static runs are for "
                            "storage the allocator does not manage (e.g. backend.external_alloc)"
                        )

    def clear_static_runs(self) -> None:
        """Go back to runs found in the pool's snapshot (undoes :meth:`set_static_runs`)."""
        with CRITICAL:
            self._require_idle("clear the static runs")
            self._retire()
            self.static_runs = None

    @property
    def high_water(self) -> int:
        """Most arena bytes any borrow pool of this state has carved so far."""
        return max(self._high_water, self.arena.cursor_bytes if self.arena else 0)

    # ------------------------------------------------------------------ capacity
    def free_runs(self) -> list[tuple[int, int]]:
        """The runs a new borrow pool would use, largest first (cached until retirement).

        Returns:
            ``(address, nbytes)`` pairs, at most ``BumpArena.MAX_EXTENTS``; empty when
            borrowing is disabled.
        """
        if not self.enabled:
            return []
        if self.static_runs is not None:
            return list(self.static_runs)
        if self._runs is None:
            segments = self._pool_snapshot()
            self._pool_segments = len(segments)
            self._runs = find_free_runs(segments, self.policy)[: BumpArena.MAX_EXTENTS]
        return list(self._runs)

    def _pool_snapshot(self) -> list:
        """The segments of this state's pool, and only those.

        A snapshot asked for one pool holds that pool's segments (torch fills
        ``segment_pool_id`` for them); any other segment is left out rather than trusted,
        so memory of another pool can never become a run.
        """
        pool = tuple(self.pool_id)
        segments = self.backend.memory_snapshot(pool)
        return [s for s in segments if tuple(s.get("segment_pool_id", pool)) == pool]

    def largest_run(self) -> int:
        """The size of the largest free run, the upper bound on any one borrowed segment.

        Returns:
            Bytes; 0 when borrowing is disabled or the pool has no idle run.
        """
        runs = self.free_runs()
        return runs[0][1] if runs else 0

    def _precarve_bytes(self, run: int) -> int:
        if not self.precarve:
            return 0
        return precarve_bytes(run, self.precarve_reserve, self.precarve_min)

    def precarve_sizes(self, runs: Sequence[Sequence[int]]) -> list[int]:
        """The seed segments a fresh borrow pool over ``runs`` allocates (and frees), in order.

        Args:
            runs: ``(address, nbytes)`` pairs, as :meth:`free_runs` returns them.

        Returns:
            Segment sizes in bytes, one per run large enough to seed (none when ``precarve``
            is off).
        """
        return [s for s in (self._precarve_bytes(n) for _, n in runs) if s]

    def can_fit(self, nbytes: int) -> bool:
        """Could one more tensor of ``nbytes`` be borrowed right now? (The single-tensor question:
        whether a whole step fits depends on its allocation sequence; ask
        :func:`graphborrow.eagle.plan.plan_verify` or :func:`graphborrow.planning.planner.plan`.)

        Applies the allocator's rounding: a request gets a 512-byte-rounded block, from a
        cached free block of the borrow pool (a precarved segment included), or in a new
        segment of 2 MiB, 20 MiB or a 2 MiB multiple that the arena must still have room
        for. Before the first borrow it answers for the pool that borrow would build.

        Args:
            nbytes: the tensor's size in bytes (before rounding).

        Returns:
            True if the allocator would place it in the borrow pool; False when borrowing
            is disabled, ``nbytes`` is not positive, or no run has room.

        Raises:
            TypeError: ``nbytes`` is not an int (a bool or a float is not a size).
        """
        nbytes = as_integer(nbytes, "can_fit's nbytes")
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
    def _held_by(self) -> Optional[str]:
        """Who holds the owner slot, once a scope collected without leaving has been reclaimed."""
        if self.holder is not None:
            self._reclaim_abandoned()
        return self.holder

    def _take_slot(self, user: str, scope: Any = None) -> None:
        if self._held_by() is not None:
            raise PoolBusyError(
                f"the graph pool is held by {self.holder!r}; cannot start {user!r}. "
                "Capture, replay and borrowing never overlap: leave the first scope "
                "(and let every borrowed tensor die) before entering the next."
            )
        self.holder = user
        self._holder_ref = None if scope is None else weakref.ref(scope)

    def _release_slot(self) -> None:
        self.holder = None
        self._holder_ref = None

    def _reclaim_abandoned(self) -> None:
        """Release the slot of a scope that was collected without leaving (an interrupt
        between its entry and exit, or in its finalizer). A live holder stays."""
        ref = self._holder_ref
        if ref is not None and ref() is None:
            self._leave()

    def _leave(self) -> None:
        """Undo whatever the holding scope did on entry and release the slot (idempotent)."""
        routing, self._routing = self._routing, None
        try:
            if routing is not None:
                routing.__exit__(None, None, None)
                self.check_pending = True  # a tensor may have escaped the borrow
        finally:
            if self.holder == CAPTURE_USER:
                self._runs = None  # the capture re-carved the free space
            self._release_slot()

    def _require_idle(self, action: str) -> None:
        if self._held_by() is not None:
            raise PoolBusyError(
                f"cannot {action} while the graph pool is held by {self.holder!r}; "
                "leave that scope first"
            )

    def capture_scope(self) -> "CaptureScope":
        """Wrap a graph capture into the shared pool: retires the borrow pool first.

        The capture re-carves the pool's free space, so the cached runs are dropped when the
        scope ends.

        Returns:
            A :class:`CaptureScope`; entering it raises ``PoolBusyError`` while another scope
            holds the pool and ``BorrowLeakError`` if a borrowed tensor is still referenced.
        """
        return CaptureScope(self, CAPTURE_USER)

    def replay_scope(self) -> "ReplayScope":
        """Wrap a graph replay: refuses while any borrowed byte is still referenced.

        A replay writes into the pool's free blocks, so a borrowed tensor alive across it
        would be overwritten silently; the scope turns that into an error.

        Returns:
            A :class:`ReplayScope`; entering it raises ``BorrowLeakError`` (a borrowed tensor
            survived its borrow) or ``PoolBusyError`` (another scope holds the pool).
        """
        return ReplayScope(self, REPLAY_USER)

    def borrow(self, user: str = "borrow") -> "BorrowScope":
        """Route new tensors of this thread into the graph pool's free runs.

        ``user`` names the borrower in errors (``PoolBusyError`` names the holder); it
        must be a non-empty string. A request no run can hold raises the backend's
        OutOfMemoryError; nothing falls back silently to fresh device memory.

        Args:
            user: who borrows, e.g. ``"EAGLE verify"``.

        Returns:
            A :class:`BorrowScope`. Entering it builds the borrow pool on the current stream
            if there is none; it raises ``WrongStreamError`` on another stream than the one
            that built the pool, ``EmptyGraphPoolError`` when nothing was captured into
            ``pool_id``, and ``PoolBusyError`` while another scope holds the pool.

        Raises:
            TypeError: ``user`` is not a non-empty string.
        """
        if not isinstance(user, str) or not user.strip():
            raise TypeError(
                f"borrow() needs a non-empty string naming the borrower, e.g. "
                f"state.borrow('EAGLE verify'); got {user!r}"
            )
        return BorrowScope(self, user)

    # ------------------------------------------------------------------ pool life
    def _build(self) -> None:
        """Build the borrow pool over the current runs, all or nothing.

        The pool is assembled on a fresh arena and only then becomes the state's: a failure
        on the way (the device or the arena refusing a precarved segment, a bad run) drops
        the half-built pool, whose segments go back to that arena, and leaves every field of
        the state (the previous arena and its counters included) as it was.
        """
        runs = self.free_runs()
        if self.static_runs is None and self._pool_segments == 0:
            raise EmptyGraphPoolError(
                f"the graph pool {tuple(self.pool_id)} holds no segments: no graph has been captured "
                "into it yet (or its graphs were freed and the memory returned), so there is nothing "
                "idle to borrow, and handing out memory from any other pool would collide with plain "
                "allocations. Capture into state.pool_id first (inside state.capture_scope()), or use "
                "set_static_runs() for memory the caching allocator does not manage."
            )
        arena = BumpArena(best_fit=self.best_fit)
        arena.set_extents(runs)
        pool = self.backend.arena_pool(arena)
        try:
            self._precarve(pool, self.precarve_sizes(runs))
        except BaseException as failure:
            # the traceback keeps the frames it passed through (a notebook keeps the last one):
            # clear them, or they would keep the half-built pool and its segments alive
            del pool, arena
            traceback.clear_frames(failure.__traceback__)
            raise
        if self.arena is not None:
            self._earlier_arena_errors += self.arena.errors
        self.arena, self.mem_pool, self._arena_errors_seen = arena, pool, 0
        self.stream = self.backend.current_stream()
        self.stream_key = self._stream_key()
        self.builds += 1

    def _precarve(self, pool: Any, seeds: Sequence[int]) -> None:
        """Allocate and free one segment per seed size in ``pool``; nothing stays allocated,
        whether it completes or not."""
        if not seeds:
            return
        held: list = []
        try:
            # hold every seed until all exist: a freed seed would otherwise serve the next;
            # activated: "cuda" must mean this device, even while another simulated one is active
            with self.backend.activated(), self.backend.use_mem_pool(pool):
                for size in seeds:
                    held.append(torch.empty(size, dtype=torch.uint8, device=self.backend.device))
        finally:
            held.clear()

    def live_borrowed_bytes(self) -> int:
        """Bytes of the borrow pool still allocated to live tensors.

        Returns:
            Bytes in ``active_allocated`` blocks (allocator-rounded sizes); 0 without a pool.
        """
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
                f"graph-pool borrow leak at {event}: {format_size(live)} ({live} bytes) borrowed from the graph pool "
                f"are still referenced, and {event} would overwrite them. Delete (or copy out "
                "of the scope) every tensor created inside the borrow before this point."
            )
        self.check_pending = False

    def retire(self) -> "RetireReport":
        """Drop the borrow pool: leak check, synchronise, drain deferred frees, release.

        Returns:
            A :class:`RetireReport`: the borrow pool's ``active_pending_free`` bytes before
            the synchronise and after the drain (always 0 after: that is the point).

        Raises:
            PoolBusyError: a scope holds the pool.
            BorrowLeakError: a tensor borrowed earlier is still referenced.
            ArenaIntegrityError: the arena refused frees since the last check.
        """
        with CRITICAL:
            self._require_idle("retire the borrow pool")
            return self._retire()

    def _check_arena(self, event: str) -> None:
        """Raise once for frees the arena refused since the last check (torch's pluggable
        path, and the simulated device's, count them because they cannot raise)."""
        arena = self.arena
        if arena is None or arena.errors == self._arena_errors_seen:
            return
        new = arena.errors - self._arena_errors_seen
        self._arena_errors_seen = arena.errors
        raise ArenaIntegrityError(
            f"at {event}: the borrow pool's arena refused {new} free(s) from the allocator above it; "
            f"the last: {arena.describe_last_error()}. The refused frees changed nothing in the arena, "
            "but something released memory it did not get from it, or released it twice. "
            "If you call BumpArena.free or raw_delete yourself, pass what malloc returned, once."
        )

    def pending_free_bytes(self) -> int:
        """Bytes of the borrow pool still ``active_pending_free`` (freed in Python, waiting for
        another stream's event).

        Returns:
            Bytes; 0 without a pool.
        """
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
        self.mem_pool = None  # the pool's segments go back to the arena now
        self.stream = self.stream_key = None
        self._check_arena("borrow-pool retirement")
        return RetireReport(before, after, built=True)

    # ------------------------------------------------------------------ reporting
    def stats(self) -> dict:
        """The state at a glance, for tables and logs.

        Returns:
            A dict: ``enabled``, ``disabled_reason``, ``holder``, the free ``runs`` (count),
            ``run_bytes``, ``largest_run``, ``pool_built``, ``builds``, the arena's
            ``cursor_bytes`` and ``freed_bytes`` (of the latest pool's arena), ``arena_errors``
            (frees refused by every arena this state built on) and ``high_water``;
            sizes in bytes.
        """
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
            "arena_errors": self._earlier_arena_errors + (self.arena.errors if self.arena else 0),
            "high_water": self.high_water,
        }


class _SlotScope:
    """A scope that holds the owner slot from entry to exit; see Note [interrupt-safe scopes]
    (:mod:`graphborrow.core.interrupts`) for how entry, exit and ``__del__`` share the work."""

    __slots__ = ("state", "user", "__weakref__")

    def __init__(self, state: BorrowState, user: str):
        self.state, self.user = state, user

    def _enter(self) -> None:
        """What the scope does once it holds the slot; raise to refuse (the slot is released)."""

    def __enter__(self) -> None:
        s = self.state
        if not s.enabled:
            return
        with CRITICAL_ENTRY:
            s._take_slot(self.user, self)
            try:
                self._enter()
            except BaseException:
                s._leave()
                raise

    def _holds(self) -> bool:
        ref = self.state._holder_ref
        return ref is not None and ref() is self

    def __exit__(self, *exc) -> bool:
        if self._holds():
            with CRITICAL:
                self._exit()
        return False

    def _exit(self) -> None:
        self.state._leave()

    def __del__(self) -> None:
        try:
            if self._holds():  # entered, never left: an interrupt cut the with statement short
                with CRITICAL:
                    self._exit()
        except Exception:  # interpreter shutdown: the state may be half torn down
            pass


class CaptureScope(_SlotScope):
    """``BorrowState.capture_scope()``: retires the borrow pool; the capture re-carves the runs."""

    __slots__ = ()

    def _enter(self) -> None:
        self.state._retire()


class ReplayScope(_SlotScope):
    """``BorrowState.replay_scope()``: refuses while a borrowed tensor is still referenced."""

    __slots__ = ()

    def _enter(self) -> None:
        s = self.state
        if s.check_pending:
            s._raise_on_live_borrows("graph replay")


class BorrowScope(_SlotScope):
    """The context manager of ``BorrowState.borrow``. It runs every decode step, and its
    host cost is measured against use_mem_pool's (``benchmarks/interrupt_cost.py``)."""

    __slots__ = ()

    def _enter(self) -> None:
        s = self.state
        if s.mem_pool is not None:
            if s._stream_key() != s.stream_key:
                raise WrongStreamError(  # streams by the id torch gives them (cuda_stream, a snapshot's "stream")
                    f"{self.user!r} borrows on stream {s._stream_key()} but the borrow pool was built on "
                    f"stream {s.stream_key}; borrow on that stream, or call retire() first so the next borrow "
                    "builds a pool on the new one"
                )
            s.backend.touch()  # lets the allocator finish completed cross-stream frees
            s._check_arena(f"the start of {self.user!r}")
            if s.arena.freed_bytes:
                # the caching layer released arena segments (empty_cache); a bump arena
                # cannot hand those bytes out again, so start over from fresh runs
                s._retire()
        if s.mem_pool is None:
            s._build()
        routing = s._route(s.mem_pool)
        routing.__enter__()
        s._routing = routing

    def __exit__(self, kind, error, trace) -> bool:
        left = _SlotScope.__exit__(self, kind, error, trace)
        if error is not None and isinstance(error, self.state.backend.OutOfMemoryError) and hasattr(error, "add_note"):
            _note_full_borrow_pool(error, self.state, self.user)  # add_note: Python 3.11+
        return left


def _note_full_borrow_pool(error: BaseException, state: BorrowState, user: str) -> None:
    """Torch's out-of-memory message speaks of the device; say that the borrow pool is what is full."""
    try:
        largest = state.largest_run()
    except Exception:  # the message must not be lost to a second failure
        return
    error.add_note(f"graphborrow: inside {user!r} every allocation comes from the borrow pool, whose largest free run "
                   f"is {format_size(largest)}; the device's free memory is not used. Ask state.can_fit(nbytes) "
                   "before the borrow, or make the step smaller (lean or chunked verification).")
