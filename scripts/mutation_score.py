"""Write the mutation score of the last `mutmut run` to a JSON file.

    python scripts/mutation_score.py [--make TARGET] data/mutation_capacity.json [MUTANT_PATTERN ...]

With patterns (fnmatch over mutant names, e.g. 'graphborrow.planning.capacity.*'), only the mutants
they match are counted: [tool.mutmut] also lists the rule modules that `make mutation` scores.
``--make`` names the make target the record says it came from (mutation-capacity by default;
mutation-sampling for the verification's sampling rules).

Reads `mutmut results --all true` (run from the checkout that holds `mutants/`) and records
the counts by status, the score (killed and timed out over all mutants that tests reach),
every survivor with its diff, split the way scripts/mutation_report.py splits them for
data/mutation.json (one mechanism): survivors a test should kill, and survivors reviewed
and judged harmless (HARMLESS below, or a change of message wording only), each with why.
Exits 1 when a survivor is left to kill or a mutant has no test, so `make
mutation-capacity` and `make mutation-sampling` fail until each is killed or reviewed.
"""

from __future__ import annotations

import collections
import fnmatch
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mutation_report import _only_wording, mutmut  # noqa: E402  (the shared review mechanism)

# Survivors looked at and judged harmless: mutant name (fnmatch pattern) -> why. A survivor
# not listed here (and not a wording-only change) is one a test should kill.
_SEARCH_BOUND = (
    "moves a bound of the bisection over one size class: the answer is the largest fitting size "
    "over the three classes (small, medium, large), fit is monotone inside each, and a bound moved "
    "into a neighbouring class only adds sizes that class's own search already answers (the "
    "256 KiB-step table test checks every run size up to 40 MiB against the allocator's rules)"
)
_GPU_ONLY = (
    "reached only with a CUDA backend: impl='auto' plans the fused kernels on a real GPU with Triton, "
    "and the simulated device always plans the reference; tests/planning/test_capacity.py::"
    "test_auto_plans_the_fused_kernels_on_cuda (marked gpu) checks it on the H200"
)
HARMLESS: dict[str, str] = {
    # capacity.largest_borrowable / _fits_one / size_class_table
    "graphborrow.planning.capacity.x_largest_borrowable__mutmut_1[56]": (
        "the probe run's address (2**40 or 2**41): any 512-byte-aligned address gives the same replay"),
    "graphborrow.planning.capacity.x_largest_borrowable__mutmut_19": "the small class's search starts at 2 bytes, not 1: both are one 512-byte block",
    "graphborrow.planning.capacity.x_largest_borrowable__mutmut_2[1245-9]": _SEARCH_BOUND,
    "graphborrow.planning.capacity.x_largest_borrowable__mutmut_3[67]": (
        "the large class's upper bound for runs under 10 or 11 MiB: no size above the run fits, so the "
        "search ends at the same size"),
    "graphborrow.planning.capacity.x_largest_borrowable__mutmut_47": (
        "bisection midpoint (low+high+2)//2 instead of +1: still in (low, high], the same fixed point"),
    "graphborrow.planning.capacity.x__fits_one__mutmut_[89]": "the probe request's id: a label that only pairs a free with its allocation",
    "graphborrow.planning.capacity.x__fits_one__mutmut_10": (
        "the probe request's recorded stream: the replay puts the first recorded stream on the pool's own"),
    "graphborrow.planning.capacity.x_size_class_table__mutmut_14": "range end 40 MiB + 2 instead of + 1: the same 256 KiB steps",
    # capacity.FitPolicyPool
    "graphborrow.planning.capacity.xǁFitPolicyPoolǁ__init____mutmut_28": (
        "the second graph's input 7.2 MiB instead of 9 MiB: any medium tensor up to 12 MiB takes the same "
        "12 MiB block and leaves the same runs (the test checks the runs and the fit-policy contrast)"),
    "graphborrow.planning.capacity.xǁFitPolicyPoolǁ__init____mutmut_{36,38,45,47,49,51,53}": (
        "the captured graphs' arithmetic (* 2, / 2, + 1, ...): only the tensors' sizes shape the pool"),
    # capacity.plan_verify / _planned_impl
    "graphborrow.planning.capacity.x_plan_verify__mutmut_{86,89}": (
        "the mode passed to plan_fused_step, which only labels its ChunkPlan (the fused step runs the "
        "whole batch in every mode); plan_verify does not read that label"),
    "graphborrow.planning.capacity.x_plan_verify__mutmut_31": _GPU_ONLY,
    "graphborrow.planning.capacity.x__planned_impl__mutmut_*": _GPU_ONLY,
    # planner
    "graphborrow.planning.planner.x__layout_device__mutmut_[45]": (
        "backed=None / activate=None for False: both are falsy, the same layout-only, inactive device"),
    "graphborrow.planning.planner.x__mib__mutmut_4": "'>' instead of '>=' MB/10: a byte count is an int and never equals 104857.6",
    "graphborrow.planning.planner.x__never__mutmut_5": "float('INF') is float('inf')",
    "graphborrow.planning.planner.xǁPoolImageǁof__mutmut_55": (
        "the stream of a built pool without segments: it has no cached block, so the step's requests "
        "carve the same segments on any stream"),
    "graphborrow.planning.planner.xǁPoolImageǁof__mutmut_65": (
        "a built pool's arena alignment left at the image's default: borrow states build their arenas "
        "with BumpArena's default alignment, the same 512 bytes"),
    "graphborrow.planning.planner.x_replay__mutmut_3[2-5]": (
        "the replay allocator's own device memory (size, backing): never used, every request routes to "
        "the pool, whose segments come from the arena and restored segments belong to it"),
    "graphborrow.planning.planner.x_replay__mutmut_120": (
        "the precarve's stream: seeds exist only in a fresh image, whose stream is the default one"),
    "graphborrow.planning.planner.x_replay__mutmut_15[789]": (
        "the id a second recorded stream gets in the replay (999, -999 or 1002 instead of 1001 for the "
        "pool's stream 0): any id other than the pool's stream keeps its blocks apart, as the "
        "two-stream test checks"),
    "graphborrow.planning.planner.x_replay__mutmut_74": (
        "snapshot(None) instead of the pool's: the replay's allocator holds that one pool only"),
    # make mutation-sampling: eagle/probs.py, renorm.py, kernel.py, acceptance.py
    "graphborrow.eagle.probs.x_softmax_rows__mutmut_{29,35}": (
        "rows per chunk of the int64 sum (at least 2, or counting a one-entry row as two entries): the "
        "sum is exact in any chunking (test_summing_a_few_rows_at_a_time_changes_nothing); only the "
        "32 MiB bound moves, for rows of more than 4M entries or of one"),
    "graphborrow.eagle.renorm.x_top_p_renorm_probs__mutmut_16": "integer=None for integer=False: both falsy",
    "graphborrow.eagle.renorm.x_renorm_rows__mutmut_{7,15,16,23,31,32}": (
        "the name renorm_rows passes for messages: it checks nothing (on_invalid='unchecked'), so no "
        "message is ever written with it"),
    "graphborrow.eagle.renorm.x__keep_and_renormalise__mutmut_27": (
        "invalid rows filled with 2.0 instead of 1.0 before renormalising: a constant row renormalises "
        "to the same uniform row"),
    "graphborrow.eagle.renorm.x__{mass_reaches__mutmut_9,mass_reaches__mutmut_13,"
    "pivots_and_kept_sums__mutmut_100,pivots_and_kept_sums__mutmut_104}": (
        "the float64 dtype of a row sum dropped while out= is a float64 tensor: torch then reduces in "
        "the output's dtype, bit for bit the same sums (checked over 4 x 200000 float32 entries)"),
    "graphborrow.eagle.renorm.x__show__mutmut_8": (
        "value[1] for value[0] where every entry must equal it: all equal value[1] exactly when all "
        "equal value[0], and one-entry tensors never get there"),
    "graphborrow.eagle.acceptance.x_sample_copies__mutmut_1": (
        "the default batch of copies: results do not depend on it (test_sampling_in_batches_is_one_batch_joined)"),
    "graphborrow.eagle.tree_sampling.x_tree_speculative_sampling_target_only__mutmut_3": (
        "deterministic's default: accepted for upstream's signature, the result is deterministic either way"),
    "graphborrow.eagle.tree_sampling.xǁTreeTablesǁbuild__mutmut_11": (
        "one more column of children for one- and two-node trees: padding (-1), masked by valid"),
    "graphborrow.eagle.tree_sampling.xǁTreeTablesǁbuild__mutmut_{20,21,36,37}": (
        "a child index > 0 for >= 0: node 0 is the root, never anyone's child or sibling"),
    "graphborrow.eagle.tree_sampling.x_walk_tree__mutmut_11": (
        "padding slots' p = 1 instead of 0: they follow a node's real children in the table, so they "
        "enter the running sum after every real child is judged, and valid masks their acceptance"),
    "graphborrow.eagle.tree_sampling.x_walk_tree__mutmut_{74,122}": (
        "-2 for the -1 that means none: only its sign is read (>= 0)"),
    "graphborrow.eagle.tree_sampling.x_walk_tree__mutmut_170": (
        "the child index of a node with no accepted child clamped to 1 instead of 0: every use is "
        "masked by step (no child accepted), and the walk has no pass for a one-node tree"),
    "graphborrow.eagle.tree_sampling.x_arange_like__mutmut_{6,8}": (
        "the dtype of like (always an int64 index tensor) for int64: the same"),
}


