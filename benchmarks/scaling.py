"""How the public entry points' time grows with their input: a large real snapshot, a big batch.

Each entry point runs on inputs of doubling size; the table shows the CPU time (median of
``--repeats``) and the growth exponent between the two largest sizes (1.0: linear, 2.0:
quadratic). Inputs are synthetic but shaped like the real thing: snapshots of many segments
with many blocks each, some segments nested in another's free block (a borrow pool inside a
graph pool), static runs next to many live blocks, sweep axes of many values, stored points.

    python benchmarks/scaling.py [--json data/scaling_cpu.json] [--repeats 3] [--scale 1.0]

CPU only (no GPU needed); times are CPU seconds (``time.process_time``), the steadier
measure on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

import graphborrow
from graphborrow.core.arena import BumpArena
from graphborrow.core.borrow import BorrowState
from graphborrow.core.runs import find_free_runs, summarize
from graphborrow.core.snapshot import load_snapshot, nested_in, read_snapshot_file
from graphborrow.eagle.plan import plan_verify
from graphborrow.run.sweep.grid import Grid
from graphborrow.run.sweep.points import PointStore, point_identity
from graphborrow.sim import SimBackend

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


_PLAN_STATE = None


def plan(bs: int) -> None:
    global _PLAN_STATE
    if _PLAN_STATE is None:
        sim = SimBackend(capacity=1 << 30, backed=False, activate=False)
        buffer = sim.external_alloc(512 * MiB)
        _PLAN_STATE = BorrowState(sim)
        _PLAN_STATE.set_static_runs([(buffer.address, buffer.nbytes)])
        _PLAN_STATE._keep = (sim, buffer)
        plan_verify(_PLAN_STATE, 1, 4, 128256)  # warm-up: the first recording builds what every later one reuses
    plan_verify(_PLAN_STATE, bs, 4, 128256)


def cases(scale: float, tmp: Path) -> list[tuple[str, str, list[int], Callable[[int], object], Callable]]:
    """(name, unit, sizes, make the input, run on it)."""
    s = lambda *sizes: [max(1, int(n * scale)) for n in sizes]  # noqa: E731
    return [
        ("load_snapshot", "segments", s(1000, 2000, 4000, 8000), snapshot, load_snapshot),
        ("find_free_runs", "segments", s(1000, 2000, 4000, 8000), snapshot, find_free_runs),
        ("summarize", "segments", s(500, 1000, 2000, 4000), snapshot, summarize),
        ("nested_in (one host)", "nested segments", s(4000, 8000, 16000, 32000), one_host, nested_in),
        ("read_snapshot_file", "segments", s(1000, 2000, 4000, 8000), lambda n: snapshot_file(n, tmp),
         read_snapshot_file),
        ("BorrowState.set_static_runs", "runs and live blocks", s(2000, 4000, 8000, 16000), static_runs_setup,
         set_static_runs),
        ("BumpArena malloc+free", "allocations", s(5000, 10000, 20000, 40000), lambda n: n, arena_churn),
        ("Grid.validated_points", "axis values", s(2000, 4000, 8000, 16000), lambda n: n, grid_points),
        ("PointStore.load", "results files", s(100, 200, 400, 800),
         lambda n: stored_point(n, Path(tempfile.mkdtemp(dir=tmp))), point_load),
        ("plan_verify (first call, V=128256)", "batch size", s(1024, 2048, 4096, 8192), lambda n: n, plan),
    ]


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
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp_name:
        for name, unit, sizes, make, run in cases(args.scale, Path(tmp_name)):
            seconds = []
            for n in sizes:
                argument = make(n)
                # plan_verify caches per shape: its first call is the one that grows with the batch
                seconds.append(cpu_seconds(run, argument, 1 if name.startswith("plan_verify") else args.repeats))
            exponent = math.log(seconds[-1] / seconds[-2], sizes[-1] / sizes[-2]) if seconds[-2] > 0 else float("nan")
            rows.append({"entry point": name, "input": unit, "sizes": sizes,
                         "cpu_seconds": [round(t, 4) for t in seconds], "growth_exponent": round(exponent, 2)})
            print(f"{name:30} {unit:22} " + "  ".join(f"{n}:{t:.3f}s" for n, t in zip(sizes, seconds))
                  + f"   exponent {exponent:.2f}", flush=True)
    if args.json:
        record = {"command": "python benchmarks/scaling.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                  "torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
                  "graphborrow": getattr(graphborrow, "__version__", "source tree"), "rows": rows}
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
