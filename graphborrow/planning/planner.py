"""Step planning: would a step fit the borrow pool as it is now? The allocator model answers.

A step's *allocation sequence* (sizes, order, frees, streams) is recorded by running the
step on a layout-only simulated device: shapes and allocator decisions, no values, so
even Llama-3-8B shapes record in milliseconds. The sequence is then replayed against a
copy of the borrow pool, a :class:`PoolImage`: the cached segments and blocks of a built
pool, the arena's room left (extents less cursors) and fit policy, and the precarve a
fresh build would make. The replay runs the simulated caching allocator with the real
bump arena as the pool's pluggable allocator, so rounding, the small/large pools, the
20 MiB segments of 1-10 MiB tensors, best fit, splitting and merging, and best- or
first-fit extent choice all apply exactly as they will when the step runs.

    sequence = record(lambda x: torch.log_softmax(x, -1), inputs=[((64, 128256), torch.float32)])
    result = plan(state, sequence)      # or plan(state, fn, inputs=...)
    result.fits, result.peak_bytes, result.reason

A replay serves the requests one at a time (:func:`replaying`), and the first one the pool
cannot serve ends it. A step not recorded yet can be replayed while it is recorded: a phase
recorded with a listener hands each request to it as the allocator sees it, and once the
listener has had enough the step's code stops at its next torch call
(:class:`RecordingStopped`), so a step that cannot fit is refused after the requests up to
the first one that does not fit, however many follow.

Failure reasons name the allocator's size classes (:func:`graphborrow.core.sizes.size_class`).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import itertools
import threading
import traceback
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import torch
from torch.overrides import TorchFunctionMode

from graphborrow.allocator.caching import CachingAllocator
from graphborrow.allocator.config import AllocatorConfig
from graphborrow.allocator.memory import PhysicalMemory
from graphborrow.allocator.restore import restore
from graphborrow.allocator.streams import Clockwork, Event
from graphborrow.core.arena import BumpArena
from graphborrow.core.sizes import (
    SMALL_BUFFER,
    SMALL_SIZE,
    SizeClass,
    round_size,
    short_size,
    size_class,
)
from graphborrow.sim import SimBackend

__all__ = [
    "ALLOC",
    "FREE",
    "AllocationSequence",
    "FailedAllocation",
    "PoolImage",
    "Recording",
    "RecordingStopped",
    "Replay",
    "Replayer",
    "plan",
    "record",
    "recording",
    "renumbered",
    "replay",
    "replaying",
]

ALLOC, FREE = "alloc", "free"
LAYOUT_CAPACITY = 1 << 50  # the recording device never runs out


# ----------------------------------------------------------------------------- sequences


@dataclasses.dataclass(frozen=True)
class AllocationSequence:
    """A step's allocator requests in order.

    ``events`` are ``(ALLOC, id, nbytes, stream)`` and ``(FREE, id, 0, stream)``. Ids are
    unique across every recording of the process, so sequences recorded apart compose by
    concatenation (``prefix + body * 3 + release``) as long as each repeated part frees
    what it allocates.
    """

    events: tuple = ()

    def __add__(self, other: "AllocationSequence") -> "AllocationSequence":
        return AllocationSequence(self.events + other.events)

    def __mul__(self, times: int) -> "AllocationSequence":
        return AllocationSequence(self.events * times)

    def __len__(self) -> int:
        return len(self.events)

    @property
    def allocations(self) -> int:
        return sum(1 for e in self.events if e[0] == ALLOC)

    @property
    def peak_bytes(self) -> int:
        """Most allocator-rounded bytes the step holds at once (its own allocations only)."""
        live, held, peak = {}, 0, 0
        for kind, ident, nbytes, _ in self.events:
            if kind == ALLOC:
                live[ident] = round_size(nbytes)
                held += live[ident]
                peak = max(peak, held)
            elif ident in live:
                held -= live.pop(ident)
        return peak


_IDS = itertools.count()
_RECORD_LOCK = threading.RLock()


def renumbered(sequences: Sequence[AllocationSequence]) -> tuple[AllocationSequence, ...]:
    """``sequences`` with fresh allocation ids, as if recorded now (one recording's phases share
    ids: a free in one names an allocation of another, and keeps naming it here).

    What a sequence made in another process (and stored) needs before it composes with this
    process's recordings, whose ids it could otherwise repeat.

    Args:
        sequences: the phases of one recording.

    Returns:
        The same events in the same order, each id replaced by a new one of this process.
    """
    fresh: dict[int, int] = {}
    out = []
    for sequence in sequences:
        events = []
        for kind, ident, nbytes, stream in sequence.events:
            if ident not in fresh:
                fresh[ident] = next(_IDS)
            events.append((kind, fresh[ident], nbytes, stream))
        out.append(AllocationSequence(tuple(events)))
    return tuple(out)
_DEVICE = None


def _layout_device():
    """The process's layout-only simulated device for recordings (created on first use)."""
    global _DEVICE
    if _DEVICE is None:
        _DEVICE = SimBackend(capacity=LAYOUT_CAPACITY, backed=False, activate=False, blas_workspace=0)
    return _DEVICE


