"""Where the eager verification call's host time goes, and how the step's sizes move its device time.

    python benchmarks/verify_tuning.py --out data/verify_tuning_h200.json

Exploratory, on a GPU: for every point of verify_kernels.py's grid, the eager call's host
time (the GPU idle before each call, 15 and 200 calls, with the garbage collector off, and
issued back to back) and its pieces timed alone (the C launch, the output allocation, the
output views, the checks the short path makes); then, at the points that miss replayed
<= 0.6 x softmax(x / T), the replayed step for other grid sizes, tiles and warps; then the
top-k / top-p step's split threshold and register caps. ``--package TREE`` measures another
tree's graphborrow (a patched kernel, say). Tokens are compared with the default sizes'.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import verify_kernels as vk  # noqa: I001  (first: it puts the measured tree, --package or this one, on sys.path)
import torch  # noqa: E402
from timing import captured, event_us, host_us, issued_us, wall_us  # noqa: E402

from graphborrow.eagle import eagle_verify  # noqa: E402
from graphborrow.eagle.triton import fused  # noqa: E402
from graphborrow.eagle.triton import select as sel  # noqa: E402
from graphborrow.eagle.triton.launch import current_stream, launch_hooks  # noqa: E402

try:  # (an older version keeps the short path in fused)
    from graphborrow.eagle.triton.eager import eager  # noqa: E402
except ImportError:
    eager = fused.eager

VOCAB, T = 128256, 0.7
POINTS = [(bs, d) for d in (4, 8, 16) for bs in (1, 4, 16, 32, 64, 128)]
TUNE_POINTS = [(32, 4), (64, 4), (4, 16), (16, 4), (128, 16)]
# (programs the slices aim at, tile entries, warps); the first is the default
SIZES = [(1056, 2048, 8), (528, 2048, 8), (2112, 2048, 8), (4224, 2048, 8), (1056, 4096, 8), (2112, 4096, 8),
         (1056, 1024, 8), (2112, 1024, 8), (1056, 2048, 4), (2112, 2048, 4), (4224, 1024, 4)]
# SUM_LAG_BYTES, the default first; 1 << 40: every maximum before any sum (the order before the lag)
LAGS = [fused.SUM_LAG_BYTES, 1 << 40, 12 << 20, 40 << 20]
RENORM_POINTS = [(1, 4), (4, 8), (16, 8), (32, 4), (128, 16)]
# (rows from which top-k / top-p split into one launch per kind, register caps plain / one launch)
RENORM_SIZES = [(32, (64, 128)), (1, (64, 128)), (10**9, (64, 128)), (32, (64, 168)), (10**9, (64, 255)),
                (32, (64, 96))]


def pieces(case) -> dict:
    """The short path's pieces, each timed alone with the plan the last call made."""
    tree, logits, coins, final = case
    plans = getattr(fused, "STEP_PLANS", None) or fused._PLANS  # (the cache's older name)
    plan = list(plans.plans.values())[-1]
    entry = plan.cached[current_stream(0)]
    launch, head, tail = entry.launches[0]
    w = entry.pointers
    buf = torch.empty(plan.output_words, dtype=torch.int32, device="cuda")
    base, (at_index, at_length) = buf.data_ptr(), plan.output_bytes
    call = (logits.data_ptr(), tree.candidates.data_ptr(), tree.retrive_index.data_ptr(),
            tree.retrive_next_token.data_ptr(), tree.retrive_next_sibling.data_ptr(), base, base + at_index,
            base + at_length, coins.data_ptr(), final.data_ptr(), w.temps, w.top_k, w.top_p, T, 0, 0.0, 1.0, 1.0)
    return {"arguments": len(head) + len(call) + len(tail),
            "launch": host_us(lambda: launch(*head, *call, *tail), 200),
            "empty": wall_us(lambda: torch.empty(plan.output_words, dtype=torch.int32, device=plan.torch_device)),
            "outputs": wall_us(lambda: plan.outputs(buf)),
            "capturing": wall_us(torch.cuda.is_current_stream_capturing),
            "stream": wall_us(lambda: current_stream(0)), "hooks": wall_us(launch_hooks),
            "tunables": wall_us(fused.tunables), "data_ptr": wall_us(logits.data_ptr),
            "short_path": host_us(lambda: eager(logits, None, tree, T, None, None, coins, final), 200)}


