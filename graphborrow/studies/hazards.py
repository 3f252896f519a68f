"""What goes wrong when a borrow scope runs code you do not own, and the two ways out.

Borrowing is safe only while every byte allocated inside the scope dies inside it. A
serving engine's sampling step runs library code that keeps state between calls: cuBLAS
creates a workspace the first time a stream multiplies a matrix and keeps it for the life
of the process; flashinfer caches a zeroed buffer on its first renorm; a logits processor
may keep a mask for the next step. Allocated inside the scope, each of these lands in the
graph pool's idle runs and outlives the step: the next guarded replay refuses to run
(``BorrowLeakError``), and without the guard the replay and the library write the same
bytes. Upstream SGLang met this and stopped borrowing for EAGLE sampling.

The two ways out measured here: *rehearse* the step once outside any borrow, so lazily
created library state lands in ordinary memory first; or verify without the
full-vocabulary temporaries at all, so there is nothing worth borrowing.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

from graphborrow.core.errors import BorrowLeakError
from graphborrow.core.sizes import round_size
from graphborrow.device import get_backend

__all__ = [
    "HazardReport",
    "library_workspace_hazard",
    "escaped_tensor_hazard",
    "peak_step_bytes",
]

_TRACE_ALLOC = "alloc"
_TRACE_FREES = ("free_completed",)


@dataclasses.dataclass(frozen=True)
class HazardReport:
    """What one hazard left behind after its step's borrow scope ended.

    Attributes:
        hazard: which hazard ran, in words.
        rehearsed: whether the step ran once outside the borrow first.
        step_error: None when the step ran; else the error it raised (a workspace larger
            than every idle run turns a step that fits into an out-of-memory error).
        left_in_pool_bytes: borrowed bytes still referenced after the scope ended.
        inside_runs_bytes: how many of them lie in the graph pool's idle runs (bytes the
            graphs rewrite on every replay).
        guard_message: what the leak check said at the next guarded replay (None: it passed).
        overwritten_fraction: share of a kept tensor's values an unguarded replay changed
            (None when it was not measured: no bytes on a layout-only device, or nothing kept).
    """

    hazard: str
    rehearsed: bool
    step_error: Optional[str]
    left_in_pool_bytes: int
    inside_runs_bytes: int
    guard_message: Optional[str]
    overwritten_fraction: Optional[float] = None


def _left_behind(state, runs) -> dict:
    """The borrowed bytes still referenced once the scope ended, and how many lie in ``runs``."""
    live = _live_borrowed_blocks(state)
    return {"left_in_pool_bytes": sum(n for _, n in live), "inside_runs_bytes": _bytes_inside(live, runs)}


def _bytes_inside(ranges, runs) -> int:
    """Bytes of ``ranges`` [(address, nbytes)] that fall inside any of ``runs``."""
    total = 0
    for address, nbytes in ranges:
        for start, length in runs:
            lo, hi = max(address, start), min(address + nbytes, start + length)
            if hi > lo:
                total += hi - lo
    return total


def _live_borrowed_blocks(state) -> list[tuple[int, int]]:
    if state.mem_pool is None:
        return []
    segments = state.backend.memory_snapshot(state.backend.pool_id(state.mem_pool))
    return [(b["address"], b["size"]) for s in segments for b in s["blocks"] if b["state"] == "active_allocated"]


def _guarded_replay(ladder) -> Optional[str]:
    """Replay the first captured graph under the borrow state's guard; the leak message, if any."""
    key = next(iter(ladder.graphs))
    try:
        ladder.replay(key)
    except BorrowLeakError as exc:
        return str(exc)
    return None


