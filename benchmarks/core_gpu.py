"""Core measurements on a real GPU: free runs by policy, physical bytes saved, host overhead.

    python benchmarks/core_gpu.py --out data/core_h200.json --snapshot data/h200_ladder_segments.pickle

Captures a Llama-3-8B-shaped prefill graph (8192 tokens, 2 MLP blocks) and a decode ladder
(8 draft tokens x bs 64..1 with the 128256-wide head) into one pool, then:
1. counts the free runs each policy finds in that pool;
2. measures with torch.cuda.mem_get_info the device memory a bs=32 x 8 x 128256 fp32
   probability set (target probabilities + draft scratch) costs without and with borrowing;
3. times entering and leaving a borrow per step against a plain allocation and against
   torch.cuda.use_mem_pool itself (medians of many iterations after warm-up).
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from timing import wall_us  # noqa: E402

from graphborrow.core.runs import find_free_runs, summarize  # noqa: E402
from graphborrow.core.sizes import MB  # noqa: E402
from graphborrow.device import get_backend  # noqa: E402
from graphborrow.workloads.ladder import LLAMA3_8B, GraphLadder  # noqa: E402


def physical_cost(make, backend) -> int:
    """Device bytes that ``make()``'s live tensors take, from the driver's view."""
    backend.synchronize()
    free0, _ = torch.cuda.mem_get_info()
    held = make()
    backend.synchronize()
    free1, _ = torch.cuda.mem_get_info()
    del held
    return free0 - free1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="data/core_h200.json")
    p.add_argument("--snapshot", default=None, help="also write the pool's segments (pickle)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--draft-tokens", type=int, default=8)
    args = p.parse_args(argv)

    backend = get_backend("cuda")
    result = {
        "command": "python " + " ".join(sys.argv),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(),
    }
    ladder = GraphLadder(backend, LLAMA3_8B, prefill_tokens=8192, draft_tokens=args.draft_tokens).capture()
    segments = ladder.snapshot()
    if args.snapshot:
        for s in segments:  # frames make the file large and say nothing about layout
            s["frames"] = []
            for b in s["blocks"]:
                b["frames"] = []
        Path(args.snapshot).parent.mkdir(parents=True, exist_ok=True)
        with open(args.snapshot, "wb") as f:
            pickle.dump({"segments": segments, "source": result}, f, protocol=4)
    summary = summarize(segments)
    result["pool"] = summary
    result["runs_by_policy"] = {
        policy: [n for _, n in find_free_runs(segments, policy)] for policy in ("runs", "whole_segments")
    }
    print(f"pool: {summary['reserved_bytes'] / MB:.1f} MiB reserved, {summary['run_bytes'] / MB:.1f} MiB "
          f"in {summary['runs']} runs (largest {summary['largest_run'] / MB:.1f} MiB); whole segments: "
          f"{summary['whole_segment_bytes'] / MB:.1f} MiB in {summary['whole_segment_runs']} runs")

    state = ladder.state
    bs, d, vocab = args.batch, args.draft_tokens, LLAMA3_8B.vocab
    logits = ladder.decode(bs).clone()
    temperature = torch.full((bs * d, 1), 0.7, device="cuda")

    def probability_set():
        target = torch.softmax(logits / temperature, dim=-1)
        draft = torch.zeros_like(target)
        return target, draft

    torch.cuda.empty_cache()
    plain = physical_cost(probability_set, backend)
    torch.cuda.empty_cache()

    def borrowed_set():
        with state.borrow("probability set"):
            held = probability_set()
            backend.synchronize()
            free, _ = torch.cuda.mem_get_info()
            del held
        return free

    backend.synchronize()
    free0, _ = torch.cuda.mem_get_info()
    borrowed_free = borrowed_set()
    borrowed = free0 - borrowed_free
    result["probability_set"] = {
        "batch": bs, "draft_tokens": d, "vocab": vocab,
        "tensor_bytes": 2 * bs * d * vocab * 4,
        "plain_device_bytes": plain,
        "borrowed_device_bytes": borrowed,
        "saved_bytes": plain - borrowed,
        "reserved_after": torch.cuda.memory_reserved(),
    }
    print(f"probability set bs={bs} D={d} V={vocab}: {plain / MB:.1f} MiB plain, {borrowed / MB:.1f} MiB borrowed")

    # host overhead per step
    small = 4 * MB
    plain_pool = torch.cuda.MemPool()

    def plain_alloc():
        t = torch.empty(small, dtype=torch.uint8, device="cuda")
        del t

    def mem_pool_enter_exit():
        with torch.cuda.use_mem_pool(plain_pool):
            pass

    def mem_pool_alloc():
        with torch.cuda.use_mem_pool(plain_pool):
            t = torch.empty(small, dtype=torch.uint8, device="cuda")
            del t

    def borrow_enter_exit():
        with state.borrow("overhead"):
            pass

    def borrow_alloc():
        with state.borrow("overhead"):
            t = torch.empty(small, dtype=torch.uint8, device="cuda")
            del t

    def snapshot_pool():
        backend.memory_snapshot(state.pool_id)

    timings = {
        "plain_alloc_4MiB_us": wall_us(plain_alloc),
        "use_mem_pool_enter_exit_us": wall_us(mem_pool_enter_exit),
        "use_mem_pool_with_4MiB_alloc_us": wall_us(mem_pool_alloc),
        "borrow_enter_exit_us": wall_us(borrow_enter_exit),
        "borrow_with_4MiB_alloc_us": wall_us(borrow_alloc),
        "pool_snapshot_us": wall_us(snapshot_pool, iters=200, warmup=20),
        # the pieces a borrow adds to use_mem_pool
        "touch_us": wall_us(backend.touch),
        "stream_key_us": wall_us(backend.current_stream_key),
        "arena_freed_query_us": wall_us(lambda: state.arena.freed_bytes),
    }
    timings["borrow_vs_use_mem_pool"] = timings["borrow_enter_exit_us"] / timings["use_mem_pool_enter_exit_us"]
    timings["borrow_alloc_vs_use_mem_pool_alloc"] = (
        timings["borrow_with_4MiB_alloc_us"] / timings["use_mem_pool_with_4MiB_alloc_us"]
    )
    timings["borrow_alloc_vs_plain_alloc"] = timings["borrow_with_4MiB_alloc_us"] / timings["plain_alloc_4MiB_us"]
    result["host_overhead"] = timings
    for k, v in timings.items():
        print(f"  {k:40s} {v:8.2f}")
    result["borrow_state"] = state.stats()

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
