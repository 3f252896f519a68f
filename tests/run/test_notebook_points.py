"""The points a notebook must hold at, the figure check, and the harness that runs them.

The harness itself (``python -m graphborrow points``) runs in ``make test``; here it
runs on a tiny notebook that fails on purpose, so the report is shown to name the notebook,
the point and the failed assert's message.
"""

import json
import random
import re
from pathlib import Path

import nbformat
import pytest

from graphborrow.core.errors import ParameterError
from graphborrow.run import points as harness
from graphborrow.run.results import check_figures
from graphborrow.run.sweep.parameters import PARAMETERS, validate
from graphborrow.run.sweep.space import (
    BACKED_LIMIT_BYTES,
    H200,
    REAL_VOCABS,
    corner,
    derive,
    footprint_bytes,
    notebook_points,
    random_point,
)
from tests.sweep_notebooks import executions, tiny_notebook

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))

SHAPES = {"HIDDEN", "INTERMEDIATE", "LAYERS", "VOCAB", "PREFILL_TOKENS", "LADDER", "DRAFT_TOKENS", "LAYOUT_ONLY"}


def test_ranges_hold_the_h200_shapes_and_real_vocabularies():
    validate(H200)
    for vocab in REAL_VOCABS:
        PARAMETERS["VOCAB"].check("VOCAB", vocab)
    for d in range(8, 17):
        PARAMETERS["DRAFT_TOKENS"].check("DRAFT_TOKENS", d)
    assert H200["LADDER"] == [64, 32, 16, 8, 4, 2, 1] and H200["VOCAB"] == 128256
    with pytest.raises(ParameterError, match="VOCAB=262145 is out of range"):
        validate({"VOCAB": 262145})


def test_corners_are_the_range_ends():
    low, high = corner(SHAPES, "low"), corner(SHAPES, "high")
    assert low["VOCAB"] == PARAMETERS["VOCAB"].lo and high["VOCAB"] == PARAMETERS["VOCAB"].hi
    assert low["LADDER"] == [1]
    assert high["LADDER"][0] == PARAMETERS["LADDER"].hi and high["LADDER"][-1] == 1
    assert all(a == 2 * b for a, b in zip(high["LADDER"], high["LADDER"][1:])), "a serving ladder halves"
    assert low["LAYOUT_ONLY"] is True and high["LAYOUT_ONLY"] is None, "the high end is the automatic choice"
    validate(low), validate(high)
    with pytest.raises(ValueError, match="'low' or 'high'"):
        corner(SHAPES, "middle")


def test_derive_makes_a_valid_combination():
    declared = SHAPES | {"BATCH_SIZE", "BRANCHING", "TOP_K"}
    p = derive({"LADDER": [4, 2, 1], "BATCH_SIZE": 200, "DRAFT_TOKENS": 3, "BRANCHING": 16, "TOP_K": 5000,
                "VOCAB": 1000, "LAYOUT_ONLY": False}, declared)
    assert p["BATCH_SIZE"] == 4 and p["BRANCHING"] == 2 and p["TOP_K"] == 1000
    assert p["LAYOUT_ONLY"] is False, "a small point keeps real bytes"
    shapes = {k: v for k, v in H200.items() if k in SHAPES}
    big = derive({**shapes, "LAYOUT_ONLY": False}, SHAPES)
    assert footprint_bytes(big, {}) > BACKED_LIMIT_BYTES and big["LAYOUT_ONLY"] is True
    no_switch = derive({k: v for k, v in shapes.items() if k != "LAYOUT_ONLY"}, SHAPES - {"LAYOUT_ONLY"})
    assert "LAYOUT_ONLY" not in no_switch, "a notebook without the switch is not given one"


def test_random_points_are_seeded_valid_and_meet_real_vocabularies():
    a = [random_point(SHAPES, random.Random(3)) for _ in range(1)]
    b = [random_point(SHAPES, random.Random(3)) for _ in range(1)]
    assert a == b
    rng = random.Random(0)
    points = [random_point(SHAPES, rng) for _ in range(60)]
    for p in points:
        validate(p)
    assert any(p["VOCAB"] in REAL_VOCABS for p in points)
    assert len({p["VOCAB"] for p in points}) > 10, "sizes are spread, not one value"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_notebook_gets_defaults_corners_h200_and_random_points(path):
    points = notebook_points(path, samples=2, seed=0)
    labels = [p.label for p in points]
    assert labels[:3] == ["defaults", "low", "high"] and labels[-2:] == ["random-0", "random-1"]
    for p in points:
        assert "DEVICE" not in p.params and "OUTPUT_DIR" not in p.params
    again = notebook_points(path, samples=2, seed=0)
    assert [p.params for p in points] == [p.params for p in again], "points are reproducible"