def library_workspace_hazard(ladder, *, rehearse: bool = False, size: int = 256) -> HazardReport:
    """A matrix product on a stream that never multiplied before, inside a borrow scope.

    cuBLAS (and the simulated device, which models it) allocates that stream's workspace
    on the first product and keeps it. Inside the scope the workspace comes from the
    borrow pool, so it outlives the step in the graph pool's idle runs. With
    ``rehearse`` the same product runs once on that stream outside the borrow first.

    Args:
        ladder: a captured :class:`graphborrow.workloads.ladder.GraphLadder` (its borrow state is used).
        rehearse: run the step once outside any borrow before borrowing.
        size: side of the square matrices multiplied.

    Returns:
        A :class:`HazardReport`; the workspace is released again before returning (see
        ``backend.clear_library_workspaces``), so the ladder stays usable.
    """
    state, backend = ladder.state, ladder.backend
    state.retire()
    stream = backend.Stream()
    a = torch.ones(size, size, device=backend.device)
    if rehearse:
        with backend.stream(stream):
            del_me = a @ a
            del del_me
        backend.synchronize()
    runs = state.free_runs()
    step_error = None
    try:
        with state.borrow("EAGLE verify (a matmul on a new stream)"):
            with backend.stream(stream):
                product = a @ a
                del product
    except backend.OutOfMemoryError as exc:
        step_error = f"{type(exc).__name__}: {exc}"  # whole: it says which pool is full
    backend.synchronize()
    report = HazardReport(hazard="library workspace created inside the borrow", rehearsed=rehearse,
                          step_error=step_error, **_left_behind(state, runs), guard_message=_guarded_replay(ladder))
    backend.clear_library_workspaces()
    state.retire()
    return report


def escaped_tensor_hazard(ladder, make: Callable[[torch.Tensor], torch.Tensor], batch: int) -> HazardReport:
    """A tensor computed inside the borrow and kept for the next step (a mask, say).

    ``make(logits)`` runs inside the scope on the decode logits of ``batch`` requests; its
    result is kept. The guarded replay must refuse; then the graphs are replayed without
    the guard, and on a device with bytes the share of the kept values that changed is
    measured. The kept tensor is dropped before returning.

    Args:
        ladder: a captured :class:`graphborrow.workloads.ladder.GraphLadder`.
        make: builds the kept tensor from the logits, e.g. ``lambda l: l > 0``.
        batch: decode batch whose logits feed ``make``.

    Returns:
        A :class:`HazardReport`.
    """
    state, backend = ladder.state, ladder.backend
    state.retire()
    logits = ladder.decode(batch)
    runs = state.free_runs()
    with state.borrow("EAGLE verify (keeps a mask)"):
        kept = make(logits)
    backend.synchronize()
    left = _left_behind(state, runs)
    guard = _guarded_replay(ladder)
    fraction = None
    if backend.backed:
        before = kept.cpu().clone()
        for graph in ladder.graphs.values():  # no replay scope: nobody checks
            graph.replay()
        backend.synchronize()
        if before.numel():  # of no values, no share changed
            fraction = (before != kept.cpu()).float().mean().item()
    del kept
    report = HazardReport(hazard="a step's tensor kept for the next step", rehearsed=False, step_error=None,
                          **left, guard_message=guard, overwritten_fraction=fraction)
    state.retire()
    return report


def peak_step_bytes(step: Callable[[], object], backend=None) -> int:
    """Most bytes the step held at once, read from the allocator's own trace.

    Runs ``step()`` with memory history recording and replays the trace's allocations and
    completed frees in order: the high-water mark of the step's live blocks (rounded sizes,
    as the allocator charges them). Works on CUDA and on the simulated device; ``backend``
    None is the device ``torch.cuda`` is.
    """
    backend = backend if backend is not None else get_backend("auto")
    backend.synchronize()
    backend.record_memory_history(True)
    try:
        result = step()
        del result
        backend.synchronize()
        trace = backend.full_snapshot()["device_traces"]
    finally:
        backend.record_memory_history(False)
    sizes: dict[int, int] = {}  # blocks the step allocated, by address (earlier blocks never count)
    live = peak = 0
    for device_trace in trace:
        for entry in device_trace:
            if entry["action"] == _TRACE_ALLOC:  # traces hold requested sizes: round as the allocator does
                sizes[entry["addr"]] = round_size(entry["size"])
                live += sizes[entry["addr"]]
                peak = max(peak, live)
            elif entry["action"] in _TRACE_FREES and entry["addr"] in sizes:
                live -= sizes.pop(entry["addr"])
    return peak
