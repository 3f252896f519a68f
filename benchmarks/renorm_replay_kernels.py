"""The standalone top-p renorm replayed from a CUDA graph: total time and device time per kernel.

    python benchmarks/renorm_replay_kernels.py TREE ROWS [ROWS ...]

TREE is the folder whose ``graphborrow`` is measured (``.`` for this one, or an older
version's ``git archive``), so two versions can be measured one after the other on one GPU.
Prints one JSON object: per row count (V = 128256, top-p 0.9), the replay's median
(CUDA events, 30 replays; ``timing.event_us``), the eager call's, and each kernel's mean device time inside
the replay (torch.profiler, 10 replays).
"""

from __future__ import annotations

import json
import sys

sys.path.insert(0, sys.argv[1])

import torch  # noqa: E402
from timing import captured, event_us  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from graphborrow.eagle.triton import fused_renorm  # noqa: E402


def measure(rows: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(rows)
    probs = torch.softmax(2.0 * torch.randn(rows, 128256, device="cuda", generator=g), dim=-1)

    def call():
        return fused_renorm.top_p_renorm(probs, 0.9, validate=False)

    call()
    graph = captured(call)
    record = {"replay_us": event_us(graph.replay, 30), "eager_us": event_us(call, 30)}
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            graph.replay()
        torch.cuda.synchronize()
    record["replay_kernels"] = {e.key[:40]: round(e.device_time_total / 10, 2) for e in prof.key_averages()
                                if getattr(e, "device_time_total", 0)}
    return record


if __name__ == "__main__":
    print(json.dumps({int(rows): measure(int(rows)) for rows in sys.argv[2:]}))
