"""Traces from long-running processes: ring buffers that wrapped, recorded on an H200, replayed in full.

``scripts/record_wrapped.py`` ran the suite's own serving workload (a graph ladder, borrowed EAGLE
verification, retire), ordinary model code (a decoder with a growing KV cache, copies on a side
stream) and the differential corpus's random program, each with expandable segments off and on,
for a long time with rings of 100 to 10 000 entries, and cut each run at three points after its
ring had wrapped. Such a trace begins mid-run: what existed before its first entry is rebuilt
from the trace and the snapshot. Every check that can be made must agree, and the checks that
cannot be made (each counted with its reason) must stay under 1 % of a trace's checks.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from graphborrow.fidelity.replay import load_trace, replay_trace

WRAPPED = Path(__file__).resolve().parents[2] / "data" / "traces" / "wrapped"
TRACES = sorted(WRAPPED.glob("*.pickle.gz"))


def name_of(path: Path) -> str:
    return path.name.split(".")[0]


def test_the_wrapped_corpus_is_committed_with_its_commands():
    index = json.loads((WRAPPED / "index.json").read_text())
    assert index["device"].startswith("NVIDIA") and index["command"].startswith("python scripts/record_wrapped.py")
    rows = index["traces"]
    assert len(TRACES) == len(rows) >= 30 and all(row["wrapped"] for row in rows)
    assert {row["workload"] for row in rows} == {"suite", "model", "churn"}
    assert {row["settings"] for row in rows} == {"", "expandable_segments:True"}
    rings = {row["max_entries"] for row in rows}
    assert min(rings) == 100 and max(rings) == 10_000 and len(rings) >= 4
    meta = load_trace(TRACES[0])["corpus"]
    assert meta["torch"].startswith("2.") and meta["device_memory"] > 0 and meta["events"] == meta["max_entries"]


@pytest.mark.parametrize("path", TRACES, ids=[name_of(p) for p in TRACES])
def test_a_wrapped_trace_agrees_wherever_a_check_can_be_made(path):
    snapshot = load_trace(path)
    report = replay_trace(snapshot)
    assert report.mid_run and report.events == snapshot["corpus"]["max_entries"]
    assert report.mismatches == [] and report.agreement == 1.0, str(report)
    assert report.checks > 50
    assert sum(report.unverifiable_reasons.values()) == report.unverifiable  # each one with its reason
    assert report.unverifiable < 0.01 * report.checks, str(report)
