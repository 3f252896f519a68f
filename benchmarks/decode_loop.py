"""Speculative decoding end to end on a GPU: tokens/s, acceptance and memory, borrowing off and on.

    python benchmarks/decode_loop.py                   # the grid, about 6 minutes on one H100/H200
    python benchmarks/decode_loop.py --quick           # a smoke run: bs 1, 8 x D 4, one repeat
    python benchmarks/decode_loop.py --device sim      # dry run on the layout-only simulated device

The loop (graphborrow.workloads.decode): a Llama-3-8B-shaped target (2 layers, bfloat16, random
weights, V = 128256) and a draft of set agreement (--agreement), prefill eager, the draft step and
the verify forward captured for the ladder --batches into one graph pool, largest first; every
verification mode of graphborrow.workloads.decode.MODES at every batch, in the same process.
Each D in --drafts runs in its own process (a fresh CUDA context, as the simulated device starts
fresh; a failing process is recorded and the others go on). A point is a memory pass (memory
read after every step, allocator history recorded) and --repeats timed runs (history off);
tokens/s are their median.

Writes, named after the device (``h200``, ``h100``, ``sim``) unless --out says otherwise:

* ``data/decode_loop_<device>.json``: command, torch, transformers, device, and per point tokens/s,
  mean accept length, ``max_memory_reserved``, ``mem_get_info`` before and after, the graph pool's
  and the borrow pool's reserved bytes, the device memory saved against ``plain`` and the KV tokens
  it would hold (Llama-3-8B's 32 layers), per-step memory; failed points with their error;
* ``data/decode_loop_<device>/D<d>.json.gz``: each process's recording for the CPU prediction
  (tests/workloads/test_decode_loop_recorded.py): the grid's parameters, the graph pool's segments,
  the allocator trace of building and capture and the segment events of every memory pass
  (graphborrow.workloads.decode_grid.History), the attention backend per call shape, the cuBLAS
  workspaces and the points;
* ``data/decode_loop_<device>/memory_viz.pickle``: allocator history of two steps of ``plain`` and
  of ``standard`` at batch 8, D = --viz-drafts, for https://pytorch.org/memory_viz.
"""

from __future__ import annotations

import argparse
import gc
import json
import pickle
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from model_pools import _blas_workspace, _cuda_choice, _sim_choice, _watch_sdpa, portable  # noqa: E402

VIZ_FRAMES = 8  # innermost Python frames kept per event in the memory_viz file (it stays a few MB)


def command_line(argv: list[str]) -> str:
    args, rest = [], list(argv)
    while rest:
        arg = rest.pop(0)
        args += [arg, portable(rest.pop(0))] if arg == "--out" and rest else [arg]
    return " ".join(["python benchmarks/decode_loop.py"] + args)


def device_label(name: str) -> str:
    """``h200`` / ``h100`` / ``sim`` / the GPU's name in lower case, for file names."""
    low = name.lower()
    for label in ("h200", "h100", "a100", "l40s"):
        if label in low:
            return label
    return "sim" if "simulated" in low else "".join(c if c.isalnum() else "_" for c in low)


def grid_spec(args, draft_tokens: int):
    from graphborrow.workloads.decode import MODES
    from graphborrow.workloads.decode_grid import SIM_MODES, GridSpec

    modes = tuple(args.modes.split(",")) if args.modes else (MODES if args.device == "cuda" else SIM_MODES)
    return GridSpec(draft_tokens=draft_tokens, batches=tuple(int(b) for b in args.batches.split(",")), modes=modes,
                    new_tokens=args.new_tokens, prompt_tokens=args.prompt_tokens, agreement=args.agreement,
                    temperature=args.temperature, repeats=args.repeats, layers=args.layers, seed=args.seed)


def memory_viz(torch, loop, out: Path, batch: int = 8) -> dict:
    """Two steps of ``plain`` and of ``standard`` with history (Python stacks), dumped for memory_viz."""
    torch.cuda.memory._record_memory_history("all", context="all", stacks="python", max_entries=200_000,
                                             clear_history=True)
    ran = {}
    for mode in ("plain", "standard"):
        try:
            ran[mode] = loop.run(batch, mode, new_tokens=loop.max_new_tokens, steps=2).steps
        except Exception as e:  # a mode that does not fit is left out of the picture
            ran[mode] = "".join(traceback.format_exception_only(type(e), e)).strip()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(None)
    for trace in snapshot.get("device_traces", ()):
        for e in trace:
            e["frames"] = e.get("frames", [])[:VIZ_FRAMES]
    for seg in snapshot.get("segments", ()):
        for b in seg.get("blocks", ()):
            b["frames"] = b.get("frames", [])[:VIZ_FRAMES]
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "wb") as f:
        pickle.dump(snapshot, f, protocol=4)
    return {"file": portable(out), "batch": batch, "steps": ran, "bytes": out.stat().st_size}


