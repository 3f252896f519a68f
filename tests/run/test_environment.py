"""Every environment variable the package reads is listed, checked, and refused before work starts."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest
from sweep_notebooks import executions, tiny_notebook

from graphborrow.allocator.config import AllocatorConfig
from graphborrow.core import native, variables
from graphborrow.core.errors import ParameterError
from graphborrow.core.variables import RULES
from graphborrow.run.environment import VARIABLES, check_environment, max_point_bytes
from graphborrow.run.sweep import Grid, run_sweep
from graphborrow.sim import SimBackend

PACKAGE = Path(__file__).resolve().parents[2] / "graphborrow"


def names_read(path: Path) -> set[str]:
    """Environment variable names a module reads: literals and module constants passed to
    os.environ.get / setdefault / [...] / os.getenv."""
    tree = ast.parse(path.read_text())
    module = None
    found = set()
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            # os.environ.get(...), (os.environ if e is None else e).get(...), os.getenv(...),
            # variables.read(...) (graphborrow.core.variables: the value checked by its rule)
            receiver = node.func.value
            reads_environ = node.func.attr in ("get", "setdefault", "pop") and any(
                isinstance(n, ast.Attribute) and n.attr == "environ" for n in ast.walk(receiver))
            checked = node.func.attr == "read" and isinstance(receiver, ast.Name) and receiver.id == "variables"
            if reads_environ or checked or node.func.attr == "getenv":
                key = node.args[0]
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "environ":
            key = node.slice
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            found.add(key.value)
        elif isinstance(key, ast.Name):
            if module is None:
                relative = path.relative_to(PACKAGE.parent).with_suffix("")
                module = importlib.import_module(".".join(relative.parts))
            found.add(getattr(module, key.id))
    return found


def test_every_variable_the_package_reads_is_in_the_table():
    read = set(RULES)  # graphborrow.core.variables reads the variable it is asked for, by its rule
    for path in PACKAGE.rglob("*.py"):
        if path != PACKAGE / "core" / "variables.py":
            read |= names_read(path)
    listed = {v.name for v in VARIABLES}
    assert read - listed == set(), "read but not listed (add to graphborrow/run/environment.py and the docs)"
    assert len(read) >= 8


def test_the_table_in_the_docs_lists_every_variable():
    page = (PACKAGE.parent / "docs" / "reliability.md").read_text()
    for variable in VARIABLES:
        assert f"`{variable.name}`" in page, variable.name


BAD = [
    ("DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT", "banana", "is not a positive time: write seconds (30)"),
    ("DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT", "0", "is not a positive time"),
    ("GRAPHBORROW_MAX_POINT_MB", "abc", "must be a positive number of MiB"),
    ("GRAPHBORROW_MAX_POINT_MB", "0", "must be a positive number of MiB"),
    ("GRAPHBORROW_MAX_POINT_MB", "-5", "must be a positive number of MiB"),
    ("GRAPHBORROW_MAX_POINT_MB", "nan", "must be a positive number of MiB"),
    ("GRAPHBORROW_MAX_POINT_MB", "inf", "must be a positive number of MiB"),
    ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:true", "takes True or False"),
    ("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:abc", "must be an integer"),
    ("PYTORCH_CUDA_ALLOC_CONF", "roundup_power2_divisions:3", "must be a power of two"),
    ("PYTORCH_CUDA_ALLOC_CONF", "expandable", "has no value"),
    ("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync", "is not modelled"),
    ("GRAPHBORROW_SIM_PURE", "false", "must be one of"),
    ("GRAPHBORROW_SIM_PURE", "yes", "must be one of"),
    ("TRITON_INTERPRET", "true", "must be one of"),
    ("GRAPHBORROW_CACHE_DIR", "relative/cache", "is a relative path"),
    ("XDG_CACHE_HOME", "cache", "is a relative path"),
    ("GRAPHBORROW_FORK_KERNELS", "no", "must be one of"),
    ("GRAPHBORROW_SEQUENCE_CACHE", "off", "must be one of"),
]
GOOD = [
    ("DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT", "120s"), ("DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT", "30"),
    ("GRAPHBORROW_MAX_POINT_MB", "0.5"), ("GRAPHBORROW_MAX_POINT_MB", "128"),
    ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True,max_split_size_mb:64"), ("PYTORCH_CUDA_ALLOC_CONF", ""),
    ("GRAPHBORROW_SIM_PURE", "1"), ("GRAPHBORROW_SIM_PURE", "0"), ("GRAPHBORROW_SIM_PURE", ""),
    ("TRITON_INTERPRET", "1"), ("GRAPHBORROW_CACHE_DIR", "/tmp/graphborrow-cache"), ("GRAPHBORROW_CACHE_DIR", ""),
    ("CC", "cc"), ("CUDA_VISIBLE_DEVICES", "anything"), ("OMP_NUM_THREADS", "1"),
    ("GRAPHBORROW_FORK_KERNELS", "0"), ("GRAPHBORROW_SEQUENCE_CACHE", "0"),
]


@pytest.mark.parametrize("name, value, message", BAD)
def test_a_bad_value_is_refused_naming_the_variable(name, value, message):
    with pytest.raises(ParameterError) as refused:
        check_environment({"PATH": "/usr/bin:/bin", name: value})
    assert str(refused.value).startswith(f"{name}={value!r}") and message in str(refused.value)


@pytest.mark.parametrize("name, value", GOOD)
def test_a_good_value_passes(name, value):
    check_environment({"PATH": "/usr/bin:/bin", name: value})


def test_a_cache_folder_that_is_a_file_is_refused(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ParameterError, match="is a file, not a folder"):
        check_environment({"GRAPHBORROW_CACHE_DIR": str(blocker)})


def test_every_checked_variable_has_a_bad_case_here():
    checked = {v.name for v in VARIABLES if v.check is not None}
    assert checked == {name for name, _, _ in BAD}


def test_names_written_out_here_are_the_allocator_modules_own():
    """environment.py names two variables without importing the allocator (which loads torch)."""
    from graphborrow.allocator.compiled import PURE_ENV
    from graphborrow.allocator.config import ENVIRONMENT
    from graphborrow.planning.stored import STORE_ENV
    from graphborrow.run import environment

    assert (environment.PURE_ENV, environment.ALLOC_CONF, environment.STORE_ENV) == (PURE_ENV, ENVIRONMENT, STORE_ENV)


def test_a_sweep_worker_imports_no_torch():
    """What a Dask worker imports to run a point (it runs notebooks, never torch itself)."""
    import subprocess
    import sys

    code = "import sys, graphborrow.run.sweep.cluster; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_max_point_bytes_reads_mib():
    assert max_point_bytes({}) == 64 << 20
    assert max_point_bytes({"GRAPHBORROW_MAX_POINT_MB": "0.5"}) == 512 << 10


def test_a_sweep_with_a_bad_variable_runs_no_point(tmp_path, monkeypatch):
    """Issue 24, bad case 7: GRAPHBORROW_MAX_POINT_MB was read after each point had run, so a typo
    cost every point of the sweep; now it is refused before the first one."""
    nb = tiny_notebook(tmp_path / "tiny.ipynb", fail_at=None)
    monkeypatch.setenv("GRAPHBORROW_MAX_POINT_MB", "64MB")
    with pytest.raises(ParameterError, match="GRAPHBORROW_MAX_POINT_MB='64MB' must be a positive number"):
        run_sweep(nb, Grid(axes={"BATCH_SIZE": [1, 2]}), out=tmp_path / "out", progress=False)
    assert executions(nb) == [] and not (tmp_path / "out").exists()


def test_the_simulated_device_follows_pytorch_cuda_alloc_conf_as_torch_does(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True,max_split_size_mb:64")
    sim = SimBackend(capacity=1 << 30)
    try:
        config = sim.allocator.config
        assert config.expandable_segments and config.max_split_size == 64 << 20
    finally:
        sim.close()
    explicit = SimBackend(capacity=1 << 30, config={})  # an explicit config wins over the variable
    try:
        assert not explicit.allocator.config.expandable_segments
    finally:
        explicit.close()
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:yes")
    with pytest.raises(ValueError, match="PYTORCH_CUDA_ALLOC_CONF='expandable_segments:yes': expandable_segments"):
        SimBackend(capacity=1 << 30)
    assert AllocatorConfig.from_environment({}).expandable_segments is False


def test_the_library_readers_use_the_tables_rules():
    """One rule per variable: the reader deep in the library and the command line's check refuse a
    bad value with the same message, so a Python user meets the refusal the command line gives."""
    readers = set()
    for name, value, _ in BAD:
        if name not in RULES:
            continue
        with pytest.raises(ParameterError) as table:
            check_environment({name: value})
        with pytest.raises(ParameterError) as reader:
            variables.read(name, environ={name: value})
        assert str(reader.value) == str(table.value)
        readers.add(name)
    assert readers == set(RULES), "every variable with a rule in the library has a bad case above"


@pytest.mark.parametrize("name, value", [("GRAPHBORROW_CACHE_DIR", "relative/dir"), ("XDG_CACHE_HOME", "rel")])
def test_the_build_cache_refuses_a_relative_folder(name, value, monkeypatch):
    monkeypatch.delenv("GRAPHBORROW_CACHE_DIR", raising=False)
    monkeypatch.setenv(name, value)
    with pytest.raises(ParameterError, match=f"{name}='{value}' is a relative path"):
        native.cache_dir()


def test_the_sequence_store_and_the_kernel_fork_refuse_a_typo(monkeypatch):
    from graphborrow.planning.stored import store_enabled
    from graphborrow.run.kernels import fork_enabled

    monkeypatch.setenv("GRAPHBORROW_SEQUENCE_CACHE", "maybe")
    with pytest.raises(ParameterError, match="GRAPHBORROW_SEQUENCE_CACHE='maybe' must be one of"):
        store_enabled()
    monkeypatch.setenv("GRAPHBORROW_SEQUENCE_CACHE", "0")
    assert store_enabled() is False
    with pytest.raises(ParameterError, match="GRAPHBORROW_FORK_KERNELS='2' must be one of"):
        fork_enabled({"GRAPHBORROW_FORK_KERNELS": "2"})
    assert fork_enabled({"GRAPHBORROW_FORK_KERNELS": "0"}) is False and fork_enabled({}) is True


@pytest.mark.parametrize("name, value, message", [
    ("GRAPHBORROW_SIM_PURE", "yes", "GRAPHBORROW_SIM_PURE='yes' must be one of"),
    ("GRAPHBORROW_CACHE_DIR", "relative/dir", "GRAPHBORROW_CACHE_DIR='relative/dir' is a relative path"),
])
def test_python_use_of_the_simulated_device_refuses_a_bad_variable(name, value, message, tmp_path):
    """No command line in between: the library itself refuses, and makes no relative cache folder."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("GRAPHBORROW_SIM_PURE", "GRAPHBORROW_CACHE_DIR")}
    code = "from graphborrow import SimBackend; SimBackend(backed=False)"
    ran = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={**env, name: value},
                         capture_output=True, text=True, timeout=300)
    assert ran.returncode != 0 and message in ran.stderr
    assert list(tmp_path.iterdir()) == [], "nothing was created under the working folder"