class RecordingStopped(Exception):
    """Raised into a recorded step at its next torch call once the phase's listener has had enough."""


class Recording:
    """Phases recorded on a simulated device; a free in one phase of a block allocated
    in an earlier one keeps that allocation's id."""

    def __init__(self, device) -> None:
        self.device = device
        self._ids: dict[int, int] = {}  # live block address -> allocation id

    @contextlib.contextmanager
    def phase(self, listener: Optional[Callable[[tuple], bool]] = None) -> Iterator[list]:
        """Record everything allocated and freed in the block; the yielded list gets the events.

        Args:
            listener: called with each event as the allocator makes it; once it returns False
                the block's code stops at its next torch call with :class:`RecordingStopped`
                (events after that are not handed to it). The phase is complete when the block
                ends without that error.

        Yields:
            A list, filled as the block runs with ``(ALLOC, id, nbytes, stream)`` and
            ``(FREE, id, 0, stream)`` tuples in the order the allocator saw them.
        """
        events: list = []
        observer = _TraceObserver(self, events, listener)
        self.device.record_memory_history(True, max_entries=1)
        self.device.allocator.history = observer  # entries come to the observer, none is kept
        try:
            with _StopAtNextCall(observer) if listener is not None else contextlib.nullcontext():
                yield events
        finally:
            self.device.record_memory_history(False)

    def event(self, entry: dict) -> Optional[tuple]:
        """The event of one trace entry: an allocation, or the completed free of one this recording made.

        Args:
            entry: an allocator trace entry (``action``, ``addr``, ``size``, ``stream``).

        Returns:
            ``(ALLOC, id, size, stream)``, ``(FREE, id, 0, stream)``, or None for an entry that is neither.
        """
        action = entry["action"]
        if action == "alloc":
            ident = next(_IDS)
            self._ids[entry["addr"]] = ident
            return (ALLOC, ident, entry["size"], entry["stream"])
        if action == "free_completed":
            ident = self._ids.pop(entry["addr"], None)
            if ident is not None:  # blocks from before the recording are not the step's
                return (FREE, ident, 0, entry["stream"])
        return None


class _TraceObserver(collections.deque):
    """Stands in for the allocator's trace buffer: each entry becomes an event at once, none is kept."""

    def __init__(self, recording: Recording, events: list, listener) -> None:
        super().__init__(maxlen=0)
        self.recording, self.events, self.listener = recording, events, listener
        self.stopped = False

    def append(self, entry: dict) -> None:
        event = self.recording.event(entry)
        if event is None:
            return
        self.events.append(event)
        if self.listener is not None and not self.stopped:
            self.stopped = not self.listener(event)


