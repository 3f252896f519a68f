"""Record a differential corpus of real allocator traces from random workloads (needs a GPU).

    python scripts/record_corpus.py data/traces/corpus --seeds 36 --jobs 8

The simulator was written from PyTorch's source and checked against a few traces; this corpus
checks it against workloads nobody wrote it from. Each seed draws a random allocator setting and
a random program, and runs it in a fresh process (allocator settings are fixed per process):

- sizes log-uniform from 1 B to 256 MiB on one to four streams, frees in random order;
- ``record_stream`` of tensors used on a busy other stream, then freed (deferred frees);
- ``empty_cache``, device and stream synchronisation;
- CUDA graph captures into a shared ``graph_pool_handle()`` or a fresh pool, with allocations on
  the capture stream and on side streams joined to the capture, frees inside the capture, replays,
  graphs retired (deleted) and recaptured (a handle whose last graph is retired is replaced: the
  allocator refuses to reopen a released pool), out-of-memory inside a capture;
- ``torch.cuda.MemPool``s used through ``use_mem_pool`` and released before the end;
- with some settings a per-process memory fraction, so out-of-memory paths and the garbage
  collection threshold are exercised (an OOM is caught and the program goes on).

Variants of some seeds start recording late (``late_start``: history enabled after part of the
program ran) or overflow a small ring buffer (``ring_overflow``): the traces real serving engines
give. Each trace is written as ``<name>.pickle.gz``: torch's ``_snapshot()`` dict (frames stripped)
plus ``memory_stats`` (the real ``torch.cuda.memory_stats()`` at the end) and ``corpus`` (seed,
variant, settings, memory fraction, max_entries, versions, command, and the executed ``program``
with the pool each allocation was routed to — ground truth for tests of pool inference; replay
does not read it). ``index.json`` lists the traces.

``--device sim`` runs the same programs on the simulated device (default settings only): a dry run
of the generator without a GPU.
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

from graphborrow.fidelity.corpus import strip_frames

MiB = 2**20
MAX_ENTRIES = 200_000
OVERFLOW_ENTRIES = 1_000


# ----------------------------------------------------------------------------- settings


def draw_settings(rng: random.Random) -> tuple[str, float | None]:
    """A PYTORCH_CUDA_ALLOC_CONF string and a memory fraction (or None) for one seed."""
    options: list[str] = []
    kind = rng.choice(["default", "split", "split", "power2", "power2_dict", "gc", "expandable", "mixed"])
    fraction = None
    if kind in ("split", "mixed"):
        options.append(f"max_split_size_mb:{rng.choice([20, 32, 64, 100, 256])}")
        if rng.random() < 0.5:
            options.append(f"max_non_split_rounding_mb:{rng.choice([20, 64, 128, 512])}")
    if kind in ("power2", "mixed"):
        options.append(f"roundup_power2_divisions:{rng.choice([1, 2, 4, 8, 16])}")
    if kind == "power2_dict":
        options.append("roundup_power2_divisions:[" + rng.choice(["64:8,256:4,>:1", "1:16,8:8,>:2", "256:4,>:8"]) + "]")
    if kind in ("gc", "mixed"):
        options.append(f"garbage_collection_threshold:{rng.choice([0.5, 0.6, 0.8, 0.95])}")
        fraction = rng.choice([0.004, 0.008, 0.016])  # 0.6 .. 2.3 GB of an H200
    if kind == "expandable":
        options.append("expandable_segments:True")
        if rng.random() < 0.5:
            fraction = rng.choice([0.008, 0.016])
    if kind == "default" and rng.random() < 0.5:
        fraction = rng.choice([0.004, 0.01])
    return ",".join(options), fraction


# ----------------------------------------------------------------------------- the program (child process)


class Program:
    """Draws and runs one random allocator workload, logging every operation it executed."""

    def __init__(self, seed: int, device: str, history_from: int | None, max_entries: int,
                 fraction: float | None = None) -> None:
        import torch

        self.torch = torch
        self.rng = random.Random(seed)
        self.device = device
        self.history_from = history_from  # op index at which recording starts (None: before the first)
        self.max_entries = max_entries
        self.fraction = fraction
        self.log: list[dict] = []
        self.tensors: dict[int, tuple] = {}  # id -> (tensor, pool label)
        self.next_id = 0
        self.steps = 0
        if device == "sim":
            from graphborrow.device import get_backend

            self.backend = get_backend("sim", backed=False)
            self.cuda = None
        else:
            self.backend = None
            self.cuda = torch.cuda
        n_streams = self.rng.randint(1, 4)
        self.streams = [self._current_stream()] + [self._new_stream() for _ in range(n_streams - 1)]
        self.handles = [self._graph_pool_handle() for _ in range(self.rng.randint(1, 2))]
        self.graphs: list[dict] = []  # {"graph", "outputs": [ids], "pool": label}
        self.mempools: list[dict] = []  # {"pool", "label", "ids"}
        self.mempool_count = 0

    # device adapters: torch.cuda on a GPU, the simulated backend for a dry run
    def _current_stream(self):
        return self.backend.current_stream() if self.backend else self.cuda.current_stream()

    def _new_stream(self):
        return self.backend.Stream() if self.backend else self.cuda.Stream()

    def _stream_ctx(self, stream):
        return self.backend.stream(stream) if self.backend else self.cuda.stream(stream)

    def _graph_pool_handle(self):
        return self.backend.graph_pool_handle() if self.backend else self.cuda.graph_pool_handle()

    def _sleep(self, stream, microseconds: float) -> None:
        if self.backend:
            self.backend.sleep(stream, microseconds)
        else:
            with self.cuda.stream(stream):
                self.cuda._sleep(int(microseconds * 1500))  # ~1.5 GHz cycles per microsecond

    def _synchronize(self) -> None:
        (self.backend or self.cuda).synchronize()

    def _empty_cache(self) -> None:
        (self.backend or self.cuda).empty_cache()

    def _record_stream(self, tensor, stream) -> None:
        if self.backend:
            self.backend.record_stream(tensor, stream)
        else:
            tensor.record_stream(stream)

    def _oom_types(self):
        return (self.torch.OutOfMemoryError,)

    def _size(self) -> int:
        return max(1, int(math.exp(self.rng.uniform(0.0, math.log(256 * MiB)))))

    def _empty(self, nbytes: int):
        return self.torch.empty(nbytes, dtype=self.torch.uint8, device="cuda")

    # one logged operation
    def _op(self, kind: str, **fields) -> dict:
        entry = {"op": kind, **fields}
        self.log.append(entry)
        self.steps += 1
        if self.history_from is not None and self.steps == self.history_from:
            self.start_history()
            self.log.append({"op": "history_started"})
        return entry

    def start_history(self) -> None:
        if self.backend:
            self.backend.record_memory_history(True, max_entries=self.max_entries)
        else:
            self.cuda.memory._record_memory_history("all", context=None, stacks="python", max_entries=self.max_entries)

    def alloc(self, stream_index: int, pool: str, keep: bool = True) -> int | None:
        nbytes = self._size()
        entry = self._op("alloc", id=self.next_id, bytes=nbytes, stream=stream_index, pool=pool)
        try:
            with self._stream_ctx(self.streams[stream_index]):
                tensor = self._empty(nbytes)
        except self._oom_types():
            entry["outcome"] = "oom"
            return None
        entry["outcome"] = "ok"
        ident = self.next_id
        self.next_id += 1
        if keep:
            self.tensors[ident] = (tensor, pool)
        return ident

    def free(self, ident: int) -> None:
        self._op("free", id=ident)
        self.tensors.pop(ident, None)

    def cross_stream_free(self) -> None:
        if not self.tensors or len(self.streams) < 2:
            return
        ident = self.rng.choice(list(self.tensors))
        tensor, _ = self.tensors[ident]
        other = self.rng.randrange(1, len(self.streams))
        busy_us = self.rng.uniform(50, 3000)
        self._op("record_stream_free", id=ident, stream=other, busy_us=round(busy_us, 1))
        self._sleep(self.streams[other], busy_us)
        self._record_stream(tensor, self.streams[other])
        del tensor
        self.tensors.pop(ident, None)

    def capture(self) -> None:
        torch = self.torch
        shared = self.rng.random() < 0.7
        handle_index = self.rng.randrange(len(self.handles))
        label = f"graph_handle{handle_index}" if shared else f"graph_private{len(self.graphs)}"
        pool = self.handles[handle_index] if shared else None
        g = self.backend.CUDAGraph() if self.backend else torch.cuda.CUDAGraph()
        side_used = len(self.streams) > 1 and self.rng.random() < 0.5
        plan = []
        for _ in range(self.rng.randint(1, 10)):
            r = self.rng.random()
            if r < 0.2 and side_used:
                plan.append(("side", self._capture_size()))
            elif r < 0.35 and plan:
                plan.append(("free", None))
            else:
                plan.append(("alloc", self._capture_size()))
        entry = self._op("capture", pool=label, plan=[[k, n] for k, n in plan])
        outputs, temps = [], []
        graph_ctx = self.backend.graph(g, pool=pool) if self.backend else torch.cuda.graph(g, pool=pool)
        try:
            with graph_ctx:
                capture_stream = self._current_stream()
                side = self.streams[1] if side_used else None
                for kind, nbytes in plan:
                    if kind == "alloc":
                        t = self._empty(nbytes)
                        t.zero_()
                        temps.append(t)
                    elif kind == "side":
                        side.wait_stream(capture_stream)
                        with self._stream_ctx(side):
                            t = self._empty(nbytes)
                            t.zero_()
                        capture_stream.wait_stream(side)
                        temps.append(t)
                    elif temps:
                        temps.pop(self.rng.randrange(len(temps)))
                keep = [t for t in temps if self.rng.random() < 0.4]
                temps.clear()
        except self._oom_types():
            entry["outcome"] = "oom"  # the capture is invalid; its graph and tensors are dropped
            temps.clear()
            return
        entry["outcome"] = "ok"
        ids = []
        for t in keep:
            self.tensors[self.next_id] = (t, label)
            ids.append(self.next_id)
            self.next_id += 1
        entry["outputs"] = ids
        outputs.extend(ids)
        self.graphs.append({"graph": g, "outputs": outputs, "pool": label, "handle": handle_index if shared else None})

    def _capture_size(self) -> int:
        # captures hold what a forward pass holds: below 64 MiB, below 16 MiB under a memory fraction
        top = 16 * MiB if self.fraction else 64 * MiB
        return max(1, int(math.exp(self.rng.uniform(0.0, math.log(top)))))

    def replay(self) -> None:
        if not self.graphs:
            return
        i = self.rng.randrange(len(self.graphs))
        self._op("replay", graph=i)
        self.graphs[i]["graph"].replay()

    def retire_graph(self) -> None:
        if not self.graphs:
            return
        i = self.rng.randrange(len(self.graphs))
        info = self.graphs.pop(i)
        self._op("retire_graph", graph=i, pool=info["pool"], outputs=info["outputs"])
        for ident in info["outputs"]:
            self.tensors.pop(ident, None)
        self._synchronize()
        handle = info["handle"]
        del info
        if handle is not None and not any(g["handle"] == handle for g in self.graphs):
            # the handle's last graph is gone and its pool released: later captures share a new handle
            self.handles[handle] = self._graph_pool_handle()
            self._op("new_graph_pool_handle", handle=handle)

    def mempool_session(self) -> None:
        torch = self.torch
        if self.mempools and self.rng.random() < 0.5:
            info = self.rng.choice(self.mempools)
        else:
            pool = self.backend.MemPool() if self.backend else torch.cuda.MemPool()
            info = {"pool": pool, "label": f"mempool{self.mempool_count}", "ids": []}
            self.mempool_count += 1
            self.mempools.append(info)
        self._op("use_mem_pool", pool=info["label"])
        ctx = self.backend.use_mem_pool(info["pool"]) if self.backend else torch.cuda.use_mem_pool(info["pool"])
        with ctx:
            for _ in range(self.rng.randint(1, 8)):
                if self.rng.random() < 0.25 and info["ids"]:
                    ident = info["ids"].pop(self.rng.randrange(len(info["ids"])))
                    self.free(ident)
                else:
                    ident = self.alloc(self.rng.randrange(len(self.streams)), info["label"])
                    if ident is not None:
                        info["ids"].append(ident)
        self._op("end_mem_pool", pool=info["label"])

    def release_mempool(self) -> None:
        if not self.mempools:
            return
        info = self.mempools.pop(self.rng.randrange(len(self.mempools)))
        outlive = self.rng.random() < 0.3  # sometimes tensors outlive their pool object
        survivors = [i for i in info["ids"] if i in self.tensors] if outlive else []
        self._op("release_mem_pool", pool=info["label"], survivors=survivors)
        if not outlive:
            for ident in info["ids"]:
                self.tensors.pop(ident, None)
        info["ids"].clear()
        del info

    def run(self, steps: int) -> None:
        rng = self.rng
        live_budget = 6 * 2**30
        while self.steps < steps:
            r = rng.random()
            live = sum(t.untyped_storage().nbytes() for t, _ in self.tensors.values()) if r < 0.05 else 0
            if live > live_budget:
                for ident in rng.sample(list(self.tensors), len(self.tensors) // 2):
                    self.free(ident)
            elif r < 0.45 or not self.tensors:
                self.alloc(rng.randrange(len(self.streams)), "default")
            elif r < 0.75:
                self.free(rng.choice(list(self.tensors)))
            elif r < 0.80:
                self.cross_stream_free()
            elif r < 0.82:
                self._op("empty_cache")
                self._empty_cache()
            elif r < 0.85:
                self._op("synchronize")
                self._synchronize()
            elif r < 0.87:
                stream = rng.randrange(len(self.streams))
                self._op("sleep", stream=stream)
                self._sleep(self.streams[stream], rng.uniform(10, 500))
            elif r < 0.91:
                self.capture()
            elif r < 0.93:
                self.replay()
            elif r < 0.95:
                self.retire_graph()
            elif r < 0.985:
                self.mempool_session()
            else:
                self.release_mempool()
        self._op("end")
        self._synchronize()


def record_one(spec: dict, outdir: str, command: str) -> dict:
    """Child process: run one program and write its trace."""
    import torch

    device = spec["device"]
    fraction = spec["fraction"]
    if device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("record_corpus.py needs a CUDA device (or --device sim for a dry run)")
        torch.cuda.init()
        if fraction:
            torch.cuda.set_per_process_memory_fraction(fraction)
    program = Program(spec["seed"], device, spec["history_from"], spec["max_entries"], fraction)
    if spec["history_from"] is None:
        program.start_history()
    error = None
    try:
        program.run(spec["steps"])
    except Exception as exc:  # keep the trace: it is still a faithful record up to here
        error = f"{type(exc).__name__}: {exc}"
    if device == "cuda":
        torch.cuda.synchronize()
        snapshot = strip_frames(torch.cuda.memory._snapshot())
        stats = torch.cuda.memory_stats()
        versions = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": torch.cuda.get_device_name()}
    else:
        snapshot = program.backend.full_snapshot()
        stats = program.backend.memory_stats()
        versions = {"torch": torch.__version__, "cuda": None, "device": program.backend.describe()}
    events = sum(len(t) for t in snapshot["device_traces"])
    snapshot["memory_stats"] = dict(stats)
    snapshot["corpus"] = {
        **{k: spec[k] for k in ("name", "seed", "variant", "settings", "fraction", "max_entries", "history_from", "steps")},
        **versions,
        "command": command,
        "events": events,
        "error": error,
        "program": program.log,
        "recorded_unix_time": int(time.time()),
    }
    path = os.path.join(outdir, f"{spec['name']}.pickle.gz")
    with gzip.open(path, "wb", compresslevel=9) as f:
        pickle.dump(snapshot, f, protocol=4)
    summary = {
        "name": spec["name"], "seed": spec["seed"], "variant": spec["variant"], "settings": spec["settings"],
        "fraction": fraction, "events": events, "ops": len(program.log), "error": error,
        "segments": len(snapshot["segments"]), "bytes": os.path.getsize(path),
    }
    print(json.dumps(summary), flush=True)
    return summary


# ----------------------------------------------------------------------------- driver


def specs_for(seeds: int, first_seed: int, device: str, steps: int, variants: int) -> list[dict]:
    specs = []
    for seed in range(first_seed, first_seed + seeds):
        rng = random.Random(1_000_003 * seed + 17)
        settings, fraction = draw_settings(rng) if device == "cuda" else ("", None)
        base = {"seed": seed, "settings": settings, "fraction": fraction, "device": device, "steps": steps}
        specs.append({**base, "name": f"seed{seed:03d}", "variant": "full", "history_from": None,
                      "max_entries": MAX_ENTRIES})
        if seed - first_seed < variants:
            specs.append({**base, "name": f"seed{seed:03d}_late", "variant": "late_start",
                          "history_from": rng.randint(steps // 4, steps // 2), "max_entries": MAX_ENTRIES})
            specs.append({**base, "name": f"seed{seed:03d}_ring", "variant": "ring_overflow",
                          "history_from": None, "max_entries": OVERFLOW_ENTRIES})
    return specs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("outdir")
    parser.add_argument("--seeds", type=int, default=36, help="number of random programs (default 36)")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--variants", type=int, default=8, help="seeds that also get late-start and ring-overflow variants")
    parser.add_argument("--steps", type=int, default=1200, help="operations per program")
    parser.add_argument("--jobs", type=int, default=8, help="programs recorded at once (one process each)")
    parser.add_argument("--device", choices=("cuda", "sim"), default="cuda")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--command", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        record_one(json.loads(args.child), args.outdir, args.command or "")
        return 0
    for name, value, low in (("--seeds", args.seeds, 1), ("--steps", args.steps, 10), ("--jobs", args.jobs, 1),
                             ("--variants", args.variants, 0)):
        if value < low:
            parser.error(f"{name} must be at least {low}, got {value}")

    os.makedirs(args.outdir, exist_ok=True)
    command = " ".join(["python", "scripts/record_corpus.py", *sys.argv[1:]])
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env_base = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])))
    specs = specs_for(args.seeds, args.first_seed, args.device, args.steps, args.variants)

    def launch(spec: dict) -> dict:
        env = dict(env_base)
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        if spec["settings"]:
            env["PYTORCH_CUDA_ALLOC_CONF"] = spec["settings"]
        child = [sys.executable, os.path.abspath(__file__), args.outdir, "--child", json.dumps(spec),
                 "--command", command]
        result = subprocess.run(child, env=env, capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            return {"name": spec["name"], "failed": True, "stderr": result.stderr[-2000:]}
        return json.loads(result.stdout.strip().splitlines()[-1])

    start = time.time()
    with ThreadPoolExecutor(args.jobs) as pool:
        summaries = list(pool.map(launch, specs))
    index = {"command": command, "wall_s": round(time.time() - start, 1), "traces": summaries}
    with open(os.path.join(args.outdir, "index.json"), "w") as f:
        json.dump(index, f, indent=1)
    failed = [s for s in summaries if s.get("failed")]
    for s in summaries:
        print(("FAILED " if s.get("failed") else "") + json.dumps({k: v for k, v in s.items() if k != "stderr"}))
    for s in failed:
        print(f"--- {s['name']} stderr ---\n{s['stderr']}", file=sys.stderr)
    print(f"{len(summaries) - len(failed)} of {len(summaries)} traces in {time.time() - start:.0f} s -> {args.outdir}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
