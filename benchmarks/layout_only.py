"""How fast the layout-only simulated device runs Llama-sized work, against bare meta tensors.

    python benchmarks/layout_only.py --json data/layout_only_cpu.json

Two workloads, each timed as the median of ``--repeats`` runs in this process:

- ``ops``: an MLP up-projection, an LM head, a softmax and a top-k at Llama-3-8B shapes
  (64 tokens), on the layout-only device and, as the baseline in the same run, on plain
  ``device="meta"`` tensors (shapes only, no allocator): the ratio is the simulator's cost
  of placing every block the way the caching allocator would;
- ``record``: the capacity planner recording a verification step's allocation sequence
  (bs 32 x 8 drafts x 128256, standard; first recording of the shape, caches cleared).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from graphborrow.sim import SimBackend  # noqa: E402


def ops(device: str) -> None:
    with torch.inference_mode():
        x = torch.empty(64, 4096, dtype=torch.bfloat16, device=device)
        w = torch.empty(14336, 4096, dtype=torch.bfloat16, device=device)
        h = F.silu(x @ w.t())
        head = torch.empty(128256, 4096, dtype=torch.bfloat16, device=device)
        probs = (x @ head.t()).float().softmax(-1)
        del h
        probs.topk(8, dim=-1)


def median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def record_once() -> None:
    from graphborrow.eagle import sequence
    from graphborrow.eagle.step import StepShape

    for cached in (sequence.PREPARE, sequence.ROWS):
        cached.cache_clear()
    sequence.verify_sequence(StepShape(32, 8, 128256, False, False), "standard")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    layout = SimBackend(capacity=80 * 2**30, backed=False, activate=False, blas_workspace=0)

    def on_layout():
        with layout.activated():
            ops("cuda")
        layout.empty_cache()

    ops("meta"), on_layout(), record_once()  # warm-up
    meta_s = median_s(lambda: ops("meta"), args.repeats)
    layout_s = median_s(on_layout, args.repeats)
    record_s = median_s(record_once, args.repeats)
    result = {
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:]),
        "torch": torch.__version__,
        "device": "CPU (layout-only simulated device)",
        "repeats": args.repeats,
        "ops_meta_ms": round(meta_s * 1e3, 3),
        "ops_layout_only_ms": round(layout_s * 1e3, 3),
        "ops_ratio": round(layout_s / meta_s, 2),
        "record_verify_step_ms": round(record_s * 1e3, 1),
    }
    print(f"Llama-shaped ops: layout-only {result['ops_layout_only_ms']:.2f} ms, bare meta "
          f"{result['ops_meta_ms']:.2f} ms ({result['ops_ratio']}x); recording a bs32 x 8 x 128256 "
          f"verification step: {result['record_verify_step_ms']:.0f} ms (medians of {args.repeats})")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