def _executed(cells):
    nb = nbformat.v4.new_notebook()
    nb.cells = cells
    return json.loads(nbformat.writes(nb))


def test_check_figures_wants_an_image_in_each_tagged_cell():
    shown = nbformat.v4.new_code_cell("plot()", metadata={"tags": ["figure"]})
    shown.outputs = [nbformat.v4.new_output("display_data", {"image/png": "iVBOR", "text/plain": "<Figure size 9x2>"})]
    missing = nbformat.v4.new_code_cell("plot()", metadata={"tags": ["figure"]})
    as_text = nbformat.v4.new_code_cell("fig")
    as_text.outputs = [nbformat.v4.new_output("execute_result", {"text/plain": "<Figure size 900x240 with 1 Axes>"},
                                              execution_count=1)]
    assert check_figures(_executed([shown])) == []
    problems = check_figures(_executed([shown, missing, as_text]), "nb")
    assert len(problems) == 2
    assert "cell 1 is tagged 'figure' but produced no image" in problems[0]
    assert "cell 2 shows a figure as text" in problems[1] and "%matplotlib inline" in problems[1]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_plotting_cells_are_tagged(path):
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        draws = re.search(r"\b(?:memory_map|bar_chart|capacity_map|stream_timeline|largest_borrowable_plot|sweep_plot|"
                          r"fit_grid_figure|plot_mode_costs)\(|ui\.figure", cell.source)
        if cell.cell_type == "code" and draws:
            assert "figure" in cell.metadata.get("tags", []), f"{path.name}: a plotting cell is not tagged 'figure'"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_the_h200_point_is_the_preset(path):
    """Every notebook declares PRESET; its H200 point sets that and nothing else (the notebook then
    picks layout-only by itself)."""
    h200 = next(p for p in notebook_points(path, samples=0) if p.label == "h200")
    assert h200.params == {"PRESET": "h200"}


@pytest.mark.slow
def test_harness_reports_the_failing_point_with_its_message(tmp_path, capsys):
    folder = tmp_path / "nbs"
    folder.mkdir()
    top = PARAMETERS["BATCH_SIZE"].hi
    path = tiny_notebook(folder / "00_tiny.ipynb", fail_at=top)
    nb = nbformat.read(path, as_version=4)
    nb.cells[3].metadata["tags"] = ["figure"]  # the pyplot cell: its image must come back
    nb.cells[4].source = nb.cells[4].source.replace("results.save('tiny'", "results.save('00_tiny'")
    nbformat.write(nb, path)
    code = harness.main(["--notebooks", str(folder), "--samples", "0", "--out", str(tmp_path / "out"),
                         "--jobs", "2", "--no-h200"])
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    by_label = {r["label"]: r for r in report["records"]}
    assert code == 1 and report["failed"] == 1, out
    assert by_label["defaults"]["ok"] and by_label["low"]["ok"], out
    high = by_label["high"]
    assert high["params"]["BATCH_SIZE"] == top and not high["ok"]
    assert f"batch size {top} is broken on purpose" in high["problems"][0]
    assert f"FAIL 00_tiny [high]" in out and "broken on purpose" in out
    executed = json.loads((tmp_path / "out" / "00_tiny" / "defaults.ipynb").read_text())
    assert check_figures(executed) == [], "the executed notebook keeps its figure as an image"


def test_an_unknown_label_is_refused_before_anything_runs(tmp_path, capsys):
    """A typo among good labels would quietly check less, and alone nothing, and still pass:
    exit 2 naming it and the labels there are, with nothing run and no report."""
    folder = tmp_path / "nbs"
    folder.mkdir()
    nb = tiny_notebook(folder / "00_tiny.ipynb")
    for labels in (["hihg"], ["low", "hihg"]):
        code = harness.main(["--notebooks", str(folder), "--labels", *labels, "--out", str(tmp_path / "out")])
        assert code == 2
        assert ("--labels hihg: no point of these 1 notebooks has that name; their points are defaults low high "
                "h200 random-0") in capsys.readouterr().err
    assert executions(nb) == [] and not (tmp_path / "out").exists()


