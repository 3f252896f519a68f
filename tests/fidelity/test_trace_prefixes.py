"""Every prefix of every committed trace replays to a report: never an exception, and 1.0 only for the whole.

A trace cut short keeps the snapshot of its end, so the two disagree: segments the snapshot
shows that the prefix never made (they look like memory from before the trace), blocks the
prefix left allocated that the snapshot shows free. The replay must say so with a report
below 1.0, whatever the cut, and never fail inside its reconstruction of what existed before
the first entry. The cut points are sampled (Hypothesis; ``make deep`` samples 50 times more).

A cut that drops only entries that leave no mark on the end (allocations freed again, in the
same blocks, failed allocations that released nothing, and nothing else) cannot be seen in the snapshot; where the trace carries the
real ``memory_stats()`` (the differential corpus does), the statistics must disagree then. Nor
can a cut of a mid-run trace (its ring buffer wrapped) whose prefix leaves every address it
touched as the snapshot shows it: what was dropped then looks like memory from before the
ring's first entry.
"""

from __future__ import annotations

import gzip
import pickle
from collections import Counter
from functools import lru_cache
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from graphborrow.fidelity.compare import expand_trace, load_recording
from graphborrow.fidelity.passes import SKIPPED
from graphborrow.fidelity.replay import replay_trace

DATA = Path(__file__).resolve().parents[2] / "data"
MAP_PAGE = 2 << 20  # expandable segments map and unmap whole pages of 2 MiB (or multiples)
TRACES = sorted([*(DATA / "traces").glob("*.pickle"), *(DATA / "traces").rglob("*.pickle.gz"),
                 *(DATA / "models_h200").glob("*.json.gz")])


@lru_cache(maxsize=None)
def trace(path: Path) -> tuple[dict, dict]:
    """The snapshot (with its trace) of a committed file, and the replay's keyword arguments."""
    if path.name.endswith(".json.gz"):  # a model-pool recording: the pool's snapshot, the device's trace
        gpu = load_recording(path)
        events = [{k: v for k, v in e.items() if k != "site"} for e in expand_trace(gpu["trace"], gpu["sites"])]
        pools = {tuple(s["segment_pool_id"]) for s in gpu["segments"]}
        # of one pool, the snapshot cannot show that the trace began at an empty allocator: the recording says so
        return {"segments": gpu["segments"], "device_traces": [events]}, {"snapshot_pools": pools, "starts_empty": True}
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        return pickle.load(f), {}


def inert(action: str) -> bool:
    """Entries that change no block or segment: the skipped kinds, and a failed allocation (what
    it released first shows as entries of their own)."""
    return action in SKIPPED or action == "oom"


def leaves_no_mark(tail: list[dict]) -> bool:
    """Whether these entries, dropped from the end, leave the final segments and blocks as they were:
    no device call, and every block they allocate freed again in them. A failed allocation (``oom``)
    leaves no mark of its own: what it released first shows as ``segment_free`` entries."""
    counts: dict[int, Counter] = {}
    for entry in tail:
        action = entry["action"]
        if inert(action):
            continue
        if action not in ("alloc", "free_requested", "free_completed"):
            return False
        counts.setdefault(entry["addr"], Counter())[action] += 1
    return all(c["alloc"] == c["free_requested"] == c["free_completed"] for c in counts.values())


def explained_by_prior_state(prefix: list[dict], snapshot: dict) -> bool:
    """Whether a mid-run trace's prefix leaves every address it touched as the snapshot shows it:
    each block it allocated last alive at the end with its size, each it freed last not alive,
    each segment it made or released there or gone, each 2 MiB page of an expandable segment it
    mapped or unmapped last inside a segment or outside every one. Then whatever the cut dropped
    looks like memory from before the ring's first entry, and the replay may not see the cut
    (checked for every cut of the wrapped 100-entry rings: each that replayed at 1.0 was
    explained; the replay's placement checks still catch most explained ones)."""
    blocks = {b["address"]: b for s in snapshot["segments"] for b in s["blocks"]}
    segments = {s["address"] for s in snapshot["segments"]}
    last, pages = {}, {}
    for entry in prefix:
        action = entry["action"]
        if inert(action):
            continue
        if action in ("segment_map", "segment_unmap"):
            for page in range(entry["addr"], entry["addr"] + entry["size"], MAP_PAGE):
                pages[page] = action == "segment_map"
            continue
        if action not in ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free"):
            return False
        last[(action.startswith("segment_"), entry["addr"])] = entry
    for page, mapped in pages.items():
        if mapped != any(s["address"] <= page < s["address"] + s["total_size"] for s in snapshot["segments"]):
            return False
    for (segment, addr), entry in last.items():
        if segment:
            if (entry["action"] == "segment_alloc") != (addr in segments):
                return False
            continue
        block = blocks.get(addr)
        alive = block is not None and block["state"] == "active_allocated"
        if entry["action"] == "alloc" and not (alive and block.get("requested_size") == entry["size"]):
            return False
        if entry["action"] != "alloc" and alive:
            return False
    return True


