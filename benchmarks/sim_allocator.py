"""Speed of the simulated caching allocator: malloc+free pairs per second versus live blocks.

Layout-only mode (no backing bytes, no history), the mode large sweeps use. For each
number of live blocks the allocator first allocates that many blocks and keeps them,
then times malloc+free pairs over a seeded mix of sizes (512 B .. 8 MiB, log-uniform).
Wall time and CPU time (process_time) are both reported: on a shared machine the CPU
column is the steadier one. Each round measures every point once with the compiled model
and once with the pure-Python model (a child process with GRAPHBORROW_SIM_PURE=1), the
baseline; medians are over rounds, so a burst of load on a shared machine hits one round
of both rather than every repeat of one point.

    python -m graphborrow build   # the compiled model; without it both columns are pure Python
    python benchmarks/sim_allocator.py docs/sim_allocator_speed.png [--json out.json] [--pairs 50000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import time

from graphborrow.allocator import compiled
from graphborrow.allocator.caching import CachingAllocator
from graphborrow.allocator.memory import PhysicalMemory
from graphborrow.allocator.streams import Clockwork

LIVE_COUNTS = (0, 100, 1_000, 10_000, 100_000)


def log_uniform_sizes(rng: random.Random, count: int, low: int = 512, high: int = 8 * 2**20) -> list[int]:
    return [int(math.exp(rng.uniform(math.log(low), math.log(high)))) for _ in range(count)]


def pairs_per_second(live: int, pairs: int, seed: int = 0) -> tuple[float, float]:
    """(wall, CPU) malloc+free pairs per second with ``live`` blocks held."""
    rng = random.Random(seed)
    allocator = CachingAllocator(PhysicalMemory(capacity=2**50, backed=False), Clockwork())
    keep = [allocator.malloc(size, 0) for size in log_uniform_sizes(rng, live)]
    sizes = log_uniform_sizes(rng, 4096)
    malloc, free = allocator.malloc, allocator.free
    start, start_cpu = time.perf_counter(), time.process_time()
    for i in range(pairs):
        free(malloc(sizes[i & 4095], 0))
    elapsed, elapsed_cpu = time.perf_counter() - start, time.process_time() - start_cpu
    del keep
    return pairs / elapsed, pairs / max(elapsed_cpu, 1e-9)


def one_round(pairs: int, seed: int) -> list[tuple[float, float]]:
    """(wall, CPU) rates at every live-block count, one seed."""
    return [pairs_per_second(live, pairs, seed) for live in LIVE_COUNTS]


def one_round_pure_python(pairs: int, seed: int) -> list[tuple[float, float]]:
    """The same round in a child process that runs the pure-Python model."""
    env = dict(os.environ, **{compiled.PURE_ENV: "1"})
    out = subprocess.run(
        [sys.executable, __file__, "--round", str(seed), "--pairs", str(pairs)],
        env=env, check=True, capture_output=True, text=True,
    ).stdout
    return [tuple(rates) for rates in json.loads(out)]


def summarize(rounds: list[list[tuple[float, float]]]) -> list[dict]:
    """Per live-block count: median wall rate, and median / min / max CPU rate over the rounds."""
    rows = []
    for i, live in enumerate(LIVE_COUNTS):
        wall = [r[i][0] for r in rounds]
        cpu = [r[i][1] for r in rounds]
        rows.append({"live_blocks": live, "pairs_per_s": statistics.median(wall),
                     "cpu_pairs_per_s": statistics.median(cpu), "cpu_min": min(cpu), "cpu_max": max(cpu)})
    return rows


def print_table(name: str, rows: list[dict]) -> None:
    print(f"{name}:")
    print(f"{'live blocks':>12} {'pairs/s':>12} {'us/pair':>9} {'cpu pairs/s':>12} {'cpu us/pair':>12}")
    for row in rows:
        rate, cpu = row["pairs_per_s"], row["cpu_pairs_per_s"]
        print(f"{row['live_blocks']:>12,} {rate:>12,.0f} {1e6 / rate:>9.2f} {cpu:>12,.0f} {1e6 / cpu:>12.2f}")


def plot(results: dict[str, list[dict]], png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for (name, rows), marker in zip(results.items(), "os"):
        lives = [max(row["live_blocks"], 1) for row in rows]
        line, = ax.plot(lives, [row["cpu_pairs_per_s"] for row in rows], marker=marker, label=f"{name} (median)")
        ax.fill_between(lives, [row["cpu_min"] for row in rows], [row["cpu_max"] for row in rows],
                        color=line.get_color(), alpha=0.15, label=f"{name} (min..max over rounds)")
    ax.axhline(200_000, color="grey", linewidth=0.8, linestyle="--", label="200k pairs/s")
    ax.set_ylim(0, 1.4 * max(row["cpu_max"] for rows in results.values() for row in rows))
    ax.yaxis.set_major_formatter(lambda value, _: f"{value / 1000:.0f}k")
    ax.legend(fontsize=7, ncol=2, loc="upper center")
    ax.set_xscale("log")
    ax.set_xlabel("live blocks (0 plotted at 1)")
    ax.set_ylabel("malloc+free pairs / s (CPU time)")
    ax.set_title("simulated caching allocator, layout-only mode")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("png", nargs="?", help="where to write the figure")
    parser.add_argument("--json", help="also write the numbers and the machine here")
    parser.add_argument("--pairs", type=int, default=50_000, help="timed malloc+free pairs per point")
    parser.add_argument("--repeats", type=int, default=5, help="rounds (seeds); medians are over rounds")
    parser.add_argument("--round", type=int, help=argparse.SUPPRESS)  # the child process: one round
    args = parser.parse_args(argv)
    if args.pairs <= 0 or args.repeats <= 0:
        parser.error("--pairs and --repeats must be positive")
    if args.round is not None:
        print(json.dumps(one_round(args.pairs, args.round)))
        return
    if not args.png:
        parser.error("give the figure's path, e.g. docs/sim_allocator_speed.png")

    this = compiled.implementation()
    if this == "pure Python":
        print("no compiled build (python -m graphborrow build): measuring pure Python only")
    rounds: dict[str, list] = {this: []}
    for seed in range(args.repeats):
        rounds[this].append(one_round(args.pairs, seed))
        if this != "pure Python":
            rounds.setdefault("pure Python", []).append(one_round_pure_python(args.pairs, seed))
    results = {name: summarize(r) for name, r in rounds.items()}
    for name, rows in results.items():
        print_table(name, rows)
    if len(results) == 2:
        ratios = [c["cpu_pairs_per_s"] / p["cpu_pairs_per_s"] for c, p in zip(*results.values())]
        print("compiled / pure Python (CPU time): " + ", ".join(f"{r:.2f}x" for r in ratios))
    plot(results, args.png)
    print(f"wrote {args.png}")
    if args.json:
        import Cython

        record = {
            "benchmark": "simulated allocator malloc+free pairs, layout-only",
            "command": "python benchmarks/sim_allocator.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "machine": {"cpus": os.cpu_count(), "processor": platform.machine(), "python": platform.python_version(),
                        "cython": Cython.__version__},
            "pairs": args.pairs, "repeats": args.repeats,
            "results": results,
        }
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
