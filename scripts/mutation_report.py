"""Collect a mutation run into one record: mutmut's results for the Python modules, the
hand-rolled pass over arena.c, and the survivors judged harmless, each with its reason.

    python scripts/mutation_report.py --out data/mutation.json [--c-json data/mutation_arena_c.json]

Run after ``mutmut run`` (from the repository root, where ``mutants/`` is) and
``scripts/mutate_arena_c.py``; ``make mutation`` runs all three.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import re
import subprocess
import sys
from collections import Counter
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[1]
# The modules that hold rules, this record's share of [tool.mutmut] only_mutate (the capacity
# planner's mutants are scored by scripts/mutation_score.py, make mutation-capacity).
RULE_MODULES = (
    "graphborrow/core/arena.py", "graphborrow/core/runs.py", "graphborrow/core/snapshot.py", "graphborrow/core/borrow.py",
    "graphborrow/allocator/stats.py", "graphborrow/allocator/restore.py",
)
# Of the simulated allocator only the statistics: all of allocator/stats.py (Stat, StatArray,
# DeviceStats, update_stat_array) and restoring them (restore's take_over_stats).
STAT_MUTANTS = (
    "graphborrow.allocator.stats.*",
    "graphborrow.allocator.restore.x_take_over_stats*",
)
RULE_MUTANTS = tuple(m[:-3].replace("/", ".") + ".*" for m in RULE_MODULES[:-2]) + STAT_MUTANTS

# Survivors looked at and judged harmless: mutant name (fnmatch pattern) -> why.
# A survivor not listed here (and not a wording-only change, see _only_wording) is one a
# test should kill.
HARMLESS_PY: dict[str, str] = {
    "graphborrow.core.arena.x_library_path__mutmut_6": (
        "the length of the source hash in the library's name (16 or 17 hex digits): any length names "
        "one build per source"
    ),
    # mkstemp's prefix and suffix (18-27), the digest's .sha256 suffix (35, 36)
    **dict.fromkeys(
        ("graphborrow.core.arena.x_library_path__mutmut_1[89]", "graphborrow.core.arena.x_library_path__mutmut_2[124-7]",
         "graphborrow.core.arena.x_library_path__mutmut_3[56]"),
        "the build's temporary file names: the files still appear by atomic rename under their final "
        "names and are verified by digest",
    ),
    "graphborrow.core.arena.x_library_path__mutmut_43": (
        "-fpic instead of -fPIC: both give position-independent code; they differ only in the size "
        "limit of the global offset table on some targets, far above this library's few symbols"
    ),
    "graphborrow.core.arena.x_library_path__mutmut_39": (
        "-o2 instead of -O2: gcc and clang take it as an output name that the later -o overrides, so the "
        "library is built without optimisation; it behaves the same, only its own code runs slower"
    ),
    "graphborrow.core.arena.x_library_path__mutmut_44": (
        "-FPIC instead of -fPIC: taken as a framework directory (-F PIC); toolchains that build "
        "position-independent code by default give the same library, the others fail the link loudly"
    ),
    "graphborrow.core.arena.x__remove_stale_temporaries__mutmut_[18]": "the age boundary (> or >=, 3600 or 3601 s) of a one-hour sweep",
    "graphborrow.core.arena.x_describe_free_error__mutmut_1": (
        "the default of live_size, which only the size-mismatch message reads and every caller passes"
    ),
    "graphborrow.core.arena.xǁBumpArenaǁset_extents__mutmut_2[78]": (
        "weakens the Python bound check on the end address; the C check refuses the same extent "
        "with the same message (tested by calling C directly)"
    ),
    "graphborrow.core.arena.x__check__mutmut_[3-7]": (
        "the message of C codes the Python checks always pre-empt (and the fallback text for a code "
        "the C side never returns)"
    ),
    "graphborrow.core.arena.x__library__mutmut_7": (
        "gb_arena_set_extents without argtypes: the two ctypes arrays still pass as pointers, and the "
        "count (at most 64, checked before) passes as a C int that the x86-64 and AArch64 calling "
        "conventions widen into the size_t register unchanged"
    ),
    "graphborrow.core.arena.x__library__mutmut_[56]": (
        "gb_arena_acquire / gb_arena_release without argtypes: their arguments are slot numbers and "
        "flags, Python ints ctypes passes as the C ints they take"
    ),
    "graphborrow.core.arena.x__library__mutmut_[89]": (
        "POINTER(None) (a void pointer) for set_extents' bases or sizes: the ctypes array passes as the "
        "same address either way"
    ),
    "graphborrow.core.arena.x__library__mutmut_10": (
        "gb_arena_set_align without argtypes: the slot and the alignment (a power of two below 2**31, "
        "checked before) pass as C ints the calling convention widens into the size_t register unchanged"
    ),
    "graphborrow.core.arena.x__library__mutmut_37": (
        "the slot-only queries (cursor, freed, ...) without argtypes: their one argument is a slot "
        "number, a Python int ctypes passes as the C int they take; restype stays size_t"
    ),
    "graphborrow.core.runs.x_summarize__mutmut_17": "passes the default policy explicitly or not: the same call",
    "graphborrow.core.arena.xǁBumpArenaǁraw_alloc__mutmut_1": "the unused stream argument's default",
    "graphborrow.core.arena.xǁBumpArenaǁraw_delete__mutmut_1": "the unused stream argument's default",
    "graphborrow.core.runs.x__runs_of__mutmut_2[68]": (
        "a hole that only touches a run (hole_end == a, or a + n == hole_start) then takes the cutting "
        "branch, which keeps the same (a, n) whole: the same runs"
    ),
    "graphborrow.core.borrow.xǁBorrowStateǁcan_fit__mutmut_4[24]": (
        "the default of a segment's segment_type: torch's and the simulator's snapshots always carry "
        "it, so the default is never read"
    ),
    "graphborrow.core.borrow.xǁBorrowStateǁ_pool_snapshot__mutmut_4": (
        "asks for every pool's segments instead of this pool's: the filter on segment_pool_id that "
        "follows (torch and the simulator fill it) keeps the same segments"
    ),
    "graphborrow.core.snapshot.x__check_segment__mutmut_130": (
        "start >= at instead of start > at inside the branch for start != at: the same test"
    ),
    "graphborrow.core.snapshot.x__block_at__mutmut_15": (
        "the text of an internal assertion no input reaches: callers only look up addresses inside a "
        "segment whose blocks were checked to tile it"
    ),
    "graphborrow.core.borrow.xǁBorrowStateǁstats__mutmut_3": "free_runs() of a disabled state is [] already",
    "graphborrow.allocator.stats.x_update_stat_array__mutmut_5": (
        "amount >= 1 instead of >= 0: an amount of 0 then goes through decrease(0) instead of "
        "increase(0), and both leave current, peak, allocated and freed as they were"
    ),
    "graphborrow.allocator.stats.xǁStatǁincrease__mutmut_5": (
        "current >= peak instead of >: when they are equal, peak = current assigns the value it has"
    ),
    "graphborrow.core.borrow.xǁBorrowStateǁ_raise_on_live_borrows__mutmut_5": (
        "check_pending = None instead of False: it is only ever tested for truth"
    ),
    "graphborrow.core.arena.xǁBumpArenaǁ_free__mutmut_19": (
        "nbytes > 2**63 instead of >=: 2**63 itself then reaches the int64 argument, which ctypes "
        "wraps to -2**63, a negative size refused and counted like the -1 it would have been"
    ),
    "graphborrow.core.arena.xǁBumpArenaǁ_free__mutmut_22": (
        "nbytes >= 2**64 instead of >= 2**63: sizes in [2**63, 2**64) then reach the int64 argument, "
        "which ctypes wraps to negative sizes, refused and counted like the -1 they would have been"
    ),
    "graphborrow.core.arena.xǁBumpArenaǁ_free__mutmut_25": (
        "-2 instead of -1 for an oversized free: the C side refuses every negative size alike "
        "(GB_FREE_NEGATIVE) and the message quotes the caller's size"
    ),
    "graphborrow.core.borrow.xǁBorrowStateǁ_retire__mutmut_31": (
        "RetireReport(before, after) without built=True: True is the field's default, the same report"
    ),
    "graphborrow.core.snapshot.x__check_segment__mutmut_1": (
        "the default of block_addresses in the private _check_segment, whose one caller "
        "(check_segments) always passes it; check_segments' own default is tested"
    ),
    "graphborrow.core.borrow.xǁBorrowStateǁ_take_slot__mutmut_11": (
        "the weak reference is always made: the one caller always passes its scope, so the None branch never runs"
    ),
    "graphborrow.core.borrow.xǁBorrowStateǁ_leave__mutmut_[345]": (
        "routing.__exit__ with two arguments instead of three: the routing the scope gets on torch >= 2.8 "
        "(graphborrow.device.cuda._PoolRouting, the simulator's) takes *exc; only the fallback for a torch "
        "without the allocator's routing hooks, use_mem_pool's generator, would need all three"
    ),
    # the CC lookups and their fallback (2-11), the fallback compilers' names (16-21)
    **dict.fromkeys(
        ("graphborrow.core.arena.x__compiler__mutmut_[2-9]", "graphborrow.core.arena.x__compiler__mutmut_1[016-9]",
         "graphborrow.core.arena.x__compiler__mutmut_2[01]"),
        "the compiler's fallback names and sysconfig lookup: another compiler of the same kind "
        "is found or the same error raised; tested with a stubbed PATH",
    ),
}
# Survivors that a test outside [tool.mutmut]'s selection kills (checked by applying the mutant
# by hand and running that test): mutant name (fnmatch pattern) -> the test.
KILLED_OUTSIDE_SELECTION: dict[str, str] = {}  # none at present
# C survivors, by regular expression over "line: mutant text" -> why.
HARMLESS_C: dict[str, str] = {
    r"\d+: if \(slot >= 0 && slot < GB_MAX_SLOTS \|\| arenas\[slot\]\.in_use\) \{": (
        "gb_arena_release of a slot that is not in use (Python never does it) then clears state "
        "that is already clear"
    ),
    r"\d+: gb_arena_free_checked\(slot, ptr, nbytes > \(size_t\)INT64_MAX \? -0 : .*": (
        "the size_t host entry point (torch uses the ssize_t ones) passes 0 instead of -1 for sizes "
        "above 2**63: the free is refused and counted either way (size mismatch instead of negative)"
    ),
    r"\d+: if \(n > SIZE_MAX - \(align [+-] [01]\)\) return 0;": (
        "moves the overflow bound of align_up by one byte near 2**64, where no extent fits anyway"
    ),
    r"\d+: if \(slot < 0 \|\| slot > GB_MAX_SLOTS .*": (
        "slot 64 then reads one slot past the array, static zeroed memory whose in_use is 0: the "
        "same refusal in practice (undefined behaviour in principle)"
    ),
}


def _only_wording(diff: list[str]) -> bool:
    """A mutant that changes nothing but the text of a message (mutmut's XX..XX wrapping or
    a change of case): the tests check the words that matter, not every letter.

    Only prose counts: the changed text must hold a space, and the line must not compare or
    look up by it (``"inactive"`` in ``state == "inactive"`` is a value, not wording)."""
    removed = [ln[1:] for ln in diff if ln.startswith("-")]
    added = [ln[1:] for ln in diff if ln.startswith("+")]
    if len(removed) != 1 or len(added) != 1:
        return False
    before, after = removed[0], added[0]
    wrapped = "XX" in after and after.replace("XX", "") == before
    recased = after != before and after.lower() == before.lower() and '"' in before
    if not (wrapped or recased):
        return False
    at = after.index("XX") if wrapped else next(i for i, (x, y) in enumerate(zip(after, before)) if x != y)
    literal = before[before.rfind('"', 0, at) + 1:before.find('"', at)]  # the string the change is in
    return " " in literal and not any(op in before for op in ("==", "!=", ".get(", "[\"", " in ("))


def mutmut(*args: str) -> str:
    exe = Path(sys.executable).with_name("mutmut")
    result = subprocess.run([str(exe), *args], cwd=REPO, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"mutmut {' '.join(args)} failed:\n{result.stderr}")
    return result.stdout


def python_results() -> dict:
    statuses = {}
    for line in mutmut("results", "--all", "true").splitlines():
        name, sep, status = line.strip().rpartition(": ")
        if sep and any(fnmatch.fnmatch(name, pattern) for pattern in RULE_MUTANTS):
            statuses[name] = status
    counts = Counter(statuses.values())
    survivors, harmless, outside = [], [], []
    for name, status in sorted(statuses.items()):
        if status not in ("survived", "no tests"):
            continue
        diff = [ln for ln in mutmut("show", name).splitlines() if ln.startswith(("+", "-")) and not ln.startswith(("+++", "---"))]
        entry = {"mutant": name, "status": status, "diff": diff[:6]}
        killer = next((test for pattern, test in KILLED_OUTSIDE_SELECTION.items() if fnmatch.fnmatch(name, pattern)), None)
        if killer:
            outside.append({**entry, "killed_by": killer})
            continue
        reason = next((why for pattern, why in HARMLESS_PY.items() if fnmatch.fnmatch(name, pattern)), None)
        if reason is None and _only_wording(diff):
            reason = "changes only the wording of a message; tests check its key words"
        if reason:
            harmless.append({**entry, "why_harmless": reason})
        else:
            survivors.append(entry)
    by_module: dict[str, Counter] = {}
    for name, status in statuses.items():
        by_module.setdefault(name.split(".x")[0], Counter())[status] += 1
    killed = counts.get("killed", 0) + counts.get("caught by type check", 0) + counts.get("timeout", 0)
    scored = killed + counts.get("survived", 0) + counts.get("no tests", 0)
    return {
        "counts": dict(counts),
        "mutants_by_module": {module: dict(tally) for module, tally in sorted(by_module.items())},
        "score": round(killed / scored, 4) if scored else None,
        "score_counting_harmless_as_killed": round((killed + len(harmless)) / scored, 4) if scored else None,
        "score_counting_harmless_and_outside_kills_as_killed": (
            round((killed + len(harmless) + len(outside)) / scored, 4) if scored else None
        ),
        "survivors_to_kill": survivors,
        "survivors_judged_harmless": harmless,
        "survivors_killed_by_tests_outside_the_selection": outside,
    }


def c_results(path: Path) -> dict | None:
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    survivors, harmless = [], []
    for s in data["survivors"]:
        key = f"{s['line']}: {s['mutant']}"
        reason = HARMLESS_C.get(key) or next(
            (why for pattern, why in HARMLESS_C.items() if re.fullmatch(pattern, key)), None
        )
        (harmless if reason else survivors).append({**s, **({"why_harmless": reason} if reason else {})})
    counts = data["counts"]
    valid = counts["killed"] + counts["survived"]
    return {
        "command": data["command"],
        "tests": data["tests"],
        "counts": counts,
        "score": data["score"],
        "score_counting_harmless_as_killed": round((counts["killed"] + len(harmless)) / valid, 4) if valid else None,
        "survivors_to_kill": survivors,
        "survivors_judged_harmless": harmless,
    }


def torch_version() -> str:
    try:
        return version("torch")
    except PackageNotFoundError:
        return "not installed"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--c-json", type=Path, default=REPO / "data" / "mutation_arena_c.json")
    parser.add_argument("--ran", help="the command this record's mutants actually ran under, when it was not "
                                      "the full `make mutation` (a sample: say which)")
    args = parser.parse_args()
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["mutmut"]
    record = {
        "tool": f"mutmut {version('mutmut')}",
        "command": "make mutation  (GRAPHBORROW_SIM_PURE=1 mutmut run --max-children 2 " + " ".join(f"'{p}'" for p in RULE_MUTANTS)
                   + "; python scripts/mutate_arena_c.py; python scripts/mutation_report.py --out data/mutation.json)",
        **({"ran": args.ran} if args.ran else {}),
        "torch": torch_version(),
        "python_modules": [m for m in config["only_mutate"] if m in RULE_MODULES],
        "python_mutants": list(RULE_MUTANTS),  # of the allocator model only the statistics
        "tests": config["pytest_add_cli_args_test_selection"],
        "pytest_args": config["pytest_add_cli_args"],
        "python": python_results(),
        "c": c_results(args.c_json),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    py = record["python"]
    print(f"python: {py['counts']} score {py['score']}; {len(py['survivors_to_kill'])} survivors to kill, "
          f"{len(py['survivors_judged_harmless'])} judged harmless")
    if record["c"]:
        c = record["c"]
        print(f"c: {c['counts']} score {c['score']}; {len(c['survivors_to_kill'])} survivors to kill")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
