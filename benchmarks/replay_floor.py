"""What a replayed fused step's time is made of: the graph's floor, the counters' zeroing node, the graph path's lookup.

    python benchmarks/replay_floor.py --out data/verify_replay_floor_h200.json
    python benchmarks/replay_floor.py --points 1x4,4x8 --rounds 2

On a GPU, CUDA events around one call at a time (the GPU idle before it), medians over
``--rounds`` rounds of ``--iters`` each, the variants taken in turn within a round:

- ``empty_graph_us``: a graph of one empty Triton kernel (one program, and as many as the
  step's grid): what any replayed kernel costs before it does any work;
- ``by_hand_us``: the plain step captured by hand (``torch.cuda.graph`` around
  ``eagle_verify``): the workspace's counters zeroed by a memset node, then the kernel;
- ``kernel_alone_us``: the same step captured on counters owned outside the graph
  (:func:`graphborrow.eagle.triton.fused.step_counters`, zeroed once): the kernel alone;
- ``graph_path_us``: ``eagle_verify(..., graph=True)``, whose entries own their counters, with
  its lookup on the host (``graph_path_host_us`` against ``replay_host_us``, ``replay()``'s own);
- ``softmax_t_us``: ``torch.softmax(logits / T)``, the yardstick of verify_kernels.py's goals.

Each variant's tokens are checked equal to the eager call's. V = 128256, T = 0.7, the trees
and logits of verify_kernels.py.
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
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
import verify_kernels as vk  # noqa: E402
from step_timeline import points  # noqa: E402
from timing import captured, event_us, host_us, pipelined_us  # noqa: E402

from graphborrow.eagle import eagle_verify  # noqa: E402
from graphborrow.eagle.graphs import clear_verify_graphs  # noqa: E402
from graphborrow.eagle.step import VerifyStep  # noqa: E402
from graphborrow.eagle.triton import fused  # noqa: E402

VOCAB, T = 128256, 0.7
POINTS = "1x4,4x4,16x4,1x8,4x8,1x16,4x16,32x8"


@triton.jit
def _empty_kernel(flag, never):
    if tl.program_id(0) == never:
        tl.store(flag, 1)


def empty_graph_us(programs: int, iters: int) -> float:
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")

    def launch():
        _empty_kernel[(programs,)](flag, 1 << 30, num_warps=8)

    launch()
    return event_us(captured(launch).replay, iters)


def point(bs: int, d: int, iters: int, rounds: int) -> dict:
    tree, logits, coins, final = vk.make_case(bs, d, VOCAB, seed=bs * 100 + d, temperature=T)
    kw = dict(coins=coins, coins_final=final, impl="fused", validate=False)

    def step():
        return eagle_verify(logits, None, tree, T, **kw)

    def graph_path():
        return eagle_verify(logits, None, tree, T, graph=True, **kw)

    expected = step()
    by_hand = torch.cuda.CUDAGraph()
    with torch.cuda.graph(by_hand):
        by_hand_out = step()
    checked = VerifyStep.of(logits, None, tree, T, None, None, coins, final)
    counters = fused.step_counters(checked)
    alone_out = fused.allocate_outputs(checked)
    alone = torch.cuda.CUDAGraph()
    with torch.cuda.graph(alone):
        fused.run_step(checked, alone_out, True, counters)
    path_out = graph_path()
    variants = {"by_hand_us": by_hand.replay, "kernel_alone_us": alone.replay, "graph_path_us": graph_path,
                "softmax_t_us": lambda: torch.softmax(logits / T, dim=-1)}
    hosts = {"graph_path_host_us": graph_path, "replay_host_us": by_hand.replay}
    samples = {name: [] for name in (*variants, *hosts)}
    for _ in range(rounds):
        for name, fn in variants.items():
            samples[name].append(event_us(fn, iters))
        for name, fn in hosts.items():
            samples[name].append(host_us(fn, iters))
    row = {"bs": bs, "d": d, **{name: round(statistics.median(v), 2) for name, v in samples.items()},
           "by_hand_pipelined_us": round(pipelined_us(by_hand.replay, iters), 2),
           "kernel_alone_pipelined_us": round(pipelined_us(alone.replay, iters), 2)}
    torch.cuda.synchronize()
    row["same_tokens"] = all(torch.equal(a, b) for got in (by_hand_out, alone_out, path_out)
                             for a, b in zip(got, expected))
    row["zeroing_node_us"] = round(row["by_hand_us"] - row["kernel_alone_us"], 2)
    row["graph_path_vs_by_hand"] = round(row["graph_path_us"] / row["by_hand_us"], 3)
    row["by_hand_vs_softmax_t"] = round(row["by_hand_us"] / row["softmax_t_us"], 3)
    clear_verify_graphs()
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", default=POINTS, help=f"bs x D points, comma-separated (default {POINTS})")
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--package", help="measure another tree's graphborrow")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("replay_floor.py measures CUDA graphs: run it on a GPU machine")
    chosen = points(args.points)
    record = {"command": "python benchmarks/replay_floor.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "torch": torch.__version__, "device": torch.cuda.get_device_name(), "python": platform.python_version(),
              "vocab": VOCAB, "temperature": T, "iters": args.iters, "rounds": args.rounds,
              "empty_graph_us": {str(n): round(empty_graph_us(n, args.iters), 2) for n in (1, 528)}, "rows": []}
    print("empty kernel's graph, one program and 528:", record["empty_graph_us"], "us")
    for bs, d in chosen:
        row = point(bs, d, args.iters, args.rounds)
        record["rows"].append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
