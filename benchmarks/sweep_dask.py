"""Sweep throughput on the embedded Dask cluster: the same 16-point sweep on 1, 2, ... workers.

Each point is notebook 06 (capacity) on the simulated device in its own papermill process,
so this measures what a researcher waits for: cluster start, kernel starts, the notebook
itself, and the client storing what comes back. Every worker count runs the whole sweep
into a fresh folder (nothing is reused); rounds alternate the worker counts so slow drift
of a shared machine hits them alike. Wall time includes starting and stopping the cluster.

    python benchmarks/sweep_dask.py --workers 1,2 --out data/sweep_dask_cpu.json            # 2-core box
    python benchmarks/sweep_dask.py --workers 1,4,8,16 --out data/sweep_dask_h200_host.json  # 16 cores
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import socket
import statistics
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

from graphborrow.allocator import compiled
from graphborrow.run.sweep import Grid, run_sweep

GRID = Grid(
    fixed={"DEVICE": "sim", "LADDER": [16, 8, 4, 2, 1]},
    axes={"VOCAB": [1024, 2048, 3072, 4096], "MODE": ["standard", "lean"], "DRAFT_TOKENS": [2, 4]},
)


def one_sweep(workers: int, timeout: float | None) -> dict:
    with tempfile.TemporaryDirectory(prefix="sweep-bench-") as out:
        start = time.perf_counter()
        report = run_sweep("06_capacity_sweep", GRID, name="bench", out=out, workers=workers,
                           timeout=timeout, progress=False)
        wall = time.perf_counter() - start
    failed = [f"{p.point_id}: {p.error}" for p in report.failed]
    if failed:
        raise SystemExit("benchmark points failed:\n" + "\n".join(failed))
    seconds = [p.seconds for p in report.points]
    return {"workers": workers, "points": len(report.points), "wall_s": round(wall, 2),
            "points_per_minute": round(60 * len(report.points) / wall, 2),
            "point_median_s": round(statistics.median(seconds), 2),
            "workers_used": len({p.worker for p in report.points})}


def simulator_in_points() -> str:
    """Which allocator model the points' kernels load: the compiled one when an intact build exists."""
    if os.environ.get(compiled.PURE_ENV):
        return f"pure Python ({compiled.PURE_ENV} is set)"
    why_not = compiled.problem()
    return "compiled" if why_not is None else f"pure Python ({why_not})"


def record(runs: dict[int, list[dict]], command: str, complete: bool) -> dict:
    """The JSON record of the sweeps measured so far; speedups are against the fewest workers measured."""
    measured = {w: statistics.median(x["wall_s"] for x in rounds) for w, rounds in runs.items() if rounds}
    base = measured[min(measured)]
    table = [{"workers": w, "wall_s": wall, "points_per_minute": round(60 * len(GRID.points()) / wall, 2),
              "speedup_vs_fewest": round(base / wall, 2), "rounds": runs[w]} for w, wall in sorted(measured.items())]
    return {
        "what": "16-point sweep of notebook 06 on the simulated device, embedded Dask cluster",
        "command": command, "complete": complete,
        "not_measured": [w for w, rounds in runs.items() if not rounds],
        "host": socket.gethostname(), "cpu_count": os.cpu_count(),
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()], "python": platform.python_version(),
        "torch": metadata.version("torch"), "distributed": metadata.version("distributed"),
        "papermill": metadata.version("papermill"), "device": "simulated (CPU)",
        "simulator": simulator_in_points(),
        "grid": {"fixed": GRID.fixed, "axes": GRID.axes}, "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"),
        "results": table,
    }


def write(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="1,2", help="comma list of worker counts")
    parser.add_argument("--rounds", type=int, default=1, help="sweeps per worker count (alternating)")
    parser.add_argument("--timeout", type=float, default=600, help="per-cell timeout, seconds")
    parser.add_argument("--out", type=Path, help="JSON file for the numbers (e.g. data/sweep_dask_cpu.json)")
    args = parser.parse_args(argv)
    counts = [int(w) for w in args.workers.split(",")]
    runs: dict[int, list[dict]] = {w: [] for w in counts}
    command = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv or sys.argv[1:])])
    for r in range(args.rounds):
        for w in (counts if r % 2 == 0 else counts[::-1]):
            result = one_sweep(w, args.timeout)
            runs[w].append(result)
            print(f"round {r + 1}: {w:2} worker(s)  {result['wall_s']:7.1f} s  "
                  f"{result['points_per_minute']:6.2f} points/min  (median point {result['point_median_s']} s)",
                  flush=True)
            if args.out:  # after every sweep, so a run stopped by a time limit keeps what it measured
                write(args.out, record(runs, command, complete=False))
    final = record(runs, command, complete=True)
    print(f"\n{'workers':>7} {'wall s':>8} {'points/min':>10} {'speedup':>8}")
    for row in final["results"]:
        print(f"{row['workers']:>7} {row['wall_s']:>8.1f} {row['points_per_minute']:>10.2f} "
              f"{row['speedup_vs_fewest']:>7.2f}x")
    if args.out:
        write(args.out, final)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
