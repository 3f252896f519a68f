"""Modules of graphborrow talk to each other through public names only.

The rule, checked on the source with ``ast``: a module may use ``obj._name`` (one leading
underscore, not a dunder) only when ``_name`` is defined in that same module, or in no
module of the package at all (then it belongs to torch, the standard library or another
third party). "Defined" means bound as a function, class, variable, parameter or import
name, assigned or deleted as an attribute (``x._name = ...``), or listed in ``__slots__``.
Exempt are ``self._name`` and ``cls._name`` (a class's own state) and attribute chains that
start at a module imported from outside the package (``torch._C``, ``sys._getframe``).
Importing a private name from another module of the package (``from .m import _f``) fails too.
"""

import ast
import textwrap
from pathlib import Path

import graphborrow


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _defined_private_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.attr)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "__slots__" for t in targets) and node.value is not None:
                names.update(c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant) and isinstance(c.value, str))
    return {n for n in names if _is_private(n)}


def _outside_modules(tree: ast.Module, package: str) -> set[str]:
    """Names bound by ``import x`` / ``import x as y`` of modules outside ``package``."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] != package:
                    names.add(alias.asname or alias.name.split(".")[0])
    return names


def _root(node: ast.expr) -> ast.expr:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node


def private_crossings(package_dir: Path) -> list[str]:
    """``file:line: ._name (defined in other.py)`` for every use that breaks the rule above."""
    package = package_dir.name
    trees = {p: ast.parse(p.read_text(), str(p)) for p in sorted(package_dir.rglob("*.py"))}
    defined = {p: _defined_private_names(tree) for p, tree in trees.items()}
    found = []
    for path, tree in trees.items():
        outside = _outside_modules(tree, package)
        where = path.relative_to(package_dir.parent)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _is_private(node.attr) and node.attr not in defined[path]:
                root = _root(node.value)
                if isinstance(root, ast.Name) and (root.id in ("self", "cls") or root.id in outside):
                    continue
                owners = sorted(str(q.relative_to(package_dir.parent)) for q in trees if node.attr in defined[q])
                if owners:
                    found.append(f"{where}:{node.lineno}: .{node.attr} (defined in {', '.join(owners)})")
            elif isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] == package):
                found.extend(f"{where}:{node.lineno}: imports {a.name}" for a in node.names if _is_private(a.name))
    return sorted(found)


def test_no_module_uses_another_modules_private_names():
    assert private_crossings(Path(graphborrow.__file__).parent) == []


def test_the_rule_catches_private_attributes_and_imports_across_modules(tmp_path):
    package = tmp_path / "seampkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "device.py").write_text(textwrap.dedent("""
        import torch

        class Device:
            __slots__ = ("_lock",)

            def _new_storage(self, n):
                self._lock = None
                return torch._C, self._lock

        def _helper():
            return 1
    """))
    (package / "tensor.py").write_text(textwrap.dedent("""
        import sys
        from .device import _helper

        def make(device, n, other):
            frame = sys._getframe()
            mine = other._cdata               # defined nowhere in the package: a third party's
            return device._new_storage(n), device._lock, frame, mine
    """))
    (package / "own.py").write_text(textwrap.dedent("""
        class Thing:
            def _step(self):
                return 1

        def use(thing):
            return thing._step()              # defined in this module: fine
    """))
    assert private_crossings(package) == [
        "seampkg/tensor.py:3: imports _helper",
        "seampkg/tensor.py:8: ._lock (defined in seampkg/device.py)",
        "seampkg/tensor.py:8: ._new_storage (defined in seampkg/device.py)",
    ]
