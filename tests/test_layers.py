"""The package's layers import only downwards, and nothing imports in a circle.

The order is the architecture (README, "Layout"): ``core`` knows nothing of the others; the
allocator model sits on it; the simulated device on the model; the real device and the choice
between the two above both; then the planner, EAGLE, the workloads, the fidelity checks, the
studies the notebooks show, and what runs them. A module may import its own layer and any
layer below it. Function-level imports count: a lazy import is still an edge.
"""

import importlib

import grimp

import graphborrow

LAYERS = ["core", "allocator", "sim", "device", "planning", "eagle", "workloads", "fidelity", "studies", "run"]


def _graph():
    return grimp.build_graph("graphborrow", cache_dir=None)


def upward_imports(graph, layers=LAYERS) -> list[str]:
    """Every import from a layer to one above it, as "importer -> imported"."""
    rank = {name: i for i, name in enumerate(layers)}
    found = []
    for module in sorted(graph.modules):
        here = module.split(".")[1] if module.count(".") else None
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            there = imported.split(".")[1] if imported.count(".") else None
            if here in rank and there in rank and rank[there] > rank[here]:
                found.append(f"{module} -> {imported}")
    return found


def test_every_subpackage_is_a_named_layer():
    graph = _graph()
    top = {m.split(".")[1] for m in graph.modules if m.count(".") >= 1}
    assert top - {"__main__"} == set(LAYERS)


def test_layers_import_only_downwards():
    assert upward_imports(_graph()) == []


def test_the_root_names_are_loaded_lazily_and_resolve():
    assert graphborrow.__all__ == sorted(graphborrow._EXPORTS)
    for name in graphborrow.__all__:
        module, _, attribute = graphborrow._EXPORTS[name].partition(":")  # "module:name" where it differs
        value = getattr(graphborrow, name)
        assert value is getattr(importlib.import_module(module), attribute or name)
        assert getattr(value, "__name__", attribute or name) == (attribute or name)


def test_the_check_finds_an_upward_import(tmp_path, monkeypatch):
    package = tmp_path / "layered"
    (package / "low").mkdir(parents=True)
    (package / "high").mkdir()
    for folder in (package, package / "low", package / "high"):
        (folder / "__init__.py").write_text("")
    (package / "high" / "user.py").write_text("from ..low import base\n")
    (package / "low" / "base.py").write_text("def f():\n    from ..high import user\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    graph = grimp.build_graph("layered", cache_dir=None)
    assert upward_imports(graph, ["low", "high"]) == ["layered.low.base -> layered.high.user"]


# Where the package imports by name at run time, and why: the root's lazy exports (checked above
# against the modules that define them), the compiled allocator model's extension files, and the
# notebook kernel server's warm-up of the modules notebooks import, before it forks kernels.
IMPORTS_BY_NAME = {"graphborrow/__init__.py", "graphborrow/allocator/compiled.py", "graphborrow/run/kernel_server.py"}


def imports_by_name(root) -> list[str]:
    """Every ``importlib.import_module``, ``__import__`` or ``spec_from_file_location`` call, as "file:line"."""
    import ast
    from pathlib import Path

    found = []
    for path in sorted(Path(root).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
                if name in ("import_module", "__import__", "spec_from_file_location"):
                    found.append(f"{path.relative_to(Path(root).parent).as_posix()}:{node.lineno}")
    return found


def test_no_module_imports_another_by_a_string():
    from pathlib import Path

    found = imports_by_name(Path(graphborrow.__file__).parent)
    assert {place.split(":")[0] for place in found} <= IMPORTS_BY_NAME, found


def test_the_check_finds_an_import_by_a_string(tmp_path):
    package = tmp_path / "graphborrow"
    package.mkdir()
    (package / "verify.py").write_text("import importlib\n\ndef f():\n    return importlib.import_module('graphborrow.x')\n")
    (package / "other.py").write_text("def g():\n    return __import__('graphborrow.y')\n")
    assert imports_by_name(package) == ["graphborrow/other.py:2", "graphborrow/verify.py:4"]
