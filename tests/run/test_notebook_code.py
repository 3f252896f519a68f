"""The notebooks' code is what a learner runs on a GPU: ``torch.cuda`` itself, and graphborrow's root names.

A notebook imports nothing from a graphborrow submodule (``from graphborrow import ...`` of names
in ``graphborrow.__all__`` only) and calls no method of a device object for what ``torch.cuda``
does: the object :func:`graphborrow.use_device` returns is asked only to describe itself.
"""

import ast
import re
from pathlib import Path

import nbformat
import pytest

import graphborrow

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))

# torch.cuda's functions and classes (and a device object's versions of them): called on anything
# but torch.cuda / torch.cuda.memory, they are the library's device API standing in for PyTorch's
TORCH_CUDA = {"mem_get_info", "memory_snapshot", "memory_reserved", "memory_allocated", "memory_stats",
              "max_memory_allocated", "reset_peak_memory_stats", "empty_cache", "graph_pool_handle",
              "use_mem_pool", "current_stream", "default_stream", "Stream", "Event", "CUDAGraph", "MemPool", "graph",
              "sleep", "_sleep", "record_memory_history", "_record_memory_history", "dump_snapshot",
              "_dump_snapshot", "set_per_process_memory_fraction", "OutOfMemoryError", "CUDAPluggableAllocator"}
# a device object's own names for what a tensor or torch.cuda does
DEVICE_ONLY = {"arena_pool", "pool_id", "current_stream_key", "full_snapshot", "set_current_stream", "activated"}
TORCH_MODULES = {"torch.cuda", "torch.cuda.memory", "torch"}
DEVICE_USES = {"describe", "simulated"}


def code_of(path: Path) -> ast.Module:
    nb = nbformat.read(path, as_version=4)
    lines = [line for c in nb.cells if c.cell_type == "code" for line in c.source.splitlines()
             if not line.lstrip().startswith(("%", "!"))]
    return ast.parse("\n".join(lines))


def dotted(node) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def problems(tree: ast.Module) -> list[str]:
    found = []
    devices = {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)
               and dotted(n.value.func) == "use_device" for t in n.targets if isinstance(t, ast.Name)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if a.name.startswith("graphborrow")]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("graphborrow"):
            if node.module != "graphborrow":
                found.append(f"from {node.module} import ...: import graphborrow's root names only")
            found += [f"{a.name} is not in graphborrow.__all__" for a in node.names if a.name not in graphborrow.__all__]
        elif isinstance(node, ast.Name) and node.id in ("backend", "get_backend", "SimBackend"):
            found.append(f"{node.id}: use torch.cuda (and graphborrow.use_device), not a backend object")
        elif isinstance(node, ast.Attribute):
            owner = dotted(node.value)
            if owner in devices and node.attr not in DEVICE_USES:
                found.append(f"{owner}.{node.attr}: the device use_device returns only describes itself")
            if node.attr in TORCH_CUDA and owner and owner not in TORCH_MODULES:
                found.append(f"{owner}.{node.attr}: call torch.cuda.{node.attr.lstrip('_')} itself")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in DEVICE_ONLY:
                found.append(f"{dotted(node.func) or node.func.attr}(): a device object's method; use torch.cuda")
            if node.func.attr == "data_ptr" and node.args:
                found.append(f"{dotted(node.func)}(tensor): use tensor.data_ptr()")
            if node.func.attr == "record_stream" and len(node.args) > 1:
                found.append(f"{dotted(node.func)}(tensor, stream): use tensor.record_stream(stream)")
    return found


def test_the_check_catches_the_old_ways():
    old = ast.parse("from graphborrow.core.sizes import MB\nfrom graphborrow import nothing_like_this\n"
                    "pool = backend.arena_pool(arena)\nx = backend.data_ptr(t)\nbackend.record_stream(t, s)\n"
                    "free = cuda.mem_get_info()\nd = use_device('auto')\nd.synchronize()\n")
    found = problems(old)
    for needle in ("from graphborrow.core.sizes", "nothing_like_this", "arena_pool", "use tensor.data_ptr()",
                   "tensor.record_stream(stream)", "cuda.mem_get_info", "d.synchronize"):
        assert any(needle in f for f in found), (needle, found)
    plain = ast.parse("from graphborrow import memory_map\nd = use_device('auto')\nprint(d.describe())\n"
                      "with state.borrow('x'):\n    t = torch.empty(4, device='cuda')\n"
                      "free = torch.cuda.mem_get_info()\nt.record_stream(s)\nx = t.data_ptr()\n"
                      "torch.cuda.memory._record_memory_history()\ns = torch.cuda.Stream()\n")
    assert problems(plain) == []


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_a_notebook_speaks_pytorch_and_graphborrows_root_names(path):
    found = problems(code_of(path))
    assert not found, f"{path.name}: " + "; ".join(found)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_the_device_line_comes_first(path):
    """One line at the start puts torch.cuda onto the device (the simulated one without a GPU)."""
    nb = nbformat.read(path, as_version=4)
    first = next(c for c in nb.cells if c.cell_type == "code" and "parameters" not in c.metadata.get("tags", []))
    assert re.search(r"^\w+ = use_device\(DEVICE", first.source, re.M), (
        f"{path.name}: its first code cell calls use_device(DEVICE, ...) before any device code")


def test_save_results_reads_the_work_of_the_device_torch_cuda_is(tmp_path):
    """A notebook saves with save_results(name, data, OUTPUT_DIR): the device work it records is
    torch.cuda's own allocation counter (here the simulated device use_device installed)."""
    import json
    import subprocess
    import sys

    script = ("import torch\nfrom graphborrow import save_results, use_device\nuse_device('sim')\n"
              "x = [torch.empty(1024, device='cuda') for _ in range(3)]\n"
              f"save_results('00_x', {{'a': 1}}, {str(tmp_path)!r})\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads((tmp_path / "00_x.json").read_text())
    assert record["device_work"] >= 3 and record["results"] == {"a": 1} and record["backend"] == "sim"
