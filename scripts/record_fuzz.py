"""Record the differential corpus on a GPU: random programs, capture rules, probes, ordinary model scripts.

    python scripts/record_fuzz.py OUT --seeds 0:320 --jobs 14            # on a CUDA machine
    python scripts/record_fuzz.py OUT --seeds 0:4 --device sim --jobs 2  # a dry run on the simulated device
    python scripts/record_fuzz.py OUT --kinds train,reuse,tied,compile --seeds train=0:150,reuse=0:40 \
        --jobs 14 --budget 540 --pack OUT.tar.gz                         # training, reuse, tied, compile

Every program runs in a fresh process (a fresh CUDA context and caching allocator, as the
simulated device starts; ``PYTORCH_CUDA_ALLOC_CONF`` set to the program's setting) with
memory history on from its first line, and writes ``OUT/<name>.json.gz``
(:func:`graphborrow.fidelity.fuzz.record.record_here`). ``OUT/index.json`` lists every program
with its error (or none), its event count, the seconds it took, the command, torch, CUDA
and the device. ``--kinds`` picks among ``fuzz`` (:func:`graphborrow.fidelity.fuzz.generate`
for each seed), ``rule`` (CUDA's capture rules), ``probe`` (one operation at many shapes)
``model`` (:data:`graphborrow.workloads.plain.PLAIN_WORKLOADS`), ``train`` (random training
programs and backward probes, :mod:`graphborrow.fidelity.fuzz.training`), ``reuse`` (captures
with cross-stream frees, each with ``graph_capture_record_stream_reuse`` on and off:
:mod:`~graphborrow.fidelity.fuzz.reuse`), ``tied`` (transformers models with tied embeddings,
moved to the device: :mod:`~graphborrow.fidelity.fuzz.tied`) and ``compile`` (graphed callables
and ``torch.compile``'s CUDA graphs: :mod:`~graphborrow.fidelity.fuzz.compiled`). ``--seeds``
gives the random kinds' seeds, one range for all or ``KIND=FIRST:END`` per kind. ``--budget``
stops launching programs after that many seconds (the index says which were left out);
``--pack`` writes what was recorded, packed as ``data/fuzz/`` keeps it, into one ``.tar.gz``
to unpack at the repository's root.

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

KINDS = ("compile", "tied", "model", "probe", "rule", "fuzz", "train", "reuse")
TIMEOUT = {"model": 240, "probe": 240, "rule": 60, "fuzz": 90, "train": 120, "reuse": 90, "tied": 300, "compile": 400}
RANDOM_KINDS = ("fuzz", "train", "reuse")


def programs(kinds, seeds: dict) -> list:
    """The programs to record, longest first (``seeds``: random kind -> its range)."""
    from graphborrow.fidelity.fuzz.compiled import compiled_programs
    from graphborrow.fidelity.fuzz.generate import Program, generate
    from graphborrow.fidelity.fuzz.probes import probe_programs
    from graphborrow.fidelity.fuzz.reuse import generate_reuse
    from graphborrow.fidelity.fuzz.rules import rule_programs
    from graphborrow.fidelity.fuzz.tied import tied_programs
    from graphborrow.fidelity.fuzz.training import generate_training, training_probes
    from graphborrow.workloads.plain import PLAIN_WORKLOADS, script

    out = []
    if "compile" in kinds:
        out += compiled_programs()
    if "tied" in kinds:
        out += tied_programs()
    if "model" in kinds:
        out += [Program(name=f"model_{name}", kind="model", source=script(spec))
                for name, spec in PLAIN_WORKLOADS.items()]
    if "probe" in kinds:
        out += probe_programs()
    if "rule" in kinds:
        out += rule_programs()
    if "fuzz" in kinds:
        out += [generate(seed) for seed in seeds["fuzz"]]
    if "train" in kinds:
        out += training_probes() + [generate_training(seed) for seed in seeds["train"]]
    if "reuse" in kinds:
        out += [generate_reuse(seed, reuse) for seed in seeds["reuse"] for reuse in (True, False)]
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


def _range(text: str) -> range:
    first, _, last = text.partition(":")
    return range(int(first), int(last)) if last else range(int(first))


def _seeds(text: str) -> dict:
    """``FIRST:END`` (or a count) for every random kind, or ``KIND=FIRST:END,...`` per kind."""
    if "=" not in text:
        return {kind: _range(text) for kind in RANDOM_KINDS}
    out = {kind: range(0) for kind in RANDOM_KINDS}
    for part in text.split(","):
        kind, _, seeds = part.partition("=")
        if kind not in RANDOM_KINDS:
            raise SystemExit(f"--seeds: {kind!r} is not a random kind; choose from {RANDOM_KINDS}")
        out[kind] = _range(seeds)
    return out


def pack_recorded(out: Path, index: dict, archive: Path) -> dict:
    """Pack every recording under ``out`` into ``data/fuzz/h200_<kind>.jsonl.gz`` files and the run's
    index into ``data/fuzz/recorded/<archive name>.json``, all in one ``.tar.gz`` (relative to
    the repository's root); returns programs per kind."""
    import tarfile
    import tempfile

    from graphborrow.fidelity.compare import load_recording
    from graphborrow.fidelity.fuzz.corpus import pack

    recordings = [load_recording(path) for path in sorted(out.glob("*.json.gz"))]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "data" / "fuzz"
        counts = pack(recordings, folder)
        stem = archive.name.removesuffix(".tar.gz")
        (folder / "recorded").mkdir()
        (folder / "recorded" / f"{stem}.json").write_text(json.dumps(index, indent=1) + "\n")
        archive.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(archive, "w:gz") as tar:
            tar.add(Path(tmp) / "data", arcname="data")
    return counts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--seeds", default="0:320", help="random programs' seeds: FIRST:END (or a count), or "
                   "KIND=FIRST:END,... per kind")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, from {KINDS}")
    p.add_argument("--jobs", type=int, default=14)
    p.add_argument("--device", choices=("cuda", "sim"), default="cuda")
    p.add_argument("--only", default="", help="comma-separated program names (after --kinds)")
    p.add_argument("--budget", type=float, default=None, help="seconds after which no program is launched")
    p.add_argument("--pack", default=None, help="a .tar.gz to pack the recordings into, as data/fuzz keeps them")
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
    given = argv or sys.argv[1:]
    command = "python scripts/record_fuzz.py " + " ".join(
        "OUT" if a == args.out else Path(a).name if a == args.pack else a for a in given)
    env_base = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))

    start = time.perf_counter()

    def launch(program) -> dict:
        if args.budget is not None and time.perf_counter() - start > args.budget:
            return {"name": program.name, "kind": program.kind, "failed": f"not launched: past --budget {args.budget} s"}
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
    if args.pack:
        counts = pack_recorded(out, index, Path(args.pack))
        print(f"packed {counts} -> {args.pack} (unpack at the repository's root)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