def run_one(args, draft_tokens: int, out_dir: Path, command: str) -> dict:
    """One process: build, capture and run the grid for ``draft_tokens``; write its recording."""
    import torch
    import transformers

    from graphborrow.device import get_backend
    from graphborrow.fidelity.compare import recording, save_recording
    from graphborrow.workloads.decode_grid import History, run_grid

    gc.collect()
    gc.freeze()  # a capture collects garbage first: keep the imports out of it
    cuda = args.device == "cuda"
    backend = get_backend("cuda") if cuda else get_backend("sim", backed=False)
    device = torch.cuda.get_device_name() if cuda else backend.describe()
    choices: dict = {}
    _watch_sdpa(torch, choices, _cuda_choice(torch) if cuda else _sim_choice(backend))
    spec = grid_spec(args, draft_tokens)
    steps = None if cuda else {(b, m): args.sim_steps for b in spec.batches for m in spec.modes}
    history = History(backend)  # before the loop is built: the recording starts from an empty device
    result = run_grid(backend, spec, steps=steps, history=history, log=lambda line: print(line, flush=True))
    extra = {}
    if cuda and draft_tokens == args.viz_drafts:
        loop = spec.loop(backend).capture()
        extra["memory_viz"] = memory_viz(torch, loop, out_dir / "memory_viz.pickle")
        del loop
    workspace = _blas_workspace(torch) if cuda else {"blas_workspace_bytes": backend.blas_workspace,
                                                     "blaslt_extra_bytes": backend.blaslt_workspace}
    source = {"command": command, "torch": torch.__version__, "transformers": transformers.__version__,
              "device": device}
    if cuda:
        source.update(cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version())
    for r in result["points"]:
        r.pop("tokens", None)  # same_tokens_as_plain says what a reader needs of them
    rec = recording(result.pop("graph_pool_segments"), history.entries, workload=f"decode_loop_D{draft_tokens}",
                    params=spec.params(), source=source,
                    sdpa_choices=[{"call": k, "backend": v} for k, v in choices.items()], **workspace, **result,
                    **extra)
    path = save_recording(rec, out_dir / f"D{draft_tokens}.json.gz")
    rows = [{k: v for k, v in r.items() if k != "accept_lengths"} for r in result["points"]]
    return {"draft_tokens": draft_tokens, "recording": portable(path), "loop": result["loop"],
            "kv_bytes_per_token": result["kv_bytes_per_token"], "graph_pool_bytes": result["graph_pool_bytes"],
            "free_runs": result["free_runs"], "capture_seconds": result["capture_seconds"], "points": rows, **extra}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="summary file (default data/decode_loop_<device>.json; recordings "
                                               "beside it in a folder of the same name)")
    p.add_argument("--device", default="cuda", choices=("cuda", "sim"),
                   help="'sim': a dry run on the layout-only simulated device (--sim-steps steps per point)")
    p.add_argument("--quick", action="store_true", help="bs 1, 8 x D 4, 8 new tokens, one repeat")
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--drafts", default="4,8")
    p.add_argument("--modes", default=None, help="comma-separated; default every mode the device runs")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--agreement", type=float, default=0.9)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sim-steps", type=int, default=2)
    p.add_argument("--viz-drafts", type=int, default=8, help="the D whose process also writes memory_viz.pickle")
    p.add_argument("--timeout", type=int, default=420, help="seconds per process")
    p.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # internal: run one D here
    return p


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    if args.quick:
        args.batches, args.drafts, args.new_tokens, args.repeats = "1,8", "4", 8, 1
    command = command_line(argv)

    import torch
    import transformers

    if args.device == "cuda" and not torch.cuda.is_available():
        _parser().error("no CUDA device here: run with --device sim for the dry run on the simulated device")
    device = torch.cuda.get_device_name() if args.device == "cuda" else "simulated device (layout only)"
    out = Path(args.out) if args.out else ROOT / "data" / f"decode_loop_{device_label(device)}.json"
    out_dir = out.with_suffix("")
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.one is not None:
        row = run_one(args, args.one, out_dir, command)
        print("RESULT " + json.dumps(row, default=str), flush=True)
        return 0

    summary = {"command": command, "torch": torch.__version__, "transformers": transformers.__version__,
               "device": device, "processes": [], "errors": {}}
    if args.device == "cuda":
        summary["cuda"] = torch.version.cuda
    started = time.perf_counter()
    for d in (int(x) for x in args.drafts.split(",")):
        cmd = [sys.executable, __file__, "--one", str(d)] + argv
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=args.timeout)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            print("\n".join(ln for ln in proc.stdout.splitlines() if not ln.startswith("RESULT ")), flush=True)
            if proc.returncode != 0 or not lines:
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-15:]
                raise RuntimeError(f"exit code {proc.returncode}:\n" + "\n".join(tail))
            summary["processes"].append(json.loads(lines[-1][len("RESULT "):]))
            print(f"D = {d}: {time.perf_counter() - t0:.0f} s", flush=True)
        except Exception as e:  # keep going past a failing process
            summary["errors"][f"D{d}"] = "".join(traceback.format_exception_only(type(e), e)).strip()
            print(f"D = {d} FAILED: {summary['errors'][f'D{d}']}", flush=True)
    summary["seconds"] = round(time.perf_counter() - started, 1)
    out.write_text(json.dumps(summary, indent=1, default=str) + "\n")
    print(f"wrote {portable(out)} and {len(summary['processes'])} recordings in {summary['seconds']} s")
    return 0 if not summary["errors"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
