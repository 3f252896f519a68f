"""Record real CUDA caching-allocator traces for the simulator's replay check (needs a GPU).

    python scripts/record_traces.py OUTDIR [--only default_churn,graph_ladder,borrow_cycles]

Each scenario runs in a fresh Python process, so its trace starts at an empty allocator,
with ``torch.cuda.memory._record_memory_history(max_entries=100000)``. It writes
``OUTDIR/<scenario>.pickle`` (the ``_snapshot()`` dict with frames stripped) and a JSON
sidecar with the torch version, device name and command. Afterwards every trace is
replayed on the simulated allocator and its agreement printed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import random
import subprocess
import sys
import time

from graphborrow.fidelity.corpus import strip_frames

SCENARIOS = ("default_churn", "graph_ladder", "borrow_cycles")
MAX_ENTRIES = 100_000
MiB = 2**20


# ----------------------------------------------------------------------------- scenarios (child process)


def default_churn(torch) -> None:
    """Seeded churn over 512 B .. 64 MiB on two streams, record_stream on a busy side stream."""
    rng = random.Random(0)
    main, side = torch.cuda.current_stream(), torch.cuda.Stream()
    live = []  # (tensor, stream it was allocated on)
    for step in range(2400):
        if step == 1200:
            torch.cuda.empty_cache()
        r = rng.random()
        if r < 0.55 or not live:
            nbytes = int(math.exp(rng.uniform(math.log(512), math.log(64 * MiB))))
            stream = side if rng.random() < 0.3 else main
            with torch.cuda.stream(stream):
                live.append((torch.empty(nbytes, dtype=torch.uint8, device="cuda"), stream))
        else:
            tensor, stream = live.pop(rng.randrange(len(live)))
            if rng.random() < 0.15:
                other = main if stream is side else side
                with torch.cuda.stream(other):
                    torch.cuda._sleep(int(rng.uniform(1e5, 2e6)))  # keep the user stream busy
                    tensor.add_(1)
                tensor.record_stream(other)
            del tensor
    torch.cuda.synchronize()
    live.clear()
    torch.cuda.empty_cache()


def _ladder(torch, hidden=1024, inter=2816, vocab=32000, prefill=512, decode=(64, 32, 16, 8, 4, 2, 1)):
    """A prefill graph and a decode ladder captured largest-first into one graph_pool_handle()."""
    dtype = torch.float16
    w_gate = torch.randn(hidden, inter, device="cuda", dtype=dtype) * 0.02
    w_up = torch.randn(hidden, inter, device="cuda", dtype=dtype) * 0.02
    w_down = torch.randn(inter, hidden, device="cuda", dtype=dtype) * 0.02
    head = torch.randn(hidden, vocab, device="cuda", dtype=dtype) * 0.02

    def step(x):
        h = torch.nn.functional.silu(x @ w_gate) * (x @ w_up)
        y = x + h @ w_down
        return torch.softmax((y @ head).float(), dim=-1)

    pool = torch.cuda.graph_pool_handle()
    graphs = []
    for tokens in (prefill, *decode):
        x = torch.randn(tokens, hidden, device="cuda", dtype=dtype)
        warm = torch.cuda.Stream()
        warm.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(warm):
            for _ in range(2):
                step(x)
        torch.cuda.current_stream().wait_stream(warm)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = step(x)
        graphs.append((graph, x, out))
    for graph, _, _ in graphs:
        graph.replay()
    torch.cuda.synchronize()
    return pool, graphs, (w_gate, w_up, w_down, head)


def graph_ladder(torch) -> None:
    with torch.inference_mode():
        keep = _ladder(torch)
        _write_snapshot_hook["keep"] = keep  # graphs stay alive for the snapshot


def borrow_cycles(torch) -> None:
    from graphborrow.core.arena import BumpArena
    from graphborrow.core.runs import find_free_runs

    with torch.inference_mode():
        pool, graphs, weights = _ladder(torch)
        pool_id = tuple(pool)
        segments = [s for s in torch.cuda.memory._snapshot()["segments"] if tuple(s["segment_pool_id"]) == pool_id]
        runs = find_free_runs(segments)[: BumpArena.MAX_EXTENTS]
        if not runs:
            raise RuntimeError("the graph pool has no free runs to borrow; the ladder left nothing idle")
        largest = runs[0][1]
        sizes = [64 * 1024, 300 * 1024, 900 * 1024] + ([4 * MiB] if largest >= 20 * MiB else [])
        kept = None
        for cycle in range(4):
            arena = BumpArena()
            arena.set_extents(runs)
            mempool = torch.cuda.MemPool(arena.allocator)
            with torch.cuda.use_mem_pool(mempool):
                tensors = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in sizes]
                probs = torch.softmax(torch.randn(8, 4096, device="cuda"), dim=-1)  # some real work
                tensors.append(probs)
            torch.cuda.synchronize()
            if cycle < 3:
                del tensors, probs
                del mempool  # releases the pool and empties its cache
                graphs[cycle % len(graphs)][0].replay()
            else:
                kept = (arena, mempool, tensors)
        torch.cuda.synchronize()
        _write_snapshot_hook["keep"] = (pool, graphs, weights, kept)


_write_snapshot_hook: dict = {}


def record(name: str, outdir: str, command: str) -> None:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("record_traces.py needs a CUDA device; torch.cuda.is_available() is False")
    torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES)
    globals()[name](torch)
    snapshot = strip_frames(torch.cuda.memory._snapshot())
    torch.cuda.memory._record_memory_history(enabled=None)
    events = sum(len(t) for t in snapshot["device_traces"])
    path = os.path.join(outdir, f"{name}.pickle")
    with open(path, "wb") as f:
        pickle.dump(snapshot, f)
    sidecar = {
        "scenario": name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(),
        "command": command,
        "max_entries": MAX_ENTRIES,
        "events": events,
        "segments": len(snapshot["segments"]),
        "recorded_unix_time": int(time.time()),
    }
    with open(os.path.join(outdir, f"{name}.json"), "w") as f:
        json.dump(sidecar, f, indent=2)
    size = os.path.getsize(path)
    if events >= MAX_ENTRIES:
        print(f"warning: {name} filled the {MAX_ENTRIES}-entry ring buffer; replay will reject it", file=sys.stderr)
    print(f"{name}: {events} events, {len(snapshot['segments'])} segments, {size / 1e6:.2f} MB -> {path}")


# ----------------------------------------------------------------------------- driver (parent process)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("outdir")
    parser.add_argument("--only", default=",".join(SCENARIOS), help="comma-separated scenario names")
    parser.add_argument("--scenario", help=argparse.SUPPRESS)  # child mode
    parser.add_argument("--command", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.scenario:
        record(args.scenario, args.outdir, args.command or "")
        return 0

    chosen = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = sorted(set(chosen) - set(SCENARIOS))
    if unknown:
        parser.error(f"unknown scenario(s) {unknown}; choose from {list(SCENARIOS)}")
    os.makedirs(args.outdir, exist_ok=True)
    command = " ".join([os.path.basename(sys.executable), *sys.argv])
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])))
    failed = []
    for name in chosen:
        child = [sys.executable, os.path.abspath(__file__), args.outdir, "--scenario", name, "--command", command]
        if subprocess.run(child, env=env).returncode != 0:
            failed.append(name)
            continue
        try:
            sys.path.insert(0, repo)
            from graphborrow.fidelity.replay import replay_trace

            report = replay_trace(os.path.join(args.outdir, f"{name}.pickle"))
            print(f"{name}: replay on the simulator -> {report}")
        except Exception as error:  # replay trouble must not lose the recording
            print(f"{name}: replay failed: {type(error).__name__}: {error}", file=sys.stderr)
    if failed:
        print(f"failed scenarios: {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
