"""How the public entry points' work grows with their input: large snapshots, long traces, big batches.

Each entry point runs on inputs ten times apart; the table shows the CPU time (median of
``--repeats``) and the growth exponent, the slope of log(time) against log(size) fitted over
every size (1.0: linear, 2.0: quadratic; at the smallest sizes a fixed cost flattens it).
Inputs are synthetic but shaped like the real thing: snapshots of many segments with many
blocks each, some segments nested in another's free block (a borrow pool inside a graph
pool), one free block holding thousands of arena segments, allocator traces of bounded and
of growing pools, snapshots with several private pools (what ``python -m graphborrow
simulate`` reports on), verification steps that fit and steps no pool holds, static runs
next to many live blocks, sweep axes of many values, stored points.

    python benchmarks/scaling.py [--json data/scaling_cpu.json] [--repeats 3] [--scale 1.0] [--only NAME ...]

CPU only (no GPU needed); times are CPU seconds (``time.process_time``), the steadier
measure on a shared machine. Planned steps are recorded afresh at every size (the sequence
store is off, ``GRAPHBORROW_SEQUENCE_CACHE=0``): a first call's time. ``tests/test_scaling.py``
runs the same entry points on the same generators and holds their growth on a count of
executed lines, not on time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

import graphborrow
from graphborrow.allocator.caching import CachingAllocator
from graphborrow.allocator.memory import PhysicalMemory
from graphborrow.allocator.streams import Clockwork
from graphborrow.core.arena import BumpArena
from graphborrow.core.borrow import BorrowState
from graphborrow.core.runs import find_free_runs, summarize
from graphborrow.core.snapshot import load_snapshot, nested_in, read_snapshot_file
from graphborrow.eagle.plan import plan_verify
from graphborrow.eagle.sequence import PREPARE, ROWS
from graphborrow.fidelity.replay import replay_trace
from graphborrow.planning.stored import STORE_ENV
from graphborrow.run.sweep.grid import Grid
from graphborrow.run.sweep.points import PointStore, point_identity
from graphborrow.sim import SimBackend
from graphborrow.studies.inspection import format_report, inspect_snapshot

MiB = 1 << 20


def snapshot(segments: int, blocks: int = 8, nested_every: int = 4) -> list[dict]:
    """``segments`` graph-pool segments of ``blocks`` blocks (free and live in turn); every
    ``nested_every``-th one hosts a borrow-pool segment in its first free block."""
    out, at = [], 1 << 40
    for i in range(segments):
        sizes = [2 * MiB] * blocks
        states = ["active_allocated" if j % 2 else "inactive" for j in range(blocks)]
        seg_blocks, a = [], at
        for size, state in zip(sizes, states):
            seg_blocks.append({"address": a, "size": size, "state": state})
            a += size
        out.append({"address": at, "total_size": a - at, "stream": 0, "segment_pool_id": (0, 1),
                    "blocks": seg_blocks})
        if i % nested_every == 0:
            out.append({"address": at, "total_size": MiB, "stream": 0, "segment_pool_id": (0, 2),
                        "blocks": [{"address": at, "size": MiB, "state": "active_allocated"}]})
        at = a + 2 * MiB
    return out


def one_host(nested: int) -> list[dict]:
    """One segment of ``2 * nested`` blocks with a nested segment in each free block (the case
    that walked the host's blocks once per nested segment)."""
    blocks, at, base = [], 1 << 40, 1 << 40
    inner = []
    for j in range(2 * nested):
        state = "inactive" if j % 2 == 0 else "active_allocated"
        blocks.append({"address": at, "size": 2 * MiB, "state": state})
        if state == "inactive":
            inner.append({"address": at, "total_size": MiB, "segment_pool_id": (0, 2),
                          "blocks": [{"address": at, "size": MiB, "state": "active_allocated"}]})
        at += 2 * MiB
    return [{"address": base, "total_size": at - base, "segment_pool_id": (0, 1), "blocks": blocks}, *inner]


def one_free_block(nested: int) -> list[dict]:
    """One graph-pool segment whose single free block holds ``nested`` arena segments, 1 MiB apart
    (a borrow pool's MemPool carving one idle run)."""
    base = 1 << 40
    host = {"address": base, "total_size": 2 * nested * MiB, "segment_pool_id": (0, 1),
            "blocks": [{"address": base, "size": 2 * nested * MiB, "state": "inactive"}]}
    inner = [{"address": base + 2 * i * MiB, "total_size": MiB, "segment_pool_id": (0, 2),
              "blocks": [{"address": base + 2 * i * MiB, "size": MiB // 2, "state": "active_allocated"},
                         {"address": base + 2 * i * MiB + MiB // 2, "size": MiB // 2, "state": "inactive"}]}
             for i in range(nested)]
    return [host, *inner]


def churn_trace(steps: int, live: int = 48, seed: int = 0) -> dict:
    """``steps`` random allocations and frees on two streams with at most ``live`` tensors alive
    (the pool stays bounded while the trace grows), recorded by the allocator model."""
    clockwork = Clockwork()
    alloc = CachingAllocator(PhysicalMemory(backed=False), clockwork)
    alloc.record_history(True, max_entries=1 << 30)
    side = clockwork.new_stream()
    rng = random.Random(seed)
    blocks = []
    for _ in range(steps):
        if len(blocks) < live and (rng.random() < 0.5 or not blocks):
            size = rng.choice([rng.randrange(1, 8 << 10), rng.randrange(1, MiB), rng.randrange(MiB, 24 * MiB)])
            blocks.append(alloc.malloc(size, rng.choice([0, 0, side.id])))
        else:
            block = blocks.pop(rng.randrange(len(blocks)))
            if rng.random() < 0.2:
                side.enqueue(rng.random() * 4)
                alloc.record_stream(block, side.id if block.stream == 0 else 0)
            alloc.free(block)
            clockwork.advance(1.0)
    return alloc.full_snapshot()


def _graph_pool_block(alloc, nbytes: int) -> BumpArena:
    """A graph pool whose one segment is a free block of ``nbytes``, and an arena over it."""
    graph_pool = alloc.new_pool_id("handle")
    alloc.create_or_incref_pool(graph_pool)
    alloc.begin_allocate_to_pool(graph_pool, lambda s, t: True)
    alloc.free(alloc.malloc(nbytes, 0))
    alloc.end_allocate_to_pool(graph_pool)
    (host,) = alloc.snapshot(graph_pool)
    arena = BumpArena()
    arena.set_extents([(host["address"], host["total_size"])])
    return arena


def _arena_segments(alloc, arena: BumpArena, segments: int) -> list:
    """A MemPool over ``arena`` (left routing to it) holding ``segments`` 2 MiB small-pool segments, two
    1 MiB blocks each."""
    borrow = alloc.new_pool_id("mempool")
    alloc.create_or_incref_pool(borrow, allocator=arena)
    alloc.begin_allocate_to_pool(borrow, lambda s, t: True)
    return [alloc.malloc(MiB, 0) for _ in range(2 * segments)]


def kept_trace(segments: int) -> dict:
    """A trace that begins after a borrow pool's arena carved ``segments`` segments out of one free
    block of a graph pool: 32 allocations and frees in them, every segment kept to the end (what
    the replay rebuilds from the snapshot and checks the trace against)."""
    alloc = CachingAllocator(PhysicalMemory(capacity=1 << 50, backed=False), Clockwork())
    arena = _graph_pool_block(alloc, 2 * MiB * segments + 2 * MiB)
    for block in _arena_segments(alloc, arena, segments)[::2]:
        alloc.free(block)
    alloc.record_history(True, max_entries=1 << 30)  # the trace begins here
    for _ in range(32):
        alloc.free(alloc.malloc(512 << 10, 0))
    snapshot = alloc.full_snapshot()
    snapshot["_keep"] = arena
    return snapshot


def arena_trace(segments: int) -> dict:
    """A trace in which a borrow pool's arena carves ``segments`` segments out of one free block of
    a graph pool made before the trace began, and the graph pool's segment stays."""
    alloc = CachingAllocator(PhysicalMemory(capacity=1 << 50, backed=False), Clockwork())
    arena = _graph_pool_block(alloc, 2 * MiB * segments + 2 * MiB)
    alloc.record_history(True, max_entries=1 << 30)  # the trace begins here
    for block in _arena_segments(alloc, arena, segments)[::2]:
        alloc.free(block)
    snapshot = alloc.full_snapshot()
    snapshot["_keep"] = arena
    return snapshot


def replay(snapshot: dict):
    report = replay_trace({k: v for k, v in snapshot.items() if k != "_keep"})
    assert report.agreement == 1.0, report
    return report


def graph_pools(pools: int = 1) -> list[dict]:
    """``pools`` private pools (pool ids (1, 0), (2, 0), ...) of four 64 MiB segments each, half idle:
    what is planned against, the same whatever else the snapshot holds."""
    out, at = [], 1 << 44
    for pool in range(1, pools + 1):
        for _ in range(4):
            out.append({"address": at, "total_size": 64 * MiB, "stream": 0, "segment_pool_id": (pool, 0),
                        "blocks": [{"address": at, "size": 32 * MiB, "state": "inactive"},
                                   {"address": at + 32 * MiB, "size": 32 * MiB, "state": "active_allocated"}]})
            at += 64 * MiB
    return out


def in_default_pool(segments: list[dict]) -> list[dict]:
    """The segments as the default pool's (nested ones as a MemPool's, (0, 2))."""
    return [dict(seg, segment_pool_id=(0, 0) if tuple(seg["segment_pool_id"]) == (0, 1) else (0, 2))
            for seg in segments]


def engine_snapshot(segments: int) -> list[dict]:
    """A graph pool beside ``segments`` segments of the default pool (8 blocks each, a quarter
    hosting a MemPool's segment)."""
    return graph_pools() + in_default_pool(snapshot(segments))


def engine_one_free_block(nested: int) -> list[dict]:
    """A graph pool beside a default-pool segment whose free block holds ``nested`` MemPool segments."""
    return graph_pools() + in_default_pool(one_free_block(nested))


def pools_snapshot(segments: int, pools: int = 2) -> dict:
    """A device's snapshot after a script: ``pools`` graph pools and ``segments`` segments of the default pool."""
    return {"segments": graph_pools(pools) + in_default_pool(snapshot(segments)), "device_traces": [[]]}


def simulate_report(snapshot: dict) -> str:
    """What ``python -m graphborrow simulate`` reports when the script ends (its report part, as
    :func:`graphborrow.run.simulate.simulate_script` makes it): one snapshot report per private
    pool, then the summary text. The grid is small, so the snapshot's size is what grows."""
    from graphborrow.run.simulate import Simulation

    private = sorted({tuple(s["segment_pool_id"]) for s in snapshot["segments"]} - {(0, 0)})
    reports = [inspect_snapshot(snapshot, batches=(1, 8), draft_tokens=(4,), vocab=32000, pool_id=pool)
               for pool in private]
    return Simulation("generated.py", Path("generated_snapshot.pickle"), reports, None, "generated", snapshot).summary()


def inspect(segments: list) -> str:
    """``python -m graphborrow inspect``'s work: the report of the graph pool (1, 0), as text."""
    return format_report(inspect_snapshot(segments, batches=(1, 8), draft_tokens=(4,), vocab=32000, pool_id=(1, 0)))


def static_runs_setup(n: int):
    """A layout-only device with ``n`` live 512-byte blocks, and ``n`` static runs elsewhere."""
    sim = SimBackend(capacity=64 << 30, backed=False, activate=False)
    with sim.activated():
        live = [torch.empty(128, device="cuda") for _ in range(n)]
    buffer = sim.external_alloc(n * 1024)
    runs = [(buffer.address + 1024 * i, 512) for i in range(n)]
    return sim, live, buffer, runs


def set_static_runs(setup) -> None:
    sim, _live, _buffer, runs = setup
    BorrowState(sim).set_static_runs(runs)


def arena_churn(n: int) -> None:
    arena = BumpArena()
    arena.set_extents([(1 << 40, n * 1024)])
    pointers = [arena.malloc(512) for _ in range(n)]
    for p in pointers:
        arena.free(p, 512)


def grid_points(n: int) -> None:
    Grid(axes={"SEED": list(range(n))}, fixed={"BATCH_SIZE": 8}).validated_points()


def stored_point(files: int, root: Path):
    """A stored point with ``files`` results files (each a small record)."""
    from graphborrow.run.sweep.execute import Execution

    results = {f"results/r{i}.json": json.dumps({"results": {"k": i}}).encode() for i in range(files)}
    params = {"BATCH_SIZE": 8}
    identity = point_identity(params, "0" * 64)
    store = PointStore(root)
    store.save("p", identity, params, Execution(0, None, 1.0, b"{}", results, "log"), notebook_name="nb.ipynb",
               notebook_digest="0" * 64)
    return store, identity, params


def point_load(setup) -> None:
    store, identity, params = setup
    result, why = store.load("p", identity, params, "nb.ipynb")
    assert result is not None, why


def snapshot_file(segments: int, root: Path) -> Path:
    import pickle

    path = root / f"s{segments}.pickle"
    path.write_bytes(pickle.dumps({"segments": snapshot(segments)}))
    return path


def fresh_phases() -> None:
    """Forget the phases recorded in this process: every plan records its step afresh."""
    os.environ[STORE_ENV] = "0"
    for store in (PREPARE, ROWS):
        store.cache_clear()


def static_pool(nbytes: int) -> BorrowState:
    """A borrow state over one static run of ``nbytes`` on a layout-only simulated device."""
    sim = SimBackend(capacity=max(1 << 30, 2 * nbytes), backed=False, activate=False)
    buffer = sim.external_alloc(nbytes)
    state = BorrowState(sim)
    state.set_static_runs([(buffer.address, buffer.nbytes)])
    state._keep = (sim, buffer)
    return state


_POOLS: dict = {}


def plan_fits(bs: int):
    """The first plan of a step that fits (a 1 TiB run): its whole sequence is recorded and replayed."""
    state = _POOLS.setdefault("roomy", static_pool(1 << 40))
    fresh_phases()
    found = plan_verify(state, bs, 4, 32000)
    assert found.fits, found.reason
    return found


def plan_refused(mode: str, vocab: int = 32000, pool: int = 64 * MiB):
    """The refusal of a step no pool of ``pool`` bytes holds, against the batch size."""
    def run(bs: int):
        state = _POOLS.setdefault((mode, pool), static_pool(pool))
        fresh_phases()
        found = plan_verify(state, bs, 4, vocab, mode)
        assert not found.fits, (mode, bs)
        return found
    return run


BATCHES = [1000, 10000, 100000, 1000000]


def cases(scale: float, tmp: Path) -> list[tuple[str, str, list[int], Callable[[int], object], Callable]]:
    """(name, unit, sizes ten times apart, make the input, run on it)."""
    s = lambda *sizes: [max(1, int(n * scale)) for n in sizes]  # noqa: E731
    same = lambda n: n  # noqa: E731
    return [
        ("load_snapshot", "segments", s(200, 2000, 20000), snapshot, load_snapshot),
        ("find_free_runs", "segments", s(200, 2000, 20000), snapshot, find_free_runs),
        ("find_free_runs (one free block)", "nested segments", s(200, 2000, 20000), one_free_block, find_free_runs),
        ("summarize", "segments", s(200, 2000, 20000), snapshot, summarize),
        ("nested_in (one host)", "nested segments", s(400, 4000, 40000), one_host, nested_in),
        ("read_snapshot_file", "segments", s(200, 2000, 20000), lambda n: snapshot_file(n, tmp), read_snapshot_file),
        ("inspect_snapshot", "segments", s(200, 2000, 20000), engine_snapshot, inspect),
        ("inspect_snapshot (one free block)", "nested segments", s(200, 2000, 20000), engine_one_free_block, inspect),
        ("simulate's report (2 graph pools)", "segments", s(200, 2000, 20000), pools_snapshot, simulate_report),
        ("replay_trace (bounded pool)", "allocator calls", s(300, 3000, 30000), churn_trace, replay),
        ("replay_trace (segments from before it)", "segments the snapshot keeps", s(200, 2000, 20000), kept_trace,
         replay),
        ("replay_trace (arena segments)", "segments the trace makes", s(20, 200, 2000), arena_trace, replay),
        ("plan_verify, fits (V=32000, D=4)", "batch size", s(10, 100, 1000, 10000), same, plan_fits),
        # batches whose [bs, V] rows a 64 MiB pool never holds, at any --scale (cheap: the refusal's work is the same)
        ("plan_verify refuses, standard (V=32000)", "batch size", BATCHES, same, plan_refused("standard")),
        ("plan_verify refuses, lean (V=32000)", "batch size", BATCHES, same, plan_refused("lean")),
        # chunked groups shrink to one request: its step is refused when the [bs, D] parameters do not fit
        ("plan_verify refuses, chunked (V=1000, 2 MiB)", "batch size", [10**5, 10**6, 10**7], same,
         plan_refused("chunked", 1000, 2 * MiB)),
        ("BorrowState.set_static_runs", "runs and live blocks", s(160, 1600, 16000), static_runs_setup,
         set_static_runs),
        ("BumpArena malloc+free", "allocations", s(400, 4000, 40000), same, arena_churn),
        ("Grid.validated_points", "axis values", s(160, 1600, 16000), same, grid_points),
        ("PointStore.load", "results files", s(8, 80, 800),
         lambda n: stored_point(n, Path(tempfile.mkdtemp(dir=tmp))), point_load),
    ]


def growth_exponent(sizes: list[int], values: list[float]) -> float:
    """The least-squares slope of log(value) against log(size)."""
    xs, ys = [math.log(n) for n in sizes], [math.log(max(v, 1e-9)) for v in values]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def cpu_seconds(run: Callable, argument, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.process_time()
        run(argument)
        times.append(time.process_time() - start)
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the table here too")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every input size (0.1: a quick look)")
    parser.add_argument("--only", nargs="*", default=None, help="entry points whose name starts so")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp_name:
        for name, unit, sizes, make, run in cases(args.scale, Path(tmp_name)):
            if args.only and not any(name.startswith(o) for o in args.only):
                continue
            run(make(sizes[0]))  # imports, builds and caches of a first call are no part of the growth
            seconds = []
            for n in sizes:
                argument = make(n)
                seconds.append(cpu_seconds(run, argument, args.repeats))
                del argument
            exponent = growth_exponent(sizes, seconds)
            rows.append({"entry point": name, "input": unit, "sizes": sizes,
                         "cpu_seconds": [round(t, 4) for t in seconds], "growth_exponent": round(exponent, 2)})
            print(f"{name:36} {unit:26} " + "  ".join(f"{n}:{t:.3f}s" for n, t in zip(sizes, seconds))
                  + f"   exponent {exponent:.2f}", flush=True)
    if args.json:
        record = {"command": "python benchmarks/scaling.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                  "torch": torch.__version__, "python": platform.python_version(),
                  "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
                  "graphborrow": getattr(graphborrow, "__version__", "source tree"),
                  "note": "CPU seconds (process_time), median of the repeats; growth exponent: the least-squares "
                          "slope of log(seconds) against log(size)", "rows": rows}
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