def _expand(pattern: str) -> list[str]:
    """fnmatch patterns with one ``{a,b,...}`` alternation expanded."""
    head, brace, rest = pattern.partition("{")
    if not brace:
        return [pattern]
    options, _, tail = rest.partition("}")
    return [head + option + tail for option in options.split(",")]


def review(name: str) -> dict:
    """The survivor's diff and, when it was judged harmless, why."""
    diff = [ln for ln in mutmut("show", name).splitlines()
            if ln.startswith(("+", "-")) and not ln.startswith(("+++", "---"))]
    entry = {"mutant": name, "diff": diff[:6]}
    reason = next((why for pattern, why in HARMLESS.items() if any(fnmatch.fnmatch(name, p) for p in _expand(pattern))),
                  None)
    if reason is None and _only_wording(diff):
        reason = "changes only the wording of a message; tests check its key words"
    return {**entry, "why_harmless": reason} if reason else entry


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    given, target = list(argv), "mutation-capacity"
    if argv[:1] == ["--make"] and len(argv) > 1:
        target, argv = argv[1], argv[2:]
    if len(argv) < 1:
        print(__doc__)
        return 2
    patterns = argv[1:]
    status = {}
    for line in mutmut("results", "--all", "true").splitlines():
        name, sep, state = line.strip().rpartition(": ")
        if sep and name and (not patterns or any(fnmatch.fnmatch(name, p) for p in patterns)):
            status[name] = state
    if not status:
        print("no mutants found: run `mutmut run` first")
        return 1
    counts = collections.Counter(status.values())
    reached = counts["killed"] + counts["timeout"] + counts["survived"]
    reviewed = [review(n) for n, s in sorted(status.items()) if s == "survived"]
    harmless = [r for r in reviewed if "why_harmless" in r]
    to_kill = [r for r in reviewed if "why_harmless" not in r]
    killed = counts["killed"] + counts["timeout"]
    import mutmut as mutmut_package
    import torch

    result = {
        "command": f"make {target}  (OMP_NUM_THREADS=1 mutmut run --max-children 2 "
                   + " ".join(f"'{p}'" for p in patterns)
                   + "; python scripts/mutation_score.py " + " ".join(given) + ")  (config: pyproject.toml [tool.mutmut])",
        "mutmut": mutmut_package.__version__,
        "torch": torch.__version__,
        "device": "CPU",
        "counts": dict(sorted(counts.items())),
        "score": round(killed / reached, 3) if reached else None,
        "score_counting_harmless_as_killed": round((killed + len(harmless)) / reached, 3) if reached else None,
        "survivors_to_kill": to_kill,
        "survivors_judged_harmless": harmless,
        "no_tests": sorted(n for n, s in status.items() if s in ("no tests", "tests")),
        "not_checked": sorted(n for n, s in status.items() if s == "not checked"),
    }
    Path(argv[0]).write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    print(f"{dict(counts)}: score {result['score']}, {result['score_counting_harmless_as_killed']} counting "
          f"the {len(harmless)} judged harmless -> {argv[0]}")
    left = (to_kill + [{"mutant": n, "diff": ["(no test reaches it)"]} for n in result["no_tests"]]
            + [{"mutant": n, "diff": ["(not run: run mutmut again)"]} for n in result["not_checked"]])
    for entry in left:
        print(f"  to kill: {entry['mutant']}  {' | '.join(entry['diff'])}")
    return 1 if left else 0


if __name__ == "__main__":
    raise SystemExit(main())