def test_the_prefix_test_covers_every_kind_of_committed_trace():
    names = {p.parent.name for p in TRACES}
    assert {"traces", "corpus", "models_h200"} <= names and len(TRACES) >= 80


@settings(max_examples=25)
@given(index=st.integers(0, len(TRACES) - 1), fraction=st.floats(0.0, 1.0, exclude_max=True))
def test_a_prefix_replays_to_a_report_below_one(index, fraction):
    snapshot, options = trace(TRACES[index])
    entries = snapshot["device_traces"][0]
    changing = [i for i, e in enumerate(entries) if e["action"] not in SKIPPED]
    cut = changing[int(fraction * len(changing))]  # the prefix drops this entry, which changes state, and all after
    report = replay_trace(dict(snapshot, device_traces=[entries[:cut]]), **options)  # never raises
    assert report.events == cut
    if leaves_no_mark(entries[cut:]):
        if snapshot.get("memory_stats") and not report.mid_run:
            assert report.stats_mismatches, (TRACES[index].name, cut)
        return
    if report.mid_run and explained_by_prior_state(entries[:cut], snapshot):
        return
    if report.agreement is None:  # nothing could be checked: the report claims nothing, and says why
        assert report.unchecked and not report.mismatches, (TRACES[index].name, cut, str(report))
        return
    assert report.agreement < 1.0, (TRACES[index].name, cut, str(report))
    assert report.mismatches


def test_a_cut_after_an_allocation_in_a_segment_from_before_the_trace_is_seen():
    """A random search's find: a mid-run trace cut after its first allocation (214 B in a small
    segment from before the trace, freed again later) and a free in memory the snapshot no longer
    holds. The free cannot be checked, but the segment of the allocation can: the snapshot shows
    the block free where the prefix left it allocated. It used to be skipped at the end as a
    segment the trace never touched, and the report said 1.0 from its two placement checks."""
    snapshot, options = trace(DATA / "traces" / "corpus" / "seed002_late.pickle.gz")
    entries = snapshot["device_traces"][0]
    report = replay_trace(dict(snapshot, device_traces=[entries[:2]]), **options)
    assert report.mid_run and report.checks == 3 and report.agreement < 1.0, str(report)
    assert report.mismatches[0].startswith("final snapshot segment 2097152 B at 0x7f2353600000")


def test_mid_run_cuts_the_snapshot_explains_are_the_ones_that_replay_at_one():
    """Two cuts a random run met: after 7 entries of one wrapped ring (blocks only) and after 50 of
    another (maps too) the prefix leaves every address as the snapshot shows it, and the replay
    cannot object; a few entries further it does not, and the replay says so."""
    for name, invisible, seen in (("churn_expandable_ring100_cut1.pickle.gz", 7, 8),
                                  ("churn_expandable_ring100_cut2.pickle.gz", 50, 54)):
        snapshot, options = trace(DATA / "traces" / "wrapped" / name)
        entries = snapshot["device_traces"][0]
        for cut, explained in ((invisible, True), (seen, False)):
            report = replay_trace(dict(snapshot, device_traces=[entries[:cut]]), **options)
            assert report.mid_run and explained_by_prior_state(entries[:cut], snapshot) == explained, (name, cut)
            assert (report.agreement == 1.0) == explained, (name, cut, str(report))


def test_the_borrow_cycles_recording_cut_short_reports_its_pool_of_arena_memory():
    """Issue 24's case: the arena MemPool's segments lie inside graph-pool blocks, off the 2 MiB grid;
    before the fix, rebuilding them as cudaMalloc memory raised. They are rebuilt as the pluggable
    pool's memory, and the cut shows as mismatches."""
    snapshot, _ = trace(DATA / "traces" / "borrow_cycles.pickle")
    entries = snapshot["device_traces"][0]
    for fraction in (0.25, 0.5, 0.75, 0.9):
        report = replay_trace(dict(snapshot, device_traces=[entries[: int(len(entries) * fraction)]]))
        assert report.mid_run and 0.5 < report.agreement < 1.0, (fraction, str(report))
        assert any("was never allocated by the trace" in m for m in report.mismatches)
