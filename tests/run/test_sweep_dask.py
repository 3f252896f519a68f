"""Sweeps on a real Dask cluster: `dask scheduler` and two `dask worker` processes on 127.0.0.1."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest
from sweep_notebooks import executions, tiny_notebook, wait_for

from graphborrow.core.errors import ParameterError
from graphborrow.run.sweep import Grid, read_csv, run_sweep

pytestmark = pytest.mark.slow

@contextmanager
def local_cluster(tmp_path: Path, workers: int = 2, env: dict | None = None):
    """A scheduler and ``workers`` single-thread workers without nannies; yields
    (address, {worker address: process})."""
    from distributed import Client

    # As the README recommends: a worker holds only the points it runs (none queued on it).
    # Points of a killed worker cannot remove their temporary folders: keep them in tmp_path.
    (tmp_path / "worker-tmp").mkdir()
    env = {**os.environ, "DASK_DISTRIBUTED__SCHEDULER__WORKER_SATURATION": "1.0",
           "TMPDIR": str(tmp_path / "worker-tmp"), **(env or {})}
    bin_dir = Path(sys.executable).parent
    scheduler_file = tmp_path / "scheduler.json"
    logs = tmp_path / "cluster-logs"
    logs.mkdir()
    procs = [subprocess.Popen([bin_dir / "dask", "scheduler", "--host", "127.0.0.1", "--port", "0",
                               "--no-dashboard", "--scheduler-file", scheduler_file],
                              env=env, stdout=subprocess.DEVNULL, stderr=open(logs / "scheduler.log", "w"))]
    try:
        wait_for(scheduler_file.exists, 60, "the scheduler file")
        for i in range(workers):
            procs.append(subprocess.Popen(
                [bin_dir / "dask", "worker", "--scheduler-file", scheduler_file, "--nthreads", "1",
                 "--no-nanny", "--no-dashboard", "--name", f"w{i}", "--host", "127.0.0.1"],
                env=env, stdout=subprocess.DEVNULL, stderr=open(logs / f"worker{i}.log", "w")))
        address = json.loads(scheduler_file.read_text())["address"]
        with Client(address) as client:
            client.wait_for_workers(workers, timeout=120)
            by_pid = {pid: addr for addr, pid in client.run(os.getpid).items()}
        yield address, {by_pid[p.pid]: p for p in procs[1:]}
    finally:
        # workers first, while the scheduler still answers: a worker told to stop as the scheduler
        # closes can hang in its own close until killed (20 s lost per test)
        for group in (procs[1:], procs[:1]):
            for p in group:
                if p.poll() is None:
                    p.terminate()
            for p in group:
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    p.kill()


def test_four_points_spread_over_both_workers(tmp_path):
    nb = tiny_notebook(tmp_path / "tiny.ipynb", fail_at=None)
    with local_cluster(tmp_path) as (address, workers):
        report = run_sweep(nb, Grid(axes={"BATCH_SIZE": [1, 2, 3, 4]}), out=tmp_path / "out",
                           scheduler=address, progress=False)
    assert [p.status for p in report.points] == ["ok"] * 4
    rows = read_csv(report.csv_path)
    assert {r["worker"] for r in rows} == set(workers), "both workers ran points"
    assert {r["host"] for r in rows} == {socket.gethostname()}
    assert [r["results.bytes"] for r in rows] == [str(b * 4 * 1024) for b in (1, 2, 3, 4)]
    for r in rows:  # the client wrote what the workers sent back
        assert (report.directory / r["point_id"] / "tiny.ipynb").stat().st_size > 0


def sweep_in_background(**kwargs):
    box = {}

    def target():
        try:
            box["report"] = run_sweep(**kwargs)
        except BaseException as exc:  # surfaced by the test
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, box


def kill_worker_running_stalled_point(nb: Path, workers: dict) -> tuple[str, int, int]:
    """SIGKILL the worker whose kernel runs the stalled point; (its address, the kernel, the kernel's
    parent: the worker's kernel server)."""
    wait_for(nb.with_suffix(".stalled").exists, what="the stalled point to start")
    kernel, parent = map(int, nb.with_suffix(".stalled").read_text().split())
    ancestors = {p.pid for p in psutil.Process(kernel).parents()}
    victim, proc = next((addr, proc) for addr, proc in workers.items() if proc.pid in ancestors)
    os.kill(proc.pid, signal.SIGKILL)
    return victim, kernel, parent


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_killed_worker_point_is_retried_on_the_other_worker(tmp_path):
    nb = tiny_notebook(tmp_path / "tiny.ipynb", fail_at=None, stall_at=3)
    with local_cluster(tmp_path) as (address, workers):
        thread, box = sweep_in_background(notebook=nb, grid=Grid(axes={"BATCH_SIZE": [1, 2, 3, 4]}),
                                          out=tmp_path / "out", scheduler=address, progress=False)
        victim, kernel, server = kill_worker_running_stalled_point(nb, workers)
        thread.join(timeout=300)
    assert "error" not in box, box.get("error")
    report = box["report"]
    assert [p.status for p in report.points] == ["ok"] * 4, report.summary()
    survivor = (set(workers) - {victim}).pop()
    assert report.points[2].worker == survivor, "the killed point ran again on the other worker"
    assert executions(nb).count(3) == 2
    wait_for(lambda: gone(server) and gone(kernel), 10, "the killed worker's kernel server and kernel to exit")


def test_killed_worker_point_recorded_failed_when_no_retry_is_allowed(tmp_path):
    nb = tiny_notebook(tmp_path / "tiny.ipynb", fail_at=None, stall_at=3)
    with local_cluster(tmp_path, env={"DASK_DISTRIBUTED__SCHEDULER__ALLOWED_FAILURES": "0"}) as (address, workers):
        thread, box = sweep_in_background(notebook=nb, grid=Grid(axes={"BATCH_SIZE": [1, 2, 3, 4]}),
                                          out=tmp_path / "out", scheduler=address, progress=False)
        kill_worker_running_stalled_point(nb, workers)
        thread.join(timeout=300)
    assert "error" not in box, box.get("error")
    report = box["report"]
    assert [p.status for p in report.points] == ["ok", "ok", "failed", "ok"], report.summary()
    assert "worker running this point died" in report.points[2].error
    point = json.loads((report.directory / "batch_size=3" / "point.json").read_text())
    assert point["status"] == "failed" and "died" in point["error"]
    assert [r["status"] for r in read_csv(report.csv_path)] == ["ok", "ok", "failed", "ok"]


def test_a_cluster_without_gpus_or_a_workers_address_is_refused(tmp_path):
    """GPU points need a GPU worker; and a worker's address, which answers Dask too, is named as
    a worker's, not taken for the scheduler."""
    nb = tiny_notebook(tmp_path / "tiny.ipynb", fail_at=None, declare='DEVICE = "auto"')
    with local_cluster(tmp_path, workers=1) as (address, workers):
        with pytest.raises(ParameterError, match="no worker of .* offers one; start one worker per GPU"):
            run_sweep(nb, Grid(fixed={"DEVICE": "cuda"}), out=tmp_path / "out", scheduler=address,
                      progress=False)
        worker = next(iter(workers))
        with pytest.raises(ParameterError, match=f"{worker} is a Dask worker, not the scheduler"):
            run_sweep(nb, Grid(), out=tmp_path / "out", scheduler=worker, progress=False)
    assert executions(nb) == []


def test_unreachable_scheduler_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT", "2s")
    import dask

    dask.config.refresh()
    nb = tiny_notebook(tmp_path / "tiny.ipynb", fail_at=None)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again below: nothing listens there
    try:
        with pytest.raises(ParameterError, match=f"cannot reach the Dask scheduler at tcp://127.0.0.1:{port}"):
            run_sweep(nb, Grid(), out=tmp_path / "out", scheduler=f"tcp://127.0.0.1:{port}", progress=False)
    finally:
        monkeypatch.undo()
        dask.config.refresh()


def test_cancelled_point_stops_its_kernel_on_a_live_worker(tmp_path):
    """Ctrl-C against an existing cluster cancels the futures; the workers live on, and each
    kills the kernel of its cancelled point (and whatever that kernel started)."""
    from distributed import Client

    from graphborrow.run.sweep.cluster import run_point_on_worker
    from graphborrow.run.sweep.execute import NotebookJob

    nb = tiny_notebook(tmp_path / "tiny.ipynb", fail_at=None, stall_at=3)
    job = NotebookJob(nb.name, nb.read_bytes(), {"BATCH_SIZE": 3}, "stalled")
    with local_cluster(tmp_path, workers=1) as (address, workers), Client(address) as client:
        future = client.submit(run_point_on_worker, job, pure=False)
        wait_for(nb.with_suffix(".stalled").exists, what="the point to start")
        kernel = int(nb.with_suffix(".stalled").read_text().split()[0])
        future.cancel()
        wait_for(lambda: gone(kernel), 10, "the cancelled point's kernel to exit")
        assert all(p.poll() is None for p in workers.values()), "the worker itself lives on"
        assert future.cancelled()
