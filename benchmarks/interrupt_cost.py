"""What interrupt safety costs per step: critical sections on, against the same code with them off.

Measures, on the device given (the simulated one always, CUDA when asked and present):

* one outermost critical section (``with CRITICAL: pass``) on the main thread;
* a borrow scope entered and left (the per-step cost that matters on CUDA), empty and
  with one 4 MiB allocation inside, next to ``use_mem_pool`` alone and a plain
  allocation;
* on the simulated device, a small decode-like step (borrow, a few allocations and ops,
  replay), where every allocator call is a critical section too.

"Off" makes every section return at its first check, as on a thread that runs no signal
handlers; both variants run in alternating rounds in the same process, and each number
is the median over rounds of the mean over ``--iters`` calls (host time,
``time.perf_counter``; on CUDA the work is host-side, the device is synchronised per round).

    python benchmarks/interrupt_cost.py --device sim --out data/interrupt_cost_sim.json
    python benchmarks/interrupt_cost.py --device cuda --out data/interrupt_cost_h200.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from graphborrow.core import interrupts  # noqa: E402
from graphborrow.core.borrow import BorrowState  # noqa: E402
from graphborrow.core.interrupts import CRITICAL  # noqa: E402
from graphborrow.device import get_backend  # noqa: E402

MiB = 1 << 20


class gate_off:
    """Sections return at once, as they do on threads that never run signal handlers."""

    def __enter__(self):
        self.main, interrupts._gate.main = interrupts._gate.main, -1

    def __exit__(self, *exc):
        interrupts._gate.main = self.main


def capture(backend, state, nbytes):
    x = torch.ones(nbytes // 4, device="cuda")
    g = backend.CUDAGraph()
    with state.capture_scope(), backend.graph(g, pool=state.pool_id):
        y = (x * 2 + 1)[:8].clone()
    backend.synchronize()
    return g, (x, y)


def per_call(fn, iters, sync):
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - start) / iters * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("sim", "cuda"), default="sim")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()

    backend = get_backend(args.device) if args.device == "cuda" else get_backend("sim", capacity=8 * 2**30)
    sync = backend.synchronize
    state = BorrowState(backend, pool_id=backend.graph_pool_handle())
    graph, keep = capture(backend, state, 256 * MiB if args.device == "cuda" else 24 * MiB)
    pool = backend.MemPool()

    def section():
        with CRITICAL:
            pass

    def borrow_empty():
        with state.borrow("overhead"):
            pass

    def borrow_alloc():
        with state.borrow("overhead"):
            t = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")
            del t

    def use_mem_pool_alone():
        with backend.use_mem_pool(pool):
            pass

    def plain_alloc():
        t = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")
        del t

    def sim_step():
        with state.borrow("step"):
            a = torch.empty(70_000, device="cuda")
            b = torch.softmax(torch.ones(16, 256, device="cuda"), -1)
            del a, b
        with state.replay_scope():
            graph.replay()

    cases = {
        "critical section": section,
        "borrow scope enter+leave": borrow_empty,
        "borrow scope with a 4 MiB allocation": borrow_alloc,
        "use_mem_pool enter+leave": use_mem_pool_alone,
        "plain 4 MiB allocation": plain_alloc,
    }
    if args.device == "sim":
        cases["decode-like step (simulated)"] = sim_step
    for fn in cases.values():  # warm: pools built, workspaces made
        fn()
    rounds = {name: {"on": [], "off": []} for name in cases}
    for r in range(args.rounds):
        for mode in (("on", "off") if r % 2 == 0 else ("off", "on")):
            for name, fn in cases.items():
                iters = args.iters if "step" not in name else max(args.iters // 20, 20)
                if mode == "off":
                    with gate_off():
                        rounds[name][mode].append(per_call(fn, iters, sync))
                else:
                    rounds[name][mode].append(per_call(fn, iters, sync))
    results = {}
    print(f"{'':42} {'on (us)':>9} {'off (us)':>9} {'ratio':>7}")
    for name, r in rounds.items():
        on, off = statistics.median(r["on"]), statistics.median(r["off"])
        results[name] = {"on_us": round(on, 3), "off_us": round(off, 3), "ratio": round(on / off, 3),
                         "rounds_on_us": [round(x, 3) for x in r["on"]], "rounds_off_us": [round(x, 3) for x in r["off"]]}
        print(f"{name:42} {on:9.2f} {off:9.2f} {on / off:7.2f}")
    record = {
        "what": "host cost per call with critical sections on and off (off: sections return at their first check)",
        "device": backend.describe(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "command": " ".join(["python", *sys.argv]),
        "iters": args.iters,
        "rounds": args.rounds,
        "signals_scanned_per_section": len(interrupts.SIGNALS),
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")
    del keep


if __name__ == "__main__":
    main()
