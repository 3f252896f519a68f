"""The documentation site: every page and notebook is in the navigation, and the build stages
only executed notebooks that show their figures."""

import re
from pathlib import Path

import nbformat

from graphborrow.run.docs import stage_notebooks
from graphborrow.studies.shipped import numbered_notebooks

ROOT = Path(__file__).resolve().parents[2]


def test_the_navigation_holds_every_page_and_notebook():
    config = (ROOT / "mkdocs.yml").read_text()
    listed = set(re.findall(r":\s+(\S+\.(?:md|ipynb))\s*$", config, re.M))
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    notebooks = {f"notebooks/{p.name}" for p in numbered_notebooks()}
    assert pages | notebooks == listed, f"missing from mkdocs.yml: {sorted(pages | notebooks - listed)}; " \
                                        f"listed but absent: {sorted(listed - pages - notebooks)}"


def _executed(path: Path, image: bool) -> None:
    cell = nbformat.v4.new_code_cell("plots.memory_map(...)", metadata={"tags": ["figure"]})
    if image:
        cell.outputs = [nbformat.v4.new_output("display_data", {"image/png": "iVBOR", "text/plain": "<Figure>"})]
    nb = nbformat.v4.new_notebook()
    nb.cells = [cell]
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)


def test_staging_takes_suite_or_points_copies_and_refuses_missing_figures(tmp_path):
    names = [p.stem for p in numbered_notebooks()]
    executed = tmp_path / "executed"
    for k, name in enumerate(names):
        # a suite's layout for some, a points folder's for the others; the last has lost its figure
        path = executed / f"{name}.ipynb" if k % 2 else executed / name / "h200.ipynb"
        _executed(path, image=k != len(names) - 1)
    target = tmp_path / "docs" / "notebooks"
    target.mkdir(parents=True)
    (target / "stale.ipynb").write_text("{}")
    problems = stage_notebooks(executed, target)
    assert len(problems) == 1 and names[-1] in problems[0] and "produced no image" in problems[0]
    assert sorted(p.stem for p in target.iterdir()) == names, "every notebook staged, the stale file gone"
    (executed / names[0] / "h200.ipynb").unlink()
    assert any("no executed copy" in p and names[0] in p for p in stage_notebooks(executed, target))