class _StopAtNextCall(TorchFunctionMode):
    """Ends a recorded step between two torch calls once its listener has had enough: the allocator
    and the device are never left half way through a call."""

    def __init__(self, observer: _TraceObserver) -> None:
        super().__init__()
        self.observer = observer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.observer.stopped:
            raise RecordingStopped("the listener of the recorded phase has had enough")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def recording() -> Iterator[Recording]:
    """The layout-only device, active on this thread under inference mode, for recordings.

    Tensors created with ``device="cuda"`` inside land on it (shapes only). One recording
    at a time per process; the device's cache is emptied before and afterwards.

    Yields:
        A :class:`Recording`; record with its ``phase()``.
    """
    with _RECORD_LOCK:
        device = _layout_device()
        device.empty_cache()  # what a stopped recording's frames held until they were dropped
        try:
            with device.activated(), torch.inference_mode():
                yield Recording(device)
        except RecordingStopped as stopped:
            traceback.clear_frames(stopped.__traceback__)  # the stopped step's tensors go back now
            raise
        finally:
            device.empty_cache()


def record(step: Callable[..., Any], inputs: Sequence[tuple] = ()) -> AllocationSequence:
    """The allocation sequence of ``step(*tensors)`` on the layout-only device.

    Args:
        step: a function of the input tensors; everything it allocates and frees is recorded
            (what it returns is released after the recording: as a borrowed step's result
            would have to be).
        inputs: ``(shape, dtype)`` of each input, created before the recording starts.

    Returns:
        The :class:`AllocationSequence`.
    """
    with recording() as rec:
        tensors = [torch.empty(shape, dtype=dtype, device="cuda") for shape, dtype in inputs]
        with rec.phase() as events:
            result = step(*tensors)
        del result, tensors
    return AllocationSequence(tuple(events))


# ----------------------------------------------------------------------------- the pool


@dataclasses.dataclass(frozen=True)
class PoolImage:
    """The borrow pool a step would borrow from now, as data the allocator model rebuilds.

    ``extents``: what the arena can still carve, ``(base, nbytes)`` in arena order;
    ``seeds``: the precarve a fresh build allocates (and frees) first; ``segments``: the
    cached segments of a built pool, in torch's snapshot format; ``runs``: the free runs
    behind it (for reasons); ``disabled``: why the state lends nothing, if it does not.
    """

    extents: tuple = ()
    best_fit: bool = True
    align: int = 512
    seeds: tuple = ()
    segments: tuple = ()
    runs: tuple = ()
    stream: int = 0
    config: Any = None
    disabled: Optional[str] = None

    @classmethod
    def from_runs(cls, runs: Iterable[Sequence[int]], best_fit: bool = True, seeds: Iterable[int] = (),
                  align: int = 512) -> "PoolImage":
        """A fresh borrow pool over ``(address, nbytes)`` runs (largest first, as borrow states keep them).

        Args:
            runs: ``(address, nbytes)`` pairs, the arena's extents in that order.
            best_fit: the arena's fit policy (False: first fit).
            seeds: precarve segment sizes the fresh pool allocates and frees first.
            align: the arena's alignment in bytes.

        Returns:
            A :class:`PoolImage` of a pool not yet built, for "what if" questions without a device.
        """
        runs = tuple((int(a), int(n)) for a, n in runs)
        return cls(extents=runs, best_fit=bool(best_fit), align=align, seeds=tuple(seeds), runs=runs)

    @classmethod
    def of(cls, state) -> "PoolImage":
        """The pool ``state``'s next borrow would use: the built one, or the one it would build.

        A built pool is read after the one allocator call the borrow makes first (a 4-byte
        allocation outside any pool, ``backend.touch()``), which completes the frees whose
        events are done; while the state is held (inside a borrow) nothing is allocated.

        Args:
            state: a :class:`~graphborrow.core.borrow.BorrowState`.

        Returns:
            A :class:`PoolImage`: the built pool's cached segments and the arena's room, a
            fresh build over the current runs, or a disabled image saying why nothing is lent.
        """
        if not state.enabled:
            why = state.disabled_reason or ("no static runs" if state.static_runs is not None else "no graph pool")
            return cls(disabled=why)
        config = _allocator_config(state.backend)
        if state.mem_pool is not None and state.holder is None:
            # what the next borrow does first: frees waiting on completed events finish, and so do
            # those deferred while a borrow routed (torch drops the stream uses recorded then)
            state.backend.touch()
        arena = state.arena
        runs = tuple(state.free_runs())
        if state.mem_pool is None or arena is None or arena.freed_bytes:  # the next borrow builds afresh
            # (a fresh build's arena has the default alignment, the image's default)
            return cls(extents=runs, best_fit=state.best_fit, seeds=tuple(state.precarve_sizes(runs)), runs=runs,
                       config=config)
        rooms = tuple((base + cursor, n - cursor)
                      for (base, n), cursor in zip(arena.extents, arena.extent_cursors()) if n > cursor)
        segments = tuple(state.backend.memory_snapshot(state.backend.pool_id(state.mem_pool)))
        stream = segments[0]["stream"] if segments else 0
        return cls(extents=rooms, best_fit=arena.best_fit, align=arena.align, segments=segments, runs=runs,
                   stream=stream, config=config)

    @property
    def largest_run(self) -> int:
        return max((n for _, n in self.runs), default=0)

    @property
    def largest_room(self) -> int:
        return max((n for _, n in self.extents), default=0)


