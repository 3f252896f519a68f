"""Every cross-reference resolves: each ``graphborrow.…`` name the package's source (docstrings,
error messages, comments), a doc page, the README or a notebook mentions names something that
exists, and so does every Sphinx role (``:mod:``, ``:func:``, ``:class:``, ``:meth:``,
``:data:``, ``:attr:``, ``:exc:``) in a docstring, relative names resolved against their module.

The oracle is Python's own import system: a name resolves when importing its longest module
prefix and reading the rest as attributes succeeds.
"""

from __future__ import annotations

import ast
import importlib
import json
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "graphborrow"
DOTTED = re.compile(r"(?<![\w./-])graphborrow(?:\.[A-Za-z_]\w*)+")
ROLE = re.compile(r":(?:py:)?(mod|func|class|meth|data|attr|exc|obj):`~?([^`<>\s]+)`")


@cache
def resolves(name: str) -> bool:
    """Whether ``name`` (dotted, absolute) is a module or an attribute path below one."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attribute in parts[cut:]:
                value = getattr(value, attribute)
        except AttributeError:
            return False
        return True
    return False


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def role_candidates(target: str, module: str, is_package: bool) -> list[str]:
    """The absolute names a docstring role's target may mean inside ``module``: a relative
    ``.name`` inside the module itself, then beside it (each further dot one package up); a
    bare name in the module; an absolute one as it is."""
    target = target.rstrip("()")
    if target.startswith("."):
        stripped = target.lstrip(".")
        ups = len(target) - len(stripped)
        package = module if is_package else module.rpartition(".")[0]
        for _ in range(ups - 1):
            package = package.rpartition(".")[0]
        return [f"{module}.{stripped}", f"{package}.{stripped}"]
    if "." not in target:
        return [f"{module}.{target}"]
    return [target]


def docstrings(tree: ast.Module):
    """(docstring, enclosing class name or None) of the module and of every class and function."""
    yield ast.get_docstring(tree, clean=False), None

    def visit(node, cls):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                yield ast.get_docstring(child, clean=False), child.name if cls is None else f"{cls}.{child.name}"
                yield from visit(child, child.name if cls is None else f"{cls}.{child.name}")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield ast.get_docstring(child, clean=False), cls
                yield from visit(child, cls)

    yield from visit(tree, None)


def source_references() -> list[tuple[str, str]]:
    """(where, names) of every dotted name and docstring role in the package's source; a
    role's names are the candidates it may mean, joined by ``|``."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        module = module_name(path)
        where = str(path.relative_to(ROOT))
        found += [(where, match) for match in DOTTED.findall(text)]
        for doc, cls in docstrings(ast.parse(text)):
            for _, target in ROLE.findall(doc or ""):
                if target.startswith("graphborrow") or target.startswith(".") or "." not in target:
                    candidates = role_candidates(target, module, path.name == "__init__.py")
                    if cls is not None and not target.startswith("graphborrow"):
                        candidates.insert(0, f"{module}.{cls}.{target.lstrip('.')}")
                    found.append((f"{where} ({target})", "|".join(candidates)))
    return found


def page_references() -> list[tuple[str, str]]:
    """(where, name) of every dotted name on the doc pages, the README and the notebooks."""
    found = []
    for path in sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")]):
        found += [(str(path.relative_to(ROOT)), m) for m in DOTTED.findall(path.read_text())]
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            text = "".join(cell["source"])
            found += [(str(path.relative_to(ROOT)), m) for m in DOTTED.findall(text)]
    return found


def unresolved(references) -> list[str]:
    return sorted({f"{where}: {name.split('|')[-1]}" for where, name in references
                   if not any(resolves(candidate.rstrip(".")) for candidate in name.split("|"))})


def test_every_name_the_package_mentions_resolves():
    assert unresolved(source_references()) == []


def test_every_name_the_pages_and_notebooks_mention_resolves():
    assert unresolved(page_references()) == []


@pytest.mark.parametrize("target, module, package, expected", [
    (".fused", "graphborrow.eagle.verify", False, ["graphborrow.eagle.verify.fused", "graphborrow.eagle.fused"]),
    (".tree_sampling", "graphborrow.eagle", True, ["graphborrow.eagle.tree_sampling", "graphborrow.eagle.tree_sampling"]),
    ("..probs", "graphborrow.eagle.triton.fused", False,
     ["graphborrow.eagle.triton.fused.probs", "graphborrow.eagle.probs"]),
    ("VerifyStep", "graphborrow.eagle.step", False, ["graphborrow.eagle.step.VerifyStep"]),
    ("graphborrow.eagle.eagle_verify()", "graphborrow.x", False, ["graphborrow.eagle.eagle_verify"]),
])
def test_relative_roles_resolve_against_their_module(target, module, package, expected):
    assert role_candidates(target, module, package) == expected


def test_the_check_finds_a_name_that_points_nowhere():
    """A name whose module exists but not its attribute, one whose module does not exist, and
    a relative role to a module that moved, are each reported; their resolving twins are not."""
    references = [("a", "graphborrow.eagle.plan.plan_verify"), ("b", "graphborrow.planning.capacity.plan_verify"),
                  ("c", "graphborrow.eagle.no_such_module.thing"),
                  ("d", "|".join(role_candidates(".fused", "graphborrow.eagle.verify", False))),
                  ("e", "|".join(role_candidates(".modes", "graphborrow.eagle.verify", False)))]
    assert unresolved(references) == ["b: graphborrow.planning.capacity.plan_verify",
                                      "c: graphborrow.eagle.no_such_module.thing", "d: graphborrow.eagle.fused"]
    assert DOTTED.findall("see graphborrow.eagle.graphs.clear_verify_graphs(), then graphborrow.eagle.") == [
        "graphborrow.eagle.graphs.clear_verify_graphs", "graphborrow.eagle"]
