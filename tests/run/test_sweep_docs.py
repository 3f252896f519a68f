"""Every documented sweep runs as written: each example's notebook, grid and values pass the
checks a sweep makes before it runs anything (so a notebook that drops a parameter fails here,
not in a reader's terminal)."""

from __future__ import annotations

import ast
import re
import shlex
from pathlib import Path

import pytest

from graphborrow.__main__ import _sweep_grid, build_parser
from graphborrow.core.errors import ParameterError
from graphborrow.run.sweep import Grid, check_sweep

ROOT = Path(__file__).resolve().parents[2]
# Grid files the examples name as the reader's own: the example grid stands in for them.
PLACEHOLDER_GRIDS = {"big.yaml", "grid.yaml"}


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "graphborrow/run/sweep/__init__.py",
            *sorted((ROOT / "notebooks").glob("sweep_*.yaml"))]


def command_lines() -> list[tuple[str, list[str]]]:
    """(where, the arguments after ``sweep``) of every ``python -m graphborrow sweep`` line."""
    found = []
    for path in documents():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if "graphborrow sweep " in line and "`" not in line:
                rest = re.sub(r"\s+\(.*\)\s*$", "", line.split("graphborrow sweep ", 1)[1])  # "(make run runs it)"
                found.append((f"{path.relative_to(ROOT)}:{number}", shlex.split(rest, comments=True)))
    return found


def python_calls() -> list[tuple[str, ast.Call]]:
    """(where, the call) of every ``run_sweep(...)`` example."""
    found = []
    for path in documents():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            text = line.strip()
            if "run_sweep(" in text and not text.startswith(("def ", "from ", "import ")):
                call = ast.parse(text).body[0].value
                found.append((f"{path.relative_to(ROOT)}:{number}", call))
    return found


COMMANDS, CALLS = command_lines(), python_calls()


def test_the_documents_hold_the_examples_this_file_checks():
    where = [w for w, _ in COMMANDS] + [w for w, _ in CALLS]
    assert sum(w.startswith("docs/sweeps.md") for w in where) >= 5, where
    assert sum(w.startswith("graphborrow/run/sweep/__init__.py") for w in where) >= 4, where


@pytest.mark.parametrize("where, words", COMMANDS, ids=[where for where, _ in COMMANDS])
def test_each_documented_command_line_passes_the_sweeps_checks(where, words, monkeypatch):
    monkeypatch.chdir(ROOT)  # the examples name notebooks/... from the checkout
    words = ["notebooks/sweep_example.yaml" if w in PLACEHOLDER_GRIDS else w for w in words]
    args = build_parser().parse_args(["sweep", *words])
    notebook, grid = _sweep_grid(args)
    points = check_sweep(notebook, grid, name=args.name, scheduler=args.scheduler, timeout=args.timeout)
    assert points, where


@pytest.mark.parametrize("where, call", CALLS, ids=[where for where, _ in CALLS])
def test_each_documented_python_sweep_passes_the_sweeps_checks(where, call):
    values = [eval(compile(ast.Expression(a), where, "eval"), {"Grid": Grid}) for a in call.args]
    keywords = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
    checked = {k: v for k, v in keywords.items() if k in ("name", "scheduler", "timeout")}
    assert check_sweep(*values, **checked), where


def test_the_check_refuses_a_parameter_the_notebook_does_not_declare():
    """What the docs once showed: notebook 02 has no BATCH_SIZE, and the check says so."""
    with pytest.raises(ParameterError, match="BATCH_SIZE is not declared"):
        check_sweep("02_borrowing", Grid(axes={"BATCH_SIZE": [1, 8, 32]}))
