"""``python -m graphborrow simulate``: an unmodified GPU script on the simulated device."""

import pickle
import subprocess
import sys
import textwrap

import pytest

from graphborrow.core.errors import ParameterError
from graphborrow.run.simulate import parse_bytes, simulate_source

SCRIPT = textwrap.dedent("""
    import sys
    import torch
    x = torch.randn(64, 128, device="cuda")
    assert torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
    (x @ x.T).softmax(-1)  # warm-up: cuBLAS makes its handle here; inside a capture that fails, as on CUDA
    pool = torch.cuda.graph_pool_handle()
    graphs = []  # kept alive: a pool whose graphs are all gone cannot be captured into again
    for n in (256, 64):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool):
            y = (x @ torch.randn(128, n, device="cuda")).softmax(-1)
        graphs.append((g, y))
    print("ran with", sys.argv[1:])
""")


def test_a_script_runs_unmodified_and_its_graph_pool_is_reported(tmp_path):
    sim = simulate_source(SCRIPT, name="tiny", out=tmp_path, batches=(1, 4), draft_tokens=(4,), vocab=32000)
    assert sim.error is None
    snapshot = pickle.loads(sim.snapshot_path.read_bytes())
    assert snapshot["device_traces"][0] and {"segments", "allocator_settings"} <= set(snapshot)
    [report] = sim.reports
    pool = report.pool(report.planned_pool)
    assert report.planned_pool != (0, 0) and pool.reserved_bytes >= 2 * 2**20 and pool.largest_run > 0
    assert {r["batch_size"] for r in report.fit} == {1, 4}
    assert "memory_viz" in sim.summary() and "verification steps against pool" in sim.summary()


def test_the_command_line_passes_arguments_and_reports_the_scripts_error(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("import sys, torch\nprint('args', sys.argv[1:])\nraise ValueError('own failure')\n")
    done = subprocess.run([sys.executable, "-m", "graphborrow", "simulate", "--out", str(tmp_path), str(script), "a",
                           "--flag"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 1 and "args ['a', '--flag']" in done.stdout
    assert "ValueError: own failure" in done.stdout


def test_sizes_are_read_with_units_and_bad_ones_named():
    assert parse_bytes("80GiB") == 80 * 2**30 and parse_bytes("512MiB") == 2**29 and parse_bytes("1000") == 1000
    with pytest.raises(ParameterError, match="not a memory size"):
        parse_bytes("lots")
