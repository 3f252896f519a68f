"""The command line: bad arguments exit 2 with one line naming the problem, never a traceback."""

import subprocess
import sys

import pytest
import torch
from sweep_notebooks import executions, tiny_notebook

from graphborrow.__main__ import main


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "graphborrow", *args], capture_output=True, text=True,
                          timeout=300)


def test_demo_refuses_a_negative_batch():
    proc = run_cli("demo", "--batch", "-3")
    assert proc.returncode == 2
    assert "BATCH_SIZE=-3 is out of range; allowed: 1 to 256" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_run_refuses_an_unknown_device():
    proc = run_cli("run", "--device", "tpu")
    assert proc.returncode == 2
    assert "invalid choice: 'tpu'" in proc.stderr and "Traceback" not in proc.stderr


def exit_code(args, capsys):
    """main()'s status, argparse's own exits included, and what it printed to stderr."""
    try:
        code = main(args)
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


def test_cuda_without_a_gpu_is_refused_before_anything_runs(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, err = exit_code(["suite", "--device", "cuda", "--out", str(tmp_path / "s")], capsys)
    assert code == 2 and "torch sees no CUDA device here" in err
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("args, message", [
    (["sweep", "--workers", "0", "x"], "must be 1 or more"),
    (["sweep", "x", "--timeout", "-1"], "must be a positive number of seconds"),
    (["sweep", "--runs-dir", "r", "x"], "unrecognized arguments: --runs-dir"),
    (["sweep", "-p", "batch_size", "1"], "name a notebook"),
    (["sweep", "01", "--scheduler", "tcp://127.0.0.1:1", "--workers", "2"], "--workers sizes the local cluster"),
    (["sweep", "99", "-p", "batch_size", "1"], "no shipped notebook matches '99'"),
    (["suite", "--only", "99"], "--only 99 matches no notebook"),
    (["suite", "--only", "01", "-p", "VOCABB", "3"], "unknown parameter 'VOCABB'"),
    (["suite", "--only", "01", "-p", "TOP_P", "0.9"], "TOP_P: declared by none of the notebooks run"),
])
def test_bad_arguments_exit_2_with_the_reason(capsys, args, message):
    code, err = exit_code(args, capsys)
    assert code == 2 and message in err


@pytest.fixture
def tiny(tmp_path):
    return tiny_notebook(tmp_path / "tiny.ipynb")


def test_out_of_range_value_runs_nothing(tmp_path, tiny, capsys):
    code, err = exit_code(["sweep", str(tiny), "-p", "batch_size", "1,0", "--out", str(tmp_path / "out")], capsys)
    assert code == 2 and "BATCH_SIZE=0 is out of range; allowed: 1 to 256" in err
    assert not (tmp_path / "out").exists() and executions(tiny) == []


@pytest.mark.parametrize("grid_text, message", [
    ("grid:\n  batch_size: []\n", "axis BATCH_SIZE has no values"),
    ("grid: {batch_size: [1, 2}\n", "is not valid YAML"),
    ("- batch_size\n", "must be a mapping"),
])
def test_bad_grid_exits_2_and_leaves_the_old_table(tmp_path, tiny, capsys, grid_text, message):
    table = tmp_path / "out" / "tiny" / "results.csv"
    table.parent.mkdir(parents=True)
    table.write_text("point_id,status\nbatch_size=1,ok\n")
    grid = tmp_path / "grid.yaml"
    grid.write_text(grid_text)
    code, err = exit_code(["sweep", str(tiny), "--grid", str(grid), "--out", str(tmp_path / "out")], capsys)
    assert code == 2 and message in err
    assert table.read_text() == "point_id,status\nbatch_size=1,ok\n", "the existing table is untouched"
    assert executions(tiny) == []


def test_empty_cli_values_exit_2(tmp_path, tiny, capsys):
    code, err = exit_code(["sweep", str(tiny), "-p", "batch_size", "", "--out", str(tmp_path / "out")], capsys)
    assert code == 2 and "no values" in err


@pytest.fixture
def a_file(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    return blocker


@pytest.mark.parametrize("command", [
    ["suite", "--only", "01", "--device", "sim"],
    ["run", "--device", "sim"],
    ["inspect", "data/h200_ladder_segments.pickle"],
    ["sweep", "01", "-p", "vocab", "64"],
])
def test_an_output_folder_under_a_file_is_refused_before_anything_runs(capsys, a_file, command):
    code, err = exit_code([*command, "--out", str(a_file / "sub")], capsys)
    assert code == 2 and f"{a_file} is a file, not a folder; choose another one" in err
    assert "Traceback" not in err and capsys.readouterr().out == ""


@pytest.mark.parametrize("command", [["sweep", "01", "-p", "OUTPUT_DIR", "x"], ["suite", "--only", "01", "-p", "OUTPUT_DIR", "x"]])
def test_output_dir_is_the_runners_and_is_refused_as_a_parameter(capsys, tmp_path, command):
    code, err = exit_code([*command, "--out", str(tmp_path / "out")], capsys)
    assert code == 2 and "OUTPUT_DIR is set by the runner for each notebook" in err and "--out" in err


def test_a_bad_environment_variable_exits_2_before_any_work(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("GRAPHBORROW_SIM_PURE", "false")
    code, err = exit_code(["suite", "--only", "01", "--out", str(tmp_path / "s")], capsys)
    assert code == 2 and "GRAPHBORROW_SIM_PURE='false' must be one of" in err
    assert not (tmp_path / "s").exists()


def test_demo_refuses_a_batch_larger_than_it_captures_before_capturing():
    proc = run_cli("demo", "--device", "sim", "--batch", "256")
    assert proc.returncode == 2
    assert "--batch 256: the demo captures decode graphs for batches [16, 8, 4, 2, 1] on the sim device" in proc.stderr
    assert "capturing" not in proc.stdout and "Traceback" not in proc.stderr


def test_inspect_help_states_the_trust_model():
    proc = run_cli("inspect", "--help")
    text = " ".join(proc.stdout.split())
    assert proc.returncode == 0
    assert "Trust: snapshot and trace files are read without running code" in text
    assert "read without running code from the file" in text and ".json" in text


def test_ctrl_c_in_the_suite_says_which_notebooks_a_rerun_repeats(capsys, monkeypatch, tmp_path):
    """Issue 24: the suite used to say "run the same command again to finish the rest" and then run
    every notebook again. Ctrl-C arrives while the first notebook runs (papermill is where it lands)."""
    import graphborrow.run.suite as suite

    def interrupted(job, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(suite, "execute", interrupted)
    out = tmp_path / "s"
    code, err = exit_code(["suite", "--only", "01", "02", "--device", "sim", "--out", str(out)], capsys)
    assert code == 130
    assert "0 notebook(s) finished" in err and "running the same command again runs every notebook again" in err
    assert f"--only 01 02 --out {out}" in err


@pytest.mark.parametrize("args, message", [
    (["--batches", "1000000000", "--draft-tokens", "8"], "more than any GPU holds"),
    (["--vocab", str(2**40)], "more than any GPU holds"),
])
def test_inspect_refuses_steps_no_device_holds_before_reading_the_file(capsys, tmp_path, args, message):
    missing = tmp_path / "not-read.pickle"  # the arguments are checked before the file is opened
    code, err = exit_code(["inspect", str(missing), "--out", str(tmp_path / "out"), *args], capsys)
    assert code == 2 and message in err and "Traceback" not in err


def test_inspect_refuses_an_output_file_name_taken_by_a_folder_before_reading_the_snapshot(capsys, tmp_path):
    """The report printed, then savefig's IsADirectoryError, and the fit table was never written."""
    (tmp_path / "h200_ladder_segments_memory_map.png").mkdir()
    code, err = exit_code(["inspect", "data/h200_ladder_segments.pickle", "--out", str(tmp_path)], capsys)
    assert code == 2 and "h200_ladder_segments_memory_map.png is a folder, where inspect writes a file" in err
    assert "Traceback" not in err and capsys.readouterr().out == ""
