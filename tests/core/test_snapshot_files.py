"""Snapshot files are read without running code; numpy values and out-of-range segments are handled."""

import gzip
import json
import pickle
from pathlib import Path

import numpy as np
import pytest

from graphborrow.core.errors import SnapshotFormatError
from graphborrow.core.runs import find_free_runs, summarize
from graphborrow.core.snapshot import TRUST, load_snapshot, read_snapshot_file

DATA = Path(__file__).resolve().parents[2] / "data"
MiB = 1 << 20


def segment(address=1 << 30, blocks=((MiB, "active_allocated"), (3 * MiB, "inactive"))):
    out, at = [], address
    for size, state in blocks:
        out.append({"address": at, "size": size, "state": state})
        at += size
    return {"address": address, "total_size": at - address, "stream": 0, "segment_pool_id": (0, 1), "blocks": out}


class LeavesAMark:
    """Unpickling this would create a file: the proof that a loader ran code from a file."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def test_every_recorded_file_reads_with_the_safe_reader():
    files = sorted(DATA.rglob("*.pickle*"))
    assert len(files) > 50
    for path in files:
        loaded = read_snapshot_file(path)
        assert isinstance(loaded, (dict, list)), path


def test_a_pickle_that_would_run_code_is_refused_by_name_and_runs_nothing(tmp_path):
    mark = tmp_path / "ran"
    bad = tmp_path / "engine.pickle"
    bad.write_bytes(pickle.dumps({"segments": [segment()], "x": LeavesAMark(mark)}))
    with pytest.raises(SnapshotFormatError) as refused:
        load_snapshot(bad)
    message = str(refused.value)
    assert "holds pathlib.Path" in message or "holds pathlib._local.Path" in message
    assert "it was not built, because unpickling an object can run code" in message
    assert "load_snapshot(pickle.load(open(path, 'rb')))" in message and "JSON form" in message
    assert not mark.exists()
    with gzip.open(tmp_path / "engine.pickle.gz", "wb") as f:
        f.write(bad.read_bytes())
    with pytest.raises(SnapshotFormatError, match="was not built"):
        load_snapshot(tmp_path / "engine.pickle.gz")
    assert not mark.exists()


def test_persistent_references_and_numpy_objects_are_refused(tmp_path):
    class Persistent(pickle.Pickler):
        def persistent_id(self, obj):
            return "storage-0" if obj == "tensor" else None

    path = tmp_path / "p.pickle"
    with open(path, "wb") as f:
        Persistent(f).dump({"segments": [segment()], "t": "tensor"})
    with pytest.raises(SnapshotFormatError, match=r"holds a persistent reference \('storage-0'\)"):
        load_snapshot(path)
    path.write_bytes(pickle.dumps({"segments": [segment(address=np.int64(1 << 30))]}))
    with pytest.raises(SnapshotFormatError, match="holds numpy"):
        load_snapshot(path)


def test_torch_version_strings_are_read_as_plain_strings(tmp_path):
    torch_version = pytest.importorskip("torch.torch_version")
    path = tmp_path / "v.pickle"
    path.write_bytes(pickle.dumps({"segments": [segment()], "torch": torch_version.TorchVersion("2.11.0")}))
    loaded = load_snapshot(path)
    assert loaded["torch"] == "2.11.0" and type(loaded["torch"]) is str


def test_the_json_form_reads_like_the_pickle(tmp_path):
    snapshot = {"segments": [segment(), segment(address=2 << 30)], "device_traces": [[]]}
    (tmp_path / "s.pickle").write_bytes(pickle.dumps(snapshot))
    (tmp_path / "s.json").write_text(json.dumps(snapshot))
    with gzip.open(tmp_path / "s.json.gz", "wt") as f:
        json.dump(snapshot, f)
    runs = find_free_runs(tmp_path / "s.pickle")
    assert runs == find_free_runs(tmp_path / "s.json") == find_free_runs(tmp_path / "s.json.gz")
    assert runs == [((1 << 30) + MiB, 3 * MiB), ((2 << 30) + MiB, 3 * MiB)]
    (tmp_path / "bad.json").write_text("{\"segments\": [")
    with pytest.raises(SnapshotFormatError, match="is not a readable snapshot JSON"):
        load_snapshot(tmp_path / "bad.json")


def test_the_trust_model_is_stated_where_snapshots_are_read():
    from graphborrow.core import snapshot

    assert "without running code" in TRUST and "json" in TRUST.lower()
    assert "can run any code" in snapshot.__doc__


def test_numpy_integers_are_integers_and_come_back_as_python_ints():
    raw = segment()
    spoiled = dict(raw, address=np.int64(raw["address"]), total_size=np.uint64(raw["total_size"]),
                   blocks=[dict(b, size=np.int32(b["size"]), address=np.int64(b["address"])) for b in raw["blocks"]])
    checked = load_snapshot([spoiled])["segments"][0]
    assert checked == raw
    assert all(type(v) is int for v in (checked["address"], checked["total_size"]))
    assert all(type(b[k]) is int for b in checked["blocks"] for k in ("address", "size"))
    assert type(spoiled["address"]) is np.int64, "the caller's dicts are not changed"
    assert load_snapshot([raw])["segments"][0] is raw, "a segment of plain ints is not copied"
    assert find_free_runs([spoiled]) == [((1 << 30) + MiB, 3 * MiB)]
    assert all(type(v) is int for run in find_free_runs([spoiled]) for v in run)


def test_numpy_integers_in_trace_entries_become_ints():
    entry = {"action": "alloc", "addr": np.int64(1 << 30), "size": np.int64(512), "stream": np.int64(0)}
    loaded = load_snapshot({"segments": [segment()], "device_traces": [[entry]]})
    got = loaded["device_traces"][0][0]
    assert got == {"action": "alloc", "addr": 1 << 30, "size": 512, "stream": 0}
    assert all(type(got[k]) is int for k in ("addr", "size", "stream"))


@pytest.mark.parametrize("address, total", [((1 << 64) - MiB, 2 * MiB), (1 << 64, MiB), (1 << 80, MiB)])
def test_a_segment_past_the_end_of_the_address_space_is_refused(address, total):
    bad = segment(address=address, blocks=((total, "inactive"),))
    with pytest.raises(SnapshotFormatError, match="run past the end of the 64-bit address space"):
        summarize([bad])


def test_a_segment_ending_exactly_at_two_to_the_64_is_refused_as_an_arena_extent_is():
    """Ranges end below 2**64 (core.checks); the loader had let one end there, and the planner then
    failed on it with a traceback."""
    top = segment(address=(1 << 64) - 2 * MiB, blocks=((2 * MiB, "inactive"),))
    with pytest.raises(SnapshotFormatError, match="run past the end of the 64-bit address space"):
        find_free_runs([top])
    below = segment(address=(1 << 64) - 4 * MiB, blocks=((2 * MiB, "inactive"),))
    assert find_free_runs([below]) == [((1 << 64) - 4 * MiB, 2 * MiB)]


def test_a_directory_and_a_missing_file_are_named(tmp_path):
    with pytest.raises(SnapshotFormatError, match="is a directory"):
        load_snapshot(tmp_path)
    with pytest.raises(FileNotFoundError):
        load_snapshot(tmp_path / "missing.pickle")
