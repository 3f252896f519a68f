"""The installed package: a wheel, installed outside the checkout, runs notebooks and a sweep.

The wheel is built from a copy of the checkout and installed (without dependencies) into a
fresh virtual environment that borrows the project environment's packages (torch,
papermill, Dask ...) through a path file; graphborrow itself comes only from the wheel,
and every command runs from a folder outside the checkout.
"""

import json
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from graphborrow.studies.shipped import (
    data_dir,
    example_grid,
    notebooks_dir,
    numbered_notebooks,
)

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
NOT_SOURCES = shutil.ignore_patterns(".venv", ".git", "build", "dist", "*.egg-info", "__pycache__", "output",
                                     "results", ".pytest_cache", ".hypothesis", ".whl", ".gl", "test-artifacts",
                                     "*.so", ".ipynb_checkpoints")


def test_package_data_is_found_through_the_package():
    assert [p.stem for p in numbered_notebooks()][:2] == ["00_overview", "01_free_runs"]
    assert example_grid().is_file() and example_grid().parent == notebooks_dir()
    assert (data_dir() / "core_h200.json").is_file()


def sh(*args, cwd, **kwargs):
    proc = subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=600, **kwargs)
    assert proc.returncode == 0, f"{args} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(python of a fresh environment holding only the wheel's graphborrow, a folder to work in)."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "source"
    shutil.copytree(ROOT, source, ignore=NOT_SOURCES)
    sh(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp / "dist", ".",
       cwd=source)
    wheel = next((tmp / "dist").glob("graphborrow-*.whl"))
    env_dir = tmp / "fresh"
    sh(sys.executable, "-m", "venv", "--without-pip", env_dir, cwd=tmp)
    python = env_dir / "bin" / "python"
    site = Path(sh(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=tmp).stdout.strip())
    (site / "project_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # torch, papermill, dask ...
    sh(python, "-m", "pip", "install", "--no-deps", "--no-index", "-q", wheel, cwd=tmp)
    work = tmp / "elsewhere"
    work.mkdir()
    return python, work, wheel, env_dir


def test_wheel_holds_the_notebooks_the_grid_and_the_data(installed):
    _, _, wheel, _ = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"graphborrow/notebooks/{p.name}" for p in numbered_notebooks()} <= names
    assert "graphborrow/notebooks/sweep_example.yaml" in names
    assert "graphborrow/data/core_h200.json" in names and "graphborrow/data/traces/graph_ladder.pickle" in names
    assert not any("/results/" in n for n in names), "no local run output is packaged"


def test_installed_package_runs_a_notebook_and_a_sweep_from_any_folder(installed):
    python, work, _, env_dir = installed
    where = sh(python, "-c", "import graphborrow, graphborrow.studies.shipped as d; print(graphborrow.__file__);"
               "print(d.notebooks_dir())", cwd=work).stdout.split()
    assert all(Path(p).is_relative_to(env_dir) for p in where), f"graphborrow must come from the wheel: {where}"

    suite = sh(python, "-m", "graphborrow", "suite", "--only", "00", "--device", "sim", "--out", "suite",
               cwd=work)
    assert "1 of 1 notebooks passed" in suite.stdout, suite.stdout
    for name in ("00_overview",):
        record = json.loads((work / "suite" / "results" / f"{name}.json").read_text())
        assert record["device_work"] > 0
    executed = json.loads((work / "suite" / "00_overview.ipynb").read_text())
    assert Path(executed["metadata"]["papermill"]["parameters"]["DATA_DIR"]).is_relative_to(env_dir), \
        "the notebook read the data shipped in the wheel"

    grid = sh(python, "-c", "from graphborrow.studies.shipped import example_grid; print(example_grid())",
              cwd=work).stdout.strip()
    sweep = sh(python, "-m", "graphborrow", "sweep", "--grid", grid, "-p", "VOCAB", "2048", "-p", "MODE", "standard",
               "--quiet", cwd=work)
    assert sweep.stdout.startswith("1 point: 1 ran, 0 already done, 0 failed"), sweep.stdout
    rows = (work / "output" / "capacity-example" / "results.csv").read_text().splitlines()
    assert len(rows) == 2 and ",ok," in rows[1]
