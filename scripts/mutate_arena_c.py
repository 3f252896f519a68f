"""A small mutation pass over the arena's C source, which mutmut cannot reach.

Each mutant changes one operator or constant in ``graphborrow/core/arena.c`` (comparisons,
boolean and arithmetic operators, a check's result code, an early return). For each, a
copy of the package with the mutated C runs the arena's unit tests; the library is
rebuilt because its name carries the source hash. A mutant is *killed* when the tests
fail (or the build fails: counted apart), *survived* otherwise.

    python scripts/mutate_arena_c.py --json data/mutation_arena_c.json [--limit N] [--jobs 2]

Writes every mutant (line, original, mutation, outcome) to the JSON file and prints the
survivors. Not part of CI: a few minutes.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 180  # the unmutated tests take well under a minute
SOURCE = REPO / "graphborrow" / "arena.c"
# the arena's unit tests, without the build-cache ones (subprocesses, slow) and without
# conftest (torch): the arena needs neither
TESTS = [
    "-x", "--noconftest", "tests/core/test_arena.py",
    "-k", "not damaged and not failed_build and not unwritable and not stale and not two_processes",
]

# (pattern, replacement): applied at one occurrence at a time
OPERATORS = [
    (r"(?<![<>=!])<(?![<=])", "<="),
    (r"<=", "<"),
    (r"(?<![-<>=!])>(?![>=])", ">="),
    (r">=", ">"),
    (r"==", "!="),
    (r"!=", "=="),
    (r"&&", "||"),
    (r"\|\|", "&&"),
    (r"(?<=[\w)\]]) \+ (?=[\w(])", " - "),
    (r"(?<=[\w)\]]) - (?=[\w(])", " + "),
    (r"\+= ", "-= "),
    (r"\+\+", "--"),
    (r"return GB_OK;", "return GB_BAD_SIZE;"),
    (r"code = GB_\w+;", "code = GB_OK;"),
    (r"return NULL;", "return (void *)1;"),
    (r"\b1\b", "0"),
    (r"\b0\b", "1"),
]
# code the tests cannot reach by design, or mutating it only changes a message
SKIP_LINE = re.compile(r"^\s*(#|/?\*|//)|GB_SLOT|GB_QUERY\(|\(void\)device|enum \{|= -\d+,|^\s*GB_\w+ = ")


def mutants(text: str):
    lines = text.splitlines(keepends=True)
    for number, line in enumerate(lines, 1):
        if SKIP_LINE.search(line):
            continue
        code = line.split("//")[0].split("/*")[0]
        for pattern, replacement in OPERATORS:
            for match in re.finditer(pattern, code):
                mutated = line[: match.start()] + replacement + line[match.end():]
                yield number, line.strip(), mutated.strip(), "".join(lines[: number - 1] + [mutated] + lines[number:])


def library_tag(source: bytes) -> str:
    return hashlib.sha256(source + sys.platform.encode() + os.uname().machine.encode()).hexdigest()[:16]


def _imported_from(tmp: str, env: dict) -> str:
    probe = subprocess.run([sys.executable, "-c", "import graphborrow.core.arena as a; print(a.__file__)"],
                           cwd=tmp, env=env, capture_output=True, text=True)
    return probe.stdout


def run_one(args) -> dict:
    index, (number, before, after, text), cache = args
    with tempfile.TemporaryDirectory(prefix="arena-mutant-") as tmp:
        package = Path(tmp, "graphborrow")
        shutil.copytree(REPO / "graphborrow", package, ignore=shutil.ignore_patterns("__pycache__"))
        (package / "arena.c").write_text(text)
        shutil.copytree(REPO / "tests", Path(tmp, "tests"), ignore=shutil.ignore_patterns("__pycache__"))
        # run from the copy: the repository's own package must not shadow the mutant
        env = dict(os.environ, PYTHONPATH=tmp, GRAPHBORROW_CACHE_DIR=str(cache))
        start = time.perf_counter()
        try:
            result = subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS],
                cwd=tmp, env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
            )
        except subprocess.TimeoutExpired:  # e.g. a probe loop that never ends: the tests notice
            result = None
        if result is not None and result.returncode in (0, 1) and f"{tmp}/graphborrow" not in _imported_from(tmp, env):
            raise RuntimeError("the tests did not import the mutated package; nothing would be measured")
        tag = library_tag(text.encode())
        for leftover in Path(cache).glob(f"libgbarena-{tag}.so*"):
            leftover.unlink()
    if result is None:
        return {"id": index, "line": number, "original": before, "mutant": after, "outcome": "killed",
                "by": f"timeout ({TIMEOUT_S} s)", "seconds": round(time.perf_counter() - start, 1)}
    output = result.stdout + result.stderr
    if result.returncode == 0:
        outcome = "survived"
    elif "building the bump arena failed" in output:
        outcome = "build failed"
    else:
        outcome = "killed"
    return {"id": index, "line": number, "original": before, "mutant": after, "outcome": outcome,
            "seconds": round(time.perf_counter() - start, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--limit", type=int, default=0, help="test only the first N mutants (0: all)")
    parser.add_argument("--stride", type=int, default=1, help="test every Nth mutant (a sample spread over the file)")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--ids", default="", help="comma-separated mutant ids to run again (e.g. the survivors)")
    parser.add_argument("--update", action="store_true", help="merge these outcomes into the existing --json file")
    args = parser.parse_args()
    text = SOURCE.read_text()
    todo = list(enumerate(mutants(text)))
    if args.ids:
        wanted = {int(i) for i in args.ids.split(",")}
        todo = [(i, m) for i, m in todo if i in wanted]
    todo = todo[:: args.stride]
    if args.limit:
        todo = todo[: args.limit]
    print(f"{len(todo)} mutants of {SOURCE.relative_to(REPO)}")
    cache = Path(tempfile.mkdtemp(prefix="arena-mutant-cache-"))
    results = []
    try:
        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            for outcome in pool.map(run_one, [(i, m, cache) for i, m in todo]):
                results.append(outcome)
                print(f"{outcome['id']:4} line {outcome['line']:4} {outcome['outcome']:12} {outcome['mutant'][:70]}", flush=True)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    if args.update and args.json.exists():
        merged = {r["id"]: r for r in json.loads(args.json.read_text())["mutants"]}
        merged.update({r["id"]: {**r, "rerun": True} for r in results})
        results = [merged[i] for i in sorted(merged)]
    counts = {k: sum(r["outcome"] == k for r in results) for k in ("killed", "survived", "build failed")}
    valid = counts["killed"] + counts["survived"]
    record = {
        "what": "hand-rolled mutation pass over graphborrow/core/arena.c (mutmut mutates Python only)",
        "command": " ".join(["python", *sys.argv]),
        "tests": " ".join(["pytest", *TESTS]),
        "mutants_in_file": len(list(mutants(text))),
        "mutants_tested": len(results),
        "counts": counts,
        "score": round(counts["killed"] / valid, 4) if valid else None,
        "survivors": [r for r in results if r["outcome"] == "survived"],
        "mutants": results,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(record, indent=1) + "\n")
    print(f"killed {counts['killed']}, survived {counts['survived']}, build failed {counts['build failed']}; wrote {args.json}")


if __name__ == "__main__":
    main()
