"""No import circle anywhere in graphborrow (function-level imports included)."""

import textwrap

import grimp


def import_cycles(package: str) -> list[list[str]]:
    """Every set of modules that import each other in a circle (Tarjan's strongly connected components)."""
    graph = grimp.build_graph(package, cache_dir=None)
    edges = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(m):
        index[m] = low[m] = len(index)
        stack.append(m)
        on_stack.add(m)
        for n in edges.get(m, ()):
            if n not in index:
                visit(n)
                low[m] = min(low[m], low[n])
            elif n in on_stack:
                low[m] = min(low[m], index[n])
        if low[m] == index[m]:
            component = []
            while True:
                n = stack.pop()
                on_stack.discard(n)
                component.append(n)
                if n == m:
                    break
            if len(component) > 1 or m in edges.get(m, ()):
                cycles.append(sorted(component))

    for m in sorted(edges):
        if m not in index:
            visit(m)
    return cycles


def test_graphborrow_has_no_import_circle():
    assert import_cycles("graphborrow") == []


def test_the_check_finds_a_circle_through_a_function_level_import(tmp_path, monkeypatch):
    package = tmp_path / "circlepkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "device.py").write_text("from .buffer import Buffer\n")
    (package / "buffer.py").write_text(textwrap.dedent("""
        class Buffer:
            def make(self):
                from .backend import get
                return get()
    """))
    (package / "backend.py").write_text("def get():\n    from .device import Buffer\n    return Buffer\n")
    (package / "leaf.py").write_text("from . import backend\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert import_cycles("circlepkg") == [["circlepkg.backend", "circlepkg.buffer", "circlepkg.device"]]
