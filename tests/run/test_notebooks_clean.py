"""The committed notebooks: stripped, one parameters cell with the shared knobs, python3 kernel."""

import json
import re
from pathlib import Path

import nbformat
import pytest
from conftest import load_script

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
strip_notebooks = load_script("scripts/strip_notebooks.py")


def test_the_suite_is_there():
    names = [p.stem[:2] for p in NOTEBOOKS]
    assert names == ["00", "01", "02", "03", "04", "05", "06", "07", "08", "09"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_stripped_and_parameterised(path):
    nb = nbformat.read(path, as_version=4)
    assert not strip_notebooks.strip(nb), f"{path.name} has outputs; run scripts/strip_notebooks.py"
    assert nb.metadata["kernelspec"]["name"] == "python3"
    tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1, f"{path.name} needs exactly one cell tagged 'parameters'"
    names = set(re.findall(r"^([A-Z_][A-Z0-9_]*)\s*=", tagged[0].source, re.M))
    assert {"DEVICE", "OUTPUT_DIR"} <= names
    assert re.search(r'^DEVICE = "auto"', tagged[0].source, re.M)
    source = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert "save_results(" in source, "every notebook saves its results for the guard"
    assert "assert " in source, "every claim is checked"
    assert "/work/" not in source


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_cell_has_an_id(path):
    """nbformat 4.5 cells carry ids: a cell without one makes every reader of the file warn
    (and nbformat means to refuse it)."""
    cells = json.loads(path.read_text())["cells"]
    missing = [i for i, c in enumerate(cells) if not c.get("id")]
    assert not missing, f"{path.name}: cells {missing} have no id (nbformat.validator.normalize adds them)"


def test_strip_removes_outputs_and_counts():
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("1 + 1")
    cell.outputs = [nbformat.v4.new_output("execute_result", {"text/plain": "2"}, execution_count=1)]
    cell.execution_count = 1
    nb.cells = [cell]
    assert strip_notebooks.strip(nb)
    assert nb.cells[0].outputs == [] and nb.cells[0].execution_count is None
    assert not strip_notebooks.strip(nb)


# Private names of the package (a module's _helper, an object's _attribute) never appear in a notebook;
# torch's own documented ones do (torch.cuda._sleep, torch.cuda.memory._record_memory_history, _dump_snapshot).
PRIVATE = re.compile(r"(?<![A-Za-z0-9_.])(?!torch\.cuda\.(?:memory\.)?_(?:sleep|record_memory_history|dump_snapshot)\b)"
                     r"(?:[a-z][a-z0-9_]*\.)*[a-z][a-z0-9_]*\._[a-z]")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_shows_figures_and_teaches(path):
    """Every notebook: goals, prerequisites, time, summary, exercises naming a parameter, next."""
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code" and "parameters" not in c.metadata.get("tags", [])]
    assert code[0].source.startswith("%matplotlib inline"), f"{path.name}: the first code cell must start with %matplotlib inline"
    text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    for needed in ("What you will learn", "What you need first", "**Time**: about", "## Summary", "## Exercises",
                   "https://"):
        assert needed in text, f"{path.name} lacks {needed!r}"
    assert text.index("What you will learn") < text.index("What you need first") < text.index("## Summary") \
        < text.index("## Exercises") < text.index("**Next**"), f"{path.name}: goals, prerequisites, summary, exercises, next"
    exercises = text.split("## Exercises", 1)[1].split("**Next**")[0]
    items = re.findall(r"^\d+\. .*`[A-Z_]+ = ", exercises, re.M)
    assert 2 <= len(items) <= 4, f"{path.name}: 2-4 exercises, each naming a parameter to change; found {len(items)}"
    nxt = re.search(r"\*\*Next\*\*:[^\n]*\[[^\]]+\]\((\d\d_[a-z_]+\.ipynb)\)", text)
    assert nxt and (path.parent / nxt.group(1)).exists(), f"{path.name}: link to the next notebook"
    params = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    assert re.search(r'^PRESET = "teaching"', params.source, re.M), f"{path.name}: a PRESET parameter, teaching by default"
    if "LAYOUT_ONLY" in params.source:
        assert re.search(r"^LAYOUT_ONLY = None", params.source, re.M), f"{path.name}: LAYOUT_ONLY automatic by default"
    source = "\n".join(c.source for c in code)
    assert not PRIVATE.findall(source), f"{path.name} calls private names: {PRIVATE.findall(source)}"
    last = nb.cells[-1]
    assert last.cell_type == "code" and "save_results(" in last.source
    assert not last.source.rstrip().splitlines()[-1].startswith(("save_results", "print(")), (
        f"{path.name}: the last cell ends with the results it shows, not a path")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_cells_stay_thin(path):
    """Heavy work lives in graphborrow.studies: no code cell longer than 40 lines."""
    nb = nbformat.read(path, as_version=4)
    for index, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            lines = len(cell.source.splitlines())
            assert lines <= 40, f"{path.name}: cell {index} has {lines} lines; move its work into graphborrow.studies"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_papermill_reads_every_parameter(path):
    """papermill's own parser (``--help-notebook``, ``inspect_notebook``) reads every line of the
    parameters cell, PRESET first: a comment it cannot parse hides the parameter from sweeps."""
    import papermill  # the sweep extra, which `make run` installs
    nb = nbformat.read(path, as_version=4)
    cell = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    names = re.findall(r"^([A-Z_][A-Z0-9_]*)\s*=", cell.source, re.M)
    found = papermill.inspect_notebook(str(path))
    assert list(found) == names, f"{path.name}: papermill reads {list(found)}, the cell assigns {names}"
    assert found["PRESET"]["default"] == '"teaching"'
