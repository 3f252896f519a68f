"""Pools from real model code on a GPU: per workload the pool, its trace, idle runs, fit, saving.

    python benchmarks/model_pools.py --out data/models_h200

Workloads: the synthetic baseline (Llama-3-8B-shaped MLP blocks, 8192-token prefill graph,
as data/core_h200.json), every model of graphborrow.workloads.models.MODELS (2 layers, verify
graphs for batch 64..1 x 8 draft tokens against 1024 cached tokens, no prefill graph),
and Llama-3-8B again with a 1024-token prefill graph and with piecewise prefill graphs
(the prompt fills the context, so every workload's KV cache has the same length).
Each runs in its own process (a fresh CUDA context, as the simulated device starts
fresh; a failing workload is recorded with its error and the others go on) and writes
``<out>/<workload>.json.gz``:

* ``segments``: the shared pool's snapshot (frames stripped);
* ``trace``/``sites``: the allocator trace from before the model is built
  (``torch.cuda.memory._record_memory_history`` with Python stacks), each event's frames
  reduced to its innermost three ``file:line:function`` sites;
* ``sdpa_choices``: the backend ``torch._fused_sdp_choice`` picked for each attention call
  shape; ``blas_workspace_bytes``: what the first matmul on a new stream allocated;
* ``study``: summary, free runs under both rules, which verification steps fit (the
  capacity planner when installed), and the device memory a borrowed probability set
  saves (``mem_get_info``);
* ``params`` (to rebuild the same workload on the simulated device), command, torch,
  device, transformers version.

``<out>/summary.json`` collects the table rows and errors; ``scripts/model_pools_table.py``
turns it into the README table. CI then replays every recording on the simulated device
and compares the pools block for block (``tests/fidelity/test_model_pools_recorded.py``).
"""

from __future__ import annotations

import argparse
import inspect
import json
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SDP_BACKENDS = {-1: "error", 0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}


def portable(path) -> str:
    """A path as the project's files write it: relative to the repository, never a machine path.

    Outside the repository only the last component is kept (the recordings still name each
    other by file name, which is all a reader of ``summary.json`` needs).
    """
    path = Path(path).resolve()
    try:
        return path.relative_to(ROOT).as_posix()
    except ValueError:
        return path.name


def command_line(argv: list[str]) -> str:
    """The command that was run, with ``--out`` written as :func:`portable` writes paths."""
    args, out = [], list(argv)
    while out:
        arg = out.pop(0)
        if arg == "--out" and out:
            args += [arg, portable(out.pop(0))]
        elif arg.startswith("--out="):
            args.append("--out=" + portable(arg[len("--out="):]))
        else:
            args.append(arg)
    return " ".join(["python benchmarks/model_pools.py"] + args)


def workloads(args) -> dict[str, dict]:
    """Workload name -> (model, build_ladder parameters)."""
    from graphborrow.workloads.models import MODELS

    batches = [int(b) for b in args.batches.split(",")]
    common = dict(decode_batches=batches, draft_tokens=args.draft_tokens)
    out = {"synthetic": {"model": "synthetic", "params": dict(common, prefill_tokens=8192)}}
    for name in MODELS:
        out[name] = {"model": name, "params": dict(common, layers=args.layers, context=args.context,
                                                    prefill="none", tiny=False)}
    for mode in ("graph", "piecewise"):
        out[f"llama-3-8b+prefill-{mode}"] = {
            "model": "llama-3-8b",
            "params": dict(common, layers=args.layers, context=args.context, prefill=mode,
                           prefill_tokens=args.prefill_tokens, tiny=False),
        }
    return out


def _start_history(torch):
    record = torch.cuda.memory._record_memory_history
    kwargs = {"context": "all", "stacks": "python", "max_entries": 1_000_000}
    if "clear_history" in inspect.signature(record).parameters:
        kwargs["clear_history"] = True
    record("all", **kwargs)


def _cuda_choice(torch):
    def choose(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa):
        c = int(torch._fused_sdp_choice(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa))
        return SDP_BACKENDS.get(c, str(c))

    return choose


def _sim_choice(backend):
    from graphborrow.sim.attention import select_backend

    def choose(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa):
        return select_backend(backend.attention, q, k, v, attn_mask, dropout_p, is_causal, enable_gqa)

    return choose


