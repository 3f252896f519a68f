"""Speed of the simulated caching allocator: malloc+free pairs per second versus live blocks.

Layout-only mode (no backing bytes, no history), the mode large sweeps use. For each
number of live blocks the allocator first allocates that many blocks and keeps them,
then times malloc+free pairs over a seeded mix of sizes (512 B .. 8 MiB, log-uniform).
Wall time and CPU time (process_time) are both reported: on a shared machine the CPU
column is the steadier one.

    python benchmarks/sim_allocator.py sim_allocator.png [--pairs 50000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time

from graphborrow.sim.allocator import CachingAllocator
from graphborrow.sim.memory import PhysicalMemory
from graphborrow.sim.streams import Clockwork

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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("png", help="where to write the figure")
    parser.add_argument("--pairs", type=int, default=50_000, help="timed malloc+free pairs per point")
    parser.add_argument("--repeats", type=int, default=3, help="median over this many runs")
    args = parser.parse_args(argv)
    if args.pairs <= 0 or args.repeats <= 0:
        parser.error("--pairs and --repeats must be positive")

    rows = []
    print(f"{'live blocks':>12} {'pairs/s':>12} {'us/pair':>9} {'cpu pairs/s':>12} {'cpu us/pair':>12}")
    for live in LIVE_COUNTS:
        runs = [pairs_per_second(live, args.pairs, seed) for seed in range(args.repeats)]
        rate = statistics.median(wall for wall, _ in runs)
        cpu_rate = statistics.median(cpu for _, cpu in runs)
        rows.append((live, rate, cpu_rate))
        print(f"{live:>12,} {rate:>12,.0f} {1e6 / rate:>9.2f} {cpu_rate:>12,.0f} {1e6 / cpu_rate:>12.2f}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    lives = [max(live, 1) for live, _, _ in rows]
    ax.plot(lives, [rate for _, rate, _ in rows], marker="o", label="wall time")
    ax.plot(lives, [cpu for _, _, cpu in rows], marker="s", linestyle="--", label="CPU time")
    ax.legend()
    ax.set_xscale("log")
    ax.set_xlabel("live blocks (0 plotted at 1)")
    ax.set_ylabel("malloc+free pairs / s")
    ax.set_ylim(bottom=0)
    ax.set_title("simulated caching allocator, layout-only mode")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.png, dpi=120)
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