def _allocator_config(backend):
    """The device allocator's settings, so the model rounds and splits the same way."""
    if isinstance(backend, SimBackend):
        return backend.allocator.config
    return _cuda_allocator_config()


@functools.lru_cache(maxsize=None)
def _cuda_allocator_config():
    """The CUDA allocator's settings as its snapshot records them (read once per process)."""
    settings = torch.cuda.memory._snapshot().get("allocator_settings")
    if settings:
        return AllocatorConfig.from_settings(settings)
    return AllocatorConfig.from_environment()


# ----------------------------------------------------------------------------- replay


@dataclasses.dataclass(frozen=True)
class FailedAllocation:
    """The request the pool could not serve, and what the pool had left at that moment."""

    index: int             # its place among the step's allocations (0-based; -1: building the pool)
    size: SizeClass
    held_bytes: int        # the step's own blocks alive at that moment
    largest_cached: int    # largest free cached block of its pool kind
    largest_room: int      # most bytes any extent could still carve
    largest_run: int
    label: str             # what the tensor is, when the caller could tell

    def reason(self) -> str:
        """Why the request did not fit, in words.

        Returns:
            Which allocation, which tensor and size class, and the room the pool had left.
        """
        s = self.size
        what = f"{self.label} ({short_size(s.nbytes)})" if self.label else f"a {short_size(s.nbytes)} tensor"
        where = ("building the borrow pool (its precarve)" if self.index < 0
                 else f"the step's allocation #{self.index + 1}")
        segment = s.segment_bytes if s.name != "small" else SMALL_BUFFER
        need = f"a new {short_size(segment)} {'small-pool segment' if s.name == 'small' else 'segment'}"
        cached = f"the largest cached free block is {short_size(self.largest_cached)}" if self.largest_cached \
            else "no cached free block is large enough"

        def beside(nbytes: int) -> str:  # exact where one decimal would show the segment's own size
            shown = short_size(nbytes)
            return f"{shown} ({nbytes} B)" if shown == short_size(segment) and nbytes != segment else shown

        return (
            f"{where}, {what}, does not fit. It is {s.describe()}; {cached}, and {need} does not fit "
            f"the room the free runs have left (largest {beside(self.largest_room)}; largest run "
            f"{beside(self.largest_run)}, the step already holds {short_size(self.held_bytes)})"
        )


@dataclasses.dataclass(frozen=True)
class Replay:
    """The outcome of replaying a sequence against a :class:`PoolImage`."""

    fits: bool
    peak_bytes: int                     # most bytes (allocator blocks) the step held at once
    carved_bytes: int                   # arena bytes carved into new segments (precarve included)
    allocations: int
    failed: Optional[FailedAllocation]
    disabled: Optional[str] = None

    @property
    def reason(self) -> str:
        if self.fits:
            return ""
        if self.disabled is not None:
            return f"borrowing is disabled: {self.disabled}"
        return self.failed.reason()


