"""Record allocator traces whose ring buffer wrapped, from long runs cut at many points (needs a GPU).

    python scripts/record_wrapped.py data/traces/wrapped [--jobs 4] [--steps-scale 1.0] [--device cuda|sim]

A serving process records ``torch.cuda.memory._record_memory_history(max_entries=N)`` for hours:
the ring buffer wraps, the oldest entries are gone, and a ``_snapshot()`` taken at any moment is
a trace that begins mid-run. Each run here is one process (allocator settings are fixed per
process) that runs one workload for a long time with a ring of ``N`` entries (100 to 10 000) and
takes a ``_snapshot()`` at several points of the run, each one such a trace. Workloads:

- ``suite``: the suite's own: a prefill graph and a decode ladder captured into one pool
  (:class:`graphborrow.workloads.ladder.GraphLadder`), then served step after step: decode and
  prefill replays, EAGLE verification borrowing the pool's idle runs through the
  :class:`~graphborrow.core.borrow.BorrowState` (a MemPool over the arena), retire, a side stream;
  history starts after the capture, as it would in a server that enables it late;
- ``model``: ordinary model code: a small decoder-only transformer in plain PyTorch serving
  batches of requests with a growing KV cache (prefill, decode), logits copied out on a side
  stream (``record_stream``), ``empty_cache`` now and then;
- ``churn``: the differential corpus's random program (``scripts/record_corpus.py``): one to four
  streams, cross-stream frees, graph captures and replays, MemPools, ``empty_cache``.

Each runs with expandable segments off and on. A trace is written as ``<name>.pickle.gz``: the
``_snapshot()`` dict (frames stripped) with a ``corpus`` record (workload, settings, ring size,
cut, the step it was taken at, whether the ring had wrapped, versions, device, the command), so
that the replay knows the device (its memory sizes expandable reservations). ``index.json``
lists them. Afterwards every trace is replayed and its report printed.

``--device sim`` runs the same workloads, small, on the simulated device: a dry run without a GPU.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import pickle
import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from graphborrow.core.atomicfile import write_atomic
from graphborrow.fidelity.corpus import strip_frames

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
MiB = 2**20
SETTINGS = {"off": "", "expandable": "expandable_segments:True"}
# workload -> ring sizes (one run each, per setting) and the steps of a run
RUNS = {"suite": ((1000, 10_000), 900), "model": ((300, 3000), 700), "churn": ((100, 1000), 3000)}
CUTS = 3  # snapshots per run, at evenly spaced steps after the ring has wrapped
ROW = "trace: "  # how a child reports a trace it wrote
CHILD_ENV, COMMAND_ENV = "RECORD_WRAPPED_RUN", "RECORD_WRAPPED_COMMAND"  # what the parent tells a child


# ----------------------------------------------------------------------------- the device (child process)


class Device:
    """torch.cuda, or the simulated device for a dry run: history, snapshots, streams."""

    def __init__(self, kind: str, settings: str) -> None:
        import torch

        from graphborrow.device import get_backend

        self.torch, self.kind = torch, kind
        if kind == "cuda":
            if not torch.cuda.is_available():
                raise SystemExit("record_wrapped.py needs a CUDA device (or --device sim for a dry run)")
            self.backend = get_backend("cuda")
        else:
            config = {"expandable_segments": True} if "expandable_segments:True" in settings else None
            self.backend = get_backend("sim", backed=True, config=config, capacity=8 * 2**30)

    def start_history(self, max_entries: int) -> None:
        if self.kind == "cuda":
            self.torch.cuda.memory._record_memory_history("all", context=None, stacks="python", max_entries=max_entries)
        else:
            self.backend.record_memory_history(True, max_entries=max_entries)

    def snapshot(self) -> dict:
        self.backend.synchronize()
        if self.kind == "cuda":
            return strip_frames(self.torch.cuda.memory._snapshot())
        return self.backend.full_snapshot()

    def versions(self) -> dict:
        torch = self.torch
        if self.kind == "cuda":
            return {"torch": torch.__version__, "cuda": torch.version.cuda, "device": torch.cuda.get_device_name(),
                    "device_memory": torch.cuda.get_device_properties(0).total_memory}
        return {"torch": torch.__version__, "cuda": None, "device": self.backend.describe(),
                "device_memory": self.backend.capacity}


# ----------------------------------------------------------------------------- workloads (child process)


def suite(device: Device, rng: random.Random, steps: int, max_entries: int, cut) -> None:
    """The suite's graph ladder served with borrowed EAGLE verification (history from after the capture)."""
    torch = device.torch
    from graphborrow.core.errors import BorrowCapacityError
    from graphborrow.eagle.draft_tree import build_draft_tree
    from graphborrow.eagle.verify import eagle_verify
    from graphborrow.workloads.ladder import GraphLadder, ModelShape

    backend = device.backend
    cuda = device.kind == "cuda"
    shape = ModelShape(hidden=1024, intermediate=2816, layers=2, vocab=32000, dtype=torch.bfloat16) if cuda else \
        ModelShape(hidden=64, intermediate=128, layers=2, vocab=512, dtype=torch.float32)
    batches = (16, 8, 4, 2, 1)
    draft = 4
    ladder = GraphLadder(backend, shape, prefill_tokens=512 if cuda else 64, decode_batches=batches,
                         draft_tokens=draft).capture()
    state = ladder.state
    trees = {b: build_draft_tree(2, 3, draft, b, shape.vocab, generator=torch.Generator().manual_seed(b),
                                 device=backend.device) for b in batches}
    side = backend.Stream()
    kept = []
    device.start_history(max_entries)
    with torch.inference_mode():
        for step in range(steps):
            batch = rng.choice(batches)
            logits = ladder.decode(batch)
            r = rng.random()
            if r < 0.75:
                try:
                    eagle_verify(logits.contiguous(), None, trees[batch], 0.8, borrow=state, impl="reference",
                                 generator=torch.Generator().manual_seed(step))
                except (BorrowCapacityError, torch.OutOfMemoryError):  # no room in the idle runs now: skipped
                    pass
            elif r < 0.85:
                ladder.prefill()
            elif r < 0.90:
                side.wait_stream(backend.current_stream())
                with backend.stream(side):  # a copy of the logits made on a side stream, used there
                    copy = logits.float() * 2
                kept.append(copy)
            elif r < 0.93:
                state.retire()
            elif r < 0.95:
                backend.synchronize()
                backend.empty_cache()
            if len(kept) > 4 or (kept and rng.random() < 0.1):
                kept.pop(0)
            cut(step)