def _watch_sdpa(torch, choices: dict, choose):
    """Record which backend is picked for each attention call shape (a host-side query only)."""
    from graphborrow.sim.attention import call_signature

    original = torch.nn.functional.scaled_dot_product_attention

    def scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                     enable_gqa=False):
        key = call_signature(q, k, attn_mask, is_causal, enable_gqa)
        if key not in choices:
            try:
                choices[key] = choose(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
            except Exception as e:  # an older torch without the query
                choices[key] = f"unknown ({type(e).__name__})"
        return original(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                        enable_gqa=enable_gqa)

    torch.nn.functional.scaled_dot_product_attention = scaled_dot_product_attention


def _blas_workspace(torch) -> dict:
    """Bytes the first cuBLAS matmul (and then a cuBLASLt one with bias) allocates on a new stream."""
    a = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(64, device="cuda", dtype=torch.bfloat16)
    out = {}
    for name, op in (("blas_workspace_bytes", lambda: a @ a),
                     ("blaslt_extra_bytes", lambda: torch.nn.functional.linear(a, a, bias))):
        stream = torch.cuda.Stream()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        with torch.cuda.stream(stream):
            if name == "blaslt_extra_bytes":
                _ = a @ a  # the stream's cuBLAS workspace first, so only Lt's extra shows
                del _
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated()
            c = op()
        torch.cuda.synchronize()
        out[name] = torch.cuda.memory_allocated() - before - 8192  # minus the 64x64 bf16 result block
        del c
    return out


def run_one(name: str, spec: dict, out_dir: Path, command: str, device: str = "cuda") -> dict:
    """Build, capture and study one workload; write its recording. ``device="sim"`` is the CPU dry run."""
    import torch
    import transformers

    from graphborrow.device import get_backend
    from graphborrow.fidelity.compare import recording, save_recording
    from graphborrow.studies.model_pools import study
    from graphborrow.workloads.ladder import build_ladder

    cuda = device == "cuda"
    backend = get_backend("cuda") if cuda else get_backend("sim", backed=False)
    source = {"command": command, "torch": torch.__version__, "transformers": transformers.__version__,
              "device": torch.cuda.get_device_name() if cuda else backend.describe()}
    if cuda:
        source.update(cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version())
    choices: dict = {}
    t0 = time.perf_counter()
    _watch_sdpa(torch, choices, _cuda_choice(torch) if cuda else _sim_choice(backend))
    if cuda:
        _start_history(torch)
    else:
        backend.record_memory_history(True)
    ladder = build_ladder(spec["model"], backend, **spec["params"]).capture()
    full = torch.cuda.memory._snapshot() if cuda else backend.full_snapshot()
    if cuda:
        torch.cuda.memory._record_memory_history(None)
    capture_s = time.perf_counter() - t0
    segments = ladder.snapshot()
    trace = full["device_traces"][torch.cuda.current_device() if cuda else 0]
    result = study(ladder, label=name)
    workspace = _blas_workspace(torch) if cuda else {"blas_workspace_bytes": backend.blas_workspace}
    rec = recording(
        segments, trace, workload=name, model=spec["model"], params=spec["params"], source=source,
        sdpa_choices=[{"call": k, "backend": v} for k, v in choices.items()],
        study=result, capture_seconds=round(capture_s, 2), trace_events=len(trace),
        allocator_settings=full.get("allocator_settings", {}), **workspace,
    )
    path = save_recording(rec, out_dir / f"{name}.json.gz")
    return {"workload": name, "file": portable(path), "study": result, "sdpa": sorted(set(choices.values())),
            "capture_seconds": rec["capture_seconds"], "trace_events": len(trace)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="data/models_h200")
    p.add_argument("--workloads", default="all", help="comma-separated names, or 'all'")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batches", default="64,32,16,8,4,2,1")
    p.add_argument("--draft-tokens", type=int, default=8)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--prefill-tokens", type=int, default=1024,
                   help="prompt of the prefill graphs (default: the context, so the KV cache is the same)")
    p.add_argument("--timeout", type=int, default=150, help="seconds per workload")
    p.add_argument("--device", default="cuda", choices=("cuda", "sim"),
                   help="'sim': a dry run on the layout-only simulated device (what CI runs)")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: run one workload here
    args = p.parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    command = command_line(list(sys.argv[1:] if argv is None else argv))
    table = workloads(args)

    if args.one:
        row = run_one(args.one, table[args.one], out_dir, command.replace(f" --one {args.one}", ""), args.device)
        print("RESULT " + json.dumps(row, default=str))
        return 0

    import torch
    import transformers

    names = list(table) if args.workloads == "all" else args.workloads.split(",")
    unknown = [n for n in names if n not in table]
    if unknown:
        p.error(f"unknown workloads {unknown}; choose from {list(table)}")
    device = torch.cuda.get_device_name() if args.device == "cuda" else "simulated device (layout only)"
    summary = {"command": command, "torch": torch.__version__, "device": device,
               "transformers": transformers.__version__, "workloads": [], "errors": {}}
    started = time.perf_counter()
    for name in names:
        cmd = [sys.executable, __file__, "--one", name] + (argv if argv is not None else sys.argv[1:])
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-15:]
                raise RuntimeError(f"exit code {proc.returncode}:\n" + "\n".join(tail))
            row = json.loads(lines[-1][len("RESULT "):])
            summary["workloads"].append(row)
            pool = row["study"]["pool"]
            print(f"{name:28s} {pool['reserved_bytes'] / 2**20:8.1f} MiB reserved, {pool['run_bytes'] / 2**20:8.1f} "
                  f"MiB idle in {pool['runs']} runs (largest {pool['largest_run'] / 2**20:.1f}); sdpa {row['sdpa']}; "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
        except Exception as e:  # keep going past a failing workload
            summary["errors"][name] = "".join(traceback.format_exception_only(type(e), e)).strip()
            print(f"{name:28s} FAILED: {summary['errors'][name]}", flush=True)
    summary["seconds"] = round(time.perf_counter() - started, 1)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    print(f"wrote {portable(out_dir / 'summary.json')} and {len(summary['workloads'])} recordings in {summary['seconds']} s")
    return 0 if not summary["errors"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
