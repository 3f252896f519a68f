"""The public API is declared and documented: ``__all__`` everywhere, ``Args:``/``Returns:`` in the core.

Every public module (no path component starting with ``_``) says in ``__all__`` what a user
imports from it. In the core modules every public function and public method of an exported
class documents each of its parameters in an ``Args:`` section and, when it returns a value,
says what in ``Returns:`` (``Yields:`` for generators and context managers), in the manner of
``torch.cuda.memory``.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import re
import textwrap

import pytest

import graphborrow

CORE_MODULES = [
    "graphborrow.core.borrow",
    "graphborrow.core.arena",
    "graphborrow.core.runs",
    "graphborrow.core.snapshot",
    "graphborrow.device.cuda",
    "graphborrow.planning.capacity",
    "graphborrow.eagle.plan",
    "graphborrow.device.select",
    "graphborrow.eagle.verify",
    "graphborrow.eagle.scope",
    "graphborrow.eagle.draft_tree",
    "graphborrow.workloads.ladder",
    "graphborrow.fidelity.replay",
    "graphborrow.sim.device",
    # beyond the core: the rest of what the README and notebooks call
    "graphborrow.eagle.tree_sampling",
    "graphborrow.eagle.renorm",
    "graphborrow.eagle.sequence",
    "graphborrow.planning.planner",
    "graphborrow.run.sweep",
    "graphborrow.core.checks",
    "graphborrow.run.environment",
    "graphborrow.run.folders",
    "graphborrow.run.sweep.points",
]

SECTION = re.compile(r"^(Args|Arguments|Returns|Yields|Raises|Example|Examples|Note|Notes|Warning|See Also):\s*$")


def public_modules() -> list[str]:
    names = ["graphborrow"]
    for info in pkgutil.walk_packages(graphborrow.__path__, "graphborrow."):
        if not any(part.startswith("_") for part in info.name.split(".")):
            names.append(info.name)
    return sorted(names)


def sections(doc: str | None) -> dict[str, list[str]]:
    """The docstring's Google-style sections, each as its body lines (dedented)."""
    found: dict[str, list[str]] = {}
    current = None
    for line in inspect.cleandoc(doc or "").splitlines():
        header = SECTION.match(line)
        if header:
            current = found.setdefault(header.group(1), [])
        elif current is not None:
            if line and not line[0].isspace():  # back at the docstring's own indentation: section over
                current = None
            else:
                current.append(line)
    return {name: textwrap.dedent("\n".join(body)).splitlines() for name, body in found.items()}


def documented_parameters(doc: str | None) -> list[str]:
    """Parameter names an ``Args:`` section describes: lines ``name: ...`` or ``name (type): ...`` at its left edge."""
    names = []
    for line in sections(doc).get("Args", []):
        entry = re.match(r"^(\*{0,2}\w+)(?:\s*\([^)]*\))?\s*:", line)
        if entry:
            names.append(entry.group(1).lstrip("*"))
    return names


def parameters(func) -> list[str]:
    return [p.name for p in inspect.signature(func).parameters.values() if p.name not in ("self", "cls")]


def returns_value(func) -> bool:
    """True when the function hands back a value: by its annotation, else by a ``return <value>`` in its body."""
    annotation = inspect.signature(func).return_annotation
    if annotation is not inspect.Signature.empty:
        return annotation not in (None, "None", type(None))
    source = textwrap.dedent(inspect.getsource(func))
    tree = ast.parse(source).body[0]

    def value_returns(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                continue
            if isinstance(child, ast.Return) and child.value is not None:
                if not (isinstance(child.value, ast.Constant) and child.value.value is None):
                    return True
            if isinstance(child, (ast.Yield, ast.YieldFrom)) or value_returns(child):
                return True
        return False

    return value_returns(tree)


def api_functions(module_name: str):
    """(qualified name, function) for each public function and public method of each class in ``__all__``."""
    module = importlib.import_module(module_name)
    for name in module.__all__:
        obj = getattr(module, name)
        if inspect.isfunction(obj):
            yield f"{module_name}.{name}", obj
        elif inspect.isclass(obj):
            for attr, member in vars(obj).items():
                if attr.startswith("_"):
                    continue
                if isinstance(member, (staticmethod, classmethod)):
                    member = member.__func__
                if inspect.isfunction(member):
                    yield f"{module_name}.{name}.{attr}", member


def documentation_problems(qualname: str, func) -> list[str]:
    problems = []
    doc = inspect.getdoc(func)
    wanted = parameters(func)
    if wanted:
        if "Args" not in sections(doc):
            problems.append(f"{qualname}: no Args: section (parameters {wanted})")
        else:
            missing = [p for p in wanted if p not in documented_parameters(doc)]
            if missing:
                problems.append(f"{qualname}: Args: does not describe {missing}")
    if returns_value(func) and not {"Returns", "Yields"} & sections(doc).keys():
        problems.append(f"{qualname}: returns a value but has no Returns: section")
    return problems


@pytest.mark.parametrize("module_name", public_modules())
def test_public_module_declares_all(module_name):
    module = importlib.import_module(module_name)
    assert hasattr(module, "__all__"), f"{module_name} has no __all__: list what a user imports from it"
    exported = list(module.__all__)
    assert len(exported) == len(set(exported)), f"{module_name}.__all__ repeats a name"
    assert [n for n in exported if n.startswith("_")] == [], f"{module_name}.__all__ exports a private name"
    missing = [n for n in exported if not hasattr(module, n)]
    assert missing == [], f"{module_name}.__all__ names what it does not define: {missing}"


@pytest.mark.parametrize("module_name", CORE_MODULES)
def test_core_api_documents_arguments_and_returns(module_name):
    problems = [p for qualname, func in api_functions(module_name) for p in documentation_problems(qualname, func)]
    assert problems == [], "\n".join(problems)


def test_core_modules_export_functions_to_check():
    assert all(list(api_functions(m)) for m in CORE_MODULES)


def test_a_parameter_left_out_of_args_is_found():
    def place(tensor, stream, nbytes: int) -> int:
        """Place a tensor.

        Args:
            tensor: what to place.
            nbytes (int): how many bytes.

        Returns:
            The address.
        """

    assert documentation_problems("place", place) == ["place: Args: does not describe ['stream']"]


def test_a_value_without_returns_is_found_and_a_described_one_passes():
    def size(nbytes):
        """How big.

        Args:
            nbytes: bytes asked for.
                A continuation line naming stream: is not a parameter entry.
        """
        return nbytes

    assert documentation_problems("size", size) == ["size: returns a value but has no Returns: section"]
    size.__doc__ = "How big.\n\nArgs:\n    nbytes: bytes asked for.\n\nReturns:\n    The rounded size.\n"
    assert documentation_problems("size", size) == []


def test_args_section_ends_at_the_next_section():
    doc = """Summary.

    Args:
        a: first.

    Returns:
        b: not an argument.
    """
    assert documented_parameters(doc) == ["a"]
