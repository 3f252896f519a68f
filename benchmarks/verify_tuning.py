"""The eager verification call's host time, and how the step's sizes move its device time.

    python benchmarks/verify_tuning.py --out data/verify_tuning_h200.json

Exploratory, on a GPU: for every point of verify_kernels.py's grid, the eager call's host
time (the GPU idle before each call, 15 and 200 calls, with the garbage collector off, and
issued back to back); then, at the points that miss replayed <= 0.6 x softmax(x / T), the
replayed step for other grid sizes, tiles and warps; then the top-k / top-p step's split
threshold and register caps (:mod:`graphborrow.eagle.triton.launch_config`'s sizes).
``--package TREE`` measures another tree's graphborrow of this version (a patched kernel,
say). Tokens are compared with the default sizes'.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import trees  # noqa: I001

trees.put_on_path(sys.argv)  # the measured tree: --package, or this one

import torch  # noqa: E402
import verify_kernels as vk  # noqa: E402
from timing import captured, event_us, host_us, issued_us  # noqa: E402

from graphborrow.eagle import eagle_verify  # noqa: E402
from graphborrow.eagle.triton import launch_config as lc  # noqa: E402

VOCAB, T = 128256, 0.7
POINTS = [(bs, d) for d in (4, 8, 16) for bs in (1, 4, 16, 32, 64, 128)]
TUNE_POINTS = [(32, 4), (64, 4), (4, 16), (16, 4), (128, 16)]
# (programs the slices aim at, tile entries, warps); the first is the default
SIZES = [(1056, 2048, 8), (528, 2048, 8), (2112, 2048, 8), (4224, 2048, 8), (1056, 4096, 8), (2112, 4096, 8),
         (1056, 1024, 8), (2112, 1024, 8), (1056, 2048, 4), (2112, 2048, 4), (4224, 1024, 4)]
# SUM_LAG_BYTES, the default first; 1 << 40: every maximum before any sum (the order before the lag)
LAGS = [lc.SUM_LAG_BYTES, 1 << 40, 12 << 20, 40 << 20]
RENORM_POINTS = [(1, 4), (4, 8), (16, 8), (32, 4), (128, 16)]
# (rows from which top-k / top-p split into one launch per kind, register caps plain / one launch)
RENORM_SIZES = [(32, (64, 128)), (1, (64, 128)), (10**9, (64, 128)), (32, (64, 168)), (10**9, (64, 255)),
                (32, (64, 96))]


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
                           same_tokens=same, splits=lc.split_layout(bs * d, VOCAB))
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
        lc.TARGET_PROGRAMS, lc.BLOCK, lc.STREAM_WARPS = config

    def split(config):
        lc.SPLIT_ROWS, lc.STEP_MAX_REGISTERS = config

    def lag(config):
        lc.SUM_LAG_BYTES = config

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
