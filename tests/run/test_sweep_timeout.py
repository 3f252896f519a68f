"""A sweep point whose cell hangs ends at the per-cell limit, default or given, and is recorded
failed with that reason while the other points finish."""

from __future__ import annotations

import json
import math
import re

import pytest
from sweep_notebooks import tiny_notebook

import graphborrow.run.sweep as sweep
from graphborrow.__main__ import build_parser
from graphborrow.core.errors import ParameterError
from graphborrow.run.sweep import Grid, read_csv, run_sweep
from graphborrow.run.sweep.execute import DEFAULT_CELL_TIMEOUT, NotebookJob, execute

pytestmark = pytest.mark.slow


def test_a_hung_point_without_timeout_fails_at_the_default_limit_with_its_reason(tmp_path, monkeypatch):
    monkeypatch.setattr(sweep, "DEFAULT_CELL_TIMEOUT", 2.0)  # ten minutes stands in as two seconds
    nb = tiny_notebook(tmp_path / "tiny.ipynb", fail_at=None, stall_at=3, stall_once=False)  # sleeps 120 s
    report = run_sweep(nb, Grid(axes={"BATCH_SIZE": [1, 3, 4]}), out=tmp_path / "out", progress=False)
    assert [p.status for p in report.points] == ["ok", "failed", "ok"]
    reason = "a cell ran longer than the per-cell timeout of 2 s (CellTimeoutError)"
    assert report.failed[0].error.startswith(reason), report.failed[0].error
    assert read_csv(report.csv_path)[1]["error"].startswith(reason)
    point = json.loads((report.directory / "batch_size=3" / "point.json").read_text())
    assert point["error"].startswith(reason) and f"FAILED batch_size=3: {reason}" in report.summary()


def test_no_limit_is_a_choice_and_a_bad_limit_is_refused(tmp_path):
    nb = tiny_notebook(tmp_path / "tiny.ipynb", fail_at=None)
    ran = execute(NotebookJob(nb.name, nb.read_bytes(), {"BATCH_SIZE": 1}, "unlimited", timeout=math.inf))
    assert ran.returncode == 0, ran.error
    for bad in (0, -5, math.nan, True, "10"):
        with pytest.raises(ParameterError, match="must be a positive number of seconds per cell"):
            run_sweep(nb, Grid(), out=tmp_path / "out", timeout=bad, progress=False)
    assert not (tmp_path / "out").exists()


def test_the_command_line_states_the_default_limit():
    sweep_parser = build_parser()._subparsers._group_actions[0].choices["sweep"]
    text = next(a.help for a in sweep_parser._actions if a.dest == "timeout")
    assert re.search(r"default (\d+)", text).group(1) == f"{DEFAULT_CELL_TIMEOUT:.0f}"
