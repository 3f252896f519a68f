"""The capacity planner on a real device: every planned verification step, predicted against ran.

    python benchmarks/capacity_gpu.py --out data/capacity_h200.json
    python benchmarks/capacity_gpu.py --out data/capacity_h200_renorm.json --top-k 50 --top-p 0.9 --batches 1,4,32,128
    python benchmarks/capacity_gpu.py --device sim --small --out /tmp/capacity_sim.json   # the same on the CPU

Captures the Llama-3-8B-shaped graph ladder of ``benchmarks/eagle_verify.py`` (prefill 8192
tokens + decode bs 64..1 x 8 draft tokens, one shared pool), then for every (D, bs, mode)
of the grid (default: bs 1..128 x D 4, 8, 16 x standard, lean, chunked, V = 128256):

1. *fresh pool*: retire the borrow pool, ask ``capacity.plan_verify``, build the pool
   (precarve included), run ``eagle_verify`` borrowing from it with CUDA memory history
   on, and record whether it finished or ran out of borrowed memory;
2. *built pool*: plan the same step against the pool the first run left (the planner
   restores its cached segments in the allocator model) and run it again.

Chunked steps planned as not fitting are refused by ``eagle_verify`` before allocating;
for those the script runs one request per group (``chunk_rows=D``), which must run out
of memory for the plan to be right.

Per check it writes planned/ran/agrees, the planned peak and carved bytes, and compares
the CUDA allocator's own sequence for the step (allocations and frees inside the borrow
pool, from the memory history) with the sequence the planner replayed: ``sequence_equal``
and, where they differ, the first difference with both sequences around it, the sizes
CUDA allocated that the model did not (and the reverse), and segment counts. Every
disagreement between plan and run prints that diagnosis, so one run explains a mismatch.
At the end: the capacity table regenerated from the planner for this pool (largest batch
per D whose standard step fits; chunked groups), agreement counts, torch, device, command.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from graphborrow.core.errors import BorrowCapacityError  # noqa: E402
from graphborrow.core.sizes import MB  # noqa: E402
from graphborrow.device import get_backend  # noqa: E402
from graphborrow.eagle import BORROW_USER, MODES, StepShape, eagle_verify  # noqa: E402
from graphborrow.eagle.draft_tree import build_draft_tree  # noqa: E402
from graphborrow.eagle.plan import plan_verify  # noqa: E402
from graphborrow.eagle.sequence import verify_sequence  # noqa: E402
from graphborrow.planning.planner import ALLOC  # noqa: E402
from graphborrow.workloads.ladder import LLAMA3_8B, GraphLadder, ModelShape  # noqa: E402

TREES = {1: (1, 1), 2: (1, 2), 4: (1, 3), 8: (4, 3), 16: (4, 5)}  # draft tokens -> (topk, depth)
SMALL_SHAPE = ModelShape(hidden=256, intermediate=1024, layers=2, vocab=32000, dtype=torch.bfloat16)
WINDOW = 6  # entries shown either side of the first difference
MARKER_BYTES = 7777  # an allocation of this odd size marks where a step's history starts


def normalised(pairs):
    """[("alloc", nbytes) | ("free", ordinal of the allocation it frees)] from (kind, key, nbytes)."""
    order, out, count = {}, [], 0
    for kind, key, nbytes in pairs:
        if kind == "alloc":
            order[key] = count
            count += 1
            out.append(("alloc", nbytes))
        elif key in order:
            out.append(("free", order.pop(key)))
    return out


def planned_pairs(shape: StepShape, mode: str, per_chunk: int):
    sequence = verify_sequence(shape, mode, per_chunk)
    return normalised([("alloc" if e[0] == ALLOC else "free", e[1], e[2]) for e in sequence.events])


def device_pairs(trace, pool_segments):
    """The step's allocations and frees inside the borrow pool, from the device's memory history."""
    spans = [(s["address"], s["address"] + s["total_size"]) for s in pool_segments]

    def inside(addr):
        return any(a <= addr < z for a, z in spans)

    pairs, segments = [], 0
    for e in trace:
        action = e.get("action")
        if action == "segment_alloc" and inside(e["addr"]):
            segments += 1
        elif action == "alloc" and inside(e["addr"]):
            pairs.append(("alloc", e["addr"], e["size"]))
        elif action == "free_completed" and inside(e["addr"]):
            pairs.append(("free", e["addr"], 0))
    return normalised(pairs), segments


def compare(cuda, planned) -> dict:
    """Where the device's sequence and the planner's differ, with both around the first difference."""
    first = next((i for i, (a, b) in enumerate(zip(cuda, planned)) if a != b), None)
    if first is None and len(cuda) != len(planned):
        first = min(len(cuda), len(planned))
    result = {"sequence_equal": first is None, "device_entries": len(cuda), "planned_entries": len(planned)}
    if first is not None:
        lo, hi = max(0, first - WINDOW), first + WINDOW
        sizes = collections.Counter(n for k, n in cuda if k == "alloc")
        model = collections.Counter(n for k, n in planned if k == "alloc")
        result.update(
            first_difference=first,
            device_around=[list(x) for x in cuda[lo:hi]],
            planned_around=[list(x) for x in planned[lo:hi]],
            device_only_sizes=sorted((sizes - model).elements())[:50],
            planned_only_sizes=sorted((model - sizes).elements())[:50],
        )
    return result


def make_inputs(backend, bs, d, vocab, seed):
    topk, depth = TREES.get(d, (2, max(d // 2, 1)))
    tree = build_draft_tree(min(topk, d), depth, d, bs, vocab, generator=torch.Generator().manual_seed(seed),
                            device=backend.device)
    if backend.name == "cuda":  # draw on the device: a CPU draw of 128 x 16 x 128256 takes seconds
        g = torch.Generator(device="cuda").manual_seed(seed)
        logits = torch.randn(bs * d, vocab, device="cuda", generator=g).mul_(2.0)
        return tree, logits, torch.rand(bs, d, device="cuda", generator=g), torch.rand(bs, device="cuda", generator=g)
    g = torch.Generator().manual_seed(seed)
    logits = (2.0 * torch.randn(bs * d, vocab, generator=g)).to(backend.device)
    coins = torch.rand(bs, d, generator=g).to(backend.device)
    coins_final = torch.rand(bs, generator=g).to(backend.device)
    return tree, logits, coins, coins_final


def run_step(backend, state, inputs, mode, args, chunk_rows=None):
    """Run one borrowed step with memory history on: (ran, error, trace, pool segments)."""
    tree, logits, coins, coins_final = inputs
    if state.mem_pool is None:
        with state.borrow(BORROW_USER):  # build (and precarve) the pool before recording
            pass
    backend.synchronize()
    backend.record_memory_history(True, max_entries=2_000_000)
    marker = torch.empty(MARKER_BYTES, dtype=torch.uint8, device=backend.device)  # outside the borrow pool
    del marker
    ran, error = True, None
    try:
        eagle_verify(logits, None, tree, args.temperature, top_ks=args.top_k or None, top_ps=args.top_p or None,
                     coins=coins, coins_final=coins_final, borrow=state, mode=mode, chunk_rows=chunk_rows,
                     impl="reference", validate=backend.backed)  # the implementation the planner records
        backend.synchronize()
    except backend.OutOfMemoryError as exc:
        ran, error = False, f"OutOfMemoryError: {str(exc).splitlines()[0][:160]}"
    except BorrowCapacityError as exc:
        ran, error = False, f"BorrowCapacityError: {str(exc)[:300]}"
    trace = backend.full_snapshot()["device_traces"][0]
    backend.record_memory_history(False)
    starts = [i for i, e in enumerate(trace) if e.get("action") == "alloc" and e.get("size") == MARKER_BYTES]
    trace = trace[starts[-1] + 1:] if starts else trace  # older entries, where a device keeps them, are not this step's
    pool = backend.memory_snapshot(backend.pool_id(state.mem_pool)) if state.mem_pool is not None else []
    return ran, error, trace, pool


def check(backend, state, inputs, shape, mode, args, label) -> dict:
    """Plan against the pool as it is, run, and compare."""
    bs, d, vocab = shape.batch_size, shape.draft_tokens, shape.vocab
    t0 = time.perf_counter()
    plan = plan_verify(state, bs, d, vocab, mode, shape.top_k, shape.top_p, impl="reference")
    plan_s = time.perf_counter() - t0
    row = {"bs": bs, "draft_tokens": d, "mode": mode, "pool": label, "planned": plan.fits,
           "requests_per_chunk": plan.requests_per_chunk, "planned_peak_bytes": plan.peak_bytes,
           "planned_carved_bytes": plan.carved_bytes, "reason": plan.reason, "plan_s": round(plan_s, 3)}
    chunk_rows = None
    if mode == "chunked" and not plan.fits:
        chunk_rows = d  # eagle_verify refuses before allocating; one request per group must run out
    ran, error, trace, pool = run_step(backend, state, inputs, mode, args, chunk_rows)
    row.update(ran=ran, error=error, agrees=ran == plan.fits)
    per = 1 if chunk_rows else plan.requests_per_chunk
    device, segments = device_pairs(trace, pool)
    planned = planned_pairs(shape, mode, max(per, 1))
    if ran:
        row.update(compare(device, planned))
    else:  # the device stopped at its failing request: compare the allocations it served
        served = [x for x in device if x[0] == "alloc"]
        model = [x for x in planned if x[0] == "alloc"]
        row.update(compare(served, model[:len(served)]), device_served=len(served), planned_served=plan.allocations)
    row["device_segments"] = segments
    return row


def capture(backend, small: bool):
    if small:
        return GraphLadder(backend, SMALL_SHAPE, prefill_tokens=2048, decode_batches=(16, 8, 4, 2, 1),
                           draft_tokens=4).capture()
    return GraphLadder(backend, LLAMA3_8B, prefill_tokens=8192, draft_tokens=8).capture()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="data/capacity_h200.json")
    p.add_argument("--device", default="cuda", choices=["cuda", "sim"])
    p.add_argument("--small", action="store_true", help="a small model and grid (for the simulated device)")
    p.add_argument("--batches", default=None, help="default 1,4,16,32,64,128 (small: 1,4,8,16)")
    p.add_argument("--draft-tokens", default=None, help="default 4,8,16 (small: 1,4,8)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-k", type=int, default=0, help="0: no top-k renorm")
    p.add_argument("--top-p", type=float, default=0.0, help="0: no top-p renorm")
    p.add_argument("--no-built", action="store_true", help="only the fresh-pool checks")
    p.add_argument("--budget-s", type=float, default=420.0, help="skip the remaining points after this long")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA device (or --device sim): this script runs the planned steps for real")
        return 2
    t_start = time.monotonic()
    backend = get_backend(args.device) if args.device == "cuda" else get_backend("sim", backed=False)
    small = args.small or args.device == "sim"
    batches = [int(x) for x in (args.batches or ("1,4,8,16" if small else "1,4,16,32,64,128")).split(",")]
    drafts = [int(x) for x in (args.draft_tokens or ("1,4,8" if small else "4,8,16")).split(",")]
    modes = [m for m in args.modes.split(",") if m]
    ladder = capture(backend, small)
    state, vocab = ladder.state, ladder.shape.vocab
    backend.empty_cache()
    pool = ladder.snapshot()
    print(f"{backend.describe()}: pool {sum(s['total_size'] for s in pool) / MB:.1f} MiB, "
          f"{state.stats()['runs']} runs, {state.stats()['run_bytes'] / MB:.1f} MiB idle, "
          f"largest {state.largest_run() / MB:.1f} MiB")
    rows = []
    print(f"{'bs':>4} {'D':>3} {'mode':>9} {'pool':>6} {'plan':>5} {'ran':>5} {'agree':>5} {'seq':>5} "
          f"{'per':>4} {'peak MiB':>9} {'plan s':>7}")
    for d in drafts:
        for bs in batches:
            shape = StepShape(bs, d, vocab, bool(args.top_k), bool(args.top_p))
            inputs = make_inputs(backend, bs, d, vocab, seed=bs * 100 + d)
            for mode in modes:
                if time.monotonic() - t_start > args.budget_s:
                    rows.append({"bs": bs, "draft_tokens": d, "mode": mode, "skipped": "time budget spent"})
                    continue
                labels = ["fresh"] if args.no_built else ["fresh", "built"]
                for label in labels:
                    if label == "fresh":
                        state.retire()
                    try:
                        row = check(backend, state, inputs, shape, mode, args, label)
                    except Exception as exc:  # keep going: one broken point must not hide the others
                        row = {"bs": bs, "draft_tokens": d, "mode": mode, "pool": label,
                               "failed": f"{type(exc).__name__}: {exc}"[:400]}
                        print(f"{bs:4d} {d:3d} {mode:>9} {label:>6} FAILED {row['failed']}")
                        rows.append(row)
                        continue
                    rows.append(row)
                    print(f"{bs:4d} {d:3d} {mode:>9} {label:>6} {str(row['planned']):>5} {str(row['ran']):>5} "
                          f"{str(row['agrees']):>5} {str(row.get('sequence_equal')):>5} "
                          f"{row['requests_per_chunk']:4d} {row['planned_peak_bytes'] / MB:9.1f} {row['plan_s']:7.2f}")
                    if not row["agrees"]:
                        print("   DISAGREES:", row["reason"] or row["error"])
                        print("   device  :", row.get("device_around"))
                        print("   planned :", row.get("planned_around"))
                        print("   device-only sizes:", row.get("device_only_sizes"),
                              " planned-only sizes:", row.get("planned_only_sizes"))
            del inputs
            backend.empty_cache()
    checked = [r for r in rows if "agrees" in r]
    table = [{"batch_size": r["bs"], "draft_tokens": r["draft_tokens"], "mode": r["mode"], "fits": r["planned"],
              "ran": r["ran"], "requests_per_chunk": r["requests_per_chunk"], "peak_bytes": r["planned_peak_bytes"]}
             for r in checked if r["pool"] == "fresh"]
    largest = {}
    for r in table:
        if r["mode"] == "standard":
            largest.setdefault(r["draft_tokens"], 0)
            if r["fits"]:
                largest[r["draft_tokens"]] = max(largest[r["draft_tokens"]], r["batch_size"])
    result = {
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:]),
        "torch": torch.__version__,
        "device": backend.describe(),
        "vocab": vocab,
        "args": vars(args),
        "pool": state.stats(),
        "checks": len(checked),
        "agreements": sum(r["agrees"] for r in checked),
        "sequence_equal": sum(bool(r.get("sequence_equal")) for r in checked),
        "failed_checks": [r for r in rows if "failed" in r],
        "largest_standard_batch_by_draft_tokens": largest,
        "capacity_table": table,
        "rows": rows,
        "wall_s": round(time.monotonic() - t_start, 1),
    }
    print(f"plan == run in {result['agreements']} of {result['checks']} checks; device sequence equal to the "
          f"planner's in {result['sequence_equal']}; largest standard batch by D: {largest}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"wrote {args.out} in {result['wall_s']:.0f} s")
    return 0 if result["agreements"] == result["checks"] and not result["failed_checks"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