def test_a_run_whose_labels_match_no_point_fails_and_checks_nothing(tmp_path, capsys):
    """Zero points checked is no pass: exit 2 naming the filter, and no report claiming 0 of 0 passed."""
    folder = tmp_path / "nbs"
    folder.mkdir()
    nb = tiny_notebook(folder / "00_tiny.ipynb")
    code = harness.main(["--notebooks", str(folder), "--labels", "defaults", "--skip-defaults",
                         "--out", str(tmp_path / "out")])
    assert code == 2
    assert "no point of 1 notebooks matched --labels defaults with --skip-defaults" in capsys.readouterr().err
    assert executions(nb) == [] and not (tmp_path / "out" / "report.json").exists()


@pytest.mark.parametrize("option, value, message", [
    ("--timeout", "0", "must be a positive number of seconds"),
    ("--timeout", "-5", "must be a positive number of seconds"),
    ("--timeout", "nan", "must be a positive number of seconds"),
    ("--timeout", "soon", "is not a number of seconds"),
    ("--memory-gb", "-1", "must be a number of GiB, 0 or more"),
    ("--memory-gb", "inf", "must be a number of GiB, 0 or more"),
    ("--memory-gb", "nan", "must be a number of GiB, 0 or more"),
])
def test_a_limit_out_of_range_is_refused_as_sweep_and_suite_refuse_it(option, value, message, tmp_path, capsys):
    folder = tmp_path / "nbs"
    folder.mkdir()
    nb = tiny_notebook(folder / "00_tiny.ipynb")
    with pytest.raises(SystemExit) as refused:
        harness.main(["--notebooks", str(folder), option, value, "--out", str(tmp_path / "out")])
    assert refused.value.code == 2 and message in capsys.readouterr().err
    assert executions(nb) == [] and not (tmp_path / "out").exists()


def test_cell_seconds_of_a_notebook_without_durations_are_undefined():
    ran = {"cells": [{"metadata": {"papermill": {"duration": 1.26}}}, {"metadata": {"papermill": {"duration": 2.0}}},
                     {"metadata": {}}]}
    assert harness.cell_seconds(json.dumps(ran).encode()) == (3.3, 2.0)  # a cell that did not run counts not
    assert harness.cell_seconds(json.dumps({"cells": [{"metadata": {}}]}).encode()) == (None, None)
    assert harness.cell_seconds(b"") == (None, None)
    assert harness.cell_seconds(b"{not json") == (None, None)


def test_free_runs_notebook_reads_a_snapshot_from_the_h200(tmp_path):
    """Notebook 01 with SNAPSHOT: the H200's recorded ladder pool, its runs and what fits it."""
    snapshot = ROOT / "data" / "h200_ladder_segments.pickle"
    record = harness.run_point(ROOT / "notebooks" / "01_free_runs.ipynb", "snapshot",
                               {"SNAPSHOT": str(snapshot), "VOCAB": 128256, "DRAFT_TOKENS": 8,
                                "LADDER": [64, 32, 16, 8, 4, 2, 1]}, tmp_path, timeout=300)
    assert record["ok"], record["problems"]
    executed = json.loads((tmp_path / "01_free_runs" / "snapshot.ipynb").read_text())
    text = "".join("".join(o.get("text", "")) + "".join(o.get("data", {}).get("text/markdown", ""))
                   for c in executed["cells"] for o in c.get("outputs", []))  # printed and rendered prose
    pool = json.loads((ROOT / "data" / "core_h200.json").read_text())["pool"]
    assert f"**{pool['runs']} free runs, {pool['run_bytes'] / 2**20:.2f} MiB**" in text, (
        "the notebook's runs of the recorded pool must be the ones the H200 benchmark found")
    # the capacity planner on the recorded pool: standard fits up to batch 32 at 8 draft tokens (as on the H200)
    assert "largest batch that fits at 8 draft tokens: standard 32," in text


def test_a_point_larger_than_one_device_is_shrunk_to_fit_it():
    from graphborrow.run.sweep.space import DEVICE_BYTES

    names = SHAPES | {"BATCH_SIZE"}
    top = corner(names, "high")
    assert footprint_bytes(top, {}) > DEVICE_BYTES, "the high corner of the ranges is larger than one device"
    p = derive(top, names)
    assert footprint_bytes(p, {}) <= DEVICE_BYTES // 2, "the derived point fits one device with room to spare"
    assert p["BATCH_SIZE"] <= max(p["LADDER"]) and p["LADDER"] == sorted(p["LADDER"], reverse=True)
    small = derive(corner(names, "low"), names)
    assert small == derive(small, names), "a point that fits is left as it is"