class TinyDecoder:
    """A small decoder-only transformer in plain PyTorch: embedding, attention + MLP blocks, LM head."""

    def __init__(self, torch, device: str, vocab: int, width: int, layers: int, heads: int) -> None:
        self.torch, self.heads = torch, heads
        g = torch.Generator().manual_seed(0)

        def weight(*size):
            return (torch.randn(*size, generator=g) * 0.02).to(device)

        self.embed = weight(vocab, width)
        self.blocks = [(weight(width, 3 * width), weight(width, width), weight(width, 4 * width), weight(4 * width, width))
                       for _ in range(layers)]
        self.head = weight(width, vocab)

    def forward(self, tokens, caches: list | None):
        """Logits of the last position of each sequence; ``caches`` (per layer, (k, v)) grow by the new tokens."""
        torch = self.torch
        F = torch.nn.functional
        x = self.embed[tokens]  # [b, t, w]
        b, t, w = x.shape
        new_caches = []
        for n, (qkv, out, up, down) in enumerate(self.blocks):
            q, k, v = (x @ qkv).split(w, dim=-1)
            q, k, v = (y.view(b, t, self.heads, w // self.heads).transpose(1, 2) for y in (q, k, v))
            if caches is not None:
                k = torch.cat([caches[n][0], k], dim=2)
                v = torch.cat([caches[n][1], v], dim=2)
            new_caches.append((k, v))
            attended = F.scaled_dot_product_attention(q, k, v, is_causal=caches is None)
            x = x + attended.transpose(1, 2).reshape(b, t, w) @ out
            x = x + F.gelu(x @ up) @ down
        return x[:, -1] @ self.head, new_caches


def model(device: Device, rng: random.Random, steps: int, max_entries: int, cut) -> None:
    """Ordinary model code serving requests: prefill, decode with a growing KV cache, copies on a side stream."""
    torch = device.torch
    backend = device.backend
    cuda = device.kind == "cuda"
    net = TinyDecoder(torch, backend.device, vocab=8192 if cuda else 256, width=512 if cuda else 32,
                      layers=4 if cuda else 2, heads=8 if cuda else 2)
    side = backend.Stream()
    device.start_history(max_entries)
    requests = []  # [caches, tokens generated, tokens to generate]
    with torch.inference_mode():
        for step in range(steps):
            if not requests or (len(requests) < 6 and rng.random() < 0.3):  # a batch arrives: prefill
                batch, length = rng.randint(1, 4), rng.randint(8, 384 if cuda else 24)
                tokens = torch.randint(0, net.embed.shape[0], (batch, length), device=backend.device)
                logits, caches = net.forward(tokens, None)
                requests.append([caches, logits.argmax(-1, keepdim=True), rng.randint(4, 48)])
            request = rng.choice(requests)  # one decode step of one batch
            logits, request[0] = net.forward(request[1], request[0])
            request[1] = logits.argmax(-1, keepdim=True)
            request[2] -= 1
            if rng.random() < 0.2:  # the logits leave on a side stream, as a sampler's copy would
                side.wait_stream(backend.current_stream())
                with backend.stream(side):
                    probs = torch.softmax(logits.float(), dim=-1)
                backend.record_stream(logits, side)
                del probs
            if request[2] <= 0:
                requests = [other for other in requests if other is not request]
            if rng.random() < 0.01:
                backend.synchronize()
                backend.empty_cache()
            cut(step)


def churn(device: Device, rng: random.Random, steps: int, max_entries: int, cut) -> None:
    """The differential corpus's random program, run in slices so that snapshots can be taken between them."""
    sys.path.insert(0, HERE)
    from record_corpus import Program

    if device.kind == "sim":  # the program makes its own simulated device: snapshots must come from it
        device.backend.close()
    program = Program(rng.randrange(10**6), device.kind, None, max_entries)
    if device.kind == "sim":
        device.backend = program.backend
    program.start_history()
    for step in range(0, steps, 50):
        program.run(step + 50)
        cut(step + 49)


WORKLOADS = {"suite": suite, "model": model, "churn": churn}


def record_run(spec: dict, outdir: str, command: str) -> list[dict]:
    """Child process: run one workload, write a trace at each cut point; their index rows."""
    device = Device(spec["device"], spec["settings"])
    rng = random.Random(spec["seed"])
    steps = spec["steps"]
    first = steps // 3  # the ring has wrapped by then (the run writes far more than max_entries entries)
    cut_steps = sorted({first + k * (steps - 1 - first) // max(CUTS - 1, 1) for k in range(CUTS)})
    rows = []

    def cut(step: int) -> None:
        """Told each step as it ends: a snapshot when the next cut point is reached."""
        if len(rows) == len(cut_steps) or step < cut_steps[len(rows)]:
            return
        snapshot = device.snapshot()
        events = len(snapshot["device_traces"][0]) if snapshot["device_traces"] else 0
        name = f"{spec['name']}_cut{len(rows)}"
        snapshot["corpus"] = {
            "name": name, "workload": spec["workload"], "variant": "wrapped", "settings": spec["settings"],
            "fraction": None, "max_entries": spec["max_entries"], "cut": len(rows), "step": step, "steps": steps,
            "wrapped": events >= spec["max_entries"], "events": events, **device.versions(), "command": command,
            "recorded_unix_time": int(time.time()),
        }
        path = os.path.join(outdir, f"{name}.pickle.gz")
        with gzip.open(path, "wb", compresslevel=9) as f:
            pickle.dump(snapshot, f, protocol=4)
        rows.append({k: snapshot["corpus"][k] for k in ("name", "workload", "settings", "max_entries", "step", "wrapped",
                                                        "events")} | {"segments": len(snapshot["segments"]),
                                                                      "bytes": os.path.getsize(path)})
        print(ROW + json.dumps(rows[-1]), flush=True)  # at once: a run that dies later keeps what it wrote

    WORKLOADS[spec["workload"]](device, rng, steps, spec["max_entries"], cut)
    return rows


# ----------------------------------------------------------------------------- driver (parent process)


def specs_for(device: str, scale: float) -> list[dict]:
    specs = []
    for workload, (rings, steps) in RUNS.items():
        for setting, settings in SETTINGS.items():
            for ring in rings:
                name = f"{workload}_{setting}_ring{ring}"
                specs.append({"name": name, "workload": workload, "settings": settings, "max_entries": ring,
                              "steps": max(30, math.ceil(steps * scale)), "device": device,
                              "seed": sum(map(ord, name))})
    return specs


def replay_all(outdir: str, rows: list[dict]) -> None:
    sys.path.insert(0, REPO)
    from graphborrow.fidelity.replay import replay_trace

    for row in rows:
        try:
            report = replay_trace(os.path.join(outdir, f"{row['name']}.pickle.gz"))
            print(f"{row['name']}: {str(report).splitlines()[0]}", flush=True)
        except Exception as error:  # replay trouble must not lose the recordings
            print(f"{row['name']}: replay failed: {type(error).__name__}: {error}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("outdir")
    parser.add_argument("--jobs", type=int, default=4, help="runs recorded at once (one process each)")
    parser.add_argument("--steps-scale", type=float, default=1.0, help="scale every run's length")
    parser.add_argument("--only", help="comma-separated run names (e.g. suite_off_ring1000)")
    parser.add_argument("--device", choices=("cuda", "sim"), default="cuda")
    parser.add_argument("--no-replay", action="store_true", help="do not replay the traces afterwards")
    args = parser.parse_args(argv)
    child = os.environ.get(CHILD_ENV)
    if child:  # a child process records one run (its spec and the parent's command in the environment)
        record_run(json.loads(child), args.outdir, os.environ.get(COMMAND_ENV, ""))
        return 0
    os.makedirs(args.outdir, exist_ok=True)
    specs = specs_for(args.device, args.steps_scale)
    if args.only:
        wanted = set(args.only.split(","))
        specs = [s for s in specs if s["name"] in wanted]
    command = "python scripts/record_wrapped.py " + " ".join(sys.argv[1:] if argv is None else argv)

    def launch(spec: dict) -> tuple[dict, list[dict], str]:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
        env.update({"PYTORCH_CUDA_ALLOC_CONF": spec["settings"], CHILD_ENV: json.dumps(spec), COMMAND_ENV: command})
        done = subprocess.run([sys.executable, os.path.abspath(__file__), args.outdir], env=env, capture_output=True,
                              text=True)
        rows = [json.loads(line[len(ROW):]) for line in done.stdout.splitlines() if line.startswith(ROW)]
        return spec, rows, "" if done.returncode == 0 else done.stderr[-3000:]

    start = time.time()
    rows, failed = [], []
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for spec, got, error in pool.map(launch, specs):
            rows += got
            print(f"{spec['name']}: {len(got)} traces" + (f"; FAILED:\n{error}" if error else ""), flush=True)
            if error:
                failed.append(spec["name"])
    rows.sort(key=lambda r: r["name"])
    write_atomic(os.path.join(args.outdir, "index.json"),
                 json.dumps({"command": command, "wall_s": round(time.time() - start, 1), "traces": rows}, indent=1))
    if not args.no_replay:
        replay_all(args.outdir, rows)
    if failed:
        print(f"failed runs: {failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
