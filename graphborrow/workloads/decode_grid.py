"""The decode loop over a grid of batches and verification modes, all in one process.

:func:`run_grid` builds one :class:`~graphborrow.workloads.decode.DecodeLoop` (one draft-tree
size), captures its ladder, and runs every (batch, mode) point: a *memory pass* (memory read
after every step, ``max_memory_reserved`` from a fresh peak) and then timed repeats. The
device's cache is emptied before every point, so each starts from what an engine holds
between steps (weights, KV caches, the graph pool). A point that cannot run is recorded with
its reason and the others go on: ``"does_not_fit"`` when the capacity planner refuses a
borrowing mode before any work, ``"failed"`` for any other error.

The same function predicts a GPU's grid on a layout-only simulated device
(:func:`predict_grid`): the device takes the recording's measured facts (cuBLAS workspaces,
the attention backend per call, the driver's segment addresses) and each point runs the
number of steps the GPU ran (a layout-only device cannot read what was accepted).
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
import traceback
from typing import Callable, ContextManager, Optional, Sequence

import torch

from graphborrow.core.errors import BorrowCapacityError, ParameterError

from .decode import MODES, DecodeLoop

__all__ = ["GridSpec", "History", "LAST_MODES", "NOT_SIMULATED", "SIM_MODES", "driver_segments", "predict_grid",
           "run_grid", "sim_backend_for"]

# what a layout-only simulated device can run: the fused kernels need a GPU, and upstream's
# reference kernel checks its probabilities' values, which a layout-only device does not have
SIM_MODES = tuple(m for m in MODES if m not in ("fused", "upstream"))
# modes that leave state behind (the fused kernels' compiled plans and workspaces) run after every other point
LAST_MODES = ("fused",)
NOT_SIMULATED = {
    "fused": "the Triton kernels run on a GPU only",
    "upstream": "the reference kernel reads its probabilities' values to check them; a layout-only device has none",
}


@dataclasses.dataclass(frozen=True)
class GridSpec:
    """One process's grid: the loop's shapes and the points to run."""

    draft_tokens: int = 8
    batches: tuple = (1, 8, 32, 64)
    modes: tuple = MODES
    new_tokens: int = 32
    prompt_tokens: int = 32
    agreement: float = 0.9
    temperature: float = 1.0
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    repeats: int = 3
    layers: int = 2
    model: str = "llama-3-8b"
    hidden: Optional[int] = None
    intermediate: Optional[int] = None
    vocab: Optional[int] = None
    dtype: str = "bfloat16"
    seed: int = 0

    def __post_init__(self):
        unknown = [m for m in self.modes if m not in MODES]
        if unknown:
            raise ParameterError(f"unknown modes {unknown}; choose from {MODES}")
        if isinstance(self.repeats, bool) or not isinstance(self.repeats, int) or self.repeats < 0:
            raise ParameterError(f"repeats must be an integer >= 0, got {self.repeats!r}")

    def loop(self, backend) -> DecodeLoop:
        """The loop (not yet captured): the ladder is the grid's batches."""
        return DecodeLoop(backend, self.model, layers=self.layers, hidden=self.hidden, intermediate=self.intermediate,
                          vocab=self.vocab, batches=self.batches, draft_tokens=self.draft_tokens,
                          prompt_tokens=self.prompt_tokens, max_new_tokens=self.new_tokens, agreement=self.agreement,
                          dtype=getattr(torch, self.dtype), seed=self.seed)

    def params(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def of(cls, params: dict) -> "GridSpec":
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in params.items()})


class History:
    """The allocator trace a recording keeps: every event of building and capturing the loop
    (frames cut to the innermost :data:`FRAMES`), then only the segment allocations and releases
    of each memory pass (the driver's addresses, which the simulated device follows). Timed runs
    are not recorded. Turning torch's history off clears its buffer, so each stretch's events are
    taken out first. Start it before the loop is built."""

    FRAMES = 12
    SEGMENT_EVENTS = ("segment_alloc", "segment_free")

    def __init__(self, backend):
        self.backend, self.cuda, self.entries, self._everything = backend, backend.name == "cuda", [], True
        self._on()

    def _on(self) -> None:
        if self.cuda:  # stacks only where they are kept: building and capture
            torch.cuda.memory._record_memory_history("all", context="all" if self._everything else None,
                                                     stacks="python", max_entries=2_000_000)
        else:
            self.backend.record_memory_history(True)

    def _off(self) -> None:
        full = torch.cuda.memory._snapshot() if self.cuda else self.backend.full_snapshot()
        for e in full["device_traces"][0]:
            if self._everything or e.get("action") in self.SEGMENT_EVENTS:
                self.entries.append(dict(e, frames=e.get("frames", [])[:self.FRAMES]))
        if self.cuda:
            torch.cuda.memory._record_memory_history(None)
        else:
            self.backend.record_memory_history(False)

    def captured(self) -> None:
        """Building and capture are over: from here, memory passes only."""
        self._off()
        self._everything = False

    @contextlib.contextmanager
    def memory_pass(self):
        self._on()
        try:
            yield
        finally:
            self._off()