_REPLAY_LOCK = threading.Lock()
_REPLAY_ARENA: Optional[BumpArena] = None


class Replayer:
    """A replay under way against a copy of one pool: requests are served one at a time, and the
    first one the pool cannot serve ends it (later ones are ignored). Made by :func:`replaying`."""

    def __init__(self, image: PoolImage, describe: Optional[Callable[[int], str]], arena: Optional[BumpArena]) -> None:
        self.image, self.describe, self.arena = image, describe, arena
        self.failed: Optional[FailedAllocation] = None
        self._final: Optional[Replay] = None
        self._live: dict[int, Any] = {}
        self._streams: dict[int, int] = {}
        self._held = self._peak = self._index = 0
        if image.disabled is not None:
            self._final = Replay(False, 0, 0, 0, None, disabled=image.disabled)
            return
        self.allocator = CachingAllocator(PhysicalMemory(capacity=SMALL_BUFFER, backed=False), Clockwork(),
                                          image.config)
        if image.segments:
            self.pool_id = _restore(self.allocator, image, arena)
        else:
            self.pool_id = self.allocator.new_pool_id("handle")
            self.allocator.create_or_incref_pool(self.pool_id, arena)
        self.allocator.begin_allocate_to_pool(self.pool_id, lambda _stream, _thread: True)
        try:
            seeds = [self.allocator.malloc(s, image.stream) for s in image.seeds]
        except torch.OutOfMemoryError:
            self.failed = self._failure(-1, max(image.seeds))
            return
        for block in seeds:
            self.allocator.free(block)

    @property
    def done(self) -> bool:
        """Whether the replay has ended: a request was not served, or the pool lends nothing."""
        return self.failed is not None or self.image.disabled is not None

    def serve(self, event: tuple) -> bool:
        """Serve one ``(ALLOC | FREE, id, nbytes, stream)`` request; False once the replay has ended.

        Args:
            event: the request, as :meth:`Recording.event` makes it.

        Returns:
            True while the replay goes on; False once a request could not be served (or it had ended).

        Raises:
            ValueError: a free of an id the replay has not allocated (or has freed already).
        """
        if self.done:
            return False
        kind, ident, nbytes, recorded_stream = event
        stream = self.image.stream
        on = self._streams.setdefault(recorded_stream, stream if not self._streams else stream + 1000 + len(self._streams))
        if kind == ALLOC:
            try:
                block = self.allocator.malloc(nbytes, on)
            except torch.OutOfMemoryError:
                self.failed = self._failure(self._index, nbytes)
                return False
            self._live[ident] = block
            self._held += block.size
            self._peak = max(self._peak, self._held)
            self._index += 1
            return True
        block = self._live.pop(ident, None)
        if block is None:
            raise ValueError(
                f"the sequence frees id {ident}, which it has not allocated (or has freed already); "
                "a composed sequence must free only what its own parts allocate")
        self._held -= block.size
        self.allocator.free(block)
        return True

    def feed(self, sequence: AllocationSequence) -> bool:
        """Serve a sequence's requests in order, up to the first that cannot be served.

        Args:
            sequence: the recorded requests of one phase of a step.

        Returns:
            True while the replay goes on; False once it has ended.
        """
        for event in sequence.events:
            if not self.serve(event):
                return False
        return not self.done

    def result(self) -> Replay:
        """The outcome so far.

        Returns:
            The :class:`Replay` (one that has not ended fits what it was given).
        """
        if self._final is not None:
            return self._final
        return Replay(self.failed is None, self._peak, self.arena.cursor_bytes, self._index, self.failed)

    def close(self) -> None:
        """Keep the outcome: the arena and the allocator model go to the next replay."""
        self._final = self.result()

    def _failure(self, index: int, nbytes: int) -> FailedAllocation:
        kind = "small" if round_size(nbytes) <= SMALL_SIZE else "large"
        cached = max((b["size"] for s in self.allocator.snapshot(self.pool_id) if s["segment_type"] == kind
                      for b in s["blocks"] if b["state"] == "inactive"), default=0)
        rooms = [n - c for (_, n), c in zip(self.arena.extents, self.arena.extent_cursors())]
        return FailedAllocation(index, size_class(nbytes), self._held, cached, max(rooms, default=0),
                                self.image.largest_run, self.describe(nbytes) if self.describe else "")


