"""Every public entry point's work grows at most about linearly with its input; refusing a step
that cannot fit does not grow with the batch at all.

The work is counted, not timed: the number of Python lines executed while the entry point
runs (a ``sys.settrace`` line counter on this thread). For one input that count is the same
on every run (no clock, no other process in it), and it grows as the algorithm does: a loop
over every segment per segment is seen whether or not it calls a function. Code compiled
from C or Cython (the arena, the compiled allocator model, torch's kernels) is counted
through the Python that calls it. Each entry point first runs on a small base input (which
also pays for imports and one-time builds, then is counted as the work any input costs),
then on four inputs 10x apart (three 10x steps); the growth exponent is the least-squares
slope of log(count - base count) against log(size), so a fixed cost does not hide a
quadratic term. A refusal's counts are taken as they are: they must not grow. The inputs are
``benchmarks/scaling.py``'s, whose timings are in ``data/scaling_cpu.json``.
"""

import sys

import pytest

from tests.conftest import load_script

pytestmark = pytest.mark.slow
scaling = load_script("benchmarks/scaling.py")
LINEAR = 1.3  # the largest growth exponent allowed
FLAT = 0.05  # ... for a refusal, whose work must not grow with the batch


def executed_lines(run, argument) -> int:
    """Python lines executed by ``run(argument)`` on this thread."""
    count = 0

    def trace(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
        return trace

    before = sys.gettrace()
    sys.settrace(trace)
    try:
        run(argument)
    finally:
        sys.settrace(before)
    return count


def growth(make, run, base, sizes) -> tuple[float, list[int]]:
    """The growth exponent of the work beyond the base input's, and the counts (base first)."""
    run(make(base))  # imports, builds and caches of a first call
    counts = [executed_lines(run, make(n)) for n in [base, *sizes]]
    assert all(c > counts[0] for c in counts[1:]), f"no work beyond the base input's: {counts}"
    return scaling.growth_exponent(sizes, [c - counts[0] for c in counts[1:]]), counts


def flat_growth(run, sizes) -> tuple[float, list[int]]:
    run(sizes[0])
    counts = [executed_lines(run, n) for n in sizes]
    return scaling.growth_exponent(sizes, counts), counts


CASES = {  # name: (make the input, run on it, base size, sizes 10x apart)
    "load_snapshot": (scaling.snapshot, scaling.load_snapshot, 1, [3, 30, 300, 3000]),
    "find_free_runs": (scaling.snapshot, scaling.find_free_runs, 1, [3, 30, 300, 3000]),
    "find_free_runs, one free block": (scaling.one_free_block, scaling.find_free_runs, 1, [3, 30, 300, 3000]),
    "inspect_snapshot": (scaling.engine_snapshot, scaling.inspect, 1, [2, 20, 200, 2000]),
    "inspect_snapshot, one free block": (scaling.engine_one_free_block, scaling.inspect, 1, [2, 20, 200, 2000]),
    "simulate's report": (scaling.pools_snapshot, scaling.simulate_report, 1, [2, 20, 200, 2000]),
    "replay_trace, bounded pool": (scaling.churn_trace, scaling.replay, 2, [3, 30, 300, 3000]),
    "replay_trace, segments from before it": (scaling.kept_trace, scaling.replay, 1, [3, 30, 300, 3000]),
    "plan_verify, fits": (int, scaling.plan_fits, 1, [2, 20, 200, 2000]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_work_grows_about_linearly(name):
    make, run, base, sizes = CASES[name]
    exponent, counts = growth(make, run, base, sizes)
    assert exponent < LINEAR, f"{name}: executed lines {dict(zip([base, *sizes], counts))} grow as size^{exponent:.2f}"


@pytest.mark.parametrize("mode,vocab,pool,sizes", [
    ("standard", 32000, 64 * scaling.MiB, scaling.BATCHES),
    ("lean", 32000, 64 * scaling.MiB, scaling.BATCHES),
    ("chunked", 1000, 2 * scaling.MiB, [10**4, 10**5, 10**6, 10**7]),
])
def test_refusing_a_step_that_cannot_fit_does_the_same_work_for_any_batch(mode, vocab, pool, sizes):
    exponent, counts = flat_growth(scaling.plan_refused(mode, vocab, pool), sizes)
    assert exponent < FLAT, f"{mode}: executed lines {dict(zip(sizes, counts))} grow as batch^{exponent:.2f}"