def run_grid(backend, spec: GridSpec, *, steps: Optional[dict] = None, history: Optional[History] = None,
             log: Callable[[str], None] = lambda line: None) -> dict:
    """Build, capture and run every point of ``spec`` on ``backend``.

    Args:
        backend: the device.
        spec: the grid.
        steps: ``{(batch, mode): n}`` steps to run at a point (a layout-only device must be
            told); None runs each until its requests are done.
        history: the :class:`History` started before this call, if the run is recorded.
        log: called with one line per point.

    Returns:
        ``{"loop": describe(), "kv_bytes_per_token", "graph_pool_segments", "graph_pool_bytes",
        "capture_seconds", "points": [row, ...]}``; rows in :func:`_point`'s form, each with its
        saving against ``plain`` at the same batch when both ran.
    """
    t0 = time.perf_counter()
    loop = spec.loop(backend).capture()
    memory_pass = contextlib.nullcontext
    if history is not None:
        history.captured()
        memory_pass = history.memory_pass
    out = {"loop": loop.describe(), "kv_bytes_per_token": loop.kv_bytes_per_token,
           "graph_pool_segments": loop.snapshot(), "capture_seconds": round(time.perf_counter() - t0, 2),
           "free_runs": [n for _, n in loop.state.free_runs()], "points": []}
    out["graph_pool_bytes"] = sum(s["total_size"] for s in out["graph_pool_segments"])
    order = [(b, m) for b in spec.batches for m in spec.modes if m not in LAST_MODES]
    order += [(b, m) for b in spec.batches for m in spec.modes if m in LAST_MODES]
    for batch, mode in order:
        n = None if steps is None else steps.get((batch, mode))
        if steps is not None and n is None:
            continue  # not run where the grid is replayed
        row = _point(loop, spec, batch, mode, n, memory_pass)
        out["points"].append(row)
        log(_line(row))
    for batch in spec.batches:
        _savings([r for r in out["points"] if r["batch"] == batch], loop.kv_bytes_per_token)
    del loop
    backend.synchronize()
    return out


def _point(loop: DecodeLoop, spec: GridSpec, batch: int, mode: str, steps: Optional[int],
           memory_pass: Callable[[], ContextManager]) -> dict:
    """One point: a memory pass, then ``spec.repeats`` timed runs; a failure is recorded, not raised."""
    b = loop.backend
    row = {"batch": batch, "draft_tokens": loop.draft_tokens, "mode": mode, "status": "ok"}
    kwargs = dict(new_tokens=spec.new_tokens, temperature=spec.temperature, top_k=spec.top_k, top_p=spec.top_p,
                  seed=spec.seed, steps=steps)
    try:
        b.empty_cache()
        with memory_pass():
            result = loop.run(batch, mode, **kwargs)
        row.update(result.row())
        row["accept_lengths"], row["memory"] = result.accept_lengths, result.memory
        row["tokens"] = result.tokens
        peaks = [m["peak"] for m in result.memory]
        row["peak_step"] = 1 + peaks.index(result.peak_reserved) if result.peak_reserved in peaks else result.steps
        seconds = [loop.run(batch, mode, record_memory=False, **kwargs).seconds for _ in range(spec.repeats)]
        row["seconds_repeats"] = [round(s, 5) for s in seconds]
        if seconds:
            row["seconds_median"] = statistics.median(seconds)
            row["tokens_per_second_median"] = batch * spec.new_tokens / row["seconds_median"]
    except BorrowCapacityError as e:
        row.update(status="does_not_fit", error=str(e))
    except Exception as e:  # a failing point is recorded; the others finish
        row.update(status="failed", error="".join(traceback.format_exception_only(type(e), e)).strip())
        with contextlib.suppress(Exception):
            loop.state.retire()
    finally:
        b.synchronize()
        b.empty_cache()
    return row


