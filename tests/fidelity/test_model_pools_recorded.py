"""The simulated device against the H200: every recorded model pool, block for block.

``benchmarks/model_pools.py`` writes one recording per workload into ``data/models_h200/``
(pool snapshot, allocator trace with Python sites, attention backend, library workspaces).
Each is rebuilt here on a layout-only simulated device from the recording's parameters,
with the cudaMalloc addresses the GPU got, and compared:

* the pool must agree block for block (every segment paired, every block identical);
* the allocator traces, aligned event by event, may differ only by what
  ``known_differences.json`` lists for that workload, cause by cause and count by count,
  so a new difference, or a listed one gone, fails until someone models or explains it;
* replaying each recorded trace on the simulated allocator reproduces every block choice
  (the allocator's rules; the simulated run above also tests the allocation sequence).

Until the GPU run has produced recordings this module collects no tests (nothing is
skipped); tests/fidelity/test_compare.py covers the machinery meanwhile.
"""

import collections
import json
from pathlib import Path

import pytest

from graphborrow.fidelity.compare import (
    ADDRESS_ORDER,
    compare_recordings,
    expand_trace,
    load_recording,
)
from graphborrow.fidelity.replay import replay_trace
from graphborrow.studies.model_pools import simulate_recording

pytestmark = pytest.mark.slow

DATA = Path(__file__).resolve().parents[2] / "data" / "models_h200"
RECORDINGS = sorted(DATA.glob("*.json.gz"))
IDS = [p.name.split(".json")[0] for p in RECORDINGS]


def known_differences(workload: str) -> dict[str, int]:
    """Cause prefix -> number of trace differences accepted for ``workload``."""
    path = DATA / "known_differences.json"
    accepted: dict[str, int] = collections.Counter()
    if path.exists():
        for entry in json.loads(path.read_text())["differences"]:
            if workload in entry["workloads"]:
                accepted.update(entry["causes"])
    return dict(accepted)


def _by_known_cause(causes: dict[str, int], accepted: dict[str, int]) -> dict[str, int]:
    found: dict[str, int] = collections.Counter()
    for cause, n in causes.items():
        prefix = next((k for k in accepted if cause.startswith(k)), cause)
        found[prefix] += n
    return dict(found)


if RECORDINGS:

    @pytest.mark.parametrize("path", RECORDINGS, ids=IDS)
    def test_simulated_pool_agrees_with_the_gpu(path):
        gpu = load_recording(path)
        result = compare_recordings(gpu, simulate_recording(gpu))
        assert result.segments[0] == result.segments[1] == result.segments[2], result.summary()
        assert result.agreement_blocks == 1.0 and result.agreement_bytes == 1.0, result.summary()
        assert not any(c.startswith("unexplained") for c in result.causes()), result.summary()
        accepted = known_differences(gpu["workload"])
        found = _by_known_cause(result.causes(), accepted)
        assert found == accepted, (
            f"{gpu['workload']}: the trace differences {found} are not the known ones {accepted}:\n"
            f"{result.summary()}\nmodel the new causes in graphborrow/sim, or list them with the reason in "
            f"data/models_h200/known_differences.json (and delete entries that no longer occur)"
        )

    @pytest.mark.parametrize("path", RECORDINGS, ids=IDS)
    def test_recorded_trace_replays_on_the_simulated_allocator(path):
        gpu = load_recording(path)
        events = [{k: v for k, v in e.items() if k != "site"} for e in expand_trace(gpu["trace"], gpu["sites"])]
        # the recording holds the shared pool's snapshot only, the trace the whole device
        pools = {tuple(s["segment_pool_id"]) for s in gpu["segments"]}
        report = replay_trace({"segments": gpu["segments"], "device_traces": [events]}, snapshot_pools=pools)
        assert report.agreement == 1.0 and report.checks > 1000, str(report)
        assert not report.mid_run  # recorded from the start (tests/fidelity/test_trace_prefixes.py relies on it)

    def test_a_pool_snapshot_read_as_the_whole_device_misses_the_other_pools():
        gpu = load_recording(DATA / "synthetic.json.gz")
        events = [{k: v for k, v in e.items() if k != "site"} for e in expand_trace(gpu["trace"], gpu["sites"])]
        whole = replay_trace({"segments": gpu["segments"], "device_traces": [events]})
        assert whole.agreement < 1.0 and whole.mismatches
        assert all("expected None" in m for m in whole.mismatches), str(whole)

    def test_without_the_gpu_addresses_equal_segments_swap_layouts():
        """The driver's address order, not the allocation sequence, is what the addresses fix."""
        gpu = load_recording(DATA / "synthetic.json.gz")
        result = compare_recordings(gpu, simulate_recording(gpu, addresses=False))
        assert result.agreement_blocks < 1.0
        assert result.trace_events[0] == result.trace_events[1] == result.trace_events[2]
        assert set(result.causes()) == {ADDRESS_ORDER}, result.summary()


def test_planner_on_the_recorded_synthetic_pool_agrees_with_the_h200_runs():
    """The synthetic recording is the benchmark ladder: the planner, replaying standard steps
    against it on the CPU, must give the largest batch the H200 ran at 8 draft tokens."""
    import json

    from graphborrow.studies.model_pools import planned_largest_batch

    summary = json.loads((DATA / "summary.json").read_text())
    study = next(w["study"] for w in summary["workloads"] if w["workload"] == "synthetic")
    ran = json.loads((DATA.parent / "capacity_h200.json").read_text())["largest_standard_batch_by_draft_tokens"]
    assert planned_largest_batch(DATA / "synthetic.json.gz", study["verify_fit"]) == ran["8"] == 32


@pytest.mark.parametrize("path", RECORDINGS, ids=IDS)
def test_the_planner_s_boundary_steps_ran_as_planned_on_the_h200(path):
    """On each recorded pool the H200 ran the planner's boundary steps (per mode, the largest
    batch planned to fit and the smallest planned not to): each finished exactly when planned,
    and the planner, replaying the same steps against the recording on the CPU, still agrees."""
    from graphborrow.studies.inspection import inspect_snapshot

    rec = load_recording(path)
    checked = rec["study"]["planner_checked"]
    assert checked and all(r["agrees"] for r in checked), checked
    assert {r["mode"] for r in checked} == {"standard", "lean", "chunked"}
    report = inspect_snapshot(rec["segments"], batches=sorted({r["batch"] for r in checked}),
                              draft_tokens=[checked[0]["draft_tokens"]], vocab=checked[0]["vocab"],
                              modes=("standard", "lean", "chunked"))
    planned = {(f["mode"], f["batch_size"]): f["fits"] for f in report.fit}
    assert all(planned[(r["mode"], r["batch"])] == r["ran"] for r in checked)
