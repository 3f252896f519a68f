"""Kernels forked from a warm kernel server: each run a new process, its namespace empty, its
random state its own, its folder and environment the run's; a kernel dies with its server."""

import json
import os
import signal
import threading
import time

import nbformat
import psutil
import pytest

from graphborrow.run import kernels
from graphborrow.run.sweep.execute import NotebookJob, count_images, execute

pytestmark = pytest.mark.slow

PROBE = """\
import json, os, random, sys
import matplotlib, numpy
import graphborrow.core.sizes  # graphborrow beyond its results files: this notebook gets a forked kernel
assert "LEFT_BEHIND" not in globals(), "a name from an earlier run"
LEFT_BEHIND = 1
info = {"pid": os.getpid(), "ppid": os.getppid(), "cwd": os.getcwd(), "path0": sys.path[0],
        "random": random.random(), "numpy": float(numpy.random.random()),
        "runtime": os.environ["JUPYTER_RUNTIME_DIR"], "parent_env": os.environ.get("JPY_PARENT_PID"),
        "backend": matplotlib.get_backend(), "count": get_ipython().execution_count,
        "names": sorted(n for n in globals() if not n.startswith("_") and n not in ("In", "Out"))}
os.makedirs(OUTPUT_DIR, exist_ok=True)
json.dump(info, open(os.path.join(OUTPUT_DIR, "probe.json"), "w"))
"""


def probe_notebook() -> bytes:
    nb = nbformat.v4.new_notebook()
    params = nbformat.v4.new_code_cell('OUTPUT_DIR = "results"')
    params.metadata["tags"] = ["parameters"]
    nb.cells = [params, nbformat.v4.new_code_cell(PROBE),
                nbformat.v4.new_code_cell("import matplotlib.pyplot as plt\nplt.plot([0, 1])\nplt.show()")]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nbformat.writes(nb).encode()


def run_probe(source: bytes) -> tuple[dict, object]:
    ran = execute(NotebookJob("probe.ipynb", source, {}, "probe", threads=1))
    assert ran.returncode == 0, ran.log[-3000:]
    return json.loads(ran.results["results/probe.json"]), ran


def test_each_run_gets_a_new_forked_kernel_with_an_empty_namespace(monkeypatch):
    monkeypatch.delenv(kernels.FORK_ENV, raising=False)
    source = probe_notebook()
    first, ran = run_probe(source)
    second, _ = run_probe(source)
    assert "forked" in ran.log.splitlines()[0], ran.log[:500]
    server = psutil.Process(first["ppid"])
    assert first["ppid"] == second["ppid"] and "graphborrow.run.kernel_server" in " ".join(server.cmdline())
    assert first["pid"] != second["pid"], "a new process per run"
    assert first["random"] != second["random"] and first["numpy"] != second["numpy"], "random state drawn anew"
    assert first["cwd"] != second["cwd"] and first["path0"] == first["cwd"] and first["runtime"] != second["runtime"]
    assert first["parent_env"] == str(os.getpid()), "JPY_PARENT_PID names the process that asked for the kernel"
    assert first["backend"] == "module://matplotlib_inline.backend_inline"
    assert count_images(ran.notebook) == 1, "the inline backend put the figure in the executed notebook"

    monkeypatch.setenv(kernels.FORK_ENV, "0")
    fresh, plain = run_probe(source)
    assert plain.log.splitlines()[0].endswith(": started (GRAPHBORROW_FORK_KERNELS=0)"), plain.log[:500]
    assert fresh["ppid"] == os.getpid(), "started from scratch by this process"
    same = ("names", "count", "backend", "parent_env")
    assert {k: fresh[k] for k in same} == {k: first[k] for k in same}, "a forked kernel is a fresh kernel"


def test_notebooks_that_import_neither_torch_nor_graphborrow_start_from_scratch():
    def notebook(code):
        nb = nbformat.v4.new_notebook()
        nb.cells = [nbformat.v4.new_code_cell(code)]
        return nbformat.writes(nb).encode()

    assert not kernels.wants_warm_kernel(notebook("%matplotlib inline\nimport matplotlib.pyplot as plt"))
    assert not kernels.wants_warm_kernel(notebook("from graphborrow.run import results"))
    assert kernels.wants_warm_kernel(notebook("import torch"))
    assert kernels.wants_warm_kernel(notebook("from graphborrow import BorrowState"))
    assert kernels.wants_warm_kernel(notebook("!echo hi\nfrom graphborrow.studies import notebook"))
    assert not kernels.wants_warm_kernel(b"not a notebook")


def test_a_kernel_dies_with_its_server_and_the_run_is_retried_on_a_new_one(monkeypatch, tmp_path):
    monkeypatch.delenv(kernels.FORK_ENV, raising=False)
    source = probe_notebook()
    first, _ = run_probe(source)
    server = psutil.Process(first["ppid"])
    marker = tmp_path / "stalled"
    nb = nbformat.reads(source.decode(), as_version=4)
    nb.cells[1].source += (f"\nimport time\nif not os.path.exists({str(marker)!r}):\n"
                           f"    open({str(marker)!r}, 'w').write(str(os.getpid()))\n    time.sleep(120)\n")
    stalled = nbformat.writes(nb).encode()
    box = {}
    job = NotebookJob("probe.ipynb", stalled, {}, "s", threads=1)
    thread = threading.Thread(target=lambda: box.update(ran=execute(job)), daemon=True)
    thread.start()
    deadline = time.time() + 60
    while time.time() < deadline and not marker.exists():
        time.sleep(0.2)
    kernel = psutil.Process(int(marker.read_text()))
    assert kernel.ppid() == server.pid
    server.send_signal(signal.SIGKILL)
    psutil.wait_procs([kernel], timeout=10)
    assert not kernel.is_running() or kernel.status() == psutil.STATUS_ZOMBIE, "the kernel died with its server"
    thread.join(timeout=120)
    ran = box["ran"]
    assert ran.returncode == 0 and "DeadKernelError" in ran.log, "the run was retried after its kernel died"
    again = json.loads(ran.results["results/probe.json"])
    assert again["ppid"] not in (server.pid, os.getpid()), "on a kernel forked by a new server"


def test_the_kernelspec_names_the_fork_provisioner_and_nbval_runs_on_it(tmp_path):
    """What `make test-nbval` does: a Jupyter client (nbval) given the kernelspec gets forked kernels."""
    import subprocess
    import sys

    folder = kernels.install_kernelspec(tmp_path / "prefix")
    spec = json.loads((folder / "kernel.json").read_text())
    assert spec["metadata"]["kernel_provisioner"]["provisioner_name"] == kernels.PROVISIONER_NAME
    assert spec["argv"][0] == sys.executable
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(
        "import os, psutil, graphborrow.core.sizes\n"
        "parent = ' '.join(psutil.Process(os.getppid()).cmdline())\n"
        "assert 'graphborrow.run.kernel_server' in parent, parent")]
    path = tmp_path / "forked.ipynb"
    nbformat.write(nb, path)
    env = {**os.environ, "JUPYTER_PATH": str(tmp_path / "prefix" / "share" / "jupyter")}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:python", "-p", "no:cacheprovider",
                           "--nbval", "--nbval-kernel-name", kernels.KERNELSPEC_NAME, str(path)],
                          env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