def _savings(rows: list[dict], kv_bytes_per_token: int) -> None:
    """Each row's device memory saved against ``plain`` at the same batch, its KV tokens, its speed ratio."""
    plain = next((r for r in rows if r["mode"] == "plain" and r["status"] == "ok"), None)
    if plain is None:
        return
    for r in rows:
        if r["status"] != "ok":
            continue
        r["saved_bytes"] = plain["device_added"] - r["device_added"]
        r["saved_kv_tokens"] = r["saved_bytes"] // kv_bytes_per_token
        if "tokens_per_second_median" in r and "tokens_per_second_median" in plain:
            r["speed_vs_plain"] = r["tokens_per_second_median"] / plain["tokens_per_second_median"]
        if r.get("tokens") is not None and plain.get("tokens") is not None:
            r["same_tokens_as_plain"] = r["tokens"] == plain["tokens"]


def _line(row: dict) -> str:
    head = f"bs {row['batch']:3d} D {row['draft_tokens']} {row['mode']:9s}"
    if row["status"] != "ok":
        return f"{head} {row['status']}: {row['error'][:160]}"
    mib = 2 ** 20
    speed = row.get("tokens_per_second_median")
    accept = row.get("mean_accept_length")
    return (f"{head} {row['steps']:3d} steps, accept {accept if accept is None else round(accept, 2)}, "
            f"peak reserved {row['peak_reserved'] / mib:8.1f} MiB, device +{row['device_added'] / mib:7.1f} MiB, "
            f"borrowed {row['borrow_pool_bytes'] / mib:6.1f} MiB"
            + (f", {speed:8.1f} tok/s" if speed else ""))


def sim_backend_for(recording: dict):
    """A layout-only simulated device with a recording's measured facts (see
    :func:`graphborrow.studies.model_pools.simulate_recording`, which does the same for model pools)."""
    from graphborrow.sim import SimBackend
    from graphborrow.sim.attention import BACKENDS, AttentionModel

    attention = AttentionModel(recorded=tuple((c["call"], c["backend"]) for c in recording.get("sdpa_choices", ())
                                              if c.get("backend") in BACKENDS))
    mib = 2 ** 20
    backend = SimBackend(backed=False, blas_workspace=int(recording.get("blas_workspace_bytes") or 32 * mib),
                         blaslt_workspace=int(recording.get("blaslt_extra_bytes") or mib), attention=attention)
    addresses = driver_segments(recording.get("trace", ()))
    if addresses:
        backend.memory.follow_addresses(addresses)
    return backend


def driver_segments(trace) -> list[tuple[int, int]]:
    """``(bytes, address)`` of every cudaMalloc in a compact trace, in order: its segment
    allocations but those inside a live one (a borrow pool's segments, carved by the arena out
    of the graph pool's runs, are not the driver's)."""
    live: dict[int, int] = {}
    out = []
    for action, addr, size, *_ in trace:
        if action == "segment_alloc":
            if not any(start <= addr < end for start, end in live.items()):
                live[addr] = addr + size
                out.append((int(size), int(addr)))
        elif action == "segment_free":
            live.pop(addr, None)
    return out


def predict_grid(recording: dict, points: Optional[Sequence[tuple]] = None, to_peak: bool = False) -> dict:
    """Run a recorded grid again on a layout-only simulated device; :func:`run_grid`'s result,
    with ``trace_entries`` (its :class:`History`).

    Each point the recording ran (and the simulator can run: :data:`SIM_MODES`) runs the steps
    the GPU ran, or with ``to_peak`` the steps until the GPU's ``max_memory_reserved`` was
    reached (no later step raised it, and every point starts from an emptied cache);
    ``points`` (``(batch, mode)`` pairs) limits them further.
    """
    spec = GridSpec.of(dict(recording["params"], repeats=0))
    key = "peak_step" if to_peak else "steps"
    steps = {(r["batch"], r["mode"]): r[key] for r in recording["points"]
             if r["status"] == "ok" and r["mode"] in SIM_MODES
             and (points is None or (r["batch"], r["mode"]) in points)}
    backend = sim_backend_for(recording)
    try:
        with backend.activated():
            history = History(backend)
            out = run_grid(backend, spec, steps=steps, history=history)
            out["trace_entries"] = history.entries
            return out
    finally:
        backend.close()

