"""Fidelity, measured: traces recorded by the real allocator on an H200 replay exactly."""

import json
from pathlib import Path

import pytest

from graphborrow.fidelity.replay import replay_trace

TRACES = sorted((Path(__file__).resolve().parents[2] / "data" / "traces").glob("*.pickle"))


def test_the_three_recorded_scenarios_are_committed():
    assert {p.stem for p in TRACES} == {"default_churn", "graph_ladder", "borrow_cycles"}


@pytest.mark.parametrize("path", TRACES, ids=[p.stem for p in TRACES])
def test_h200_trace_replays_with_full_agreement(path):
    meta = json.loads(path.with_suffix(".json").read_text())
    assert meta["device"].startswith("NVIDIA") and meta["torch"].startswith("2.")
    report = replay_trace(path)
    assert report.mismatches == []
    assert report.agreement == 1.0
    assert report.events == meta["events"]  # every traced event was replayed
    assert report.checks > 400  # block choices, segment allocations and releases
