"""Replay a recorded allocator trace on the simulated allocator and measure agreement.

Input is what ``torch.cuda.memory._snapshot()`` returns after
``torch.cuda.memory._record_memory_history()`` (a dict, or a pickle of it, gzipped or not):
its device trace, final segments and ``allocator_settings`` (the settings that were in
force; they configure the simulated allocator). The trace is driven, operation by
operation, into a fresh :class:`~graphborrow.allocator.caching.CachingAllocator` whose memory is told the addresses the
trace recorded, and the entries the simulated allocator writes are compared with the
recorded ones: the block each allocation got, every segment allocated, mapped, released
or unmapped (also inside an allocation: garbage collection, oversize releases, the
out-of-memory retry), cross-stream frees that stay pending until the trace completes
them, and out-of-memory failures. After the last entry the simulated segments and blocks
are compared with the snapshot's, so a trace that stops early (or contradicts its
snapshot) never replays at 1.0, and a trace with nothing to check reports no agreement at all
(None, with the reason).

What the trace does not say is decided by consistency with what it does say, and
reported (:attr:`ReplayReport.inferred`):

- **Pools.** A segment alive at the end has its pool in the snapshot. Any other new
  segment (or expandable reservation) goes to a pool that, at that moment, had no cached
  block for the request: the pool of the previous allocation, the default pool, a recent
  private pool, or a new one, in that order. A choice that later evidence contradicts (the
  simulated allocator picks a block of that segment where the real one did not, or an
  ``empty_cache`` releases it where the real one did not) is refuted, and the trace is
  replayed again without it.
- **Releases.** A run of ``segment_free`` / ``segment_unmap`` entries is part of the next
  allocation when that allocation could not have got device memory without it (memory
  fraction, garbage collection); otherwise it is an ``empty_cache``, of one pool when it
  releases only that pool's segments while others were releasable (a MemPool going away).
- **Mid-run traces** (history enabled late, or a ring buffer that wrapped): the state at the
  first entry is rebuilt (:mod:`.prestate`) from the snapshot and the trace (segments released
  or unmapped without being allocated, blocks freed without being allocated, blocks alive in
  the snapshot that the trace never allocated) and restored into the allocator; expandable
  memory as the ranges mapped at the first entry (the snapshot's, less what the trace mapped,
  plus what it unmapped), one reservation per stream, kind and pool, each starting at its
  lowest range or, below a rebuilt reservation, where the driver's end-to-end layout puts it
  (``RESERVATION_ALIGNMENT``). The plan follows those same reservations through the trace: one
  ends when all its pages are unmapped, and a later one at its address is a new one, with the
  snapshot's pool. A segment off cudaMalloc's 2 MiB grid, or inside another segment or a
  reservation, is a pluggable pool's (a MemPool over an arena) and is rebuilt as that pool's
  memory. A block freed without being allocated has the size of its request (exact when the
  allocator split the block it came from); when the trace places the next block further on,
  in the free space after it, that is where it ends (:class:`~.checking_pass.Learned`), and
  the start is rebuilt with it.
  Where the evidence cannot decide, checks are not made but counted with their reason
  (:attr:`ReplayReport.unverifiable_reasons`): a placement in, or by the model, the free space
  right after a block whose size is still a guess; memory from before the trace that could
  not be rebuilt (expandable ranges that fit no set of reservations; at the end a mapped range
  with a page the trace did not map); memory that went another way than the trace at such a
  check (from then on: memory one side placed, kept or gave back and the other did not); a
  decision of the memory fraction's cap (out of memory, the retry's releases, garbage
  collection) while the model holds other device memory than the trace says. Every other
  check is made, so a contradiction (a trace cut short, a snapshot of another moment, segments
  from before the trace that overlap, a reservation over other memory, a segment the trace
  released or made in memory the snapshot shows alive throughout) is a mismatch, and the
  trace does not replay at 1.0. A trace that starts at an empty allocator has no
  unverifiable check; ``starts_empty=True`` says so when the snapshot cannot (one pool's).
- **Failed releases.** ``segment_free`` is written before ``cudaFree`` is called; when that
  fails (a free inside a graph capture invalidates the capture) the allocator raises and
  the segment stays. After the trace's last allocation of device memory, a release whose
  segment (address, size, stream) the snapshot still shows is taken as that: the segment
  stays, ``num_device_free`` counts it, and the end compares it.

Statistics: for a trace that starts at an empty allocator and carries the real
``memory_stats()`` (the differential corpus does), every statistic is compared too
(:attr:`ReplayReport.stats_mismatches`), except ``num_sync_all_streams``: an
``empty_cache`` that releases nothing leaves no trace entry.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from graphborrow.allocator.blocks import DEFAULT_POOL, pool_tuple
from graphborrow.allocator.config import AllocatorConfig
from graphborrow.core.errors import SnapshotFormatError
from graphborrow.core.snapshot import load_snapshot

from .checking_pass import CheckingPass, Learned, Refuted
from .layout_pass import LayoutPass
from .passes import TraceInput
from .pool_inference import PoolEvidence, infer_pools
from .report import ReplayReport

__all__ = ["DEVICE_MEMORY", "ReplayReport", "load_trace", "replay_trace"]

# totalGlobalMem of devices the recorded traces come from: it sizes expandable segments' virtual
# ranges and, with a memory fraction, the allowed maximum. For the H200 the corpus pins it: the
# driver lays expandable segments' reservations end to end, 9/8 of the memory rounded up to 2 MiB
# apart, which leaves (150113208094, 150115072228]; 143160 MiB is the one whole MiB in it, and every
# allocation made under a memory fraction fits it (tests/fidelity/test_sim_corpus.py recomputes both).
DEVICE_MEMORY = {"NVIDIA H200": 143_160 * 2**20}
_UNKNOWN_DEVICE_MEMORY = 80 * 2**30
_MAX_REPLAYS = 120
_MAX_LEARNED = 64  # lessons a trace may teach (block sizes) before its replay stops learning
# statistics a trace does not determine: an empty_cache that releases nothing leaves no entry
# (num_sync_all_streams), and an allocation that fails with nothing releasable looks the same
# whether it was routed to a private pool or retried after emptying the cache (num_alloc_retries)
_UNOBSERVABLE_STATS = ("num_sync_all_streams", "num_alloc_retries")


def load_trace(source: Any) -> dict:
    """A ``_snapshot()`` dict with a device trace, from a dict or a path to its pickle (``.gz`` or not).

    Read and checked by :func:`graphborrow.core.snapshot.load_snapshot`, the one reader of
    snapshots: every segment, block and trace entry is checked before the replay trusts it
    (blocks may omit their addresses: the replay reads them from the sizes).
    An empty trace is accepted here; the replay then reports that it made no check.

    Args:
        source: a ``_snapshot()`` dict, or a path to its pickle.

    Returns:
        The checked snapshot dict, with ``"segments"`` and ``"device_traces"``.

    Raises:
        SnapshotFormatError: the source is malformed or has no ``"device_traces"``.
        FileNotFoundError: the path does not exist.
    """
    snapshot = load_snapshot(source, block_addresses=False)
    if "device_traces" not in snapshot:
        raise SnapshotFormatError(
            "expected the dict written by torch.cuda.memory._snapshot() (keys 'segments' and "
            "'device_traces'); record it after torch.cuda.memory._record_memory_history()"
        )
    return snapshot


def replay_trace(snapshot: Any, device: int | None = None, *, memory_fraction: float | None = None,
                 device_memory: int | None = None, torch_version: str | None = None,
                 snapshot_pools: Any = None, starts_empty: bool = False) -> ReplayReport:
    """Replay ``snapshot``'s device trace on a fresh simulated allocator; see the module docstring.

    Args:
        snapshot: a ``_snapshot()`` dict, or a path to its pickle (``.pickle`` or ``.pickle.gz``).
        device: which device's trace (default: the only one with entries).
        memory_fraction: the ``set_per_process_memory_fraction`` the program ran with.
        device_memory: the device's total memory in bytes (known devices are looked up).
        torch_version: the torch that recorded it (its parsing rules for the settings string).
            The three default to a ``corpus`` record in the snapshot, as the differential
            corpus stores one (``fraction``, ``torch``, and ``device_memory`` or ``device``, a
            name looked up in :data:`DEVICE_MEMORY`); the recorded ``allocator_settings``
            always decide the settings.
        snapshot_pools: the pool ids (``(a, b)`` pairs) whose segments the snapshot holds, when
            it was taken of some pools only (``MemPool.snapshot()``, a graph pool's segments):
            at the end, simulated segments of other pools are not compared with it. Default:
            the snapshot holds every segment of the device.
        starts_empty: the trace begins at an empty allocator (history was enabled before the
            first allocation and the ring buffer never filled): memory it uses without making it
            is then a contradiction, each piece a mismatch. Default: it may begin mid-run, and
            what existed before its first entry is rebuilt.

    Returns:
        :class:`ReplayReport`.

    Raises:
        SnapshotFormatError: the snapshot or its trace is malformed.
        ValueError: ``device`` or ``snapshot_pools`` does not fit the snapshot, or ``device_memory`` is
            not a positive number of bytes.
    """
    snapshot = load_trace(snapshot)
    trace = _trace_input(snapshot, device, memory_fraction, device_memory, torch_version, snapshot_pools)
    if starts_empty:
        trace = dataclasses.replace(trace, starts_empty=True)
    checking, refuted = _replay_learning(trace)
    checks = checking.checks
    report = ReplayReport(
        agreement=None if checks == 0 else 1.0 - len(checking.mismatches) / checks, mismatches=checking.mismatches,
        events=len(trace.entries), checks=checks, unverifiable=checking.unverifiable,
        unverifiable_reasons=dict(checking.unverifiable_reasons), mid_run=checking.plan.mid_run,
        inferred=dict(checking.decisions), refuted=len(refuted),
    )
    for address, size in sorted(checking.trace.learned.items()):  # block sizes the trace taught
        least = "at least " if address in checking.trace.bounds else ""
        report.inferred[f"block at {address:#x}"] = f"{least}{size} B, from where the trace placed the next block"
    if checks == 0:
        report.unchecked = _why_nothing_was_checked(trace.entries, checking.unverifiable)
    recorded_stats = snapshot.get("memory_stats")
    if recorded_stats and not checking.plan.mid_run and trace.entries:
        _compare_stats(report, recorded_stats, checking.sim.memory_stats())
    return report


def _trace_input(snapshot: dict, device: int | None, memory_fraction: float | None, device_memory: int | None,
                 torch_version: str | None, snapshot_pools: Any) -> TraceInput:
    """The entries of one device's trace, its final segments and the recording's settings, checked."""
    pools = None
    if snapshot_pools is not None:
        given = [tuple(p) if isinstance(p, (tuple, list)) else p for p in snapshot_pools]
        if not given or any(not isinstance(p, tuple) or len(p) != 2 or not all(isinstance(v, int) for v in p)
                            for p in given):
            raise ValueError(f"snapshot_pools must be pool ids, (int, int) pairs such as (0, 1); got {snapshot_pools!r}")
        pools = frozenset(pool_tuple(p) for p in given)
    traces = snapshot["device_traces"]
    if device is not None and (isinstance(device, bool) or not isinstance(device, int) or device < 0):
        raise ValueError(f"device={device!r}: pass the index of a device the snapshot has a trace for "
                         f"(0 to {max(len(traces) - 1, 0)}), or None for the only one with entries")
    if device is None:
        busy = [d for d, trace in enumerate(traces) if trace]
        if len(busy) > 1:
            raise ValueError(f"the snapshot has traces for devices {busy}; pass device= to choose one")
        device = busy[0] if busy else 0
    if device >= max(len(traces), 1):
        raise ValueError(f"the snapshot has traces for {len(traces)} device(s); device {device} is not among them")
    entries = list(traces[device]) if traces else []
    final = [s for s in snapshot["segments"] if s.get("device", 0) == device]
    meta = snapshot.get("corpus") or {}
    if memory_fraction is None:
        memory_fraction = meta.get("fraction")
    if torch_version is None:
        torch_version = meta.get("torch")
    if device_memory is not None and (isinstance(device_memory, bool) or not isinstance(device_memory, int)
                                      or device_memory <= 0):
        raise ValueError(f"device_memory={device_memory!r}: pass the device's total memory as a positive whole "
                         "number of bytes (torch.cuda.get_device_properties(0).total_memory), or None to look it up")
    if device_memory is None:
        device_memory = meta.get("device_memory") or DEVICE_MEMORY.get(meta.get("device"), _UNKNOWN_DEVICE_MEMORY)
    config = AllocatorConfig.from_settings(snapshot.get("allocator_settings") or {}, torch_version or "2.11")
    if pools is not None:
        outside = sorted({pool_tuple(s.get("segment_pool_id", DEFAULT_POOL)) for s in final} - pools)
        if outside:
            raise ValueError(f"the snapshot holds segments of pools {outside}, which snapshot_pools={sorted(pools)} "
                             f"leaves out; pass every pool the snapshot was taken of")
    return TraceInput(entries, final, config, device_memory, memory_fraction, pools)


def _replay_learning(trace: TraceInput) -> tuple[CheckingPass, set]:
    """The layout pass, then checking passes; again from the start whenever the trace teaches the size
    of a block from before it (:class:`~graphborrow.fidelity.checking_pass.Learned`)."""
    learned: dict[int, int] = {}
    bounds: set[int] = set()
    learning = True
    for lessons in range(_MAX_LEARNED + 1):
        trace = dataclasses.replace(trace, learned=dict(learned), bounds=frozenset(bounds))
        layout = LayoutPass(trace)
        layout.run()
        try:
            return _check_with_refutations(trace, layout.result(), learning=learning and lessons < _MAX_LEARNED)
        except Learned as lesson:
            if learned.get(lesson.address) == lesson.size:  # the same lesson again: it explained nothing
                learning = False
                continue
            learned[lesson.address] = lesson.size
            if lesson.exact:
                bounds.discard(lesson.address)
            else:
                bounds.add(lesson.address)


def _check_with_refutations(trace: TraceInput, evidence: PoolEvidence, learning: bool = True) -> tuple[CheckingPass, set]:
    """Replay with inferred pools until no choice is refuted (each refutation: infer again, replay again).

    Out of patience (the same choice refuted twice, or ``_MAX_REPLAYS``), the last replay is
    made without refuting and reported as it stands.
    """
    refuted: set = set()
    for _ in range(_MAX_REPLAYS):
        checking = CheckingPass(trace, infer_pools(evidence, refuted), evidence, refuted, learning=learning)
        try:
            checking.run()
        except Refuted as refutation:
            if refutation.decision in refuted:
                break  # the same choice again: another replay would be the same one
            refuted.add(refutation.decision)
            continue
        return checking, refuted
    checking = CheckingPass(trace, infer_pools(evidence, refuted), evidence, refuted, blaming=False, learning=False)
    checking.run()
    return checking, refuted


def _why_nothing_was_checked(entries: list[dict], unverifiable: int) -> str:
    if not entries:
        return "no check could be made: the trace has no entries"
    if unverifiable:
        return (f"no check could be made: the {unverifiable} checks its {len(entries)} entries allow all rest on "
                "state from before the trace that it does not show")
    return (f"no check could be made: its {len(entries)} entries change no allocator state "
            f"({', '.join(sorted({str(e.get('action')) for e in entries}))})")


def _compare_stats(report: ReplayReport, recorded: dict, simulated: dict) -> None:
    """Every statistic the trace determines, recorded against simulated (a trace from an empty allocator)."""
    for key in sorted(recorded):
        if key in _UNOBSERVABLE_STATS or key not in simulated:
            continue
        report.stats_checked += 1
        if simulated[key] != recorded[key]:
            report.stats_mismatches.append(f"memory_stats {key}: recorded {recorded[key]}, simulated {simulated[key]}")