def host_rows(cases) -> list:
    rows = []
    for (bs, d), case in cases.items():
        tree, logits, coins, final = case

        def step():
            return eagle_verify(logits, None, tree, T, coins=coins, coins_final=final, impl="fused", validate=False)

        step()
        torch.cuda.synchronize()
        row = {"bs": bs, "d": d, "host15": host_us(step, 15), "host200": host_us(step, 200)}
        gc.disable()
        row["host200_nogc"] = host_us(step, 200)
        gc.enable()
        row["issued"] = issued_us(step, 50)
        row["event"] = event_us(step, 30)
        row.update(pieces(case))
        rows.append(row)
        print(row, flush=True)
    return rows


def sized(cases, points, configs, apply, renorm: dict) -> list:
    """The replayed and eager step at ``points`` for each configuration ``apply`` sets."""
    out = []
    for bs, d in points:
        tree, logits, coins, final = cases[(bs, d)]
        softmax_t = event_us(lambda: torch.softmax(logits / T, dim=-1), 30)
        first = None
        for config in configs:
            apply(config)

            def step():
                return eagle_verify(logits, None, tree, T, coins=coins, coins_final=final, impl="fused",
                                    validate=False, **renorm)

            row = {"bs": bs, "d": d, "config": config}
            try:
                got = step()
                same = first is None or all(torch.equal(a, b) for a, b in zip(got, first))
                first = first or [t.clone() for t in got]
                graph = captured(step)
                row.update(replayed=event_us(graph.replay, 30), eager=event_us(step, 30), softmax_t=softmax_t,
                           same_tokens=same, splits=sel.split_layout(bs * d, VOCAB))
                row["replayed_vs_softmax_t"] = row["replayed"] / softmax_t
                del graph
            except Exception as exc:  # noqa: BLE001 (recorded; the other configurations run)
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            out.append(row)
            print(row, flush=True)
        apply(configs[0])
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--package", type=Path, default=None, help="the tree whose graphborrow is measured")
    ap.add_argument("--defaults-only", action="store_true", help="no host rows; each point at the default sizes")
    ap.add_argument("--lag-only", action="store_true", help="only the sums' lag behind the maxima, at every point")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("verify_tuning.py measures CUDA kernels: run it on a GPU machine")
    import triton

    x = torch.zeros(1024, device="cuda")
    graph = captured(lambda: x.add_(1))
    record = {"command": " ".join(["verify_tuning.py"] + (argv if argv is not None else sys.argv[1:])),
              "torch": torch.__version__, "device": torch.cuda.get_device_name(), "triton": triton.__version__,
              "host_floor": {"empty": host_us(lambda: torch.empty(1024, device="cuda"), 300),
                             "add": host_us(lambda: x.add_(1), 300), "replay": host_us(graph.replay, 300)}}
    cases = {(bs, d): vk.make_case(bs, d, VOCAB, seed=bs * 100 + d, temperature=T) for bs, d in POINTS}
    if not (args.defaults_only or args.lag_only):
        record["host_rows"] = host_rows(cases)
        first = cases[(1, 4)]
        record["drift_1x4"] = statistics.median(
            host_us(lambda: eagle_verify(first[1], None, first[0], T, coins=first[2], coins_final=first[3],
                                         impl="fused", validate=False), 200) for _ in range(3))

    def grid(config):
        sel.TARGET_PROGRAMS, sel.BLOCK, sel.STREAM_WARPS = config

    def split(config):
        fused.SPLIT_ROWS, fused.STEP_MAX_REGISTERS = config

    def lag(config):
        fused.SUM_LAG_BYTES = config

    started = time.monotonic()
    record["lag"] = sized(cases, POINTS, LAGS, lag, {})
    if not args.lag_only:
        sizes, renorm_sizes = (SIZES[:1], RENORM_SIZES[:1]) if args.defaults_only else (SIZES, RENORM_SIZES)
        record["tune"] = sized(cases, TUNE_POINTS, sizes, grid, {})
        record["renorm"] = sized(cases, RENORM_POINTS, renorm_sizes, split, {"top_ks": 50, "top_ps": 0.9})
    record["sized_s"] = time.monotonic() - started
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
