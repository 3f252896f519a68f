"""The committed corpus: programs recorded on the H200, read back, simulated again and compared.

``data/fuzz/`` holds one gzipped JSON-lines file per kind of program (``fuzz``, ``rule``,
``probe``, ``model``), a recording per line (:mod:`.record`), and ``known_differences.json``:
the programs whose simulated run still differs from the GPU's, each with the cause, the
operation it is in and a count, which the tests compare against exactly (a new difference,
or a listed one gone, fails until it is modelled or listed).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Iterable, Iterator

from .generate import Program
from .run import ProgramComparison, compare_program, gpu_addresses, gpu_streams, simulate_program

__all__ = ["CORPUS", "KINDS", "check", "known_differences", "pack", "program_of", "read_corpus"]

CORPUS = Path(__file__).resolve().parents[3] / "data" / "fuzz"
KINDS = ("fuzz", "rule", "probe", "model")


def program_of(rec: dict) -> Program:
    """The program a recording ran."""
    return Program(name=rec["name"], kind=rec["kind"], source=rec["source"], settings=rec.get("settings") or "",
                   seed=rec.get("seed"))


def read_corpus(kinds: Iterable[str] = KINDS, directory: Path = CORPUS) -> Iterator[dict]:
    """Every recording of the given kinds, in file order.

    Raises:
        FileNotFoundError: a kind has no file in ``directory`` (name and path given).
    """
    for kind in kinds:
        path = Path(directory) / f"h200_{kind}.jsonl.gz"
        if not path.exists():
            raise FileNotFoundError(f"no recordings of kind {kind!r}: {path} is missing (scripts/record_fuzz.py "
                                    "records them on a GPU; scripts/pack_fuzz.py packs them)")
        with gzip.open(path, "rt", encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    yield json.loads(line)


def pack(recordings: Iterable[dict], directory: Path = CORPUS) -> dict[str, int]:
    """Write recordings into the per-kind files (replacing them); returns programs per kind."""
    by_kind: dict[str, list[dict]] = {}
    for rec in recordings:
        by_kind.setdefault(rec["kind"], []).append(rec)
    Path(directory).mkdir(parents=True, exist_ok=True)
    for kind, recs in by_kind.items():
        recs.sort(key=lambda r: (r.get("seed") is None, r.get("seed") or 0, r["name"]))
        with gzip.open(Path(directory) / f"h200_{kind}.jsonl.gz", "wt", encoding="utf-8", compresslevel=9) as f:
            for rec in recs:
                f.write(json.dumps(rec, separators=(",", ":")) + "\n")
    return {kind: len(recs) for kind, recs in by_kind.items()}


def check(rec: dict, backed: bool = False) -> ProgramComparison:
    """Run a recorded program on the simulated device (the GPU's cudaMalloc addresses followed)
    and compare it with the recording."""
    sim = simulate_program(program_of(rec), addresses=gpu_addresses(rec), backed=backed,
                           capacity=rec.get("total_memory"), streams=gpu_streams(rec))
    return compare_program(rec, sim)


def known_differences(directory: Path = CORPUS) -> dict[str, dict]:
    """Program name -> its listed difference (``cause``, ``operation``, ``counts``)."""
    path = Path(directory) / "known_differences.json"
    if not path.exists():
        return {}
    return {entry["program"]: entry for entry in json.loads(path.read_text())["differences"]}
