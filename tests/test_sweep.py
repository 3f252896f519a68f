import json
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from graphborrow import results, sweep
from graphborrow.errors import ParameterError


def tiny_notebook(path: Path) -> Path:
    """A notebook that fails at BATCH_SIZE == 2 and otherwise saves a result."""
    nb = nbformat.v4.new_notebook()
    params = nbformat.v4.new_code_cell('BATCH_SIZE = 1\nDRAFT_TOKENS = 4\nOUTPUT_DIR = "results"')
    params.metadata["tags"] = ["parameters"]
    nb.cells = [
        params,
        nbformat.v4.new_code_cell('assert BATCH_SIZE != 2, "batch size two is broken on purpose"'),
        nbformat.v4.new_code_cell(
            "from graphborrow import results\n"
            "results.save('tiny', {'bytes': BATCH_SIZE * DRAFT_TOKENS * 1024}, OUTPUT_DIR,"
            " device_work=BATCH_SIZE)"),
    ]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)
    return path


def test_validate_rejects_out_of_range_unknown_and_undeclared():
    assert sweep.validate({"batch_size": 8, "fit_policy": "best"}) == {"BATCH_SIZE": 8, "FIT_POLICY": "best"}
    with pytest.raises(ParameterError, match=r"BATCH_SIZE=5000 is out of range; allowed: 1 to 4096"):
        sweep.validate({"batch_size": 5000})
    with pytest.raises(ParameterError, match="choose one of"):
        sweep.validate({"fit_policy": "worst"})
    with pytest.raises(ParameterError, match="LADDER entry 0"):
        sweep.validate({"ladder": [8, 0]})
    with pytest.raises(ParameterError, match="must be an integer"):
        sweep.validate({"draft_tokens": 2.5})
    with pytest.raises(ParameterError, match="unknown parameter 'bogus'"):
        sweep.validate({"bogus": 1})
    with pytest.raises(ParameterError, match="not declared in the notebook"):
        sweep.validate({"vocab": 64}, known={"BATCH_SIZE"})


def test_grid_from_yaml_and_cli(tmp_path):
    grid_file = tmp_path / "grid.yaml"
    grid_file.write_text("name: g\nparameters:\n  device: sim\n  ladder: [8, 4, 2]\n"
                         "grid:\n  batch_size: [1, 2]\n  draft_tokens: [4, 8]\n")
    grid = sweep.Grid.from_yaml(grid_file)
    assert grid.fixed == {"DEVICE": "sim", "LADDER": [8, 4, 2]}
    assert len(grid.points()) == 4
    grid.add_cli([("draft_tokens", "16"), ("ladder", "[4,2],[2,1]")])
    points = grid.points()
    assert len(points) == 4 and all(p["DRAFT_TOKENS"] == 16 for p in points)
    assert {tuple(p["LADDER"]) for p in points} == {(4, 2), (2, 1)}
    ids = {sweep.point_id(p, grid.axes) for p in points}
    assert "batch_size=1_ladder=4-2" in ids


def test_out_of_range_point_rejected_before_anything_runs(tmp_path):
    nb = tiny_notebook(tmp_path / "tiny.ipynb")
    grid = sweep.Grid(axes={"BATCH_SIZE": [1, 99999]})
    with pytest.raises(ParameterError, match="99999"):
        sweep.sweep(nb, grid, runs_dir=tmp_path / "runs", progress=False)
    assert not (tmp_path / "runs").exists()
    with pytest.raises(ParameterError, match="VOCAB is not declared"):
        sweep.sweep(nb, sweep.Grid(fixed={"VOCAB": 64}), runs_dir=tmp_path / "runs", progress=False)


@pytest.mark.slow
def test_sweep_survives_a_failing_point_and_rerun_skips_completed(tmp_path):
    nb = tiny_notebook(tmp_path / "tiny.ipynb")
    grid = sweep.Grid(axes={"BATCH_SIZE": [1, 2, 3]}, fixed={"DRAFT_TOKENS": 4})
    report = sweep.sweep(nb, grid, name="s", runs_dir=tmp_path / "runs", progress=False)
    status = {p.point_id: p.status for p in report.points}
    assert status == {"batch_size=1": "ok", "batch_size=2": "failed", "batch_size=3": "ok"}
    failed = report.failed[0]
    assert "AssertionError" in failed.error and "broken on purpose" in failed.error
    point_dir = tmp_path / "runs" / "s" / "batch_size=3"
    assert (point_dir / "tiny.ipynb").exists()
    assert results.load("tiny", point_dir / "results")["results"]["bytes"] == 3 * 4 * 1024
    assert json.loads((tmp_path / "runs/s/batch_size=2/point.json").read_text())["status"] == "failed"
    rows = sweep.read_csv(report.csv_path)
    assert [r["status"] for r in rows] == ["ok", "failed", "ok"]
    assert rows[2]["results.bytes"] == str(3 * 4 * 1024)
    assert report.plot_path is not None and report.plot_path.stat().st_size > 0

    before = (point_dir / "tiny.ipynb").stat().st_mtime_ns
    again = sweep.sweep(nb, grid, name="s", runs_dir=tmp_path / "runs", progress=False)
    assert [p.status for p in again.points] == ["skipped", "failed", "skipped"]
    assert (point_dir / "tiny.ipynb").stat().st_mtime_ns == before
    assert len(sweep.read_csv(again.csv_path)) == 3


def test_cli_rejects_out_of_range_with_clear_message(tmp_path):
    nb = tiny_notebook(tmp_path / "tiny.ipynb")
    proc = subprocess.run(
        [sys.executable, "-m", "graphborrow", "sweep", str(nb), "-p", "batch_size", "1,0",
         "--runs-dir", str(tmp_path / "runs")], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "BATCH_SIZE=0 is out of range; allowed: 1 to 4096" in proc.stderr
    assert not (tmp_path / "runs").exists()
