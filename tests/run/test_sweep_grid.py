"""Sweep parameters and grids: every bad input is refused with a message naming it."""

import argparse

import pytest

from graphborrow.core.errors import ParameterError
from graphborrow.run.sweep import Grid, argument_type, declared_parameters, validate
from graphborrow.run.sweep.parameters import read_notebook
from graphborrow.studies.shipped import example_grid, find_notebook


def test_validate_rejects_out_of_range_unknown_and_undeclared():
    assert validate({"batch_size": 8, "fit_policy": "best"}) == {"BATCH_SIZE": 8, "FIT_POLICY": "best"}
    with pytest.raises(ParameterError, match=r"BATCH_SIZE=5000 is out of range; allowed: 1 to 256"):
        validate({"batch_size": 5000})
    with pytest.raises(ParameterError, match="choose one of"):
        validate({"fit_policy": "worst"})
    with pytest.raises(ParameterError, match="LADDER entry 0"):
        validate({"ladder": [8, 0]})
    with pytest.raises(ParameterError, match="must be an integer"):
        validate({"draft_tokens": 2.5})
    with pytest.raises(ParameterError, match="unknown parameter 'bogus'"):
        validate({"bogus": 1})
    with pytest.raises(ParameterError, match="not declared in the notebook"):
        validate({"vocab": 64}, known={"BATCH_SIZE"})
    with pytest.raises(ParameterError, match="given twice"):
        validate({"vocab": 64, "VOCAB": 128})


def test_choice_tells_booleans_from_numbers():
    assert validate({"layout_only": True}) == {"LAYOUT_ONLY": True}
    with pytest.raises(ParameterError, match="LAYOUT_ONLY=1 is not allowed"):
        validate({"layout_only": 1})
    with pytest.raises(ParameterError, match="DEVICE=True is not allowed"):
        validate({"device": True})


def test_argument_type_states_the_rule_once():
    batch = argument_type("BATCH_SIZE")
    assert batch("16") == 16
    with pytest.raises(argparse.ArgumentTypeError, match=r"BATCH_SIZE=-3 is out of range; allowed: 1 to 256"):
        batch("-3")
    with pytest.raises(argparse.ArgumentTypeError, match="'x' is not a whole number"):
        batch("x")


