"""Recorded allocation sequences kept on disk: read back exactly, with ids new to the process."""

import json
import subprocess
import sys

import torch

from graphborrow.planning import planner
from graphborrow.planning.stored import STORE_ENV, store_folder, stored_sequences


def softmax_phases():
    """Two phases of one recording: a softmax, then freeing its output (made in the first)."""
    with planner.recording() as rec:
        x = torch.empty(64, 1000, device="cuda")
        with rec.phase() as made:
            y = torch.softmax(x * 2, -1)
        with rec.phase() as released:
            del y
        del x
    return planner.AllocationSequence(tuple(made)), planner.AllocationSequence(tuple(released))


def shape_of(sequences):
    """The events with ids replaced by their order of first appearance: what must survive a store."""
    order = {}
    return [[(k, order.setdefault(i, len(order)), n, s) for k, i, n, s in seq.events] for seq in sequences]


def counted_recorder(tmp_path, monkeypatch):
    """A store in ``tmp_path`` and a recorder of the softmax phases that counts its calls."""
    monkeypatch.setenv("GRAPHBORROW_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(STORE_ENV, raising=False)
    calls = []

    def record():
        calls.append(1)
        return softmax_phases()

    return record, calls


def test_a_stored_recording_reads_back_the_same_with_fresh_ids(tmp_path, monkeypatch):
    record, calls = counted_recorder(tmp_path, monkeypatch)
    first = stored_sequences("test-softmax", [64, 1000], record)
    second = stored_sequences("test-softmax", [64, 1000], record)
    assert len(calls) == 1, "the second request read the store"
    assert shape_of(second) == shape_of(first) and second[0].peak_bytes == first[0].peak_bytes > 0
    ids = lambda seqs: {e[1] for s in seqs for e in s.events}  # noqa: E731
    assert not ids(first) & ids(second), "read back with ids new to this process"
    assert {e[1] for e in second[1].events} <= {e[1] for e in second[0].events}, "frees still name their allocations"
    replayed = planner.replay(second[0] + second[1], planner.PoolImage.from_runs([(1 << 40, 64 << 20)]))
    assert replayed.fits
    assert len(list(store_folder().glob("*.json"))) == 1


def test_a_damaged_or_foreign_file_is_recorded_again(tmp_path, monkeypatch):
    record, calls = counted_recorder(tmp_path, monkeypatch)
    stored_sequences("test-softmax", [1], record)
    path = next(store_folder().glob("*.json"))
    path.write_text('{"name": ')
    stored_sequences("test-softmax", [1], record)
    data = json.loads(path.read_text())
    data["name"] = "another key"
    path.write_text(json.dumps(data))
    stored_sequences("test-softmax", [1], record)
    assert len(calls) == 3


def test_the_store_can_be_turned_off(tmp_path, monkeypatch):
    monkeypatch.setenv("GRAPHBORROW_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(STORE_ENV, "0")
    calls = []
    for _ in range(2):
        stored_sequences("test-softmax", [2], lambda: calls.append(1) or softmax_phases())
    assert len(calls) == 2 and not (tmp_path / "sequences").exists()


def test_plans_from_the_store_equal_plans_recorded_afresh(tmp_path):
    """The capacity planner in a new process, with the store filled by another and with none."""
    code = """
import json, sys
from graphborrow.eagle.plan import plan_verify
from graphborrow.planning.planner import PoolImage
image = PoolImage.from_runs([(1 << 40, 48 << 20), (2 << 40, 12 << 20)])
rows = [(m, bs, d, p.fits, p.peak_bytes, p.requests_per_chunk, p.reason)
        for m in ("standard", "lean", "chunked") for bs in (1, 32) for d in (4,)
        for p in [plan_verify(image, bs, d, 32000, m)]]
print(json.dumps(rows))
"""
    env = {"GRAPHBORROW_CACHE_DIR": str(tmp_path), "GRAPHBORROW_SIM_PURE": "1", "PATH": "/usr/bin:/bin"}
    run = lambda extra: subprocess.run([sys.executable, "-c", code], env={**env, **extra}, capture_output=True,  # noqa: E731
                                       text=True, check=True).stdout
    fresh = run({STORE_ENV: "0"})
    filled, read = run({}), run({})
    assert fresh == filled == read
    assert list((tmp_path / "sequences").rglob("*.json")), "the second process read what the first stored"
