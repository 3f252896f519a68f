"""Where the replayed fused step's device time goes, from the kernel's own clock.

    python benchmarks/step_timeline.py --out data/step_timeline_h200.json
    python benchmarks/step_timeline.py --points 1x16,4x8 --iters 50

On a GPU, for each point (bs x D, V = 128256, the trees and logits of verify_kernels.py):
``softmax(logits / T)`` and the plain fused step replayed from a CUDA graph (CUDA events,
medians), then the same step traced (:mod:`graphborrow.eagle.triton.timeline`) and
replayed ``--iters`` times: the median time at which each milestone is reached, counted
from the first program's start, and the median of each kind of item's parts. The traced
replay's event time is printed beside the untraced one (the records' cost), and its
tokens are checked equal to the untraced step's. ``--package TREE`` measures another
tree's graphborrow; with ``--no-trace`` (the only way for a tree without the trace) just
softmax and the replayed step, so two trees can be compared in turns.
``--target-programs N`` sets the programs the vocabulary split aims at
(``launch_config.TARGET_PROGRAMS``), ``--residual-items N`` the items the residual split
aims at (``launch_config.RESIDUAL_ITEMS``) and ``--one-round-rows N`` the most rows split for
one round of programs (``launch_config.ONE_ROUND_ROWS``; 0: none, every step aims at
``TARGET_PROGRAMS``).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

import trees  # noqa: I001

trees.put_on_path(sys.argv)  # the measured tree: --package, or this one

import torch  # noqa: E402
import verify_kernels as vk  # noqa: E402
from timing import captured, event_us, timed_us  # noqa: E402

from graphborrow.eagle import eagle_verify  # noqa: E402
from graphborrow.eagle.step import VerifyStep  # noqa: E402

VOCAB, T = 128256, 0.7
SMALL = "1x4,4x4,16x4,1x8,4x8,16x8,1x16,4x16"


def points(text: str) -> list:
    out = []
    for part in text.split(","):
        bs, d = part.lower().split("x")
        if int(d) not in vk.DRAFT_SHAPES:
            raise SystemExit(f"D must be one of {sorted(vk.DRAFT_SHAPES)}, got {part}")
        out.append((int(bs), int(d)))
    return out


def point(bs: int, d: int, iters: int, trace: bool = True) -> dict:
    tree, logits, coins, final = vk.make_case(bs, d, VOCAB, seed=bs * 100 + d, temperature=T)
    kw = dict(coins=coins, coins_final=final, impl="fused", validate=False)
    softmax_us = event_us(lambda: torch.softmax(logits / T, dim=-1), iters)
    plain = eagle_verify(logits, None, tree, T, **kw)
    graph = captured(lambda: eagle_verify(logits, None, tree, T, **kw))
    replayed_us = event_us(graph.replay, iters)
    row = {"bs": bs, "d": d, "rows": bs * d, "softmax_us": round(softmax_us, 1), "replayed_us": round(replayed_us, 1),
           "replayed_vs_softmax": round(replayed_us / softmax_us, 3)}
    if not trace:
        return row
    from graphborrow.eagle.triton.timeline import StepTimeline, run_traced, traced_config

    step = VerifyStep.of(logits, None, tree, T, coins=coins, coins_final=final)
    config = traced_config(step)
    out = run_traced(config, step)  # compiles and sizes the grid
    traced_graph = captured(lambda: run_traced(config, step, out))
    times, timelines = [], []
    for _ in range(iters):
        config.trace.zero_()
        times.append(timed_us(traced_graph.replay))
        timelines.append(StepTimeline.of(config.trace.cpu().numpy(), config))
    same = all(torch.equal(a, b) for a, b in zip(out, plain))
    first = timelines[0]

    def med(values):
        values = [v for v in values if v is not None]
        return round(statistics.median(values) / 1e3, 2) if values else None

    return {
        **row, "splits": config.splits, "rsplits": config.rsplits, "programs": first.programs,
        "items": config.groups[0][1],
        "traced_replayed_us": round(statistics.median(times), 1), "same_tokens_traced": same,
        "milestones_us": {k: med([t.milestones[k] for t in timelines]) for k in first.milestones},
        "items_us": {k: med([t.items[k] for t in timelines]) for k in first.items},
    }


def show(row: dict) -> None:
    print(f"\n{row['bs']} x {row['d']}: softmax(x / T) {row['softmax_us']} us, replayed {row['replayed_us']} us "
          f"({row['replayed_vs_softmax']}x)")
    if "milestones_us" not in row:
        return
    print(f"  {row['rows']} rows, {row['splits']} slices per row, {row['items']} items, {row['programs']} programs; "
          f"traced {row['traced_replayed_us']} us, same tokens {row['same_tokens_traced']}")
    print("  milestones (us after the first program started): "
          + ", ".join(f"{k} {v}" for k, v in row["milestones_us"].items()))
    print("  items (median us): " + ", ".join(f"{k} {v}" for k, v in row["items_us"].items()))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", default=SMALL, help=f"bs x D points, comma-separated (default {SMALL})")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--package", help="measure another tree's graphborrow")
    ap.add_argument("--no-trace", action="store_true", help="softmax and the replayed step only")
    ap.add_argument("--target-programs", type=int, help="programs the vocabulary split aims at")
    ap.add_argument("--residual-items", type=int, help="items the residual split aims at")
    ap.add_argument("--one-round-rows", type=int, help="most rows split for one round of programs")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("step_timeline.py needs a CUDA GPU (the trace reads the GPU's clock)")
    if args.target_programs or args.residual_items or args.one_round_rows is not None:
        from graphborrow.eagle.triton import launch_config  # (this version's sizes)
    if args.target_programs:
        launch_config.TARGET_PROGRAMS = args.target_programs
    if args.residual_items:
        launch_config.RESIDUAL_ITEMS = args.residual_items
    if args.one_round_rows is not None:
        launch_config.ONE_ROUND_ROWS = args.one_round_rows
    rows = []
    for bs, d in points(args.points):
        row = point(bs, d, args.iters, trace=not args.no_trace)
        show(row)
        rows.append(row)
    record = {"command": "python benchmarks/step_timeline.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "torch": torch.__version__, "device": torch.cuda.get_device_name(), "python": platform.python_version(),
              "vocab": VOCAB, "temperature": T, "iters": args.iters, "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    return record


if __name__ == "__main__":
    main()