def write(tmp_path, text, name="grid.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_grid_from_yaml_and_cli(tmp_path):
    grid = Grid.from_yaml(write(tmp_path, "name: g\nparameters:\n  device: sim\n  ladder: [8, 4, 2]\n"
                                          "grid:\n  batch_size: [1, 2]\n  draft_tokens: [4, 8]\n"))
    assert grid.name == "g"
    assert grid.fixed == {"DEVICE": "sim", "LADDER": [8, 4, 2]}
    assert grid.axes == {"BATCH_SIZE": [1, 2], "DRAFT_TOKENS": [4, 8]}
    assert len(grid.points()) == 4
    grid.add_cli([("draft_tokens", "16"), ("ladder", "[4,2],[2,1]")])
    points = grid.points()
    assert len(points) == 4 and all(p["DRAFT_TOKENS"] == 16 for p in points)
    assert {tuple(p["LADDER"]) for p in points} == {(4, 2), (2, 1)}


def test_plain_grid_file_list_valued_parameter_is_one_value(tmp_path):
    grid = Grid.from_yaml(write(tmp_path, "LADDER: [8, 4]\nVOCAB: [64, 128]\nnotebook: '01'\n"))
    assert grid.fixed == {"LADDER": [8, 4]} and grid.axes == {"VOCAB": [64, 128]}
    assert grid.notebook == "01"


@pytest.mark.parametrize("text, message", [
    ("grid: [1, 2\n", "is not valid YAML"),
    ("", "is empty"),
    ("- 1\n- 2\n", "must be a mapping of parameter -> values, got a list"),
    ("grid:\n  vocab: [64]\nparameter:\n  device: sim\n", r"unknown key\(s\) 'parameter'"),
    ("grid: [1, 2]\n", "'grid' must be a mapping"),
    ("parameters: 3\ngrid: {vocab: [64]}\n", "'parameters' must be a mapping"),
    ("grid:\n  vocab: []\n", "axis VOCAB has no values"),
    ("grid:\n  bogus: [1, 2]\n", "unknown parameter 'bogus'"),
    ("VOCAB: 64\nvocab: [1, 2]\n", "VOCAB is given twice"),
    ("name: ../elsewhere\nVOCAB: 64\n", "must be one folder name"),
    ("name: [a]\nVOCAB: 64\n", "'name' must be non-empty text"),
    ("3: 4\n", "parameter names are text"),
    ("notebook: 06\nVOCAB: 64\n", "YAML read 06 as the number 6; quote it: notebook: \"06\""),
    ("name: 0755\nVOCAB: 64\n", "YAML read 0755 as the number 493; quote it: name: \"0755\""),
])
def test_bad_grid_files_name_the_problem(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(ParameterError, match=message) as info:
        Grid.from_yaml(path)
    if "given twice" not in message and "parameter names" not in message:
        assert str(path) in str(info.value), "the message names the file"


def test_missing_grid_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Grid.from_yaml(tmp_path / "nope.yaml")


def test_cli_values_refuse_empty_and_unknown():
    grid = Grid()
    with pytest.raises(ParameterError, match="no values"):
        grid.add_cli([("batch_size", " , ")])
    with pytest.raises(ParameterError, match="unknown parameter 'batchsize'"):
        grid.add_cli([("batchsize", "1,2")])
    with pytest.raises(ParameterError, match=r"SEED is already given \('1'\); give it once, .*\(-p seed 1,2\)"):
        grid.add_cli([("SEED", "1"), ("seed", "2")])  # the second had replaced the first, silently
    assert "SEED" not in grid.fixed and "SEED" not in grid.axes  # refused before anything is set


def test_duplicate_axis_values_are_refused():
    with pytest.raises(ParameterError, match="lists 2 twice"):
        Grid(axes={"BATCH_SIZE": [1, 2, 2]}).validated_points()


def test_example_grid_is_valid_for_its_notebook():
    grid = Grid.from_yaml(example_grid())
    notebook = find_notebook(grid.notebook)
    points = grid.validated_points(declared_parameters(read_notebook(notebook)))
    assert len(points) == 4 and all(p["DEVICE"] == "sim" for p in points)


def test_models_grid_is_valid_for_its_notebook():
    grid = Grid.from_yaml(example_grid().with_name("sweep_models.yaml"))
    points = grid.validated_points(declared_parameters(read_notebook(find_notebook(grid.notebook))))
    assert {p["MODEL"] for p in points} == {"synthetic", "mistral-7b", "qwen3-30b-a3b"} and len(points) == 6


def test_find_notebook_by_prefix_and_errors(tmp_path):
    assert find_notebook("06").name == "06_capacity_sweep.ipynb"
    assert find_notebook("01_free_runs.ipynb").name == "01_free_runs.ipynb"
    with pytest.raises(FileNotFoundError, match="no shipped notebook matches '99'"):
        find_notebook("99")
    with pytest.raises(FileNotFoundError, match="several shipped notebooks match '0'"):
        find_notebook("0")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        find_notebook(tmp_path / "missing.ipynb")
    bad = tmp_path / "bad.ipynb"
    bad.write_text("not json")
    with pytest.raises(ParameterError, match="is not a readable Jupyter notebook"):
        read_notebook(bad)


def test_local_cluster_workers_get_one_gpu_each():
    from graphborrow.run.sweep.cluster import gpu_for_worker

    assert [gpu_for_worker(i, None) for i in range(3)] == ["0", "1", "2"]
    assert [gpu_for_worker(i, "4, 6") for i in range(2)] == ["4", "6"]
    with pytest.raises(ParameterError, match="worker 2 has no GPU of its own"):
        gpu_for_worker(2, "4,6")


def test_more_local_workers_than_gpus_is_refused(monkeypatch):
    from graphborrow.run.sweep import cluster

    monkeypatch.setattr(cluster, "_visible_gpus", lambda: 1)
    with pytest.raises(ParameterError, match="--workers 2 but 1 GPU"):
        with cluster.dask_client(None, 2, gpu=True):
            pass
    monkeypatch.setattr(cluster, "_visible_gpus", lambda: 0)
    with pytest.raises(ParameterError, match="need a GPU, and torch sees none"):
        with cluster.dask_client(None, 1, gpu=True):
            pass


def test_model_names_are_the_workloads_a_notebook_can_build():
    from graphborrow.run.sweep.parameters import MODEL_NAMES
    from graphborrow.workloads.ladder import model_names

    assert MODEL_NAMES == model_names(), "MODEL's allowed values must be exactly the buildable workloads"


def test_snapshot_is_a_path_or_none_and_branching_fits_the_tree():
    from graphborrow.core.errors import ParameterError
    from graphborrow.run.sweep.parameters import validate
    from graphborrow.run.sweep.space import derive

    assert validate({"SNAPSHOT": None}) == {"SNAPSHOT": None}
    assert validate({"snapshot": "pool.pickle"}) == {"SNAPSHOT": "pool.pickle"}
    with pytest.raises(ParameterError, match="SNAPSHOT=''"):
        validate({"SNAPSHOT": ""})
    point = derive({"BRANCHING": 16, "DRAFT_TOKENS": 4}, {"BRANCHING", "DRAFT_TOKENS"})
    assert point["BRANCHING"] == 3, "four tree nodes hold at most three children under the root"
    assert derive({"BRANCHING": 16, "DRAFT_TOKENS": 1}, {"BRANCHING", "DRAFT_TOKENS"})["BRANCHING"] == 1
