"""Run a program on the simulated device, and compare its recording with the GPU's.

:func:`simulate_program` runs the source a GPU ran (:mod:`.record`) on a fresh simulated
device, through the same ``torch.cuda`` calls (:func:`graphborrow.sim.cuda_api.simulated_cuda`
answers them), and records it the same way. :func:`compare_program` puts the two
recordings side by side: pools block for block, traces event for event, and the error.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Optional

import torch

from graphborrow.fidelity.compare import Comparison, compare_snapshots, expand_trace
from graphborrow.sim import SimBackend
from graphborrow.sim.cuda_api import simulated_cuda

from .generate import Program
from .record import execute, make_recording, start_history

__all__ = ["ProgramComparison", "compare_program", "gpu_addresses", "gpu_streams", "simulate_program"]

_ALLOC_ACTIONS = ("segment_alloc", "alloc", "free_completed", "segment_free", "free_requested")
NOTHING_COMPARED = "nothing to compare (no block, no trace event and no error on either side)"


def simulate_program(program: Program, addresses: Optional[list] = None, backed: bool = False,
                     capacity: Optional[int] = None, streams: Optional[list] = None) -> dict:
    """Run ``program`` on a fresh simulated device and record it as
    :func:`~graphborrow.fidelity.fuzz.record.record_here` does.

    Args:
        program: the program.
        addresses: ``(bytes, address)`` of the GPU's cudaMallocs in order
            (:func:`graphborrow.studies.model_pools.segment_addresses` of its recording), so equal
            free blocks are told apart as on the GPU; None for the simulator's own.
        backed: run with real bytes behind every segment (default: layout only).
        capacity: device memory in bytes (default: SimBackend's).
        streams: the GPU's stream handles in the order each first allocated
            (:func:`gpu_streams` of its recording), so free blocks of different streams are
            released in the GPU's order; None for the simulator's own.

    Returns:
        The recording.
    """
    kwargs = {} if capacity is None else {"capacity": capacity}
    backend = SimBackend(backed=backed, config=program.settings or None, activate=False, **kwargs)
    try:
        if addresses:
            backend.memory.follow_addresses(addresses)
        if streams:
            backend.allocator.follow_streams(streams)
        namespace: dict = {}
        with simulated_cuda(backend):
            start_history(torch.cuda)
            try:
                error = execute(program, namespace)
                snapshot = torch.cuda.memory._snapshot()
            finally:
                namespace.clear()
        return make_recording(program, snapshot, error, backend.describe())
    finally:
        backend.close()


def gpu_addresses(rec: dict) -> list[tuple[int, int]]:
    """``(bytes, address)`` of every cudaMalloc in a recording's trace, in order."""
    return [(int(row[2]), int(row[1])) for row in rec.get("trace", ()) if row[0] == "segment_alloc"]


def gpu_streams(rec: dict) -> list[int]:
    """The stream handles of a recording's trace, in the order each first appears."""
    seen: dict[int, None] = {}
    for row in rec.get("trace", ()):
        if row[0] in _ALLOC_ACTIONS[:4]:
            seen.setdefault(int(row[3]), None)
    return list(seen)


@dataclasses.dataclass
class ProgramComparison:
    """A program on the GPU against the simulator: pools, traces, errors."""

    name: str
    pools: Comparison
    errors: tuple  # (gpu error, simulated error), None for a run to the end
    first_difference: str

    @property
    def errors_agree(self) -> bool:
        gpu, sim = self.errors
        if gpu is None or sim is None:
            return gpu is sim
        return (gpu["type"], gpu["message"], gpu["line"]) == (sim["type"], sim["message"], sim["line"])

    @property
    def compared(self) -> bool:
        """Whether there was anything to compare: a block or a trace event on either side, or an error."""
        return self.pools.compared or any(self.pools.trace_events[:2]) or self.errors != (None, None)

    @property
    def agrees(self) -> bool | None:
        """Every block identical, every trace event aligned, the same error (or none) at the same line;
        None when there was nothing to compare (no block, no trace event and no error on either side)."""
        if not self.compared:
            return None
        ref, cand, aligned = self.pools.trace_events
        return self.pools.identical and ref == cand == aligned and self.errors_agree

    def summary(self) -> str:
        verdict = {True: "agrees", False: "DIFFERS", None: NOTHING_COMPARED}[self.agrees]
        lines = [f"{self.name}: {verdict}", self.pools.summary()]
        if not self.errors_agree:
            lines.append(f"errors: GPU {self.errors[0]} / simulated {self.errors[1]}")
        if self.first_difference:
            lines.append(f"first difference: {self.first_difference}")
        return "\n".join(lines)


def _first_trace_difference(gpu: dict, sim: dict) -> str:
    """The first event one side has and the other has not, with the program line of each."""
    def keyed(rec):
        rows = [r for r in rec.get("trace", ()) if r[0] in _ALLOC_ACTIONS[:4]]
        lines = [ln for r, ln in zip((r for r in rec.get("trace", ()) if r[0] in _ALLOC_ACTIONS), rec["lines"])
                 if r[0] in _ALLOC_ACTIONS[:4]]
        streams: dict = {}
        for r in rows:
            streams.setdefault(r[3], len(streams))
        return [(r[0], r[2], streams[r[3]]) for r in rows], lines

    a, la = keyed(gpu)
    b, lb = keyed(sim)
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag != "equal":
            left = f"GPU {a[i1]} at line {la[i1]}" if i1 < i2 else "GPU nothing"
            right = f"simulated {b[j1]} at line {lb[j1]}" if j1 < j2 else "simulated nothing"
            return f"event {i1}: {left}; {right}"
    return ""


def compare_program(gpu: dict, sim: dict) -> ProgramComparison:
    """Compare a GPU recording with the simulated recording of the same program.

    Args:
        gpu: the recording :func:`~graphborrow.fidelity.fuzz.record.record_here` made on the GPU.
        sim: the recording :func:`simulate_program` made.

    Returns:
        A :class:`ProgramComparison`.
    """
    sizes = {32 * 2**20, 2**20}
    pools = compare_snapshots(gpu["segments"], sim["segments"],
                              expand_trace(gpu.get("trace", ()), gpu.get("sites", ())),
                              expand_trace(sim.get("trace", ()), sim.get("sites", ())), workspace_sizes=sizes)
    return ProgramComparison(gpu["name"], pools, (gpu.get("error"), sim.get("error")),
                             _first_trace_difference(gpu, sim))
