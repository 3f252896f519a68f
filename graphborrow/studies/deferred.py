"""What a borrow pool retired without synchronising would hand back too early.

A borrowed tensor used on a second stream and dropped after ``record_stream`` stays
``active_pending_free`` until that stream's event completes. :meth:`BorrowState.retire`
therefore synchronises and drains those frees before the extents go back to the graph pool.
:func:`early_release_hazard` shows, on the simulated device, what skipping that step would
do: which pending bytes the next replay of the ladder writes, and for how long the side
stream still uses them. It reads the streams' clocks and the captured graphs' write ranges,
which only the simulated device exposes.
"""

from __future__ import annotations

import dataclasses

import torch

from .writes import merged_writes, overlap_bytes

__all__ = ["EarlyReleaseReport", "early_release_hazard"]


@dataclasses.dataclass(frozen=True)
class EarlyReleaseReport:
    """One borrowed tensor, used on a busy side stream and dropped, at the moment a retirement
    without synchronise would release the extents.

    ``pending``: ``(address, nbytes)`` blocks still ``active_pending_free``. ``overwritten``:
    bytes of them that replaying the ladder's graphs writes. ``side_busy_us``: how long the
    side stream still works on them (the replay on the main stream could start now).
    ``writers``: the graphs (ladder keys) whose replay writes them.
    """

    pending: list
    overwritten: int
    side_busy_us: float
    writers: list

    @property
    def pending_bytes(self) -> int:
        return sum(n for _, n in self.pending)


def early_release_hazard(ladder, nbytes: int, busy_us: float = 50_000) -> EarlyReleaseReport:
    """Borrow ``nbytes``, use them on a side stream busy for ``busy_us``, drop them, and report
    what releasing the borrow pool *now*, without synchronising, would expose. The pool is
    then retired properly, so the ladder is left as it was.

    Args:
        ladder: a captured :class:`~graphborrow.workloads.ladder.GraphLadder` on a simulated device.
        nbytes: the borrowed tensor's size (a multiple of 4; it must fit: ``state.can_fit``).
        busy_us: the side stream's work before it touches the tensor.

    Returns:
        An :class:`EarlyReleaseReport`.
    """
    backend, state = ladder.backend, ladder.state
    if backend.name != "sim":
        raise ValueError("early_release_hazard reads the simulated device's clocks and graph write ranges; "
                         "pass a ladder captured on get_backend('sim')")
    if nbytes <= 0 or nbytes % 4 or not state.can_fit(nbytes):
        raise ValueError(f"nbytes={nbytes} must be a positive multiple of 4 that state.can_fit accepts")
    main, side = backend.current_stream(), backend.Stream()
    with state.borrow("early release demo"):
        t = torch.ones(nbytes // 4, device=backend.device)
        backend.sleep(side, busy_us)
        side.wait_stream(main)
        with backend.stream(side):
            t.mul_(2)
        backend.record_stream(t, side)
        del t
    segments = backend.memory_snapshot(backend.pool_id(state.mem_pool))
    pending = [(b["address"], b["size"]) for seg in segments for b in seg["blocks"]
               if b["state"] == "active_pending_free"]
    writers = [key for key, graph in ladder.graphs.items() if overlap_bytes(pending, graph.written_ranges())]
    overwritten = overlap_bytes(pending, merged_writes(ladder.graphs.values()))
    busy = max(0.0, side.queued_until - side.clock)
    state.retire()
    return EarlyReleaseReport(pending, overwritten, busy, writers)


def timeline_lanes(busy_us: float) -> tuple[dict, list]:
    """The deferred free of notebook 03 as lanes for :func:`graphborrow.studies.plots.stream_timeline`,
    in milliseconds from the moment the main stream wrote the borrowed tensor.

    Args:
        busy_us: how long the side stream was busy before it used the tensor.

    Returns:
        ``(lanes, marks)``: what the main stream, the side stream and the tensor's block do, and
        the moments Python dropped the tensor and the side stream's event completed.
    """
    busy = busy_us / 1000
    tick = busy * 0.03  # the short kernels, drawn visibly
    lanes = {
        "main stream": [(0.0, tick, "write t")],
        "side stream": [(0.0, busy, "busy (other work)"), (busy, busy + tick, "t.mul_")],
        "t's block": [(0.0, busy + tick, "active_pending_free"), (busy + tick, busy * 1.25, "inactive")],
    }
    marks = [(tick, "del t"), (busy + tick, "event completes: retire() may release")]
    return lanes, marks
