"""What a borrow pool retired without synchronising would hand back too early.

A borrowed tensor used on a second stream and dropped after ``record_stream`` stays
``active_pending_free`` until that stream's event completes. :meth:`BorrowState.retire`
therefore synchronises and drains those frees before the extents go back to the graph pool.
:func:`deferred_free_lanes` draws what notebook 03 measured with ``torch.cuda.Event`` s and
snapshots (on a GPU or the simulated device alike). :func:`early_release_hazard` shows, on the
simulated device, what skipping the synchronise would do: which pending bytes the next replay
of the ladder writes, and for how long the side stream still uses them. It reads the streams'
clocks and the captured graphs' write ranges, which only the simulated device exposes;
:func:`early_release_on_sim` captures the notebook's ladder on a layout-only simulated device
of its own for it, whatever device the notebook runs on.
"""

from __future__ import annotations

import dataclasses

import torch

from .writes import merged_writes, overlap_bytes

__all__ = ["EarlyReleaseReport", "early_release_hazard", "early_release_on_sim", "deferred_free_lanes"]


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


def early_release_on_sim(setup, nbytes_of, busy_us: float, seed: int = 0) -> EarlyReleaseReport:
    """:func:`early_release_hazard` for the notebook's shapes, on a layout-only simulated device of its own.

    Args:
        setup: the notebook's :class:`~graphborrow.studies.presets.Setup` (shapes and dtype).
        nbytes_of: the tensor's size for a borrow state (the largest the pool can lend, say).
        busy_us: the side stream's work before it touches the tensor.
        seed: seed of the ladder's random weights.
    """
    from graphborrow.device import get_backend
    from graphborrow.workloads.ladder import borrowable_ladder

    from .notebook import capture_ladder

    sim = get_backend("sim", backed=False, activate=False)
    try:
        with sim.activated():
            ladder, _ = borrowable_ladder(capture_ladder(setup, seed=seed, device=sim))
            return early_release_hazard(ladder, nbytes_of(ladder.state), busy_us=busy_us)
    finally:
        sim.close()


def deferred_free_lanes(ms: dict) -> tuple[dict, list]:
    """The measured deferred free of notebook 03 as lanes for
    :func:`graphborrow.studies.plots.stream_timeline`.

    Args:
        ms: milliseconds since the main stream wrote the borrowed tensor (``torch.cuda.Event``
            times): ``side_busy`` (the side stream's other work ended), ``side_used`` (its use of
            the tensor ended), ``main_busy`` (the main stream's own work ended) and ``dropped``
            (where the main stream was when Python dropped the tensor).

    Returns:
        ``(lanes, marks)``: what each stream and the tensor's block did, and the moments Python
        dropped the tensor and the side stream's event completed. The block is
        ``active_allocated`` until the drop, ``active_pending_free`` from the drop until the side
        stream's use has completed, ``inactive`` after.

    Raises:
        ValueError: a time is missing, or the order is impossible (a drop before the write,
            the use before the side stream's other work).
    """
    needed = ("side_busy", "side_used", "main_busy", "dropped")
    missing = [k for k in needed if k not in ms]
    if missing:
        raise ValueError(f"deferred_free_lanes needs the times {list(needed)}; missing {missing}")
    busy, used, main, dropped = (float(ms[k]) for k in needed)
    if not 0 <= dropped or not busy <= used:
        raise ValueError(f"the measured times are out of order: {ms}")
    tail = max(used * 0.2, 1e-3)
    lanes = {
        "main stream": [(0.0, main, "other work")],
        "side stream": [(0.0, busy, "busy (other work)"), (busy, used, "t.mul_")],
        "t's block": [(0.0, dropped, "active_allocated"), (dropped, used, "active_pending_free"),
                      (used, used + tail, "inactive")],
    }
    marks = [(dropped, "del t"), (used, "side stream's event completes")]
    return lanes, marks