@contextlib.contextmanager
def replaying(image: PoolImage, describe: Optional[Callable[[int], str]] = None) -> Iterator[Replayer]:
    """A :class:`Replayer` against a copy of the pool ``image``, for the block (one replay at a time
    per process: the model's arena is shared). Its ``result()`` stays readable afterwards.

    Args:
        image: the pool (see :meth:`PoolImage.of`).
        describe: names a request of n bytes for the reason (e.g. "a [64, 128256] float32 matrix").

    Returns:
        A context manager that yields the :class:`Replayer`.
    """
    if image.disabled is not None:
        replayer = Replayer(image, describe, None)
        yield replayer
        return
    global _REPLAY_ARENA
    with _REPLAY_LOCK:
        if _REPLAY_ARENA is None:
            _REPLAY_ARENA = BumpArena()
        arena = _REPLAY_ARENA
        arena.set_extents([])
        arena.align = image.align
        arena.best_fit = image.best_fit
        arena.set_extents(image.extents)
        replayer = Replayer(image, describe, arena)
        try:
            yield replayer
        finally:
            replayer.close()


def replay(sequence: AllocationSequence, image: PoolImage,
           describe: Optional[Callable[[int], str]] = None) -> Replay:
    """Run ``sequence`` against a copy of the pool ``image`` in the allocator model.

    Args:
        sequence: the step's requests (see :func:`record`).
        image: the pool (see :meth:`PoolImage.of`).
        describe: names a request of n bytes for the reason (e.g. "a [64, 128256] float32 matrix").

    Returns:
        A :class:`Replay`: fits, peak and carved bytes, and the failed request if any.
    """
    with replaying(image, describe) as replayer:
        replayer.feed(sequence)
    return replayer.result()


def _restore(allocator, image: PoolImage, arena: BumpArena) -> tuple[int, int]:
    """Rebuild a built borrow pool's cached segments in ``allocator``; new segments come from ``arena``."""
    pool_id = tuple(image.segments[0]["segment_pool_id"])
    # frees still waiting on another stream's work stay pending for the whole step: a borrow
    # routes to its pool, and the allocator processes no events while a pool routes
    restore(allocator, list(image.segments), allocators={pool_id: arena}, pending=_never(allocator))
    return pool_id


def _never(allocator):
    """An event on a stream whose work never ends, for blocks whose frees are still pending."""
    stream = allocator.clockwork.new_stream()
    stream.enqueue(float("inf"))
    event = Event()
    event.record(stream)
    return event


def plan(state, step, inputs: Sequence[tuple] = (), describe: Optional[Callable[[int], str]] = None) -> Replay:
    """Would ``step``, run inside ``state.borrow()`` right now, fit the borrowed runs?

    Args:
        state: a :class:`~graphborrow.core.borrow.BorrowState` (or a :class:`PoolImage`).
        step: an :class:`AllocationSequence`, or a function recorded by :func:`record`
            (with ``inputs``): everything it allocates counts as borrowed.
        inputs: ``(shape, dtype)`` of the function's inputs, made outside the borrow.
        describe: names a request for the reason.

    Returns:
        The :class:`Replay`.
    """
    image = state if isinstance(state, PoolImage) else PoolImage.of(state)
    sequence = step if isinstance(step, AllocationSequence) else record(step, inputs)
    return replay(sequence, image, describe)
