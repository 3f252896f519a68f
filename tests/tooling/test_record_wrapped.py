"""scripts/record_wrapped.py on the simulated device: the GPU recorder's dry run, end to end.

One run, short, of the suite's serving workload with expandable segments (graph captures, borrows
through a pluggable MemPool inside expandable memory): each cut is a trace whose ring wrapped, with
its record, and replays at 1.0 on the simulated allocator (its own traces).
"""

import gzip
import json
import pickle

from conftest import load_script

from graphborrow.fidelity.replay import replay_trace


def test_a_short_run_writes_wrapped_traces_that_replay(tmp_path, capsys):
    script = load_script("scripts/record_wrapped.py")
    code = script.main([str(tmp_path), "--device", "sim", "--only", "suite_expandable_ring1000", "--steps-scale", "0.08",
                        "--jobs", "1", "--no-replay"])
    assert code == 0, capsys.readouterr().err
    index = json.loads((tmp_path / "index.json").read_text())
    assert [row["name"] for row in index["traces"]] == [f"suite_expandable_ring1000_cut{k}" for k in range(3)]
    assert all(row["wrapped"] and row["events"] == 1000 for row in index["traces"])
    with gzip.open(tmp_path / "suite_expandable_ring1000_cut2.pickle.gz", "rb") as f:
        snapshot = pickle.load(f)
    meta = snapshot["corpus"]
    assert meta["settings"] == "expandable_segments:True" and meta["device_memory"] > 0
    assert meta["command"].startswith("python scripts/record_wrapped.py")
    assert any(s["is_expandable"] for s in snapshot["segments"])
    report = replay_trace(snapshot)  # the record gives the device's memory: its reservations' sizes
    assert report.mid_run and report.agreement == 1.0 and report.checks > 300, str(report)
