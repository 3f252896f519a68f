"""Sweeps end to end on the embedded Dask cluster: failures, reruns, damage, locks, Ctrl-C."""

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter

import psutil
import pytest
from sweep_notebooks import executions, tiny_notebook, wait_for

from graphborrow.core.errors import ParameterError
from graphborrow.run import results
from graphborrow.run.sweep import Grid, read_csv, run_sweep
from graphborrow.run.sweep.execute import count_images

pytestmark = pytest.mark.slow


def test_out_of_range_point_rejected_before_anything_runs(tmp_path):
    nb = tiny_notebook(tmp_path / "tiny.ipynb")
    with pytest.raises(ParameterError, match="99999"):
        run_sweep(nb, Grid(axes={"BATCH_SIZE": [1, 99999]}), out=tmp_path / "out", progress=False)
    with pytest.raises(ParameterError, match="VOCAB is not declared"):
        run_sweep(nb, Grid(fixed={"VOCAB": 64}), out=tmp_path / "out", progress=False)
    with pytest.raises(ParameterError, match="axis BATCH_SIZE has no values"):
        run_sweep(nb, Grid(axes={"BATCH_SIZE": []}), out=tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    assert executions(nb) == []


def test_failures_reruns_damage_and_figures(tmp_path, monkeypatch):
    monkeypatch.setenv("MPLBACKEND", "Agg")  # as `make` used to export: must not reach the kernels
    nb = tiny_notebook(tmp_path / "tiny.ipynb")
    grid = Grid(axes={"BATCH_SIZE": [1, 2, 3]}, fixed={"DRAFT_TOKENS": 4})
    out = tmp_path / "out"
    report = run_sweep(nb, grid, name="s", out=out, workers=2, progress=False)
    assert {p.point_id: p.status for p in report.points} == {
        "batch_size=1": "ok", "batch_size=2": "failed", "batch_size=3": "ok"}
    assert "AssertionError" in report.failed[0].error and "broken on purpose" in report.failed[0].error
    point = out / "s" / "batch_size=3"
    record = results.load("tiny", point / "results")["results"]
    assert record["bytes"] == 3 * 4 * 1024
    assert "inline" in record["backend"], "the kernel kept the inline backend"
    assert count_images((point / "tiny.ipynb").read_bytes()) == 1, "the executed notebook holds its figure"
    assert json.loads((out / "s/batch_size=2/point.json").read_text())["status"] == "failed"
    rows = read_csv(report.csv_path)
    assert [r["status"] for r in rows] == ["ok", "failed", "ok"]
    assert rows[2]["results.bytes"] == str(3 * 4 * 1024)
    assert all(r["worker"].startswith("tcp://127.0.0.1:") and r["host"] for r in rows)
    assert report.plot_path is not None and report.plot_path.stat().st_size > 0
    assert sorted(executions(nb)) == [1, 2, 3]

    # Rerun: completed points are reused untouched; the failed one runs again.
    before = (point / "tiny.ipynb").stat().st_mtime_ns
    again = run_sweep(nb, grid, name="s", out=out, progress=False)
    assert [p.status for p in again.points] == ["done", "failed", "done"]
    assert (point / "tiny.ipynb").stat().st_mtime_ns == before
    assert sorted(executions(nb)) == [1, 2, 2, 3]

    # A damaged results file: named, and only that point runs again.
    (point / "results" / "tiny.json").write_text('{"truncated": ')
    messages = []
    third = run_sweep(nb, grid, name="s", out=out, progress=False, log=messages.append)
    assert [p.status for p in third.points] == ["done", "failed", "ok"]
    assert any(str(point / "results" / "tiny.json") in m and "damaged" in m for m in messages)
    assert sorted(executions(nb)) == [1, 2, 2, 2, 3, 3]
    assert len(read_csv(third.csv_path)) == 3


def test_changed_fixed_parameter_is_not_already_done(tmp_path):
    nb = tiny_notebook(tmp_path / "tiny.ipynb", fail_at=None)
    out = tmp_path / "out"
    first = run_sweep(nb, Grid(axes={"BATCH_SIZE": [1, 3]}, fixed={"DRAFT_TOKENS": 4}), name="s", out=out,
                      progress=False)
    assert [p.status for p in first.points] == ["ok", "ok"]
    messages = []
    second = run_sweep(nb, Grid(axes={"BATCH_SIZE": [1, 3]}, fixed={"DRAFT_TOKENS": 8}), name="s", out=out,
                       progress=False, log=messages.append)
    assert [p.status for p in second.points] == ["ok", "ok"], "not reported as already done"
    assert [p.results["results.bytes"] for p in second.points] == [8 * 1024, 3 * 8 * 1024]
    assert [r["DRAFT_TOKENS"] for r in read_csv(second.csv_path)] == ["8", "8"]
    assert sum("other parameters" in m for m in messages) == 2
    kept = sorted((out / "s" / "_superseded").iterdir())  # the first run's points, not deleted
    assert [p.name.split("-")[0] for p in kept] == ["batch_size=1", "batch_size=3"]
    assert [results.load("tiny", p / "results")["results"]["bytes"] for p in kept] == [4 * 1024, 3 * 4 * 1024]


def cli(*args, **kwargs):
    return subprocess.Popen([sys.executable, "-m", "graphborrow", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)


def test_concurrent_sweeps_of_one_name_run_each_point_once(tmp_path):
    nb = tiny_notebook(tmp_path / "tiny.ipynb", fail_at=None)
    args = ("sweep", str(nb), "-p", "batch_size", "1,3", "--name", "same", "--out", str(tmp_path / "out"),
            "--quiet")
    procs = [cli(*args) for _ in range(3)]
    outputs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outputs
    assert Counter(executions(nb)) == {1: 1, 3: 1}, "each point ran exactly once"
    summaries = sorted(o[0].splitlines()[0] for o in outputs)
    assert summaries == ["2 points: 0 ran, 2 already done, 0 failed"] * 2 + ["2 points: 2 ran, 0 already done, 0 failed"]
    assert sum("waiting for it to finish" in o[1] for o in outputs) >= 1


def processes_with(token: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("GRAPHBORROW_TEST_TOKEN") == token:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its parent to reap it has finished)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_ctrl_c_cancels_without_orphans_and_keeps_finished_points(tmp_path):
    nb = tiny_notebook(tmp_path / "tiny.ipynb", fail_at=None, stall_at=3)
    out = tmp_path / "out"
    token = f"ctrl-c-{os.getpid()}-{time.time()}"
    proc = cli("sweep", str(nb), "-p", "batch_size", "1,3", "--workers", "2", "--out", str(out), "--quiet",
               env={**os.environ, "GRAPHBORROW_TEST_TOKEN": token, "TMPDIR": str(tmp_path)},
               start_new_session=True)
    try:
        wait_for(lambda: (out / "tiny" / "batch_size=1" / "point.json").exists()
                 and nb.with_suffix(".stalled").exists(), what="one point done and one running")
        kernel_pid = int(nb.with_suffix(".stalled").read_text().split()[0])
        assert alive(kernel_pid)
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole group
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, stderr
    assert "interrupted" in stderr and "Traceback" not in stderr
    wait_for(lambda: not processes_with(token), timeout=20, what="every process of the sweep to exit")
    wait_for(lambda: not alive(kernel_pid), timeout=5, what="the stalled point's kernel to exit")
    assert json.loads((out / "tiny" / "batch_size=1" / "point.json").read_text())["status"] == "ok"
    assert not (out / "tiny" / "batch_size=3").exists()


def test_embedded_cluster_leaves_8787_alone_and_logs_only_critical(tmp_path):
    """Another cluster's dashboard on 8787 must not make ours warn, and a worker's shutdown
    traceback (a heartbeat cut by Ctrl-C) must not reach the terminal: both once broke the
    Ctrl-C test above under load."""
    import logging
    import socket
    import warnings

    from graphborrow.run.sweep.cluster import dask_client

    holder = socket.socket()
    try:
        holder.bind(("127.0.0.1", 8787))
        holder.listen()
    except OSError:
        pass  # someone else holds it already: the same situation
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with dask_client(workers=1) as client:
                levels = client.run(lambda: logging.getLogger("distributed").getEffectiveLevel())
    finally:
        holder.close()
    assert not [w for w in caught if "already in use" in str(w.message)]
    assert list(levels.values()) == [logging.CRITICAL]
