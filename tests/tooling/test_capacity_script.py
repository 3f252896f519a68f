"""benchmarks/capacity_gpu.py on the simulated device: the GPU script's CPU twin."""

import json

from conftest import load_script


def load_capacity_script():
    return load_script("benchmarks/capacity_gpu.py")


def test_every_check_agrees_and_the_sequences_match(tmp_path):
    out = tmp_path / "capacity.json"
    code = load_capacity_script().main(["--device", "sim", "--small", "--batches", "1,8", "--draft-tokens", "4",
                               "--top-k", "20", "--out", str(out)])
    result = json.loads(out.read_text())
    assert code == 0
    assert result["checks"] == 12 and result["agreements"] == 12 and result["sequence_equal"] == 12
    assert {r["pool"] for r in result["rows"]} == {"fresh", "built"}
    assert {r["planned"] for r in result["rows"]} == {True, False}  # both outcomes in this grid
    assert result["command"].startswith("python ") and result["torch"] and "simulated" in result["device"]


def test_the_comparison_shows_where_sequences_part():
    script = load_capacity_script()
    device = [("alloc", 512), ("alloc", 8), ("free", 1), ("alloc", 4096), ("free", 0), ("free", 2)]
    planned = [("alloc", 512), ("alloc", 4096), ("free", 0), ("free", 1)]
    diff = script.compare(device, planned)
    assert not diff["sequence_equal"] and diff["first_difference"] == 1
    assert diff["device_only_sizes"] == [8] and diff["planned_only_sizes"] == []
    assert diff["device_around"][1] == ["alloc", 8]
    assert script.compare(planned, list(planned))["sequence_equal"]
