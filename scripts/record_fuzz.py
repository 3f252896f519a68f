"""Record the differential corpus on a GPU: random programs, capture rules, probes, ordinary model scripts.

    python scripts/record_fuzz.py OUT --seeds 0:320 --jobs 14            # on a CUDA machine
    python scripts/record_fuzz.py OUT --seeds 0:4 --device sim --jobs 2  # a dry run on the simulated device

Every program runs in a fresh process (a fresh CUDA context and caching allocator, as the
simulated device starts; ``PYTORCH_CUDA_ALLOC_CONF`` set to the program's setting) with
memory history on from its first line, and writes ``OUT/<name>.json.gz``
(:func:`graphborrow.fidelity.fuzz.record.record_here`). ``OUT/index.json`` lists every program
with its error (or none), its event count, the seconds it took, the command, torch, CUDA
and the device. ``--kinds`` picks among ``fuzz`` (:func:`graphborrow.fidelity.fuzz.generate`
for each seed), ``rule`` (CUDA's capture rules), ``probe`` (one operation at many shapes)
and ``model`` (:data:`graphborrow.workloads.plain.PLAIN_WORKLOADS`).

``--device sim`` runs the same children on the simulated device, layout only: a dry run of
this script without a GPU (CI does not run it; ``make fuzz-sim-dry`` does).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

KINDS = ("model", "probe", "rule", "fuzz")
TIMEOUT = {"model": 240, "probe": 240, "rule": 60, "fuzz": 90}


def programs(kinds, seeds: range) -> list:
    """The programs to record, longest first."""
    from graphborrow.fidelity.fuzz.generate import Program, generate
    from graphborrow.fidelity.fuzz.probes import probe_programs
    from graphborrow.fidelity.fuzz.rules import rule_programs
    from graphborrow.workloads.plain import PLAIN_WORKLOADS, script

    out = []
    if "model" in kinds:
        out += [Program(name=f"model_{name}", kind="model", source=script(spec))
                for name, spec in PLAIN_WORKLOADS.items()]
    if "probe" in kinds:
        out += probe_programs()
    if "rule" in kinds:
        out += rule_programs()
    if "fuzz" in kinds:
        out += [generate(seed) for seed in seeds]
    return out


def _child(spec: str, device: str) -> int:
    if device == "cuda":
        from graphborrow.fidelity.fuzz.record import main_child

        return main_child(spec)
    from graphborrow.fidelity.compare import save_recording
    from graphborrow.fidelity.fuzz.generate import Program
    from graphborrow.fidelity.fuzz.run import simulate_program

    fields = json.loads(spec)
    out = Path(fields.pop("out"))
    program = Program(**fields)
    rec = simulate_program(program)
    save_recording(rec, out / f"{program.name}.json.gz")
    print("RECORDED " + json.dumps({"name": program.name, "error": rec["error"], "events": len(rec.get("trace", ())),
                                    "segments": len(rec["segments"])}))
    return 0


def _seeds(text: str) -> range:
    first, _, last = text.partition(":")
    return range(int(first), int(last)) if last else range(int(first))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--seeds", default="0:320", help="fuzz seeds FIRST:END (or a count)")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, from {KINDS}")
    p.add_argument("--jobs", type=int, default=14)
    p.add_argument("--device", choices=("cuda", "sim"), default="cuda")
    p.add_argument("--only", default="", help="comma-separated program names (after --kinds)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return _child(args.child, args.device)
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        p.error(f"unknown kinds {unknown}; choose from {KINDS}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    todo = programs(kinds, _seeds(args.seeds))
    if args.only:
        wanted = set(args.only.split(","))
        todo = [prog for prog in todo if prog.name in wanted]
    command = "python scripts/record_fuzz.py " + " ".join(a if a != args.out else "OUT" for a in (argv or sys.argv[1:]))
    env_base = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))

    def launch(program) -> dict:
        env = dict(env_base)
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        if program.settings:
            env["PYTORCH_CUDA_ALLOC_CONF"] = program.settings
        spec = json.dumps({"out": str(out), "name": program.name, "kind": program.kind, "source": program.source,
                           "settings": program.settings, "seed": program.seed})
        t0 = time.perf_counter()
        try:
            proc = subprocess.run([sys.executable, __file__, str(out), "--device", args.device, "--child", spec],
                                  env=env, capture_output=True, text=True, timeout=TIMEOUT[program.kind])
        except subprocess.TimeoutExpired:
            return {"name": program.name, "kind": program.kind, "failed": f"timed out after {TIMEOUT[program.kind]} s"}
        row = {"name": program.name, "kind": program.kind, "seconds": round(time.perf_counter() - t0, 1)}
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RECORDED ")]
        if proc.returncode != 0 or not lines:
            row["failed"] = (proc.stderr or proc.stdout)[-3000:]
        else:
            row.update(json.loads(lines[-1][len("RECORDED "):]))
        print(json.dumps({k: (v if k != "failed" else v[-300:]) for k, v in row.items()}), flush=True)
        return row

    start = time.perf_counter()
    with ThreadPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(launch, todo))
    index = {"command": command, "device": args.device, "wall_s": round(time.perf_counter() - start, 1),
             "programs": rows}
    if args.device == "cuda":
        import torch

        index.update(torch=torch.__version__, cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version(),
                     device_name=torch.cuda.get_device_name(), total_memory=torch.cuda.mem_get_info()[1])
    (out / "index.json").write_text(json.dumps(index, indent=1) + "\n")
    failed = [r for r in rows if "failed" in r]
    print(f"{len(rows) - len(failed)} of {len(rows)} programs recorded in {index['wall_s']} s -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
