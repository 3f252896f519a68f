"""The package keeps the shape its redesign gave it: few top-level entries, short modules and
functions. A module past the limit is split by concept (as eagle/triton/fused.py and
step_kernel.py were), not trimmed line by line."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "graphborrow"
MAX_TOP_LEVEL = 14
MAX_MODULE_LINES = 900
MAX_FUNCTION_LINES = 120


def modules():
    return sorted(PACKAGE.rglob("*.py"))


def test_the_top_level_has_few_entries():
    entries = [p.name for p in PACKAGE.iterdir() if p.name != "__pycache__" and not p.name.endswith((".so", ".c"))]
    assert len(entries) <= MAX_TOP_LEVEL, sorted(entries)


def test_no_module_is_longer_than_the_limit():
    lengths = {str(p.relative_to(PACKAGE)): len(p.read_text().splitlines()) for p in modules()}
    long = {name: n for name, n in lengths.items() if n > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_no_function_is_longer_than_the_limit():
    long = []
    for path in modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"
