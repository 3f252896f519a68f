"""EAGLE verification on a real GPU: device memory, fit, and time per step, per mode.

    python benchmarks/eagle_verify.py --out data/eagle_h200.json

Captures the Llama-3-8B-shaped graph ladder of benchmarks/core_gpu.py (prefill 8192 tokens
+ decode bs 64..1 x 8 draft tokens, one shared pool) to get real free runs, then for each
batch size and draft-token count verifies random logits [bs*D, 128256] in four modes:
standard (no borrow), standard + borrow, lean (no borrow), chunked + borrow.

Per point and mode it records:
- device_bytes: the drop of torch.cuda.mem_get_info's free memory across one step,
  measured right after torch.cuda.empty_cache(). The caching allocator keeps every
  segment it creates until the next empty_cache, so the drop after the step equals the
  step's peak demand on the device. Borrowed tensors live in the graph pool's idle runs
  and cost nothing here; memory_reserved would count them a second time, so it is only
  recorded (reserved_growth) for comparison;
- peak_allocated_bytes (max_memory_allocated growth, every pool) next to verify_bytes,
  the step's peak from its recorded allocation sequence (chunked: for the group size the
  capacity planner picks); fits_plan (capacity.plan_verify against the borrow pool as it
  is before the step: the answer chunked mode sizes its groups by) and whether it ran
  (an OOM is recorded as failed and the sweep goes on);
- device_ms: CUDA-event time of one step, median over --iters steps after warm-up, and its
  ratio to one torch.softmax pass over the same logits; host_ms: the Python call's wall
  time (launch-bound steps show it); agrees: same tokens as standard for the same coins.
Once per run: the host cost of entering and leaving the borrow scope.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from timing import event_us, host_us, wall_us  # noqa: E402

from graphborrow.core.sizes import MB  # noqa: E402
from graphborrow.device import get_backend  # noqa: E402
from graphborrow.eagle import BORROW_USER, eagle_verify, verify_bytes  # noqa: E402
from graphborrow.eagle.draft_tree import build_draft_tree  # noqa: E402
from graphborrow.eagle.plan import plan_verify  # noqa: E402
from graphborrow.workloads.ladder import LLAMA3_8B, GraphLadder  # noqa: E402

MODES = {  # name: (eagle_verify mode, borrow?)
    "standard": ("standard", False),
    "standard+borrow": ("standard", True),
    "lean": ("lean", False),
    "chunked+borrow": ("chunked", True),
}
TREES = {4: (1, 3), 8: (4, 3), 16: (4, 5)}  # draft tokens -> (topk, depth)


def event_ms(fn, iters: int, warmup: int = 3) -> float:
    return event_us(fn, iters, warmup) / 1e3


def host_ms(fn, iters: int) -> float:
    return host_us(fn, iters) / 1e3


def memory_of(fn) -> dict:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    reserved0 = torch.cuda.memory_reserved()
    allocated0 = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    free0, _ = torch.cuda.mem_get_info()
    out = fn()
    torch.cuda.synchronize()
    free1, _ = torch.cuda.mem_get_info()
    return {
        "device_bytes": free0 - free1,
        "reserved_growth": torch.cuda.memory_reserved() - reserved0,
        "peak_allocated_bytes": torch.cuda.max_memory_allocated() - allocated0,
        "result": out,
    }


def run_point(bs, d, vocab, state, args, budget_end) -> list[dict]:
    topk, depth = TREES[d]
    seed = bs * 100 + d
    tree = build_draft_tree(topk, depth, d, bs, vocab, generator=torch.Generator().manual_seed(seed), device="cuda")
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(bs * d, vocab, device="cuda", generator=g).mul_(2.0)
    coins = torch.rand(bs, d, device="cuda", generator=g)
    coins_final = torch.rand(bs, device="cuda", generator=g)
    top_k = args.top_k if args.top_k else None
    top_p = args.top_p if args.top_p else None
    softmax_ms = event_ms(lambda: torch.softmax(logits, dim=-1), args.iters)
    rows, reference = [], None
    for name, (mode, borrowing) in MODES.items():
        row = {"bs": bs, "draft_tokens": d, "tree": {"topk": topk, "depth": depth}, "mode": name,
               "softmax_ms": softmax_ms}
        chunk_rows = None
        if borrowing:  # each borrowed mode gets a fresh borrow pool over the same runs
            state.retire()
            planned = plan_verify(state, bs, d, vocab, mode, bool(top_k), bool(top_p), impl="reference")
            row["fits_plan"], row["plan_reason"] = planned.fits, planned.reason
            if mode == "chunked":
                row["chunk_requests"] = planned.requests_per_chunk if planned.fits else 0
                chunk_rows = planned.requests_per_chunk * d if planned.fits else None
        else:
            row["fits_plan"] = None
        row["verify_bytes"] = verify_bytes(bs, d, vocab, mode, bool(top_k), bool(top_p), chunk_rows=chunk_rows)
        if time.monotonic() > budget_end:
            row.update(ok=False, error="skipped: time budget spent")
            rows.append(row)
            continue

        def step():
            return eagle_verify(logits, None, tree, args.temperature, top_ks=top_k, top_ps=top_p, coins=coins,
                                coins_final=coins_final, borrow=state if borrowing else None, mode=mode,
                                impl="reference")  # the reference modes (benchmarks/verify_kernels.py: fused)

        try:
            if borrowing:  # the fresh pool, built (and precarved) before the measured step
                with state.borrow(BORROW_USER):
                    pass
            mem = memory_of(step)
            result = mem.pop("result")
            row.update(mem)
            row["device_ms"] = event_ms(step, args.iters)
            row["host_ms"] = host_ms(step, max(5, args.iters // 4))
            row["vs_softmax"] = row["device_ms"] / softmax_ms
            row["ok"] = True
            if reference is None and name == "standard":
                reference = [t.cpu() for t in result]
            row["agrees"] = None if reference is None else all(
                torch.equal(a.cpu(), b) for a, b in zip(result, reference))
            row["accept_length_mean"] = float(result.accept_length.float().mean())
            del result
        except (torch.cuda.OutOfMemoryError, RuntimeError, ValueError) as exc:  # OOM in the runs, capacity
            row.update(ok=False, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            del exc
        rows.append(row)
        torch.cuda.synchronize()
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="data/eagle_h200.json")
    p.add_argument("--batches", default="1,4,16,32,64,128")
    p.add_argument("--draft-tokens", default="4,8,16")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-k", type=int, default=0, help="0: no top-k renorm")
    p.add_argument("--top-p", type=float, default=0.0, help="0: no top-p renorm")
    p.add_argument("--budget-s", type=float, default=200.0, help="skip the remaining points after this long")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device: this benchmark measures real device memory and time")
        return 2
    t_start = time.monotonic()
    backend = get_backend("cuda")
    vocab = LLAMA3_8B.vocab
    ladder = GraphLadder(backend, LLAMA3_8B, prefill_tokens=8192, draft_tokens=8).capture()
    state = ladder.state
    torch.cuda.empty_cache()
    result = {
        "command": "python " + " ".join(sys.argv),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(),
        "vocab": vocab,
        "args": vars(args),
        "memory_method": "mem_get_info free-memory drop across one step, right after empty_cache "
                         "(segments stay cached until empty_cache, so the drop is the step's peak)",
        "pool": state.stats(),
    }
    print(f"pool: {state.stats()['run_bytes'] / MB:.1f} MiB in {state.stats()['runs']} runs, "
          f"largest {state.largest_run() / MB:.1f} MiB")

    def enter_exit():
        with state.borrow(BORROW_USER):
            pass

    result["borrow_scope_host_us"] = wall_us(enter_exit)
    print(f"borrow scope enter+exit: {result['borrow_scope_host_us']:.2f} us")

    budget_end = t_start + args.budget_s
    points = []
    print(f"{'bs':>4} {'D':>3} {'mode':>16} {'ok':>3} {'dev MiB':>9} {'plan MiB':>9} {'peak MiB':>9} "
          f"{'ms':>8} {'xsoftmax':>8} {'host ms':>8} agrees")
    for d in [int(x) for x in args.draft_tokens.split(",")]:
        for bs in [int(x) for x in args.batches.split(",")]:
            for row in run_point(bs, d, vocab, state, args, budget_end):
                points.append(row)
                if row["ok"]:
                    print(f"{bs:4d} {d:3d} {row['mode']:>16} {'yes':>3} {row['device_bytes'] / MB:9.1f} "
                          f"{row['verify_bytes'] / MB:9.1f} {row['peak_allocated_bytes'] / MB:9.1f} "
                          f"{row['device_ms']:8.3f} {row['vs_softmax']:8.2f} {row['host_ms']:8.3f} {row['agrees']}")
                else:
                    print(f"{bs:4d} {d:3d} {row['mode']:>16}  no  {row['error']}")
            torch.cuda.empty_cache()
    result["points"] = points
    result["borrow_state_after"] = state.stats()
    result["wall_s"] = time.monotonic() - t_start
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"wrote {args.out} in {result['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
